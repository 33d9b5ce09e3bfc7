"""Weight sync in place (issue 37): a version from the trainer's memory, bit for bit the store's.

The mechanism on the CPU (shared memory: the same code path as CUDA IPC but for the transport):
export -> open gives torch.equal tensors, a corrupted byte or a foreign host is caught before
serving, and a replica switched in place holds exactly the tensors a replica switched through the
weight store (a real weight-store service on loopback) holds, and generates the same tokens and
logprobs. A descriptor a replica cannot use falls back to the store; a bad one gets a clear status
and the replica keeps serving its version.
"""
from __future__ import annotations

import asyncio
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
from zerokl.services import weightsync
from zerokl.services.weightsync import ChecksumMismatch, SharedUnavailable, export_shared, open_shared

from conftest import CONFIG, TOKENIZER, decode_server
from test_switch_weights import weight_store

pytestmark = pytest.mark.timeout(120)


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return Model(CONFIG, seed=seed, dtype=dtype).state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_then_open_gives_the_same_bits_and_catches_corruption(dtype: torch.dtype) -> None:
    state = _state(1, dtype)
    export = export_shared(state, "v2", "fp")
    try:
        desc = export.descriptor
        assert desc.transport == "cpu_shm" and desc.checksum.startswith("sha256:")
        got = open_shared(desc)
        assert list(got) == list(state)
        for name, t in state.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        # The receiver holds its own copy: the trainer dropping (or reusing) its buffer changes nothing.
        export.buffer[: desc.total_bytes // 2].fill_(0xFF)
        assert all(torch.equal(got[n], t) for n, t in state.items())
        with pytest.raises(ChecksumMismatch):
            open_shared(desc)       # what arrives now is not what was sent
        foreign = type(desc)()
        foreign.CopyFrom(desc)
        foreign.host_id = "elsewhere/0"
        with pytest.raises(SharedUnavailable):
            open_shared(foreign)
        bad = type(desc)()
        bad.CopyFrom(desc)
        bad.path = "/etc/passwd"
        with pytest.raises(ValueError):
            open_shared(bad)
    finally:
        export.close()
    with pytest.raises(SharedUnavailable):
        open_shared(desc)           # released by the trainer


def test_sum64_the_device_checksum_is_exact_and_sees_moved_rows() -> None:
    buf = torch.randint(0, 256, (3 * (1 << 19),), dtype=torch.uint8)
    a = weightsync._sum64(buf)
    assert a == weightsync._sum64(buf.clone())
    words = buf.view(torch.int64).view(-1, 1 << 16).clone()
    swapped = words[[1, 0, 2]].reshape(-1).view(torch.uint8)     # two rows trade places: same plain sum
    assert weightsync._sum64(swapped) != a


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
                    corrupt = type(export.descriptor)()
                    corrupt.CopyFrom(export.descriptor)
                    corrupt.checksum = "sha256:" + "0" * 64
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await ca.switch_weights("v2", shared=corrupt)
                    assert err.value.code() is grpc.StatusCode.DATA_LOSS
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await ca.switch_weights("v3", shared=export.descriptor)
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                    assert (await ca.info()).weights_version == "v1"

                    shared_before, store_before = _switches("shared"), _switches("store")
                    assert (await ca.switch_weights("v2", shared=export.descriptor)).weights_version == "v2"
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
    foreign = type(export.descriptor)()
    foreign.CopyFrom(export.descriptor)
    foreign.host_id = "another-host/0"      # as a replica on another host sees it
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


_CHILD = """
import sys, torch
from safetensors.torch import save_file
from zerokl.services.weightsync import open_shared
from zerokl.v1 import weights_pb2
desc = weights_pb2.SharedWeights.FromString(open(sys.argv[1], "rb").read())
got = open_shared(desc, "cuda")
assert all(t.is_cuda for t in got.values())
save_file({k: v.cpu().contiguous() for k, v in got.items()}, sys.argv[2])
"""


@pytest.mark.gpu
def test_cuda_ipc_gives_another_process_the_trainers_exact_tensors(tmp_path: pathlib.Path) -> None:
    """The GPU transport: CUDA IPC handles opened in another process (as a replica does), sum64 checked."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    state = {k: v.cuda() for k, v in _state(1, torch.bfloat16).items()}
    export = export_shared(state, "v2")
    try:
        assert export.descriptor.transport == "cuda_ipc" and export.descriptor.checksum.startswith("sum64:")
        (tmp_path / "desc.bin").write_bytes(export.descriptor.SerializeToString())
        subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "desc.bin"), str(tmp_path / "got.safetensors")],
                       check=True, timeout=300)
        got = load_file(str(tmp_path / "got.safetensors"))
        assert got.keys() == state.keys()
        for name, t in state.items():
            assert torch.equal(got[name], t.cpu()), name
    finally:
        export.close()
