"""Training objectives: SFT, DPO, GRPO advantages with the PPO-clip objective, the policy-gradient
estimators and off-policy corrections of `zerokl experiment` (:func:`policy_loss_terms`), and the
per-token losses of Tinker's API (:func:`token_loss_terms`: cross_entropy, importance_sampling, ppo,
cispo, dro).

All take per-token logprobs [B, T] with a mask [B, T] of the tokens that count
(completion tokens), so they work on padded batches. Sums over tokens run in a fixed
order (torch sums over a fixed-shape tensor on one device): two identical runs give
identical losses and gradients.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["sft_loss", "dpo_loss", "group_advantages", "PPOStats", "ppo_clip_loss", "ppo_clip_terms", "ESTIMATORS",
           "CORRECTIONS", "GSPO_CLIP", "LOW_PROB", "PolicyObjective", "policy_loss_terms", "TOKEN_LOSSES",
           "token_loss_terms"]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _masked_extreme(x: torch.Tensor, on: torch.Tensor, count: torch.Tensor, fill: float, reduce) -> torch.Tensor:
    """min/max of x where `on` (1.0 where nothing is on), with no host read."""
    if x.numel() == 0:
        return torch.ones((), device=x.device)
    return torch.where(count > 0, reduce(torch.where(on, x, torch.full_like(x, fill))), torch.ones((), device=x.device))


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

    @staticmethod
    def from_terms(terms: dict[str, torch.Tensor]) -> "PPOStats":
        """The statistics of ppo_clip_terms read back to the host (one device sync)."""
        values = torch.stack([terms[f].double() for f in _PPO_FIELDS]).tolist()
        got = dict(zip(_PPO_FIELDS, values))
        return PPOStats(**{f: int(v) if f in ("mismatched_tokens", "tokens") else v for f, v in got.items()})


_PPO_FIELDS = ("loss", "kl_behaviour", "mismatched_tokens", "clip_fraction", "ratio_min", "ratio_max", "tokens",
               "kl_reference")


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """PPO's pessimistic surrogate min(ratio * A, clip(ratio, low, high) * A), elementwise."""
    return torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


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
    loss, terms = ppo_clip_terms(logprobs, behaviour_logprobs, advantages, mask, clip_eps, ref_logprobs, kl_coef,
                                 kl_policy_logprobs)
    return loss, PPOStats.from_terms(terms)


