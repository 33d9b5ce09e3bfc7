"""Block-scaled FP8 (e4m3) kernels: activation and weight quantization and the FP8 GEMM `fp8_linear`.

The definition (NUMERICS.md, "FP8"): a weight [N, K] is stored as e4m3 values with one fp32
scale per 128 x 128 block; an activation row is quantized per 128-channel group,
s = amax / 448, q = the e4m3 value nearest clamp(x / s, -448, 448), ties to even (s = 1 for an
all-zero group). Output
element (m, n) is, for K blocks b = 0, 1, ... in ascending order,
    acc = acc + dot_b(q_x[m], q_w[n]) * (s_x[m, b] * s_w[n // 128, b])
in fp32, where dot_b is the block's dot product in fp32. Invariance by construction, as for
the bf16 GEMM (kernels/zerokl/kernels/triton/gemm.py): one program owns an output tile and every K block of
it, in ascending order, no split-K; a row's quantization reads only that row; BLOCK_K is the
quantization group (128) and BLOCK_N the weight block (128), so a tile's columns share one
weight scale per K block whatever the batch.

`fp8_grouped_linear` (the MoE experts) is the same kernel over a grouped GEMM's row tiles:
each group's rows cut into tiles from its first row, found from device offsets (no host sync,
as kernels/zerokl/kernels/triton/gemm.py's grouped GEMM), so a token's result never depends on how many tokens
its expert received.

Under the interpreter the block dot is the exact contraction rounded once to fp32
(kernels/zerokl/kernels/interpreter.py), which is the torch backend's definition, so interpreted bits
equal the torch backend's. Compiled on Hopper the block dot is the tensor cores' FP8 MMA,
whose accumulation is the hardware's own: other bits than the CPU's (another fingerprint key),
the same for a row alone or in any batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerokl.kernels.fp8_format import FP8_BLOCK, FP8_MAX

from ._common import check_float, check_launchable, is_interpreted, next_pow2, unit_last
from .gemm import _device_offsets, _group_tile

__all__ = ["FP8_BLOCK", "FP8_MAX", "fp8_quantize", "fp8_quantize_weight", "fp8_gemm", "fp8_grouped_linear", "fp8_linear"]

# FP8_BLOCK (channels per activation scale; weight blocks FP8_BLOCK x FP8_BLOCK) and FP8_MAX (the
# largest e4m3 value) are the library's (fp8_format); the kernels read FP8_MAX as a compile-time constant.
_E4M3_MAX: tl.constexpr = tl.constexpr(FP8_MAX)


@triton.jit
def _e4m3_byte(y):
    # fp32 y, |y| <= 448 -> the byte of the e4m3 value nearest y, ties to even (int32). Rounds onto
    # the e4m3 grid with IEEE adds (torch_ops.round_to_e4m3), then writes the byte itself: Triton's
    # own fp8 cast under the interpreter rounds ties away and flushes subnormals, so no conversion
    # routine may decide a bit.
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    quantum = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    c = quantum * 12582912.0
    r = (y + c) - c
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    ex = ((bits >> 23) & 0xFF) - 127
    normal = (sign << 7) | ((ex + 7) << 3) | ((bits >> 20) & 7)
    subnormal = (sign << 7) | (tl.abs(r) * 512.0).to(tl.int32)         # r = k * 2^-9, k in 0..7
    return tl.where(ex >= -6, normal, subnormal)


@triton.jit
def _fp8_quantize_kernel(x_ptr, q_ptr, s_ptr, K, KB, stride_xm, stride_qm, BLOCK: tl.constexpr):
    # One program per (row, 128-channel group): the group's amax, its scale, its e4m3 values.
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, _E4M3_MAX), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -_E4M3_MAX), _E4M3_MAX)
    tl.store(q_ptr + row * stride_qm + cols, _e4m3_byte(y).to(tl.uint8), mask=mask)
    tl.store(s_ptr + row * KB + b, s)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/bf16) -> (q [M, K] float8_e4m3fn, scale [M, ceil(K/128)] fp32), per row per group."""
    op = "fp8_quantize"
    check_float(op, "x", x, ndim=2)
    check_launchable(op, _fp8_quantize_kernel, x)
    x = unit_last(x)
    m, k = x.shape
    kb = triton.cdiv(k, FP8_BLOCK)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m and k:
        _fp8_quantize_kernel[(m, kb)](x, q.view(torch.uint8), s, k, kb, x.stride(0), q.stride(0), BLOCK=FP8_BLOCK)
    return q, s


