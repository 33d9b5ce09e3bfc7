"""Batch-invariant implementations in plain torch (the `torch` backend).

Plain torch ops are not batch-invariant on CPU: `x[i:i+1] @ w` differs in the
last bits from row i of `x @ w` because BLAS picks its blocking (and so its sum
order) from M. Some element-wise kernels differ too: sigmoid, silu and pow give
different bits for an element in the SIMD body than in the scalar tail of a
loop, so the bits depend on where the element sits in the tensor.

Everything here is therefore built from three kinds of pieces whose bits
depend only on the row they compute (see NUMERICS.md):

* `_tile_mm`: GEMMs evaluated on fixed-shape row tiles, [ROW_TILE, K] @ [K, N],
  one torch.mm per tile. The shape never depends on M, so neither does the K order.
  Every dot product and every row sum goes through it (a row sum is a GEMM
  against a ones column). `linear` also cuts the weight into fixed COL_TILE-column
  tiles (zero-padded), so every torch.mm it issues is [ROW_TILE, K] @ [K, COL_TILE]:
  a column's bits never depend on N either, which is what lets tensor parallelism
  shard a weight by output columns (MKL's K order does depend on N for K >= 1024).
* Correctly rounded element-wise arithmetic (+ - * / sqrt, max) and the
  transcendentals checked position-invariant by `zerokl verify` (exp, log,
  cos, sin); sigmoid/silu are composed from exp and division.
* Order-free selections (max, stable sorts with explicit tie-breaks).

All functions take fp32 or bf16 inputs and accumulate in fp32.
"""
from __future__ import annotations

import torch

__all__ = [
    "ROW_TILE",
    "COL_TILE",
    "KV_BLOCK",
    "linear",
    "grouped_linear",
    "row_sum",
    "rms_norm",
    "layer_norm",
    "softmax",
    "log_softmax",
    "sigmoid",
    "silu",
    "rope",
    "mla_attention",
    "indexer_scores",
    "topk_positions",
]

ROW_TILE = 16  # rows per GEMM tile: fixed, so the BLAS kernel and its K order never see M
COL_TILE = 128  # weight rows (output columns) per linear tile: fixed, so the K order never sees N
KV_BLOCK = 16  # keys per online-softmax step in attention and per indexer scoring step