def ppo_clip_terms(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, clip_eps: float = 0.2, ref_logprobs: torch.Tensor | None = None,
                   kl_coef: float = 0.0, kl_policy_logprobs: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ppo_clip_loss with its statistics left on the device as 0-dim tensors (PPOStats' fields):
    nothing is read back, so a CUDA graph can hold the step (PPOStats.from_terms reads them)."""
    mask = mask.float()
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.view(-1, 1).float()
    loss = -_masked_mean(_clipped_surrogate(ratio, adv, 1.0 - clip_eps, 1.0 + clip_eps), mask)
    kl_ref = torch.zeros((), device=logprobs.device)
    if ref_logprobs is not None and kl_coef > 0:
        d = ref_logprobs - (logprobs if kl_policy_logprobs is None else kl_policy_logprobs)
        kl_ref = _masked_mean(torch.exp(d) - d - 1.0, mask)          # k3 estimator, >= 0
        loss = loss + kl_coef * kl_ref
    with torch.no_grad():
        on = mask > 0
        tokens = on.sum()
        clipped_tokens = (on & ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps))).sum()
        terms = {
            "loss": loss.detach(),
            "kl_behaviour": _masked_mean(-log_ratio, mask),
            "mismatched_tokens": (on & (logprobs != behaviour_logprobs)).sum(),
            # 0 / 1 (not 0 / 0) on a batch with no counted token
            "clip_fraction": clipped_tokens.float() / tokens.clamp(min=1).float(),
            "ratio_min": _masked_extreme(ratio, on, tokens, float("inf"), torch.amin),
            "ratio_max": _masked_extreme(ratio, on, tokens, float("-inf"), torch.amax),
            "tokens": tokens,
            "kl_reference": kl_ref.detach(),
        }
    return loss, terms


# ----------------------------------------------------------------------------- estimators and corrections

#: Policy-gradient estimators of `zerokl experiment --estimator` (the ratio r is the trainer's
#: logprob against the "old" one: inference's, or with a correction the trainer's own):
#: grpo-clip: token-level PPO-clip, min(r A, clip(r, 1-eps, 1+eps) A), mean over tokens (GRPO/DAPO);
#: reinforce: r A with no clip, mean over tokens (on-policy REINFORCE; its gradient is r A grad log pi);
#: gspo: one ratio per sequence, the geometric mean of its token ratios, clipped at the sequence
#: level to [1 - GSPO_CLIP[0], 1 + GSPO_CLIP[1]], mean over sequences (GSPO, Zheng et al. 2025).
ESTIMATORS = ("grpo-clip", "reinforce", "gspo")
#: Corrections for inference logprobs that differ from the trainer's (rho = pi_train / pi_infer per
#: token, the trainer's logprob recomputed on the sampled tokens; the estimator's ratio is then taken
#: against the trainer's own logprobs, exactly 1 at an on-policy update):
#: tis: each token weighted by min(rho, C) (truncated IS; Yao et al. 2025);
#: mis: each token weighted by rho, or 0 where rho > C (token-level masked IS);
#: seq-mis: each sequence weighted by its rho(y) = prod rho, or dropped where rho(y) > C (sequence-level
#: masked IS: "When Speed Kills Stability", Liu et al. 2025).
CORRECTIONS = ("none", "tis", "mis", "seq-mis")
#: GSPO's published sequence clip range (left, right): ratios are geometric means, close to 1.
GSPO_CLIP = (3e-4, 4e-4)
#: A sampled token is low-probability when inference gave it p below this (the tokens "When Speed
#: Kills Stability" finds behind the gradient-norm explosions).
LOW_PROB = 1e-3


@dataclass(frozen=True)
class PolicyObjective:
    """What one policy-gradient update optimizes: an estimator and a correction (see ESTIMATORS, CORRECTIONS)."""

    estimator: str = "grpo-clip"
    correction: str = "none"
    clip_eps: float = 0.2               # grpo-clip's token clip range
    seq_clip: tuple[float, float] = GSPO_CLIP   # gspo's sequence clip range (left, right)
    cap: float = 2.0                    # C of the corrections

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {self.estimator!r}: expected one of {', '.join(ESTIMATORS)}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown correction {self.correction!r}: expected one of {', '.join(CORRECTIONS)}")
        if self.estimator == "gspo" and self.correction in ("tis", "mis"):
            raise ValueError(f"gspo optimizes whole sequences: its correction is none or seq-mis, not "
                             f"{self.correction!r} (a token-level weight)")
        if not self.cap > 0:
            raise ValueError(f"the correction cap C must be > 0, got {self.cap}")


def policy_loss_terms(logprobs: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      objective: PolicyObjective = PolicyObjective()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of `objective` and its statistics (0-dim tensors, nothing read back).

    logprobs [B, T] the trainer's (with grad), behaviour [B, T] inference's, advantages [B], mask [B, T].
    With ``correction == "none"`` the estimator's ratio is taken against inference's logprobs (a
    typical stack); grpo-clip then is :func:`ppo_clip_terms`' loss. Statistics over the counted tokens:
    ``kl`` (mean of behaviour - trainer logprob), ``mismatched_tokens``, ``ratio_min`` / ``ratio_max``
    and ``max_abs_log_ratio`` of rho = pi_train / pi_infer, ``low_prob_fraction`` (inference p < LOW_PROB),
    ``clip_fraction`` (tokens, or for gspo sequences, whose estimator ratio was clipped),
    ``behaviour_clip_fraction`` (tokens whose rho leaves [1 - eps, 1 + eps]: what PPO against inference
    would clip), ``correction_dropped_fraction`` (tokens truncated or masked by the correction; for
    seq-mis the tokens of dropped sequences) and ``correction_discarded_weight`` (the share of the
    rho mass the correction removed).
    """
    o = objective
    mask = mask.float()
    on = mask > 0
    tokens = on.sum()
    n = tokens.clamp(min=1).float()
    adv = advantages.view(-1, 1).float()
    log_rho = (logprobs.detach() - behaviour) * mask                   # log pi_train / pi_infer, 0 off the mask
    rho = torch.exp(log_rho)
    corrected = o.correction != "none"
    old = logprobs.detach() if corrected else behaviour
    weight = torch.ones_like(rho)                                        # the correction's per-token weight
    seq_len = mask.sum(1)
    has = seq_len > 0
    if o.correction == "tis":
        weight = torch.clamp(rho, max=o.cap)
        dropped = on & (rho > o.cap)
    elif o.correction == "mis":
        dropped = on & (rho > o.cap)
        weight = torch.where(dropped, torch.zeros_like(rho), rho)
    elif o.correction == "seq-mis":
        log_seq = log_rho.sum(1)                                         # log prod rho over the sequence
        keep = log_seq <= math.log(o.cap)
        # exp of the clamped log: a dropped sequence's rho(y) can overflow (it gets weight 0 either way)
        weight = torch.where(keep, torch.exp(torch.clamp(log_seq, max=math.log(o.cap))),
                             torch.zeros_like(log_seq)).view(-1, 1).expand_as(rho)
        dropped = on & ~keep.view(-1, 1)
    else:
        dropped = torch.zeros_like(on)
    log_ratio = logprobs - old
    if o.estimator == "gspo":
        # s_i = exp(mean_t log ratio): the sequence's geometric-mean ratio, with its gradient.
        seq_log = (log_ratio * mask).sum(1) / seq_len.clamp(min=1)
        s = torch.exp(seq_log).view(-1, 1)
        per_seq = _clipped_surrogate(s, adv, 1.0 - o.seq_clip[0], 1.0 + o.seq_clip[1]).view(-1) * weight[:, 0]
        loss = -torch.where(has, per_seq, torch.zeros_like(per_seq)).sum() / has.sum().clamp(min=1)
        with torch.no_grad():
            sd = s.view(-1).detach()
            clipped = (has & ((sd < 1.0 - o.seq_clip[0]) | (sd > 1.0 + o.seq_clip[1]))).sum().float() / \
                has.sum().clamp(min=1).float()
    else:
        ratio = torch.exp(log_ratio)
        per_token = (_clipped_surrogate(ratio, adv, 1.0 - o.clip_eps, 1.0 + o.clip_eps) if o.estimator == "grpo-clip"
                     else ratio * adv)
        loss = -_masked_mean(weight * per_token if corrected else per_token, mask)
        with torch.no_grad():
            rd = ratio.detach()
            clipped = ((on & ((rd < 1.0 - o.clip_eps) | (rd > 1.0 + o.clip_eps))).sum().float() / n
                       if o.estimator == "grpo-clip" else torch.zeros((), device=rd.device))
    with torch.no_grad():
        if o.correction == "seq-mis":
            # the dropped sequences' share of the rho(y) mass, in log space (rho(y) can overflow)
            lse = lambda x: (torch.logsumexp(x, 0) if x.numel()  # noqa: E731
                                 else torch.full((), float("-inf"), device=x.device))
            log_seq_on = log_seq[has]
            discarded = torch.exp(lse(log_seq_on[~keep[has]]) - lse(log_seq_on)) if bool(has.any()) else \
                torch.zeros((), device=rho.device)
        else:
            raw_mass = torch.where(on, rho, torch.zeros_like(rho)).sum()
            kept_mass = torch.where(on, weight, torch.zeros_like(rho)).sum()
            discarded = torch.where(raw_mass > 0, (raw_mass - kept_mass) / raw_mass, torch.zeros_like(raw_mass))
        terms = {
            "loss": loss.detach(),
            "kl": _masked_mean(-log_rho, mask),
            "mismatched_tokens": (on & (logprobs.detach() != behaviour)).sum(),
            "clip_fraction": clipped,
            "ratio_min": _masked_extreme(rho, on, tokens, float("inf"), torch.amin),
            "ratio_max": _masked_extreme(rho, on, tokens, float("-inf"), torch.amax),
            "max_abs_log_ratio": torch.where(on, log_rho.abs(), torch.zeros_like(rho)).amax() if rho.numel()
            else torch.zeros((), device=rho.device),
            "low_prob_fraction": (on & (behaviour < math.log(LOW_PROB))).sum().float() / n,
            "tokens": tokens,
        }
        if corrected:
            terms |= {
                "behaviour_clip_fraction":
                    (on & ((rho < 1.0 - o.clip_eps) | (rho > 1.0 + o.clip_eps))).sum().float() / n,
                "correction_dropped_fraction": dropped.sum().float() / n,
                "correction_discarded_weight": discarded,
            }
    return loss, terms


# ----------------------------------------------------------------------------- per-token losses (Tinker's)

#: The per-token losses, each with its loss_fn_config keys and their defaults (Tinker's documented
#: ones: PPO clips the ratio to [0.8, 1.2], CISPO's coefficient to [0, 4]). Every loss is a SUM over
#: positions, never a mean: a batch split into chunks sums to the same loss and gradient.
TOKEN_LOSSES: dict[str, dict[str, float]] = {
    "cross_entropy": {},                                    # -sum(weights * logprobs)
    "importance_sampling": {},                              # -sum(ratio * advantages)
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},                                  # -sum(logprobs * advantages - beta/2 * (log ratio)^2)
}


def token_loss_terms(loss: str, logprobs: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                     behaviour: torch.Tensor, advantages: torch.Tensor, config: dict[str, float]
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One of :data:`TOKEN_LOSSES` over padded per-position tensors [B, T], and its statistics.

    ``logprobs`` are the trainer's (the graph the backward runs through), ``valid`` marks the
    positions that exist (padding is False), ``weights`` cross-entropy's per-position weights,
    ``behaviour`` the sampling logprobs and ``advantages`` the per-position advantages (both zero
    where unused). ``config`` holds the loss's keys (defaults filled in by the caller). ratio =
    exp(logprobs - behaviour). Statistics (0-dim tensors) count the positions that carry the loss:
    nonzero weight (cross_entropy) or nonzero advantage (the RL losses): ``tokens``, and for the RL
    losses ``mismatched_tokens`` (trainer logprob != sampling logprob: 0 with aligned numerics),
    ``kl`` (sum of sampling minus trainer logprob: exactly 0 then), ``ratio_min`` / ``ratio_max``
    and, for the clipped losses, ``clipped_tokens``.
    """
    zero = torch.zeros_like(logprobs)
    if loss == "cross_entropy":
        per_position = -weights * logprobs
        on = valid & (weights != 0)
    else:
        log_ratio = logprobs - behaviour
        ratio = torch.exp(log_ratio)
        if loss == "importance_sampling":
            per_position = -ratio * advantages
        elif loss == "ppo":
            per_position = -_clipped_surrogate(ratio, advantages, config["clip_low_threshold"],
                                               config["clip_high_threshold"])
        elif loss == "cispo":
            coef = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
            per_position = -coef * logprobs * advantages
        elif loss == "dro":
            per_position = -(logprobs * advantages - 0.5 * config["beta"] * log_ratio ** 2)
        else:
            raise ValueError(f"unknown loss {loss!r}: expected one of {', '.join(TOKEN_LOSSES)}")
        on = valid & (advantages != 0)
    # torch.where, not a product: a padded position contributes exactly nothing (and no NaN).
    total = torch.where(valid, per_position, zero).sum()
    with torch.no_grad():
        terms = {"loss": total.detach(), "tokens": on.sum()}
        if loss != "cross_entropy":
            count = terms["tokens"]
            terms |= {"mismatched_tokens": (on & (logprobs != behaviour)).sum(),
                      "kl": torch.where(on, -log_ratio, zero).sum(),
                      "ratio_min": _masked_extreme(ratio, on, count, float("inf"), torch.amin),
                      "ratio_max": _masked_extreme(ratio, on, count, float("-inf"), torch.amax)}
            if loss in ("ppo", "cispo"):
                low, high = config["clip_low_threshold"], config["clip_high_threshold"]
                terms["clipped_tokens"] = (on & ((ratio < low) | (ratio > high))).sum()
    return total, terms
