"""The Triton interpreter's `tl.dot`, made exact so interpreted kernels keep their invariance.

Under TRITON_INTERPRET=1 Triton evaluates `tl.dot(a, b, acc)` as numpy's
`np.matmul(a, b) + acc`, and numpy hands the tile product to OpenBLAS. OpenBLAS picks its
kernels by CPU (its "core": SkylakeX, Haswell, Zen, ...) and by shape, and a row's sums come
out in a different order depending on where the row sits in the tile and on the other rows:
on a Haswell-core machine a column shard of `linear`, or a subset of attention heads, got
other bits than the full op (seen on an AMD EPYC without AVX-512; a SkylakeX core happened
not to show it). So the interpreter was not batch-invariant on every CPU, and a test of
Triton's invariance run on CPU was a test of OpenBLAS.

Here the tile product is the exact contraction of kernels/zerokl/kernels/portable.py (every product and
sum exact in float64 slices, rounded once to fp32), so an element of `tl.dot` depends only on
its row of `a` and column of `b`: on every CPU, at every tile position. The kernel's own
order (BLOCK_K chunks added to the fp32 accumulator, left to right) is untouched. GPUs never
run this: compiled kernels use the tensor cores' dot.
"""
from __future__ import annotations

import numpy as np
import torch

from zerokl.kernels.portable import contract

__all__ = ["install_exact_dot"]

_INSTALLED = False


def _exact_dot(original):
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        from triton.runtime.interpreter import TensorHandle

        acc = d.data
        # Only fp32 accumulation of float operands is ours (zerokl's kernels upcast every dot
        # operand to fp32 under the interpreter, kernels/zerokl/kernels/triton/_common.dot_in_fp32).
        if acc.dtype != np.float32 or a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        lhs = torch.from_numpy(np.ascontiguousarray(a.data))                    # [..., M, K]
        rhs = torch.from_numpy(np.ascontiguousarray(np.swapaxes(b.data, -1, -2)))  # [..., N, K]
        with torch.no_grad():
            product = contract(lhs, rhs).numpy()                                # [..., M, N] fp32
        return TensorHandle(product + acc, d.dtype.scalar)
    return create_dot


def install_exact_dot() -> None:
    """Replace the interpreter's tl.dot with the exact one (idempotent; interpreter only)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from triton.runtime import interpreter
    interpreter.InterpreterBuilder.create_dot = _exact_dot(interpreter.InterpreterBuilder.create_dot)
    _INSTALLED = True
