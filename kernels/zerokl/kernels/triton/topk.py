"""Deterministic top-k of indexer scores: `topk_positions(scores [T, L], positions [T, L], k)`.

Order: highest score first; equal scores -> the LOWER position first; -0.0 counts as +0.0;
-inf, NaN and entries with position < 0 are never selected. The k winners are returned
sorted ascending by position, padded with -1 at the end when fewer than k are valid.

Every valid entry is packed into one int64 whose signed order IS that order:
    key   = monotone int32 image of the canonical fp32 score (bits ^ 0x7fffffff when negative)
    packed = (-1 - key) << 32 | position           (position must lie in [0, 2**32))
Invalid entries become INT64_MAX. Since no two valid entries of a row pack equal (positions
are distinct), "the k smallest packed values" is a single, well-defined set: any algorithm
that finds it exactly (and a sort does) returns the same bits, whatever the batch, so
batch invariance holds by construction, not by care about reduction order.

Kernel: one program per (row, chunk of CHUNK entries): bitonic-sort the packed chunk ascending
(`_sort_ascending`: compare-and-swap from min/max over size-2 axes of a hypercube view).
If the row fits one chunk (L <= TOPK_MAX_CHUNK, or 2*next_pow2(k) if larger), that program
finishes: keeps the first k, turns them into positions, sorts those ascending and writes.
Longer rows run a tournament: each chunk writes its own best next_pow2(k) packed values,
and the survivors are reduced again the same way until one chunk is left. The global
top-k of a strict total order is always among the per-chunk top-k, so the tournament
returns exactly what one big sort would. (A single-program sort of a whole 128k-entry
row would not fit on-chip; the tournament keeps every sort at TOPK_MAX_CHUNK entries.)

Columns (`positions=None`: a row's position is its column, the model's case): no sort at all.
`_topk_columns_kernel`, one program per row, finds the k-th highest score key exactly by a
radix select (4 passes over the row, one 8-bit digit of the 32-bit monotone key each: a 256-bin
histogram of the entries still on the threshold's chosen prefix, the count of those above it
carried along), and emits in one last pass, in column order, every entry above the threshold
plus the lowest-column entries equal to it until k are chosen. That is the same set as the packed
order's k smallest (ties to the lower column), already ascending: the same bits as the sort, at
5 passes over the row instead of a bitonic network of log2(L)^2 / 2 stages. (4-bit digits, 8
counting passes and a count pass, gave the same bits 1.2x to 1.9x slower on an H100: docs/perf.md.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_launchable, is_interpreted, next_pow2

__all__ = ["TOPK_COLUMNS_MAX_BLOCK", "TOPK_COLUMNS_MIN_BLOCK", "TOPK_MAX_CHUNK", "topk_positions"]

TOPK_MAX_CHUNK = 4096  # entries sorted by one program (raised to 2*next_pow2(k) for large k)
# Compiled kernels may sort with tl.sort instead of _sort_ascending (the interpreter runs tl.sort's
# xor-reduction in Python, ~10x slower). Sorting integers has one answer, so either gives the same bits.
TOPK_USE_TL_SORT = True
# Entries of a row one pass of _topk_columns_kernel reads per tile: the row length rounded up to a power of two,
# within these bounds.
TOPK_COLUMNS_MIN_BLOCK = 1024
TOPK_COLUMNS_MAX_BLOCK = 4096


@triton.jit
def _indicator(N_DIMS: tl.constexpr, J: tl.constexpr):
    """0/1 along the J-th innermost axis of a [2] * N_DIMS hypercube (broadcastable)."""
    return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - J - 1) + [2] + [1] * J)


@triton.jit
def _compare_and_swap(h, flip, I: tl.constexpr, N_DIMS: tl.constexpr):
    """Bitonic compare-and-swap across the I-th innermost axis of the hypercube h: the left
    slot of each pair gets the min and the right slot the max (reversed where flip is 1).
    Built from min/max over a size-2 axis (native reductions; exact for integers)."""
    lo = tl.min(h, axis=N_DIMS - 1 - I, keep_dims=True)
    hi = tl.max(h, axis=N_DIMS - 1 - I, keep_dims=True)
    take_hi = (flip ^ _indicator(N_DIMS, I)) != 0
    return tl.where(take_hi, hi, lo)


@triton.jit
def _sort_ascending(x, LOG_N: tl.constexpr):
    """Bitonic sort of a [2**LOG_N] integer tensor, ascending (LOG_N >= 1)."""
    h = tl.reshape(x, [2] * LOG_N)
    for stage in tl.static_range(1, LOG_N + 1):
        if stage < LOG_N:
            flip = _indicator(LOG_N, stage)
        else:
            flip = tl.zeros([1] * LOG_N, dtype=tl.int32)
        for i in tl.static_range(stage):
            h = _compare_and_swap(h, flip, stage - 1 - i, LOG_N)
    return tl.reshape(h, [2**LOG_N])


@triton.jit
def _monotone_key(sc):
    """fp32 scores [BLOCK] -> (unsigned monotone key as int64 in [0, 2**32), valid): -0.0 as +0.0."""
    valid = sc > float("-inf")  # NaN compares false: never selected
    sc = tl.where(sc == 0.0, 0.0, sc)
    bits = sc.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-monotone in the score
    return key.to(tl.int64) + 2147483648, valid


@triton.jit(do_not_specialize=["W", "K"])
def _topk_columns_kernel(score_ptr, out_ptr, W, K, s_score, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = score_ptr + row * s_score
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 512)                      # 256 digits and bin 256 (entries off the chosen prefix)
    # Radix select: tau = the largest key with at least K valid entries >= it, one byte per pass, high byte first.
    tau = tl.zeros((), dtype=tl.int64)            # the threshold's digits chosen so far
    above = tl.zeros((), dtype=tl.int32)          # valid entries known to be above the threshold
    n_valid = tl.zeros((), dtype=tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        counts = tl.zeros((512,), dtype=tl.int32)
        for start in range(0, W, BLOCK):
            j = start + offs
            key, valid = _monotone_key(tl.load(base + j, mask=j < W, other=float("-inf")).to(tl.float32))
            match = valid & ((key >> (shift + 8)) == (tau >> (shift + 8)))       # on the prefix chosen so far
            digit = tl.where(match, (key >> shift) & 255, 256).to(tl.int32)
            counts += tl.histogram(digit, 512)
        counts = tl.where(bins < 256, counts, 0)
        total = tl.sum(counts)
        if p == 0:
            n_valid = total                                                  # pass 0's prefix is empty: every valid entry
        suffix = total - tl.cumsum(counts, axis=0) + counts                  # entries on the prefix with digit >= d
        # suffix falls as the digit rises: the chosen digit is how many of 1..255 still reach K with those above
        step = tl.sum(((above + suffix >= K) & (bins >= 1) & (bins < 256)).to(tl.int32))
        above += tl.sum(tl.where(bins > step, counts, 0))
        tau = tau + (step.to(tl.int64) << shift)
    take_all = n_valid <= K
    need = K - above                                                     # ties at tau to take, lowest columns first
    written = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for start in range(0, W, BLOCK):
        j = start + offs
        key, valid = _monotone_key(tl.load(base + j, mask=j < W, other=float("-inf")).to(tl.float32))
        eq = valid & (key == tau)
        tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0)            # 1-based among ties so far
        sel = valid & ((key > tau) | (eq & (tie_rank <= need)))
        sel = tl.where(take_all, valid, sel)
        slot = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * s_out + slot, j.to(tl.int64), mask=sel)
        written += tl.sum(sel.to(tl.int32))
        ties += tl.sum(eq.to(tl.int32))
    for start in range(0, K, BLOCK):                                     # -1 after the chosen
        i = start + offs
        tl.store(out_ptr + row * s_out + i, tl.full((BLOCK,), -1, dtype=tl.int64), mask=(i >= written) & (i < K))


@triton.jit(do_not_specialize=["W"])
def _topk_kernel(
    score_ptr, pos_ptr, src_ptr, dst_ptr, out_ptr,
    W, K, s_score, s_pos, s_src, s_dst, s_out,
    FROM_SCORES: tl.constexpr, FINAL: tl.constexpr, CHUNK: tl.constexpr, LOG_CHUNK: tl.constexpr, KP: tl.constexpr,
    TL_SORT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = tl.arange(0, CHUNK)
    j = chunk * CHUNK + idx
    j_mask = j < W
    big = tl.full((CHUNK,), 9223372036854775807, dtype=tl.int64)
    if FROM_SCORES:
        sc = tl.load(score_ptr + row * s_score + j, mask=j_mask, other=float("-inf")).to(tl.float32)
        ps = tl.load(pos_ptr + row * s_pos + j, mask=j_mask, other=-1).to(tl.int64)
        valid = (sc > float("-inf")) & (ps >= 0)  # NaN compares false: never selected
        sc = tl.where(sc == 0.0, 0.0, sc)  # -0.0 -> +0.0
        bits = sc.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-monotone in the score
        desc = -1 - key  # descending score, no overflow
        packed = (desc.to(tl.int64) << 32) | ps
        packed = tl.where(valid, packed, big)
    else:
        packed = tl.load(src_ptr + row * s_src + j, mask=j_mask, other=9223372036854775807)
    if TL_SORT:
        ordered = tl.sort(packed)
    else:
        ordered = _sort_ascending(packed, LOG_CHUNK)
    if FINAL:
        keep = (idx < K) & (ordered != big)
        low = ordered - ((ordered >> 32) << 32)  # the position (low 32 bits)
        if TL_SORT:
            chosen = tl.sort(tl.where(keep, low, big))
        else:
            chosen = _sort_ascending(tl.where(keep, low, big), LOG_CHUNK)
        res = tl.where(chosen == big, -1, chosen)
        tl.store(out_ptr + row * s_out + idx, res, mask=idx < K)
    else:
        tl.store(dst_ptr + row * s_dst + chunk * KP + idx, ordered, mask=idx < KP)


def topk_positions(scores: torch.Tensor, positions: torch.Tensor | None, k: int) -> torch.Tensor:
    """Deterministic top-k positions per row, sorted ascending, -1 padded. See the module doc.
    ``positions=None``: each entry's position is its column (the radix-select kernel)."""
    op = "topk_positions"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.dtype.is_floating_point:
        raise ValueError(f"{op}: scores must be a 2-D float tensor [T, L]")
    if positions is None:
        return _topk_columns(op, scores, k)
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: positions must be an int64 (or int32) tensor [T, L]")
    if positions.shape != scores.shape:
        raise ValueError(f"{op}: positions {tuple(positions.shape)} must match scores {tuple(scores.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{op}: k must be a non-negative int, got {k!r}")
    check_launchable(op, _topk_kernel, scores, positions)
    if positions.device.type != "cuda" and positions.numel() and int(positions.max()) >= 2**32:
        raise ValueError(f"{op}: positions must be < 2**32")
    t, l = scores.shape
    out = torch.full((t, k), -1, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0 or l == 0:
        return out
    scores = scores.float().contiguous()
    positions = positions.contiguous()
    kp = next_pow2(k)
    max_chunk = max(TOPK_MAX_CHUNK, 2 * kp)
    src = None
    width = l
    while True:
        chunk = max(min(next_pow2(width), max_chunk), kp, 16)
        n_chunks = triton.cdiv(width, chunk)
        final = n_chunks == 1
        dst = out if final else torch.empty((t, n_chunks * kp), dtype=torch.int64, device=scores.device)
        src_t = src if src is not None else out  # unused pointer when FROM_SCORES
        warps = 4 if chunk <= 1024 else 8
        _topk_kernel[(t, n_chunks)](
            scores, positions, src_t, dst, out,
            width, k, scores.stride(0), positions.stride(0), src_t.stride(0), dst.stride(0), out.stride(0),
            FROM_SCORES=src is None, FINAL=final, CHUNK=chunk, LOG_CHUNK=chunk.bit_length() - 1, KP=kp,
            TL_SORT=TOPK_USE_TL_SORT and not is_interpreted(_topk_kernel), num_warps=warps,
        )
        if final:
            return out
        src, width = dst, n_chunks * kp


def _topk_columns(op: str, scores: torch.Tensor, k: int) -> torch.Tensor:
    """topk_positions with positions = columns: the radix-select kernel, one program per row."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{op}: k must be a non-negative int, got {k!r}")
    check_launchable(op, _topk_columns_kernel, scores)
    t, l = scores.shape
    if t == 0 or k == 0 or l == 0:
        return torch.full((t, k), -1, dtype=torch.int64, device=scores.device)
    scores = scores.float().contiguous()
    out = torch.empty((t, k), dtype=torch.int64, device=scores.device)
    # The tile follows the row's length (the block is not part of the answer, a set): 1,024 scores with 4 warps
    # up to 1,024 columns, 2,048 with 8 up to 2,048, 4,096 with 16 beyond, the fastest tile at each length
    # (tools/bench/bench_topk.py). At most three compiled kernels, whatever the context.
    block = min(max(next_pow2(l), TOPK_COLUMNS_MIN_BLOCK), TOPK_COLUMNS_MAX_BLOCK)
    _topk_columns_kernel[(t,)](scores, out, l, k, scores.stride(0), out.stride(0), BLOCK=block,
                               num_warps=max(1, min(16, block // 256)))
    return out
