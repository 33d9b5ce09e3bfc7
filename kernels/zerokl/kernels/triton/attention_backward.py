"""Backward of absorbed MLA attention (attention.py): `mla_attention_backward`.

Recompute-style flash backward over the SAME key selection the forward used. With
s = scale * (q_latent . kv[j] + q_rope . k_rope[j]), p = exp(s - lse) and out = sum_j p_j kv[j]
(the latent is both key and value in the absorbed form), for each (query t, head h):
    delta = dOut . out;   dp_j = dOut . kv[j];   ds_j = p_j (dp_j - delta)
    dq_latent = scale sum_j ds_j kv[j]            dq_rope = scale sum_j ds_j k_rope[j]
    dkv[j]    = sum_(t,h) (p dOut + scale ds q_latent)        dk_rope[j] = scale sum_(t,h) ds q_rope

Two kernels, each a fixed order with fp32 accumulators and no atomics:
* `_mla_bwd_dq_kernel`: one program per (query, BLOCK_H heads), the forward's grid; it walks
  the query's own keys in the forward's KV_BLOCK blocks from position 0, so a query's dq and
  delta depend only on its own inputs and key list, never on its neighbours.
* Causal (no key list), `_mla_bwd_dkv_kernel`: one program per key block (up to BLOCK_K
  consecutive slots) walks the (query, head) rows that attend it, the contiguous range from
  the block's first key to the end of its sequence, ROWS at a time. Key blocks start at every
  position that is a multiple of BLOCK_K of each sequence, so a key's gradient depends only on
  its own sequence.
* A key list (the indexer's selection, a cache's slots): in the training layout the queries
  whose list is their whole causal prefix (positions below the list's width: the rows within
  index_topk) go through the key blocks as above; every other (query, listed key) pair goes
  through `_mla_bwd_dkv_parts_kernel`, one program per (query, block of its list), which
  computes each listed key's part of the gradient summed over the query's heads, [R + P] fp32
  per (query, key); `_mla_bwd_dkv_sum_kernel`, one program per key, then adds a key's parts one
  by one in ascending query order onto the key blocks' fp32 sum. Work follows the (query, key)
  pairs: a key block walked by every later query that selected any of its keys did the dense
  causal work for a 2,048-of-16,384 selection (issue 34's profile). The parts are made and
  summed in chunks of queries to bound their memory; a running fp32 sum in ascending query
  order has the same bits for any chunking, and only a key's own sequence selects it.

Gradients are fp32 sums rounded to the inputs' dtype at the end. Deterministic and, in the
training layout, independent of the other sequences in the batch; not bitwise equal to any
other backend's gradients (tolerance against a float64 reference, tests/kernels).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_launchable, dot_in_fp32, next_pow2
from .attention import KV_BLOCK, blocks_to_visit

__all__ = ["DKV_BLOCK_K", "DKV_CHUNK_BYTES", "DKV_ROWS", "mla_attention_backward", "mla_attention_backward_reference"]

# dkv program shape, from the H200 sweep in tools/bench/bench_attention_backward.py (--sweep):
# 16 keys (more programs: the causal triangle's longest program bounds the time) and 64
# (query, head) rows per step were fastest or within noise at both the small and GLM-5 shapes.
DKV_BLOCK_K = 16   # keys per dkv program
DKV_ROWS = 64      # (query, head) rows per dkv step
# Key lists: keys per parts program and heads per step (up to the model's heads), from the H200
# sweep (bench_attention_backward.py --sweep, GLM-5 widths: 16 keys x 64 heads 283 ms per 16k
# backward, 32 x 16 444 ms, 64 x 16 1,334 ms; 32 x 64 needs more shared memory than sm90 has), and
# the memory of one chunk of parts ([queries, list width, R + P] fp32; the chunking never changes
# the bits, only the memory).
DKV_PART_KEYS = 16
DKV_PART_HEADS = 64
DKV_CHUNK_BYTES = 2 << 30


@triton.jit(do_not_specialize=["T"])
def _mla_bwd_dq_kernel(
    ql_ptr, qr_ptr, kv_ptr, kr_ptr, idx_ptr, nblk_ptr, pos_ptr, out_ptr, lse_ptr, do_ptr,
    delta_ptr, dql_ptr, dqr_ptr,
    T, H, R, P, L, scale,
    s_qlt, s_qlh, s_qrt, s_qrh, s_kv, s_kr, s_idx,
    DOT_F32: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, KV_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p_ = tl.arange(0, BLOCK_P)
    j0 = tl.arange(0, KV_BLOCK)
    h_mask = h < H
    hr_mask = h_mask[:, None] & (r < R)[None, :]
    hp_mask = h_mask[:, None] & (p_ < P)[None, :]
    ql = tl.load(ql_ptr + t * s_qlt + h[:, None] * s_qlh + r[None, :], mask=hr_mask, other=0.0)
    qr = tl.load(qr_ptr + t * s_qrt + h[:, None] * s_qrh + p_[None, :], mask=hp_mask, other=0.0)
    if DOT_F32:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    # out, dOut, lse, delta: contiguous [T, H, R] / [T, H] fp32
    o = tl.load(out_ptr + (t * H + h[:, None]) * R + r[None, :], mask=hr_mask, other=0.0)
    do = tl.load(do_ptr + (t * H + h[:, None]) * R + r[None, :], mask=hr_mask, other=0.0)
    # dOut as the dots see it (rounded to the operand dtype): delta and dp from the same values,
    # so sum_j ds_j = 0 holds up to rounding instead of carrying dOut's rounding error
    do = do.to(ql.dtype).to(tl.float32)
    delta = tl.sum(o * do, axis=1)                                   # [BLOCK_H]
    tl.store(delta_ptr + t * H + h, delta, mask=h_mask)
    lse = tl.load(lse_ptr + t * H + h, mask=h_mask, other=0.0)
    do_c = do.to(ql.dtype)
    dql = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    dqr = tl.zeros((BLOCK_H, BLOCK_P), dtype=tl.float32)
    if CAUSAL:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        n_blocks = (pos // KV_BLOCK + 1).to(tl.int32)
    else:
        n_blocks = tl.load(nblk_ptr + t)
    for b in range(n_blocks):                                        # the forward's blocks, in its order
        j = b * KV_BLOCK + j0
        if CAUSAL:
            valid = j <= pos
            slot = tl.where(valid, t - pos + j, 0)
        else:
            slot = tl.load(idx_ptr + t * s_idx + j, mask=j < L, other=-1).to(tl.int64)
            valid = slot >= 0
            slot = tl.where(valid, slot, 0)
        kv = tl.load(kv_ptr + slot[:, None] * s_kv + r[None, :], mask=valid[:, None] & (r < R)[None, :], other=0.0)
        kr = tl.load(kr_ptr + slot[:, None] * s_kr + p_[None, :], mask=valid[:, None] & (p_ < P)[None, :], other=0.0)
        if DOT_F32:
            kv = kv.to(tl.float32)
            kr = kr.to(tl.float32)
        s = tl.dot(ql, tl.trans(kv), input_precision="ieee")
        s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee") * scale
        p = tl.where(valid[None, :], tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do_c, tl.trans(kv), input_precision="ieee")
        ds = tl.where(valid[None, :], p * (dp - delta[:, None]), 0.0) * scale
        dql = tl.dot(ds.to(kv.dtype), kv, dql, input_precision="ieee")
        dqr = tl.dot(ds.to(kr.dtype), kr, dqr, input_precision="ieee")
    tl.store(dql_ptr + (t * H + h[:, None]) * R + r[None, :], dql, mask=hr_mask)
    tl.store(dqr_ptr + (t * H + h[:, None]) * P + p_[None, :], dqr, mask=hp_mask)


@triton.jit
def _mla_bwd_dkv_kernel(
    ql_ptr, qr_ptr, kv_ptr, kr_ptr, do_ptr, lse_ptr, delta_ptr,
    kstart_ptr, kcount_ptr, qbegin_ptr, qend_ptr, prefix_ptr,
    dkv_ptr, dkr_ptr,
    H, R, P, scale,
    s_qlt, s_qlh, s_qrt, s_qrh, s_kv, s_kr,
    DOT_F32: tl.constexpr, PREFIX_ONLY: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Causal layout: dkv and dk_rope of one key block from the queries [qbegin, qend) that attend it
    (PREFIX_ONLY: only those whose key list is their whole causal prefix, prefix_ptr[t] != 0)."""
    blk = tl.program_id(0)
    k0 = tl.load(kstart_ptr + blk).to(tl.int64)
    nk = tl.load(kcount_ptr + blk)
    i = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_R)
    p_ = tl.arange(0, BLOCK_P)
    k_mask = i < nk
    kslot = k0 + i
    kv = tl.load(kv_ptr + kslot[:, None] * s_kv + r[None, :], mask=k_mask[:, None] & (r < R)[None, :], other=0.0)
    kr = tl.load(kr_ptr + kslot[:, None] * s_kr + p_[None, :], mask=k_mask[:, None] & (p_ < P)[None, :], other=0.0)
    if DOT_F32:
        kv = kv.to(tl.float32)
        kr = kr.to(tl.float32)
    # queries q in [q0, q1), each with H rows: row g = (q - q0) * H + head
    q0 = tl.load(qbegin_ptr + blk).to(tl.int64)
    q1 = tl.load(qend_ptr + blk).to(tl.int64)
    n_rows = (q1 - q0) * H
    g0 = tl.arange(0, ROWS)
    dkv = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    dkr = tl.zeros((BLOCK_K, BLOCK_P), dtype=tl.float32)
    for c in range(tl.cdiv(n_rows, ROWS)):                          # ascending queries, fixed chunks
        g = c * ROWS + g0
        g_mask = g < n_rows
        tq = q0 + g // H
        hh = g % H
        sel = (tq[None, :] >= kslot[:, None]) & k_mask[:, None] & g_mask[None, :]
        if PREFIX_ONLY:
            sel = sel & (tl.load(prefix_ptr + tq, mask=g_mask, other=0) != 0)[None, :]
        row = tq * H + hh                                            # into [T, H] and [T, H, R]
        ql = tl.load(ql_ptr + tq[:, None] * s_qlt + hh[:, None] * s_qlh + r[None, :],
                     mask=g_mask[:, None] & (r < R)[None, :], other=0.0)
        qr = tl.load(qr_ptr + tq[:, None] * s_qrt + hh[:, None] * s_qrh + p_[None, :],
                     mask=g_mask[:, None] & (p_ < P)[None, :], other=0.0)
        do = tl.load(do_ptr + row[:, None] * R + r[None, :], mask=g_mask[:, None] & (r < R)[None, :], other=0.0)
        lse = tl.load(lse_ptr + row, mask=g_mask, other=0.0)
        delta = tl.load(delta_ptr + row, mask=g_mask, other=0.0)
        if DOT_F32:
            ql = ql.to(tl.float32)
            qr = qr.to(tl.float32)
        do_c = do.to(kv.dtype)
        s = tl.dot(kv, tl.trans(ql), input_precision="ieee")                       # [BLOCK_K, ROWS]
        s = tl.dot(kr, tl.trans(qr), s, input_precision="ieee") * scale
        p = tl.where(sel, tl.exp(s - lse[None, :]), 0.0)
        dp = tl.dot(kv, tl.trans(do_c), input_precision="ieee")
        ds = tl.where(sel, p * (dp - delta[None, :]), 0.0) * scale
        dkv = tl.dot(p.to(kv.dtype), do_c, dkv, input_precision="ieee")
        dkv = tl.dot(ds.to(kv.dtype), ql, dkv, input_precision="ieee")
        dkr = tl.dot(ds.to(kr.dtype), qr, dkr, input_precision="ieee")
    tl.store(dkv_ptr + kslot[:, None] * R + r[None, :], dkv, mask=k_mask[:, None] & (r < R)[None, :])
    tl.store(dkr_ptr + kslot[:, None] * P + p_[None, :], dkr, mask=k_mask[:, None] & (p_ < P)[None, :])


