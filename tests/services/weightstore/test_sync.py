"""Weight sync in place, the mechanism (zerokl.services.weightstore.sync): a version packed into one
shared buffer opens elsewhere with the same bits, or not at all (checksum, host, path checked); the
device checksum is exact; the descriptor survives its gRPC form (the converters) whole.
"""
from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.weightstore import sync
from zerokl.services.weightstore.convert import shared_export_from_proto, shared_export_to_proto
from zerokl.services.weightstore.shared import ChecksumMismatch, SharedCudaBuffer, SharedUnavailable
from zerokl.services.weightstore.sync import export_shared, open_shared

pytestmark = pytest.mark.timeout(120)

CONFIG = ModelConfig.preset("tiny")


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return Model(CONFIG, seed=seed, dtype=dtype).state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_then_open_gives_the_same_bits_and_catches_corruption(dtype: torch.dtype) -> None:
    state = _state(1, dtype)
    export = export_shared(state, "v2", "fp")
    try:
        desc = export.export
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
        foreign = dataclasses.replace(desc, host_id="elsewhere/0")
        with pytest.raises(SharedUnavailable):
            open_shared(foreign)
        bad = dataclasses.replace(desc, path="/etc/passwd")
        with pytest.raises(ValueError):
            open_shared(bad)
    finally:
        export.close()
    with pytest.raises(SharedUnavailable):
        open_shared(desc)           # released by the trainer


def test_sum64_the_device_checksum_is_exact_and_sees_moved_rows() -> None:
    buf = torch.randint(0, 256, (3 * (1 << 19),), dtype=torch.uint8)
    a = sync._sum64(buf)
    assert a == sync._sum64(buf.clone())
    words = buf.view(torch.int64).view(-1, 1 << 16).clone()
    swapped = words[[1, 0, 2]].reshape(-1).view(torch.uint8)     # two rows trade places: same plain sum
    assert sync._sum64(swapped) != a


_CHILD = """
import sys, torch
from safetensors.torch import save_file
from zerokl.services.weightstore.convert import shared_export_from_proto
from zerokl.services.weightstore.sync import open_shared
from zerokl.v1 import weights_pb2
desc = shared_export_from_proto(weights_pb2.SharedWeights.FromString(open(sys.argv[1], "rb").read()))
got = open_shared(desc, sys.argv[3])
assert all(t.device.type == sys.argv[3] for t in got.values())
if sys.argv[3] == "cpu":    # the record process: straight to the host, no device copy of the version
    assert torch.cuda.max_memory_allocated() < desc.total_bytes, torch.cuda.max_memory_allocated()
save_file({k: v.cpu().contiguous() for k, v in got.items()}, sys.argv[2])
"""


@pytest.mark.gpu
@pytest.mark.parametrize("reader", ["cuda", "cpu"])
def test_cuda_ipc_gives_another_process_the_trainers_exact_tensors(tmp_path: pathlib.Path, reader: str) -> None:
    """The GPU transport: CUDA IPC handles opened in another process, sum64 checked there: onto its device (as a
    replica does) or onto its host (as the record process does, with the checksum computed on the host)."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    state = {k: v.cuda() for k, v in _state(1, torch.bfloat16).items()}
    export = export_shared(state, "v2")
    try:
        assert export.export.transport == "cuda_ipc" and export.export.checksum.startswith("sum64:")
        (tmp_path / "desc.bin").write_bytes(shared_export_to_proto(export.export).SerializeToString())
        subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "desc.bin"), str(tmp_path / "got.safetensors"),
                        reader], check=True, timeout=300)
        got = load_file(str(tmp_path / "got.safetensors"))
        assert got.keys() == state.keys()
        for name, t in state.items():
            assert torch.equal(got[name], t.cpu()), name
    finally:
        export.close()


def test_the_descriptor_survives_its_grpc_form() -> None:
    export = export_shared(_state(1), "v2", "fp")
    try:
        desc = export.export
        assert shared_export_from_proto(shared_export_to_proto(desc)) == desc and desc.cuda is None
        assert export.ipc_references() is None      # a file in shared memory: no IPC reference count
        cuda = dataclasses.replace(desc, transport="cuda_ipc", path="", cuda=SharedCudaBuffer(
            1, b"h" * 64, 1 << 20, 512, b"r" * 16, 8, b"", True))
        assert shared_export_from_proto(shared_export_to_proto(cuda)) == cuda
    finally:
        export.close()


_OPEN_AND_LEAVE = """
import sys
from zerokl.services.weightstore.convert import shared_export_from_proto
from zerokl.services.weightstore.sync import open_shared
from zerokl.v1 import weights_pb2
open_shared(shared_export_from_proto(weights_pb2.SharedWeights.FromString(open(sys.argv[1], "rb").read())), "cuda")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("readers", [0, 1, 2])
def test_a_cuda_export_closed_after_its_readers_gives_its_memory_back(tmp_path: pathlib.Path, readers: int) -> None:
    """close(), once no reader opens the export again: its device memory is free whether no replica, one or two
    opened it. torch counts one IPC reference per share, unsigned, and each reader's release took one away: two
    readers (a replica and the record process) took it below zero, and the block stayed allocated in torch's IPC
    limbo until the trainer exited (23 GiB of the GLM-5 slice's co-located H100 at every step). Readers now leave
    the count alone; the trainer's close releases its one reference."""
    import gc
    import subprocess
    import sys
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    state = {k: v.cuda() for k, v in _state(3, torch.bfloat16).items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    export = export_shared(state, "v3")
    assert torch.cuda.memory_allocated() > before
    (tmp_path / "desc.bin").write_bytes(shared_export_to_proto(export.export).SerializeToString())
    for _ in range(readers):
        subprocess.run([sys.executable, "-c", _OPEN_AND_LEAVE, str(tmp_path / "desc.bin")], check=True, timeout=300)
    assert export.ipc_references() == 1     # the trainer's own: readers' releases leave it alone
    export.close()
    del export
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_storage_uses_counts_what_keeps_an_export_in_memory() -> None:
    """The trainer logs this when it closes a version: every view of the buffer keeps its memory (a CUDA export
    closed while something still views it stays allocated on the device)."""
    export = export_shared(_state(2), "v4")
    try:
        assert export.storage_uses() == 1
        views = export.tensors()
        assert export.storage_uses() >= 1 + len(views)      # each view (and the base a dtype view keeps)
        del views
        assert export.storage_uses() == 1
    finally:
        export.close()
    assert export.storage_uses() == 0
