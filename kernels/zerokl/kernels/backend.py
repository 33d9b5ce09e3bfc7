"""The one place where the kernel backend is chosen.

`torch` runs everywhere (the embedded CPU default); `triton` is the GPU default
and runs on CPU under TRITON_INTERPRET=1 (how CI tests it). Bits are promised
equal within a backend, never across backends. `stock` is plain non-invariant torch:
the baseline for benchmarks and the mismatched arm of experiments, never a default.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from types import ModuleType
from typing import Iterator

import torch

# The CPU backends load with the library; the Triton package is imported on first use only
# (backend_module): TRITON_INTERPRET must be set before it loads, and a CPU host may lack it.
from zerokl.kernels import stock_ops, torch_ops

__all__ = ["BACKENDS", "INVARIANT_BACKENDS", "default_backend", "get_backend", "use_backend", "backend_module", "device_name"]

INVARIANT_BACKENDS = ("torch", "triton")   # the ones with a fingerprint and the guarantee
BACKENDS = INVARIANT_BACKENDS + ("stock",)

_active: contextvars.ContextVar[str | None] = contextvars.ContextVar("zerokl_backend", default=None)


def _exact_interpreter_dot() -> None:
    """Under TRITON_INTERPRET=1 make the interpreter's tl.dot the exact contraction
    (kernels/zerokl/kernels/interpreter.py). Runs when this module loads and again before the Triton package
    is first imported (it sets the variable on a CPU), so it precedes every Triton kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from zerokl.kernels.interpreter import install_exact_dot
        install_exact_dot()


_exact_interpreter_dot()


def default_backend() -> str:
    """ZEROKL_BACKEND if set, else triton on CUDA machines and torch elsewhere."""
    name = os.environ.get("ZEROKL_BACKEND")
    if name:
        if name not in BACKENDS:
            raise ValueError(f"ZEROKL_BACKEND={name!r}: expected one of {BACKENDS}")
        return name
    return "triton" if torch.cuda.is_available() else "torch"


def get_backend() -> str:
    """The backend the current context computes with."""
    return _active.get() or default_backend()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Compute with `name` inside the block: `with use_backend("triton"): ...`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: expected one of {BACKENDS}")
    token = _active.set(name)
    try:
        yield
    finally:
        _active.reset(token)


def backend_module(name: str | None = None) -> ModuleType:
    """The module implementing the ops for `name` (default: the active backend)."""
    name = name or get_backend()
    if name == "torch":
        return torch_ops
    if name == "stock":
        return stock_ops
    if not torch.cuda.is_available():
        # Triton decides at decoration time whether to interpret: set it before import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _exact_interpreter_dot()
    from zerokl.kernels import triton as triton_ops
    return triton_ops


def device_name(device: torch.device | str | None = None, backend: str | None = None) -> str:
    """What determines the bits on this device for `backend` (default: the active one): the
    device part of a fingerprint key.

    * CUDA: the compute capability, e.g. ``cuda-sm90``.
    * CPU, torch backend: ``cpu``. Its ops are built from IEEE basic operations and exact sums
      (kernels/zerokl/kernels/portable.py), so every CPU computes the same bits, whatever its vendor or ISA.
    * CPU, triton backend: the interpreter evaluates Triton ops with numpy, whose exp/log are
      dispatched by numpy's SIMD target, so the key names it, e.g. ``cpu-interp-numpy2.4-AVX2``.
      (tl.dot is the exact contraction there, kernels/zerokl/kernels/interpreter.py: BLAS plays no part.)
    * CPU, stock backend (not fingerprinted): ATen's capability, e.g. ``cpu-avx512``.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    backend = backend or get_backend()
    if backend == "torch":
        return "cpu"
    if backend == "triton":
        return f"cpu-interp-{_numpy_dispatch()}"
    return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


def _numpy_dispatch() -> str:
    """numpy's version and the best SIMD target its dispatcher found here."""
    import numpy

    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:                                      # numpy < 2
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    found = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    simd = found[-1] if found else "baseline"
    version = ".".join(numpy.__version__.split(".")[:2])
    return f"numpy{version}-{simd}"
