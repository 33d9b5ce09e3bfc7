"""`zerokl experiment countdown`: the same RL run with aligned and with mismatched numerics.

An arm is a rollout numerics, optionally with a correction (`--arms`, e.g. ``mismatch-fp8-seq-mis``);
all arms of a run start from the same warm start with the same seeds, prompts and hyperparameters.
Rollout numerics:

* **zerokl**: inference samples with the trainer's own kernels (the invariant
  backend: triton on CUDA, torch on CPU), so the behaviour logprobs the trainer
  receives are bitwise its own.
* **mismatch**: inference samples with the ``stock`` backend (plain torch ops, the
  fast non-invariant path a typical serving stack runs) in the engine's continuous
  batching, while the trainer keeps the invariant forward: an RL stack with
  separate engines. The estimator's ratio is taken against inference's logprobs.
* **mismatch-router**: inference runs the trainer's kernels except its MoE routers, which
  compute their logits from bf16 input and weights (a serving stack's bf16 router) where the
  trainer's are fp32; a token keeps the exact route unless its expert set flips. Each step
  records the share of flipped router decisions (experiment_state.FlippingRouter).
* **zerokl-fp8**: inference samples in block-scaled FP8 (e4m3 projections, bf16
  activations; zerokl.kernels.model.fp8) and the trainer trains on the same FP8 forward
  (TrainConfig.dtype "fp8": fp32 masters quantized after every step, straight-through
  backward), publishing the e4m3 bytes the engine serves: KL exactly 0.
* **mismatch-fp8**: the industry's common setup: inference samples in FP8 from the
  trainer's weights quantized at load, the trainer trains in bf16 (fp32 masters) on
  the bf16 forward. Both kernels are invariant; the mismatch is FP8 vs bf16 numerics.

Corrections (a suffix of a mismatched arm: ``-tis``, ``-mis``, ``-seq-mis``; losses.CORRECTIONS):
truncated IS, token-level masked IS, sequence-level masked IS. The estimator (``--estimator``:
grpo-clip, reinforce, gspo; losses.ESTIMATORS), the answers (``--answers``: short TinyZero
answers, or a search trace of 512+ tokens before the answer: zerokl.tasks.countdown_trace) and
the learning rate are per run. A **cell** of the map (issue 53) is one such run, a same-seed
pair zerokl vs mismatched plus corrections: ``--cell NAME`` sets its flags, ``--grid`` lists
the cells. Every zerokl arm must have KL 0.0 and no mismatched token at every step: a step that
breaks it stops the run.

Warm start: the shipped CPU SFT checkpoint (``tiny``), or SFT on the device from
solver demonstrations with the same recipe at the chosen size, cached under the
state folder. Long runs go in pieces: with --max-minutes or --max-steps-this-run an
invocation checkpoints (model, optimizer, step, every RNG, data cursor, metrics)
and exits with status 75; the same command continues bitwise where it stopped.
--sweep runs the zerokl arm over a grid of difficulty, model size and learning rate
and reports whether each point's reward rises above its step-to-step noise.

The report records what happens; it does not assume the mismatch arm learns worse.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import random
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from zerokl.kernels.dtypes import to_dtype
from zerokl.services.engine.types import EngineConfig
from zerokl.services.rl.loop import RLConfig
from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments
from zerokl.services.trainer.losses import ESTIMATORS, PolicyObjective
from zerokl.tasks.setup import ANSWERS

__all__ = ["ARMS", "CELLS", "INCOMPLETE", "NUMERICS", "Numerics", "add_arguments", "main", "parse_arm", "run",
           "run_arm", "sft_warm_start", "trend", "write_map", "write_report"]


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How an arm's rollouts are computed against its trainer."""

    backend: str | None = None          # inference kernels (None: the trainer's own)
    fp8_trainer: str | None = None      # FP8 rollouts; the trainer's TrainConfig.dtype ("fp8": the same forward)
    flip_routers: bool = False          # the rollout's MoE routers in bf16 (experiment_state.FlippingRouter)

    @property
    def exact(self) -> bool:
        """Whether this is a zerokl arm: KL 0.0 and no mismatched token at every step, asserted."""
        return self.backend is None and not self.flip_routers and self.fp8_trainer in (None, "fp8")


#: rollout numerics of an arm -> how its rollouts are computed
NUMERICS = {"zerokl": Numerics(), "mismatch": Numerics(backend="stock"), "mismatch-router": Numerics(flip_routers=True),
            "zerokl-fp8": Numerics(fp8_trainer="fp8"), "mismatch-fp8": Numerics(fp8_trainer="bfloat16")}
#: Every arm: a rollout numerics, or a mismatched one with a correction (losses.CORRECTIONS).
ARMS = (*NUMERICS, *(f"{n}-{c}" for n in NUMERICS if not NUMERICS[n].exact for c in ("tis", "mis", "seq-mis")))


def parse_arm(arm: str) -> tuple[str, str]:
    """(rollout numerics, correction) of an arm name, e.g. "mismatch-fp8-seq-mis" -> ("mismatch-fp8", "seq-mis")."""
    if arm not in ARMS:
        raise SystemExit(f"unknown arm {arm!r}: expected one of {', '.join(ARMS)}")
    for c in ("seq-mis", "mis", "tis"):                   # "-seq-mis" before "-mis": it ends with it
        if arm.endswith("-" + c) and arm[: -len(c) - 1] in NUMERICS:
            return arm[: -len(c) - 1], c
    return arm, "none"


#: The cells of the map (issue 53): name -> (what it varies, its flags). Each is a same-seed pair, zerokl
#: vs mismatched rollouts, beside the mismatched arm's corrections; run one with --cell NAME plus the
#: scale flags (docs/rl.md, "The map"). "trace" cells answer with a search trace of 512+ tokens, on
#: 4-number problems (3-number traces are mostly shorter: zerokl.tasks.countdown_trace).
_FP8 = "zerokl-fp8,mismatch-fp8"
CELLS: dict[str, tuple[str, list[str]]] = {
    "clip-bf16": ("GRPO-clip, stock bf16 rollouts, short answers, lr 1e-5 (the published H200 run's setting)",
                  ["--estimator", "grpo-clip", "--arms", "zerokl,mismatch,mismatch-tis,mismatch-seq-mis",
                   "--answers", "short", "--lr", "1e-5"]),
    "clip-fp8": ("GRPO-clip, FP8 rollouts with a bf16 trainer, short answers, lr 1e-5",
                 ["--estimator", "grpo-clip", "--arms", f"{_FP8},mismatch-fp8-tis,mismatch-fp8-seq-mis",
                  "--answers", "short", "--lr", "1e-5"]),
    "clip-router": ("GRPO-clip, routing flips (bf16 rollout router), short answers, lr 1e-5",
                    ["--estimator", "grpo-clip", "--arms", "zerokl,mismatch-router,mismatch-router-seq-mis",
                     "--answers", "short", "--lr", "1e-5"]),
    "reinforce-bf16": ("REINFORCE (no clip), stock bf16 rollouts, short answers, lr 1e-5",
                       ["--estimator", "reinforce", "--arms", "zerokl,mismatch,mismatch-mis,mismatch-seq-mis",
                        "--answers", "short", "--lr", "1e-5"]),
    "reinforce-fp8": ("REINFORCE (no clip), FP8 rollouts with a bf16 trainer, short answers, lr 1e-5",
                      ["--estimator", "reinforce", "--arms", f"{_FP8},mismatch-fp8-mis,mismatch-fp8-seq-mis",
                       "--answers", "short", "--lr", "1e-5"]),
    "gspo-fp8": ("GSPO (sequence-level ratio), FP8 rollouts with a bf16 trainer, short answers, lr 1e-5",
                 ["--estimator", "gspo", "--arms", f"{_FP8},mismatch-fp8-seq-mis", "--answers", "short",
                  "--lr", "1e-5"]),
    "clip-fp8-lr1e-4": ("GRPO-clip, FP8 rollouts with a bf16 trainer, short answers, lr 1e-4 (10x)",
                        ["--estimator", "grpo-clip", "--arms", f"{_FP8},mismatch-fp8-tis,mismatch-fp8-seq-mis",
                         "--answers", "short", "--lr", "1e-4"]),
    "reinforce-fp8-lr1e-4": ("REINFORCE (no clip), FP8 rollouts with a bf16 trainer, short answers, lr 1e-4 (10x)",
                             ["--estimator", "reinforce", "--arms", f"{_FP8},mismatch-fp8-seq-mis", "--answers",
                              "short", "--lr", "1e-4"]),
    "clip-fp8-trace": ("GRPO-clip, FP8 rollouts with a bf16 trainer, search-trace answers (512+ tokens), lr 1e-5",
                       ["--estimator", "grpo-clip", "--arms", f"{_FP8},mismatch-fp8-tis,mismatch-fp8-seq-mis",
                        "--answers", "trace", "--difficulty", "hard", "--lr", "1e-5"]),
    "reinforce-fp8-trace": ("REINFORCE (no clip), FP8 rollouts with a bf16 trainer, search-trace answers, lr 1e-5",
                            ["--estimator", "reinforce", "--arms", f"{_FP8},mismatch-fp8-mis,mismatch-fp8-seq-mis",
                             "--answers", "trace", "--difficulty", "hard", "--lr", "1e-5"]),
    "reinforce-router-trace": ("REINFORCE (no clip), routing flips, search-trace answers, lr 1e-5",
                               ["--estimator", "reinforce", "--arms", "zerokl,mismatch-router,mismatch-router-seq-mis",
                                "--answers", "trace", "--difficulty", "hard", "--lr", "1e-5"]),
    "gspo-bf16-trace": ("GSPO (sequence-level ratio), stock bf16 rollouts, search-trace answers, lr 1e-5",
                        ["--estimator", "gspo", "--arms", "zerokl,mismatch,mismatch-seq-mis", "--answers", "trace",
                         "--difficulty", "hard", "--lr", "1e-5"]),
}
#: The scale of the GPU grid's cells (docs/rl.md, "How to reproduce the map"; `bash tools/bench/h200_run.sh map`
#: runs them): `small` in bf16, 50 steps first, 16 prompts x 8 samples a step (512 a step, the H200 runs'
#: batch, does not fit 8 cells x 50 steps into a 10-minute device call), every unit of a cell at once. --seeds
#: 0,1,2 runs each arm once per RL seed. Trace cells sample 16 prompts x 8 of up to 1,024 tokens (about 90,000
#: tokens a step) with room in the KV cache, from 2,000 training problems (the 4-number draws that give
#: 512-960-token traces are slow to find: about 50 CPU seconds per 1,000).
GPU_SCALE = ["--preset", "small", "--device", "cuda", "--dtype", "bfloat16", "--steps", "50", "--seeds", "0",
             "--prompts", "16", "--group", "8", "--eval-every", "10", "--eval-prompts", "128", "--max-num-seqs", "128",
             "--max-num-batched-tokens", "4096", "--num-blocks", "1024", "--checkpoint-every", "0", "--processes", "4",
             "--max-minutes", "9"]
