"""SwitchWeights: a replica serves a new weight-store version between requests, bit-exactly.

A decode and a prefill replica start on weights v1 with a real weight store on
loopback (local directory). v2 (other weights, same config) is published; then:
requests pinned to v1 run on v1, a switch lets a request already running finish
on v1 (stamped v1) while a request arriving during the switch waits and runs on
v2, and every result equals the offline engine on the matching weights
(exact ids and fp32 logprobs). Bad switches get clear statuses and lose nothing.
"""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
from typing import AsyncIterator

import grpc
import pytest
import torch

from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.inference import InferenceClient
from zerokl.services.inference.types import GenerateResult, InferenceRequest
from zerokl.services.runtime import ServiceServer
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.weightstore.backends import LocalDirBackend
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.service import add_weight_store
from zerokl.services.weightstore.store import VersionStore
from zerokl.vocab import SamplingOptions

from conftest import CONFIG, TOKENIZER, decode_server, make_replica, offline, offline_score, prefill_server

pytestmark = pytest.mark.timeout(90)


@contextlib.asynccontextmanager
async def weight_store(root: pathlib.Path) -> AsyncIterator[str]:
    server = ServiceServer("weight-store")
    add_weight_store(server, VersionStore(LocalDirBackend(root)), ServiceIdentity("weight-store", "ws-test"),
                     watch_poll_s=0.2)
    await server.start()
    try:
        yield server.address
    finally:
        await server.drain(0)


async def _generate(client: InferenceClient, ids: tuple[int, ...], options: SamplingOptions,
                    pin: str = "") -> GenerateResult:
    return GenerateResult.collect([d async for d in client.generate(
        InferenceRequest(prompt_ids=ids, options=options, weights_version=pin))])


def _equal(result: GenerateResult, reference) -> bool:  # noqa: ANN001
    return all(s.token_ids == r.token_ids and torch.equal(torch.tensor(s.logprobs), torch.tensor(r.logprobs))
               for s, r in zip(result.samples, reference, strict=True))


def test_switch_is_bit_exact_and_waits_for_admitted_requests(tmp_path: pathlib.Path) -> None:
    asyncio.run(_switch_is_bit_exact(tmp_path))


async def _switch_is_bit_exact(tmp_path: pathlib.Path) -> None:
    v1 = Model(CONFIG, seed=0)
    v2 = Model(CONFIG, seed=1)
    ids = tuple(TOKENIZER.encode("nums 3 5 2 target 16\n"))
    short = SamplingOptions(temperature=1.0, max_tokens=6, seed=7, n=2)
    long = SamplingOptions(temperature=1.0, max_tokens=48, seed=3, ignore_eos=True)
    async with weight_store(tmp_path / "store") as store_address:
        async with WeightStoreClient(store_address) as store:
            v2_dir = tmp_path / "v2"
            v2.save_pretrained(v2_dir)
            await store.publish(v2_dir, "v2", parent_version="v1", numerics_version=numerics_version)
        async with decode_server(Model(CONFIG, seed=0), weights="v1", weight_store=store_address) as (server, replica):
            client = InferenceClient(server.address)
            try:
                before = await _generate(client, ids, short, pin="v1")
                assert before.weights_version == "v1"
                assert _equal(before, offline(v1, ids, short))

                # A long request is running when the switch starts; another arrives during the switch.
                running = asyncio.ensure_future(_generate(client, ids, long))
                while not replica.engine.num_in_flight:
                    await asyncio.sleep(0.01)
                switch = asyncio.ensure_future(client.switch_weights("v2"))
                await asyncio.sleep(0.05)
                arriving = asyncio.ensure_future(_generate(client, ids, short))
                identity = await switch
                assert identity.weights_version == "v2"
                old, new = await running, await arriving
                assert old.weights_version == "v1"
                assert _equal(old, offline(v1, ids, long))       # finished on the weights it started with
                # Admitted before or after the swap (fetching takes a while): computed by what it names.
                assert _equal(new, offline({"v1": v1, "v2": v2}[new.weights_version], ids, short))
                assert (await client.info()).weights_version == "v2"

                # The old pin is refused now; the new pin serves.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _generate(client, ids, short, pin="v1")
                assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert _equal(await _generate(client, ids, short, pin="v2"), offline(v2, ids, short))
            finally:
                await client.close()


