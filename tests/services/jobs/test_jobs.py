"""The scheduler's Jobs API against the five real services (`zerokl up` on loopback).

SFT, DPO and RL jobs run on the trainer, publish weight-store versions and switch
the replicas at each step boundary; RL rollouts are generated through the
scheduler pinned to the version being updated, so the trainer's recomputed
logprobs equal the behaviour logprobs: KL == 0.0 and 0 mismatched tokens at every
step. Bad specs get clear statuses and the service keeps serving.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
import grpc.aio
import pytest
import torch

from zerokl.services.inference import InferenceClient
from zerokl.services.jobs.manager import validate
from zerokl.services.jobs.types import CountdownTask, DPOJobSpec, JobState, RLJobSpec, SFTJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.runtime import field_violations
from zerokl.services.trainer import convert
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.store_marks import META_STATE
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.sync import SHM_PREFIX
from zerokl.v1 import jobs_pb2, jobs_pb2_grpc, trainer_pb2
from zerokl.vocab import Completion

from test_jobs_bf16 import _shared_switches, _with_exploding_moments

pytestmark = pytest.mark.timeout(600)

TASK = CountdownTask(seed=0, train_problems=300, test_problems=8)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, zerokl_up):  # noqa: ANN001, ANN201
    """`zerokl up` (weight store, decode, trainer, scheduler); yields its services (name -> up.json entry)."""
    with zerokl_up(tmp_path_factory.mktemp("jobs-up"), "--trainer-flag=--lr=3e-3", "--trainer-flag=--run=jobs") as services:
        yield services


@pytest.fixture(scope="module")
def cluster(fleet) -> str:  # noqa: ANN001
    """The scheduler's address."""
    return fleet["scheduler"]["address"]


async def _events(client: JobsClient, job_id: str) -> list:
    return [ev async for ev in client.watch(job_id)]


def _steps(events: list) -> list:
    return [ev for ev in events if ev.step is not None]


def test_rl_job_has_exactly_zero_kl_and_switches_the_fleet_every_step(cluster: str) -> None:
    async def main() -> None:
        async with JobsClient(cluster) as jobs:
            # vowel_share: uneven rewards, so every step moves the weights the fleet then serves
            spec = RLJobSpec(steps=3, countdown=TASK, prompts_per_step=2, group_size=4, max_tokens=12, seed=1,
                             eval_every=3, eval_prompts=4, reward="vowel_share", ignore_eos=True)
            job = await jobs.submit(spec, "rl-test")
            assert job.state is JobState.QUEUED and job.total_steps == 3
            events = await _events(jobs, job.job_id)
            assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
            steps = _steps(events)
            assert [ev.step for ev in steps] == [1, 2, 3]
            for ev in steps:
                assert ev.metrics["kl"] == 0.0 and ev.metrics["mismatched_tokens"] == 0.0
                assert ev.metrics["tokens"] > 0 and ev.metrics["tokens_per_s"] > 0 and ev.metrics["grad_norm"] > 0
                # Where the step's time went: sampling, the update, the new version reaching the fleet.
                assert {"rollout_s", "train_s", "sync_s"} <= ev.metrics.keys()
            assert "test_accuracy" in steps[-1].metrics
            versions = [ev.weights_version for ev in steps]
            assert len(set(versions)) == 3  # one published version per step
            # The fleet serves the last one: an unpinned Generate through the scheduler runs on it.
            async with InferenceClient(cluster) as inference:
                assert (await inference.info()).weights_version == versions[-1]
            # A watcher that comes late replays every step.
            assert [ev.step for ev in _steps(await _events(jobs, job.job_id))] == [1, 2, 3]
    asyncio.run(main())


