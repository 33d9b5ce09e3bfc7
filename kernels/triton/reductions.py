"""Row reductions over the last dim: `softmax`, `log_softmax` (fp32 out) and `row_sum`.

One row per program. Long rows (a 154,880-token vocabulary) are walked in BLOCK-wide chunks
(BLOCK from the row length only) in ascending order:
  pass 1: running element-wise max over chunks, then tl.max  (max is order-free and exact);
  pass 2: element-wise fp32 sum of exp(x - max) over chunks, then one tl.sum (fixed tree);
  pass 3: write exp(x - max) / sum, or (x - max) - log(sum).
A row's bits depend only on the row: nothing reads another row and no shape depends on M.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_launchable, pow2_between, rows_2d

__all__ = ["SOFTMAX_MAX_BLOCK", "log_softmax", "row_sum", "softmax"]

SOFTMAX_MAX_BLOCK = 4096  # chunk width for long rows (vocab 154880 -> 38 chunks)


def _launch_params(n: int) -> tuple[int, int]:
    block = pow2_between(n, 16, SOFTMAX_MAX_BLOCK)
    return block, 4 if block <= 1024 else 8


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, N, stride_xm, stride_ym, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, BLOCK)
    mx = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        x = tl.load(x_row + c, mask=c < N, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, x)
    m = tl.max(mx, axis=0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        x = tl.load(x_row + c, mask=mask, other=float("-inf")).to(tl.float32)
        acc += tl.where(mask, tl.exp(x - m), 0.0)
    total = tl.sum(acc, axis=0)
    if LOG:
        log_total = tl.log(total)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            y = (x - m) - log_total
        else:
            y = tl.exp(x - m) / total
        tl.store(y_row + c, y, mask=mask)


@triton.jit
def _row_sum_kernel(x_ptr, y_ptr, N, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        acc += tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + row, tl.sum(acc, axis=0))


def _run(op: str, x: torch.Tensor, log: bool) -> torch.Tensor:
    check_float(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim, got a scalar")
    check_launchable(op, _softmax_kernel, x)
    n = x.shape[-1]
    x2 = rows_2d(x)
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] and n:
        block, warps = _launch_params(n)
        _softmax_kernel[(x2.shape[0],)](x2, y, n, x2.stride(0), y.stride(0), LOG=log, BLOCK=block, num_warps=warps)
    return y.reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; fp32 output."""
    return _run("softmax", x, log=False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim: (x - max) - log(sum(exp(x - max))); fp32 output."""
    return _run("log_softmax", x, log=True)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in fp32 with a fixed per-row order; shape x.shape[:-1]."""
    check_float("row_sum", "x", x)
    if x.dim() < 1:
        raise ValueError("row_sum: x must have at least 1 dim, got a scalar")
    check_launchable("row_sum", _row_sum_kernel, x)
    n = x.shape[-1]
    x2 = rows_2d(x)
    y = torch.zeros(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0] and n:
        block, warps = _launch_params(n)
        _row_sum_kernel[(x2.shape[0],)](x2, y, n, x2.stride(0), BLOCK=block, num_warps=warps)
    return y.reshape(x.shape[:-1])