def _tile_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N] in fp32 with each row's bits independent of M and of its neighbours.

    Pads M up to a multiple of ROW_TILE and runs one torch.mm per [ROW_TILE, K] tile,
    so BLAS always sees the same GEMM shape. (A single bmm over the tiles is NOT safe:
    batched GEMM on CPU changes its sum order with the batch count, e.g. for N = 1.)
    """
    m, k = a.shape
    n = b.shape[1]
    a32, b32 = a.float(), b.float()
    pad = -m % ROW_TILE
    if pad:
        a32 = torch.cat([a32, a32.new_zeros(pad, k)])
    tiles = [torch.mm(a32[i:i + ROW_TILE], b32) for i in range(0, m + pad, ROW_TILE)]
    return torch.cat(tiles)[:m] if tiles else a32.new_zeros(0, n)


def _tile_linear(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ weight.T ([N, K]) in fp32 on fixed [ROW_TILE, K] @ [K, COL_TILE] tiles.

    The weight is zero-padded to a multiple of COL_TILE rows; every torch.mm has one
    shape for a given K, so an output element's bits depend only on its row of `a`,
    its row of `weight` and K: never on M, N or where the column sits (a column
    shard of the weight gives exactly the matching columns of the full product).
    """
    (m, k), n = a.shape, weight.shape[0]
    a32, w32 = a.float(), weight.float()
    if m % ROW_TILE:                          # pad rows once here rather than in every column tile
        a32 = torch.cat([a32, a32.new_zeros(-m % ROW_TILE, k)])
    if n % COL_TILE:
        w32 = torch.cat([w32, w32.new_zeros(-n % COL_TILE, k)])
    cols = [_tile_mm(a32, w32[j:j + COL_TILE].t()) for j in range(0, w32.shape[0], COL_TILE)]
    return torch.cat(cols, 1)[:m, :n] if cols else a32.new_zeros((m, 0))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias); x [..., K], weight [N, K]; fp32 accumulate.

    Output in out_dtype (default x.dtype): out_dtype=torch.float32 returns the fp32
    accumulator unrounded (the partials of ops.split_linear).
    """
    lead = x.shape[:-1]
    out = _tile_linear(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).reshape(*lead, weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [M, K] times weight[g].T ([G, N, K]) -> [M, N].

    A row's result depends only on the row and its group's weight, never on how
    many rows share the group (dropless MoE, per-head projections).
    """
    parts = [linear(x[offsets[g]:offsets[g + 1]], weight[g]) for g in range(weight.shape[0])]
    return torch.cat(parts) if parts else x.new_zeros((0, weight.shape[1]))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in fp32 with a fixed order (a GEMM against a ones column)."""
    k = x.shape[-1]
    ones = torch.ones(k, 1, dtype=torch.float32, device=x.device)
    return _tile_mm(x.reshape(-1, k), ones).reshape(x.shape[:-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32, output in x.dtype."""
    x32 = x.float()
    mean_sq = row_sum(x32 * x32) / x.shape[-1]
    inv = 1.0 / torch.sqrt(mean_sq + eps)
    return (x32 * inv.unsqueeze(-1) * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm over the last dim (two-pass mean/variance in fp32), output in x.dtype."""
    x32 = x.float()
    d = x.shape[-1]
    mean = row_sum(x32) / d
    centered = x32 - mean.unsqueeze(-1)
    var = row_sum(centered * centered) / d
    inv = 1.0 / torch.sqrt(var + eps)
    return (centered * inv.unsqueeze(-1) * weight.float() + bias.float()).to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim in fp32: x - max - log(sum(exp(x - max)))."""
    x32 = x.float()
    shifted = x32 - x32.amax(dim=-1, keepdim=True)
    return shifted - torch.log(row_sum(torch.exp(shifted))).unsqueeze(-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in fp32."""
    x32 = x.float()
    e = torch.exp(x32 - x32.amax(dim=-1, keepdim=True))
    return e / row_sum(e).unsqueeze(-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32 from correctly rounded pieces (torch.sigmoid is not position-invariant)."""
    return 1.0 / (1.0 + torch.exp(-x.float()))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in fp32."""
    x32 = x.float()
    return x32 * sigmoid(x32)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, H, D] by positions [T] with inv_freq [D/2] (fp32); output in x.dtype.

    interleaved: pairs are (x[2i], x[2i+1]) (DeepSeek/GLM checkpoints), else (x[i], x[i+D/2]).
    """
    angles = positions.float().unsqueeze(-1) * inv_freq.float()  # [T, D/2]
    cos = torch.cos(angles).unsqueeze(1)
    sin = torch.sin(angles).unsqueeze(1)
    x32 = x.float()
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = x32.chunk(2, dim=-1)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if interleaved:
        out = torch.stack([r1, r2], dim=-1).flatten(-2)
    else:
        out = torch.cat([r1, r2], dim=-1)
    return out.to(x.dtype)


def _gather_block(cache: torch.Tensor, index: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows cache[index[:, start:start+KV_BLOCK]] as fp32 [T, KV_BLOCK, D] and a validity mask [T, KV_BLOCK]."""
    block = index[:, start:start + KV_BLOCK]
    if block.shape[1] < KV_BLOCK:
        block = torch.nn.functional.pad(block, (0, KV_BLOCK - block.shape[1]), value=-1)
    valid = block >= 0
    return cache[block.clamp(min=0)].float(), valid


def _per_query_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Per-query products [T, X, D] x [T, Y, D] -> [T, X, Y], summing over D.

    Each query has its own right operand (its own keys), so this cannot be one tiled
    GEMM; batched GEMM is not invariant to T on CPU either. The product is materialized
    with D innermost and contiguous and reduced with sum(-1), whose per-output order
    depends only on D (checked by the invariance suite)."""
    return (a.unsqueeze(2) * b_t.unsqueeze(1)).sum(-1)


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    key_index: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA attention over an explicit key list per query.

    q_latent [T, H, R] (q_nope already absorbed through W_UK), q_rope [T, H, P],
    kv_latent [S, R] (normalized latent = keys and values), k_rope [S, P],
    key_index [T, L] int64 slots into the cache in ascending position order, -1 padded.
    Returns the latent output [T, H, R] in fp32 (to be projected by W_UV).

    Keys are visited in KV_BLOCK blocks from the start of each query's list; a
    block without valid keys leaves the state untouched, so padding to a longer L
    (a longer neighbour) changes nothing.
    """
    t, h, r = q_latent.shape
    ql = q_latent.float()
    qr = q_rope.float()
    dev = q_latent.device
    m = torch.full((t, h), float("-inf"), device=dev)
    l = torch.zeros(t, h, device=dev)
    acc = torch.zeros(t, h, r, device=dev)
    for start in range(0, key_index.shape[1], KV_BLOCK):
        kv, valid = _gather_block(kv_latent, key_index, start)    # [T, B, R]
        kr, _ = _gather_block(k_rope, key_index, start)           # [T, B, P]
        s = _per_query_mm(ql, kv) + _per_query_mm(qr, kr)                        # [T, H, B]
        s = (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
        any_valid = valid.any(dim=1)                               # [T]
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(any_valid.unsqueeze(1), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        # One GEMM gives both P @ V and the row sum of P (a ones column appended to V).
        kv_ext = torch.cat([kv, torch.ones(t, KV_BLOCK, 1, device=dev)], dim=-1)
        pv = _per_query_mm(p, kv_ext.transpose(1, 2))                 # [T, H, R + 1]
        keep = any_valid.view(t, 1)
        l = torch.where(keep, l * alpha + pv[..., r], l)
        acc = torch.where(keep.unsqueeze(-1), acc * alpha.unsqueeze(-1) + pv[..., :r], acc)
        m = torch.where(keep, m_new, m)
    return acc / l.unsqueeze(-1)


def indexer_scores(
    q: torch.Tensor, k_cache: torch.Tensor, head_weights: torch.Tensor, key_index: torch.Tensor
) -> torch.Tensor:
    """Lightning-indexer scores in fp32: score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[key_index[t, j]]).

    q [T, Hi, D], k_cache [S, D], head_weights [T, Hi] (already scaled), key_index [T, L]
    (-1 padded). Returns [T, L] with -inf where key_index < 0.
    """
    t, hi, _ = q.shape
    q32 = q.float()
    w = head_weights.float().unsqueeze(1)                          # [T, 1, Hi]
    out = []
    for start in range(0, key_index.shape[1], KV_BLOCK):
        k, valid = _gather_block(k_cache, key_index, start)       # [T, B, D]
        s = torch.relu(_per_query_mm(q32, k))                         # [T, Hi, B]
        score = _per_query_mm(w, s.transpose(1, 2)).squeeze(1)        # [T, B]
        out.append(score.masked_fill(~valid, float("-inf")))
    scores = torch.cat(out, dim=1) if out else q32.new_zeros(t, 0)
    return scores[:, : key_index.shape[1]]


def topk_positions(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Deterministic top-k (see ops.topk_positions): a stable descending sort over the rows
    pre-sorted by position, so ties fall to the lower position; then ascending positions."""
    t, l = scores.shape
    by_pos = torch.sort(positions, dim=-1, stable=True).indices
    pos = positions.gather(1, by_pos)
    s = (scores.float() + 0.0).gather(1, by_pos)                  # +0.0: -0.0 ties with +0.0
    s = torch.where(torch.isnan(s) | (pos < 0), torch.full_like(s, float("-inf")), s)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = pos.gather(1, order)
    big = torch.iinfo(torch.int64).max
    chosen = torch.where(s.gather(1, order) > float("-inf"), chosen, torch.full_like(chosen, big))
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == big, torch.full_like(chosen, -1), chosen)
    if chosen.shape[1] < k:                                       # fewer keys than k: pad to width k
        chosen = torch.cat([chosen, chosen.new_full((t, k - chosen.shape[1]), -1)], dim=1)
    return chosen