def test_sft_and_dpo_jobs_lower_their_losses(cluster: str) -> None:
    prompts = [(1, 5 + i, 7, 9) for i in range(8)]
    examples = tuple(Completion(p, (20, 21, 22, 2)) for p in prompts)
    pairs = tuple((Completion(p, (20, 21, 2)), Completion(p, (25, 26, 2))) for p in prompts)

    async def main() -> None:
        async with JobsClient(cluster) as jobs:
            sft = await jobs.submit(SFTJobSpec(steps=6, examples=examples, batch_size=4, publish_every=3), "sft")
            dpo = await jobs.submit(DPOJobSpec(steps=6, pairs=pairs, batch_size=4, learning_rate=2e-3),
                                    "dpo")  # queued behind sft
            dpo2 = await jobs.submit(DPOJobSpec(steps=1, pairs=pairs, batch_size=4), "dpo again")
            sft_events, dpo_events, dpo2_events = await asyncio.gather(
                _events(jobs, sft.job_id), _events(jobs, dpo.job_id), _events(jobs, dpo2.job_id))
            for events in (sft_events, dpo_events):
                assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
                losses = [ev.metrics["loss"] for ev in _steps(events)]
                assert len(losses) == 6 and losses[-1] < losses[0], losses
            sft_versions = [ev.weights_version for ev in _steps(sft_events)]
            # Published at 3 and 6 only: the other steps' events name no version.
            assert [bool(v) for v in sft_versions] == [False, False, True, False, False, True], sft_versions
            assert sft_versions[2] != sft_versions[5]
            assert "preference_accuracy" in _steps(dpo_events)[-1].metrics
            # the DPO job's own learning rate at every step; SFT's follows the trainer's schedule
            assert [ev.metrics["lr"] for ev in _steps(dpo_events)] == [2e-3] * 6
            assert 2e-3 not in [ev.metrics["lr"] for ev in _steps(sft_events)]
            # Each DPO job's reference is the weights it starts from, so its first loss is exactly
            # -log sigmoid(0) = log 2, also for a job after another DPO job has moved the weights.
            log2 = float(torch.tensor(math.log(2.0)))
            assert _steps(dpo_events)[0].metrics["loss"] == log2
            assert _steps(dpo2_events)[0].metrics["loss"] == log2, _steps(dpo2_events)[0].metrics
            listed = await jobs.list()
            assert [s.job_id for s in listed][-3:] == [sft.job_id, dpo.job_id, dpo2.job_id]
    asyncio.run(main())


def test_cancel_stops_a_running_job_at_a_step_boundary(cluster: str) -> None:
    async def main() -> None:
        async with JobsClient(cluster) as jobs:
            job = await jobs.submit(RLJobSpec(steps=50, countdown=TASK, prompts_per_step=2, group_size=2,
                                              max_tokens=8, eval_every=0), "long")
            async for ev in jobs.watch(job.job_id):
                if ev.step == 1:
                    cancelled = await jobs.cancel(job.job_id)
                    assert not cancelled.state.done or cancelled.state is JobState.CANCELLED
                last = ev
            assert last.status.state is JobState.CANCELLED and last.status.step < 50
            queued_then_cancelled = await jobs.submit(SFTJobSpec(steps=1, countdown=TASK, batch_size=2), "x")
            await jobs.cancel(queued_then_cancelled.job_id)
            ok = await jobs.submit(SFTJobSpec(steps=1, countdown=TASK, batch_size=2), "after")
            events = await _events(jobs, ok.job_id)
            assert events[-1].status.state is JobState.SUCCEEDED
    asyncio.run(main())


