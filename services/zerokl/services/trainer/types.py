"""The trainer service's request and result types (plain dataclasses; convert.py maps them to protos).

Completions and rollouts are the trainer's own :class:`Completion` and
:class:`Rollout`; these types add what the service needs around them: which
objective a ForwardBackward runs (the batch type is the method), and what each
RPC reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

from zerokl.services.trainer.trainer import TrainConfig
from zerokl.vocab import Completion, Rollout

__all__ = [
    "METHODS",
    "SFTBatch",
    "DPOBatch",
    "PPOBatch",
    "TrainBatch",
    "PPOMetrics",
    "ForwardBackwardResult",
    "OptimResult",
    "TrainerState",
]

METHODS = ("sft", "dpo", "ppo")


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


TrainBatch = Union[SFTBatch, DPOBatch, PPOBatch]


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
