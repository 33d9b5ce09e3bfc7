"""What names a weights version shared in place: the descriptor a replica opens (:mod:`.sync`), and the
errors of opening it.

Plain data, no torch: the weight store's converters (:mod:`.convert`) turn it into a
``zerokl.v1.SharedWeights`` and back at the service edges (the trainer's SaveWeights answer, a
replica's SwitchWeights), and the weight-store server imports them without torch; so does a replica's
server whose engine (in a child process) opens the memory and reports these errors back to it.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SharedExport", "SharedTensor", "SharedCudaBuffer", "SharedUnavailable", "ChecksumMismatch"]


class SharedUnavailable(RuntimeError):
    """The shared weights cannot be opened here (another host, no IPC, the memory gone): use the store."""


class ChecksumMismatch(RuntimeError):
    """What arrived is not what was sent: never served."""


@dataclass(frozen=True)
class SharedTensor:
    """Where one tensor of a shared version lies in its flat buffer."""

    name: str
    dtype: str                      # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int                     # bytes into the flat buffer (64-byte aligned)


@dataclass(frozen=True)
class SharedCudaBuffer:
    """The IPC handles of a CUDA allocation: torch's ``UntypedStorage._share_cuda_()`` fields."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class SharedExport:
    """One version in the trainer's memory, as a replica on its host opens it (:func:`open_shared`).

    Plain data (picklable: it crosses to a replica's engine process); ``transport`` is ``cpu_shm``
    (``path`` names the shared-memory file) or ``cuda_ipc`` (``cuda`` holds the handles).
    """

    version: str
    host_id: str                    # hostname + boot id of the trainer's host
    transport: str
    total_bytes: int                # the flat buffer every tensor lives in
    checksum: str                   # "<algorithm>:<hex>" over the flat buffer
    tensors: tuple[SharedTensor, ...]   # the serving state dict, in order
    numerics_fingerprint: str = ""  # the fingerprint the trainer trained under
    path: str = ""
    cuda: SharedCudaBuffer | None = None
