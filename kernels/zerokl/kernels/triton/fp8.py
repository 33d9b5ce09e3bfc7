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
quantization group (128), so each K block has one activation scale per row and one weight scale
per 128 columns, and an element's scale is the same fp32 product s_x * s_w in every tile shape.

Launch configs (`Fp8GemmConfig`: BLOCK_M, BLOCK_N, warps, stages, grouped program order) as the
bf16 GEMM's: interpreted launches always use INTERPRETED_CONFIG (the CPU bits and their golden
vectors); compiled CUDA launches pick one by M (`fp8_launch_config`, `_CUDA_BUCKETS`). That is
invariant because on sm90 an element's bits do not depend on the tile: each K block's tl.dot
chains the same MMA steps in ascending K order into a fresh fp32 accumulator whatever the
tile, warps or stages, and the rest is elementwise (NUMERICS.md, "Tile configs on CUDA";
tests/kernels/test_fp8_configs.py asserts it on the GPU for every config in use and every
config `tools/bench/bench_fp8.py --sweep` times).

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from zerokl.kernels.fp8_format import FP8_BLOCK, FP8_MAX

from ._common import check_float, check_launchable, is_interpreted, multiprocessors, next_pow2, tma_aligned, unit_last
from .gemm import _device_offsets, _group_tile, _swizzled_tile

__all__ = ["CANONICAL_CONFIG", "FP8_BLOCK", "FP8_MAX", "INTERPRETED_CONFIG", "Fp8GemmConfig", "fp8_gemm",
           "fp8_grouped_linear", "fp8_launch_config", "fp8_linear", "fp8_quantize", "fp8_quantize_weight"]

