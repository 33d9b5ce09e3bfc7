"""The resumable parts of `zerokl experiment`: one RL step at a time, checkpoints, RNGs, time budgets.

A long run goes in pieces (each invocation under the device's 10-minute limit). Each
piece restores an arm's checkpoint -- model, optimizer, step, every RNG, the data
cursor and the metrics so far -- runs steps while its budget allows, and writes the
checkpoint again. The continuation is bitwise the run that never stopped: the loop's
only state is what the checkpoint holds (sampling seeds are derived from the step
number, not drawn from a stream).

Also here: the in-process ports an arm runs on (one served model reloaded in place
per version, not a new model per step), and the truncated-importance-sampling update
of the `mismatch-tis` arm.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import random
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from zerokl.kernels.model.fp8 import serving_fp8_model
from zerokl.services.rl.loop import RLConfig, Task, as_dict
from zerokl.services.rl.loop import rl_step as loop_rl_step
from zerokl.services.rl.ports import LocalEnginePort, LocalTrainerPort
from zerokl.services.trainer.losses import group_advantages
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.weightstore.versions import WeightsVersion
from zerokl.vocab import Rollout

__all__ = ["TIMING_KEYS", "ArmState", "Budget", "ArmEnginePort", "ArmTrainerPort", "capture_rng", "restore_rng",
           "save_state", "load_state", "save_records", "load_records", "rl_step", "run_steps", "tis_ppo_loss",
           "tis_grpo_step"]

#: Fields of a metrics line that measure wall time: the only ones a resumed run may change.
TIMING_KEYS = ("tokens_per_s", "rollout_s", "train_s", "sync_s", "rollout_tokens_per_s")


# ----------------------------------------------------------------------------- budget

@dataclass
class Budget:
    """How much work this invocation may still do: a wall-clock deadline and/or a step count.

    A step (RL or SFT) starts only if the slowest step so far would still end before the
    deadline, so a piece ends on time with its checkpoint written.
    """

    max_seconds: float | None = None
    max_steps: int | None = None
    start: float = dataclasses.field(default_factory=time.monotonic)
    steps: int = 0
    slowest_s: float = 0.0
    reserve_s: float = 30.0             # kept for writing the checkpoint and the report

    def allows_step(self) -> bool:
        if self.max_steps is not None and self.steps >= self.max_steps:
            return False
        if self.max_seconds is None:
            return True
        return time.monotonic() - self.start + self.slowest_s + self.reserve_s <= self.max_seconds

    def spent(self, seconds: float) -> None:
        self.steps += 1
        self.slowest_s = max(self.slowest_s, seconds)


# ----------------------------------------------------------------------------- RNGs and checkpoints

def capture_rng() -> dict:
    """Every global RNG a step could touch: Python's, numpy's, torch's CPU and CUDA generators."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(path: pathlib.Path, state: dict) -> None:
    """Write `state` atomically: a piece killed mid-write leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: pathlib.Path) -> dict | None:
    """A checkpoint, every tensor on the CPU (RNG states must be; load_state_dict copies weights and
    optimizer state to the model's device)."""
    if not path.exists():
        return None
    # Our own file, holding Python RNG tuples and numpy state: not weights-only.
    return torch.load(path, map_location="cpu", weights_only=False)


def save_records(path: pathlib.Path, meta: dict, records: list[dict]) -> None:
    """Checkpoint `path`'s setting and metrics lines beside it (PATH.records.json): a report, or a
    finished arm's re-run, reads them without loading GBs of optimizer state."""
    side = path.with_name(path.name + ".records.json")
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "records": records}))
    os.replace(tmp, side)


def load_records(path: pathlib.Path) -> tuple[dict | None, list[dict]]:
    """(setting, metrics lines) saved with checkpoint `path`; (None, []) when it has none. The setting
    is as JSON gives it back (tuples are lists)."""
    side = path.with_name(path.name + ".records.json")
    if not side.exists():
        return None, []
    d = json.loads(side.read_text())
    return d["meta"], d["records"]


@dataclass
class ArmState:
    """An arm's progress (its checkpoint also holds the trainer, the data cursor and the RNGs)."""

    step: int                           # RL steps done
    records: list[dict]                 # metrics lines so far
    done: bool = False


# ----------------------------------------------------------------------------- ports