GPU_TRACE_SCALE = ["--train-problems", "2000", "--max-num-batched-tokens", "16384", "--num-blocks", "12288"]

#: Exit status of an invocation that stopped for its budget with work left: run the same command again.
INCOMPLETE = 75
#: The published GLM countdown run without aligned numerics (README, "Why").
PUBLISHED = {"kl": 0.013, "clip_fraction": 0.45}
#: --dtype of the non-FP8 arms (zerokl.kernels.dtypes names them).
_ARM_DTYPES = ("bfloat16", "float32")
#: SFT (steps, peak lr) per preset. tiny's is the shipped checkpoint's recipe. `small` at tiny's lr 3e-3
#: stayed at 0.8% greedy test accuracy after 1,200 steps (loss ~1.2, H200, bf16); at 3e-4 it reached 22%
#: by step 400 of 600 (loss 0.29), at 1e-3 6% (docs/rl.md, the GPU proof run).
_SFT_RECIPES = {"tiny": (1200, 3e-3)}
_SFT_RECIPE = (600, 3e-4)                      # every other preset
#: SFT steps are ~10x cheaper than RL steps: --checkpoint-every N checkpoints SFT every 10 N steps.
_SFT_STEPS_PER_RL_STEP = 10
_DOC_BEGIN, _DOC_END = "<!-- experiment-table:begin -->", "<!-- experiment-table:end -->"


#: The experiment's RLConfig and EngineConfig flags: the fields it honours (a Setting field each), its defaults.
#: RLConfig's max_tokens and seed have the experiment's own flags (add_arguments); top_p, max_staleness and
#: ignore_eos are not the experiment's (its arms sample at top_p 1, strictly on-policy, stopping at eos).
_RL_SKIP = ("max_tokens", "seed", "top_p", "max_staleness", "ignore_eos")
_RL_DEFAULTS = RLConfig(steps=30, prompts_per_step=16, group_size=8, temperature=1.0, eval_every=10, eval_prompts=64)
_ENGINE_SKIP = tuple(f.name for f in dataclasses.fields(EngineConfig)
                     if f.name not in ("num_blocks", "max_num_seqs", "max_num_batched_tokens"))
_ENGINE_DEFAULTS = EngineConfig(num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512)


