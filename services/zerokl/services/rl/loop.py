"""The on-policy RL loop, independent of transport.

    sample prompts -> generate n per prompt on weights version v -> rewards
    -> trainer update -> publish v+1 -> inference switches to v+1 -> next step

The loop talks to two ports (:mod:`.ports`): a `RolloutPort` (inference: generate on a
pinned version) and a `TrainerPort` (update, publish). In-process ports serve tests and the
embedded demo; the Jobs API's gRPC ports put the same loop in front of the five services. Every step records
the exact train/inference KL, the number of tokens whose logprobs differ, clip
fraction, reward and throughput.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zerokl.services.rl.ports import RolloutPort, TrainerPort, sampling_seed
from zerokl.services.weightstore.versions import WeightsVersion
from zerokl.vocab import Completion, Rollout, SamplingOptions

__all__ = ["RLConfig", "StepRecord", "Task", "run_rl", "rl_step", "evaluate", "as_dict", "StaleRolloutError"]


_U32, _U64 = 2**32 - 1, 2**64 - 1


class StaleRolloutError(RuntimeError):
    """A rollout was sampled under a weights version the update does not accept."""


@dataclass(frozen=True)
class RLConfig:
    """The loop's settings. A Jobs API RL job is one of these plus the job's own fields
    (:class:`~zerokl.services.jobs.types.RLJobSpec`); the experiment and the benchmarks build one."""

    # A field's metadata is its command-line flag's (runtime/dataclass_flags.py): a name other than the
    # field's, an integer's bounds (the Jobs API's wire types: uint32 counts, uint64 seeds).
    steps: int = field(default=30, metadata={"range": (1, _U32)})                    # RL updates
    # distinct prompts per update
    prompts_per_step: int = field(default=8, metadata={"flag": "prompts", "range": (1, _U32)})
    # samples per prompt (GRPO group)
    group_size: int = field(default=8, metadata={"flag": "group", "range": (2, _U32)})
    max_tokens: int = field(default=24, metadata={"range": (1, _U32)})             # sampled tokens per completion
    temperature: float = 1.0                                                       # sampling temperature, 0 = greedy
    top_p: float = 1.0                                                             # nucleus mass, 1 = off
    seed: int = field(default=0, metadata={"range": (0, _U64)})                    # prompt order and sampling seeds
    # accept rollouts this many versions old (0 = strictly on-policy)
    max_staleness: int = field(default=0, metadata={"range": (0, _U32)})
    # greedy test accuracy every this many steps (0 = never)
    eval_every: int = field(default=5, metadata={"range": (0, _U32)})
    eval_prompts: int = field(default=32, metadata={"range": (1, _U32)})           # test problems of each evaluation
    ignore_eos: bool = False             # answers run to max_tokens, past eos (length-controlled rollouts)

    def rollout_options(self, step: int) -> SamplingOptions:
        """The sampling of step ``step``'s rollouts (0-based): ``group_size`` samples per prompt, seeded by the
        run's seed and the step, so a step redone samples the same tokens."""
        return SamplingOptions(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                               n=self.group_size, seed=sampling_seed(self.seed * 1_000_003 + step),
                               ignore_eos=self.ignore_eos)

    def eval_options(self) -> SamplingOptions:
        """The sampling of :func:`evaluate`: one greedy answer per problem."""
        return SamplingOptions(temperature=0.0, top_p=1.0, max_tokens=self.max_tokens, n=1, seed=0)


@dataclass
class StepRecord:
    """One RL step, as metrics.jsonl records it."""

    step: int
    weights_version: str
    reward: float
    kl: float
    mismatched_tokens: int
    clip_fraction: float
    ratio_min: float
    ratio_max: float
    loss: float
    grad_norm: float
    lr: float                   # the learning rate the step used
    tokens: int
    tokens_per_s: float         # tokens / train_s
    rollout_s: float            # sampling the step's rollouts
    train_s: float              # the update (ForwardBackward + OptimStep), up to the optimizer step's end
    stale_rollouts: int = 0
    test_accuracy: float | None = None
    # The optimizer step's end -> the new version served (through the services: SaveWeights(share)
    # and every replica switched; in process: the serving copy made); None where the caller does not say.
    sync_s: float | None = None
    sync_bytes: float | None = None         # serving bytes each replica received (the version's size)
    sync_bytes_per_s: float | None = None   # sync_bytes / sync_s
    sync_export_s: float | None = None      # of sync_s: the trainer's SaveWeights(share) (export + checksum)
    sync_switch_s: float | None = None      # of sync_s: the fleet's switch (canary, every replica's copy)
    # Waiting, before the step trained, for the store's background record of the previous version
    # (in neither train_s nor sync_s: it overlaps the rollouts and is ~0 when the upload kept up).
    record_wait_s: float | None = None
    # Versions served whose store record was still pending after this step's (weights-only ones the trainer
    # has not superseded yet, and at most the job's RECORD_LAG checkpoints), and whether this step's record
    # carries the trainer state (a resume point).
    record_lag: int | None = None
    checkpoint: bool | None = None
    # Durability (issue 49): the job step of the newest version whose store record landed, and of the newest
    # resume point that did (-1: none yet; 0: the job's start); what the records that landed since the step
    # before cost: the versions' bytes, the bytes the store wrote (deltas: what changed), their seconds.
    durable_step: int | None = None
    checkpoint_step: int | None = None
    record_bytes: float | None = None
    record_written_bytes: float | None = None
    record_s: float | None = None
    # Co-location (the fleet and the trainer on one device): the fleet's sleep before the step trained (its
    # seconds, in neither train_s nor sync_s; the wake is the switch, in sync_s) and the device bytes released.
    sleep_s: float | None = None
    sleep_bytes: float | None = None
    # Of train_s: the co-located trainer's wait, before its backward, until no store record still held a version's
    # bytes on the device (a record copies them after the records before it were written and uploaded).
    export_wait_s: float | None = None
    # Weights-only versions superseded since the step before: served in place by every replica, read by no one
    # from the store, so never recorded (ARCHITECTURE.md, "Durable versions").
    superseded: int | None = None


