"""Absorbed MLA attention over an explicit key list per query: `mla_attention`.

One program per (query t, block of BLOCK_H heads). It walks the query's own key list
key_index[t] in KV_BLOCK-wide blocks from the start, in ascending order, gathering cache
rows by slot:
    s   = (q_latent . kv_latent[slot]) + (q_rope . k_rope[slot])    (latent first), * scale
    m'  = max(m, rowmax(s));  p = exp(s - m');  alpha = exp(m - m')
    l   = l * alpha + rowsum(p);  acc = acc * alpha + p @ kv_latent[slot]
and finally writes acc / l (fp32). Each step is one fixed-shape tile op; a block with no
valid key (slot < 0) leaves (m, l, acc) exactly unchanged, and the loop stops after the
query's last valid key (a per-query count computed on the host). So a query's bits depend
only on its own q and key list, never on T, on its neighbours, or on how far its list was
padded with -1 to match a longer neighbour. No split-KV: one program owns all of a query's
keys (the sparse indexer caps them at index_topk).

KV_BLOCK here is the Triton backend's block size; it need not equal torch_ops.KV_BLOCK
(bits are promised per backend).

The training layout (`mla_attention_sequences`) has no key list: the key store is the N new
tokens themselves, sequences packed one after another, each from position 0, so query t's
keys are the slots t - positions[t] .. t. The kernel then forms the same slots block by
block (column j = position j, valid while j <= positions[t]) instead of loading them, and
visits the same KV_BLOCK blocks: its bits equal the explicit list's. With a selection
[N, index_topk] (the sparse rows), that selection is the explicit key list.

The forward can also write each (query, head)'s log-sum-exp m + log(l) (fp32), which the
backward (attention_backward.py) uses to recompute probabilities; the output's bits do not
depend on whether it is written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_index, check_launchable, dot_in_fp32, next_pow2

__all__ = ["ATTN_BLOCK_H", "KV_BLOCK", "blocks_to_visit", "mla_attention", "mla_attention_sequences"]

KV_BLOCK = 32  # keys per online-softmax step: part of the numerics definition
ATTN_BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows); any value gives the same bits per head


@triton.jit(do_not_specialize=["T"])
def _mla_attention_kernel(
    ql_ptr, qr_ptr, kv_ptr, kr_ptr, idx_ptr, nblk_ptr, pos_ptr, out_ptr, lse_ptr,
    T, H, R, P, L, scale,
    s_qlt, s_qlh, s_qrt, s_qrh, s_kv, s_kr, s_idx, s_ot, s_oh,
    DOT_F32: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, KV_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p_ = tl.arange(0, BLOCK_P)
    j0 = tl.arange(0, KV_BLOCK)
    h_mask = h < H
    r_mask = r < R
    p_mask = p_ < P
    ql = tl.load(ql_ptr + t * s_qlt + h[:, None] * s_qlh + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    qr = tl.load(qr_ptr + t * s_qrt + h[:, None] * s_qrh + p_[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    if DOT_F32:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    if CAUSAL:
        pos = tl.load(pos_ptr + t).to(tl.int64)          # keys: slots t - pos .. t (positions 0 .. pos)
        n_blocks = (pos // KV_BLOCK + 1).to(tl.int32)
    else:
        n_blocks = tl.load(nblk_ptr + t)
    for b in range(n_blocks):
        j = b * KV_BLOCK + j0
        if CAUSAL:
            valid = j <= pos
            slot = tl.where(valid, t - pos + j, 0)
        else:
            slot = tl.load(idx_ptr + t * s_idx + j, mask=j < L, other=-1).to(tl.int64)
            valid = slot >= 0
            slot = tl.where(valid, slot, 0)
        kv = tl.load(kv_ptr + slot[:, None] * s_kv + r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
        kr = tl.load(kr_ptr + slot[:, None] * s_kr + p_[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0)
        if DOT_F32:
            kv = kv.to(tl.float32)
            kr = kr.to(tl.float32)
        s = tl.dot(ql, tl.trans(kv), input_precision="ieee")
        s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee")
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        any_valid = tl.max(valid.to(tl.int32), axis=0) > 0
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_new = l * alpha + tl.sum(p, axis=1)
        acc_new = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision="ieee")
        # a block without valid keys is a no-op, bit for bit
        l = tl.where(any_valid, l_new, l)
        acc = tl.where(any_valid, acc_new, acc)
        m = tl.where(any_valid, m_new, m)
    out = acc / l[:, None]
    tl.store(out_ptr + t * s_ot + h[:, None] * s_oh + r[None, :], out, mask=h_mask[:, None] & r_mask[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + t * H + h, m + tl.log(l), mask=h_mask)


def blocks_to_visit(key_index: torch.Tensor, block: int) -> torch.Tensor:
    """Per query: number of `block`-wide key blocks up to and including its last valid key (int32)."""
    t, l = key_index.shape
    if l == 0:
        return torch.zeros(t, dtype=torch.int32, device=key_index.device)
    pos1 = torch.arange(1, l + 1, device=key_index.device, dtype=torch.int64)
    last = torch.where(key_index >= 0, pos1, torch.zeros_like(pos1)).amax(dim=1)
    return ((last + block - 1) // block).to(torch.int32)


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    key_index: torch.Tensor,
    scale: float,
    block_h: int | None = None,
    num_warps: int | None = None,
    return_lse: bool = False,
):
    """Absorbed MLA attention. q_latent [T, H, R], q_rope [T, H, P], kv_latent [S, R], k_rope [S, P],
    key_index [T, L] (cache slots in ascending position order, -1 padded). Returns [T, H, R] fp32,
    and with return_lse also the log-sum-exp [T, H] fp32 of each query's scaled scores.

    Slots must be < S (not checked on CUDA, to avoid a device sync). A query with no valid key
    gets NaN (0/0), as in the torch backend.
    """
    op = "mla_attention"
    _check(op, q_latent, q_rope, kv_latent, k_rope)
    check_index(op, "key_index", key_index, ndim=2)
    if key_index.shape[0] != q_latent.shape[0]:
        raise ValueError(f"{op}: key_index {tuple(key_index.shape)} must be [T, L] with T = {q_latent.shape[0]}")
    check_launchable(op, _mla_attention_kernel, q_latent, q_rope, kv_latent, k_rope, key_index)
    s_len = kv_latent.shape[0]
    if key_index.device.type != "cuda" and key_index.numel() and int(key_index.max()) >= s_len:
        raise ValueError(f"{op}: key_index holds slot {int(key_index.max())} >= S = {s_len}")
    key_index = key_index.contiguous()
    return _launch(q_latent, q_rope, kv_latent, k_rope, key_index, blocks_to_visit(key_index, KV_BLOCK), None,
                   scale, block_h, num_warps, return_lse)


def mla_attention_sequences(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    selection: torch.Tensor | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    return_lse: bool = False,
):
    """mla_attention in the training layout: the key store kv_latent [T, R], k_rope [T, P] is the T
    query tokens themselves, sequences packed contiguously, each starting at position 0
    (positions [T]). Without `selection` every query attends its causal prefix, slots
    t - positions[t] .. t, with no key table; with `selection` [T, K] (ascending slots, -1
    padded: the sparse rows' indexer choice) that is the key list. Bits equal mla_attention's
    over the explicit list.
    """
    # Arguments checked by ops.mla_attention_sequences (the public op); here only the launch guard.
    if selection is not None:
        return mla_attention(q_latent, q_rope, kv_latent, k_rope, selection, scale, block_h, num_warps, return_lse)
    check_launchable("mla_attention_sequences", _mla_attention_kernel, q_latent, q_rope, kv_latent, k_rope, positions)
    return _launch(q_latent, q_rope, kv_latent, k_rope, None, None, positions.contiguous(),
                   scale, block_h, num_warps, return_lse)


def _check(op, q_latent, q_rope, kv_latent, k_rope) -> None:
    check_float(op, "q_latent", q_latent, ndim=3)
    check_float(op, "q_rope", q_rope, ndim=3)
    check_float(op, "kv_latent", kv_latent, ndim=2)
    check_float(op, "k_rope", k_rope, ndim=2)
    t, h, r = q_latent.shape
    p = q_rope.shape[2]
    s_len = kv_latent.shape[0]
    if q_rope.shape[:2] != (t, h):
        raise ValueError(f"{op}: q_rope {tuple(q_rope.shape)} must be [T, H, P] with T, H = {t}, {h}")
    if kv_latent.shape[1] != r:
        raise ValueError(f"{op}: kv_latent {tuple(kv_latent.shape)} must be [S, R] with R = {r}")
    if tuple(k_rope.shape) != (s_len, p):
        raise ValueError(f"{op}: k_rope {tuple(k_rope.shape)} must be [S, P] = [{s_len}, {p}]")
    if len({q_latent.dtype, q_rope.dtype, kv_latent.dtype, k_rope.dtype}) != 1:
        raise ValueError(f"{op}: q_latent, q_rope, kv_latent and k_rope must share one dtype, got "
                         f"{q_latent.dtype}, {q_rope.dtype}, {kv_latent.dtype}, {k_rope.dtype}")


def _launch(q_latent, q_rope, kv_latent, k_rope, key_index, nblk, positions, scale, block_h, num_warps, return_lse):
    """One forward launch over an explicit key list (key_index, nblk) or the causal layout (positions)."""
    t, h, r = q_latent.shape
    p = q_rope.shape[2]
    dev = q_latent.device
    out = torch.empty((t, h, r), dtype=torch.float32, device=dev)
    lse = torch.empty((t, h), dtype=torch.float32, device=dev)
    if t == 0 or h == 0 or r == 0:
        return (out, lse) if return_lse else out
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    kv_latent, k_rope = kv_latent.contiguous(), k_rope.contiguous()
    causal = key_index is None
    dummy = positions if causal else key_index
    block_r = max(16, next_pow2(r))
    bh = block_h or ATTN_BLOCK_H
    grid = (t, triton.cdiv(h, bh))
    _mla_attention_kernel[grid](
        q_latent, q_rope, kv_latent, k_rope, dummy, dummy if causal else nblk, dummy, out, lse,
        t, h, r, p, 0 if causal else key_index.shape[1], float(scale),
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_latent.stride(0), k_rope.stride(0), 0 if causal else key_index.stride(0), out.stride(0), out.stride(1),
        DOT_F32=dot_in_fp32(_mla_attention_kernel, q_latent.dtype), CAUSAL=causal, WRITE_LSE=return_lse,
        BLOCK_H=bh, BLOCK_R=block_r, BLOCK_P=max(16, next_pow2(p)), KV_BLOCK=KV_BLOCK,
        num_warps=num_warps or (8 if block_r >= 256 else 4), num_stages=2,
    )
    return (out, lse) if return_lse else out