class ArmTrainerPort(LocalTrainerPort):
    """LocalTrainerPort that keeps only the newest version (a 100-step run must not hold 100 copies
    of the weights) and names versions by the trainer's step, so a resumed port names them alike.

    With `tis_cap` set, updates are truncated-importance-sampling GRPO (:func:`tis_grpo_step`).
    With `serve_fp8` each version is published as an FP8 engine serves it (e4m3 values + block
    scales): an FP8 trainer's own bytes, or a bf16/fp32 trainer's weights quantized (the FP8 arms).
    """

    def __init__(self, trainer: Trainer, run: str, tis_cap: float | None = None, serve_fp8: bool = False):
        self.trainer, self.run, self.tis_cap, self.serve_fp8 = trainer, run, tis_cap, serve_fp8
        self._version = str(WeightsVersion.in_process(run, trainer.step))
        self.versions = {self._version: self._serving()}

    def _serving(self) -> dict[str, torch.Tensor]:
        """The version's weights in the engine's form."""
        if self.serve_fp8 and not self.trainer.fp8:
            # The industry's FP8 rollouts: the trainer's weights quantized at load (deterministic).
            return serving_fp8_model(self.trainer.model).state_dict()
        return self.trainer.serving_state_dict()

    def grpo_step(self, rollouts, group_size):  # noqa: ANN001, ANN201
        if self.tis_cap is None:
            return self.trainer.grpo_step(rollouts, group_size)
        return tis_grpo_step(self.trainer, rollouts, group_size, self.tis_cap)

    def publish(self) -> str:
        self._version = str(WeightsVersion.in_process(self.run, self.trainer.step))
        self.versions = {self._version: self._serving()}
        return self._version


class ArmEnginePort(LocalEnginePort):
    """LocalEnginePort that serves every version from one Engine, its model reloaded in place.

    A new Model per version re-runs the seeded init (portable normal draws on the CPU: tens of
    seconds for `small`), and a new Engine per step re-allocates the KV cache and re-captures
    its CUDA graphs (the graphs replay on the same parameter storage, so they survive a reload).
    The served model starts as a copy of the trainer's (no init at all). Each `generate` starts
    with an empty prefix cache, as a fresh engine would: a run resumed from a checkpoint (a fresh
    engine) computes what the uninterrupted run did, on the stock backend too, whose bits do
    depend on cache hits.
    """

    def __init__(self, trainer_port: LocalTrainerPort, tokenizer, engine_config=None, backend: str | None = None):  # noqa: ANN001
        super().__init__(trainer_port, tokenizer, engine_config, backend)
        self._engine = None

    def _model_for(self, version: str):  # noqa: ANN202
        if self._model is None:
            trainer = self.trainer_port.trainer
            if getattr(self.trainer_port, "serve_fp8", False):
                # A served FP8 model (e4m3 weights, no masters), whatever the trainer trains in.
                self._model = serving_fp8_model(trainer.model)
            else:
                self._model = copy.deepcopy(trainer.model).eval().requires_grad_(False)
        if version != self._loaded:
            if self._engine is None:
                self._model.load_state_dict(self.trainer_port.versions[version])
            else:
                self._engine.load_weights(self.trainer_port.versions[version], version)
            self._loaded = version
        return self._model

    def _engine_for(self, version: str):  # noqa: ANN202
        from zerokl.services.engine.engine import Engine
        model = self._model_for(version)
        if self._engine is None:
            self._engine = Engine(model, self.engine_config, tokenizer=self.tokenizer)
        self._engine.blocks.reset_prefix_cache()
        return self._engine


# ----------------------------------------------------------------------------- truncated importance sampling