@dataclass(frozen=True)
class Task:
    """A task: prompts as token ids, and a reward for (problem, completion text)."""

    train: Sequence
    test: Sequence
    encode_prompt: Callable[[object], tuple[int, ...]]
    reward: Callable[[str, object], float]


def run_rl(task: Task, rollouts_port: RolloutPort, trainer: TrainerPort, config: RLConfig,
           on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    """Run `config.steps` on-policy GRPO steps; returns one record per step."""
    rng = random.Random(config.seed)
    records = []
    for step in range(config.steps):
        record, _, _ = rl_step(step, rng, task, rollouts_port, trainer, config)
        records.append(record)
        if on_step:
            on_step(record)
    return records


def rl_step(step: int, rng: random.Random, task: Task, rollouts_port: RolloutPort, trainer: TrainerPort,
            config: RLConfig) -> tuple[StepRecord, dict, int]:
    """Step ``step`` (0-based) of :func:`run_rl`: its prompts drawn from ``rng`` (the run's data cursor, which
    a caller that checkpoints holds), sampled, rewarded, trained on and published. Returns the step's record,
    the trainer port's metrics (a port may report more than the record keeps) and the sampled tokens."""
    version = trainer.weights_version
    problems = rng.sample(list(task.train), config.prompts_per_step)
    t0 = time.perf_counter()
    groups = rollouts_port.generate([task.encode_prompt(p) for p in problems], config.rollout_options(step),
                                    weights_version=version)
    rollout_s = time.perf_counter() - t0
    batch, stale = [], 0
    for problem, group in zip(problems, groups, strict=True):
        for s in group:
            if s.weights_version != version:
                now, then = WeightsVersion.parse(version), WeightsVersion.parse(s.weights_version)
                # A version whose step cannot be read is as stale as can be: refused.
                lag = now.step - then.step if now is not None and then is not None else None
                if lag is None or lag > config.max_staleness or lag < 0:
                    raise StaleRolloutError(f"rollout from {s.weights_version} while updating {version} "
                                            f"(max_staleness {config.max_staleness})")
                stale += 1
            seq = Completion(s.prompt_ids, s.completion_ids, config.temperature, 0, config.top_p)
            batch.append(Rollout(seq, s.logprobs, task.reward(s.text, problem), s.weights_version))
    t1 = time.perf_counter()
    m = trainer.grpo_step(batch, config.group_size)
    t2 = time.perf_counter()
    new_version = trainer.publish()
    # A port publishes in publish(), or already inside grpo_step (the services' port, one
    # restartable unit with the update) and then says how long that took as m["sync_s"].
    sync_s = m.get("sync_s", 0.0) + time.perf_counter() - t2
    train_s = time.perf_counter() - t1 - sync_s - m.get("record_wait_s", 0.0) - m.get("sleep_s", 0.0)
    record = StepRecord(
        step=step + 1, weights_version=new_version, reward=m["reward"], kl=m["kl"],
        mismatched_tokens=m["mismatched_tokens"], clip_fraction=m["clip_fraction"],
        ratio_min=m["ratio_min"], ratio_max=m["ratio_max"], loss=m["loss"], grad_norm=m["grad_norm"],
        lr=m["lr"], tokens=m["tokens"], tokens_per_s=m["tokens"] / max(train_s, 1e-9), rollout_s=rollout_s,
        train_s=train_s, stale_rollouts=stale, sync_s=sync_s, sync_bytes=m.get("sync_bytes"),
        sync_bytes_per_s=m.get("sync_bytes_per_s"), sync_export_s=m.get("sync_export_s"),
        sync_switch_s=m.get("sync_switch_s"), record_wait_s=m.get("record_wait_s"),
        record_lag=None if m.get("record_lag") is None else int(m["record_lag"]),
        checkpoint=None if m.get("checkpoint") is None else bool(m["checkpoint"]),
        durable_step=None if m.get("durable_step") is None else int(m["durable_step"]),
        checkpoint_step=None if m.get("checkpoint_step") is None else int(m["checkpoint_step"]),
        record_bytes=m.get("record_bytes"), record_written_bytes=m.get("record_written_bytes"),
        record_s=m.get("record_s"), sleep_s=m.get("sleep_s"), sleep_bytes=m.get("sleep_bytes"),
        export_wait_s=m.get("export_wait_s"),
        superseded=None if m.get("superseded") is None else int(m["superseded"]),
    )
    if config.eval_every and (step + 1) % config.eval_every == 0:
        record.test_accuracy = evaluate(task, rollouts_port, new_version, config)
    return record, m, sum(len(r.sequence.completion_ids) for r in batch)


def evaluate(task: Task, port: RolloutPort, version: str, config: RLConfig) -> float:
    """Greedy accuracy (reward == 1.0) on the first eval_prompts test problems."""
    problems = list(task.test)[: config.eval_prompts]
    groups = port.generate([task.encode_prompt(p) for p in problems], config.eval_options(), version)
    return sum(task.reward(g[0].text, p) == 1.0 for p, g in zip(problems, groups)) / max(1, len(problems))


def as_dict(record: StepRecord) -> dict:
    return dataclasses.asdict(record)


