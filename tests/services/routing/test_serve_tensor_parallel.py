"""`zerokl serve decode --tp 2`: a tensor-parallel replica (two processes in lockstep, gloo on CPU)
serves exactly what a one-process replica serves, side by side in one fleet behind the scheduler,
and switches to a weight-store version as a one-process replica does."""
from __future__ import annotations

import asyncio
import os
import pathlib
import random
import signal
import subprocess
import sys

import grpc
import pytest

from conftest import WEIGHTS, numbers, offline, prompt, replica_server, routed, scheduler_server, serve_decode, stop, \
    wait_listening
from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient
from zerokl.services.inference.server import make_identity
from zerokl.services.inference.types import InferenceRequest
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.vocab import SamplingOptions


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


def test_a_tp2_replica_switches_weights_bit_exactly(model: Model, model_seed1: Model, tmp_path: pathlib.Path) -> None:
    store = subprocess.Popen([sys.executable, "-m", "zerokl", "serve", "weight-store", "--root", str(tmp_path / "store"),
                              "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = None
    try:
        store_address = wait_listening(store, "weight-store")
        model_seed1.save_pretrained(tmp_path / "v2")

        async def publish() -> None:
            async with WeightStoreClient(store_address) as ws:
                await ws.publish(tmp_path / "v2", "v2", parent_version=WEIGHTS, numerics_version=numerics_version)
        asyncio.run(publish())
        proc = serve_decode("--tp", "2", "--weight-store", store_address, "--weights-cache", str(tmp_path / "cache"))
        address = wait_listening(proc)
        rng = random.Random(3)
        requests = [InferenceRequest(prompt_ids=prompt(rng, 3, 20), options=SamplingOptions(
            temperature=1.0, seed=rng.randrange(100), max_tokens=6, ignore_eos=True)) for _ in range(3)]

        async def main() -> tuple[list, list, str]:
            async with InferenceClient(address) as client:
                before = await asyncio.gather(*(client.generate_all(r) for r in requests))
                identity = await client.switch_weights("v2")
                after = await asyncio.gather(*(client.generate_all(r) for r in requests))
                with pytest.raises(grpc.aio.AioRpcError) as err:     # an unknown version: nothing changes
                    await client.switch_weights("v3")
                assert err.value.code() is grpc.StatusCode.NOT_FOUND
                return before, after, identity.weights_version

        before, after, version = asyncio.run(main())
        assert version == "v2"
        for r, b, a in zip(requests, before, after, strict=True):
            assert b.weights_version == WEIGHTS and a.weights_version == "v2"
            assert numbers(b.samples) == numbers(offline(model, r.prompt_ids, r.options))
            assert numbers(a.samples) == numbers(offline(model_seed1, r.prompt_ids, r.options))
    finally:
        if proc is not None:
            stop(proc)
        stop(store)


def test_a_tp_replica_exits_when_a_follower_dies() -> None:
    """A replica missing a shard cannot serve: rank 0 exits non-zero for its supervisor to restart it."""
    proc = serve_decode("--tp", "2")
    try:
        wait_listening(proc)
        children = pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
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
