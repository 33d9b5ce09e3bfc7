"""Page-locked host tensors of exactly the size asked for: the offloaded optimizer's state.

torch's pinned allocator (``pin_memory=True``, its CachingHostAllocator) rounds every block up to the
next power of two and keeps freed blocks cached. For the trainer's offloaded AdamW state that is
memory nobody uses: the GLM-5 2-layer slice's bf16 parameters are 22.69 GiB, and one moment of each
in power-of-two blocks is 29.65 GiB (its 6 GiB expert stacks become 8), so its two moments pin 59.3
GiB instead of 45.4 on a host that also holds the record process's copy of each version. (vLLM's
CPU offload and SGLang's host caches met the same rounding and pin exact sizes the same way.)

Here a tensor's memory is an anonymous ``mmap`` of its exact size (page-aligned, zero-filled by the
kernel), registered with the CUDA driver (``cudaHostRegister``): the GPU's copy engines read and write
it asynchronously like any pinned memory, and ``Tensor.is_pinned()`` is true. The registration and
the mapping end when the tensor's storage is freed: the storage keeps the ctypes view of the mapping
alive (``torch.frombuffer``), whose finalizer unregisters and unmaps it. Without CUDA the tensors are
plain host memory (there is nothing to pin for).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import weakref

import torch

__all__ = ["pinned_copy", "pinned_zeros"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _release(address: int, length: int) -> None:
    """The end of one mapping: unregistered from the driver first (it must not outlive the pages), then unmapped."""
    torch.cuda.cudart().cudaHostUnregister(address)
    _libc.munmap(address, length)


def _registered_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor [nbytes] over a fresh anonymous mapping registered with the CUDA driver (zeros)."""
    length = max(nbytes, 1)     # mmap refuses 0 bytes; a 0-element tensor views one unused byte
    address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if address in (None, _MAP_FAILED):
        raise MemoryError(f"could not map {length} bytes of host memory (errno {ctypes.get_errno()})")
    # Flag 1, cudaHostRegisterPortable: pinned for every CUDA context, as torch's own registrations are.
    error = torch.cuda.cudart().cudaHostRegister(address, length, 1)
    if int(error) != 0:
        _libc.munmap(address, length)
        raise RuntimeError(f"cudaHostRegister of {length} bytes of host memory failed (CUDA error {int(error)}); "
                           "is the memory-lock limit (ulimit -l) too low?")
    view = (ctypes.c_uint8 * length).from_address(address)
    weakref.finalize(view, _release, address, length)
    return torch.frombuffer(view, dtype=torch.uint8)[:nbytes]


def pinned_zeros(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` and ``dtype`` in page-locked host memory of exactly their bytes (plain host memory without
    CUDA)."""
    if not torch.cuda.is_available():
        return torch.zeros(shape, dtype=dtype)
    return _registered_bytes(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in page-locked host memory of exactly its bytes (for asynchronous copies both ways)."""
    out = pinned_zeros(t.shape, t.dtype)
    out.copy_(t)
    return out