@triton.jit(do_not_specialize=["t0"])
def _mla_bwd_dkv_parts_kernel(
    ql_ptr, qr_ptr, kv_ptr, kr_ptr, idx_ptr, prefix_ptr, do_ptr, lse_ptr, delta_ptr, parts_ptr,
    t0, H, R, P, L, scale,
    s_qlt, s_qlh, s_qrt, s_qrh, s_kv, s_kr, s_idx,
    DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    KEYS: tl.constexpr,
):
    """parts[t - t0, j] = sum over heads of (p dOut + scale ds q_latent | scale ds q_rope) for the
    keys j of query t's list in [b * KEYS, (b + 1) * KEYS): heads BLOCK_H at a time, ascending.
    A query whose list is its whole causal prefix (prefix_ptr[t] != 0) has none: the key blocks took it."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    if tl.load(prefix_ptr + t) != 0:
        return
    j = tl.program_id(1) * KEYS + tl.arange(0, KEYS)
    r = tl.arange(0, BLOCK_R)
    p_ = tl.arange(0, BLOCK_P)
    slot = tl.load(idx_ptr + t * s_idx + j, mask=j < L, other=-1).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    kv = tl.load(kv_ptr + slot[:, None] * s_kv + r[None, :], mask=valid[:, None] & (r < R)[None, :], other=0.0)
    kr = tl.load(kr_ptr + slot[:, None] * s_kr + p_[None, :], mask=valid[:, None] & (p_ < P)[None, :], other=0.0)
    if DOT_F32:
        kv = kv.to(tl.float32)
        kr = kr.to(tl.float32)
    dkv = tl.zeros((KEYS, BLOCK_R), dtype=tl.float32)
    dkr = tl.zeros((KEYS, BLOCK_P), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < H
        ql = tl.load(ql_ptr + t * s_qlt + h[:, None] * s_qlh + r[None, :], mask=h_mask[:, None] & (r < R)[None, :],
                     other=0.0)
        qr = tl.load(qr_ptr + t * s_qrt + h[:, None] * s_qrh + p_[None, :], mask=h_mask[:, None] & (p_ < P)[None, :],
                     other=0.0)
        do = tl.load(do_ptr + (t * H + h[:, None]) * R + r[None, :], mask=h_mask[:, None] & (r < R)[None, :], other=0.0)
        lse = tl.load(lse_ptr + t * H + h, mask=h_mask, other=0.0)
        delta = tl.load(delta_ptr + t * H + h, mask=h_mask, other=0.0)
        if DOT_F32:
            ql = ql.to(tl.float32)
            qr = qr.to(tl.float32)
        do_c = do.to(kv.dtype)
        s = tl.dot(kv, tl.trans(ql), input_precision="ieee")                       # [KEYS, BLOCK_H]
        s = tl.dot(kr, tl.trans(qr), s, input_precision="ieee") * scale
        sel = valid[:, None] & h_mask[None, :]
        p = tl.where(sel, tl.exp(s - lse[None, :]), 0.0)
        dp = tl.dot(kv, tl.trans(do_c), input_precision="ieee")
        ds = tl.where(sel, p * (dp - delta[None, :]), 0.0) * scale
        dkv = tl.dot(p.to(kv.dtype), do_c, dkv, input_precision="ieee")
        dkv = tl.dot(ds.to(kv.dtype), ql, dkv, input_precision="ieee")
        dkr = tl.dot(ds.to(kr.dtype), qr, dkr, input_precision="ieee")
    row = parts_ptr + (tc * L + j[:, None]) * (R + P)
    tl.store(row + r[None, :], dkv, mask=valid[:, None] & (r < R)[None, :])
    tl.store(row + R + p_[None, :], dkr, mask=valid[:, None] & (p_ < P)[None, :])


@triton.jit(do_not_specialize=["t0"])
def _mla_bwd_dkv_sum_kernel(
    parts_ptr, entry_ptr, lo_ptr, hi_ptr, dkv_ptr, dkr_ptr,
    t0, R, P, L,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """dkv[j] += parts of key j's entries [lo, hi) (query-major flat indices t * L + column,
    ascending query), one at a time: a running fp32 sum in ascending query order."""
    key = tl.program_id(0).to(tl.int64)
    lo = tl.load(lo_ptr + key)
    hi = tl.load(hi_ptr + key)
    if lo < hi:
        r = tl.arange(0, BLOCK_R)
        p_ = tl.arange(0, BLOCK_P)
        acc_kv = tl.load(dkv_ptr + key * R + r, mask=r < R, other=0.0)
        acc_kr = tl.load(dkr_ptr + key * P + p_, mask=p_ < P, other=0.0)
        for e in range(lo, hi):
            flat = tl.load(entry_ptr + e)
            row = parts_ptr + (flat - t0 * L) * (R + P)                # (t - t0) * L + column
            acc_kv += tl.load(row + r, mask=r < R, other=0.0)
            acc_kr += tl.load(row + R + p_, mask=p_ < P, other=0.0)
        tl.store(dkv_ptr + key * R + r, acc_kv, mask=r < R)
        tl.store(dkr_ptr + key * P + p_, acc_kr, mask=p_ < P)


def _key_blocks(positions: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal dkv key blocks of the training layout (start slot [S], count [S]): a block starts at
    each position that is a multiple of block_k and stops at the next such position or the
    sequence's end. How many blocks that makes is not read back (a CUDA graph can hold the
    backward): the lists have S entries (at most one block starts per token), the ones past the
    last block start at S with count 0 (their programs do nothing)."""
    s_len, device = positions.shape[0], positions.device
    block_of_slot = torch.cumsum(((positions % block_k) == 0).to(torch.int64), 0) - 1   # [S], non-decreasing
    # Block b starts at the first slot whose block is >= b (S for b past the last block).
    start = torch.searchsorted(block_of_slot, torch.arange(s_len, device=device, dtype=torch.int64))
    ends = torch.cat([start[1:], torch.full((1,), s_len, dtype=start.dtype, device=device)])   # no host copy
    return start, (ends - start).to(torch.int32)                     # stops at the next block's start


