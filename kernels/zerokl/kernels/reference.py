"""Plain-torch references: the textbook math with no invariance guarantees.

Used only to check the accuracy of both backends (within dtype tolerances) and
as the "stock" side of the invariance demonstrations and benchmarks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "linear", "rms_norm", "layer_norm", "softmax", "log_softmax", "rope",
    "mla_attention", "indexer_scores",
    "rms_norm_backward", "rope_backward", "swiglu_backward", "moe_combine_backward", "pair_rows_backward",
]


def linear(x, weight, bias=None):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def rms_norm(x, weight, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def layer_norm(x, weight, bias, eps=1e-6):
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps)


def softmax(x):
    return torch.softmax(x.float(), dim=-1)


def log_softmax(x):
    return torch.log_softmax(x.float(), dim=-1)


def rope(x, positions, inv_freq, interleaved):
    # Angles in fp32 as Hugging Face computes them (position * inv_freq rounded to fp32).
    angles = (positions.float().unsqueeze(-1) * inv_freq.float()).double()
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    x = x.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.stack([r1, r2], -1).flatten(-2) if interleaved else torch.cat([r1, r2], -1)
    return out.float()


def mla_attention(q_latent, q_rope, kv_latent, k_rope, key_index, scale):
    """Dense softmax over each query's key list in float64."""
    valid = key_index >= 0
    idx = key_index.clamp(min=0)
    kv = kv_latent.double()[idx]                          # [T, L, R]
    kr = k_rope.double()[idx]
    s = torch.einsum("thr,tlr->thl", q_latent.double(), kv) + torch.einsum("thp,tlp->thl", q_rope.double(), kr)
    s = (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
    return torch.einsum("thl,tlr->thr", torch.softmax(s, -1), kv).float()


def indexer_scores(q, k_cache, head_weights, key_index):
    valid = key_index >= 0
    k = k_cache.double()[key_index.clamp(min=0)]          # [T, L, D]
    s = torch.relu(torch.einsum("thd,tld->thl", q.double(), k))
    out = torch.einsum("th,thl->tl", head_weights.double(), s).float()
    return out.masked_fill(~valid, float("-inf"))


# ----------------------------------------------------------------------------- backward references
# float64 autograd of the textbook forward: what the Triton backward kernels are checked against.

def _grads64(fn, inputs, grad):
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, grad.double())


def rms_norm_backward(x, weight, grad, eps=1e-6):
    """(grad_x, grad_weight) in float64."""
    return _grads64(lambda a, w: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * w, (x, weight), grad)


def rope_backward(x, positions, inv_freq, interleaved, grad):
    """grad_x in float64 (angles rounded to fp32 as the forward takes them)."""
    angles = (positions.float().unsqueeze(-1) * inv_freq.float()).double()
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)

    def rotate(a):
        a1, a2 = (a[..., 0::2], a[..., 1::2]) if interleaved else a.chunk(2, dim=-1)
        r1, r2 = a1 * cos - a2 * sin, a2 * cos + a1 * sin
        return torch.stack([r1, r2], -1).flatten(-2) if interleaved else torch.cat([r1, r2], -1)
    return _grads64(rotate, (x,), grad)[0]


def swiglu_backward(gate, up, grad):
    """(grad_gate, grad_up) of silu(gate) * up in float64."""
    return _grads64(lambda g, u: F.silu(g) * u, (gate, up), grad)


def moe_combine_backward(weights, outputs, grad):
    """(grad_weights, grad_outputs) of sum_j w[:, j] * y[:, j] in float64."""
    return _grads64(lambda w, y: (w.unsqueeze(-1) * y).sum(1), (weights, outputs), grad)


def pair_rows_backward(grad, order, k):
    """grad_x of xs = x[order // k] in float64: each pair's gradient added to its token's row."""
    dx = torch.zeros(grad.shape[0] // k, grad.shape[1], dtype=torch.float64, device=grad.device)
    return dx.index_add_(0, order // k, grad.double())
