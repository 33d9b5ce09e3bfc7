"""Batch-invariant, machine-portable implementations in plain torch (the `torch` backend).

Plain torch ops are neither batch-invariant nor portable on CPU: `x[i:i+1] @ w` differs in
the last bits from row i of `x @ w` because BLAS picks its blocking (and so its sum order)
from M, and the same torch build gives different bits on different CPUs (MKL's kernels are
chosen by vendor and ISA; ATen's exp/log/sin/cos and vectorized sums follow the ISA).

Everything here is built from kernels/zerokl/kernels/portable.py, whose results are the same on every
machine (see NUMERICS.md):

* every dot product and row sum is an exact contraction (`portable.contract`,
  `portable.row_sum`): float64 GEMMs over integer-valued slices of the operands that
  perform no rounding at all, so no blocking, batch size, column shard, thread count or
  BLAS library can change a bit; the result is rounded once to fp32;
* transcendentals (exp, log, sigmoid, silu, cos, sin) are float64 polynomials of IEEE
  basic operations, rounded once to fp32; sqrt is correctly rounded from division
  (`portable.sqrt`: torch.sqrt on a CPU is MKL's vector math, whose bits follow the CPU);
* the rest is correctly rounded element-wise arithmetic (+ - * /, max) and order-free
  selections (max, stable sorts with explicit tie-breaks).

All functions take fp32 or bf16 inputs and accumulate in fp32 or better.
"""
from __future__ import annotations

import torch

from zerokl.kernels import portable
from zerokl.kernels.fp8_format import FP8_BLOCK, FP8_MAX

__all__ = [
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
    "mla_attention_sequences",
    "indexer_scores",
    "topk_positions",
    "round_to_e4m3",
    "fp8_quantize",
    "fp8_quantize_weight",
    "fp8_gemm",
    "fp8_grouped_linear",
    "fp8_linear",
]

