"""Lightning-indexer scores: score[t, j] = sum_h w[t, h] * relu(q[t, h] . k_cache[key_index[t, j]]).

One program per (query t, block of INDEXER_BLOCK_L keys). q[t] . k is one fixed-shape tile
dot per BLOCK_D chunk of the head dim, chunks in ascending order (BLOCK_D from D only); the
head sum is one tl.sum over a [BLOCK_HI, BLOCK_L] tile (BLOCK_HI from Hi only). A key's
score therefore depends only on q[t], w[t] and that key's cache row: not on T, not on
neighbours, not on how far key_index was padded. fp32 out, -inf where key_index < 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    check_float,
    check_index,
    check_launchable,
    dot_in_fp32,
    next_pow2,
    pow2_between,
)

__all__ = ["INDEXER_BLOCK_L", "indexer_scores"]

INDEXER_BLOCK_L = 64  # keys per program
INDEXER_MAX_BLOCK_D = 128  # head-dim chunk (GLM-5's index_head_dim is 128: one chunk)


@triton.jit(do_not_specialize=["T"])
def _indexer_scores_kernel(
    q_ptr, k_ptr, w_ptr, idx_ptr, out_ptr,
    T, HI, D, L,
    s_qt, s_qh, s_k, s_wt, s_idx, s_ot,
    DOT_F32: tl.constexpr,
    BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    hh = tl.arange(0, BLOCK_HI)
    dd = tl.arange(0, BLOCK_D)
    h_mask = hh < HI
    j_mask = j < L
    slot = tl.load(idx_ptr + t * s_idx + j, mask=j_mask, other=-1).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    s = tl.zeros((BLOCK_HI, BLOCK_L), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        d_mask = d < D
        q = tl.load(q_ptr + t * s_qt + hh[:, None] * s_qh + d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        k = tl.load(k_ptr + slot[:, None] * s_k + d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), s, input_precision="ieee")
    w = tl.load(w_ptr + t * s_wt + hh, mask=h_mask, other=0.0).to(tl.float32)
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t * s_ot + j, score, mask=j_mask)


def indexer_scores(
    q: torch.Tensor, k_cache: torch.Tensor, head_weights: torch.Tensor, key_index: torch.Tensor
) -> torch.Tensor:
    """q [T, Hi, D], k_cache [S, D], head_weights [T, Hi] (already scaled), key_index [T, L] (-1 padded).
    Returns fp32 [T, L], -inf where key_index < 0. Slots must be < S (not checked on CUDA)."""
    op = "indexer_scores"
    check_float(op, "q", q, ndim=3)
    check_float(op, "k_cache", k_cache, ndim=2)
    check_float(op, "head_weights", head_weights, ndim=2)
    check_index(op, "key_index", key_index, ndim=2)
    t, hi, d = q.shape
    if k_cache.shape[1] != d:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} must be [S, D] with D = {d}")
    if tuple(head_weights.shape) != (t, hi):
        raise ValueError(f"{op}: head_weights {tuple(head_weights.shape)} must be [T, Hi] = [{t}, {hi}]")
    if key_index.shape[0] != t:
        raise ValueError(f"{op}: key_index {tuple(key_index.shape)} must be [T, L] with T = {t}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"{op}: q and k_cache must share one dtype, got {q.dtype} and {k_cache.dtype}")
    check_launchable(op, _indexer_scores_kernel, q, k_cache, head_weights, key_index)
    if key_index.device.type != "cuda" and key_index.numel() and int(key_index.max()) >= k_cache.shape[0]:
        raise ValueError(f"{op}: key_index holds slot {int(key_index.max())} >= S = {k_cache.shape[0]}")
    l = key_index.shape[1]
    out = torch.empty((t, l), dtype=torch.float32, device=q.device)
    if t == 0 or l == 0:
        return out
    q, k_cache = q.contiguous(), k_cache.contiguous()
    head_weights, key_index = head_weights.contiguous(), key_index.contiguous()
    grid = (t, triton.cdiv(l, INDEXER_BLOCK_L))
    _indexer_scores_kernel[grid](
        q, k_cache, head_weights, key_index, out,
        t, hi, d, l,
        q.stride(0), q.stride(1), k_cache.stride(0), head_weights.stride(0), key_index.stride(0), out.stride(0),
        DOT_F32=dot_in_fp32(_indexer_scores_kernel, q.dtype),
        BLOCK_HI=max(16, next_pow2(hi)), BLOCK_D=pow2_between(d, 16, INDEXER_MAX_BLOCK_D), BLOCK_L=INDEXER_BLOCK_L,
        num_warps=4,
    )
    return out
