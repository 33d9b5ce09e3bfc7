"""Weight sync in place (issue 37): a version from the trainer's memory, bit for bit the store's.

On the CPU (shared memory: the same code path as CUDA IPC but for the transport; the mechanism itself
is tests/services/weightstore/test_sync.py), a replica switched in place holds exactly the tensors a
replica switched through the weight store (a real weight-store service on loopback) holds, and
generates the same tokens and logprobs. A descriptor a replica cannot use falls back to the store; a bad one gets a clear status
and the replica keeps serving its version.
"""
from __future__ import annotations

import asyncio
import dataclasses
import pathlib

import grpc
import pytest
import torch

from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels.model import Model
from zerokl.vocab import SamplingOptions
from zerokl.services.inference import InferenceClient
from zerokl.services.inference.types import GenerateResult, InferenceRequest
from zerokl.services.inference.weights import SWITCHES
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.sync import export_shared

from conftest import CONFIG, TOKENIZER, decode_server
from test_switch_weights import weight_store

pytestmark = pytest.mark.timeout(120)


def _switches(path: str) -> float:
    return SWITCHES.labels(path)._value.get()


async def _generate(address: str) -> GenerateResult:
    ids = tuple(TOKENIZER.encode("nums 3 5 2 target 16\n"))
    options = SamplingOptions(temperature=1.0, max_tokens=12, seed=5, n=2, ignore_eos=True)
    async with InferenceClient(address) as client:
        return GenerateResult.collect([d async for d in client.generate(
            InferenceRequest(prompt_ids=ids, options=options, weights_version="v2"))])


def test_an_in_place_switch_serves_exactly_what_the_store_switch_serves(tmp_path: pathlib.Path) -> None:
    asyncio.run(_in_place_vs_store(tmp_path))


async def _in_place_vs_store(tmp_path: pathlib.Path) -> None:
    v2 = Model(CONFIG, seed=1)
    export = export_shared(v2.state_dict(), "v2")
    try:
        async with weight_store(tmp_path / "store") as store_address:
            async with WeightStoreClient(store_address) as store:
                v2.save_pretrained(tmp_path / "v2")
                await store.publish(tmp_path / "v2", "v2", parent_version="v1", numerics_version=numerics_version)
            async with decode_server(Model(CONFIG, seed=0), weights="v1", weight_store=store_address) as (a, ra), \
                    decode_server(Model(CONFIG, seed=0), weights="v1", weight_store=store_address) as (b, rb):
                async with InferenceClient(a.address) as ca, InferenceClient(b.address) as cb:
                    # A bad descriptor: a clear status, nothing changed.
                    corrupt = dataclasses.replace(export.export, checksum="sha256:" + "0" * 64)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await ca.switch_weights("v2", shared=corrupt)
                    assert err.value.code() is grpc.StatusCode.DATA_LOSS
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await ca.switch_weights("v3", shared=export.export)
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                    assert (await ca.info()).weights_version == "v1"

                    shared_before, store_before = _switches("shared"), _switches("store")
                    assert (await ca.switch_weights("v2", shared=export.export)).weights_version == "v2"
                    assert (_switches("shared"), _switches("store")) == (shared_before + 1, store_before)
                    assert (await cb.switch_weights("v2")).weights_version == "v2"
                    assert _switches("store") == store_before + 1
                shared_state = ra.engine.engine.model.state_dict()
                store_state = rb.engine.engine.model.state_dict()
                assert shared_state.keys() == store_state.keys()
                for name in shared_state:
                    assert torch.equal(shared_state[name], store_state[name]), name
                x, y = await _generate(a.address), await _generate(b.address)
                assert x.weights_version == y.weights_version == "v2"
                assert [(s.token_ids, s.logprobs) for s in x.samples] == [(s.token_ids, s.logprobs) for s in y.samples]
    finally:
        export.close()


def test_a_replica_that_cannot_open_the_memory_waits_for_the_store_record(tmp_path: pathlib.Path) -> None:
    asyncio.run(_falls_back(tmp_path))


async def _falls_back(tmp_path: pathlib.Path) -> None:
    v2 = Model(CONFIG, seed=1)
    export = export_shared(v2.state_dict(), "v2")
    foreign = dataclasses.replace(export.export, host_id="another-host/0")     # as a replica on another host sees it
    try:
        async with weight_store(tmp_path / "store") as store_address:
            async with decode_server(Model(CONFIG, seed=0), weights="v1", weight_store=store_address) as (a, ra):
                async with InferenceClient(a.address) as ca, WeightStoreClient(store_address) as store:
                    switching = asyncio.ensure_future(ca.switch_weights("v2", shared=foreign))
                    await asyncio.sleep(0.5)
                    assert not switching.done()     # v2 is not in the store yet: the replica waits for it
                    v2.save_pretrained(tmp_path / "v2")
                    await store.publish(tmp_path / "v2", "v2", parent_version="v1", numerics_version=numerics_version)
                    assert (await switching).weights_version == "v2"
                got = ra.engine.engine.model.state_dict()
                for name, t in v2.state_dict().items():
                    assert torch.equal(got[name], t), name
    finally:
        export.close()