KV_BLOCK = 16  # keys per online-softmax step in attention and per indexer scoring step
# FP8_BLOCK (channels per activation scale, 128 x 128 weight blocks) and FP8_MAX (448): fp8_format.


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias); x [..., K], weight [N, K]; exact sum rounded to fp32.

    Output in out_dtype (default x.dtype): out_dtype=torch.float32 returns the fp32
    accumulator unrounded (the partials of ops.split_linear). An element's bits depend only on
    its row of x and its row of weight: never on M, N or where the column sits.
    """
    lead = x.shape[:-1]
    out = portable.contract(x.reshape(-1, x.shape[-1]), weight, b_is_weight=True)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).reshape(*lead, weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: list[int] | torch.Tensor) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [M, K] times weight[g].T ([G, N, K]) -> [M, N].

    A row's result depends only on the row and its group's weight, never on how
    many rows share the group (dropless MoE, per-head projections). offsets: a list or an
    int tensor (read to the host: this backend slices the rows per group).
    """
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.tolist()
    return portable.contract_grouped(x, weight, offsets).to(x.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in fp32, exactly summed (portable.row_sum)."""
    return portable.row_sum(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32, output in x.dtype."""
    x32 = x.float()
    mean_sq = row_sum(x32 * x32) / x.shape[-1]
    inv = 1.0 / portable.sqrt(mean_sq + eps)
    return (x32 * inv.unsqueeze(-1) * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm over the last dim (two-pass mean/variance in fp32), output in x.dtype."""
    x32 = x.float()
    d = x.shape[-1]
    mean = row_sum(x32) / d
    centered = x32 - mean.unsqueeze(-1)
    var = row_sum(centered * centered) / d
    inv = 1.0 / portable.sqrt(var + eps)
    return (centered * inv.unsqueeze(-1) * weight.float() + bias.float()).to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim in fp32: x - max - log(sum(exp(x - max)))."""
    x32 = x.float()
    shifted = x32 - x32.amax(dim=-1, keepdim=True)
    return shifted - portable.log(row_sum(portable.exp(shifted))).unsqueeze(-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in fp32."""
    x32 = x.float()
    e = portable.exp(x32 - x32.amax(dim=-1, keepdim=True))
    return e / row_sum(e).unsqueeze(-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32, rounded once from float64 (portable.sigmoid)."""
    return portable.sigmoid(x.float())


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in fp32, rounded once from float64 (portable.silu)."""
    return portable.silu(x.float())


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, H, D] by positions [T] with inv_freq [D/2] (fp32); output in x.dtype.

    interleaved: pairs are (x[2i], x[2i+1]) (DeepSeek/GLM checkpoints), else (x[i], x[i+D/2]).
    """
    angles = positions.float().unsqueeze(-1) * inv_freq.float()  # [T, D/2], rounded to fp32
    cos, sin = portable.cos_sin(angles)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
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


# Gathered key elements per query chunk (T_chunk x L x width): bounds the memory of a long
# prompt's attention. Queries are independent, so the chunking never changes a bit.
_CHUNK_ELEMENTS = 1 << 22


def _query_step(keys: int, width: int) -> int:
    """Queries per chunk when each gathers `keys` keys of `width` elements."""
    return max(1, _CHUNK_ELEMENTS // max(1, keys * width))


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

    Keys are visited in KV_BLOCK blocks from the start of each query's list with one
    online-softmax merge per block; a block without valid keys leaves the state untouched,
    so padding to a longer L (a longer neighbour) changes nothing.
    """
    t, h, r = q_latent.shape
    pad = -key_index.shape[1] % KV_BLOCK
    index = torch.nn.functional.pad(key_index, (0, pad), value=-1) if pad else key_index
    if t == 0 or index.shape[1] == 0:                                # no query, or no key: 0 / 0 as before
        return torch.full((t, h, r), float("nan"), device=q_latent.device)
    n = _query_step(index.shape[1], r + q_rope.shape[-1] + 1)
    return torch.cat([_mla_chunk(q_latent[i:i + n], q_rope[i:i + n], kv_latent, k_rope, index[i:i + n], scale)
                      for i in range(0, t, n)])


def mla_attention_sequences(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    selection: torch.Tensor | None = None,
) -> torch.Tensor:
    """mla_attention in the training layout: the keys are the T query tokens (kv_latent [T, R]),
    sequences packed contiguously from position 0 (positions [T]). Without `selection` each
    query attends slots t - positions[t] .. t; with `selection` [T, K] that list. The causal
    list is built per query chunk (at most [chunk, L]), never for all T: same bits as
    mla_attention over the full [T, L] list, since queries are independent.
    """
    # Arguments checked by ops.mla_attention_sequences (the public op).
    if selection is not None:
        return mla_attention(q_latent, q_rope, kv_latent, k_rope, selection, scale)
    t = q_latent.shape[0]
    if t == 0:
        return mla_attention(q_latent, q_rope, kv_latent, k_rope, positions.view(0, 0), scale)
    width = int(positions.max()) + 1
    cols = torch.arange(width, device=positions.device)
    n = _query_step(width + (-width % KV_BLOCK), q_latent.shape[2] + q_rope.shape[-1] + 1)
    parts = []
    for i in range(0, t, n):
        pos = positions[i:i + n].view(-1, 1)
        start = torch.arange(i, i + pos.shape[0], device=positions.device).view(-1, 1) - pos
        index = torch.where(cols <= pos, start + cols, torch.full_like(start + cols, -1))
        parts.append(mla_attention(q_latent[i:i + n], q_rope[i:i + n], kv_latent, k_rope, index, scale))
    return torch.cat(parts)


def _mla_chunk(q_latent, q_rope, kv_latent, k_rope, index, scale):
    """mla_attention for a chunk of queries; index [T, nb * KV_BLOCK]."""
    t, h, r = q_latent.shape
    nb = index.shape[1] // KV_BLOCK
    valid = index >= 0                                               # [T, Lp]
    slots = index.clamp(min=0)
    # Each score is one exact contraction, so scoring all keys at once gives every block's bits.
    s = portable.contract_gathered(q_latent.float(), kv_latent, slots) \
        + portable.contract_gathered(q_rope.float(), k_rope, slots)  # [T, H, Lp]
    s = (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf")).view(t, h, nb, KV_BLOCK)
    block_valid = valid.view(t, nb, KV_BLOCK).any(-1)                # [T, nb]
    m_after = torch.cummax(s.amax(-1), dim=-1).values               # [T, H, nb]: the running max after each block
    m_safe = torch.where(block_valid.unsqueeze(1), m_after, torch.zeros_like(m_after))
    p = portable.exp(s - m_safe.unsqueeze(-1))                       # [T, H, nb, B]
    m_before = torch.cat([torch.full_like(m_after[..., :1], float("-inf")), m_after[..., :-1]], dim=-1)
    alpha = portable.exp(m_before - m_safe)                          # [T, H, nb]
    # One contraction per block gives both P @ V and the row sum of P (a ones column on V).
    kv = kv_latent[slots].float()                                    # [T, Lp, R]
    kv_ext = torch.cat([kv, torch.ones(t, nb * KV_BLOCK, 1, device=kv.device)], dim=-1)
    pv = portable.contract(p.transpose(1, 2), kv_ext.view(t, nb, KV_BLOCK, r + 1).transpose(-1, -2))  # [T, nb, H, R+1]
    l = torch.zeros(t, h, device=kv.device)
    acc = torch.zeros(t, h, r, device=kv.device)
    for j in range(nb):                                              # the merge, block by block in key order
        keep = block_valid[:, j].view(t, 1)
        a = alpha[..., j]
        l = torch.where(keep, l * a + pv[:, j, :, r], l)
        acc = torch.where(keep.unsqueeze(-1), acc * a.unsqueeze(-1) + pv[:, j, :, :r], acc)
    return acc / l.unsqueeze(-1)


def indexer_scores(
    q: torch.Tensor, k_cache: torch.Tensor, head_weights: torch.Tensor, key_index: torch.Tensor
) -> torch.Tensor:
    """Lightning-indexer scores in fp32: score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[key_index[t, j]]).

    q [T, Hi, D], k_cache [S, D], head_weights [T, Hi] (already scaled), key_index [T, L]
    (-1 padded). Returns [T, L] with -inf where key_index < 0. Both sums are exact
    contractions, so a key's score depends only on its query and its key.
    """
    t, hi, d = q.shape
    step = _query_step(key_index.shape[1], d + hi)
    out = []
    for i in range(0, t, step):
        index = key_index[i:i + step]
        s = torch.relu(portable.contract_gathered(q[i:i + step].float(), k_cache, index.clamp(min=0)))  # [T, Hi, L]
        score = portable.contract(head_weights[i:i + step].float().unsqueeze(1), s.transpose(1, 2)).squeeze(1)
        out.append(score.masked_fill(index < 0, float("-inf")))
    return torch.cat(out) if out else q.new_zeros((0, key_index.shape[1]), dtype=torch.float32)


def topk_positions(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Deterministic top-k (see ops.topk_positions): a stable descending sort over the rows
    pre-sorted by position, so ties fall to the lower position; then ascending positions."""
    t, l = scores.shape
    if positions is None:                                         # the column index
        positions = torch.arange(l, device=scores.device).expand(t, l)
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


def round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 y with |y| <= 448 rounded to the nearest e4m3 value, ties to even, as fp32 (exact in
    e4m3). The grid's quantum at y is 2^(max(e, -6) - 3) for y in [2^e, 2^(e+1)) (3 mantissa bits;
    subnormals below 2^-6 step by 2^-9), and adding then subtracting C = 1.5 * 2^23 * quantum
    rounds to a multiple of it by IEEE's round-to-nearest-even: no library conversion decides a
    bit. Values that round to zero give +0."""
    e = ((y.view(torch.int32) >> 23) & 0xFF) - 127
    quantum = ((torch.clamp(e, min=-6) - 3 + 127) << 23).view(torch.float32)
    c = quantum * 12582912.0                                          # 1.5 * 2^23 quanta: exact
    return (y + c) - c


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, ceil(K/128)] fp32): per row, per group of
    128 channels, s = amax / 448 (1 for an all-zero group), q = round_to_e4m3(clamp(x / s, +-448)).
    Every step is exact or correctly rounded (max, IEEE division and addition); the final cast
    only re-encodes values already on the e4m3 grid."""
    m, k = x.shape
    kb = -(-k // FP8_BLOCK)
    xp = torch.nn.functional.pad(x.float(), (0, kb * FP8_BLOCK - k)).view(m, kb, FP8_BLOCK)
    amax = xp.abs().amax(-1)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = round_to_e4m3((xp / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
    return q.view(m, kb * FP8_BLOCK)[:, :k], s


# Experts of a stack quantized per step of fp8_quantize_weight, by elements (memory, not bits): the fp32
# temporaries of a GLM-5 expert stack at once (256 x 2,048 x 6,144) would be 12 GiB each.
QUANTIZE_SLICE_ELEMENTS = 1 << 28


def fp8_quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] or a stack of experts [E, N, K] -> (q float8_e4m3fn of its shape, scale
    [..., ceil(N/128), ceil(K/128)] fp32): per 128 x 128 block of each expert, s = amax / 448 (1 for an
    all-zero block), q = round_to_e4m3(clamp(w / s, +-448)). Every step is exact or correctly rounded."""
    if weight.dim() == 3:
        e, n, k = weight.shape
        # A block reads only its own 128 x 128 values, so whole experts at a time give each expert's
        # blocks exactly as alone; rows of one block never straddle two experts when N % 128 == 0.
        if n % FP8_BLOCK:
            parts = [fp8_quantize_weight(x) for x in weight]
            return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        step = max(1, QUANTIZE_SLICE_ELEMENTS // max(1, n * k))
        parts = [fp8_quantize_weight(weight[i:i + step].reshape(-1, k)) for i in range(0, e, step)]
        q = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        scale = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return q.view(e, n, k), scale.view(e, n // FP8_BLOCK, scale.shape[-1])
    n, k = weight.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    w = torch.nn.functional.pad(weight.detach().float(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    blocks = w.view(nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))                                      # [NB, KB]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = round_to_e4m3((blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
    return q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous(), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Block-scaled FP8 GEMM (NUMERICS.md, "FP8"): x [..., K] quantized by fp8_quantize, weight
    [N, K] float8_e4m3fn with weight_scale [ceil(N/128), ceil(K/128)] fp32. For K blocks b in
    ascending order, acc += fp32(dot_b) * (s_x[m, b] * s_w[n // 128, b]) in fp32.

    A block's dot of e4m3 values is exact in float64 in any order (products have 8 significant
    bits between 2^-18 and 2^18, 128 of them sum within 43 bits), so the float64 GEMM computes
    it exactly whatever BLAS does, and it is rounded once to fp32.
    """
    lead, (n, k) = x.shape[:-1], weight.shape
    q, sx = fp8_quantize(x.reshape(-1, k))
    return fp8_gemm(q, sx, weight, weight_scale, bias, out_dtype or x.dtype).reshape(*lead, n)


def fp8_gemm(q: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The block-scaled product of quantized activations q [M, K], sx [M, KB] and an FP8 weight
    (fp8_linear after its quantization); KB = 0 gives zeros (an empty split segment)."""
    (m, k), n, kb = q.shape, weight.shape[0], sx.shape[1]
    pad = kb * FP8_BLOCK - k
    qa = torch.nn.functional.pad(q.double(), (0, pad)).view(m, kb, FP8_BLOCK).transpose(0, 1)      # [KB, M, 128]
    qw = torch.nn.functional.pad(weight.double(), (0, pad)).view(n, kb, FP8_BLOCK).permute(1, 2, 0)  # [KB, 128, N]
    parts = torch.matmul(qa, qw).float()                                   # [KB, M, N]: exact, rounded once
    sw = weight_scale.repeat_interleave(FP8_BLOCK, dim=0)[:n].t()          # [KB, N]: each column's block scale
    acc = torch.zeros(m, n, dtype=torch.float32, device=q.device)
    for b in range(kb):                                                    # ascending K blocks
        acc = acc + parts[b] * (sx[:, b:b + 1] * sw[b:b + 1])
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       offsets: list[int] | torch.Tensor) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [M, K] times FP8 weight[g] -> [M, N] in x.dtype: each
    group's rows through fp8_linear (a row's result is its own whatever its group holds)."""
    bounds = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    out = x.new_empty((x.shape[0], weight.shape[1]))
    for g in range(weight.shape[0]):
        lo, hi = bounds[g], bounds[g + 1]
        if hi > lo:
            out[lo:hi] = fp8_linear(x[lo:hi], weight[g], weight_scale[g])
    return out
