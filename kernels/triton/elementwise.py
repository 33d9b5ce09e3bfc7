"""Element-wise activations: `sigmoid` and `silu`, fp32 output.

sigmoid(x) = 1 / (1 + exp(-x)), silu(x) = x * sigmoid(x), both in fp32 (the torch backend's
formulas). Invariance by construction: the launch is 2-D over (row, column block) of the
[M, N] view, so an element's place in its block depends only on its column, never on M or
on the rows around it; and every lane runs the same instruction sequence anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_launchable, pow2_between, rows_2d

__all__ = ["sigmoid", "silu"]

EW_MAX_BLOCK = 1024


@triton.jit
def _act_kernel(x_ptr, y_ptr, N, stride_xm, stride_ym, SILU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    x = tl.load(x_ptr + row * stride_xm + c, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-x))
    if SILU:
        s = x * s
    tl.store(y_ptr + row * stride_ym + c, s, mask=mask)


def _run(op: str, x: torch.Tensor, silu: bool) -> torch.Tensor:
    check_float(op, "x", x)
    check_launchable(op, _act_kernel, x)
    x2 = rows_2d(x)
    m, n = x2.shape
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m and n:
        block = pow2_between(n, 16, EW_MAX_BLOCK)
        _act_kernel[(m, triton.cdiv(n, block))](
            x2, y, n, x2.stride(0), y.stride(0), SILU=silu, BLOCK=block, num_warps=4
        )
    return y.reshape(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32."""
    return _run("sigmoid", x, silu=False)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in fp32."""
    return _run("silu", x, silu=True)
