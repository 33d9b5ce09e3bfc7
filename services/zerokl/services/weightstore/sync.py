"""Weight sync in place: a new weights version from the trainer's memory to the replicas on its host.

The trainer packs its serving state dict (the tensors a replica loads: bf16 when the fleet
serves bf16, LoRA merged) into ONE flat uint8 buffer, each tensor at a 64-byte aligned offset,
and shares that buffer:

- ``cuda_ipc``: the buffer is a CUDA allocation on the trainer's device; a replica opens it
  with the IPC handles of ``UntypedStorage._share_cuda_()`` (what torch.multiprocessing
  sends between processes; :func:`open_shared` rebuilds it as ``rebuild_cuda_tensor`` does)
  and copies device to device;
- ``cpu_shm``: the buffer is a file in shared memory (``/dev/shm``), mapped by both sides
  (the same path on a CPU fleet, so CI exercises the mechanism).

What travels is only the descriptor (:class:`~zerokl.services.weightstore.shared.SharedExport`: transport, handles or path, per-tensor
name/dtype/shape/offset, the buffer's checksum; over gRPC a ``zerokl.v1.SharedWeights``, converted
at the service edges by :mod:`zerokl.services.weightstore.convert`). The receiver copies the bytes into a buffer of its own, recomputes the checksum over what it
received and refuses a mismatch (:class:`~zerokl.services.weightstore.shared.ChecksumMismatch`, DATA_LOSS)
before any byte is served. A replica on another host, or one that cannot open the memory, raises
:class:`~zerokl.services.weightstore.shared.SharedUnavailable` and the caller falls back to the weight store,
which records the same version (asynchronously, for resume and audit). The tensors are the bytes the trainer
holds, so they are bit for bit what a store round trip gives (safetensors keeps raw bytes).

Checksums: ``sha256`` over the bytes where they are on the host (CPU); on CUDA, hashing on the
host would copy the whole buffer back, so ``sum64`` is an exact integer checksum computed on
the device: the buffer as int64 words in rows of 2^16, each row summed (integer addition:
any order gives the same bits), the row sums weighted by odd multipliers 2r+1 and summed, all
modulo 2^64. It catches corrupted or truncated transfers and misplaced rows, not an adversary
(the descriptor only comes over an authenticated peer RPC).

CUDA IPC lifetime: the trainer owns it. torch counts one reference per ``_share_cuda_`` and lets each
reader's release take one away; a block freed with its count above zero stays allocated in torch's IPC
"limbo". The count is unsigned: an export that two readers open (a replica and the record process, or two
replicas) goes below zero, reads as 2^64 - 1, and its block stays allocated until the trainer exits (23 GiB
of the GLM-5 slice's co-located H100 at every step: the first backward ran out of memory). So a reader
opens the handle with no counter of its own (:data:`_NO_COUNTER`: its release touches nothing), and
:meth:`SharedBuffer.close` releases the share's one reference itself: the memory goes when the trainer
closes the version. The trainer closes a version only once its readers are done with it: a co-located one
before the backward that needs the memory (each replica copied it in its switch, each record said so), any
other after two newer versions (a replica copies one at its switch; a record holds its export until copied).
A reader later than that copies reused memory, and the checksum refuses it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import socket
import tempfile
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from zerokl.kernels.dtypes import dtype_name
from zerokl.services.weightstore.shared import (ChecksumMismatch, SharedCudaBuffer, SharedExport, SharedTensor,
                                                SharedUnavailable)

__all__ = ["SharedBuffer", "export_shared", "open_shared", "copy_checked", "host_id",
           "checksum", "SHM_PREFIX"]

log = logging.getLogger(__name__)

_ALIGN = 64                     # bytes: every tensor view starts aligned for any dtype's loads
_ROW_WORDS = 1 << 16            # sum64: int64 words per row
SHM_PREFIX = "zerokl-weights-"  # the only files cpu_shm opens (a descriptor cannot name others)
_IPC_COUNTER_HEADER = 64        # bytes before the counters in torch's ref-counter file (RefcountedMapAllocator)
# A reader's ref-counter handle: no such shared-memory file, so the release of what it opened decrements nothing
# (torch's deleter skips a counter file it cannot open: a producer that exited first). See the module docstring.
_NO_COUNTER = b"/zerokl-reader-holds-no-reference"


def host_id() -> str:
    """This host's identity: hostname and boot id (a container on the same host shares the boot id)."""
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _shm_dir() -> pathlib.Path:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else pathlib.Path(tempfile.gettempdir())


