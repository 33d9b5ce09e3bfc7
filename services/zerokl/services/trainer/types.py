"""The trainer service's request and result types (plain dataclasses; convert.py maps them to protos).

Completions and rollouts are the trainer's own :class:`Completion` and
:class:`Rollout`; these types add what the service needs around them: which
objective a ForwardBackward runs (the batch type is the method), an optimizer
step's own hyperparameters, and what each RPC reports. No torch here: clients
and the scheduler exchange these without running a kernel (a token batch's
result holds tensors, made by the converter that reads them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence, Union

from zerokl.services.runtime.errors import FieldViolation
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.weightstore.store import WeightsManifest
from zerokl.vocab import Completion, Rollout

if TYPE_CHECKING:
    import torch

__all__ = [
    "METHODS",
    "SFTBatch",
    "DPOBatch",
    "dpo_pair_violations",
    "PPOBatch",
    "TokenSequence",
    "TokenLossBatch",
    "TrainBatch",
    "PPOMetrics",
    "ForwardBackwardResult",
    "AdamParams",
    "OptimResult",
    "TrainerState",
    "Recorded",
]

METHODS = ("sft", "dpo", "ppo", "token")


@dataclass(frozen=True)
class SFTBatch:
    """Token-level cross-entropy on each completion's ids."""

    completions: tuple[Completion, ...]
    method = "sft"


@dataclass(frozen=True)
class DPOBatch:
    """(chosen, rejected) pairs, scored against the frozen reference."""

    pairs: tuple[tuple[Completion, Completion], ...]
    reset_reference: bool = False       # freeze the current weights as the reference first
    method = "dpo"


def dpo_pair_violations(pairs: Sequence[tuple[Completion, Completion]], where: str) -> list[FieldViolation]:
    """A preference pair whose chosen and rejected completions are the same tokens states no preference:
    its DPO loss is log 2 whatever the weights, its gradient zero (up to rounding). Refused by name (the
    trainer service and the Jobs API)."""
    return [FieldViolation(f"{where}[{i}]", "chosen and rejected are the same completion (same prompt and "
                                            "completion ids): the pair prefers nothing")
            for i, (chosen, rejected) in enumerate(pairs)
            if (chosen.prompt_ids, chosen.completion_ids) == (rejected.prompt_ids, rejected.completion_ids)]


@dataclass(frozen=True)
class PPOBatch:
    """Rollouts for PPO-clip against their behaviour logprobs.

    Advantages are GRPO's (rewards normalized within consecutive groups of
    ``group_size``) unless ``advantages`` gives one per rollout. With
    ``max_staleness`` None every rollout must come from the trainer's current
    weights; otherwise rollouts up to that many optimizer steps behind are
    accepted and counted.
    """

    rollouts: tuple[Rollout, ...]
    group_size: int | None = None
    advantages: tuple[float, ...] | None = None
    max_staleness: int | None = None
    method = "ppo"


@dataclass(frozen=True)
class TokenSequence:
    """A sequence scored at every position (a Tinker ``Datum``): position i reads input_ids[0..i] and
    scores target_ids[i]. The per-position inputs are None (unused) or one value per position."""

    input_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    weights: tuple[float, ...] | None = None        # cross_entropy's (None: 1 everywhere)
    logprobs: tuple[float, ...] | None = None       # the sampling logprobs (RL losses)
    advantages: tuple[float, ...] | None = None     # per-position advantages (RL losses)


@dataclass(frozen=True)
class TokenLossBatch:
    """One of Tinker's per-token losses (losses.TOKEN_LOSSES: a sum over positions) on ``sequences``,
    its logprobs taken under (temperature, top_k, top_p): the defaults are the model's own distribution."""

    loss: str
    sequences: tuple[TokenSequence, ...]
    config: Mapping[str, float] = field(default_factory=dict)   # the loss's keys; absent: defaults
    forward_only: bool = False          # loss and logprobs only, no gradients
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    method = "token"


TrainBatch = Union[SFTBatch, DPOBatch, PPOBatch, TokenLossBatch]


@dataclass(frozen=True)
class PPOMetrics:
    """What a PPO-clip pass measured (exact values: KL and mismatches are 0 with aligned numerics)."""

    kl: float
    mismatched_tokens: int
    clip_fraction: float
    ratio_min: float
    ratio_max: float
    kl_reference: float
    reward_mean: float
    stale_rollouts: int
    max_staleness: int


@dataclass(frozen=True)
class ForwardBackwardResult:
    """One ForwardBackward: its loss and throughput, PPO's exact metrics, and every metric by name."""

    method: str
    loss: float
    tokens: int
    tokens_per_s: float
    step: int                                   # optimizer steps taken so far
    accumulated_batches: int                    # ForwardBackward calls since the last OptimStep, this one included
    ppo: PPOMetrics | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    # token batches: the trainer's fp32 logprob of every target, one tensor per sequence
    token_logprobs: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's hyperparameters, instead of the trainer's (TrainConfig's lr schedule,
    betas, weight decay, grad_clip and AdamW's default eps). Tinker's ``AdamParams``."""

    learning_rate: float                # this step's learning rate (0: the weights stay as they are)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0           # decoupled (AdamW)
    grad_clip_norm: float = 0.0         # clip the global gradient norm to this (0 = off)


@dataclass(frozen=True)
class OptimResult:
    """One optimizer step: the gradient norm before clipping, the learning rate used, the new step count."""

    grad_norm: float
    lr: float
    step: int


@dataclass(frozen=True)
class TrainerState:
    """Where the trainer stands (GetState, LoadWeights)."""

    run: str
    step: int
    weights_version: str                        # last published or loaded version
    weights_step: int                           # the step at which the weights were weights_version
    tokens_seen: int
    accumulated_batches: int
    config: TrainConfig
    model_config_json: str
    numerics_version: str
    numerics_fingerprint: str


@dataclass(frozen=True)
class Recorded:
    """RecordWeights: what became of a version saved with share. Recorded: its store manifest (``stored_size`` says
    what the store wrote) and the seconds from the share to the commit. Superseded (a weights-only version nobody
    read, shared before the version the caller serves; never recorded): ``superseded_by`` names the newer
    version shared when it was dropped, and there is no manifest."""

    manifest: WeightsManifest | None
    record_s: float = 0.0
    superseded_by: str = ""

    @property
    def superseded(self) -> bool:
        return bool(self.superseded_by)