# FP8_BLOCK (channels per activation scale; weight blocks FP8_BLOCK x FP8_BLOCK) and FP8_MAX (the
# largest e4m3 value) are the library's (fp8_format); the kernels read FP8_MAX as a compile-time constant.
_E4M3_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_FP8_BLOCK: tl.constexpr = tl.constexpr(FP8_BLOCK)


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


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch shape of _fp8_linear_kernel. BLOCK_K is always FP8_BLOCK, the quantization group
    (one activation scale per row and one weight scale per 128 columns for each K block), so a
    config never changes what an element computes, only who computes it and when."""
    BLOCK_M: int
    BLOCK_N: int        # a power of two: up to 128 a tile lies in one weight block, 256 spans two
    num_warps: int
    num_stages: int
    GROUP_M: int = 8    # row tiles per band of the grouped program order (the plain GEMM only)
    # Operand tiles through the tensor memory accelerator (host tensor descriptors) instead of
    # pointer loads: the same bytes, zero-padded past M, N and K as the masked loads, so the same
    # bits. The plain GEMM only, and only where the operands' rows are 16-byte aligned (TMA's rule);
    # elsewhere the launch loads by pointer.
    TMA: bool = False
    # A persistent grid (the plain GEMM only): PROGRAMS_PER_SM programs a multiprocessor, each
    # walking tiles in the grouped order; 0: one program a tile. Who computes a tile, not what.
    PROGRAMS_PER_SM: int = 0


# Interpreted launches (CPU) always take this one: the interpreter's CPU bits and golden vectors.
INTERPRETED_CONFIG = Fp8GemmConfig(16, 128, 4, 1)
# The compiled reference: what every launch of M > 64 rows used before the table. The GPU tests
# (tests/kernels/test_fp8_configs.py) and the sweep compare every other config's bits with it.
CANONICAL_CONFIG = Fp8GemmConfig(128, 128, 8, 3)
# The MoE experts' compiled config (fp8_grouped_linear; rows per expert are few and vary), from
# `bench_fp8.py --sweep-grouped` on one H100 (2026-12-08, docs/perf.md): 15 candidates at the GLM-5 experts'
# gate/up and down ([256, 2048, 6144], [256, 6144, 2048]) x 64 / 256 / 2,048 / 8,192 tokens (8 experts each),
# every one bit-identical to 64x128 w4 s3 (the config before). 64x256, 8 warps, 4 stages had the best mean:
# at decode (64 tokens) the same 0.86 of the experts' HBM bound as before, at 256-8,192 tokens 7% faster.
_GROUPED_CUDA_CONFIG = Fp8GemmConfig(64, 256, 8, 4)

# Configs of compiled CUDA launches by M bucket: (max M, {(N, K) or None: Fp8GemmConfig}), as
# gemm._CUDA_BUCKETS. `python tools/bench/bench_fp8.py --sweep` on the GPU times the candidates beside cuBLASLt
# and checks their bits; the table takes its fastest bit-identical configs (below). Candidates it times, and why:
# - M <= 64 (decode): one row tile, so the time is the weight streamed from HBM by N / BLOCK_N
#   programs; 64-column tiles give twice the programs of 128 (N = 2048: 32 instead of 16).
# - M <= 1024: 64 x 128 tiles keep the grid above the 132 SMs (M = 512, N = 2048: 128 tiles,
#   against 64 of 128 x 128).
# - larger: 128 x 128 with 8 warps (two warpgroups) and 3-4 stages. The FP8 tutorial's 128 x 256
#   keeps a K block's partial product beside the accumulator: 128 + 128 fp32 registers a thread
#   with 8 warps, which may spill.
# The table from the full sweep on an H100 (2026-12-07, commit 414ff8e, `bench_fp8.py --sweep --ms 1 64 2048 8192`:
# 27 candidates x 3 weights x 4 M, every one bit-identical to the canonical config), one config a bucket, the best
# mean over the three weights (N x K = 4,096 x 4,096, 2,048 x 7,168, 7,168 x 2,048), as the fraction of cuBLASLt
# rowwise FP8's speed:
# - M <= 64: 64 x 64 tiles, 4 warps, 5 stages: 0.86-1.03x at M = 64 and 0.71-0.90x at M = 1, against 0.64-0.88x
#   and 0.65-0.78x for the 64 x 128 3-stage tiles it replaces (more programs stream the weight, deeper prefetch).
# - M <= 1,024: the canonical tiles (not swept between 64 and 2,048 rows).
# - above: 128 x 128, 8 warps, 4 stages, TMA loads: 0.64-0.68x at M = 2,048 (the canonical pointer tiles:
#   0.59-0.60x) and 0.66-0.73x at 8,192. Persistent grids and 128 x 256 tiles were no faster.
_CUDA_BUCKETS: list[tuple[int, dict]] = [
    (64, {None: Fp8GemmConfig(64, 64, 4, 5)}),
    (1024, {None: CANONICAL_CONFIG}),
    (1 << 62, {None: Fp8GemmConfig(128, 128, 8, 4, TMA=True)}),
]


def fp8_launch_config(m: int, n: int, k: int, interpreted: bool) -> Fp8GemmConfig:
    """The config of an fp8_gemm launch of M rows on a weight [N, K]: under the interpreter always
    INTERPRETED_CONFIG (the one its golden vectors record); compiled, by M (and by the weight's
    shape where the table names it) from _CUDA_BUCKETS."""
    if interpreted:
        return INTERPRETED_CONFIG
    return next(table.get((n, k)) or table[None] for max_m, table in _CUDA_BUCKETS if m <= max_m)


@triton.jit
def _block_scales(sx, sw_ptr, n0, rn, n_mask, b, stride_swn, BLOCK_N: tl.constexpr):
    # K block b's scale of each tile element, s_x[m, b] * s_w[n // 128, b], one fp32 product as
    # the definition's. sx [BLOCK_M]: the rows' activation scales; sw_ptr: the weight's scales
    # [NB, KB] (row stride stride_swn); n0: the tile's first column; rn [BLOCK_N]: its columns.
    if BLOCK_N <= _FP8_BLOCK:
        # BLOCK_N divides 128, so the tile lies in one weight block: one scale, [BLOCK_M, 1]
        # (a multiply per row, not per element).
        scales = (sx * tl.load(sw_ptr + (n0 // _FP8_BLOCK) * stride_swn + b))[:, None]
    else:
        # a wider tile spans BLOCK_N / 128 weight blocks: a scale per column, [BLOCK_M, BLOCK_N].
        sw = tl.load(sw_ptr + (rn // _FP8_BLOCK) * stride_swn + b, mask=n_mask, other=0.0)
        scales = sx[:, None] * sw[None, :]
    return scales


@triton.jit
def _fp8_tile(q_src, sx_ptr, w_src, sw_ptr, b_ptr, y_ptr, row0, m_mask, pid_n, N, K, KB,
              stride_qm, stride_wn, stride_swn, stride_ym,
              HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One output tile: rows row0 + [0, BLOCK_M) (m_mask: those that exist), columns of band pid_n.
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, KB):                              # K blocks in ascending order, one per scale
        if TMA:                                         # the box past M, N or K reads as zeros
            a = q_src.load([row0.to(tl.int32), b * BLOCK_K])
            w = w_src.load([(pid_n * BLOCK_N).to(tl.int32), b * BLOCK_K])
        else:
            k_mask = b * BLOCK_K + rk < K
            a = tl.load(q_src + rm[:, None] * stride_qm + (b * BLOCK_K + rk)[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_src + rn[:, None] * stride_wn + (b * BLOCK_K + rk)[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:                                      # interpreter: the exact fp32 dot of e4m3 values
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        part = tl.dot(a, tl.trans(w), out_dtype=tl.float32)
        sx = tl.load(sx_ptr + rm * KB + b, mask=m_mask, other=0.0)
        acc = acc + part * _block_scales(sx, sw_ptr, pid_n * BLOCK_N, rn, n_mask, b, stride_swn, BLOCK_N)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    q_src, sx_ptr, w_src, sw_ptr, b_ptr, y_ptr, offs_ptr,
    M, N, K, KB, G,
    stride_qm, stride_wg, stride_wn, stride_sg, stride_swn, stride_ym,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, GROUPED: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, PERSISTENT: tl.constexpr,
):
    # q_src, w_src: the e4m3 activations [M, K] and weight [N, K] (a stack [G, N, K] when GROUPED),
    # pointers, or with TMA (never GROUPED) tensor descriptors of [BLOCK_M, BLOCK_K] and
    # [BLOCK_N, BLOCK_K] boxes.
    # GROUPED (MoE experts): program_id(0) is a row tile of one group, found from the device
    # offsets as the bf16 grouped GEMM finds it (gemm._group_tile); tiles never span two groups;
    # program_id(1) is the column band.
    if GROUPED:
        g, row0, row_end = _group_tile(offs_ptr, tl.program_id(0), G, BLOCK_M, BLOCK_G)
        if g >= G:
            return
        row0 = row0.to(tl.int64)
        _fp8_tile(q_src, sx_ptr, w_src + g.to(tl.int64) * stride_wg, sw_ptr + g.to(tl.int64) * stride_sg, b_ptr,
                  y_ptr, row0, row0 + tl.arange(0, BLOCK_M) < row_end, tl.program_id(1).to(tl.int64), N, K, KB,
                  stride_qm, stride_wn, stride_swn, stride_ym, HAS_BIAS, UPCAST, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
    elif PERSISTENT:
        # Fewer programs than tiles (one or two a multiprocessor), each walking the tiles in
        # grouped order with a stride of the grid: the next tile's loads start while the last
        # tile's stores drain, and no tail of short-lived programs.
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
            pid_m, pid_n = _swizzled_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            row0 = pid_m * BLOCK_M
            _fp8_tile(q_src, sx_ptr, w_src, sw_ptr, b_ptr, y_ptr, row0, row0 + tl.arange(0, BLOCK_M) < M, pid_n,
                      N, K, KB, stride_qm, stride_wn, stride_swn, stride_ym, HAS_BIAS, UPCAST, TMA,
                      BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        # One program a tile, one program axis in grouped order, as gemm._linear_kernel's (the order
        # never enters a tile's arithmetic).
        pid_m, pid_n = _swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        row0 = pid_m * BLOCK_M
        _fp8_tile(q_src, sx_ptr, w_src, sw_ptr, b_ptr, y_ptr, row0, row0 + tl.arange(0, BLOCK_M) < M, pid_n,
                  N, K, KB, stride_qm, stride_wn, stride_swn, stride_ym, HAS_BIAS, UPCAST, TMA,
                  BLOCK_M, BLOCK_N, BLOCK_K)


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
             bias: torch.Tensor | None, out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """The block-scaled product of quantized activations (q [M, K], sx [M, KB]) and a quantized
    weight: fp8_linear after its quantization (arguments as fp8_linear checks them). config:
    the launch's tiles (default fp8_launch_config's; any config gives the same bits on the GPU)."""
    (m, k), n = q.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0 or n == 0:
        return y
    q, sx, weight, weight_scale = unit_last(q), sx.contiguous(), unit_last(weight), weight_scale.contiguous()
    interpreted = is_interpreted(_fp8_linear_kernel)
    cfg = config or fp8_launch_config(m, n, k, interpreted)
    tma = cfg.TMA and tma_aligned(q) and tma_aligned(weight)
    q_src = TensorDescriptor.from_tensor(q, [cfg.BLOCK_M, FP8_BLOCK]) if tma else q
    w_src = TensorDescriptor.from_tensor(weight, [cfg.BLOCK_N, FP8_BLOCK]) if tma else weight
    tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    programs = min(tiles, cfg.PROGRAMS_PER_SM * multiprocessors(q.device)) if cfg.PROGRAMS_PER_SM else tiles
    _fp8_linear_kernel[(programs,)](
        q_src, sx, w_src, weight_scale, bias if bias is not None else weight_scale, y, weight_scale,
        m, n, k, sx.shape[1], 1,
        q.stride(0), 0, weight.stride(0), 0, weight_scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=interpreted, GROUPED=False, BLOCK_G=1,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=FP8_BLOCK, GROUP_M=cfg.GROUP_M, TMA=tma,
        PERSISTENT=programs < tiles, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       offsets: list[int] | torch.Tensor, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [M, K] times FP8 weight[g] ([G, N, K] e4m3, scales
    [G, ceil(N/128), ceil(K/128)]) -> [M, N] in x.dtype. Each row is quantized once and its
    product is fp8_linear's; the offsets may be a device tensor (no host sync). config: the
    launch's tiles (default INTERPRETED_CONFIG interpreted, one fixed config compiled; its
    GROUP_M is unused: the row tiles follow the groups)."""
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
    cfg = config or (INTERPRETED_CONFIG if interpreted else _GROUPED_CUDA_CONFIG)     # its TMA unused: pointer loads
    tiles = (m // cfg.BLOCK_M + min(g, m) if offs is None
             else sum(-(-(b - a) // cfg.BLOCK_M) for a, b in zip(offs, offs[1:])))
    if tiles == 0:
        return y
    _fp8_linear_kernel[(tiles, triton.cdiv(n, cfg.BLOCK_N))](
        q, sx, weight, weight_scale, weight_scale, y, offs_t,
        m, n, k, kb, g,
        q.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0), weight_scale.stride(1), y.stride(0),
        HAS_BIAS=False, UPCAST=interpreted, GROUPED=True, BLOCK_G=max(16, next_pow2(g)),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=FP8_BLOCK, GROUP_M=cfg.GROUP_M, TMA=False, PERSISTENT=False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