def _csv(kind):  # noqa: ANN001, ANN202
    return lambda text: [kind(x) for x in text.split(",") if x]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("task", choices=["countdown"], help="the experiment to run")
    ap.add_argument("--out", default="runs/experiment", help="report folder: report.md, metrics.jsonl, experiment.png")
    ap.add_argument("--state-dir", default=None,
                    help="checkpoints, the cached SFT warm start and problem sets (default: OUT/state)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the trainer and the engine run")
    ap.add_argument("--preset", default="tiny", help="model size: a ModelConfig preset with the countdown vocabulary")
    ap.add_argument("--dtype", choices=_ARM_DTYPES, default="float32",
                    help="weights and compute dtype of both arms (default %(default)s)")
    ap.add_argument("--arms", type=_csv(str), default=["zerokl", "mismatch"],
                    help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--estimator", choices=ESTIMATORS, default="grpo-clip",
                    help="policy-gradient estimator of every arm (zerokl.services.trainer.losses.ESTIMATORS; "
                         "default %(default)s)")
    ap.add_argument("--answers", choices=tuple(ANSWERS), default="short",
                    help="short: the TinyZero answer (at most 24 tokens); trace: a depth-first search trace, then the "
                         "answer (512+ tokens; zerokl.tasks.countdown_trace)")
    ap.add_argument("--seeds", type=_csv(int), default=None,
                    help="run every arm once per RL seed (prompt order and sampling; the warm start and problems "
                         "keep --seed) and report mean ± s.e. over seeds")
    ap.add_argument("--cell", default=None, choices=tuple(CELLS),
                    help="a cell of the map: its estimator, arms, answers and learning rate (flags given after it "
                         "override them); --grid lists the cells")
    ap.add_argument("--grid", action="store_true", help="print the map's cells and their commands, and exit")
    ap.add_argument("--map", default=None, metavar="DIR",
                    help="instead of running: the map of the cells run into DIR/CELL (--out of each cell's command) "
                         "as DIR/map.md and DIR/map.png")
    ap.add_argument("--difficulty", default="demo", help="problem distribution (zerokl.tasks.setup.DIFFICULTIES)")
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="sampled tokens per completion (default per --answers: 24 short, 1024 trace)")
    ap.add_argument("--correction-cap", type=float, default=2.0,
                    help="C of the corrections: tis truncates each token's weight at C, mis and seq-mis drop a token "
                         "or sequence whose ratio exceeds C (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seeds the model, the problems and the sampling (default %(default)s)")
    ap.add_argument("--train-problems", type=int, default=None,
                    help="training problems (default 20000; 2000 for the small 'easy' space)")
    ap.add_argument("--start", choices=["auto", "shipped", "sft", "scratch"], default="auto",
                    help="warm start: the shipped tiny SFT checkpoint, SFT on --device, or the seeded model; "
                         "auto: shipped for tiny/float32 on the demo's problems, else sft")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="SFT recipe: steps (default per preset: 1200 for tiny, tools/train_countdown_sft.py's; 600)")
    ap.add_argument("--sft-batch", type=int, default=32,
                    help="SFT recipe: demonstrations per step (default %(default)s)")
    ap.add_argument("--sft-lr", type=float, default=None, help="SFT peak learning rate (default per preset: 3e-3 "
                    "for tiny; 3e-4)")
    ap.add_argument("--sft-warmup", type=int, default=50,
                    help="SFT recipe: learning-rate warmup steps (default %(default)s)")
    ap.add_argument("--sft-eval-every", type=int, default=250,
                    help="SFT recipe: greedy test accuracy every N steps (default %(default)s)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop, checkpointed, before this many minutes; exit 75 if work is left")
    ap.add_argument("--max-steps-this-run", type=int, default=None,
                    help="stop, checkpointed, after this many steps (SFT and RL); exit 75 if work is left")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="also checkpoint every N steps (0: only when a "
                    "piece stops)")
    ap.add_argument("--processes", type=int, default=1,
                    help="run up to N arms (or sweep points) at once, each in a process of this same command sharing "
                         "the device; their tokens/s are then measured under that sharing")
    ap.add_argument("--update-doc", default=None,
                    help=f"replace the block between {_DOC_BEGIN} and {_DOC_END} in this file with the summary")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of the arms: the zerokl arm for --steps at every point of the grid below")
    ap.add_argument("--sweep-presets", type=_csv(str), default=None, help="default: --preset")
    ap.add_argument("--sweep-difficulties", type=_csv(str), default=None, help="default: --difficulty")
    ap.add_argument("--sweep-lrs", type=_csv(float), default=None, help="default: --lr")
    # One flag per RLConfig and EngineConfig field the experiment honours, generated (--steps, --prompts,
    # --group, --num-blocks, ...), with the experiment's defaults. Its own flags above: --max-tokens (the
    # default depends on --answers) and --seed (it also seeds the warm start and the problems).
    add_dataclass_arguments(ap.add_argument_group("the RL loop (GRPO steps per arm: raise --steps to extend a "
                                                  "finished run)"), RLConfig, skip=_RL_SKIP, defaults=_RL_DEFAULTS)
    add_dataclass_arguments(ap.add_argument_group("the engine"), EngineConfig, skip=_ENGINE_SKIP,
                            defaults=_ENGINE_DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="zerokl experiment", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    if argv is not None:
        args.argv = list(argv)
    return run(args)


def _with_cell(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the cell's flags applied under the command's own (which come after them, so win)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="zerokl experiment")
    add_arguments(ap)
    own = _argv(args)
    again = ap.parse_args([*CELLS[args.cell][1], *own])
    again.argv = own
    return again


def _grid() -> str:
    """The map's cells as a markdown table: what each varies and its command (the GPU grid's scale)."""
    lines = ["| cell | what it varies | arms | command (GPU grid) |", "|---|---|---|---|"]
    for name, (what, flags) in CELLS.items():
        arms = flags[flags.index("--arms") + 1]
        scale = GPU_SCALE + (GPU_TRACE_SCALE if "trace" in flags else [])
        lines.append(f"| {name} | {what} | {arms} | `zerokl experiment countdown --cell {name} "
                     f"{shlex.join(scale)} --out runs/map/{name} --state-dir runs/map/state` |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- setup

@dataclasses.dataclass(frozen=True)
class Setting:
    """What one arm's numbers depend on (a checkpoint is only resumed under the same setting)."""

    preset: str
    dtype: str
    device: str                     # device type: cpu | cuda
    difficulty: str
    train_problems: int
    start: str
    prompts: int
    group: int
    lr: float
    temperature: float
    max_tokens: int
    seed: int                       # the warm start's, the problems' (and by default the RL seed)
    rl_seed: int                    # prompt order and sampling
    estimator: str                  # losses.ESTIMATORS
    answers: str                    # zerokl.tasks.setup.ANSWERS
    eval_every: int
    eval_prompts: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    correction_cap: float
    sft: tuple = ()                 # (steps, batch, lr, warmup) when start == "sft"


def _setting(args: argparse.Namespace, **override) -> Setting:
    a = {k: getattr(args, k) for k in ("preset", "difficulty", "lr")} | {"rl_seed": args.seed} | override
    start = args.start
    if start == "auto":
        shipped = (a["preset"], args.dtype, a["difficulty"], args.answers) == ("tiny", "float32", "demo", "short")
        start = "shipped" if shipped else "sft"
    train = args.train_problems or (2000 if a["difficulty"] == "easy" else 20000)
    return Setting(preset=a["preset"], dtype=args.dtype, device=torch.device(args.device).type,
                   difficulty=a["difficulty"], train_problems=train, start=start, prompts=args.prompts_per_step,
                   group=args.group_size, lr=a["lr"], temperature=args.temperature,
                   max_tokens=args.max_tokens or ANSWERS[args.answers].max_tokens, seed=args.seed,
                   rl_seed=a["rl_seed"], estimator=args.estimator, answers=args.answers,
                   eval_every=args.eval_every, eval_prompts=args.eval_prompts, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                   correction_cap=args.correction_cap,
                   sft=_sft_recipe(args, a["preset"]) if start == "sft" else ())


def _sft_recipe(args: argparse.Namespace, preset: str) -> tuple:
    """(steps, batch, lr, warmup): the flags, else the preset's recipe."""
    steps, lr = _SFT_RECIPES.get(preset, _SFT_RECIPE)
    return (args.sft_steps or steps, args.sft_batch, args.sft_lr or lr, args.sft_warmup)


def _data(s: Setting, state_dir: pathlib.Path):  # noqa: ANN202
    """(train, test, tokenizer); problem sets are cached in the state folder (20,000 take minutes to draw).

    The test problems are the --eval-prompts the evaluations read (draws are prefix-stable: the first
    k test problems are the same whatever the count drawn; 4-number trace problems are slow to draw)."""
    from zerokl.tokenizer import CountdownTokenizer
    from zerokl.tasks.countdown import Problem
    from zerokl.tasks.setup import countdown_data
    trace = "-trace" if s.answers == "trace" else ""
    n_test = max(1, s.eval_prompts)
    path = state_dir / f"problems-{s.difficulty}{trace}-seed{s.seed}-{s.train_problems}-{n_test}.json"
    if path.exists():
        d = json.loads(path.read_text())
        load = lambda rows: [Problem(tuple(r[0]), r[1], r[2]) for r in rows]  # noqa: E731
        return load(d["train"]), load(d["test"]), CountdownTokenizer()
    train, test, tok = countdown_data(s.seed, s.train_problems, n_test, difficulty=s.difficulty, answers=s.answers)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")        # processes of one run may draw it at once
    tmp.write_text(json.dumps({k: [[list(p.numbers), p.target, p.solution] for p in v]
                               for k, v in (("train", train), ("test", test))}))
    os.replace(tmp, path)
    return train, test, tok


def _task(train, test, tok):  # noqa: ANN001, ANN202
    from zerokl.tasks.countdown import reward
    from zerokl.tasks.setup import encode_prompt
    from zerokl.experiment_state import Task
    return Task(train, test, lambda p: encode_prompt(p, tok), reward)


# ----------------------------------------------------------------------------- SFT warm start

def sft_warm_start(s: Setting, device: torch.device, data, folder: pathlib.Path, budget,  # noqa: ANN001
                   checkpoint_every: int, eval_every: int, eval_prompts: int = 100) -> bool:
    """SFT from the seeded model on solver demonstrations (tools/train_countdown_sft.py's recipe at the
    setting's size, dtype and device) into `folder` (config.json, model.safetensors, sft.json).

    Greedy test accuracy on `eval_prompts` held-out problems every `eval_every` steps and at the
    end (it reads the weights, never changes them). Resumable like an arm (folder/sft-state.pt).
    Returns whether the checkpoint is complete.
    """
    from zerokl.experiment_state import capture_rng, load_state, restore_rng, save_state
    from zerokl.kernels import __version__, fingerprint
    from zerokl.kernels.model import Model
    from zerokl.services.trainer.config import TrainConfig
    from zerokl.services.trainer.trainer import Trainer
    from zerokl.tasks.setup import countdown_config, demonstration_batch, greedy_accuracy
    steps, batch, lr, warmup = s.sft
    recipe = {"preset": s.preset, "dtype": s.dtype, "device": s.device, "difficulty": s.difficulty, "seed": s.seed,
              "train_problems": s.train_problems, "steps": steps, "batch": batch, "lr": lr, "warmup_steps": warmup,
              "answers": s.answers}
    record = folder / "sft.json"
    if record.exists():
        made = json.loads(record.read_text())
        if made["recipe"] != recipe:
            raise SystemExit(f"{folder} holds an SFT checkpoint of another recipe ({made['recipe']}); "
                             "use another --state-dir")
        return True
    train, test, tok = data
    dtype = to_dtype(s.dtype)
    trainer = Trainer(Model(countdown_config(tok, s.preset), seed=s.seed, dtype=dtype).to(device),
                      TrainConfig(lr=lr, warmup_steps=warmup, total_steps=steps, seed=s.seed))
    rng = random.Random(s.seed)
    state_path = folder / "sft-state.pt"
    saved = load_state(state_path)
    step, curve, wall = 0, [], 0.0
    if saved is not None:
        if saved["recipe"] != recipe:
            raise SystemExit(f"{state_path} was made by another SFT recipe; use another --state-dir")
        trainer.load_state_dict(saved["trainer"])
        rng.setstate(saved["loop_rng"])
        restore_rng(saved["rng"])
        step, curve, wall = saved["step"], saved["curve"], saved["wall_s"]
    t_start = time.monotonic()

    def checkpoint() -> None:
        save_state(state_path, {"recipe": recipe, "trainer": trainer.state_dict(), "loop_rng": rng.getstate(),
                                "rng": capture_rng(), "step": step, "curve": curve,
                                "wall_s": wall + time.monotonic() - t_start})

    bar = tqdm(total=steps, initial=step, desc=f"SFT {s.preset} {s.dtype}", unit="step",
               disable=None)  # None: no \r bar interleaved with the step lines when piped
    since = 0
    while step < steps and budget.allows_step():
        t0 = time.monotonic()
        loss = trainer.sft_step(demonstration_batch(rng.sample(train, batch), tok, s.answers))["loss"]
        step += 1
        budget.spent(time.monotonic() - t0)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if step % eval_every == 0 or step == steps:
            acc = greedy_accuracy(_copy(trainer.model), test[:eval_prompts], tok, s.max_tokens)
            curve.append({"step": step, "loss": loss, "test_accuracy": acc})
            tqdm.write(f"SFT step {step} loss {loss:.4f} greedy test accuracy {acc:.2f}")
        since += 1
        if checkpoint_every and since >= checkpoint_every * _SFT_STEPS_PER_RL_STEP and step < steps:
            checkpoint()
            since = 0
    bar.close()
    if step < steps:
        checkpoint()
        return False
    folder.mkdir(parents=True, exist_ok=True)
    _copy(trainer.model).save_pretrained(folder)
    weights = b"".join(p.read_bytes() for p in sorted(folder.glob("*.safetensors")))
    record.write_text(json.dumps({
        "recipe": recipe, "numerics_version": __version__, "numerics_fingerprint": fingerprint(),
        "model.safetensors sha256": hashlib.sha256(weights).hexdigest(),
        "wall_time_s": round(wall + time.monotonic() - t_start), "curve": curve}, indent=2) + "\n")
    state_path.unlink(missing_ok=True)
    return True


def _copy(model):  # noqa: ANN001, ANN202
    """The serving copy of a model without LoRA: Trainer.serving_model's weights without re-running the
    seeded init (tens of CPU seconds for `small`)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def _sft_folder(state_dir: pathlib.Path, s: Setting) -> pathlib.Path:
    trace = "-trace" if s.answers == "trace" else ""
    return state_dir / f"sft-{s.preset}-{s.difficulty}{trace}-{s.dtype}-{s.device}"


def _start_model(s: Setting, device: torch.device, tok, state_dir: pathlib.Path):  # noqa: ANN001, ANN202
    """The arm's starting weights (the warm start must already exist)."""
    from zerokl.tasks.setup import SFT_CHECKPOINT
    from zerokl.kernels.model import Model
    from zerokl.tasks.setup import countdown_config
    dtype = to_dtype(s.dtype)
    if s.start == "scratch":
        return Model(countdown_config(tok, s.preset), seed=s.seed, dtype=dtype).to(device)
    if s.start == "shipped" and (s.preset, s.difficulty, s.answers) != ("tiny", "demo", "short"):
        raise SystemExit("the shipped SFT checkpoint is the tiny model on the demo's problems with short answers: "
                         "use --start sft")
    folder = SFT_CHECKPOINT if s.start == "shipped" else _sft_folder(state_dir, s)
    return Model.from_pretrained(folder, dtype=dtype).to(device)


def _first_part(s: Setting, device: torch.device, state_dir: pathlib.Path, data, backend: str) -> str:  # noqa: ANN001
    """Where the mismatch arm's inference first computes other bits than the trainer, on the start weights."""
    from zerokl.diff import describe, diff_backends
    from zerokl.tasks.setup import encode_prompt
    _, test, tok = data
    try:
        model = _start_model(s, device, tok, state_dir)
        return describe(diff_backends(model, encode_prompt(test[0], tok), backend, NUMERICS["mismatch"].backend))
    except Exception as err:  # noqa: BLE001 - a detail of the report must not cost the run its report
        return f"not computed ({type(err).__name__}: {err})"


# ----------------------------------------------------------------------------- one arm

def run_arm(arm: str, s: Setting, device: torch.device, data, state_dir: pathlib.Path, state_path: pathlib.Path,  # noqa: ANN001
            steps: int, budget, checkpoint_every: int, on_step=None,  # noqa: ANN001
            same_run: pathlib.Path | None = None) -> tuple[list[dict], bool]:
    """Run (or continue) one arm up to `steps` RL steps; returns (metrics lines so far, finished).

    `same_run`: another checkpoint of this very run (the sweep's point at the same setting: the
    zerokl arm's first steps), continued from when `state_path` holds none and its setting matches.
    """
    from zerokl.experiment_state import (ArmEnginePort, ArmState, ArmTrainerPort, capture_rng, load_records,
                                         load_state, restore_rng, run_steps, save_records, save_state)
    from zerokl.kernels.model import Model
    from zerokl.services.trainer.config import TrainConfig
    from zerokl.services.trainer.trainer import Trainer
    from zerokl.tasks.setup import countdown_config
    numerics_name, correction = parse_arm(arm)
    numerics = NUMERICS[numerics_name]
    objective = _objective(s, correction)
    train, test, tok = data
    meta = dataclasses.asdict(s) | {"arm": arm}
    # A finished arm is answered from its records: its checkpoint holds GBs of optimizer state.
    done_meta, done_records = load_records(state_path)
    if done_meta is not None and len(done_records) >= steps and done_meta == json.loads(json.dumps(meta)):
        return done_records[:steps], True
    saved = load_state(state_path)
    if saved is None and same_run is not None:
        saved = load_state(same_run)
        if saved is not None and saved["meta"] != meta:
            saved = None
    if saved is not None and saved["meta"] != meta:
        diff = sorted(k for k in meta if saved["meta"].get(k) != meta[k])
        raise SystemExit(f"{state_path} was made by another setting (differs in {', '.join(diff)}): use another "
                         "--state-dir or remove it")
    if saved is not None and saved["done"] and saved["step"] >= steps:
        # Finished already (the sweep's point may have run every step): record it as this arm's, so a
        # parent process assembling the report from the arms' records finds it.
        save_records(state_path, meta, saved["records"])
        return saved["records"][:steps], True
    if saved is None:
        model = _start_model(s, device, tok, state_dir)
    else:
        model = Model(countdown_config(tok, s.preset), seed=0, dtype=to_dtype(s.dtype)).to(device)
    trainer = Trainer(model.train(), TrainConfig(lr=s.lr, seed=s.seed, dtype=numerics.fp8_trainer))
    rng = random.Random(s.rl_seed)
    state = ArmState(step=0, records=[])
    if saved is not None:
        trainer.load_state_dict(saved["trainer"])
        rng.setstate(saved["loop_rng"])
        restore_rng(saved["rng"])
        state = ArmState(step=saved["step"], records=saved["records"])
    trainer_port = ArmTrainerPort(trainer, run=f"countdown-{arm}", objective=objective,
                                  serve_fp8=numerics.fp8_trainer is not None)
    engine_config = EngineConfig(max_num_batched_tokens=s.max_num_batched_tokens, num_blocks=s.num_blocks,
                                 max_num_seqs=s.max_num_seqs)
    engine = ArmEnginePort(trainer_port, tok, engine_config, backend=numerics.backend,
                           flip_routers=numerics.flip_routers)
    config = RLConfig(steps=steps, prompts_per_step=s.prompts, group_size=s.group, max_tokens=s.max_tokens,
                      temperature=s.temperature, seed=s.rl_seed, eval_every=s.eval_every, eval_prompts=s.eval_prompts)

    def checkpoint() -> None:
        save_state(state_path, {"meta": meta, "trainer": trainer.state_dict(), "loop_rng": rng.getstate(),
                                "rng": capture_rng(), "step": state.step, "records": state.records,
                                "done": state.done})
        save_records(state_path, meta, state.records)

    def each(record: dict) -> None:
        record["arm"], record["seed"] = arm, s.rl_seed
        if numerics.exact and (record["kl"] != 0.0 or record["mismatched_tokens"] != 0):
            # The contract, checked at every step of every zerokl arm: a broken one stops the run.
            raise RuntimeError(f"arm {arm} step {record['step']}: KL {record['kl']!r} and "
                               f"{record['mismatched_tokens']} mismatched tokens; a zerokl arm must have KL 0.0 and none")
        if on_step:
            on_step(record)

    run_steps(steps, state, rng, _task(train, test, tok), engine, trainer_port, config, budget, checkpoint,
              checkpoint_every, each)
    return state.records, state.done


def _objective(s: Setting, correction: str) -> PolicyObjective:
    """The arm's estimator and correction; an impossible pair (gspo with a token-level weight) named."""
    try:
        return PolicyObjective(estimator=s.estimator, correction=correction, cap=s.correction_cap)
    except ValueError as err:
        raise SystemExit(f"--estimator {s.estimator} with the {correction} correction: {err}") from None


# ----------------------------------------------------------------------------- statistics and report

def trend(rewards: list[float], window: int | None = None) -> dict:
    """Reward rise from the first to the last `window` steps (default a quarter of the run), the
    step-to-step noise (std of consecutive differences / sqrt 2: a slow trend does not inflate it),
    the rise's standard error under that noise, and t = rise / s.e."""
    n = len(rewards)
    if n < 2:
        return {"first": rewards[0] if rewards else float("nan"), "last": rewards[-1] if rewards else float("nan"),
                "rise": 0.0, "noise": float("nan"), "se": float("nan"), "t": float("nan"), "window": n}
    w = window or max(1, n // 4)
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    d = [b - a for a, b in zip(rewards, rewards[1:])]
    mean_d = sum(d) / len(d)
    noise = math.sqrt(sum((x - mean_d) ** 2 for x in d) / max(1, len(d) - 1) / 2) if len(d) > 1 else float("nan")
    se = noise * math.sqrt(2 / w)
    return {"first": first, "last": last, "rise": last - first, "noise": noise, "se": se,
            "t": (last - first) / se if se > 0 else float("nan"), "window": w}


def _summary_rows(arms: dict[str, list[dict]], steps: int) -> list[str]:
    """One row per unit (arm, or arm and seed): the contract, the mismatch, the outcome."""
    rows = ["| arm | steps | KL per step: max abs (mean) | mismatched tokens | clip fraction: mean (max) | "
            "importance ratio range | reward: first → last quarter (rise ± s.e.; step noise) | greedy test accuracy "
            "| rollout tok/s | train tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, rs in arms.items():
        if not rs:
            rows.append(f"| {arm} | 0 / {steps} | | | | | | | | |")
            continue
        kls = [r["kl"] for r in rs]
        mis, tok = sum(r["mismatched_tokens"] for r in rs), sum(r["tokens"] for r in rs)
        clips = [r["clip_fraction"] for r in rs]
        t = trend([r["reward"] for r in rs])
        accs = [r["test_accuracy"] for r in rs if r.get("test_accuracy") is not None]
        acc = f"{accs[0]:.3f} → {accs[-1]:.3f}" if accs else "-"
        kl = "**0.0 at every step**" if all(k == 0.0 for k in kls) else \
            f"{max(abs(k) for k in kls):.3g} ({sum(kls) / len(kls):.3g})"
        clip = f"{sum(clips) / len(clips):.4f} ({max(clips):.4f})"
        if "correction_dropped_fraction" in rs[0]:
            drop = [r["correction_dropped_fraction"] for r in rs]
            disc = [r["correction_discarded_weight"] for r in rs]
            bclip = [r["behaviour_clip_fraction"] for r in rs]
            clip += (f"; outside [1-ε, 1+ε] vs inference {sum(bclip) / len(bclip):.4f}; correction dropped "
                     f"{sum(drop) / len(drop):.4f} of tokens, discarded weight {sum(disc) / len(disc):.4f} "
                     f"(max {max(disc):.4f})")
        rows.append(
            f"| {arm} | {len(rs)} / {steps} | {kl} | {mis:,} of {tok:,} ({mis / max(1, tok):.1%}) | {clip} | "
            f"[{min(r['ratio_min'] for r in rs):.7g}, {max(r['ratio_max'] for r in rs):.7g}] | "
            f"{t['first']:.3f} → {t['last']:.3f} ({t['rise']:+.3f} ± {t['se']:.3f}; {t['noise']:.3f}) | {acc} | "
            f"{_median([r['rollout_tokens_per_s'] for r in rs]):,.0f} | {_median([r['tokens_per_s'] for r in rs]):,.0f} |")
    return rows


def _stability_rows(arms: dict[str, list[dict]]) -> list[str]:
    """One row per unit: the telemetry that shows a collapse early (the objective's, and the router's flips)."""
    rows = ["| arm | grad norm: median (max) | entropy: first → last step | max abs log ratio: median (max) | "
            "low-probability tokens (p < 1e-3): mean | router decisions flipped (rows with a flip) | mean answer "
            "tokens |", "|---|---|---|---|---|---|---|"]
    for arm, rs in arms.items():
        rs = [r for r in rs if "entropy" in r]
        if not rs:
            continue
        g, lr = [r["grad_norm"] for r in rs], [r["max_abs_log_ratio"] for r in rs]
        flips = [r for r in rs if "router_flip_fraction" in r]
        flip = "-" if not flips else (f"{sum(r['router_flip_fraction'] for r in flips) / len(flips):.2%} "
                                      f"({sum(r['router_flip_row_fraction'] for r in flips) / len(flips):.2%})")
        samples = sum(r.get("samples", 0) for r in rs)
        answer = f"{sum(r['rollout_tokens'] for r in rs) / samples:.0f}" if samples else "-"
        rows.append(f"| {arm} | {_median(g):.4g} ({max(g):.4g}) | {rs[0]['entropy']:.4f} → {rs[-1]['entropy']:.4f} | "
                    f"{_median(lr):.3g} ({max(lr):.3g}) | {sum(r['low_prob_fraction'] for r in rs) / len(rs):.4f} | "
                    f"{flip} | {answer} |")
    return rows


def _partner(arm: str) -> str:
    """The zerokl arm a mismatched arm pairs with (same seeds): zerokl-fp8 for FP8 rollouts."""
    return "zerokl-fp8" if parse_arm(arm)[0].endswith("fp8") else "zerokl"


def _mean_se(xs: list[float], single_se: float = float("nan")) -> tuple[float, float]:
    """(mean, standard error): std / √n over several values; `single_se` for one."""
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, single_se
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _arm_stats(records: list[dict], eval_prompts: int | None = None) -> dict[str, dict]:
    """Per arm of a run's metrics lines, as (mean, s.e.) over its seeds: the reward rise, the final reward (mean
    of the last quarter of steps), the last greedy test accuracy and the largest grad norm; and over every seed
    and step: the largest |KL| of a step, the mismatched-token share, the largest |log ratio|, mean |KL|, the
    entropy of the first step and of the last quarter, the low-probability share, router flips and the tokens
    a correction dropped. "diff": its reward rise minus its zerokl partner's on the same seeds (None for a
    zerokl arm). With one seed an s.e. is the run's own: the rise's under the step-to-step noise (trend), the
    final reward's from the spread of the last quarter's steps, the test accuracy's binomial over
    `eval_prompts` problems; the difference's combines both arms' (as if independent: the pair shares its
    samples until they part, so this overstates it)."""
    by_arm: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {}).setdefault(r.get("seed", 0), []).append(r)
    trends = {arm: {k: trend([r["reward"] for r in rs]) for k, rs in seeds.items()} for arm, seeds in by_arm.items()}
    stats: dict[str, dict] = {}
    for arm, seeds in by_arm.items():
        t = trends[arm]
        runs = list(seeds.values())
        every = [r for rs in runs for r in rs]
        accs = [[r["test_accuracy"] for r in rs if r.get("test_accuracy") is not None] for rs in runs]
        lasts = [[r["reward"] for r in rs[-max(1, len(rs) // 4):]] for rs in runs]
        acc = _mean_se([a[-1] for a in accs if a])
        if eval_prompts and len([a for a in accs if a]) == 1:
            acc = (acc[0], math.sqrt(acc[0] * (1 - acc[0]) / eval_prompts))
        mis, tok = sum(r["mismatched_tokens"] for r in every), sum(r["tokens"] for r in every)
        telemetry = [r for r in every if "entropy" in r]
        stats[arm] = {
            "seeds": sorted(seeds), "steps": min(len(rs) for rs in runs),
            "rise": _mean_se([x["rise"] for x in t.values()], next(iter(t.values()))["se"]),
            "final": _mean_se([sum(x) / len(x) for x in lasts], _mean_se(lasts[0])[1]),
            "acc": acc,
            "grad": _mean_se([max(r["grad_norm"] for r in rs) for rs in runs]),
            "max_kl": max(abs(r["kl"]) for r in every),
            "exact": all(r["kl"] == 0.0 and r["mismatched_tokens"] == 0 for r in every),
            "mismatched": (mis, tok),
            "log_ratio": max(r.get("max_abs_log_ratio", 0.0) for r in every),
            "abs_kl": sum(abs(r["kl"]) for r in every) / len(every),
            "entropy": (_mean_se([rs[0]["entropy"] for rs in runs if "entropy" in rs[0]])[0],
                        _mean_se([r["entropy"] for rs in runs for r in rs[-max(1, len(rs) // 4):]
                                  if "entropy" in r])[0]),
            "low_prob": _mean_se([r["low_prob_fraction"] for r in telemetry])[0] if telemetry else float("nan"),
            "flips": _mean_se([r["router_flip_fraction"] for r in every if "router_flip_fraction" in r]),
            "dropped": _mean_se([r["correction_dropped_fraction"] for r in every
                                 if "correction_dropped_fraction" in r])[0],
            "diff": None}
    for arm in stats:
        z = _partner(arm)
        if arm == z or z not in trends:
            continue
        common = sorted(set(trends[arm]) & set(trends[z]))
        if common:
            single = math.hypot(trends[arm][common[0]]["se"], trends[z][common[0]]["se"])
            stats[arm]["diff"] = _mean_se([trends[arm][k]["rise"] - trends[z][k]["rise"] for k in common], single)
    return stats


def _pm(x: tuple[float, float], fmt: str = "+.3f") -> str:
    """"mean ± s.e." ("-" without a mean; the mean alone without an s.e.)."""
    if math.isnan(x[0]):
        return "-"
    return f"{x[0]:{fmt}}" if math.isnan(x[1]) else f"{x[0]:{fmt}} ± {x[1]:.3f}"


def _seed_rows(arms: dict[str, list[dict]]) -> list[str]:
    """With several RL seeds: per arm, the mean over seeds ± its standard error (std / √seeds) of the
    reward rise, the last greedy test accuracy and the largest gradient norm; and each arm's
    difference to its zerokl partner (same seeds) with the s.e. of that difference."""
    stats = _arm_stats([r for rs in arms.values() for r in rs])
    if not any(len(st["seeds"]) > 1 for st in stats.values()):
        return []
    rows = ["| arm | seeds | reward rise (mean ± s.e. over seeds) | last greedy test accuracy | largest grad norm | "
            "reward rise minus the zerokl partner's (same seeds) |", "|---|---|---|---|---|---|"]
    for arm, st in stats.items():
        rows.append(f"| {arm} | {len(st['seeds'])} | {_pm(st['rise'])} | {_pm(st['acc'])} | {_pm(st['grad'])} | "
                    f"{'-' if st['diff'] is None else _pm(st['diff'])} |")
    return rows


def _verdict(diff: tuple[float, float]) -> str:
    """Whether the mismatched arm's reward rise differs from its zerokl partner's beyond 2 s.e., and by how much."""
    m, se = diff
    if math.isnan(se) or se == 0:
        return "not measurable (one step or no noise)"
    if m <= -2 * se:
        return f"**yes**: the rise is lower by {-m:.3f} ({-m / se:.1f} s.e.)"
    if m >= 2 * se:
        return f"no: the rise is higher by {m:.3f} ({m / se:.1f} s.e.)"
    return "no difference beyond 2 s.e."


#: The map's telemetry figure: (metrics key, panel title), a column each, a row per cell.
_MAP_PANELS = [("test_accuracy", "greedy test accuracy"), ("grad_norm", "gradient norm (before clipping)"),
               ("entropy", "entropy"), ("max_abs_log_ratio", "max |log ratio| trainer vs rollout"),
               ("low_prob_fraction", "share of tokens with p < 1e-3")]


def _cell_run(folder: pathlib.Path) -> tuple[list[dict], dict]:
    """A cell's metrics lines and its run.json ({} when absent)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    run = folder / "run.json"
    return records, json.loads(run.read_text()) if run.exists() else {}


def write_map(folder: pathlib.Path) -> str:
    """The map from the cells run into FOLDER/CELL (each cell's --out: metrics.jsonl, run.json); returns map.md.

    FOLDER/map.md holds two tables ready for docs/rl.md: the outcome (a row per mismatched arm of each cell
    against its zerokl partner on the same seeds: final reward and greedy test accuracy of both, the
    difference of their reward rises ± s.e., a verdict against 2 s.e.) and the stability telemetry (a row per
    arm, the zerokl arms included: the contract's KL and mismatched tokens, grad norm, entropy, max |log ratio|,
    low-probability share, router flips, what a correction dropped); cells not run are listed as such.
    FOLDER/map.png: each cell's reward per step and arm (mean over seeds; a band of ± s.e. with several);
    FOLDER/map-telemetry.png: a row per cell run, a column per _MAP_PANELS entry."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    outcome = ["| cell | arm (vs its zerokl partner) | seeds × steps | final reward: partner / arm | greedy test "
               "accuracy: partner / arm | reward rise: partner / arm | difference (arm − partner) | does the "
               "mismatch hurt? |", "|---|---|---|---|---|---|---|---|"]
    telemetry = ["| cell | arm | KL: largest abs of a step | mismatched tokens | max abs log ratio | largest grad "
                 "norm | entropy: first step → last quarter | tokens with p < 1e-3 | router decisions flipped | "
                 "dropped by the correction |", "|---|---|---|---|---|---|---|---|---|---|"]
    runs: dict[str, tuple[list[dict], dict]] = {}
    for cell in CELLS:
        if not (folder / cell / "metrics.jsonl").exists():
            outcome.append(f"| {cell} | not run | | | | | | |")
            continue
        records, run = runs[cell] = _cell_run(folder / cell)
        stats = _arm_stats(records, run.get("setting", {}).get("eval_prompts"))
        status = "" if run.get("complete", True) else " (incomplete)"
        for arm, st in stats.items():
            zerokl = stats.get(_partner(arm))
            if st["diff"] is None or zerokl is None:
                continue
            outcome.append(f"| {cell}{status} | {arm} | {len(st['seeds'])} × {st['steps']} | "
                           f"{_pm(zerokl['final'], '.3f')} / {_pm(st['final'], '.3f')} | "
                           f"{_pm(zerokl['acc'], '.3f')} / {_pm(st['acc'], '.3f')} | "
                           f"{_pm(zerokl['rise'])} / {_pm(st['rise'])} | {_pm(st['diff'])} | {_verdict(st['diff'])} |")
        for arm, st in stats.items():
            mis, tok = st["mismatched"]
            kl = "**0.0 at every step**" if st["exact"] else f"{st['max_kl']:.3g}"
            flips = "-" if math.isnan(st["flips"][0]) else f"{st['flips'][0]:.2%}"
            dropped = "-" if math.isnan(st["dropped"]) else f"{st['dropped']:.2%}"
            low = "-" if math.isnan(st["low_prob"]) else f"{st['low_prob']:.2%}"
            telemetry.append(f"| {cell} | {arm} | {kl} | {mis:,} of {tok:,} ({mis / max(1, tok):.1%}) | "
                             f"{st['log_ratio']:.3g} | {_pm(st['grad'], '.3g')} | {st['entropy'][0]:.3f} → "
                             f"{st['entropy'][1]:.3f} | {low} | {flips} | {dropped} |")
    lines = ["# The map: where train/inference mismatch bites (zerokl experiment countdown --map)", "",
             "Each outcome row: a mismatched arm of a cell against its zerokl partner, from the same warm start with "
             "the same seeds. Final reward: the mean of the last quarter of steps; reward rise: that minus the "
             "first quarter's. ± is the standard error over seeds; with one seed, the run's own (final reward: the "
             "spread of the last quarter's steps; test accuracy: binomial over the evaluation problems; rise: the "
             "step-to-step noise). The verdict compares the difference of the rises with 2 s.e.", "", *outcome, "",
             "Stability telemetry (every step of every seed; a zerokl arm must show KL 0.0 and no mismatched token):",
             "", *telemetry]
    folder.mkdir(parents=True, exist_ok=True)
    if runs:
        _plot_map(runs, folder, plt)
        lines += ["", "![reward per cell](map.png)", "", "![telemetry per cell](map-telemetry.png)"]
    text = "\n".join(lines) + "\n"
    (folder / "map.md").write_text(text)
    return text


def _per_step(records: list[dict], key: str) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """arm -> (steps, mean over seeds, s.e. over seeds (0 with one)) of `key` where recorded."""
    by: dict[str, dict[int, list[float]]] = {}
    for r in records:
        if r.get(key) is not None:
            by.setdefault(r["arm"], {}).setdefault(r["step"], []).append(r[key])
    out = {}
    for arm, steps in by.items():
        xs = sorted(steps)
        ms = [_mean_se(steps[x], 0.0) for x in xs]
        out[arm] = (xs, [m for m, _ in ms], [se for _, se in ms])
    return out


def _plot_map(runs: dict[str, tuple[list[dict], dict]], folder: pathlib.Path, plt) -> None:  # noqa: ANN001
    """map.png (reward per cell) and map-telemetry.png (a row per cell); an arm keeps its colour everywhere."""
    names = list(dict.fromkeys(r["arm"] for records, _ in runs.values() for r in records))
    colors = {a: f"C{i % 10}" for i, a in enumerate(names)}
    n = len(runs)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax, (cell, (records, _)) in zip(axes.flat, runs.items()):
        for arm, (xs, ms, ses) in _per_step(records, "reward").items():
            ax.plot(xs, ms, label=arm, lw=1, color=colors[arm])
            if any(ses):
                ax.fill_between(xs, [m - s for m, s in zip(ms, ses)], [m + s for m, s in zip(ms, ses)],
                                color=colors[arm], alpha=0.15, lw=0)
        ax.set_title(cell, fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean reward (over seeds)")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(folder / "map.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(n, len(_MAP_PANELS), figsize=(3.6 * len(_MAP_PANELS), 2.6 * n), squeeze=False)
    for row, (cell, (records, _)) in zip(axes, runs.items()):
        for ax, (key, label) in zip(row, _MAP_PANELS):
            for arm, (xs, ms, _) in _per_step(records, key).items():
                ax.plot(xs, ms, label=arm, lw=1, color=colors[arm], marker="o" if key == "test_accuracy" else None,
                        ms=2)
            if key in ("grad_norm", "max_abs_log_ratio") and ax.lines and all(
                    min(line.get_ydata()) > 0 for line in ax.lines):
                ax.set_yscale("log")
            ax.set_title(f"{cell}: {label}", fontsize=8)
            ax.tick_params(labelsize=7)
        row[0].legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("RL step")
    fig.tight_layout()
    fig.savefig(folder / "map-telemetry.png", dpi=80)
    plt.close(fig)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


#: The report's plot: (metrics key, panel title); reward and accuracy, the mismatch, then the stability telemetry.
_PANELS = [("reward", "mean reward"), ("test_accuracy", "greedy test accuracy"),
           ("kl", "train/inference KL (exact)"), ("mismatched_fraction", "mismatched-token fraction"),
           ("grad_norm", "gradient norm (before clipping)"), ("entropy", "entropy of the trainer's distribution"),
           ("max_abs_log_ratio", "max |log ratio| trainer vs rollout"),
           ("low_prob_fraction", "share of sampled tokens with p < 1e-3"),
           ("clip_fraction", "clip fraction"), ("ratio_min", "importance ratio min / max"),
           ("router_flip_fraction", "router decisions flipped"),
           ("correction_dropped_fraction", "tokens dropped or truncated by the correction")]


def _plot(arms: dict[str, list[dict]], out: pathlib.Path, title: str) -> str:
    """experiment.png: a panel per _PANELS entry, a colour per arm, a line style per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 4, figsize=(20, 11))
    names = list(dict.fromkeys(r["arm"] for rs in arms.values() for r in rs[:1]))
    colors = {a: f"C{i % 10}" for i, a in enumerate(names)}
    seeds = sorted({r.get("seed", 0) for rs in arms.values() for r in rs[:1]})
    styles = {k: ("-", "--", ":", "-.")[i % 4] for i, k in enumerate(seeds)}
    for ax, (key, label) in zip(axes.flat, _PANELS, strict=True):
        for unit, records in arms.items():
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if not pts:
                continue
            arm, seed = records[0]["arm"], records[0].get("seed", 0)
            kw = {"color": colors[arm], "linestyle": styles[seed], "marker": "o", "ms": 2}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=unit, **kw)
            if key == "ratio_min":
                ax.plot([r["step"] for r in records], [r["ratio_max"] for r in records], **kw)
        if key in ("grad_norm", "max_abs_log_ratio") and ax.lines and all(
                min(line.get_ydata()) > 0 for line in ax.lines):
            ax.set_yscale("log")
        ax.set_xlabel("RL step")
        ax.set_title(label, fontsize=9)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "experiment.png", dpi=100)
    plt.close(fig)
    return "experiment.png"


def write_report(arms: dict[str, list[dict]], out: pathlib.Path, header: dict, steps: int) -> list[str]:
    """metrics.jsonl (one line per unit and step, with "arm" and "seed"), experiment.png and report.md
    (summary, stability telemetry, with several seeds their mean ± s.e., every step); returns the summary table."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for records in arms.values():
            for r in records:
                f.write(json.dumps(r) + "\n")
    title = f"countdown RL, {header['model']}: zerokl numerics vs mismatched inference"
    plot = _plot(arms, out, title)
    rows = _summary_rows(arms, steps)
    lines = [f"# zerokl experiment countdown ({header['model']})", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()] + ["", *rows, ""]
    stability = _stability_rows(arms)
    if len(stability) > 2:
        lines += ["Stability telemetry (what shows a collapse early):", "", *stability, ""]
    seeds = _seed_rows(arms)
    if seeds:
        lines += ["Over RL seeds (mean ± standard error; the pair shares each seed):", "", *seeds, ""]
    lines += [f"Published, without aligned numerics (GLM countdown run): KL ≈ {PUBLISHED['kl']}, "
              f"≈ {PUBLISHED['clip_fraction']:.0%} of tokens clipped. Reward rise: mean of the last quarter of steps "
              "minus the first; s.e. from the step-to-step noise (std of consecutive differences / √2).", ""]
    names = list(arms)
    keys = [("reward", ".3f"), ("kl", ".3g"), ("mismatched_fraction", ".3f"), ("clip_fraction", ".4f"),
            ("grad_norm", ".4g"), ("entropy", ".4f"), ("max_abs_log_ratio", ".3g")]
    lines += ["| step | " + " | ".join(f"{k} {a}" for k, _ in keys for a in names) + " | test acc |",
              "|---|" + "---|" * (len(keys) * len(names) + 1)]
    for i in range(max((len(v) for v in arms.values()), default=0)):
        cells, accs = [], []
        for k, fmt in keys:
            for a in names:
                r = arms[a][i] if i < len(arms[a]) else None
                v = None if r is None else r.get(k)
                cells.append("" if v is None else (repr(v) if k == "kl" and v == 0.0 else format(v, fmt)))
        for a in names:
            r = arms[a][i] if i < len(arms[a]) else None
            if r is not None and r.get("test_accuracy") is not None:
                accs.append(f"{a} {r['test_accuracy']:.3f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + f" | {', '.join(accs)} |")
    lines += ["", f"![{plot}]({plot})"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return rows


def _update_doc(path: pathlib.Path, rows: list[str], header: dict) -> None:
    text = path.read_text()
    if _DOC_BEGIN not in text or _DOC_END not in text:
        raise SystemExit(f"{path} has no {_DOC_BEGIN} ... {_DOC_END} block")
    head, rest = text.split(_DOC_BEGIN, 1)
    _, tail = rest.split(_DOC_END, 1)
    block = [f"{k}: {v}" for k, v in header.items()]
    path.write_text(head + _DOC_BEGIN + "\n" + "\n".join(["<!-- written by zerokl experiment --update-doc -->",
                                                          "; ".join(block) + ".", "", *rows]) + "\n" + _DOC_END + tail)


# ----------------------------------------------------------------------------- the command

def _budget(args: argparse.Namespace):  # noqa: ANN202
    from zerokl.experiment_state import Budget
    return Budget(max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
                  max_steps=args.max_steps_this_run)


def _step_printer(arm: str, total: int):  # noqa: ANN202
    def on_step(r: dict) -> None:
        acc = "" if r.get("test_accuracy") is None else f" test_acc {r['test_accuracy']:.3f}"
        corr = ("" if "correction_dropped_fraction" not in r else
                f" dropped {r['correction_dropped_fraction']:.4f} discarded {r['correction_discarded_weight']:.4f}")
        flips = "" if "router_flip_fraction" not in r else f" router_flips {r['router_flip_fraction']:.4f}"
        print(f"[{arm}] step {r['step']:3d}/{total} reward {r['reward']:.3f} kl {r['kl']!r} mismatched "
              f"{r['mismatched_tokens']}/{r['tokens']} clip {r['clip_fraction']:.4f} ratio [{r['ratio_min']:.7g}, "
              f"{r['ratio_max']:.7g}] grad_norm {r['grad_norm']:.4g} entropy {r.get('entropy', float('nan')):.4f} "
              f"max|logratio| {r.get('max_abs_log_ratio', float('nan')):.3g} low_p "
              f"{r.get('low_prob_fraction', float('nan')):.4f}{corr}{flips}{acc} rollout "
              f"{r['rollout_tokens_per_s']:.0f} tok/s train {r['tokens_per_s']:.0f} tok/s", flush=True)
    return on_step


def _prepare(s: Setting, device: torch.device, state_dir: pathlib.Path, budget, args) -> tuple | None:  # noqa: ANN001
    """Data and warm start for setting `s`; None when the budget ran out during SFT."""
    data = _data(s, state_dir)
    if s.start == "sft":
        folder = _sft_folder(state_dir, s)
        with _locked(folder.with_name(folder.name + ".lock")):     # processes of one run share the warm start
            if not sft_warm_start(s, device, data, folder, budget, args.checkpoint_every, args.sft_eval_every,
                                  args.eval_prompts):
                return None
    return data


@contextlib.contextmanager
def _locked(path: pathlib.Path):  # noqa: ANN202
    """An exclusive lock on `path` across processes (released when the holder exits, however it exits)."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(args: argparse.Namespace) -> int:
    """Run (or continue) the experiment; 0 when every arm is done, INCOMPLETE (75) when work is left."""
    from zerokl.experiment_state import load_records
    from zerokl.kernels import __version__, fingerprint
    from zerokl.kernels.backend import get_backend
    if args.grid:
        print(_grid())
        return 0
    if args.map:
        print(write_map(pathlib.Path(args.map)))
        return 0
    if args.cell:
        args = _with_cell(args)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    elif device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    out = pathlib.Path(args.out)
    state_dir = pathlib.Path(args.state_dir) if args.state_dir else out / "state"
    budget = _budget(args)
    command = "zerokl experiment " + shlex.join(_argv(args))
    if args.processes < 1:
        raise SystemExit(f"--processes must be at least 1, got {args.processes}")
    if args.sweep:
        return _sweep(args, device, out, state_dir, budget, command)
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {', '.join(bad)}: expected {', '.join(ARMS)}")
    s = _setting(args)
    for arm in args.arms:                           # an impossible estimator/correction pair fails before any work
        _objective(s, parse_arm(arm)[1])
    # One unit per arm and RL seed: (its name, the arm, the seed); named by the arm alone without --seeds.
    units = [(arm if args.seeds is None else f"{arm}-seed{k}", arm, k)
             for arm in args.arms for k in (args.seeds or [args.seed])]
    t0 = time.monotonic()
    data = _prepare(s, device, state_dir, budget, args)
    arms: dict[str, list[dict]] = {name: [] for name, _, _ in units}
    complete = data is not None
    failed = []
    if data is not None and args.processes > 1 and len(units) > 1:
        complete, failed = _fan_out(args, budget, state_dir, [
            (name, ["--arms", arm, *([] if args.seeds is None else ["--seeds", str(k)])]) for name, arm, k in units])
    elif data is not None:
        for name, arm, k in units:
            su = _setting(args, rl_seed=k)
            records, done = run_arm(arm, su, device, data, state_dir, _arm_path(args, state_dir, name), args.steps,
                                    budget, args.checkpoint_every, _step_printer(name, args.steps),
                                    same_run=_sweep_path(state_dir, su) if arm == "zerokl" else None)
            arms[name] = records
            if not done:
                complete = False
                break
    for name in arms:                               # units not run in this process: what their checkpoints hold
        if not arms[name]:
            arms[name] = load_records(_arm_path(args, state_dir, name))[1][: args.steps]
    if s.start == "sft":
        start = f"SFT on {device.type}, {s.sft[0]} steps × {s.sft[1]} demonstrations, lr {s.sft[2]}"
    else:
        start = {"shipped": "the shipped tiny SFT checkpoint (zerokl/assets/countdown-sft)",
                 "scratch": "the seeded model, no SFT"}[s.start]
    sft_record = _sft_folder(state_dir, s) / "sft.json"
    if s.start == "sft" and sft_record.exists():
        sft = json.loads(sft_record.read_text())
        out.mkdir(parents=True, exist_ok=True)
        (out / "sft.json").write_text(sft_record.read_text())
        if sft["curve"]:
            start += f" (greedy test accuracy {sft['curve'][-1]['test_accuracy']:.2f}, {sft['wall_time_s']} s)"
    backend = get_backend()
    used = {parse_arm(a)[0] for a in args.arms}
    first_part = (_first_part(s, device, state_dir, data, backend)
                  if data is not None and any(NUMERICS[n].backend == "stock" for n in used) else None)
    header = {"model": f"{s.preset}, {s.dtype}, {device.type}",
              "status": "complete" if complete else "INCOMPLETE: run the same command again to continue",
              "command": f"`{command}`", "numerics": f"{__version__} fingerprint {fingerprint()}",
              **({"cell": f"{args.cell}: {CELLS[args.cell][0]}"} if args.cell else {}),
              "estimator": s.estimator, "answers": f"{s.answers} (at most {s.max_tokens} tokens)",
              "trainer and zerokl-arm inference backend": backend,
              **({"mismatch-arm inference backend": "stock"} if "mismatch" in used else {}),
              **({"mismatch-router arm": "the trainer's kernels except the MoE routers' logits, computed from bf16 "
                  "input and weights; a token keeps the exact route unless its expert set flips"}
                 if "mismatch-router" in used else {}),
              **({"FP8 arms (e4m3 projections, bf16 activations)": "zerokl-fp8 samples in FP8 and trains on the same "
                  "FP8 forward; mismatch-fp8 samples in FP8 (the trainer's weights quantized at load) and trains "
                  f"in bf16; both on the {backend} backend"} if used & {"zerokl-fp8", "mismatch-fp8"} else {}),
              **({"correction cap C": s.correction_cap} if any(parse_arm(a)[1] != "none" for a in args.arms) else {}),
              "start": start, "problems": f"{s.difficulty} ({s.train_problems} train)",
              "steps per arm": args.steps, "samples per step": f"{s.prompts} prompts × {s.group}",
              "learning rate": s.lr, "seed": s.seed,
              **({"RL seeds": ", ".join(map(str, args.seeds))} if args.seeds else {}),
              "wall time of this piece (s)": f"{time.monotonic() - t0:.0f}"}
    if args.processes > 1:
        header["arms at once"] = (f"up to {args.processes}, one process each, sharing the {device.type} device "
                                  "(tokens/s are measured under that sharing)")
    if first_part is not None:
        header["where the stock path first parts (zerokl diff, first test prompt)"] = first_part
    rows = write_report(arms, out, header, args.steps)
    (out / "run.json").write_text(json.dumps({"command": command, "setting": dataclasses.asdict(s),
                                              "arms": args.arms, "seeds": args.seeds or [args.seed],
                                              "steps": args.steps, "complete": complete},
                                             indent=2) + "\n")
    if args.update_doc:
        _update_doc(pathlib.Path(args.update_doc), rows, {k: header[k] for k in
                                                          ("model", "status", "command", "numerics", "start")})
    return _exit_status(complete, failed, out / "report.md")


def _arm_path(args: argparse.Namespace, state_dir: pathlib.Path, unit: str) -> pathlib.Path:
    """A unit's checkpoint: STATE/arm-UNIT.pt, or a cell's STATE/cells/CELL/arm-UNIT.pt (cells share a
    state folder's warm starts and problems, not their arms)."""
    return (state_dir / "cells" / args.cell if args.cell else state_dir) / f"arm-{unit}.pt"


# ----------------------------------------------------------------------------- processes

def _argv(args: argparse.Namespace) -> list[str]:
    """The command's own arguments (after `zerokl experiment`)."""
    if getattr(args, "argv", None) is not None:
        return args.argv
    return sys.argv[2:] if sys.argv[1:2] == ["experiment"] else sys.argv[1:]


def _fan_out(args: argparse.Namespace, budget, state_dir: pathlib.Path,  # noqa: ANN001
             units: list[tuple[str, list[str]]]) -> tuple[bool, list[str]]:
    """Run each unit (name, flags that narrow the command to it) as a process of this same command,
    up to --processes at once; returns (every unit complete, "name (exit N)" of each that failed).

    A unit's flags come last, so they override the command's (argparse keeps the last value). Each
    gets the time this invocation has left when it starts, writes its checkpoint where this one
    would, and its report under STATE/parts/NAME: the caller assembles the report from the
    checkpoints. Units of one SFT warm start wait for it on its lock.
    """
    def one(unit: tuple[str, list[str]]) -> tuple[str, int]:
        name, flags = unit
        common = ["--processes", "1", "--update-doc", "", "--out", str(state_dir / "parts" / name),
                  "--state-dir", str(state_dir)]
        if args.max_minutes is not None:
            left = args.max_minutes - (time.monotonic() - budget.start) / 60
            common += ["--max-minutes", f"{max(left, 0.0):.4f}"]
        if args.max_steps_this_run is not None:
            common += ["--max-steps-this-run", str(max(0, args.max_steps_this_run - budget.steps))]
        cmd = [sys.executable, "-m", "zerokl", "experiment", *_argv(args), *common, *flags]
        return name, subprocess.run(cmd, check=False).returncode

    with ThreadPoolExecutor(max_workers=args.processes) as pool:
        codes = dict(pool.map(one, units))
    return (all(c == 0 for c in codes.values()),
            [f"{name} (exit {c})" for name, c in codes.items() if c not in (0, INCOMPLETE)])


def _exit_status(complete: bool, failed: list[str], report: pathlib.Path) -> int:
    """Say how the invocation ended; 1 if a process failed, else 0 or INCOMPLETE."""
    if failed:
        print(f"failed: {', '.join(failed)} (their output is above); {report.stem}: {report}", flush=True)
        return 1
    print(f"{'complete' if complete else 'INCOMPLETE (exit 75): run the same command again'}; "
          f"{report.stem}: {report}", flush=True)
    return 0 if complete else INCOMPLETE


# ----------------------------------------------------------------------------- the sweep

def _sweep(args: argparse.Namespace, device: torch.device, out: pathlib.Path, state_dir: pathlib.Path, budget,  # noqa: ANN001
           command: str) -> int:
    """The zerokl arm at every (preset, difficulty, lr) of the grid; sweep.md ranks the points by t."""
    from zerokl.experiment_state import load_records
    grid = list(itertools.product(args.sweep_presets or [args.preset], args.sweep_difficulties or [args.difficulty],
                                  args.sweep_lrs or [args.lr]))
    settings = [_setting(args, preset=preset, difficulty=difficulty, lr=lr) for preset, difficulty, lr in grid]
    results, complete, failed = [], True, []
    if args.processes > 1 and len(settings) > 1:
        complete, failed = _fan_out(args, budget, state_dir, [
            (_point_name(s), ["--sweep-presets", s.preset, "--sweep-difficulties", s.difficulty,
                              "--sweep-lrs", repr(s.lr)]) for s in settings])
        for s in settings:
            results.append((_point_name(s), s, load_records(_sweep_path(state_dir, s))[1][: args.steps]))
    else:
        for s in settings:
            name = _point_name(s)
            data = _prepare(s, device, state_dir, budget, args) if complete else None
            records, done = [], False
            if data is not None:
                records, done = run_arm("zerokl", s, device, data, state_dir, _sweep_path(state_dir, s),
                                        args.steps, budget, args.checkpoint_every, _step_printer(name, args.steps))
            complete = complete and done
            results.append((name, s, records))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.jsonl", "w") as f:
        for name, _, records in results:
            for r in records:
                f.write(json.dumps({"point": name} | r) + "\n")
    lines = ["# zerokl experiment countdown --sweep", "", f"- command: `{command}`",
             f"- status: {'complete' if complete else 'INCOMPLETE: run the same command again to continue'}",
             f"- zerokl arm only, {args.steps} steps per point, {args.prompts_per_step} prompts × {args.group_size} "
             f"samples, {args.dtype} on {device.type}, seed {args.seed}", "",
             "A point learns when its reward rise (last quarter of steps minus first) is at least twice its "
             "standard error under the step-to-step noise (t ≥ 2).", "",
             "| point | steps | reward first → last quarter | rise | step noise | t | learns | greedy test accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for name, _, records in sorted(results, key=lambda x: -_nan0(trend([r["reward"] for r in x[2]])["t"])):
        t = trend([r["reward"] for r in records]) if records else None
        accs = [r["test_accuracy"] for r in records if r.get("test_accuracy") is not None]
        lines.append(f"| {name} | {len(records)} | " + ("| | | | |" if t is None else
                     f"{t['first']:.3f} → {t['last']:.3f} | {t['rise']:+.3f} | {t['noise']:.3f} | {t['t']:.2f} | "
                     f"{'yes' if _nan0(t['t']) >= 2 else 'no'} |") +
                     (f" {accs[0]:.3f} → {accs[-1]:.3f} |" if accs else " - |"))
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(results) - 2:]))
    return _exit_status(complete, failed, out / "sweep.md")


def _point_name(s: Setting) -> str:
    return f"{s.preset}-{s.difficulty}-lr{s.lr:g}"


def _sweep_path(state_dir: pathlib.Path, s: Setting) -> pathlib.Path:
    """The sweep's checkpoint of the zerokl arm at setting `s` (the main run's zerokl arm continues it)."""
    return state_dir / "sweep" / f"{_point_name(s)}.pt"


def _nan0(x: float) -> float:
    return 0.0 if math.isnan(x) else x
