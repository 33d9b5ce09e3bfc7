"""A bf16 fleet end to end (issue 37): `zerokl up --dtype bfloat16`, then an RL job through the services.

The trainer keeps fp32 master weights and publishes bf16 serving weights; every new version reaches
the decode replica in place from the trainer's memory (shared memory on the CPU: the mechanism the
GPU's CUDA IPC path shares), its checksum checked, while the weight store records it in the
background. Every step: KL == 0.0 exactly and 0 mismatched tokens; its events say where the time
went (rollout_s, train_s, sync_s) and how many bytes moved. The GPU tier runs the same job on CUDA.
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import re
import shutil
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerokl.services.inference import InferenceClient
from zerokl.services.jobs.manager import RECORD_LAG
from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.trainer.checkpointing import STATE_FORMAT, STATE_TENSORS
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.store import FETCHED_MANIFEST

pytestmark = pytest.mark.timeout(600)

TASK = CountdownTask(seed=0, train_problems=300, test_problems=8)


def _shared_switches(metrics_address: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    m = re.search(r'^zerokl_replica_weight_switches_total\{path="shared"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _rl_job_in_bf16(services: dict[str, dict], steps: int) -> list:
    address = services["scheduler"]["address"]

    async def main() -> list:
        async with JobsClient(address) as jobs:
            # vowel_share: uneven rewards, so every step moves the weights and each sync carries new ones
            spec = RLJobSpec(steps=steps, countdown=TASK, prompts_per_step=2, group_size=4, max_tokens=10, seed=3,
                             eval_every=0, reward="vowel_share", ignore_eos=True)
            job = await jobs.submit(spec, "rl-bf16")
            events = [ev async for ev in jobs.watch(job.job_id)]
            assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
            async with InferenceClient(address) as inference:
                info = await inference.info()
            assert info.dtype == "bfloat16"
            return [ev for ev in events if ev.step is not None], info
    steps_events, info = asyncio.run(main())
    assert [ev.step for ev in steps_events] == list(range(1, steps + 1))
    for ev in steps_events:
        m = ev.metrics
        assert m["kl"] == 0.0 and m["mismatched_tokens"] == 0.0, (ev.step, m)
        assert m["tokens"] > 0 and m["grad_norm"] > 0.0, m
        assert {"rollout_s", "train_s", "sync_s", "sync_bytes", "sync_bytes_per_s"} <= m.keys()
        assert m["sync_bytes"] > 0
    assert info.weights_version == steps_events[-1].weights_version
    return steps_events


def test_an_rl_job_on_a_bf16_fleet_has_zero_kl_and_syncs_in_place(tmp_path, zerokl_up) -> None:  # noqa: ANN001
    workdir = tmp_path / "up"
    with zerokl_up(workdir, "--dtype", "bfloat16", "--trainer-flag=--lr=3e-3", "--trainer-flag=--run=bf16") as services:
        decode = next(s for name, s in services.items() if name.startswith("decode"))
        before = _shared_switches(decode["metrics"])
        events = _rl_job_in_bf16(services, steps=3)
        # Every step's version reached the replica from the trainer's memory, not the store, and so did the job's
        # start (its record lands in the background: issue 49).
        assert _shared_switches(decode["metrics"]) - before == len(events) + 1
        # And the store recorded every one of them that someone reads (the last: a resume point; the one the fleet
        # served before it); an intermediate weights-only one whose record had not started when a newer one was
        # served is superseded instead, never recorded, and the job's events count it.
        versions = [ev.weights_version for ev in events]
        held = {p.name for p in (workdir / "weights" / "versions").iterdir()}
        assert versions[-2:] == [v for v in versions[-2:] if v in held]
        assert len(set(versions) - held) == sum(ev.metrics["superseded"] for ev in events)
        # The trainer state (a resume point) only with the job's last step (checkpoint_every 10 > 3 steps).
        states = [json.loads((workdir / "weights" / "manifests" / f"{v}.json").read_text())
                  ["metadata"]["zerokl.trainer_state"] for v in versions if v in held]
        assert states[-1] == "full" and set(states[:-1]) <= {"none"}
        assert [ev.metrics["checkpoint"] for ev in events] == [0.0, 0.0, 1.0]
        # At most RECORD_LAG checkpoints pending, and weights-only records beyond the served one superseded.
        assert all(0 <= ev.metrics["record_lag"] <= RECORD_LAG + 3 for ev in events)
        good = events[-1].weights_version

        # A version shared in place that fails its canary: the job fails by name, the trainer is rolled
        # back, the version is deleted from the store once its background record landed, and the fleet
        # keeps serving the version the job started from. The poison: AdamW first moments of 1e20 in a
        # copy of the last checkpoint a person loads by hand (finite, so nothing refuses them): the job's
        # first step moves every weight by ~1e25, finite weights whose activations overflow.
        async def poisoned() -> tuple:
            async with JobsClient(services["scheduler"]["address"]) as jobs, \
                    WeightStoreClient(services["weight-store"]["address"]) as weights, \
                    TrainerClient(services["trainer"]["address"]) as trainer:
                await trainer.load_weights(await _with_exploding_moments(weights, good, tmp_path), restore_state=True)
                job = await jobs.submit(RLJobSpec(steps=1, countdown=TASK, prompts_per_step=2, group_size=4,
                                                  max_tokens=10, seed=4, eval_every=0), "poison")
                final = [ev async for ev in jobs.watch(job.job_id)][-1].status
                stored = {e.manifest.version for e in await weights.list()}
            async with InferenceClient(services["scheduler"]["address"]) as inference:
                served = (await inference.info()).weights_version
            return final, stored, served
        final, stored, served = asyncio.run(poisoned())
        start = final.weights_version   # the trainer's weights when the job started: served, after their canary
        assert final.state is JobState.FAILED and "failed its canary" in final.error, final
        assert f"rolled back to {start}" in final.error and "deleted from the weight store" in final.error, final.error
        rejected = final.error.split("weights version ", 1)[1].split()[0]
        assert served == start and start in stored and rejected not in stored, (start, rejected, stored)
        assert rejected not in {p.name for p in (workdir / "weights" / "versions").iterdir()}


async def _with_exploding_moments(weights: WeightStoreClient, version: str, folder: pathlib.Path,
                                  name: str = "exploding-moments") -> str:
    """Publish a copy of ``version`` (with its trainer state) whose AdamW first moments are all 1e20, as a person
    might upload a damaged resume point, as ``name``; its name."""
    src, dst = folder / "checkpoint", folder / "exploding"
    await weights.fetch(version, src)
    dst.mkdir()
    for f in src.iterdir():
        if f.name != FETCHED_MANIFEST:
            shutil.copyfile(f, dst / f.name)
    state = load_file(str(src / STATE_TENSORS))
    state = {k: torch.full_like(v, 1e20) if k.endswith("/exp_avg") else v for k, v in state.items()}
    save_file(state, str(dst / STATE_TENSORS), metadata={"format": STATE_FORMAT})
    await weights.publish(dst, name)
    return name


@pytest.mark.gpu
def test_an_rl_job_on_a_bf16_fleet_on_cuda_has_zero_kl_every_step(tmp_path, zerokl_up) -> None:  # noqa: ANN001
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with zerokl_up(tmp_path / "up", "--dtype", "bfloat16", "--trainer-flag=--lr=3e-3",
                   "--trainer-flag=--run=bf16-cuda", timeout=600) as services:
        decode = next(s for name, s in services.items() if name.startswith("decode"))
        before = _shared_switches(decode["metrics"])
        events = _rl_job_in_bf16(services, steps=4)
        assert _shared_switches(decode["metrics"]) - before == len(events)   # CUDA IPC, not the store