def test_bad_jobs_are_refused_clearly_and_the_scheduler_keeps_serving(cluster: str) -> None:
    bad = [
        (RLJobSpec(steps=0, countdown=TASK), "steps"),
        (RLJobSpec(steps=1, countdown=TASK, group_size=1), "group_size"),
        (RLJobSpec(steps=1, countdown=TASK, top_p=1.5), "top_p"),
        (SFTJobSpec(steps=1, examples=(Completion((1, 2), (3,)),), batch_size=4), "batch_size"),
        (DPOJobSpec(steps=1, pairs=()), "no preference pairs"),
        (RLJobSpec(steps=1, countdown=CountdownTask(train_problems=10**6)), "countdown"),
        (SFTJobSpec(steps=1, countdown=TASK, batch_size=2, learning_rate=-1e-4), "learning_rate"),
        (RLJobSpec(steps=1, countdown=TASK, learning_rate=float("nan")), "learning_rate"),
    ]

    async def main() -> None:
        async with JobsClient(cluster) as jobs:
            for spec, field in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await jobs.submit(spec)
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), \
                    err.value.details()
            stub = jobs_pb2_grpc.JobsStub(jobs.channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitJob(jobs_pb2.JobSpec(name="no kind"))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            for call in (jobs.cancel("nope"), _events(jobs, "nope")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() is grpc.StatusCode.NOT_FOUND
            ok = await jobs.submit(SFTJobSpec(steps=1, countdown=TASK, batch_size=2))
            assert (await _events(jobs, ok.job_id))[-1].status.state is JobState.SUCCEEDED
    asyncio.run(main())


def test_the_jobs_command_line(cluster: str) -> None:
    def zerokl(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zerokl", "jobs", "--server", cluster, *argv],
                              capture_output=True, text=True, timeout=300)

    def at_once(*argvs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
        """Independent command lines side by side (each its own process); their results in order."""
        with ThreadPoolExecutor(len(argvs)) as pool:
            return list(pool.map(lambda argv: zerokl(*argv), argvs))

    r, missing = at_once(("submit", "sft", "--steps", "2", "--batch-size", "2", "--name", "cli", "--json",
                          "--train-problems", "300", "--test-problems", "8"),
                         ("watch", "no-such-job"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stdout
    # JSON lines only: the queued job first, then its events.
    queued, *events = [json.loads(line) for line in r.stdout.splitlines()]
    assert queued["state"] == "queued" and queued["kind"] == "sft" and queued["total_steps"] == 2
    assert [e["step"] for e in events if e["step"] is not None] == [1, 2]
    assert events[-1]["state"] == "succeeded"
    job_id = events[-1]["job_id"]
    # Only the last step published (no --publish-every): only its event names a version.
    published = [e["weights_version"] for e in events if e["step"] is not None]
    assert published[0] == "" and published[1].startswith("jobs-step") and events[-1]["weights_version"] == published[1]
    watch, listed = at_once(("watch", job_id), ("list",))
    steps = [line for line in watch.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and "published" not in steps[0] and f"step 2/2 published {published[1]} " in steps[1]
    assert job_id in listed.stdout and "succeeded" in listed.stdout


def test_bad_configs_and_pairs_are_refused_by_name_at_submission_and_leave_nothing_pending(fleet) -> None:  # noqa: ANN001
    """Issue 47, case 4. A bad TrainConfig field or a DPO pair preferring a completion to itself is refused by name
    (INVALID_ARGUMENT, never UNKNOWN) before the job is accepted, through the API and the command line, and at
    the trainer's own RPCs, which leave no unapplied batch behind; an lr above the ceiling (1) is refused
    everywhere; a partly filled train_config keeps the defaults of the fields it leaves unset."""
    scheduler, trainer_address = fleet["scheduler"]["address"], fleet["trainer"]["address"]
    pair = (Completion((1, 5, 7, 9), (20, 21, 2)), Completion((1, 5, 7, 9), (25, 26, 2)))
    same = (pair[0], Completion(pair[0].prompt_ids, pair[0].completion_ids, temperature=0.7))
    bad = [
        (SFTJobSpec(steps=1, countdown=TASK, batch_size=2, train_config=TrainConfig(lr=-1.0)), "train_config.lr"),
        (SFTJobSpec(steps=1, countdown=TASK, batch_size=2, train_config=TrainConfig(lr=float("nan"))),
         "train_config.lr"),
        (SFTJobSpec(steps=1, countdown=TASK, batch_size=2, train_config=TrainConfig(lr=1e9)), "train_config.lr"),
        (RLJobSpec(steps=1, countdown=TASK, train_config=TrainConfig(betas=(2.0, 0.95))), "train_config.beta1"),
        (RLJobSpec(steps=1, countdown=TASK, train_config=TrainConfig(dtype="int8")),  # type: ignore[arg-type]
         "train_config.dtype"),
        (RLJobSpec(steps=1, countdown=TASK, train_config=TrainConfig(clip_eps=-1.0)), "train_config.clip_eps"),
        (RLJobSpec(steps=1, countdown=TASK, train_config=TrainConfig(grad_clip=float("nan"))),
         "train_config.grad_clip"),
        (RLJobSpec(steps=1, countdown=TASK, learning_rate=1e9), "learning_rate"),
        (DPOJobSpec(steps=1, pairs=(pair, same), batch_size=1), "dpo.pairs[1]"),
    ]

    async def main() -> None:
        async with JobsClient(scheduler) as jobs, TrainerClient(trainer_address) as trainer:
            before = [s.job_id for s in await jobs.list()]
            for spec, field in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await jobs.submit(spec)
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
                assert [v.field for v in field_violations(err.value)] == [field], err.value.details()
            assert [s.job_id for s in await jobs.list()] == before          # none was accepted
            # The trainer's RPCs refuse the same by the same names, and hold nothing afterwards.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await trainer.forward_backward("dpo", [same])
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "dpo.pairs[0]" in err.value.details()
            for call, field in ((trainer.optim_step(lr=1e9), "lr"),
                                (trainer.load_weights("latest", config=TrainConfig(betas=(0.9, 1.5))), "config.beta2")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
            assert (await trainer.get_state()).accumulated_batches == 0
            # A train_config that sets only lr (the wire's form: every field optional) trains with every other
            # field at its default: betas 0.9/0.95, clip_eps 0.2, dpo_beta 0.1, lora_alpha 16, never 0.
            stub = jobs_pb2_grpc.JobsStub(jobs.channel)
            submitted = await stub.SubmitJob(jobs_pb2.JobSpec(
                name="partial", dpo=jobs_pb2.DPOJob(steps=1, batch_size=1, pairs=trainer_pb2.DPOBatch(
                    pairs=[trainer_pb2.PreferencePair(chosen=convert.completion_to_proto(pair[0]),
                                                      rejected=convert.completion_to_proto(pair[1]))])),
                train_config=trainer_pb2.TrainConfig(lr=3e-3)))
            events = await _events(jobs, submitted.job_id)
            assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
            assert (await trainer.get_state()).config == TrainConfig(lr=3e-3)
    asyncio.run(main())
    # The command line says the server's refusal by name, and exits 1.
    cli = subprocess.run([sys.executable, "-m", "zerokl", "jobs", "--server", scheduler, "submit", "sft", "--steps",
                          "1", "--lr", "1e9", "--train-problems", "300", "--test-problems", "8"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and "INVALID_ARGUMENT" in cli.stdout + cli.stderr, cli.stdout + cli.stderr
    assert "learning_rate" in cli.stdout + cli.stderr


def _record_process(trainer_pid: int) -> int:
    """The trainer's record process (trainer/recorder.py: its one spawned child beside multiprocessing's tracker)."""
    children = pathlib.Path(f"/proc/{trainer_pid}/task/{trainer_pid}/children").read_text().split()
    [pid] = [int(c) for c in children if b"spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
    return pid


TINY_RL = dict(countdown=TASK, prompts_per_step=1, group_size=2, max_tokens=4, eval_every=0)


def _shared_memory_of(pid: int) -> list[pathlib.Path]:
    """The shared-memory files of the versions process ``pid`` shares in place now (weightstore/sync.py, cpu_shm)."""
    lines = pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({pathlib.Path(line.split(None, 5)[5]) for line in lines
                   if SHM_PREFIX in line and not line.endswith("(deleted)")})


async def _first_step_fails_while_its_start_is_recorded(fleet, tmp_path: pathlib.Path,
                                                         lose: Callable[[int], None]) -> tuple[str, str, str]:
    """An RL job's start is recorded in the background while its first step trains (issue 49). Here its record is
    held (the trainer's record process stopped) when the first step's version fails its canary (AdamW moments of
    1e20 loaded by hand, as in test_jobs_bf16), with checkpoint_every 0 (the GLM-5 slice's setting: its start, 22.7
    GiB recorded whole, is still in flight when a first step fails): the fleet goes back to the start from the
    trainer's memory, not the store, which does not hold it yet. Then ``lose(record process)``. Returns the version
    served before the job, the job's start and the job's error."""
    scheduler, trainer_pid = fleet["scheduler"]["address"], fleet["trainer"]["pid"]
    decode = next(s for name, s in fleet.items() if name.startswith("decode"))
    async with JobsClient(scheduler) as jobs, TrainerClient(fleet["trainer"]["address"]) as trainer, \
            WeightStoreClient(fleet["weight-store"]["address"]) as weights, \
            InferenceClient(decode["address"]) as replica:
        # A resume point to go back to, recorded (a job waits for its records), and the record process up.
        warm = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=6, **TINY_RL), "before")).job_id)
        assert warm[-1].status.state is JobState.SUCCEEDED, warm[-1].status.error
        before = warm[-1].status.weights_version
        await trainer.load_weights(await _with_exploding_moments(weights, before, tmp_path, f"{before}.exploding"),
                                   restore_state=True)
        step = (await trainer.get_state()).step
        recorder = _record_process(trainer_pid)
        os.kill(recorder, signal.SIGSTOP)
        try:
            switches = _shared_switches(decode["metrics"])
            job = await jobs.submit(RLJobSpec(steps=1, seed=7, checkpoint_every=0, **TINY_RL), "lost-start")
            # In place: the start, step 1's version (its canary fails) and back to the start, whose record is
            # held: the switch back took the trainer's copy.
            deadline = time.monotonic() + 60
            while _shared_switches(decode["metrics"]) < switches + 3:
                assert time.monotonic() < deadline, "the replica did not switch back to the job's start"
                await asyncio.sleep(0.1)
            start = next(s for s in await jobs.list() if s.job_id == job.job_id).weights_version
            assert (await replica.info()).weights_version == start != before
            assert (await trainer.get_state()).weights_step == step + 1     # the rejected step, shared
            assert start not in {e.manifest.version for e in await weights.list()}
        finally:
            lose(recorder)
        final = (await _events(jobs, job.job_id))[-1].status
        assert final.state is JobState.FAILED and "failed its canary" in final.error, final
        assert "NOT_FOUND" not in final.error, final.error
        return before, start, final.error


async def _next_job_trains_from(fleet, version: str) -> None:
    """One bad job harms no other: the next one trains from ``version``, with KL 0, and the fleet serves its own."""
    scheduler = fleet["scheduler"]["address"]
    async with JobsClient(scheduler) as jobs, InferenceClient(scheduler) as served:
        assert (await served.info()).weights_version == version
        after = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=8, **TINY_RL), "after")).job_id)
        assert after[-1].status.state is JobState.SUCCEEDED, after[-1].status.error
        assert [ev.metrics["kl"] for ev in _steps(after)] == [0.0]
        assert (await served.info()).weights_version == after[-1].status.weights_version != version


def test_a_failed_step_whose_start_record_lost_its_process_rolls_back_to_the_start_recorded_again(
        fleet, tmp_path) -> None:  # noqa: ANN001
    """The held record's process killed (as the host's OOM killer would): the trainer starts another and records the
    start again from the export it still holds. The job's rollback waits for that record and lands on the start,
    which the fleet serves and the store now holds; the rejected step is deleted."""
    before, start, error = asyncio.run(_first_step_fails_while_its_start_is_recorded(
        fleet, tmp_path, lambda recorder: os.kill(recorder, signal.SIGKILL)))
    assert f"rolled back to {start}" in error and "never reached" not in error, error
    rejected = error.split("weights version ", 1)[1].split()[0]
    state, stored = _trainer_state_and_stored(fleet)
    assert (state.weights_version, state.step, state.accumulated_batches) == (start, state.weights_step, 0)
    assert start in stored and rejected not in stored
    asyncio.run(_next_job_trains_from(fleet, start))


def test_a_failed_step_whose_start_never_reached_the_store_leaves_trainer_and_fleet_on_a_durable_version(
        fleet, tmp_path) -> None:  # noqa: ANN001
    """The held record's bytes gone before its process read them (the shared memory removed, as a /dev/shm cleanup
    would): the start never reaches the store. The trainer cannot load a version the store never got, so it and the
    fleet go back to the version served before the job, which is durable, and the job's error says so (never the
    store's NOT_FOUND). The next job runs as usual."""
    trainer_pid = fleet["trainer"]["pid"]

    def unmap_and_go_on(recorder: int) -> None:
        for path in _shared_memory_of(trainer_pid):
            path.unlink()
        os.kill(recorder, signal.SIGCONT)
    before, start, error = asyncio.run(_first_step_fails_while_its_start_is_recorded(fleet, tmp_path,
                                                                                     unmap_and_go_on))
    assert f"{start} never reached the weight store" in error and before in error, error
    # Trainer and fleet on the version served before the job, from the store; nothing of the job kept.
    state, stored = _trainer_state_and_stored(fleet)
    assert (state.weights_version, state.step, state.accumulated_batches) == (before, state.weights_step, 0)
    assert before in stored and start not in stored
    asyncio.run(_next_job_trains_from(fleet, before))


def _trainer_state_and_stored(fleet) -> tuple:  # noqa: ANN001
    """The trainer's state and the versions the weight store holds."""
    async def read() -> tuple:
        async with TrainerClient(fleet["trainer"]["address"]) as trainer, \
                WeightStoreClient(fleet["weight-store"]["address"]) as weights:
            return await trainer.get_state(), {e.manifest.version for e in await weights.list()}
    return asyncio.run(read())


async def _served_version_whose_record_failed(fleet, jobs: JobsClient, seed: int) -> str:
    """A job (checkpoint_every 0: its versions weights only) whose one step's version the fleet serves while its
    record is held (the record process stopped), then fails: the version's shared memory is removed before the record
    process reads it (as a /dev/shm cleanup would), so it cannot read the bytes the fleet was sent. The job fails at
    its end naming the version; the fleet keeps serving it, and the store does not hold it. Its name."""
    trainer_pid = fleet["trainer"]["pid"]
    recorder = _record_process(trainer_pid)
    os.kill(recorder, signal.SIGSTOP)
    try:
        job = await jobs.submit(RLJobSpec(steps=1, seed=seed, checkpoint_every=0, **TINY_RL), "record-fails")
        deadline = time.monotonic() + 60
        while (status := next(s for s in await jobs.list() if s.job_id == job.job_id)).step < 1:
            assert time.monotonic() < deadline and not status.state.done, status
            await asyncio.sleep(0.05)
    finally:
        for path in _shared_memory_of(trainer_pid):
            path.unlink()
        os.kill(recorder, signal.SIGCONT)
    final = (await _events(jobs, job.job_id))[-1].status
    lost = status.weights_version
    assert final.state is JobState.FAILED and f"{lost} never reached the weight store" in final.error, final.error
    return lost


def test_a_served_version_whose_record_failed_is_recorded_again_by_the_next_jobs_start(fleet) -> None:  # noqa: ANN001
    """Issue 49. The fleet serves a version whose background record failed, outside a rollback. The next job started
    on it records it again at its start, from the trainer's weights (checked against the checksum of the bytes the
    fleet was sent), and trains as usual; before, it found out only at its end, when it waited for its records.
    Where the trainer no longer holds the version (moved to another by hand), the next job fails at its start
    (FAILED_PRECONDITION, naming the version and what to do), and the one after trains once the fleet serves a
    version the store holds."""
    scheduler = fleet["scheduler"]["address"]

    async def main() -> None:
        async with JobsClient(scheduler) as jobs, TrainerClient(fleet["trainer"]["address"]) as trainer, \
                WeightStoreClient(fleet["weight-store"]["address"]) as weights, InferenceClient(scheduler) as fleet_:
            warm = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=9, **TINY_RL), "warm")).job_id)
            assert warm[-1].status.state is JobState.SUCCEEDED, warm[-1].status.error     # the record process is up
            lost = await _served_version_whose_record_failed(fleet, jobs, seed=10)
            assert (await fleet_.info()).weights_version == lost
            assert lost not in {e.manifest.version for e in await weights.list()}
            again = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=11, **TINY_RL), "again")).job_id)
            assert again[-1].status.state is JobState.SUCCEEDED, again[-1].status.error
            assert [ev.metrics["kl"] for ev in _steps(again)] == [0.0]
            # Recorded by the job's start, with the trainer state: a resume point.
            assert (await weights.manifest(lost)).spec.metadata[META_STATE] == "full"
            durable = again[-1].status.weights_version

            lost = await _served_version_whose_record_failed(fleet, jobs, seed=12)
            await trainer.load_weights(durable, restore_state=True)
            refused = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=13, **TINY_RL), "no")).job_id)
            final = refused[-1].status
            assert final.state is JobState.FAILED and not _steps(refused), final
            assert final.error.startswith("FailedPrecondition:") and f"fleet serves {lost}" in final.error, final.error
            assert "SwitchWeights" in final.error and durable in final.error, final.error
            assert (await fleet_.info()).weights_version == lost and lost not in {
                e.manifest.version for e in await weights.list()}
            # What it says to do: the fleet on a version the store holds; then jobs run again.
            await fleet_.switch_weights(durable)
            after = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=14, **TINY_RL), "after")).job_id)
            assert after[-1].status.state is JobState.SUCCEEDED, after[-1].status.error
    asyncio.run(main())


