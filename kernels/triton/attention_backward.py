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
* `_mla_bwd_dkv_kernel`: one program per key block (up to BLOCK_K consecutive slots). It walks
  the (query, head) rows that attend any key of the block in ascending query order, ROWS at a
  time. Dense causal: the queries are the contiguous range from the block's first key to the
  end of its sequence. Sparse: the transpose of the key lists is built on the device with a
  stable sort: per block, the queries that selected one of its keys, ascending, each with a
  bit mask of the keys it selected.
Key blocks: in the training layout (positions given) they start at every position that is a
multiple of BLOCK_K of each sequence, so a key's gradient depends only on its own sequence;
otherwise (a cache) they are slots [b * BLOCK_K, (b + 1) * BLOCK_K).

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

__all__ = ["DKV_BLOCK_K", "DKV_ROWS", "mla_attention_backward", "mla_attention_backward_reference"]

# dkv program shape, from the H200 sweep in tools/bench/bench_attention_backward.py (--sweep):
# 16 keys (more programs: the causal triangle's longest program bounds the time) and 64
# (query, head) rows per step were fastest or within noise at both the small and GLM-5 shapes.
DKV_BLOCK_K = 16   # keys per dkv program
DKV_ROWS = 64      # (query, head) rows per dkv step


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
    kstart_ptr, kcount_ptr, qbegin_ptr, qend_ptr, eq_ptr, emask_ptr,
    dkv_ptr, dkr_ptr,
    H, R, P, scale,
    s_qlt, s_qlh, s_qrt, s_qrh, s_kv, s_kr,
    DOT_F32: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
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
    # queries (causal) or entries (sparse) e in [e0, e1), each with H rows: row g = (e - e0) * H + head
    e0 = tl.load(qbegin_ptr + blk).to(tl.int64)
    e1 = tl.load(qend_ptr + blk).to(tl.int64)
    n_rows = (e1 - e0) * H
    g0 = tl.arange(0, ROWS)
    dkv = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    dkr = tl.zeros((BLOCK_K, BLOCK_P), dtype=tl.float32)
    for c in range(tl.cdiv(n_rows, ROWS)):                          # ascending queries, fixed chunks
        g = c * ROWS + g0
        g_mask = g < n_rows
        e = e0 + g // H
        hh = g % H
        if CAUSAL:
            tq = e
            sel = (tq[None, :] >= kslot[:, None]) & k_mask[:, None] & g_mask[None, :]
        else:
            tq = tl.load(eq_ptr + e, mask=g_mask, other=0)
            bits = tl.load(emask_ptr + e, mask=g_mask, other=0)
            sel = (((bits[None, :] >> i[:, None].to(tl.int64)) & 1) != 0) & k_mask[:, None] & g_mask[None, :]
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


def _key_blocks(s_len: int, positions: torch.Tensor | None, block_k: int, device):
    """Key blocks (start slot [NB], count [NB], block of each slot [S]).

    Training layout (positions: the slots are the tokens): a block starts at each position that
    is a multiple of block_k and stops at the next such position or the sequence's end. How
    many blocks that makes is not read back (a CUDA graph can hold the backward): the lists
    have S entries (at most one block starts per token), the ones past the last block start
    at S with count 0 (their programs do nothing). Otherwise: slots [b * block_k, (b + 1) * block_k)."""
    if positions is None:
        start = torch.arange(0, s_len, block_k, device=device, dtype=torch.int64)
        count = torch.clamp(s_len - start, max=block_k).to(torch.int32)
        return start, count, torch.arange(s_len, device=device) // block_k
    block_of_slot = torch.cumsum(((positions % block_k) == 0).to(torch.int64), 0) - 1   # [S], non-decreasing
    # Block b starts at the first slot whose block is >= b (S for b past the last block).
    start = torch.searchsorted(block_of_slot, torch.arange(s_len, device=device, dtype=torch.int64))
    ends = torch.cat([start[1:], torch.full((1,), s_len, dtype=start.dtype, device=device)])   # no host copy
    count = (ends - start).to(torch.int32)                           # stops at the next block's start
    return start, count, block_of_slot