def checksum(buffer: torch.Tensor) -> str:
    """``"<algorithm>:<hex>"`` of a flat uint8 buffer: sha256 on the CPU, sum64 on CUDA (module docstring)."""
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    if buffer.device.type == "cpu":
        return "sha256:" + hashlib.sha256(memoryview(buffer.numpy())).hexdigest()
    return "sum64:" + format(_sum64(buffer), "016x")


def _sum64(buffer: torch.Tensor) -> int:
    """Exact on-device integer checksum; ``buffer``'s length is a multiple of 8 (export pads it)."""
    words = buffer.view(torch.int64)                        # [n]
    full = words.numel() // _ROW_WORDS * _ROW_WORDS
    rows = words[:full].view(-1, _ROW_WORDS).sum(dim=1, dtype=torch.int64)   # [n // 2^16], wraps modulo 2^64
    if full < words.numel():    # the last, short row (as if zero-padded: no copy of the buffer)
        rows = torch.cat([rows, words[full:].sum(dtype=torch.int64).view(1)])
    weights = torch.arange(rows.numel(), device=rows.device, dtype=torch.int64) * 2 + 1
    return int((rows * weights).sum(dtype=torch.int64).item()) & (2**64 - 1)


def _check(expected: str, buffer: torch.Tensor) -> None:
    """ChecksumMismatch unless ``buffer`` has checksum ``expected`` (recomputed by its algorithm)."""
    algorithm = expected.split(":", 1)[0]
    if algorithm == "sha256":
        got = checksum(buffer.cpu())
    elif algorithm == "sum64":
        got = "sum64:" + format(_sum64(buffer), "016x")   # integer sums: the same bits on any device
    else:
        raise ChecksumMismatch(f"unknown checksum algorithm {algorithm!r}")
    if got != expected:
        raise ChecksumMismatch(f"the shared weights arrived with checksum {got}, the trainer sent {expected}")