def _switches(metrics_address: str) -> float:
    """Weight switches a replica made, from the trainer's memory and from the store."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    return sum(float(m) for m in re.findall(r'^zerokl_replica_weight_switches_total\{path="\w+"\} (\S+)$', text, re.M))


def test_a_failed_rollback_is_said_once_in_the_jobs_error(fleet, tmp_path) -> None:  # noqa: ANN001
    """Issue 49. A job whose start fails its canary (weights a person made unservable by hand: a step on AdamW
    moments of 1e20) takes the trainer back to the version the fleet serves, from the store. Here that version is
    gone from the store meanwhile (unpinned and deleted while the job waits for its start's record, the record
    process stopped), so the rollback fails: the job's error says so once, not once more by a second rollback.
    The next job refuses to start on a version the store does not hold, saying what to do; done, jobs run again."""
    scheduler, trainer_pid = fleet["scheduler"]["address"], fleet["trainer"]["pid"]
    decode = next(s for name, s in fleet.items() if name.startswith("decode"))

    async def main() -> None:
        async with JobsClient(scheduler) as jobs, TrainerClient(fleet["trainer"]["address"]) as trainer, \
                WeightStoreClient(fleet["weight-store"]["address"]) as weights, InferenceClient(scheduler) as fleet_:
            durable = (await fleet_.info()).weights_version
            warm = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=15, **TINY_RL), "warm")).job_id)
            assert warm[-1].status.state is JobState.SUCCEEDED, warm[-1].status.error
            served = warm[-1].status.weights_version
            await trainer.load_weights(await _with_exploding_moments(weights, served, tmp_path, f"{served}.exploding"),
                                       restore_state=True)
            await trainer.forward_backward("sft", [Completion((3, 4, 5, 6), (7, 8, 2))])
            await trainer.optim_step()
            recorder = _record_process(trainer_pid)
            os.kill(recorder, signal.SIGSTOP)
            try:
                switches = _switches(decode["metrics"])
                job = await jobs.submit(RLJobSpec(steps=1, seed=16, **TINY_RL), "unservable")
                # The canary replica took the start in place and went back to the served version: the job now waits
                # for its start's record before deleting it.
                deadline = time.monotonic() + 60
                while _switches(decode["metrics"]) < switches + 2:
                    assert time.monotonic() < deadline, "the canary replica did not switch back"
                    await asyncio.sleep(0.1)
                for owner in next(e for e in await weights.list() if e.manifest.version == served).pinned_by:
                    await weights.unpin(served, owner)
                await weights.delete(served)
            finally:
                os.kill(recorder, signal.SIGCONT)
            error = (await _events(jobs, job.job_id))[-1].status.error
            assert "failed its canary" in error, error
            assert f"The fleet keeps serving {served}, but rolling the trainer back to it failed" in error, error
            assert error.count("NOT_FOUND") == 1 and error.count("rolling the trainer back") == 1, error
            assert (await fleet_.info()).weights_version == served

            refused = (await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=17, **TINY_RL),
                                                              "refused")).job_id))[-1].status
            assert refused.state is JobState.FAILED and f"fleet serves {served}" in refused.error, refused.error
            assert "SwitchWeights" in refused.error, refused.error
            await trainer.load_weights(durable)
            await fleet_.switch_weights(durable)
            after = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=18, **TINY_RL), "after")).job_id)
            assert after[-1].status.state is JobState.SUCCEEDED, after[-1].status.error
    asyncio.run(main())


def test_a_trainer_killed_mid_job_resumes_and_the_job_ends_with_the_uninterrupted_weights(tmp_path, zerokl_up) -> None:
    """SIGKILL the trainer mid-SFT-job; `zerokl up`'s supervisor starts it again on the same port: the job waits,
    continues from the trainer's newest published step, reports each step once, and the final weights equal
    (torch.equal) an uninterrupted in-process Trainer fed the same batches from the same start."""
    import os
    import random

    import torch

    from zerokl.kernels.model import Model, ModelConfig
    from zerokl.services.trainer.config import TrainConfig
    from zerokl.services.trainer.trainer import Trainer
    from zerokl.services.weightstore.client import WeightStoreClient

    prompts = [(1, 5 + i, 7, 9, 11 + i) for i in range(16)]
    examples = tuple(Completion(p, (20 + i % 5, 21, 22, 2)) for i, p in enumerate(prompts))
    # Killed after step 3 of 6 (published every 2): it resumes from step 2 and redoes step 3.
    steps, batch, seed = 6, 4, 7

    def uninterrupted() -> dict[str, torch.Tensor]:
        reference = Trainer(Model(ModelConfig.preset("tiny"), seed=0), TrainConfig(lr=3e-3))
        for step in range(steps):
            reference.sft_step(random.Random(f"{seed}:{step}").sample(list(examples), batch))
        return reference.serving_state_dict()

    workdir = tmp_path / "up"
    # The reference needs no service: it is computed while the fleet starts.
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(uninterrupted)
        with zerokl_up(workdir, "--trainer-flag=--lr=3e-3", "--trainer-flag=--run=crash") as services:
            trainer, store = services["trainer"], services["weight-store"]["address"]

            async def main() -> str:
                killed = False
                async with JobsClient(services["scheduler"]["address"]) as jobs:
                    job = await jobs.submit(SFTJobSpec(steps=steps, examples=examples, batch_size=batch, publish_every=2,
                                                       seed=seed), "crash")
                    seen = []
                    async for ev in jobs.watch(job.job_id):
                        if ev.step is not None:
                            seen.append(ev.step)
                            if ev.step == 3 and not killed:
                                os.kill(trainer["pid"], signal.SIGKILL)
                                killed = True
                        last = ev
                    assert last.status.state is JobState.SUCCEEDED, last.status.error
                    assert last.status.step == steps and seen[-1] == steps
                    # Step 3 is redone after the restart (the trainer resumed from step 2): watchers see it once.
                    assert killed and seen == list(range(1, steps + 1))
                    return last.status.weights_version

            final = asyncio.run(main())
            # The job ran on a trainer started again on the same port: not the one killed.
            again = next(s for s in json.loads((workdir / "up.json").read_text())["services"] if s["name"] == "trainer")
            assert again["restarts"] >= 1 and again["last_exit"] == -signal.SIGKILL and again["pid"] != trainer["pid"]
            assert again["address"] == trainer["address"]

            async def fetch() -> None:
                async with WeightStoreClient(store) as client:
                    await client.fetch(final, tmp_path / "final", serving_only=True)
            asyncio.run(fetch())
            served = Model.from_pretrained(tmp_path / "final").state_dict()
        want = reference.result()
    assert served.keys() == want.keys()
    assert all(torch.equal(served[k], want[k]) for k in want)


def test_an_rl_specs_checkpoint_every_of_0_crosses_the_api_and_unset_is_the_default() -> None:
    """0 (never record the trainer state) is a value of its own on the wire, not proto3's unset: an old client that
    never sets the field still gets the default, 10."""
    from zerokl.services.jobs.service import spec_from_proto, spec_to_proto
    never = RLJobSpec(steps=2, checkpoint_every=0)
    assert spec_from_proto(spec_to_proto(never)).checkpoint_every == 0
    unset = spec_from_proto(jobs_pb2.JobSpec(rl=jobs_pb2.RLJob(steps=2)))
    assert unset.checkpoint_every == RLJobSpec(1).checkpoint_every == 10
    with pytest.raises(InvalidArgument, match="rl.checkpoint_every"):
        validate(RLJobSpec(steps=2, checkpoint_every=-1))


def test_an_sft_spec_naming_no_data_defaults_to_countdown_as_rl_does() -> None:
    from zerokl.services.jobs.service import spec_from_proto
    sft = spec_from_proto(jobs_pb2.JobSpec(sft=jobs_pb2.SFTJob(steps=2)))
    rl = spec_from_proto(jobs_pb2.JobSpec(rl=jobs_pb2.RLJob(steps=2)))
    assert isinstance(sft, SFTJobSpec) and sft.countdown == rl.countdown == CountdownTask() and not sft.examples
    given = spec_from_proto(jobs_pb2.JobSpec(sft=jobs_pb2.SFTJob(steps=2, countdown=jobs_pb2.CountdownTask(seed=3))))
    assert given.countdown.seed == 3


def test_a_failed_steps_rollback_waits_for_a_record_that_never_ends_only_as_long_as_the_store_wait(
        tmp_path, zerokl_up) -> None:  # noqa: ANN001
    """A failed step's rollback, and the delete of the version that failed its canary, wait for the trainer's records
    they need; here those records never end (the record process stopped for the whole job, as one the host has
    stopped, or a store that takes the bytes and never answers: no outage, so nothing else bounds the wait). They wait
    the scheduler's --store-wait in all, then the job fails saying which record it waited for and how long: the
    trainer and the fleet go back to the version served before the job (the store holds it), and the version that
    failed its canary is said not deleted (its record may land yet). Once the record process goes on, the two records
    fail (the rollback's load let go of the shared memory they were to read): neither version is ever in the store.
    The next job trains from the version served before."""
    with zerokl_up(tmp_path / "up", "--trainer-flag=--lr=3e-3", "--trainer-flag=--run=pending",
                   "--scheduler-flag=--store-wait=10") as fleet:
        stopped: list[int] = []

        async def failed_job() -> tuple[str, str, str]:
            # The record process stays stopped until the job has ended (the guard: before the wait was bounded, the
            # job never ended).
            return await asyncio.wait_for(_first_step_fails_while_its_start_is_recorded(
                fleet, tmp_path, stopped.append), 300)
        try:
            before, start, error = asyncio.run(failed_job())
        finally:
            for recorder in stopped:
                os.kill(recorder, signal.SIGCONT)
        rejected = error.split("weights version ", 1)[1].split()[0]
        assert f"the record of {start} did not end within the 10 s waited for it (the scheduler's --store-wait" \
            in error, error
        assert f"rolled back to {before}" in error and f"{before} is what the fleet served before this job" in error, \
            error
        assert f"{rejected} was not deleted from the weight store" in error, error
        state, stored = _trainer_state_and_stored(fleet)
        assert (state.weights_version, state.step, state.accumulated_batches) == (before, state.weights_step, 0)

        async def records_fail() -> None:
            async with TrainerClient(fleet["trainer"]["address"]) as trainer:
                for version in (start, rejected):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await asyncio.wait_for(trainer.record_weights(version), 120)
                    assert err.value.code() is grpc.StatusCode.INTERNAL and "SharedUnavailable" in err.value.details()
        asyncio.run(records_fail())
        assert {start, rejected}.isdisjoint(_trainer_state_and_stored(fleet)[1])
        asyncio.run(_next_job_trains_from(fleet, before))