@triton.jit
def _fp8_quantize_weight_kernel(w_ptr, q_ptr, s_ptr, N, K, NB, KB, stride_we, stride_wn, BLOCK: tl.constexpr):
    # One program per (128-row block, 128-column block, expert) of a stack [E, N, K]: the block's amax,
    # its scale, its e4m3 values. Rows and columns past N and K count as zeros (torch_ops pads with zeros).
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = (nb * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + e * stride_we + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, _E4M3_MAX), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(w, s), -_E4M3_MAX), _E4M3_MAX)
    tl.store(q_ptr + (e * N + rows[:, None]) * K + cols[None, :], _e4m3_byte(y).to(tl.uint8), mask=mask)
    tl.store(s_ptr + (e * NB + nb) * KB + kb, s)


def fp8_quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] or a stack of experts [E, N, K] (fp32/bf16) -> (q float8_e4m3fn of its shape,
    scale [..., ceil(N/128), ceil(K/128)] fp32), one scale per 128 x 128 block of each expert: one
    launch, no fp32 temporaries (the trainer re-quantizes every FP8 weight after each optimizer step)."""
    op = "fp8_quantize_weight"
    check_float(op, "weight", weight)
    if weight.dim() not in (2, 3):
        raise ValueError(f"{op}: weight must be [N, K] or [E, N, K], got shape {tuple(weight.shape)}")
    check_launchable(op, _fp8_quantize_weight_kernel, weight)
    w = unit_last(weight if weight.dim() == 3 else weight.unsqueeze(0))
    e, n, k = w.shape
    nb, kb = triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK)
    q = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((e, nb, kb), dtype=torch.float32, device=w.device)
    if e and n and k:
        _fp8_quantize_weight_kernel[(nb, kb, e)](w, q.view(torch.uint8), s, n, k, nb, kb, w.stride(0), w.stride(1),
                                                 BLOCK=FP8_BLOCK, num_warps=8)
    return (q, s) if weight.dim() == 3 else (q[0], s[0])


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    q_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, offs_ptr,
    M, N, K, KB, G,
    stride_qm, stride_wg, stride_wn, stride_sg, stride_swn, stride_ym,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, GROUPED: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # GROUPED (MoE experts): program_id(0) is a row tile of one group, found from the device
    # offsets as the bf16 grouped GEMM finds it (gemm._group_tile); tiles never span two groups.
    if GROUPED:
        g, row0, row_end = _group_tile(offs_ptr, tl.program_id(0), G, BLOCK_M, BLOCK_G)
        if g >= G:
            return
        rm = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
        m_mask = rm < row_end
        w_ptr += g.to(tl.int64) * stride_wg
        sw_ptr += g.to(tl.int64) * stride_sg
    else:
        rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
    pid_n = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, KB):                              # K blocks in ascending order, one per scale
        k_mask = b * BLOCK_K + rk < K
        a = tl.load(q_ptr + rm[:, None] * stride_qm + (b * BLOCK_K + rk)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (b * BLOCK_K + rk)[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:                                      # interpreter: the exact fp32 dot of e4m3 values
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        part = tl.dot(a, tl.trans(w), out_dtype=tl.float32)
        sx = tl.load(sx_ptr + rm * KB + b, mask=m_mask, other=0.0)
        sw = tl.load(sw_ptr + pid_n * stride_swn + b)   # BLOCK_N == 128: one weight block per tile
        acc = acc + part * (sx * sw)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _block_m(m: int, interpreted: bool) -> int:
    """Rows per tile: fixed under the interpreter; by M when compiled (rows never mix in a dot)."""
    if interpreted:
        return 16
    return 64 if m <= 64 else 128


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = fp8_quantize(x) @ (weight x weight_scale).T (+ bias) by the block-scaled definition.

    x [..., K] fp32/bf16; weight [N, K] float8_e4m3fn; weight_scale [ceil(N/128), ceil(K/128)]
    fp32; output in out_dtype (default x.dtype).
    """
    op = "fp8_linear"
    check_float(op, "x", x)
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{op}: weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} != weight's K {k}")
    nb, kb = triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK)
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (nb, kb):
        raise ValueError(f"{op}: weight_scale must be float32 [{nb}, {kb}], got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None:
        check_float(op, "bias", bias, ndim=1)
    check_launchable(op, _fp8_linear_kernel, x, weight, weight_scale, bias)
    q, sx = fp8_quantize(x.reshape(-1, k))
    return fp8_gemm(q, sx, weight, weight_scale, bias, out_dtype or x.dtype).reshape(*x.shape[:-1], n)


def fp8_gemm(q: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The block-scaled product of quantized activations (q [M, K], sx [M, KB]) and a quantized
    weight: fp8_linear after its quantization (arguments as fp8_linear checks them)."""
    (m, k), n = q.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0 or n == 0:
        return y
    sx, weight, weight_scale = sx.contiguous(), unit_last(weight), weight_scale.contiguous()
    interpreted = is_interpreted(_fp8_linear_kernel)
    block_m = _block_m(m, interpreted)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, FP8_BLOCK))
    _fp8_linear_kernel[grid](
        q, sx, weight, weight_scale, bias if bias is not None else weight_scale, y, weight_scale,
        m, n, k, sx.shape[1], 1,
        q.stride(0), 0, weight.stride(0), 0, weight_scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=interpreted, GROUPED=False, BLOCK_G=1,
        BLOCK_M=block_m, BLOCK_N=FP8_BLOCK, BLOCK_K=FP8_BLOCK,
        num_warps=4 if interpreted or block_m == 64 else 8, num_stages=1 if interpreted else 3,
    )
    return y


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       offsets: list[int] | torch.Tensor) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [M, K] times FP8 weight[g] ([G, N, K] e4m3, scales
    [G, ceil(N/128), ceil(K/128)]) -> [M, N] in x.dtype. Each row is quantized once and its
    product is fp8_linear's; the offsets may be a device tensor (no host sync)."""
    op = "fp8_grouped_linear"
    check_float(op, "x", x, ndim=2)
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 3:
        raise ValueError(f"{op}: weight must be a 3-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    g, n, k = weight.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"{op}: x's last dim {x.shape[1]} != weight's K {k}")
    nb, kb = triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK)
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (g, nb, kb):
        raise ValueError(f"{op}: weight_scale must be float32 [{g}, {nb}, {kb}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    offs_t, offs = _device_offsets(op, offsets, g, m, x.device)
    check_launchable(op, _fp8_linear_kernel, x, weight, weight_scale)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    q, sx = fp8_quantize(x)
    weight, weight_scale = unit_last(weight), weight_scale.contiguous()
    interpreted = is_interpreted(_fp8_linear_kernel)
    block_m = 16 if interpreted else 64
    tiles = m // block_m + min(g, m) if offs is None else sum(-(-(b - a) // block_m) for a, b in zip(offs, offs[1:]))
    if tiles == 0:
        return y
    _fp8_linear_kernel[(tiles, nb)](
        q, sx, weight, weight_scale, weight_scale, y, offs_t,
        m, n, k, kb, g,
        q.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0), weight_scale.stride(1), y.stride(0),
        HAS_BIAS=False, UPCAST=interpreted, GROUPED=True, BLOCK_G=max(16, next_pow2(g)),
        BLOCK_M=block_m, BLOCK_N=FP8_BLOCK, BLOCK_K=FP8_BLOCK,
        num_warps=4, num_stages=1 if interpreted else 3,
    )
    return y
