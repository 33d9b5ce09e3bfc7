"""Element-wise activations: `sigmoid` and `silu`, fp32 output; `swiglu_backward`.

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

__all__ = ["sigmoid", "silu", "swiglu_backward"]

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


@triton.jit
def _swiglu_backward_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, N, stride_gm, stride_um, stride_dhm, stride_dgm,
                            stride_dum, BLOCK: tl.constexpr):
    # h = silu(g) * u in fp32 (g, u: the gate and up projections). With s = sigmoid(g):
    # du = dh * g * s,  dg = dh * u * s * (1 + g * (1 - s))   (silu' = s + g s (1 - s)).
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    g = tl.load(g_ptr + row * stride_gm + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_um + c, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + row * stride_dhm + c, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(du_ptr + row * stride_dum + c, (dh * (g * s)).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + row * stride_dgm + c, (dh * u * (s * (1.0 + g * (1.0 - s)))).to(dg_ptr.dtype.element_ty),
             mask=mask)


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


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of h = silu(gate) * up (fp32 math, ops.swiglu's hidden state) for grad
    dh, each in its input's dtype; element-wise, one launch."""
    op = "swiglu_backward"
    for name, t in (("gate", gate), ("up", up), ("grad", grad)):
        check_float(op, name, t)
    if not gate.shape == up.shape == grad.shape:
        raise ValueError(f"{op}: gate {tuple(gate.shape)}, up {tuple(up.shape)} and grad {tuple(grad.shape)} differ")
    check_launchable(op, _swiglu_backward_kernel, gate, up, grad)
    g2, u2, dh2 = rows_2d(gate), rows_2d(up), rows_2d(grad)
    m, n = g2.shape
    dg = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    du = torch.empty((m, n), dtype=up.dtype, device=up.device)
    if m and n:
        block = pow2_between(n, 16, EW_MAX_BLOCK)
        _swiglu_backward_kernel[(m, triton.cdiv(n, block))](
            g2, u2, dh2, dg, du, n, g2.stride(0), u2.stride(0), dh2.stride(0), dg.stride(0), du.stride(0),
            BLOCK=block, num_warps=4,
        )
    return dg.reshape(gate.shape), du.reshape(up.shape)
