"""Row reductions over the last dim: `softmax`, `log_softmax` (fp32 out), `row_sum`, and
`logprob_backward` (the gradient of a target's log-softmax with respect to the row's logits).

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

__all__ = ["SOFTMAX_MAX_BLOCK", "log_softmax", "logprob_backward", "row_sum", "softmax"]

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
def _logprob_backward_kernel(x_ptr, t_ptr, temp_ptr, scale_ptr, g_ptr, N, stride_xm, stride_gm, BLOCK: tl.constexpr):
    # lp = log_softmax(x / temp)[target]  ->  d lp / d x = (onehot(target) - softmax(x / temp)) / temp.
    # scale[row] = grad_lp / temp (0 for a row without a distribution: its gradient is 0).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    g_row = g_ptr + row * stride_gm
    temp = tl.load(temp_ptr + row)
    scale = tl.load(scale_ptr + row)
    target = tl.load(t_ptr + row)
    cols = tl.arange(0, BLOCK)
    mx = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mx = tl.maximum(mx, tl.load(x_row + c, mask=c < N, other=float("-inf")).to(tl.float32) / temp)
    m = tl.max(mx, axis=0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        z = tl.load(x_row + c, mask=mask, other=float("-inf")).to(tl.float32) / temp
        acc += tl.where(mask, tl.exp(z - m), 0.0)
    total = tl.sum(acc, axis=0)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        z = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32) / temp
        g = (tl.where(c == target, 1.0, 0.0) - tl.exp(z - m) / total) * scale
        tl.store(g_row + c, tl.where(scale != 0.0, g, 0.0).to(g_ptr.dtype.element_ty), mask=mask)


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


def logprob_backward(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
    """Gradient [T, V] (logits' dtype) of lp[t] = log_softmax(logits[t] / temperature[t])[targets[t]]
    times grad_lp[t], given scale = grad_lp / temperature (fp32 [T]; 0 gives a zero row): the
    backward of an unfiltered sampling logprob in one pass over the vocabulary per row.

    The same three passes as log_softmax (max, sum, write), so a row reads only itself."""
    op = "logprob_backward"
    check_float(op, "logits", logits, ndim=2)
    t, n = logits.shape
    for name, v in (("targets", targets), ("temperature", temperature), ("scale", scale)):
        if v.shape != (t,):
            raise ValueError(f"{op}: {name} must be [T] = [{t}], got {tuple(v.shape)}")
    check_launchable(op, _logprob_backward_kernel, logits, targets, temperature, scale)
    x2 = rows_2d(logits)
    g = torch.empty((t, n), dtype=logits.dtype, device=logits.device)
    if t and n:
        block, warps = _launch_params(n)
        _logprob_backward_kernel[(t,)](x2, targets.long().contiguous(), temperature.float().contiguous(),
                                       scale.float().contiguous(), g, n, x2.stride(0), g.stride(0),
                                       BLOCK=block, num_warps=warps)
    return g
