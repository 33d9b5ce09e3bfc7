"""The MoE glue's backward: `moe_combine_backward` and `pair_rows_backward`.

The forward of both is plain indexing and a fixed-order fp32 sum (kernels/zerokl/kernels/ops.py); differentiating
it as written would slice [T, k, D] gradients one slot at a time (a zero-filled [T, k, D] tensor
per slot) and cast them to fp32. These kernels read each row once and write each gradient once.
A token's gradients depend only on that token's rows, so batch invariance holds by construction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_index, check_launchable, pow2_between

__all__ = ["moe_combine_backward", "pair_rows_backward"]

COMBINE_BLOCK = 1024  # D columns a loop step; rows of any width are walked in these chunks


@triton.jit
def _moe_combine_backward_kernel(w_ptr, out_ptr, g_ptr, gout_ptr, gw_ptr, D,
                                 K: tl.constexpr, BLOCK: tl.constexpr):
    # total[t] = sum_j w[t, j] * out[t, j, :]  ->  gout[t, j, :] = g[t] * w[t, j],  gw[t, j] = sum_d g[t, d] * out[t, j, d]
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for j in range(K):
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK):
            d = d0 + cols
            mask = d < D
            g = tl.load(g_ptr + t * D + d, mask=mask, other=0.0).to(tl.float32)
            o = tl.load(out_ptr + (t * K + j) * D + d, mask=mask, other=0.0).to(tl.float32)
            tl.store(gout_ptr + (t * K + j) * D + d, (g * w).to(gout_ptr.dtype.element_ty), mask=mask)
            acc += g * o
        tl.store(gw_ptr + t * K + j, tl.sum(acc, axis=0).to(gw_ptr.dtype.element_ty))


def moe_combine_backward(weights: torch.Tensor, outputs: torch.Tensor,
                         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_weights [T, k] in weights' dtype, grad_outputs [T, k, D] in outputs' dtype) of
    ops.moe_combine(weights, outputs) for grad [T, D]; fp32 math, one program per token."""
    op = "moe_combine_backward"
    check_float(op, "weights", weights, ndim=2)
    check_float(op, "outputs", outputs, ndim=3)
    check_float(op, "grad", grad, ndim=2)
    t, k, d = outputs.shape
    if weights.shape != (t, k) or grad.shape != (t, d):
        raise ValueError(f"{op}: weights {tuple(weights.shape)}, outputs {tuple(outputs.shape)}, grad "
                         f"{tuple(grad.shape)} are not [T, k], [T, k, D], [T, D]")
    check_launchable(op, _moe_combine_backward_kernel, weights, outputs, grad)
    weights, outputs, grad = weights.contiguous(), outputs.contiguous(), grad.contiguous()
    g_out = torch.empty_like(outputs)
    g_w = torch.empty_like(weights)
    if t and k and d:
        _moe_combine_backward_kernel[(t,)](weights, outputs, grad, g_out, g_w, d, K=k,
                                           BLOCK=pow2_between(d, 16, COMBINE_BLOCK), num_warps=4)
    elif t and k:
        g_w.zero_()
    return g_w, g_out


@triton.jit
def _pair_rows_backward_kernel(g_ptr, src_ptr, dx_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
    # dx[t, :] = sum over the token's k pairs, slot order, of g[src[t * K + j], :] (fp32, left to right)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    row = tl.load(src_ptr + t * K).to(tl.int64)
    acc = tl.load(g_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
    for j in range(1, K):
        row = tl.load(src_ptr + t * K + j).to(tl.int64)
        acc = acc + tl.load(g_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + t * D + d, acc.to(dx_ptr.dtype.element_ty), mask=mask)


def pair_rows_backward(grad: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """grad_x [T, D] of xs = x[order // k] (xs [T * k, D], pairs taken in `order`): each token's k
    pair gradients summed in slot order in fp32, rounded to grad's dtype. No atomics."""
    op = "pair_rows_backward"
    check_float(op, "grad", grad, ndim=2)
    check_index(op, "order", order, 1)
    p, d = grad.shape
    if order.shape[0] != p or k < 1 or p % k:
        raise ValueError(f"{op}: order {tuple(order.shape)} and k = {k} do not fit grad {tuple(grad.shape)}")
    check_launchable(op, _pair_rows_backward_kernel, grad, order)
    # source[pair] = the row of grad holding that pair (order's inverse permutation)
    source = torch.empty_like(order).index_copy_(0, order, torch.arange(p, device=order.device, dtype=order.dtype))
    dx = torch.empty((p // k, d), dtype=grad.dtype, device=grad.device)
    if p and d:
        block = pow2_between(d, 16, COMBINE_BLOCK)
        _pair_rows_backward_kernel[(p // k, triton.cdiv(d, block))](grad.contiguous(), source, dx, d, K=k, BLOCK=block,
                                                                    num_warps=4)
    return dx