def tis_ppo_loss(logprobs: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 clip_eps: float, cap: float) -> tuple[torch.Tensor, dict]:
    """GRPO/PPO-clip on the trainer's own old logprobs, each token weighted by min(pi_train / pi_infer, cap).

    The usual correction for an inference engine whose numbers differ from the trainer's
    (truncated importance sampling, as in "Your efficient RL framework secretly brings you
    off-policy RL training", Yao et al. 2025): the PPO ratio is taken against the trainer's
    recomputed logprobs (exactly 1 at the first update), and the mismatch is corrected by
    a per-token weight, truncated at `cap`. The weight mass above the cap is signal the
    correction discards.

    logprobs [B, T] (with grad), behaviour [B, T] (inference's), advantages [B], mask [B, T].
    """
    mask = mask.float()
    on = mask > 0
    old = logprobs.detach()
    ratio = torch.exp(logprobs - old)                                  # 1.0, carrying the gradient
    adv = advantages.view(-1, 1).float()
    per_token = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    raw = torch.exp(old - behaviour)                                   # pi_train / pi_infer per token
    weight = torch.clamp(raw, max=cap)
    loss = -(weight * per_token * mask).sum() / mask.sum().clamp(min=1)
    r, w = raw[on], weight[on]
    n = int(on.sum())
    stats = {
        "loss": float(loss.detach()),
        "kl": float(((behaviour - old) * mask).sum() / mask.sum().clamp(min=1)),
        "mismatched_tokens": int((old[on] != behaviour[on]).sum()),
        "clip_fraction": float(((ratio[on] < 1.0 - clip_eps) | (ratio[on] > 1.0 + clip_eps)).float().mean()) if n else 0.0,
        "ratio_min": float(r.min()) if n else 1.0,
        "ratio_max": float(r.max()) if n else 1.0,
        "tokens": n,
        # What plain PPO against inference's logprobs would have clipped at this step.
        "behaviour_clip_fraction": float(((r < 1.0 - clip_eps) | (r > 1.0 + clip_eps)).float().mean()) if n else 0.0,
        "tis_truncated_fraction": float((r > cap).float().mean()) if n else 0.0,
        "tis_discarded_weight": float((r - w).sum() / r.sum()) if n else 0.0,
    }
    return loss, stats


def tis_grpo_step(trainer: Trainer, rollouts: list[Rollout], group_size: int, cap: float) -> dict:
    """One GRPO update with the truncated-importance-sampling loss, through the trainer's own forward
    and optimizer step (same logprob path as Trainer.grpo_step, different objective)."""
    start = time.perf_counter()
    trainer.model.train()
    adv = group_advantages(torch.tensor([r.reward for r in rollouts]), group_size).to(trainer.device)
    batch = trainer.batch_of([r.sequence for r in rollouts])
    behaviour = torch.zeros(batch.mask.shape)
    for b, r in enumerate(rollouts):
        behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    logprobs = trainer.token_logprobs(trainer.model, batch)
    loss, metrics = tis_ppo_loss(logprobs, behaviour.to(trainer.device), adv, batch.mask, trainer.config.clip_eps, cap)
    loss.backward()
    trainer.tokens_seen += metrics["tokens"]
    metrics["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - start, 1e-9)
    metrics["reward"] = float(sum(r.reward for r in rollouts) / len(rollouts))
    return metrics | trainer.optim_step()


# ----------------------------------------------------------------------------- one RL step

def rl_step(step: int, rng: random.Random, task: Task, engine: ArmEnginePort, trainer_port: ArmTrainerPort,
            config: RLConfig) -> dict:
    """RL step number `step` (1-based) of run_rl's loop (:func:`zerokl.services.rl.loop.rl_step`), with the
    data cursor `rng` passed in so a checkpoint can hold it; returns the metrics line (run_rl's StepRecord
    plus the experiment's fields)."""
    step_record, m, rollout_tokens = loop_rl_step(step - 1, rng, task, engine, trainer_port, config)
    record = as_dict(step_record)
    record["mismatched_fraction"] = m["mismatched_tokens"] / max(1, m["tokens"])
    record["rollout_tokens"] = rollout_tokens
    record["rollout_tokens_per_s"] = rollout_tokens / max(step_record.rollout_s, 1e-9)
    for k in ("behaviour_clip_fraction", "tis_truncated_fraction", "tis_discarded_weight"):
        if k in m:
            record[k] = m[k]
    return record


def run_steps(total: int, state: ArmState, rng: random.Random, task: Task, engine: ArmEnginePort,
              trainer_port: ArmTrainerPort, config: RLConfig, budget: Budget,
              checkpoint: Callable[[], None], checkpoint_every: int,
              on_step: Callable[[dict], None] | None = None) -> None:
    """Steps state.step+1 .. total while the budget allows; checkpoint every `checkpoint_every` steps and at the end."""
    since = 0
    while state.step < total and budget.allows_step():
        t0 = time.monotonic()
        record = rl_step(state.step + 1, rng, task, engine, trainer_port, config)
        state.step += 1
        state.records.append(record)
        budget.spent(time.monotonic() - t0)
        if on_step:
            on_step(record)
        since += 1
        if checkpoint_every and since >= checkpoint_every and state.step < total:
            checkpoint()
            since = 0
    state.done = state.step >= total
    checkpoint()
