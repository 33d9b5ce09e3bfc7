"""`zerokl up --dtype fp8`: the whole fleet in FP8 on loopback. The weight store publishes the preset
quantized (e4m3 values + block scales), every replica and the trainer advertise the FP8 fingerprint,
and an RL job through the five services has KL exactly 0.0 and no mismatched token at every step:
the trainer trains on the FP8 forward and each version it publishes is what the replicas switch to
and serve (the same bytes)."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from zerokl.kernels import fingerprint
from zerokl.kernels.model import Model
from zerokl.kernels.model.fp8 import is_fp8
from zerokl.services.inference import InferenceClient
from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec
from zerokl.services.jobs.service import JobsClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]   # ~3 minutes on a 2-core CPU


def test_an_fp8_fleet_trains_with_zero_kl_and_serves_what_it_publishes(tmp_path, zerokl_up) -> None:
    fp8 = fingerprint(dtype=torch.float8_e4m3fn)
    with zerokl_up(tmp_path / "up", "--dtype", "fp8", "--trainer-flag=--lr=3e-3", "--trainer-flag=--run=fp8",
                   timeout=300) as services:
        assert {name: s["numerics_fingerprint"] for name, s in services.items() if name != "weight-store"} == \
            {name: fp8 for name in services if name != "weight-store"}
        scheduler = services["scheduler"]["address"]

        async def main() -> list:
            async with JobsClient(scheduler) as jobs:
                spec = RLJobSpec(steps=2, countdown=CountdownTask(seed=0, train_problems=300, test_problems=4),
                                 prompts_per_step=2, group_size=4, max_tokens=8, seed=1, eval_every=0,
                                 reward="vowel_share", ignore_eos=True)   # uneven rewards: the weights move
                job = await jobs.submit(spec, "rl-fp8")
                events = [ev async for ev in jobs.watch(job.job_id)]
            assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
            steps = [ev for ev in events if ev.step is not None]
            async with InferenceClient(scheduler) as inference:
                info = await inference.info()
            assert (info.weights_version, info.numerics_fingerprint) == (steps[-1].weights_version, fp8)
            return steps
        steps = asyncio.run(main())
    assert [ev.step for ev in steps] == [1, 2]
    for ev in steps:
        assert ev.metrics["kl"] == 0.0 and ev.metrics["mismatched_tokens"] == 0.0 and ev.metrics["tokens"] > 0
        assert ev.metrics["grad_norm"] > 0.0, ev.metrics
    # Each published version is an FP8 checkpoint (e4m3 + scales, 1 byte a quantized weight).
    versions = tmp_path / "up" / "weights" / "versions"
    first = versions / "1"
    assert json.loads((first / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert is_fp8(Model.from_pretrained(versions / steps[-1].weights_version))
