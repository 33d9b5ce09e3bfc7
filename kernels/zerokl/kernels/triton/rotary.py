"""Rotary embedding: `rope(x [T, H, D], positions [T], inv_freq [D/2], interleaved)`.

angle = float(position) * inv_freq (fp32), then for each pair (x1, x2):
  r1 = x1 * cos - x2 * sin,  r2 = x2 * cos + x1 * sin   (the torch backend's formula)
with pairs (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + D/2]).

The backward is the same kernel with the angle negated (`inverse=True`).
One program per (token, block of heads); every output element is a pure function of its
token's position, its pair and inv_freq, so batch invariance holds by construction.
On GPU, cos/sin come from libdevice (accurate for the large angles of long contexts);
under the interpreter from numpy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import (
    check_float,
    check_index,
    check_launchable,
    is_interpreted,
    next_pow2,
    pow2_between,
)

__all__ = ["rope"]


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, f_ptr, y_ptr, H, HALF,
    stride_xt, stride_xh, stride_yt, stride_yh,
    INTERLEAVED: tl.constexpr, LIBDEVICE: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freq = tl.load(f_ptr + i, mask=i_mask, other=0.0).to(tl.float32)
    angle = pos * freq
    if LIBDEVICE:
        c = libdevice.cos(angle)
        s = libdevice.sin(angle)
    else:
        c = tl.cos(angle)
        s = tl.sin(angle)
    if INVERSE:
        s = -s
    if INTERLEAVED:
        o1 = 2 * i
        o2 = 2 * i + 1
    else:
        o1 = i
        o2 = i + HALF
    mask = (h < H)[:, None] & i_mask[None, :]
    x_base = x_ptr + t * stride_xt + h[:, None] * stride_xh
    x1 = tl.load(x_base + o1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + o2[None, :], mask=mask, other=0.0).to(tl.float32)
    r1 = x1 * c[None, :] - x2 * s[None, :]
    r2 = x2 * c[None, :] + x1 * s[None, :]
    y_base = y_ptr + t * stride_yt + h[:, None] * stride_yh
    tl.store(y_base + o1[None, :], r1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_base + o2[None, :], r2.to(y_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool,
         inverse: bool = False) -> torch.Tensor:
    """Rotate x [T, H, D] by positions [T] with inv_freq [D/2] (fp32 math); output in x.dtype.

    inverse=True rotates by minus the angle (sin negated): the transposed rotation, i.e. rope's
    backward (grad_x of a rotation is the gradient rotated back)."""
    op = "rope"
    check_float(op, "x", x, ndim=3)
    t, h, d = x.shape
    if d % 2:
        raise ValueError(f"{op}: head dim D must be even, got {d}")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.shape[0] != t:
        raise ValueError(f"{op}: positions must be a 1-D tensor of T = {t} entries, got "
                         f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    if positions.dtype not in (torch.int64, torch.int32, torch.float32):
        check_index(op, "positions", positions, 1)
    check_float(op, "inv_freq", inv_freq, ndim=1)
    if inv_freq.shape[0] != d // 2:
        raise ValueError(f"{op}: inv_freq must have D/2 = {d // 2} entries, got {inv_freq.shape[0]}")
    check_launchable(op, _rope_kernel, x, positions, inv_freq)
    if x.stride(2) != 1 and d > 1:
        x = x.contiguous()
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0 or d == 0:
        return y
    block_h = pow2_between(h, 1, 16)
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, positions.contiguous(), inv_freq.contiguous(), y, h, d // 2,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        INTERLEAVED=bool(interleaved), LIBDEVICE=not is_interpreted(_rope_kernel), INVERSE=bool(inverse),
        BLOCK_H=block_h, BLOCK_HALF=next_pow2(d // 2), num_warps=4,
    )
    return y