def test_requests_arriving_during_a_swap_wait_and_run_on_the_new_weights() -> None:
    """AsyncEngine level, where the swap is posted at once: admission order is deterministic."""
    v1, v2 = Model(CONFIG, seed=0), Model(CONFIG, seed=1)
    ids = tuple(TOKENIZER.encode("nums 4 6 target 24\n"))
    long = SamplingOptions(temperature=1.0, max_tokens=40, seed=5, ignore_eos=True)
    short = SamplingOptions(temperature=1.0, max_tokens=5, seed=9)

    async def main() -> None:
        from zerokl.services.engine.types import GenerateRequest
        from zerokl.services.inference.async_engine import collect
        replica = make_replica(Model(CONFIG, seed=0), "decode", weights="v1")
        engine = replica.engine
        engine.start()
        try:
            running = await engine.submit(GenerateRequest("running", ids, long))
            swap = asyncio.ensure_future(engine.load_weights(v2.state_dict(), "v2"))
            await asyncio.sleep(0)
            pinned_old = asyncio.ensure_future(engine.submit(GenerateRequest("old-pin", ids, short), "v1"))
            arriving = asyncio.ensure_future(engine.submit(GenerateRequest("arriving", ids, short)))
            old_outs = await collect(running)
            await swap
            new_outs = await collect(await arriving)
            with pytest.raises(Exception) as err:
                await pinned_old
            assert "pinned weights_version 'v1'" in str(err.value)
            assert (running.weights_version, (await arriving).weights_version) == ("v1", "v2")
            ref_old, ref_new = offline(v1, ids, long)[0], offline(v2, ids, short)[0]
            assert [t for o in old_outs for t in o.token_ids] == ref_old.token_ids
            assert torch.equal(torch.tensor([x for o in old_outs for x in o.logprobs]), torch.tensor(ref_old.logprobs))
            assert [t for o in new_outs for t in o.token_ids] == ref_new.token_ids
            assert torch.equal(torch.tensor([x for o in new_outs for x in o.logprobs]), torch.tensor(ref_new.logprobs))
            assert replica.identity.weights_version == "v2"
        finally:
            await engine.close()

    asyncio.run(main())


def test_bad_switches_are_refused_and_the_replica_keeps_serving(tmp_path: pathlib.Path) -> None:
    asyncio.run(_bad_switches(tmp_path))


async def _bad_switches(tmp_path: pathlib.Path) -> None:
    v1 = Model(CONFIG, seed=0)
    ids = tuple(TOKENIZER.encode("nums 7 8 target 15\n"))
    opts = SamplingOptions(temperature=0.0, max_tokens=8)
    other = Model(ModelConfig.preset("tiny").replace(num_hidden_layers=2), seed=0)
    async with weight_store(tmp_path / "store") as store_address:
        async with WeightStoreClient(store_address) as store:
            other.save_pretrained(tmp_path / "other")
            await store.publish(tmp_path / "other", "other-config", numerics_version=numerics_version)
            Model(CONFIG, seed=2).save_pretrained(tmp_path / "alien")
            await store.publish(tmp_path / "alien", "alien-numerics", numerics_fingerprint="0" * 16)
        async with prefill_server(Model(CONFIG, seed=0), weights="v1", weight_store=store_address) as (server, replica):
            client = InferenceClient(server.address)
            try:
                for version, code in (("", grpc.StatusCode.INVALID_ARGUMENT),
                                      ("no-such-version", grpc.StatusCode.NOT_FOUND),
                                      ("other-config", grpc.StatusCode.FAILED_PRECONDITION),
                                      ("alien-numerics", grpc.StatusCode.FAILED_PRECONDITION)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.switch_weights(version)
                    assert err.value.code() is code, (version, err.value.details())
                    assert err.value.details()
                    assert (await client.info()).weights_version == "v1"
                    got = await client.score(InferenceRequest(prompt_ids=ids, options=opts))
                    assert torch.equal(torch.tensor(got.logprobs), torch.tensor(offline_score(v1, ids, opts)))
            finally:
                await client.close()
