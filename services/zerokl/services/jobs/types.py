"""What a job is and how it stands: the specs a client submits, a job's state, status and step events.

Plain dataclasses, exchanged by the scheduler's :class:`~zerokl.services.jobs.manager.JobManager`, the
``zerokl.v1.Jobs`` converters and clients (:class:`~zerokl.services.jobs.service.JobsClient`, `zerokl jobs`),
who run no kernel: nothing here imports torch. An RL job's settings are the RL loop's own
:class:`~zerokl.services.rl.loop.RLConfig`; a job's ``train_config`` is the trainer's
:class:`~zerokl.services.trainer.config.TrainConfig`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from zerokl.services.rl.loop import RLConfig
from zerokl.services.trainer.config import TrainConfig
from zerokl.vocab import Completion

__all__ = ["CountdownTask", "SFTJobSpec", "DPOJobSpec", "RLJobSpec", "JobSpec", "JobState", "JobStatus", "JobEvent"]


# ----------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class CountdownTask:
    """Built-in countdown problems (zerokl.tasks.countdown, the demo's distribution)."""

    seed: int = 0
    train_problems: int = 20000
    test_problems: int = 200


@dataclass(frozen=True)
class SFTJobSpec:
    steps: int
    countdown: CountdownTask | None = None          # solver demonstrations, or:
    examples: tuple[Completion, ...] = ()           # the caller's completions
    batch_size: int = 32
    publish_every: int = 0                          # 0: publish only at the end
    seed: int = 0
    learning_rate: float = 0.0                      # > 0: every step's lr; 0: the trainer's schedule
    train_config: TrainConfig | None = None         # set: a fresh trainer with these hyperparameters
    kind = "sft"


@dataclass(frozen=True)
class DPOJobSpec:
    steps: int
    pairs: tuple[tuple[Completion, Completion], ...]  # (chosen, rejected)
    batch_size: int = 8
    publish_every: int = 0
    seed: int = 0
    learning_rate: float = 0.0
    train_config: TrainConfig | None = None
    kind = "dpo"


@dataclass(frozen=True)
class RLJobSpec(RLConfig):
    """An RL job: the loop's settings (its RLConfig fields, which :func:`run_rl` is handed as they are) and the
    job's own below. The Jobs API's RLJob message names both at one level."""

    # Required here: RLConfig's default is the experiment's (an explicit field(), since a bare annotation
    # would take the inherited class attribute as its default).
    steps: int = field()
    countdown: CountdownTask = CountdownTask()
    learning_rate: float = 0.0
    train_config: TrainConfig | None = None
    # The trainer state (fp32 masters, AdamW moments, counters: a resume point) is recorded every N steps
    # and at the job's first (when it started on no resume point) and last; the other steps' versions are
    # recorded weights only (audit, replicas that read the store). A trainer restart redoes the steps since
    # the newest recorded checkpoint. 0: never: every version weights only (the start's too), no resume point,
    # so a trainer restart fails the job (the trainer comes back on its run's newest resume point, from before
    # the job): what a model whose trainer state would not fit the store's disk runs with.
    checkpoint_every: int = 10
    # The reward (zerokl.tasks.synthetic.REWARDS): "countdown" (TinyZero's), or "vowel_share", a synthetic
    # reward any policy earns some of (for measuring the loop: zerokl/tasks/synthetic.py), with ignore_eos
    # (RLConfig's) for length-controlled rollouts.
    reward: str = "countdown"
    kind = "rl"


JobSpec = SFTJobSpec | DPOJobSpec | RLJobSpec


# ----------------------------------------------------------------------------- status

class JobState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    name: str
    kind: str
    state: JobState
    step: int
    total_steps: int
    weights_version: str = ""
    error: str = ""
    elapsed_s: float = 0.0
    train_config: TrainConfig | None = None     # the hyperparameters it trains with, once started


@dataclass(frozen=True)
class JobEvent:
    """A status change, or a finished step (``step``/``metrics`` set)."""

    status: JobStatus
    step: int | None = None
    weights_version: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
