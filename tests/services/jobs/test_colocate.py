"""Co-location end to end (issue 49): `zerokl up --colocate`, then an RL job through the services.

Before every step trains, the scheduler puts the fleet to sleep (each decode replica releases its KV cache
and its weights: sleep level 2) and the trainer keeps its AdamW state and fp32 masters in host memory between
steps (--offload-optimizer); the step's in-place weight switch wakes the replica with the new version from the
trainer's memory. KL == 0.0 and 0 mismatched tokens at every step; every sleep and wake is counted (the step
events' sleep_s / sleep_bytes, the replica's zerokl_engine_sleeps / wakes), and the fleet serves afterwards;
a step that fails after the fleet slept (its version fails the canary, or the trainer refuses its batch while
the job's start is still being recorded) leaves the fleet awake.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request

import pytest

from test_jobs import _record_process
from test_jobs_bf16 import _with_exploding_moments
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.vocab import Completion, SamplingOptions

pytestmark = pytest.mark.timeout(600)

TASK = CountdownTask(seed=0, train_problems=300, test_problems=8)


def _counter(metrics_address: str, name: str, labels: str = "", suffix: str = "_total") -> float:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name}{suffix}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_colocated_rl_job_sleeps_and_wakes_the_fleet_with_zero_kl(tmp_path, zerokl_up) -> None:  # noqa: ANN001
    steps = 3
    # --max-batch-tokens: 4 x 4 answers of 10 tokens past their prompts (over 500 tokens) are refused, 2 x 4 are not.
    with zerokl_up(tmp_path / "up", "--colocate", "--dtype", "bfloat16", "--trainer-flag=--lr=3e-3",
                   "--trainer-flag=--run=colocated", "--trainer-flag=--max-batch-tokens=400") as services:
        decode = services["decode-0"]["metrics"]
        before = {name: _counter(decode, name) for name in ("zerokl_engine_sleeps", "zerokl_engine_wakes")}
        shared_before = _counter(decode, "zerokl_replica_weight_switches", '{path="shared"}')
        address = services["scheduler"]["address"]

        async def main():
            async with JobsClient(address) as jobs:
                # vowel_share: a reward any policy earns unevenly, so every step moves the weights (a tiny model's
                # countdown rewards are all 0: zero advantages, the same weights every step, which hid a replica
                # that served an earlier adopted version's cached weights from its second wake on).
                spec = RLJobSpec(steps=steps, countdown=TASK, prompts_per_step=2, group_size=4, max_tokens=10,
                                 seed=3, eval_every=0, reward="vowel_share", ignore_eos=True)
                job = await jobs.submit(spec, "rl-colocated")
                events = [ev async for ev in jobs.watch(job.job_id)]
            async with InferenceClient(address) as inference:
                served = await inference.generate_all(InferenceRequest(
                    prompt_ids=(3, 4, 5, 6), options=SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)))
            return events, served

        events, served = asyncio.run(main())
        assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
        stepped = [ev for ev in events if ev.step is not None]
        assert [ev.step for ev in stepped] == list(range(1, steps + 1))
        for ev in stepped:
            m = ev.metrics
            assert m["kl"] == 0.0 and m["mismatched_tokens"] == 0.0, (ev.step, m)
            assert m["grad_norm"] > 0.0, (ev.step, m)           # the step moved the weights
            assert m["sleep_bytes"] > 0 and m["sleep_s"] >= 0.0, m
            assert 0.0 <= m["export_wait_s"] <= m["train_s"], m     # the backward's wait for records, reported
        # One sleep before each step trained and one before the job's start switch (so the replica's copy of the
        # start replaces its weights instead of sitting beside them), one wake by each of those switches (from the
        # trainer's memory).
        assert _counter(decode, "zerokl_engine_sleeps") - before["zerokl_engine_sleeps"] == steps + 1
        assert _counter(decode, "zerokl_engine_wakes") - before["zerokl_engine_wakes"] == steps + 1
        assert _counter(decode, "zerokl_replica_weight_switches", '{path="shared"}') - shared_before == steps + 1
        # Awake afterwards, on the job's last version.
        assert served.weights_version == stepped[-1].weights_version
        assert len(served.samples[0].token_ids) == 4
        assert _counter(decode, "zerokl_engine_sleep_level", suffix="") == 0.0

        # checkpoint_every 0, the setting of a model whose trainer state the disk cannot hold: the job records no
        # trainer state at all (its start, its steps, its last), every version it records is weights only, and
        # it runs as the others do: KL 0.0, and its last version durable and served.
        async def without_trainer_state():
            async with JobsClient(address) as jobs:
                job = await jobs.submit(RLJobSpec(steps=2, countdown=TASK, prompts_per_step=2, group_size=4,
                                                  max_tokens=10, seed=5, eval_every=0, reward="vowel_share",
                                                  ignore_eos=True, checkpoint_every=0), "no-trainer-state")
                return [ev async for ev in jobs.watch(job.job_id)]
        plain = asyncio.run(without_trainer_state())
        assert plain[-1].status.state is JobState.SUCCEEDED, plain[-1].status.error
        plain_steps = [ev for ev in plain if ev.step is not None]
        assert [ev.metrics["kl"] for ev in plain_steps] == [0.0, 0.0]
        assert all(ev.metrics["grad_norm"] > 0 for ev in plain_steps)
        assert [ev.metrics["checkpoint"] for ev in plain_steps] == [0.0, 0.0]
        manifests = tmp_path / "up" / "weights" / "manifests"
        recorded = [json.loads((manifests / f"{ev.weights_version}.json").read_text())
                    for ev in plain_steps if (manifests / f"{ev.weights_version}.json").exists()]
        assert recorded and recorded[-1]["version"] == plain_steps[-1].weights_version
        assert {m["metadata"]["zerokl.trainer_state"] for m in recorded} == {"none"}

        # A step that fails after the fleet slept while the job's start is still being recorded (the record process
        # stopped): the trainer refuses the step's batch (more tokens than its --max-batch-tokens). The replica's
        # weights were released, so it wakes by a switch to the start, from the store: the switch waits for the
        # start's record instead of failing NOT_FOUND and leaving the fleet asleep, and serves it once it landed.
        async def refused_while_recording():
            async with JobsClient(address) as jobs, TrainerClient(services["trainer"]["address"]) as trainer, \
                    WeightStoreClient(services["weight-store"]["address"]) as weights, \
                    InferenceClient(address) as inference:
                # A step by hand first, so the job starts on a version of its own, recorded in the background.
                await trainer.forward_backward("sft", [Completion((3, 4, 5, 6), (7, 8, 2))])
                await trainer.optim_step()
                recorder = _record_process(services["trainer"]["pid"])
                os.kill(recorder, signal.SIGSTOP)
                try:
                    job = await jobs.submit(RLJobSpec(steps=1, countdown=TASK, prompts_per_step=4, group_size=4,
                                                      max_tokens=10, seed=6, eval_every=0, ignore_eos=True,
                                                      checkpoint_every=0), "refused")
                    deadline = time.monotonic() + 60
                    while not ((status := next(s for s in await jobs.list() if s.job_id == job.job_id)).weights_version
                               and _counter(decode, "zerokl_engine_sleep_level", suffix="") == 2.0):
                        assert time.monotonic() < deadline, status     # started (its switch woke the fleet), then
                        await asyncio.sleep(0.05)                     # asleep for step 1
                    await asyncio.sleep(1.0)    # the step's batch is refused meanwhile; the job waits for the record
                    assert status.weights_version not in {e.manifest.version for e in await weights.list()}
                    assert next(s for s in await jobs.list() if s.job_id == job.job_id).state is JobState.RUNNING
                finally:
                    os.kill(recorder, signal.SIGCONT)
                final = [ev async for ev in jobs.watch(job.job_id)][-1].status
                served = await inference.generate_all(InferenceRequest(
                    prompt_ids=(3, 4, 5, 6), options=SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)),
                    timeout=60)
                return final, status.weights_version, served, {e.manifest.version for e in await weights.list()}

        refused, start, served, stored = asyncio.run(refused_while_recording())
        assert refused.state is JobState.FAILED and refused.error.startswith("INVALID_ARGUMENT"), refused
        assert "exceed this trainer's limit of 400" in refused.error, refused.error
        assert start in stored and served.weights_version == start and len(served.samples[0].token_ids) == 4
        assert _counter(decode, "zerokl_engine_sleep_level", suffix="") == 0.0

        # A step that fails after the fleet slept (its version fails the canary: AdamW moments of 1e20 loaded by
        # hand, as in test_jobs_bf16) leaves the fleet awake on the version the job started from.
        async def poisoned():
            async with JobsClient(address) as jobs, WeightStoreClient(services["weight-store"]["address"]) as weights, \
                    TrainerClient(services["trainer"]["address"]) as trainer:
                await trainer.load_weights(await _with_exploding_moments(weights, stepped[-1].weights_version,
                                                                         tmp_path), restore_state=True)
                job = await jobs.submit(RLJobSpec(steps=1, countdown=TASK, prompts_per_step=2, group_size=4,
                                                  max_tokens=10, seed=4, eval_every=0), "poison")
                final = [ev async for ev in jobs.watch(job.job_id)][-1].status
            async with InferenceClient(address) as inference:
                after = await inference.generate_all(InferenceRequest(
                    prompt_ids=(3, 4, 5, 6), options=SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)))
            return final, after

        final, after = asyncio.run(poisoned())
        assert final.state is JobState.FAILED and "failed its canary" in final.error, final
        assert after.weights_version == final.weights_version and len(after.samples[0].token_ids) == 4
        assert _counter(decode, "zerokl_engine_sleep_level", suffix="") == 0.0
        # Each job's steps, and one sleep for each job's start.
        assert _counter(decode, "zerokl_engine_sleeps") - before["zerokl_engine_sleeps"] == \
            (steps + 1) + (2 + 1) + (1 + 1) + (1 + 1)


def test_a_colocated_step_that_fails_while_its_wake_cannot_be_done_ends_with_its_own_error(tmp_path,  # noqa: ANN001
                                                                                            zerokl_up) -> None:
    """The H100 run of the GLM-5 slice: a co-located step failed, and its wake waited for the record of the job's
    start, which never came (the store's disk was full), so the job never ended and the step's error was seen
    nowhere. Here the record stays held (the record process stopped): the step's error is logged (WARNING, its type
    and message) before the wake, the wake waits for the record --store-wait seconds, not for ever, and the job ends
    FAILED with the step's own error, saying the fleet could not be woken and why."""
    store_wait = 3
    with zerokl_up(tmp_path / "up", "--colocate", "--dtype", "bfloat16", "--trainer-flag=--run=unwoken",
                   "--trainer-flag=--max-batch-tokens=400", f"--scheduler-flag=--store-wait={store_wait}") as services:
        decode = services["decode-0"]["metrics"]

        async def refused_while_held():
            async with JobsClient(services["scheduler"]["address"]) as jobs, \
                    TrainerClient(services["trainer"]["address"]) as trainer, \
                    WeightStoreClient(services["weight-store"]["address"]) as weights:
                # The record process up (it starts with the trainer's first record), then a step by hand, so the job
                # starts on a version of its own, recorded in the background.
                for share in (True, False):
                    await trainer.forward_backward("sft", [Completion((3, 4, 5, 6), (7, 8, 2))])
                    await trainer.optim_step()
                    if share:
                        shared, _, _ = await trainer.share_weights(weights_only=True)
                        await trainer.record_weights(shared.version)
                recorder = _record_process(services["trainer"]["pid"])
                os.kill(recorder, signal.SIGSTOP)
                try:
                    # 4 x 4 answers of 10 tokens past their prompts: more than the trainer's --max-batch-tokens.
                    job = await jobs.submit(RLJobSpec(steps=1, countdown=TASK, prompts_per_step=4, group_size=4,
                                                      max_tokens=10, seed=6, eval_every=0, ignore_eos=True,
                                                      checkpoint_every=0), "unwoken")
                    events = [ev async for ev in jobs.watch(job.job_id)]
                    stored = {e.manifest.version for e in await weights.list()}
                finally:
                    os.kill(recorder, signal.SIGCONT)
                return events[-1].status, stored

        final, stored = asyncio.run(refused_while_held())
        start = final.weights_version
        assert final.state is JobState.FAILED, final
        assert final.error.startswith("INVALID_ARGUMENT") and "exceed this trainer's limit of 400" in final.error, \
            final.error
        assert start not in stored      # the record the wake waited for never landed meanwhile
        assert f"the fleet could not be woken on {start} (RecordPending: the record of {start} did not end " \
               f"within the {store_wait:g} s waited for it (the scheduler's --store-wait" in final.error, final.error
        # The step's own error was logged before the wake was tried, and the wake's failure after it.
        log = (tmp_path / "up" / "logs" / "scheduler.log").read_text()
        said = log.index("the step failed with the fleet asleep: AioRpcError INVALID_ARGUMENT")
        assert " WARNING " in log[log.rindex("\n", 0, said):said], log[-3000:]
        assert said < log.index(f"the fleet could not be woken on {start} after a failed step"), log[-3000:]
        assert _counter(decode, "zerokl_engine_sleep_level", suffix="") == 2.0     # it stays asleep: said, not hidden
