"""The `stock` backend: the same ops in plain, fast, NON-invariant torch.

This is what a stock engine computes: cuBLAS/MKL GEMMs whose blocking follows M,
one-shot softmax and attention, torch.topk. It exists to measure what invariance
costs (tools/bench) and to run the mismatched-numerics arm of the RL experiment; it
has no fingerprint and `zerokl verify` does not check it. Same signatures as
kernels/zerokl/kernels/torch_ops.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The quantization is a definition, not a kernel choice: the stock backend quantizes as the torch
# backend does and dequantizes by the format's definition (a backend never imports ops).
from zerokl.kernels import torch_ops
from zerokl.kernels.fp8_format import fp8_dequantize_weight

__all__ = [
    "linear", "grouped_linear", "rms_norm", "layer_norm", "softmax", "log_softmax", "sigmoid", "silu",
    "rope", "mla_attention", "mla_attention_sequences", "indexer_scores", "topk_positions", "fp8_quantize",
    "fp8_quantize_weight", "fp8_linear", "fp8_gemm", "fp8_grouped_linear",
]


def linear(x, weight, bias=None, out_dtype=None):
    out = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return out.to(out_dtype or x.dtype)


def fp8_quantize(x):
    return torch_ops.fp8_quantize(x)


def fp8_quantize_weight(weight):
    return torch_ops.fp8_quantize_weight(weight)


def fp8_linear(x, weight, weight_scale, bias=None, out_dtype=None):
    """The FP8 product as a stock engine would compute it: the same quantized operands,
    dequantized and multiplied by one BLAS GEMM (sum order by M and the library)."""
    k = weight.shape[1]
    q, s = fp8_quantize(x.reshape(-1, k))
    return fp8_gemm(q, s, weight, weight_scale, bias, out_dtype or x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_grouped_linear(x, weight, weight_scale, offsets):
    return torch_ops.fp8_grouped_linear(x, weight, weight_scale, offsets)


def fp8_gemm(q, sx, weight, weight_scale, bias, out_dtype):
    xs = q.float() * sx.repeat_interleave(128, 1)[:, :q.shape[1]]
    out = F.linear(xs, fp8_dequantize_weight(weight, weight_scale), None if bias is None else bias.float())
    return out.to(out_dtype)


def grouped_linear(x, weight, offsets):
    """With device offsets on a CUDA GPU in bf16: torch._grouped_mm, one grouped GEMM with no host
    sync (what transformers' grouped_mm experts run). Otherwise one F.linear per group."""
    if isinstance(offsets, torch.Tensor) and _grouped_mm_ok(x, weight):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets[1:].to(torch.int32))
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.tolist()
    parts = [F.linear(x[offsets[g]:offsets[g + 1]], weight[g]) for g in range(weight.shape[0])]
    return torch.cat(parts) if parts else x.new_zeros((0, weight.shape[1]))


def _grouped_mm_ok(x, weight) -> bool:
    """torch._grouped_mm's preconditions: CUDA sm90+, bf16 operands, unit inner strides and
    16-byte aligned rows (K and N multiples of 8)."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and x.stride(-1) == 1 and weight.stride(-1) == 1
            and x.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0 and x.stride(0) % 8 == 0 and weight.stride(1) % 8 == 0)


def rms_norm(x, weight, eps=1e-6):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def layer_norm(x, weight, bias, eps=1e-6):
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


def softmax(x):
    return torch.softmax(x.float(), dim=-1)


def log_softmax(x):
    return torch.log_softmax(x.float(), dim=-1)


def sigmoid(x):
    return torch.sigmoid(x.float())


def silu(x):
    return F.silu(x.float())


def rope(x, positions, inv_freq, interleaved):
    angles = positions.float().unsqueeze(-1) * inv_freq.float()
    cos, sin = torch.cos(angles).unsqueeze(1), torch.sin(angles).unsqueeze(1)
    x32 = x.float()
    x1, x2 = (x32[..., 0::2], x32[..., 1::2]) if interleaved else x32.chunk(2, dim=-1)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.stack([r1, r2], -1).flatten(-2) if interleaved else torch.cat([r1, r2], -1)
    return out.to(x.dtype)


def mla_attention(q_latent, q_rope, kv_latent, k_rope, key_index, scale):
    """One batched softmax over each query's padded key list."""
    valid = key_index >= 0
    idx = key_index.clamp(min=0)
    kv, kr = kv_latent[idx].float(), k_rope[idx].float()              # [T, L, R], [T, L, P]
    s = torch.bmm(q_latent.float(), kv.transpose(1, 2)) + torch.bmm(q_rope.float(), kr.transpose(1, 2))
    s = (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
    return torch.bmm(torch.softmax(s, -1), kv)


def mla_attention_sequences(q_latent, q_rope, kv_latent, k_rope, positions, scale, selection=None):
    """The training layout through the explicit list (the whole [T, L] causal table)."""
    if selection is None:
        t = positions.shape[0]
        cols = torch.arange(int(positions.max()) + 1 if t else 0, device=positions.device)
        start = (torch.arange(t, device=positions.device) - positions).view(-1, 1)
        selection = torch.where(cols <= positions.view(-1, 1), start + cols, torch.full_like(start + cols, -1))
    return mla_attention(q_latent, q_rope, kv_latent, k_rope, selection, scale)


def indexer_scores(q, k_cache, head_weights, key_index):
    valid = key_index >= 0
    k = k_cache[key_index.clamp(min=0)].float()                        # [T, L, D]
    s = torch.relu(torch.bmm(q.float(), k.transpose(1, 2)))           # [T, Hi, L]
    out = torch.bmm(head_weights.float().unsqueeze(1), s).squeeze(1)
    return out.masked_fill(~valid, float("-inf"))


def topk_positions(scores, positions, k):
    if positions is None:
        positions = torch.arange(scores.shape[1], device=scores.device).expand(scores.shape)
    take = min(k, scores.shape[-1])
    vals, order = torch.topk(scores.float(), take, dim=-1)
    chosen = torch.where(vals > float("-inf"), positions.gather(1, order), torch.full_like(order, -1))
    big = torch.iinfo(torch.int64).max
    chosen = torch.sort(torch.where(chosen < 0, torch.full_like(chosen, big), chosen), dim=-1).values
    chosen = torch.where(chosen == big, torch.full_like(chosen, -1), chosen)
    if take < k:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], k - take), -1)], dim=1)
    return chosen
