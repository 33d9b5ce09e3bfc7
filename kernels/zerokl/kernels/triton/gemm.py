"""Batch-invariant GEMMs: `linear` (y = x @ W.T + b) and `grouped_linear` (MoE / per-group weights).

Invariance by construction:
* Every program computes one [BLOCK_M, BLOCK_N] output tile with a fp32 accumulator and walks
  K in BLOCK_K chunks in ascending order, one tl.dot per chunk. There is no split-K or
  stream-K: one program owns every K step of its tile.
* Interpreted launches (CPU) take (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from
  `gemm_config(N, K, dtype)`: the weight's shape and dtype only, never M. So a row meets the
  same tile shape and the same K order whether it is alone (M = 1) or in any batch, at any
  position; rows of a tile never mix (a dot's row i depends only on row i of A).
* Compiled CUDA launches pick a config by M (`launch_config`, `_CUDA_BUCKETS`, the persistent
  TMA kernel for large M, whose columns `wave_split` may cut between two tile widths). That is invariant because on sm90 an element's bits do not depend
  on the config at all: tl.dot chains k16 MMA steps into one fp32 accumulator in ascending K
  order whatever the tile, warps, stages, MMA flavour or load path (measured over 42 configs,
  asserted by tests/kernels/test_gemm_configs.py; NUMERICS.md). fp32 keeps the canonical one.
  The suite checks M = 1 against many M, positions and neighbours on every path.
* Masked loads pad with zeros (rows past M, K past the end), adding exact zeros.
* grouped_linear cuts each group's rows into BLOCK_M tiles starting at the group's first row;
  a tile never spans two groups, so a token's result depends only on its row and its group's
  weight, never on how many tokens the group got (dropless MoE). Each program finds its tile
  from the offsets on the device (a prefix sum of tiles per group), so offsets may be a device
  tensor: no host sync, no per-call table, CUDA-graph capturable.
* Every kernel walks its reduction with the one jitted loop `_k_loop` (linear, grouped, and the
  grouped weight gradient), so the K order is written once.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (check_float, check_launchable, dot_in_fp32, is_interpreted, multiprocessors, next_pow2,
                      pow2_between, tma_aligned, unit_last)

__all__ = ["GemmConfig", "gemm_config", "grouped_linear", "grouped_linear_wgrad", "launch_config", "linear", "split_partial",
           "tree_combine", "tree_combine_planes"]


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    TMA: bool = False        # persistent TMA kernel (compiled CUDA, bf16/fp16 only)
    FLATTEN: bool = False    # TMA kernel: software-pipeline across tiles


def gemm_config(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """Tile shape for a weight [N, K] of `dtype`: a function of K and the dtype only (never M or N).

    Changing BLOCK_K changes the K summation order, i.e. the numerics version. BLOCK_N is
    fixed too (not shrunk for small N), so a column's result never depends on how many
    columns the weight has: a column shard of a weight (tensor parallelism) computes the
    matching columns of the full product with the same tile shape. `n` is kept in the
    signature for callers; it does not influence the choice.
    """
    if dtype == torch.float32:
        # fp32 operands are dotted with input_precision="ieee" (no tf32 rounding).
        return GemmConfig(64, 64, pow2_between(k, 16, 32), 4, 3)
    # bf16/fp16: 128x128x64 tiles, 8 warps (two warpgroups of wgmma on Hopper).
    return GemmConfig(128, 128, pow2_between(k, 16, 64), 8, 3)


# Tile configs used on CUDA, by M bucket: (max M, {(N, K) or None: GemmConfig}). Every entry
# keeps the canonical per-element arithmetic (see launch_config); filled from
# tools/bench/bench_linear.py --sweep on the H200.
# Measured on an H200 (docs/perf.md): small M is bound by how many programs stream the weight
# (N / BLOCK_N of them), so decode sizes take 16 x 32 tiles (with 128-deep K chunks, 5 stages);
# large M takes the persistent TMA kernel.
_TMA_128 = GemmConfig(128, 128, 64, 4, 4, TMA=True)   # also the narrow tail of wave_split
_CUDA_BUCKETS: list[tuple[int, dict]] = [
    (64, {None: GemmConfig(16, 32, 128, 2, 5)}),
    (256, {None: GemmConfig(64, 64, 64, 4, 4)}),
    (1024, {None: _TMA_128}),
    (1 << 62, {None: GemmConfig(128, 256, 64, 8, 3, TMA=True)}),
]


def launch_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """The tile config one launch uses.

    Interpreted (CPU) launches always use gemm_config(n, k, dtype): numpy's block matmul
    makes the bits depend on the tile. Compiled CUDA launches may pick a faster config by M
    from _CUDA_BUCKETS; only configs whose per-element bits equal the canonical config's are
    allowed there (tests/kernels/test_triton_kernels.py::test_gemm_configs_bit_identical_on_gpu
    checks every entry on the GPU).
    """
    canonical = gemm_config(n, k, dtype)
    if device.type != "cuda" or dtype == torch.float32:
        return canonical
    for max_m, table in _CUDA_BUCKETS:
        if m <= max_m:
            cfg = table.get((n, k)) or table.get(None) or canonical
            if k % cfg.BLOCK_K:
                # A ragged K keeps the canonical chunking, so the zero-padded tail of the last
                # chunk is the same run of exact-zero products as the canonical config's.
                cfg = dataclasses.replace(cfg, BLOCK_K=canonical.BLOCK_K)
            return cfg
    return canonical


@triton.jit
def _k_loop(acc, a_rows, b_cols, a_mask, b_mask, K, stride_ak, stride_bk,
            DOT_F32: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BM, BN] += A[:, :K] @ B[:K, :]: ascending BLOCK_K chunks, one tl.dot each into the
    same fp32 accumulator (the reduction order of every GEMM in this module).

    a_rows [BM, 1] / b_cols [1, BN]: pointers to A's rows / B's columns at reduction index 0;
    a_mask [BM] / b_mask [BN]: which exist (the others load exact zeros); stride_ak / stride_bk:
    the reduction strides. EVEN_K: K is a multiple of BLOCK_K (no reduction mask).
    """
    rk = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):  # ascending K chunks
        kk = k0 + rk
        if EVEN_K:
            a = tl.load(a_rows + kk[None, :] * stride_ak, mask=a_mask[:, None], other=0.0)
            b = tl.load(b_cols + kk[:, None] * stride_bk, mask=b_mask[None, :], other=0.0)
        else:
            k_mask = kk < K
            a = tl.load(a_rows + kk[None, :] * stride_ak, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_cols + kk[:, None] * stride_bk, mask=k_mask[:, None] & b_mask[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Program pid's output tile (row tile, column tile), int64, in grouped order: GROUP_M row tiles
    # walk a column band together, so the band's weight stays in L2 while they read it. The order in
    # which programs run never enters a tile's arithmetic.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = (first_m + (pid % per_group) % rows_in_group).to(tl.int64)
    pid_n = ((pid % per_group) // rows_in_group).to(tl.int64)
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_ys,
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    # program_id(1) is the K segment (split_partial): segment s reads K columns
    # [s K, (s + 1) K) and writes its own fp32 plane y + s * stride_ys. Plain linear: one segment.
    seg = tl.program_id(1).to(tl.int64)
    x_ptr += seg * K * stride_xk
    w_ptr += seg * K * stride_wk
    y_ptr += seg * stride_ys
    pid_m, pid_n = _swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = _k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                  x_ptr + rm[:, None] * stride_xm, w_ptr + rn[None, :] * stride_wn, m_mask, n_mask,
                  K, stride_xk, stride_wk, DOT_F32, BLOCK_K, EVEN_K)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias); x [..., K], weight [N, K]; fp32 accumulation.

    Output in out_dtype (default x.dtype); torch.float32 stores the accumulator unrounded
    (the partials of ops.split_linear). Only the final store's dtype changes.
    """
    op = "linear"
    check_float(op, "x", x)
    check_float(op, "weight", weight, ndim=2)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim, got a scalar")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} != weight's K {k} (weight is [N, K] = {tuple(weight.shape)})")
    if bias is not None:
        check_float(op, "bias", bias, ndim=1)
        if bias.shape[0] != n:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements, weight has N = {n}")
    check_launchable(op, _linear_kernel, x, weight, bias)
    lead = x.shape[:-1]
    x2 = unit_last(x.reshape(-1, k))
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"{op}: out_dtype must be x's dtype or float32, got {out_dtype}")
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if k == 0:
        y.zero_()
        if bias is not None:
            y += bias.float().to(out_dtype)
        return y.reshape(*lead, n)
    cfg = config or launch_config(m, n, k, weight.dtype, x.device)
    if _tma_ok(x2, weight, y, cfg):
        _linear_tma(x2, weight, bias, y, cfg)
        return y.reshape(*lead, n)
    grid = (triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N),)
    _linear_kernel[grid](
        x2, weight, bias if bias is not None else weight, y,
        m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), 0,
        HAS_BIAS=bias is not None, DOT_F32=dot_in_fp32(_linear_kernel, x.dtype, weight.dtype),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M, EVEN_K=k % cfg.BLOCK_K == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.reshape(*lead, n)


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(
    x_desc, w_desc, y_desc, b_ptr,
    M, N, K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Persistent Hopper variant of _linear_kernel (compiled CUDA only): tiles loaded by the
    tensor-memory accelerator (zero padding past M, N, K), NUM_SMS programs walking the tiles
    in grouped order. The per-tile arithmetic is the same chain of tl.dot into one fp32
    accumulator over ascending K chunks, so an element's bits are _linear_kernel's (checked on
    the GPU by the tests and by every bench run)."""
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_m * num_n
    per_group = GROUP_M * num_n
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN):
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows_in_group
        pid_n = (tile % per_group) // rows_in_group
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([off_m, ki * BLOCK_K])
            b = w_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc, input_precision="ieee")
        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


