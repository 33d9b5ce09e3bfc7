"""Training objectives: SFT, DPO, and GRPO advantages with the PPO-clip objective.

All take per-token logprobs [B, T] with a mask [B, T] of the tokens that count
(completion tokens), so they work on padded batches. Sums over tokens run in a fixed
order (torch sums over a fixed-shape tensor on one device): two identical runs give
identical losses and gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["sft_loss", "dpo_loss", "group_advantages", "PPOStats", "ppo_clip_loss"]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy on completion tokens: -mean(log p(target))."""
    return -_masked_mean(logprobs, mask)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO on summed sequence logprobs [B]: -log sigmoid(beta * (policy margin - reference margin)).

    Returns (loss, preference accuracy).
    """
    logits = beta * ((policy_chosen - policy_rejected) - (ref_chosen - ref_rejected))
    return -torch.nn.functional.logsigmoid(logits).mean(), (logits > 0).float().mean()


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (groups are
    consecutive runs of `group_size` samples of one prompt). A group with equal rewards
    gets zero advantage."""
    r = rewards.float().view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    # Exactly zero for equal rewards: the fp32 mean of eight 0.1s is not 0.1, and (r - mean) / (std + eps)
    # would then give every sample the same nonzero advantage (-0.0074), a push on every sampled token.
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(r), (r - mean) / (std + eps)).view(-1)


@dataclass
class PPOStats:
    """What a policy-gradient step reports (all exact numbers, not estimates of them)."""

    loss: float
    kl_behaviour: float          # mean over tokens of (behaviour logprob - trainer logprob)
    mismatched_tokens: int       # tokens whose recomputed logprob differs from the behaviour's
    clip_fraction: float         # tokens whose ratio left [1 - eps, 1 + eps]
    ratio_min: float
    ratio_max: float
    tokens: int
    kl_reference: float = 0.0    # k3 estimate of KL(policy || reference), when a reference is used


def ppo_clip_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float = 0.2, ref_logprobs: torch.Tensor | None = None,
                  kl_coef: float = 0.0, kl_policy_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, PPOStats]:
    """PPO-clip with the importance ratio against the logprobs inference sampled with.

    logprobs, behaviour_logprobs, mask [B, T]; advantages [B] (one per sequence).
    Token-level mean over every counted token of the batch. With zerokl's aligned
    numerics the first step after sampling has ratio exactly 1 on every token.
    The KL penalty uses kl_policy_logprobs (the policy under the reference's
    distribution family, e.g. without top-p) when given, else logprobs.
    """
    mask = mask.float()
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.view(-1, 1).float()
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    loss = -_masked_mean(torch.minimum(unclipped, clipped), mask)
    kl_ref = torch.zeros(())
    if ref_logprobs is not None and kl_coef > 0:
        d = ref_logprobs - (logprobs if kl_policy_logprobs is None else kl_policy_logprobs)
        kl_ref = _masked_mean(torch.exp(d) - d - 1.0, mask)          # k3 estimator, >= 0
        loss = loss + kl_coef * kl_ref
    with torch.no_grad():
        on = mask > 0
        r = ratio[on]
        stats = PPOStats(
            loss=float(loss),
            kl_behaviour=float(_masked_mean(-log_ratio, mask)),
            mismatched_tokens=int((logprobs[on] != behaviour_logprobs[on]).sum()),
            clip_fraction=float(((r < 1.0 - clip_eps) | (r > 1.0 + clip_eps)).float().mean()) if r.numel() else 0.0,
            ratio_min=float(r.min()) if r.numel() else 1.0,
            ratio_max=float(r.max()) if r.numel() else 1.0,
            tokens=int(on.sum()),
            kl_reference=float(kl_ref),
        )
    return loss, stats
