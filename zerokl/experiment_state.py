"""The resumable parts of `zerokl experiment`: one RL step at a time, checkpoints, RNGs, time budgets.

A long run goes in pieces (each invocation under the device's 10-minute limit). Each
piece restores an arm's checkpoint -- model, optimizer, step, every RNG, the data
cursor and the metrics so far -- runs steps while its budget allows, and writes the
checkpoint again. The continuation is bitwise the run that never stopped: the loop's
only state is what the checkpoint holds (sampling seeds are derived from the step
number, not drawn from a stream).

Also here: the in-process ports an arm runs on (one served model reloaded in place
per version, not a new model per step), the policy update of every arm (an estimator and
a correction (Trainer.grpo_step's ``objective``), with the step's collapse telemetry: gradient norm,
entropy, max |log ratio|, low-probability share), and the routing-flip arm's router
(:class:`FlippingRouter`: the rollout's MoE router in its own numerics).
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

from zerokl.kernels import ops
from zerokl.kernels.model.fp8 import serving_fp8_model, serving_fp8_state
from zerokl.kernels.model.model import MoE, Router
from zerokl.services.rl.loop import RLConfig, Task, as_dict
from zerokl.services.rl.loop import rl_step as loop_rl_step
from zerokl.services.rl.ports import LocalEnginePort, LocalTrainerPort
from zerokl.services.trainer.losses import PolicyObjective
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.weightstore.versions import WeightsVersion

__all__ = ["TIMING_KEYS", "TELEMETRY_KEYS", "ArmState", "Budget", "ArmEnginePort", "ArmTrainerPort", "FlippingRouter",
           "RouterFlips", "capture_rng", "restore_rng", "save_state", "load_state", "save_records", "load_records", "rl_step",
           "run_steps"]

#: Fields of a metrics line that measure wall time: the only ones a resumed run may change.
TIMING_KEYS = ("tokens_per_s", "rollout_s", "train_s", "sync_s", "rollout_tokens_per_s")
#: The policy update's fields a metrics line carries beside run_rl's StepRecord (the objective's telemetry: Trainer.forward_backward).
TELEMETRY_KEYS = ("entropy", "max_abs_log_ratio", "low_prob_fraction", "behaviour_clip_fraction",
                  "correction_dropped_fraction", "correction_discarded_weight")


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

    With `objective` set, updates are the trainer's GRPO step with it (the experiment's estimator and correction,
    with its telemetry); without, the trainer's own GRPO step.
    With `serve_fp8` each version is published as an FP8 engine serves it (e4m3 values + block
    scales): an FP8 trainer's own bytes, or a bf16/fp32 trainer's weights quantized (the FP8 arms).
    """

    def __init__(self, trainer: Trainer, run: str, objective: PolicyObjective | None = None, serve_fp8: bool = False):
        self.trainer, self.run, self.objective, self.serve_fp8 = trainer, run, objective, serve_fp8
        self._version = str(WeightsVersion.in_process(run, trainer.step))
        self.versions = {self._version: self._serving()}

    def _serving(self) -> dict[str, torch.Tensor]:
        """The version's weights in the engine's form."""
        if self.serve_fp8 and not self.trainer.fp8:
            # The industry's FP8 rollouts: the trainer's weights quantized at load (deterministic).
            return serving_fp8_state(self.trainer.model)
        return self.trainer.serving_state_dict()

    def grpo_step(self, rollouts, group_size):  # noqa: ANN001, ANN201
        return self.trainer.grpo_step(rollouts, group_size, self.objective)

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

    With `flip_routers` the served model's MoE routers are :class:`FlippingRouter`s (the routing-flip
    arm; the engine then runs without CUDA graphs, whose padded rows the flip counts would include)
    and each `generate` leaves its rollouts' counts in `last_router_flips`.
    """

    def __init__(self, trainer_port: LocalTrainerPort, tokenizer, engine_config=None, backend: str | None = None,  # noqa: ANN001
                 flip_routers: bool = False):
        super().__init__(trainer_port, tokenizer, engine_config, backend)
        if flip_routers:
            self.engine_config = dataclasses.replace(self.engine_config, cuda_graphs=False)
        self._engine = None
        self.router_flips = RouterFlips() if flip_routers else None
        self.last_router_flips: dict | None = None

    def generate(self, prompts, options, weights_version):  # noqa: ANN001, ANN201
        if self.router_flips is not None:
            self.router_flips.reset()
        groups = super().generate(prompts, options, weights_version)
        if self.router_flips is not None:
            self.last_router_flips = self.router_flips.read()
        return groups

    def _model_for(self, version: str):  # noqa: ANN202
        if self._model is None:
            trainer = self.trainer_port.trainer
            if getattr(self.trainer_port, "serve_fp8", False):
                # A served FP8 model (e4m3 weights, no masters), whatever the trainer trains in.
                self._model = serving_fp8_model(trainer.model)
            else:
                self._model = copy.deepcopy(trainer.model).eval().requires_grad_(False)
            if self.router_flips is not None:
                FlippingRouter.install(self._model, self.router_flips)
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


# ----------------------------------------------------------------------------- the routing-flip arm's router

class RouterFlips:
    """Counts of the flipping routers' decisions since `reset`, kept on the device (no read per layer).

    A decision is one token's expert set at one MoE layer; it flips when the rollout's router picks
    another set than the trainer's would on the same input. A row (a token of one forward) flips when
    any of its layers does: the router-replay paper's "tokens that differ in at least one layer".
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.decisions, self.flipped, self.rows, self.flipped_rows = 0, 0, 0, 0
        self._pending: torch.Tensor | None = None      # [T] the current forward's rows flipped so far

    def add(self, first_layer: bool, flip: torch.Tensor) -> None:
        """One MoE layer's flips [T] (bool); `first_layer` starts a new forward."""
        if first_layer:
            self._flush()
            self._pending = flip.clone()
        elif self._pending is not None and self._pending.shape == flip.shape:
            self._pending |= flip
        self.decisions += flip.numel()
        self.flipped = self.flipped + flip.sum()

    def _flush(self) -> None:
        if self._pending is not None:
            self.rows += self._pending.numel()
            self.flipped_rows = self.flipped_rows + self._pending.sum()
            self._pending = None

    def read(self) -> dict:
        """{"router_decisions", "router_flip_fraction", "router_flip_row_fraction"} (one host read)."""
        self._flush()
        flipped, rows = int(self.flipped), int(self.flipped_rows)
        return {"router_decisions": self.decisions, "router_flip_fraction": flipped / max(1, self.decisions),
                "router_flip_row_fraction": rows / max(1, self.rows)}