def _sequence_ends(positions: torch.Tensor) -> torch.Tensor:
    """Per token (training layout): one past the last token of its sequence."""
    t = positions.shape[0]
    tok = torch.arange(t, device=positions.device)
    start = tok - positions
    last = torch.zeros(t, dtype=torch.int64, device=positions.device)
    last = last.scatter_reduce(0, start, positions.to(torch.int64), reduce="amax")  # integer max: exact
    return start + last[start] + 1


def _prefix_rows(key_index: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Per query (int32 [T]): 1 when its key list is exactly its whole causal prefix in the training
    layout (slots t - pos .. t, then -1), else 0; all 0 without positions. Read from the row alone."""
    t, l = key_index.shape
    if positions is None or l == 0:
        return torch.zeros(t, dtype=torch.int32, device=key_index.device)
    cols = torch.arange(l, device=key_index.device)
    pos = positions.view(-1, 1)
    want = torch.where(cols <= pos, torch.arange(t, device=key_index.device).view(-1, 1) - pos + cols, -1)
    return ((key_index == want).all(dim=1) & (positions < l)).to(torch.int32)


def _pairs_by_key(key_index: torch.Tensor, s_len: int, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query, column) pairs of the key lists ordered by (key, query), prefix rows' pairs left
    out (the key blocks took them): (sorted keys [T*L], flat pair indices t * L + column [T*L]).
    Sort key slot * T + t; empty entries (-1) and prefix rows' entries last."""
    t, l = key_index.shape
    flat = key_index.reshape(-1).to(torch.int64)
    query = torch.arange(t * l, device=key_index.device) // l
    listed = (flat >= 0) & (prefix[query] == 0)
    keys = torch.where(listed, flat * t + query, torch.full_like(flat, s_len * t))
    return torch.sort(keys, stable=True)


def mla_attention_backward(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    key_index: torch.Tensor | None,
    positions: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    scale: float,
    block_k: int | None = None,
    rows: int | None = None,
    block_h: int | None = None,
    dkv_chunk: int | None = None,
    part_keys: int | None = None,
    part_heads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq_latent, dq_rope, dkv_latent, dk_rope) of mla_attention, in the inputs' dtype.

    key_index [T, L] is the forward's key list (slots, ascending, -1 padded; each slot at most
    once per row), or None for the causal training layout, where positions [T] says where
    each query token sits in its sequence and the keys are the tokens (kv_latent [T, R]).
    positions may also accompany a key_index (the training layout's selection); the key-list
    path needs none: a key's gradient sums only the queries that listed it, so in the training
    layout every gradient is independent of the other sequences either way.
    out [T, H, R] and lse [T, H] are the forward's (mla_attention(..., return_lse=True)),
    grad_out [T, H, R] the gradient of out. block_k / rows (the causal dkv program: keys, (query,
    head) rows per step) and block_h (dq program: heads) default to DKV_BLOCK_K, DKV_ROWS, 16; they
    fix the gradients' summation order (a config is part of the gradient bits); so do part_keys /
    part_heads (a key list's dkv parts program: keys, heads per step; DKV_PART_KEYS, DKV_PART_HEADS).
    dkv_chunk: queries per chunk of a key list's dkv parts (default: DKV_CHUNK_BYTES of parts); bits
    do not depend on it.
    """
    op = "mla_attention_backward"
    for name, x, nd in (("q_latent", q_latent, 3), ("q_rope", q_rope, 3), ("kv_latent", kv_latent, 2),
                        ("k_rope", k_rope, 2), ("out", out, 3), ("grad_out", grad_out, 3)):
        check_float(op, name, x, ndim=nd)
    if key_index is None and positions is None:
        raise ValueError(f"{op}: give key_index, positions (causal training layout), or both")
    t, h, r = q_latent.shape
    p = q_rope.shape[2]
    s_len = kv_latent.shape[0]
    if tuple(out.shape) != (t, h, r) or tuple(grad_out.shape) != (t, h, r) or tuple(lse.shape) != (t, h):
        raise ValueError(f"{op}: out, grad_out must be [T, H, R] = {(t, h, r)} and lse [T, H]")
    if positions is not None and (positions.shape != (t,) or s_len != t):
        raise ValueError(f"{op}: with positions the keys are the T = {t} query tokens")
    dev = check_launchable(op, _mla_bwd_dq_kernel, q_latent, q_rope, kv_latent, k_rope, out, lse, grad_out)
    dql = torch.zeros((t, h, r), dtype=torch.float32, device=dev)
    dqr = torch.zeros((t, h, p), dtype=torch.float32, device=dev)
    dkv = torch.zeros((s_len, r), dtype=torch.float32, device=dev)
    dkr = torch.zeros((s_len, p), dtype=torch.float32, device=dev)
    if t and h and r and s_len:
        q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
        kv_latent, k_rope = kv_latent.contiguous(), k_rope.contiguous()
        out, lse, grad_out = out.float().contiguous(), lse.float().contiguous(), grad_out.float().contiguous()
        causal = key_index is None
        if causal:
            positions = positions.to(torch.int64).contiguous()
            idx, nblk = positions, positions
        else:
            idx = key_index.contiguous()
            nblk = blocks_to_visit(idx, KV_BLOCK)
        if positions is not None:
            positions = positions.to(torch.int64).contiguous()
        dot_f32 = dot_in_fp32(_mla_bwd_dq_kernel, q_latent.dtype)
        block_r, block_p = max(16, next_pow2(r)), max(16, next_pow2(p))
        delta = torch.empty((t, h), dtype=torch.float32, device=dev)
        bh = block_h or 16
        _mla_bwd_dq_kernel[(t, triton.cdiv(h, bh))](
            q_latent, q_rope, kv_latent, k_rope, idx, nblk, positions if causal else idx, out, lse, grad_out,
            delta, dql, dqr,
            t, h, r, p, 0 if causal else idx.shape[1], float(scale),
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            kv_latent.stride(0), k_rope.stride(0), 0 if causal else idx.stride(0),
            DOT_F32=dot_f32, CAUSAL=causal,
            BLOCK_H=bh, BLOCK_R=block_r, BLOCK_P=block_p, KV_BLOCK=KV_BLOCK,
            num_warps=8 if block_r >= 256 else 4, num_stages=2,
        )
        warps = 8 if block_r >= 256 else 4
        # dkv / dk_rope. The key blocks walk the queries whose list is their whole causal prefix
        # (all of them in the causal layout; the rows within index_topk of a training selection):
        # there a block's queries are a contiguous range. Every other listed (query, key) pair
        # adds its part afterwards, in ascending query order.
        prefix = None if causal else _prefix_rows(idx, positions)
        if positions is not None:
            bk = block_k or DKV_BLOCK_K
            kstart, kcount = _key_blocks(positions, bk)
            ends = _sequence_ends(positions)
            if prefix is not None:                     # rows past the list's width are never prefix rows
                ends = torch.minimum(ends, torch.arange(t, device=dev) - positions + idx.shape[1])
            qend = torch.cat([ends, torch.full((1,), s_len, dtype=ends.dtype, device=dev)])[kstart]  # S: no queries
            _mla_bwd_dkv_kernel[(kstart.shape[0],)](
                q_latent, q_rope, kv_latent, k_rope, grad_out, lse, delta,
                kstart, kcount, kstart, qend, kstart if prefix is None else prefix,
                dkv, dkr,
                h, r, p, float(scale),
                q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
                kv_latent.stride(0), k_rope.stride(0),
                DOT_F32=dot_f32, PREFIX_ONLY=prefix is not None,
                BLOCK_K=bk, ROWS=rows or DKV_ROWS, BLOCK_R=block_r, BLOCK_P=block_p,
                num_warps=warps, num_stages=2,
            )
        if prefix is not None and idx.shape[1]:
            width = idx.shape[1]
            keys, entries = _pairs_by_key(idx, s_len, prefix)
            first = torch.arange(s_len, device=dev, dtype=torch.int64) * t     # key j's sort keys start at j * T
            chunk = max(1, min(t, dkv_chunk or DKV_CHUNK_BYTES // (width * (r + p) * 4)))
            keys_per = part_keys or DKV_PART_KEYS
            heads_per = part_heads or min(DKV_PART_HEADS, max(16, next_pow2(h)))   # by the model's heads only
            parts = torch.empty((chunk, width, r + p), dtype=torch.float32, device=dev)
            for t0 in range(0, t, chunk):                            # ascending queries, chunk by chunk
                t1 = min(t, t0 + chunk)
                _mla_bwd_dkv_parts_kernel[(t1 - t0, triton.cdiv(width, keys_per))](
                    q_latent, q_rope, kv_latent, k_rope, idx, prefix, grad_out, lse, delta, parts,
                    t0, h, r, p, width, float(scale),
                    q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
                    kv_latent.stride(0), k_rope.stride(0), idx.stride(0),
                    DOT_F32=dot_f32, BLOCK_H=heads_per, BLOCK_R=block_r, BLOCK_P=block_p,
                    KEYS=keys_per,
                    num_warps=warps, num_stages=2,
                )
                lo = torch.searchsorted(keys, first + t0)
                hi = torch.searchsorted(keys, first + t1)
                _mla_bwd_dkv_sum_kernel[(s_len,)](
                    parts, entries, lo, hi, dkv, dkr, t0, r, p, width,
                    BLOCK_R=block_r, BLOCK_P=block_p, num_warps=4,
                )
    return dql.to(q_latent.dtype), dqr.to(q_rope.dtype), dkv.to(kv_latent.dtype), dkr.to(k_rope.dtype)


def mla_attention_backward_reference(q_latent, q_rope, kv_latent, k_rope, key_index, grad_out, scale):
    """The same gradients by autograd through a one-shot float64 softmax (tests' reference)."""
    ql, qr, kv, kr = (x.detach().double().requires_grad_() for x in (q_latent, q_rope, kv_latent, k_rope))
    valid = key_index >= 0
    idx = key_index.clamp(min=0)
    s = torch.einsum("thr,tlr->thl", ql, kv[idx]) + torch.einsum("thp,tlp->thl", qr, kr[idx])
    s = (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
    o = torch.einsum("thl,tlr->thr", torch.softmax(s, -1), kv[idx])
    return torch.autograd.grad(o, (ql, qr, kv, kr), grad_out.double())