@dataclass
class SharedBuffer:
    """One version the trainer shares: its export (what is sent) and the memory behind it (kept alive
    until :meth:`close`)."""

    export: SharedExport
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.export.total_bytes

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shared tensors, as views of the buffer (they keep its memory alive after :meth:`close`)."""
        return _views(self.buffer, self.export.tensors)

    def ipc_references(self) -> int | None:
        """CUDA: the share's IPC reference count now, read from torch's counter file (``/dev/shm`` + the handle: a
        64-byte header, then int64 counters): 1 until :meth:`close` (readers never change it). None elsewhere, or
        when the file is gone."""
        c = self.export.cuda
        if self.export.transport != "cuda_ipc" or c is None:
            return None
        path = _shm_dir() / c.ref_counter_handle.decode(errors="replace").lstrip("/")
        try:
            with open(path, "rb") as f:
                f.seek(_IPC_COUNTER_HEADER + 8 * c.ref_counter_offset)
                raw = f.read(8)
        except OSError:
            return None
        return int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else None

    def storage_uses(self) -> int:
        """How many holders the buffer's memory has in this process: 1 is the buffer alone; each tensor viewing it
        (and each C++ holder) adds one. Above 1 at :meth:`close`, the memory stays until they let go."""
        if self.buffer.numel() == 0:
            return 0
        return torch._C._storage_Use_Count(self.buffer.untyped_storage()._cdata) - 1   # less the storage asked

    def close(self) -> None:
        """Drop this process's hold on the shared memory. On CUDA the share's one IPC reference goes too (module
        docstring), so the memory is free once nothing here views it: call it when no reader will open it again."""
        if self.export.transport == "cpu_shm":
            with _suppress_oserror():
                os.unlink(self.export.path)
        release = self.export.transport == "cuda_ipc" and self.export.cuda is not None and self.buffer.numel() > 0
        if release:
            c = self.export.cuda
            torch.UntypedStorage._release_ipc_counter_cuda(c.ref_counter_handle, c.ref_counter_offset)
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if release:
            torch.cuda.ipc_collect()        # a block already in the limbo goes now (its count reached zero)


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:  # noqa: ANN001
        return kind is not None and issubclass(kind, OSError)


def _layout(state: Mapping[str, torch.Tensor]) -> tuple[tuple[SharedTensor, ...], int]:
    entries, offset = [], 0
    for name, t in state.items():
        entries.append(SharedTensor(name, dtype_name(t.dtype), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return tuple(entries), offset


def _views(buffer: torch.Tensor, tensors: Iterable[SharedTensor]) -> dict[str, torch.Tensor]:
    """Each tensor as a view of ``buffer`` (no copy)."""
    out = {}
    for e in tensors:
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {e.name!r}: unknown dtype {e.dtype!r}")
        shape = tuple(int(s) for s in e.shape)
        count = 1
        for s in shape:
            count *= s
        size = count * torch.empty(0, dtype=dtype).element_size()
        if e.offset % _ALIGN or e.offset + size > buffer.numel():
            raise ValueError(f"tensor {e.name!r}: offset {e.offset} + {size} bytes outside the "
                             f"{buffer.numel()}-byte buffer")
        out[e.name] = buffer[e.offset:e.offset + size].view(dtype).view(shape)
    return out


def export_shared(state: Mapping[str, torch.Tensor], version: str, numerics_fingerprint: str = "",
                  device: torch.device | None = None) -> SharedBuffer:
    """Pack ``state`` (name -> tensor) into one shared buffer on ``device`` (default: the tensors').

    Cost on the critical path: one device copy of the serving bytes and the checksum.
    """
    device = torch.device(device) if device is not None else next(iter(state.values())).device
    entries, total = _layout(state)
    total = max(total, 8)
    path = ""
    if device.type == "cuda":
        buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        transport = "cuda_ipc"
    elif device.type == "cpu":
        shm = _shm_dir() / f"{SHM_PREFIX}{uuid.uuid4().hex}"
        shm.touch(mode=0o600)
        buffer = torch.from_file(str(shm), shared=True, size=total, dtype=torch.uint8)
        buffer.zero_()      # the padding between tensors too: the checksum covers every byte
        transport, path = "cpu_shm", str(shm)
    else:
        raise SharedUnavailable(f"no in-place transport for {device.type} tensors")
    with torch.no_grad():
        for e, t in zip(entries, state.values(), strict=True):
            n = t.numel() * t.element_size()
            buffer[e.offset:e.offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    digest = checksum(buffer)
    cuda = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)      # the bytes are in place before any importer reads them
        (dev, handle, size, offset, rc_handle, rc_offset, event, sync) = buffer.untyped_storage()._share_cuda_()
        cuda = SharedCudaBuffer(int(dev), bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
                                bytes(event or b""), bool(sync))
    export = SharedExport(version, host_id(), transport, total, digest, entries, numerics_fingerprint, path, cuda)
    return SharedBuffer(export, buffer)


def open_shared(desc: SharedExport, device: torch.device | str = "cpu",
                copied: Callable[[], None] | None = None, into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The shared version's tensors, copied into memory of our own on ``device`` and checked.

    ``copied``: called once the bytes are ours, before they are checked (the trainer may free its buffer then:
    a host reader's checksum of the GLM-5 slice takes seconds on the host). ``into``: the memory of our own, a
    uint8 tensor of the export's ``total_bytes`` on ``device`` (the record process's buffer whose pages it gives
    back as it builds the files from them); default a new one.

    Raises :class:`SharedUnavailable` (another host, no CUDA here, the memory gone: fall back to the
    store), :class:`ChecksumMismatch` (never serve them) and ValueError (a malformed descriptor).
    """
    device = torch.device(device)
    if desc.host_id != host_id():
        raise SharedUnavailable(f"shared on host {desc.host_id!r}, this is {host_id()!r}")
    total = int(desc.total_bytes)
    if into is not None and (into.dtype != torch.uint8 or into.numel() != total or into.device != device):
        raise ValueError(f"open_shared into a {into.dtype} tensor of {into.numel()} on {into.device}: "
                         f"wants uint8 of {total} on {device}")

    def own() -> torch.Tensor:
        return into if into is not None else torch.empty(total, dtype=torch.uint8, device=device)
    if desc.transport == "cpu_shm":
        path = pathlib.Path(desc.path)
        if not path.name.startswith(SHM_PREFIX) or path.parent != _shm_dir():
            raise ValueError(f"shared path {desc.path!r} is not a zerokl shared-memory file")
        try:
            if path.stat().st_size != total:
                raise SharedUnavailable(f"{path} holds {path.stat().st_size} bytes, the descriptor says {total}")
            mapped = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        except (OSError, RuntimeError) as err:
            raise SharedUnavailable(f"cannot map {path}: {err}") from None
        received = own()
        received.copy_(mapped)      # ours now: the trainer may drop its buffer at any time
        del mapped
    elif desc.transport == "cuda_ipc":
        if not torch.cuda.is_available():
            raise SharedUnavailable("a CUDA IPC buffer and no CUDA here")
        if desc.cuda is None:   # no handles to open, as handles that do not open: the store has the version
            raise SharedUnavailable("a CUDA IPC export without its handles")
        c = desc.cuda
        try:
            torch.cuda._lazy_init()
            # _NO_COUNTER: this reader's release leaves the share's count alone (the trainer owns it).
            storage = torch.UntypedStorage._new_shared_cuda(
                c.device, c.handle, c.storage_size_bytes, c.storage_offset_bytes, _NO_COUNTER, 0,
                c.event_handle or None, c.event_sync_required)
        except (RuntimeError, TypeError) as err:
            raise SharedUnavailable(f"cannot open the CUDA IPC handle: {err}") from None
        # As rebuild_cuda_tensor does: a tensor over the opened storage (offset 0, the whole buffer).
        shared = torch.empty(0, dtype=torch.uint8, device=f"cuda:{c.device}")
        shared.set_(storage, 0, (total,), (1,))
        # Straight to ``device``: a host reader (the record process) makes no device copy of the version (23 GiB
        # of the GLM-5 slice beside a co-located trainer and replica); sum64 is the same integer on the host.
        received = own()
        received.copy_(shared)
        torch.cuda.synchronize(device if device.type == "cuda" else c.device)
        del shared, storage     # closes the mapping (the share's count is the trainer's: see _NO_COUNTER)
    else:
        raise ValueError(f"unknown shared-weights transport {desc.transport!r}")
    if copied is not None:
        copied()
    _check(desc.checksum, received)
    return _views(received, desc.tensors)


def copy_checked(shared: SharedBuffer, device: torch.device | str = "cpu",
                 copied: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a version this process shares, copied out of its shared memory into memory of our own on
    ``device`` and checked against the checksum the export was sent with, as a reader's :func:`open_shared` checks
    what it copied: what a later change of the shared memory (a stray writer, memory reused) cannot reach, or
    :class:`ChecksumMismatch` when the bytes are no longer those the readers were sent.

    ``copied``: called once the bytes are ours, before they are checked (the export may be closed then)."""
    received = torch.empty(shared.buffer.numel(), dtype=torch.uint8, device=device)
    received.copy_(shared.buffer)
    if shared.buffer.is_cuda:
        torch.cuda.synchronize(shared.buffer.device)
    if copied is not None:
        copied()
    _check(shared.export.checksum, received)
    return _views(received, shared.export.tensors)