class FlippingRouter(Router):
    """The rollout's MoE router in its own numerics: logits from bf16 input and weight (a serving
    stack's bf16 router) instead of the trainer's fp32 ones.

    Where the bf16 logits pick the same expert set as the trainer's router, the token keeps the
    exact route (weights and expert order): only tokens whose experts flip compute anything else.
    So the arm isolates routing flips; every other op is the trainer's invariant kernel.
    """

    def __init__(self, router: Router, flips: RouterFlips, first: bool):
        super().__init__(router.c)
        self.load_state_dict(router.state_dict())
        self.to(router.weight.device)
        self.flips, self.first = flips, first

    @staticmethod
    def install(model: torch.nn.Module, flips: RouterFlips) -> None:
        """Replace every MoE layer's router of `model` by a FlippingRouter counting into `flips`."""
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        for i, moe in enumerate(moes):
            moe.gate = FlippingRouter(moe.gate, flips, first=i == 0).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().forward(x)
        c = self.c
        logits = ops.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)).float()
        flip_weights, flip_ids = ops.moe_route(logits, self.e_score_correction_bias, c.num_experts_per_tok,
                                               c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)
        flip = (ids.sort(dim=1).values != flip_ids.sort(dim=1).values).any(dim=1)       # [T] another expert set
        self.flips.add(self.first, flip)
        return (torch.where(flip.unsqueeze(1), flip_weights, weights),
                torch.where(flip.unsqueeze(1), flip_ids, ids))


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
    record["samples"] = config.prompts_per_step * config.group_size
    record["rollout_tokens_per_s"] = rollout_tokens / max(step_record.rollout_s, 1e-9)
    for k in TELEMETRY_KEYS:
        if k in m:
            record[k] = m[k]
    if getattr(engine, "last_router_flips", None) is not None:
        record |= engine.last_router_flips
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
