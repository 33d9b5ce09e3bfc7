"""Row norms: `rms_norm` and `layer_norm`, one row per program.

Invariance by construction: a program reads only its own row. The row is walked in
BLOCK-wide chunks in ascending order (BLOCK from the row length only), each chunk is added
element-wise into a [BLOCK] fp32 vector, and one tl.sum of that vector (a fixed tree for a
fixed BLOCK) gives the row total. Neither M nor the neighbours enter anywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_launchable, pow2_between, rows_2d

__all__ = ["NORM_MAX_BLOCK", "NORM_BACKWARD_ROWS", "layer_norm", "rms_norm", "rms_norm_backward"]

NORM_MAX_BLOCK = 8192  # widest chunk; rows up to this length (hidden 6144) take one chunk
NORM_BACKWARD_ROWS = 16  # rows per rms_norm_backward program: one fp32 partial of grad_weight each


def _norm_launch_params(n: int) -> tuple[int, int]:
    block = pow2_between(n, 16, NORM_MAX_BLOCK)
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_xm, stride_ym, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, BLOCK)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        x = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
        sq += x * x
    mean_sq = tl.sum(sq, axis=0) / N
    inv = 1.0 / tl.sqrt_rn(mean_sq + eps)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + c, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, stride_xm, stride_ym, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, BLOCK)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        s += tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
    mean = tl.sum(s, axis=0) / N
    v = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean, 0.0)
        v += d * d
    var = tl.sum(v, axis=0) / N
    inv = 1.0 / tl.sqrt_rn(var + eps)
    for c0 in range(0, N, BLOCK):
        c = c0 + cols
        mask = c < N
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + c, ((x - mean) * inv * w + b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, dw_ptr, M, N, stride_xm, stride_gm, stride_dxm, eps,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # Program p takes rows p*ROWS .. p*ROWS + ROWS - 1 in ascending order, each row whole (N <= BLOCK).
    # With xhat = x * inv, y = xhat * w:  dx = inv * (g*w - xhat * mean(g*w*xhat)),  dw = sum_rows g*xhat.
    # A row's dx reads only that row; dw's partial of the program goes to dw_ptr[p, :] (fp32).
    p = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(ROWS):
        row = p * ROWS + r
        mask = cols < tl.where(row < M, N, 0)         # a row past M (the last program's tail) is all masked
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps)
        xhat = x * inv
        gw = g * w
        c = tl.sum(gw * xhat, axis=0) / N
        tl.store(dx_ptr + row * stride_dxm + cols, ((gw - xhat * c) * inv).to(dx_ptr.dtype.element_ty), mask=mask)
        dw += g * xhat
    tl.store(dw_ptr + p * N + cols, dw, mask=cmask)


def _check_norm_args(op: str, x: torch.Tensor, params: dict) -> int:
    check_float(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim, got a scalar")
    n = x.shape[-1]
    for name, p in params.items():
        check_float(op, name, p, ndim=1)
        if p.shape[0] != n:
            raise ValueError(f"{op}: {name} has {p.shape[0]} elements, x's last dim is {n}")
    return n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32; output in x.dtype."""
    n = _check_norm_args("rms_norm", x, {"weight": weight})
    check_launchable("rms_norm", _rms_norm_kernel, x, weight)
    x2 = rows_2d(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block, warps = _norm_launch_params(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), y, n, x2.stride(0), y.stride(0), float(eps), BLOCK=block, num_warps=warps
        )
    return y.reshape(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm over the last dim (two-pass mean then variance, fp32); output in x.dtype."""
    n = _check_norm_args("layer_norm", x, {"weight": weight, "bias": bias})
    check_launchable("layer_norm", _layer_norm_kernel, x, weight, bias)
    x2 = rows_2d(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block, warps = _norm_launch_params(n)
        _layer_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), bias.contiguous(), y, n, x2.stride(0), y.stride(0), float(eps),
            BLOCK=block, num_warps=warps,
        )
    return y.reshape(x.shape)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                      eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x in x.dtype, grad_weight in weight.dtype) of rms_norm(x, weight, eps) for grad [..., N].

    One launch: a program per NORM_BACKWARD_ROWS rows writes their grad_x and one fp32 partial of
    grad_weight; the partials are summed by torch.sum over a fixed shape (deterministic per
    shape). grad_x of a row depends only on that row. Rows up to NORM_MAX_BLOCK wide.
    """
    n = _check_norm_args("rms_norm_backward", x, {"weight": weight})
    check_float("rms_norm_backward", "grad", grad)
    if grad.shape != x.shape:
        raise ValueError(f"rms_norm_backward: grad {tuple(grad.shape)} is not x's shape {tuple(x.shape)}")
    if n > NORM_MAX_BLOCK:
        raise ValueError(f"rms_norm_backward: rows of {n} exceed NORM_MAX_BLOCK = {NORM_MAX_BLOCK}")
    check_launchable("rms_norm_backward", _rms_norm_backward_kernel, x, weight, grad)
    x2, g2 = rows_2d(x), rows_2d(grad)
    m = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    programs = triton.cdiv(m, NORM_BACKWARD_ROWS)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    if m and n:
        block, warps = _norm_launch_params(n)
        _rms_norm_backward_kernel[(programs,)](
            x2, weight.contiguous(), g2, dx, partial, m, n, x2.stride(0), g2.stride(0), dx.stride(0), float(eps),
            ROWS=NORM_BACKWARD_ROWS, BLOCK=block, num_warps=warps,
        )
    return dx.reshape(x.shape), partial.sum(0).to(weight.dtype)
