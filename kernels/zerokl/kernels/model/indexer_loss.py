"""What trains the DSA lightning indexer: a KL loss toward the main attention distribution.

The indexer's top-k is not differentiable, so the language-modelling loss never reaches the
indexer. GLM-5 and DeepSeek-V3.2 train it with an auxiliary loss instead: for each query t
over its selected keys S_t, the target is the main attention's distribution summed over
heads and L1-normalised,
    p[t, j] = sum_h softmax_j(s[t, h, :])[j] / H,      s = scale (q_latent . kv + q_rope . k_rope),
and the loss is KL(p[t] || softmax_j(indexer_scores[t, j])) averaged over queries. The main
model enters detached (the target carries no gradient and the indexer reads detached hidden
states), so the loss trains only the indexer's parameters and the LM loss only the rest.
(DeepSeek-V3.2's sparse stage; its dense warm-up takes the same KL over all earlier keys.)

`indexer_losses(model)` asks a model's attention layers for it during a training-layout
forward (kernels/zerokl/kernels/model/model.py: MLAttention appends one loss per indexer layer whose rows
exceed index_topk keys). Below the model (model.py imports the loss): the layers are found by
the `indexer_losses` attribute they declare, not by their class.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["attention_distribution", "indexer_kl_loss", "indexer_losses"]

_CHUNK_ELEMENTS = 1 << 24   # gathered key elements per chunk of rows (bounds the target's memory)


@torch.no_grad()
def attention_distribution(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_latent: torch.Tensor,
                           k_rope: torch.Tensor, key_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """The main attention's per-query distribution over its keys, summed over heads and
    L1-normalised: [T, K] fp32 (0 at padding). q_latent [T, H, R], q_rope [T, H, P],
    kv_latent [S, R], k_rope [S, P], key_slots [T, K] (-1 padded). No gradient."""
    t, h, r = q_latent.shape
    k = key_slots.shape[1]
    out = torch.zeros(t, k, dtype=torch.float32, device=q_latent.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, k * (r + q_rope.shape[-1])))
    for i in range(0, t, step):
        slots = key_slots[i:i + step]
        valid = slots >= 0
        idx = slots.clamp(min=0)
        s = torch.einsum("thr,tkr->thk", q_latent[i:i + step].float(), kv_latent[idx].float()) \
            + torch.einsum("thp,tkp->thk", q_rope[i:i + step].float(), k_rope[idx].float())
        s = (s * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(1)          # [chunk, K]: sum over heads
        out[i:i + step] = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    return out


def indexer_kl_loss(index_scores: torch.Tensor, q_latent: torch.Tensor, q_rope: torch.Tensor,
                    kv_latent: torch.Tensor, k_rope: torch.Tensor, key_slots: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Mean over queries of KL(attention || softmax(index_scores)) on each query's keys.

    index_scores [T, K] fp32 (the indexer's scores of key_slots, -inf at padding) carries the
    gradient; the attention inputs (as for mla_attention) are only read, never differentiated.
    Queries without keys are skipped. Returns a scalar fp32 tensor.
    """
    if index_scores.shape != key_slots.shape:
        raise ValueError(f"indexer_kl_loss: index_scores {tuple(index_scores.shape)} must match key_slots "
                         f"{tuple(key_slots.shape)}")
    target = attention_distribution(q_latent.detach(), q_rope.detach(), kv_latent.detach(), k_rope.detach(),
                                    key_slots, scale)
    valid = key_slots >= 0
    rows = valid.any(-1)
    log_q = torch.log_softmax(index_scores.float().masked_fill(~valid, float("-inf")), dim=-1)
    log_p = torch.where(target > 0, target, torch.ones_like(target)).log()
    kl = torch.where(valid & (target > 0), target * (log_p - log_q), torch.zeros_like(target)).sum(-1)
    return kl[rows].mean() if bool(rows.any()) else index_scores.sum() * 0.0


@contextlib.contextmanager
def indexer_losses(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the indexer KL losses of the forwards run inside the block:

        with indexer_losses(model) as losses:
            logits = model(input_ids)
        aux = torch.stack(losses).mean()   # one per indexer layer (none if no row exceeds index_topk)
    """
    layers = [m for m in model.modules() if hasattr(m, "indexer_losses")]   # MLAttention's slot
    losses: list[torch.Tensor] = []
    for m in layers:
        m.indexer_losses = losses
    try:
        yield losses
    finally:
        for m in layers:
            m.indexer_losses = None