def _tma_ok(x2: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, cfg: GemmConfig) -> bool:
    if not cfg.TMA or x2.device.type != "cuda" or is_interpreted(_linear_kernel):
        return False
    if x2.dtype != weight.dtype or x2.dtype not in (torch.bfloat16, torch.float16):
        return False
    if y.dtype != x2.dtype:
        return False
    return all(tma_aligned(t) for t in (x2, weight, y))


def wave_split(m: int, n: int, cfg: GemmConfig, sms: int, tail: GemmConfig) -> int:
    """Columns [0, n0) of a persistent launch keep cfg's tiles and [n0, n) take `tail`'s
    narrower tiles; returns n0 (n: no split).

    A persistent launch of T tiles on `sms` programs takes ceil(T / sms) tile-times: at M = 2048,
    N = 7168 the 16 x 28 = 448 tiles of 128x256 are 3.4 waves, so the 4th wave runs 40% full.
    Cutting the columns so the wide part fills whole waves and the rest runs as one wave of
    half-width tiles saves most of that wave. Bits are unchanged: on sm90 an element's value
    does not depend on its tile (module docstring), so both launches give the canonical bits.
    Cost model: a tail tile counts 0.6 of a wide one (it streams the same K at half the width,
    and is less efficient); a split must save 8%.
    """
    if tail.BLOCK_M != cfg.BLOCK_M or 2 * tail.BLOCK_N != cfg.BLOCK_N:
        return n
    num_m, num_n = triton.cdiv(m, cfg.BLOCK_M), triton.cdiv(n, cfg.BLOCK_N)
    if num_n < 2:
        return n
    def cost(c: int) -> float:            # tile-times of c wide column tiles + the tail
        narrow = triton.cdiv(n - c * cfg.BLOCK_N, tail.BLOCK_N)
        return triton.cdiv(num_m * c, sms) + 0.6 * triton.cdiv(num_m * narrow, sms)
    c = min(range(1, num_n), key=cost)
    return c * cfg.BLOCK_N if cost(c) < 0.92 * triton.cdiv(num_m * num_n, sms) else n


