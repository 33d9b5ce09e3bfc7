"""Sampling's row scan: `row_cumsum`, the inclusive prefix sums of each row (top-p's prefix mass).

One row per program; nothing reads another row and no launch parameter depends on the
number of rows. The row is walked in BLOCK-wide chunks (BLOCK from the row length only) in
ascending order. Each chunk is upcast to fp64 and scanned by one `tl.associative_scan`
(a fixed tree for the fixed BLOCK and warp count); the running fp64 carry (every element
before the chunk, added chunk by chunk in order) is added to the chunk's scan, and each
prefix is rounded once to fp32. A row's bits therefore depend only on the row: alone, in
any batch, at any position (torch.cumsum on CUDA picks its scan by the tensor's shape).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_launchable, pow2_between, rows_2d

__all__ = ["SCAN_MAX_BLOCK", "row_cumsum"]

SCAN_MAX_BLOCK = 4096  # chunk width for long rows (vocab 32768 -> 8 chunks)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_cumsum_kernel(x_ptr, y_ptr, N, stride_xm, stride_ym, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, BLOCK)
    carry = tl.zeros((1,), dtype=tl.float64)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float64)
        scan = tl.associative_scan(x, 0, _add)
        tl.store(y_row + c, (carry + scan).to(tl.float32), mask=mask)
        carry += tl.sum(tl.where(cols == BLOCK - 1, scan, 0.0), axis=0)   # the chunk's own total, from its scan


def _launch_params(n: int) -> tuple[int, int]:
    block = pow2_between(n, 16, SCAN_MAX_BLOCK)
    return block, 4 if block <= 1024 else 8


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums over the last dim, accumulated in fp64 in a fixed per-row order; fp32 out."""
    check_float("row_cumsum", "x", x)
    if x.dim() < 1:
        raise ValueError("row_cumsum: x must have at least 1 dim, got a scalar")
    check_launchable("row_cumsum", _row_cumsum_kernel, x)
    n = x.shape[-1]
    x2 = rows_2d(x)
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] and n:
        block, warps = _launch_params(n)
        _row_cumsum_kernel[(x2.shape[0],)](x2, y, n, x2.stride(0), y.stride(0), BLOCK=block, num_warps=warps)
    return y.reshape(x.shape)
