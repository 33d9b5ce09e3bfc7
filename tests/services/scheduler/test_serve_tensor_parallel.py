"""`zerokl serve decode --tp 2`: a tensor-parallel replica (two processes in lockstep, gloo on CPU)
serves exactly what a one-process replica serves, side by side in one fleet behind the scheduler."""
from __future__ import annotations

import asyncio
import random
import signal

import grpc
import pytest

from conftest import WEIGHTS, numbers, offline, prompt, replica_server, routed, scheduler_server, serve_decode, stop, \
    wait_listening
from zerokl.model import Model
from zerokl.services.engine.types import SamplingOptions
from zerokl.services.inference import InferenceClient
from zerokl.services.inference.server import make_identity
from zerokl.services.inference.types import InferenceRequest


def test_a_tp2_replica_serves_the_tp1_bits_beside_a_tp1_replica(model: Model) -> None:
    rng = random.Random(7)
    requests = [InferenceRequest(prompt_ids=prompt(rng, 3, 30), options=SamplingOptions(
        temperature=rng.choice([0.0, 1.0]), top_k=rng.choice([0, 8]), seed=rng.randrange(100), n=rng.choice([1, 2]),
        max_tokens=rng.randint(3, 8), ignore_eos=True)) for _ in range(10)]
    proc = serve_decode("--tp", "2")
    try:
        address = wait_listening(proc)

        async def main() -> tuple[list, dict[str, int], str]:
            async with InferenceClient(address) as direct:
                info = await direct.info()
                # bad input: a clear status, and both ranks stay in step (the next requests prove it)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await direct.generate_all(InferenceRequest(prompt_ids=(3, 10**6)))
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                async with replica_server(model) as (tp1, _), scheduler_server([address, tp1.address]) as (sched, s):
                    async with InferenceClient(sched.address) as client:
                        results = await asyncio.gather(*(client.generate_all(r) for r in requests))
                    return results, routed(s), info.numerics_fingerprint

        results, counts, fp = asyncio.run(main())
        # the same fingerprint as a one-process replica of these weights: one fleet, no mixed-fleet refusal
        assert fp == make_identity("decode", model, WEIGHTS).numerics_fingerprint
        assert all(c >= 2 for c in counts.values()) and len(counts) == 2, counts   # both replicas served
        for r, got in zip(requests, results, strict=True):
            assert numbers(got.samples) == numbers(offline(model, r.prompt_ids, r.options))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0                    # rank 0 stops its follower and exits cleanly
    finally:
        stop(proc)


def test_tp_flags_are_checked() -> None:
    for flags, says in ((("--tp", "3"), "--tp must be one of"),
                        (("--tp", "0"), "--tp must be one of")):
        proc = serve_decode(*flags)
        try:
            assert proc.wait(timeout=60) == 2
            assert says in proc.stderr.read()  # type: ignore[union-attr]
        finally:
            stop(proc)