def _sequence_ends(positions: torch.Tensor) -> torch.Tensor:
    """Per token (training layout): one past the last token of its sequence."""
    t = positions.shape[0]
    tok = torch.arange(t, device=positions.device)
    start = tok - positions
    last = torch.zeros(t, dtype=torch.int64, device=positions.device)
    last = last.scatter_reduce(0, start, positions.to(torch.int64), reduce="amax")  # integer max: exact
    return start + last[start] + 1


def _transpose_selection(key_index: torch.Tensor, block_of_slot: torch.Tensor, kstart: torch.Tensor, n_blocks: int):
    """For each key block, the queries that selected one of its keys, ascending, with a bit mask
    of which keys: (entry begin [NB], entry end [NB], entry query [E], entry mask [E] int64).
    A stable sort by (block, query) fixes the order; the masks are integer sums of distinct bits."""
    t, k = key_index.shape
    dev = key_index.device
    flat = key_index.reshape(-1).to(torch.int64)
    valid = flat >= 0
    query = torch.arange(t, device=dev).repeat_interleave(k)[valid]
    slot = flat[valid]
    blk = block_of_slot[slot]
    bit = torch.bitwise_left_shift(torch.ones_like(slot), slot - kstart[blk])
    order = torch.sort(blk * t + query, stable=True).indices
    keys = (blk * t + query)[order]
    uniq, inverse = torch.unique_consecutive(keys, return_inverse=True)
    mask = torch.zeros(uniq.shape[0], dtype=torch.int64, device=dev).index_add_(0, inverse, bit[order])
    counts = torch.bincount(uniq // t, minlength=n_blocks)
    end = torch.cumsum(counts, 0)
    return end - counts, end, uniq % t, mask


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq_latent, dq_rope, dkv_latent, dk_rope) of mla_attention, in the inputs' dtype.

    key_index [T, L] is the forward's key list (slots, ascending, -1 padded; each slot at most
    once per row), or None for the causal training layout, where positions [T] says where
    each query token sits in its sequence and the keys are the tokens (kv_latent [T, R]).
    positions may also accompany a key_index over the training layout's tokens: key blocks
    then follow the sequences, so every gradient is independent of the other sequences.
    out [T, H, R] and lse [T, H] are the forward's (mla_attention(..., return_lse=True)),
    grad_out [T, H, R] the gradient of out. block_k / rows (dkv program: keys, (query, head)
    rows per step) and block_h (dq program: heads) default to DKV_BLOCK_K, DKV_ROWS, 16; they
    fix the gradients' summation order (a config is part of the gradient bits).
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
        bk = block_k or DKV_BLOCK_K
        kstart, kcount, block_of_slot = _key_blocks(s_len, positions, bk, dev)
        n_blocks = kstart.shape[0]
        if causal:
            qbegin = kstart
            ends = _sequence_ends(positions)
            qend = torch.cat([ends, torch.full((1,), s_len, dtype=ends.dtype, device=dev)])[kstart]  # S: no queries
            eq = emask = kstart                                      # unused
        else:
            qbegin, qend, eq, emask = _transpose_selection(idx, block_of_slot, kstart, n_blocks)
            if eq.numel() == 0:
                eq = emask = kstart
        _mla_bwd_dkv_kernel[(n_blocks,)](
            q_latent, q_rope, kv_latent, k_rope, grad_out, lse, delta,
            kstart, kcount, qbegin, qend, eq, emask,
            dkv, dkr,
            h, r, p, float(scale),
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            kv_latent.stride(0), k_rope.stride(0),
            DOT_F32=dot_f32, CAUSAL=causal,
            BLOCK_K=bk, ROWS=rows or DKV_ROWS, BLOCK_R=block_r, BLOCK_P=block_p,
            num_warps=8 if block_r >= 256 else 4, num_stages=2,
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