def _linear_tma(x2, weight, bias, y, cfg: GemmConfig) -> None:
    m, k = x2.shape
    n = weight.shape[0]
    sms = multiprocessors(x2.device)
    tail = _TMA_128
    n0 = wave_split(m, n, cfg, sms, tail)
    _linear_tma_launch(x2, weight[:n0], None if bias is None else bias[:n0], y[:, :n0], cfg, sms)
    if n0 < n:
        _linear_tma_launch(x2, weight[n0:], None if bias is None else bias[n0:], y[:, n0:], tail, sms)


def _linear_tma_launch(x2, weight, bias, y, cfg: GemmConfig, sms: int) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = x2.shape
    n = weight.shape[0]
    xd = TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [cfg.BLOCK_M, cfg.BLOCK_K])
    wd = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.BLOCK_N, cfg.BLOCK_K])
    yd = TensorDescriptor(y, [m, n], [y.stride(0), 1], [cfg.BLOCK_M, cfg.BLOCK_N])
    tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    _linear_tma_kernel[(min(sms, tiles),)](
        xd, wd, yd, bias if bias is not None else weight,
        m, n, k,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M, NUM_SMS=sms, FLATTEN=cfg.FLATTEN,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@triton.jit
def _plane(p_ptr, s: tl.constexpr, MN, TABLE: tl.constexpr):
    """Start of fp32 plane s: p + s * MN (one contiguous [S, MN] tensor), or, with TABLE, the
    address held in p[s] (an int64 table of plane addresses, e.g. peers' symmetric memory)."""
    if TABLE:
        return tl.load(p_ptr + s).to(tl.pointer_type(tl.float32))
    else:
        return p_ptr + s * MN


@triton.jit
def _tree_kernel(p_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr,
                 TABLE: tl.constexpr):
    """y = tree_sum of the S fp32 planes (adjacent pairs, level by level), rounded to y's dtype."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    p0 = tl.load(_plane(p_ptr, 0, MN, TABLE) + i, mask=mask, other=0.0)
    if S == 1:
        t = p0
    else:
        p1 = tl.load(_plane(p_ptr, 1, MN, TABLE) + i, mask=mask, other=0.0)
        if S == 2:
            t = p0 + p1
        else:
            p2 = tl.load(_plane(p_ptr, 2, MN, TABLE) + i, mask=mask, other=0.0)
            p3 = tl.load(_plane(p_ptr, 3, MN, TABLE) + i, mask=mask, other=0.0)
            if S == 4:
                t = (p0 + p1) + (p2 + p3)
            else:
                p4 = tl.load(_plane(p_ptr, 4, MN, TABLE) + i, mask=mask, other=0.0)
                p5 = tl.load(_plane(p_ptr, 5, MN, TABLE) + i, mask=mask, other=0.0)
                p6 = tl.load(_plane(p_ptr, 6, MN, TABLE) + i, mask=mask, other=0.0)
                p7 = tl.load(_plane(p_ptr, 7, MN, TABLE) + i, mask=mask, other=0.0)
                t = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))
    if RNE_BF16:
        # fp32 -> bf16 round-to-nearest-even by integer arithmetic (torch's .to(bfloat16) rule on
        # every device; the interpreter's own cast truncates). NaN stays NaN.
        u = t.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(y_ptr + i, tl.where(t != t, t.to(tl.bfloat16), r), mask=mask)
    else:
        tl.store(y_ptr + i, t.to(y_ptr.dtype.element_ty), mask=mask)


def _tree_launch(planes: torch.Tensor, s: int, shape, out_dtype: torch.dtype, device, table: bool) -> torch.Tensor:
    if s not in (1, 2, 4, 8):
        raise ValueError(f"tree_combine: the tree joins 1, 2, 4 or 8 planes, got {s}")
    direct = out_dtype in (torch.float32, torch.bfloat16)
    y = torch.empty(shape, dtype=out_dtype if direct else torch.float32, device=device)
    mn = y.numel()
    if mn:
        _tree_kernel[(triton.cdiv(mn, 1024),)](planes, y, mn, S=s, BLOCK=1024,
                                               RNE_BF16=out_dtype == torch.bfloat16, TABLE=table)
    return y if direct else y.to(out_dtype)


def tree_combine(parts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """tree_sum over the leading dim of fp32 `parts` [S, ...] (S in 1, 2, 4, 8), rounded to
    out_dtype as torch rounds (fp32 / bf16 in the kernel; other dtypes via torch's cast)."""
    if parts.dtype != torch.float32 or parts.dim() < 1:
        raise ValueError(f"tree_combine: need fp32 [S, ...], got {parts.dtype} {tuple(parts.shape)}")
    return _tree_launch(parts.contiguous(), parts.shape[0], parts.shape[1:], out_dtype, parts.device, table=False)


def tree_combine_planes(plane_ptrs: torch.Tensor, shape: tuple[int, ...], out_dtype: torch.dtype) -> torch.Tensor:
    """tree_combine over S fp32 planes given by address: `plane_ptrs` is an int64 tensor [S] on
    the output's device holding each plane's address (rank order), each plane holds
    prod(shape) contiguous fp32 values. The planes may live in other GPUs' memory mapped into
    this one (torch symmetric memory): the tensor-parallel join reads its peers' subtrees
    where they lie, in the same tree as tree_combine. The caller keeps the planes alive and
    written before the launch (stream order, or a barrier for peers)."""
    if plane_ptrs.dtype != torch.int64 or plane_ptrs.dim() != 1:
        raise ValueError(f"tree_combine_planes: plane_ptrs must be int64 [S], got {plane_ptrs.dtype} "
                         f"{tuple(plane_ptrs.shape)}")
    return _tree_launch(plane_ptrs, plane_ptrs.shape[0], tuple(shape), out_dtype, plane_ptrs.device, table=True)


def split_partial(x: torch.Tensor, weight: torch.Tensor, splits: int,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ops.split_partial in two launches: every K segment's fp32 product in one GEMM launch
    (segment = a grid axis; each segment is exactly `linear(x_seg, w_seg, out_dtype=fp32)`,
    same tile config rule, same K order), then the fixed pairwise tree over the segments,
    rounded to out_dtype (fp32: the rank's subtree; x.dtype: split_linear without bias).
    splits in {1, 2, 4, 8}."""
    op = "split_partial"
    check_float(op, "x", x)
    check_float(op, "weight", weight, ndim=2)
    n, k = weight.shape
    if splits not in (1, 2, 4, 8) or k % splits or x.shape[-1] != k:
        raise ValueError(f"{op}: K = {k} (x {tuple(x.shape)}) must split into {splits} in (1, 2, 4, 8) equal segments")
    check_launchable(op, _linear_kernel, x, weight)
    lead = x.shape[:-1]
    x2 = unit_last(x.reshape(-1, k))
    m, seg = x2.shape[0], k // splits
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    if seg == 0:
        parts.zero_()
    else:
        cfg = launch_config(m, n, seg, weight.dtype, x.device)
        grid = (triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N), splits)
        _linear_kernel[grid](
            x2, weight, weight, parts,
            m, n, seg,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), parts.stride(1), parts.stride(0),
            HAS_BIAS=False, DOT_F32=dot_in_fp32(_linear_kernel, x.dtype, weight.dtype),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
            GROUP_M=cfg.GROUP_M, EVEN_K=seg % cfg.BLOCK_K == 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    block = 1024
    direct = out_dtype in (torch.float32, torch.bfloat16)      # fp16: fp32 tree, then torch's cast
    tree = y if direct else torch.empty((m, n), dtype=torch.float32, device=x.device)
    _tree_kernel[(triton.cdiv(m * n, block),)](parts, tree, m * n, S=splits, BLOCK=block,
                                               RNE_BF16=out_dtype == torch.bfloat16, TABLE=False)
    return (y if direct else tree.to(out_dtype)).reshape(*lead, n)


@triton.jit
def _group_tile(offs_ptr, tile, G, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Row tile `tile` of a grouped GEMM: (group, first row, end row); group >= G past the last tile.

    Group g's rows offs[g]:offs[g+1] are cut into cdiv(rows, BLOCK_M) tiles starting at offs[g];
    tiles are numbered group after group (a prefix sum of the per-group tile counts), so the
    tiles and their rows are a function of the offsets alone. BLOCK_G >= G.
    """
    i = tl.arange(0, BLOCK_G)
    lo = tl.load(offs_ptr + i, mask=i < G, other=0).to(tl.int32)
    hi = tl.load(offs_ptr + i + 1, mask=i < G, other=0).to(tl.int32)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)                        # one past each group's last tile
    g = tl.sum((ends <= tile).to(tl.int32), 0)        # groups wholly before this tile
    here = i == g
    first_tile = tl.sum(tl.where(here, ends - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, lo, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(here, hi, 0), 0)
    return g, row0, row_end


@triton.jit
def _grouped_linear_kernel(
    x_ptr, w_ptr, y_ptr, offs_ptr,
    G, N, K,
    stride_xm, stride_xk, stride_wg, stride_wn, stride_wk, stride_ym,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    # program_id(0): a row tile (the grid may hold more than there are: those exit);
    # program_id(1): a BLOCK_N column band.
    g, row0, row_end = _group_tile(offs_ptr, tl.program_id(0), G, BLOCK_M, BLOCK_G)
    if g >= G:
        return
    pid_n = tl.program_id(1).to(tl.int64)
    rm = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < row_end  # a tile never reads rows of the next group
    n_mask = rn < N
    acc = _k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                  x_ptr + rm[:, None] * stride_xm, w_ptr + g.to(tl.int64) * stride_wg + rn[None, :] * stride_wn,
                  m_mask, n_mask, K, stride_xk, stride_wk, DOT_F32, BLOCK_K, EVEN_K)
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    g_ptr, x_ptr, dw_ptr, offs_ptr,
    N, K,
    stride_gm, stride_gn, stride_xm, stride_xk, stride_wg, stride_wn, stride_wk,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dW[grp] [N, K] = dY[rows]^T @ X[rows] over the group's rows: one [BLOCK_N, BLOCK_K] tile of
    # one group per program; the rows are the reduction, walked by _k_loop in ascending BLOCK_M
    # chunks (one program owns the whole sum: no split, no atomics, the same bits every run).
    grp = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(2).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    row0 = tl.load(offs_ptr + grp).to(tl.int64)
    rows = tl.load(offs_ptr + grp + 1).to(tl.int64) - row0
    n_mask = rn < N
    k_mask = rk < K
    acc = _k_loop(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32),
                  g_ptr + row0 * stride_gm + rn[:, None] * stride_gn, x_ptr + row0 * stride_xm + rk[None, :] * stride_xk,
                  n_mask, k_mask, rows, stride_gm, stride_xm, DOT_F32, BLOCK_M, False)
    dw = dw_ptr + grp * stride_wg + rn[:, None] * stride_wn + rk[None, :] * stride_wk
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def _check_offsets(op: str, offsets, groups: int, m: int) -> list[int]:
    try:
        offs = [int(o) for o in offsets]
    except TypeError as e:
        raise ValueError(f"{op}: offsets must be a sequence of ints or an int tensor") from e
    if len(offs) != groups + 1:
        raise ValueError(f"{op}: offsets must have G + 1 = {groups + 1} entries, got {len(offs)}")
    if offs[0] != 0 or offs[-1] != m:
        raise ValueError(f"{op}: offsets must start at 0 and end at M = {m}, got {offs[0]}..{offs[-1]}")
    if any(b < a for a, b in itertools.pairwise(offs)):
        raise ValueError(f"{op}: offsets must be non-decreasing (rows sorted by group), got {offs}")
    return offs


def _device_offsets(op: str, offsets, groups: int | None, m: int, device: torch.device) -> tuple[torch.Tensor, list[int] | None]:
    """offsets [G+1] as an int tensor on `device`, and the host list when the caller gave one.

    A list is checked (0 = offs[0] <= ... <= offs[G] = M) and copied over. A tensor is taken as
    it is, on the device, unread: checking its values would cost the host sync it exists to avoid,
    so the caller guarantees them (ops.moe_expert_outputs builds them by a search over sorted ids).
    """
    if isinstance(offsets, torch.Tensor):
        if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1:
            raise ValueError(f"{op}: offsets tensor must be int32/int64 [G + 1], got {offsets.dtype} {tuple(offsets.shape)}")
        if groups is not None and offsets.shape[0] != groups + 1:
            raise ValueError(f"{op}: offsets must have G + 1 = {groups + 1} entries, got {offsets.shape[0]}")
        if offsets.device != device:
            raise ValueError(f"{op}: offsets are on {offsets.device}, x on {device}")
        if m >= 2**31:
            raise ValueError(f"{op}: M = {m} rows exceed the int32 tile search")
        return offsets.contiguous(), None
    offs = _check_offsets(op, offsets, len(offsets) - 1 if groups is None else groups, m)
    if m >= 2**31:
        raise ValueError(f"{op}: M = {m} rows exceed the int32 tile search")
    return _offsets_on(tuple(offs), device), offs


_CAPTURED_OFFSETS: dict[tuple, torch.Tensor] = {}     # offsets a CUDA graph reads: kept for good


def _offsets_on(offs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Host offsets as a cached int32 device tensor.

    The attention's per-head projections repeat the same offsets every step, so after the
    first call nothing is copied (a fresh host->device copy is a synchronization a CUDA graph
    cannot hold). A tensor used while a graph is being captured is kept for the process's life.
    """
    t = _offsets_cached(offs, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _CAPTURED_OFFSETS[(offs, device)] = t
    return t


@functools.lru_cache(maxsize=256)
def _offsets_cached(offs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(offs, dtype=torch.int32).to(device)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: list[int] | torch.Tensor,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [M, K] times weight[g].T ([G, N, K]) -> [M, N] in x.dtype.

    offsets: G + 1 non-decreasing row offsets from 0 to M, a list of ints or an int32/int64
    tensor on x's device (then never read back on the host: no sync, graph-capturable; its
    values are the caller's promise). weight may have any strides (weight.transpose(1, 2) is
    the backward's dX operand).

    A row's bits depend only on the row and its group's weight, never on how many rows share
    the group: each group's rows are cut into BLOCK_M tiles from its first row, with the same
    tile shape (gemm_config of the per-group weight [N, K]) for every group and every M. The
    grid is an upper bound on the tile count (M // BLOCK_M + min(G, M)) unless the offsets are
    a host list; programs past the last tile exit.
    """
    op = "grouped_linear"
    check_float(op, "x", x, ndim=2)
    check_float(op, "weight", weight, ndim=3)
    g, n, k = weight.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"{op}: x's last dim {x.shape[1]} != weight's K {k} (weight is [G, N, K] = {tuple(weight.shape)})")
    offs_t, offs = _device_offsets(op, offsets, g, m, x.device)
    check_launchable(op, _grouped_linear_kernel, x, weight)
    x = unit_last(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    # The tile config is chosen from rows per busy group (on CUDA every config in use gives the
    # same bits; interpreted launches always take the canonical one, see launch_config).
    busy = min(g, m) if offs is None else sum(1 for a, b in itertools.pairwise(offs) if b > a)
    cfg = config or launch_config(-(-m // max(busy, 1)), n, k, weight.dtype, x.device)
    if offs is None:
        tiles = m // cfg.BLOCK_M + min(g, m)
    else:
        tiles = sum(-(-(b - a) // cfg.BLOCK_M) for a, b in itertools.pairwise(offs))
    if tiles == 0:
        return y
    grid = (tiles, triton.cdiv(n, cfg.BLOCK_N))
    _grouped_linear_kernel[grid](
        x, weight, y, offs_t,
        g, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0),
        DOT_F32=dot_in_fp32(_grouped_linear_kernel, x.dtype, weight.dtype),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, EVEN_K=k % cfg.BLOCK_K == 0,
        BLOCK_G=max(16, next_pow2(g)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def _wgrad_config(dtype: torch.dtype) -> GemmConfig:
    """Tiles of the weight gradient: BLOCK_N x BLOCK_K output tiles, BLOCK_M rows per reduction step.
    Gradients are promised deterministic, not batch-invariant, so this is a speed choice only."""
    if dtype == torch.float32:
        return GemmConfig(32, 64, 64, 4, 3)
    return GemmConfig(32, 128, 128, 8, 3)


def grouped_linear_wgrad(grad: torch.Tensor, x: torch.Tensor, offsets: list[int] | torch.Tensor,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight gradient of grouped_linear: dW[g] = grad[rows of g]^T @ x[rows of g] -> [G, N, K].

    grad [M, N], x [M, K], offsets as grouped_linear's (G + 1 entries; a device tensor is not
    read back). fp32 accumulation over each group's rows in ascending BLOCK_M chunks, one program
    per output tile (no split of the rows, no atomics): the same bits on every run. A group
    without rows gets zeros. Rounded to out_dtype (default x.dtype).
    """
    op = "grouped_linear_wgrad"
    check_float(op, "grad", grad, ndim=2)
    check_float(op, "x", x, ndim=2)
    m, n = grad.shape
    k = x.shape[1]
    if x.shape[0] != m:
        raise ValueError(f"{op}: grad has {m} rows, x has {x.shape[0]}")
    g = (offsets.shape[0] if isinstance(offsets, torch.Tensor) else len(offsets)) - 1
    if g < 0:
        raise ValueError(f"{op}: offsets must have G + 1 >= 1 entries")
    offs_t, _ = _device_offsets(op, offsets, g, m, x.device)
    check_launchable(op, _grouped_wgrad_kernel, grad, x)
    dw = torch.empty((g, n, k), dtype=out_dtype or x.dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    if m == 0:
        return dw.zero_()
    cfg = _wgrad_config(x.dtype)
    grid = (g, triton.cdiv(n, cfg.BLOCK_N), triton.cdiv(k, cfg.BLOCK_K))
    _grouped_wgrad_kernel[grid](
        grad, x, dw, offs_t,
        n, k,
        grad.stride(0), grad.stride(1), x.stride(0), x.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        DOT_F32=dot_in_fp32(_grouped_wgrad_kernel, grad.dtype, x.dtype),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dw
