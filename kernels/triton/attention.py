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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_float, check_index, check_launchable, dot_in_fp32, next_pow2

__all__ = ["ATTN_BLOCK_H", "KV_BLOCK", "mla_attention"]

KV_BLOCK = 32  # keys per online-softmax step: part of the numerics definition
ATTN_BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows); any value gives the same bits per head


@triton.jit(do_not_specialize=["T"])
def _mla_attention_kernel(
    ql_ptr, qr_ptr, kv_ptr, kr_ptr, idx_ptr, nblk_ptr, out_ptr,
    T, H, R, P, L, scale,
    s_qlt, s_qlh, s_qrt, s_qrh, s_kv, s_kr, s_idx, s_ot, s_oh,
    DOT_F32: tl.constexpr,
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
    n_blocks = tl.load(nblk_ptr + t)
    for b in range(n_blocks):
        j = b * KV_BLOCK + j0
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
) -> torch.Tensor:
    """Absorbed MLA attention. q_latent [T, H, R], q_rope [T, H, P], kv_latent [S, R], k_rope [S, P],
    key_index [T, L] (cache slots in ascending position order, -1 padded). Returns [T, H, R] fp32.

    Slots must be < S (not checked on CUDA, to avoid a device sync). A query with no valid key
    gets NaN (0/0), as in the torch backend.
    """
    op = "mla_attention"
    check_float(op, "q_latent", q_latent, ndim=3)
    check_float(op, "q_rope", q_rope, ndim=3)
    check_float(op, "kv_latent", kv_latent, ndim=2)
    check_float(op, "k_rope", k_rope, ndim=2)
    check_index(op, "key_index", key_index, ndim=2)
    t, h, r = q_latent.shape
    p = q_rope.shape[2]
    s_len = kv_latent.shape[0]
    if q_rope.shape[:2] != (t, h):
        raise ValueError(f"{op}: q_rope {tuple(q_rope.shape)} must be [T, H, P] with T, H = {t}, {h}")
    if kv_latent.shape[1] != r:
        raise ValueError(f"{op}: kv_latent {tuple(kv_latent.shape)} must be [S, R] with R = {r}")
    if tuple(k_rope.shape) != (s_len, p):
        raise ValueError(f"{op}: k_rope {tuple(k_rope.shape)} must be [S, P] = [{s_len}, {p}]")
    if key_index.shape[0] != t:
        raise ValueError(f"{op}: key_index {tuple(key_index.shape)} must be [T, L] with T = {t}")
    if len({q_latent.dtype, q_rope.dtype, kv_latent.dtype, k_rope.dtype}) != 1:
        raise ValueError(f"{op}: q_latent, q_rope, kv_latent and k_rope must share one dtype, got "
                         f"{q_latent.dtype}, {q_rope.dtype}, {kv_latent.dtype}, {k_rope.dtype}")
    check_launchable(op, _mla_attention_kernel, q_latent, q_rope, kv_latent, k_rope, key_index)
    if key_index.device.type != "cuda" and key_index.numel() and int(key_index.max()) >= s_len:
        raise ValueError(f"{op}: key_index holds slot {int(key_index.max())} >= S = {s_len}")
    out = torch.empty((t, h, r), dtype=torch.float32, device=q_latent.device)
    if t == 0 or h == 0 or r == 0:
        return out
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    kv_latent, k_rope, key_index = kv_latent.contiguous(), k_rope.contiguous(), key_index.contiguous()
    nblk = blocks_to_visit(key_index, KV_BLOCK)
    block_r = max(16, next_pow2(r))
    bh = block_h or ATTN_BLOCK_H
    grid = (t, triton.cdiv(h, bh))
    _mla_attention_kernel[grid](
        q_latent, q_rope, kv_latent, k_rope, key_index, nblk, out,
        t, h, r, p, key_index.shape[1], float(scale),
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_latent.stride(0), k_rope.stride(0), key_index.stride(0), out.stride(0), out.stride(1),
        DOT_F32=dot_in_fp32(_mla_attention_kernel, q_latent.dtype),
        BLOCK_H=bh, BLOCK_R=block_r, BLOCK_P=max(16, next_pow2(p)), KV_BLOCK=KV_BLOCK,
        num_warps=num_warps or (8 if block_r >= 256 else 4), num_stages=2,
    )
    return out
