"""Shared helpers for the Triton backend: argument checks, launch guards, block-size helpers.

Nothing here decides a reduction order; each kernel module documents its own.
"""
from __future__ import annotations

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else triton.next_power_of_2(int(n))


def pow2_between(n: int, lo: int, hi: int) -> int:
    """next_pow2(n) clamped to [lo, hi] (lo, hi powers of two)."""
    return max(lo, min(hi, next_pow2(n)))


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (runs on CPU through numpy)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(op: str, kernel, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device can run `kernel`. Returns the device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    dev = devices.pop()
    if dev.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"{op}: Triton kernels need CUDA tensors (got {dev}); on CPU set TRITON_INTERPRET=1 "
            "before zerokl.kernels.triton is imported, or use the torch backend"
        )
    return dev


def check_float(op: str, name: str, t: torch.Tensor, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_index(op: str, name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: {name} must be int64 or int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether a 2-D operand can be a TMA tensor descriptor's: unit last stride, base and row stride in
    bytes multiples of 16 (the tensor memory accelerator's rule)."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


_MULTIPROCESSORS: dict[int, int] = {}


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 SXM / H200), cached: a persistent grid's
    size. Off CUDA (the interpreter) 4, so the CPU tests walk several tiles a program."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """`t` with stride 1 in its last dim (a copy only when needed; a copy never changes bits)."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """View `t` [..., N] as [M, N] with a unit last stride, copying only if no such view exists."""
    n = t.shape[-1] if t.dim() else 1
    t = unit_last(t)
    if t.dim() == 2:
        return t
    if t.dim() == 0:
        return t.reshape(1, 1)
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.contiguous().view(-1, n)


def dot_in_fp32(kernel, *dtypes: torch.dtype) -> bool:
    """Whether a kernel's tl.dot operands are upcast to fp32 (then dotted with input_precision="ieee").

    fp32 operands always; mixed operand dtypes; and every dtype under the interpreter, whose
    numpy-backed tl.dot cannot multiply bf16 (held as uint16). bf16/fp16 products are exact in
    fp32, so upcasting never changes what is being summed, only the speed.
    """
    return is_interpreted(kernel) or any(d == torch.float32 for d in dtypes) or len(set(dtypes)) > 1
