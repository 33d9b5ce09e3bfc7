"""The product path on CUDA (issue 32): `zerokl up` on the GPU, concurrent Generate calls through its
scheduler, every result identical (tokens and logprobs, ==) to the same request sent alone.

GPU tier (skipped without CUDA): the tiny preset in bf16, one decode replica prefilling its own
prompts, so a concurrent wave exercises CUDA-graph decode, mixed prefill/decode steps and the
coalesced streams of the replica and the scheduler.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from zerokl.kernels import fingerprint
from zerokl.services.inference.client import InferenceClient
from zerokl.services.inference.types import GenerateResult, InferenceRequest
from zerokl.vocab import SamplingOptions

pytestmark = pytest.mark.gpu


def _requests(count: int) -> list[InferenceRequest]:
    rng = random.Random(32)
    return [InferenceRequest(
        prompt_ids=tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 60))),
        options=SamplingOptions(temperature=rng.choice([0.0, 1.0, 0.7]), top_k=rng.choice([0, 20]),
                                seed=i, max_tokens=rng.randint(8, 48), ignore_eos=True, n=rng.choice([1, 1, 2])))
        for i in range(count)]


def _numbers(result: GenerateResult) -> list[tuple[list[int], list[float]]]:
    return [(s.token_ids, s.logprobs) for s in result.samples]


async def _generate(address: str, requests: list[InferenceRequest], concurrently: bool) -> list[GenerateResult]:
    async with InferenceClient(address) as client:
        if concurrently:
            return list(await asyncio.gather(*(client.generate_all(r, timeout=300) for r in requests)))
        return [await client.generate_all(r, timeout=300) for r in requests]


def test_zerokl_up_on_cuda_serves_concurrent_generates_identical_to_one_at_a_time(tmp_path, zerokl_up) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with zerokl_up(tmp_path / "up", "--no-trainer", "--dtype", "bfloat16", timeout=600) as services:
        address = services["scheduler"]["address"]
        requests = _requests(48)
        together = asyncio.run(_generate(address, requests, concurrently=True))
        alone = asyncio.run(_generate(address, requests, concurrently=False))
    want = fingerprint(device=torch.device("cuda"), dtype=torch.bfloat16)
    assert {(r.weights_version, r.numerics_fingerprint) for r in together + alone} == {("1", want)}
    for i, (t, a) in enumerate(zip(together, alone)):
        assert _numbers(t) == _numbers(a), f"request {i}: concurrent != alone"
        assert all(s.finish_reason == "length" for s in t.samples)
