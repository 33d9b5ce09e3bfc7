"""`zerokl jobs`: submit, follow, list and cancel training jobs on a scheduler.

    zerokl jobs submit rl --steps 30          # GRPO on countdown; follows the job until it ends
    zerokl jobs submit sft --steps 200        # SFT on countdown demonstrations
    zerokl jobs list
    zerokl jobs watch JOB_ID [--verbose|--json]   # the job's hyperparameters, past steps, then live ones
    zerokl jobs cancel JOB_ID
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
from typing import Callable

from zerokl.services.rl.loop import RLConfig
from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments, dataclass_from_args, int_in
from zerokl.table import aligned
from zerokl.tasks.synthetic import REWARDS

__all__ = ["HEADLINE", "add_arguments", "hyperparameters_line", "run", "step_line"]

_UINT32_MAX = 2**32 - 1     # the wire type of counts


def _learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0 (0: the trainer's schedule), got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from zerokl.connect import add_connection_arguments
    # Submitting and cancelling are internal RPCs: they need the operator token when auth is on.
    add_connection_arguments(p)
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("submit", help="queue a job on countdown and follow it",
                       description="Queue an SFT (solver demonstrations) or RL (GRPO) job on the built-in countdown "
                                   "task and follow it. DPO jobs take preference pairs, which have no command-line "
                                   "form: submit them through the Jobs API (zerokl.v1.Jobs; in Python, "
                                   "zerokl.services.jobs.JobsClient with a DPOJobSpec).")
    s.add_argument("kind", choices=["rl", "sft"], help="rl: GRPO with exact KL per step; sft: supervised")
    # One flag per RLConfig field, generated (--steps, --prompts, --group, --seed, ...).
    add_dataclass_arguments(s.add_argument_group("the RL job's settings (an sft job reads --steps and --seed)"),
                            RLConfig, required=("steps",))
    s.add_argument("--name", default="", help="a name shown by `zerokl jobs list` (default: the kind)")
    s.add_argument("--train-problems", type=int_in(1, 100_000), default=None,
                   help="countdown problems drawn for training (default: the Jobs API's, 20000)")
    s.add_argument("--test-problems", type=int_in(1, _UINT32_MAX), default=None,
                   help="held-out countdown problems of the greedy evaluation (default: the Jobs API's, 200)")
    s.add_argument("--batch-size", type=int_in(1, _UINT32_MAX), default=32, help="sft: completions per step")
    s.add_argument("--checkpoint-every", type=int_in(0, _UINT32_MAX), default=10,
                   help="rl: record the trainer state (a resume point) every N steps and at the first and last; the "
                        "other steps' versions are recorded weights only; 0: never (no resume point: a trainer "
                        "restart fails the job) (default %(default)s)")
    s.add_argument("--reward", choices=REWARDS, default="countdown",
                   help="rl: countdown (TinyZero's: 1 for a correct equation), or vowel_share (synthetic: the "
                        "share of vowels in the answer, which any policy earns some of, for measuring the loop; "
                        "with --ignore-eos every answer is --max-tokens long) (default %(default)s)")
    s.add_argument("--lr", type=_learning_rate, default=0.0,
                   help="learning rate of every step (default: the trainer's schedule)")
    s.add_argument("--detach", action="store_true", help="print the job id and return")
    s.add_argument("--json", action="store_true",
                   help="JSON lines only: the queued job, then one object per event")
    s.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    sub.add_parser("list", help="every job, in submission order")
    w = sub.add_parser("watch", help="the job's steps (past ones first) until it ends")
    w.add_argument("job_id", help="as `zerokl jobs submit` or `list` printed it")
    w.add_argument("--json", action="store_true", help="one JSON object per event")
    w.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    c = sub.add_parser("cancel", help="stop a job at its next step boundary")
    c.add_argument("job_id", help="as `zerokl jobs submit` or `list` printed it")


_VERBOSE_HELP = ("step lines with every metric: the headline ones first, then the rest (timings, weight sync, "
                 "records, ratios) in alphabetical order")

# A step line's metrics in this order, the ones that say whether training is healthy first (the exact
# train/inference KL beside the reward); a kind shows those it has. The others (timings, sync, records,
# ratio bounds, ...) follow in alphabetical order with --verbose; --json has them all.
HEADLINE = ("reward", "kl", "clip_fraction", "mismatched_tokens", "test_accuracy", "loss", "preference_accuracy",
            "grad_norm", "lr", "tokens_per_s")
_COUNTS = {"mismatched_tokens", "tokens", "stale_rollouts", "record_lag"}   # integers on the wire as doubles


def _metric(name: str, value: float) -> str:
    if name == "kl":
        return f"kl {value!r}"                       # exact: 0.0 means zero, not "small"
    if name in _COUNTS and float(value).is_integer():
        return f"{name} {int(value)}"
    return f"{name} {value:.4g}"


def step_line(step: int, total: int, version: str, metrics: dict[str, float], verbose: bool = False) -> str:
    """One step as `zerokl jobs watch` prints it: `step 3/30 [published V] reward ... kl 0.0 ...`."""
    names = [k for k in HEADLINE if k in metrics]
    if verbose:
        names += sorted(k for k in metrics if k not in HEADLINE)
    published = f" published {version}" if version else ""
    return f"step {step}/{total}{published} " + " ".join(_metric(k, metrics[k]) for k in names)


def hyperparameters_line(kind: str, c) -> str:  # noqa: ANN001 - a TrainConfig
    """The hyperparameters a job of ``kind`` trains with, in one line (those its kind reads)."""
    lr = f"lr {c.lr:g}"
    if c.warmup_steps or c.total_steps:
        lr += f" (warmup {c.warmup_steps} steps" + (f", cosine to {0.1 * c.lr:g} at step {c.total_steps})"
                                                     if c.total_steps else ")")
    parts = [lr, f"betas {c.betas[0]:g},{c.betas[1]:g}", f"weight_decay {c.weight_decay:g}",
             f"grad_clip {c.grad_clip:g}"]
    if kind == "rl":
        parts += [f"clip_eps {c.clip_eps:g}", f"kl_coef {c.kl_coef:g}"]
    if kind == "dpo":
        parts.append(f"dpo_beta {c.dpo_beta:g}")
    if c.lora_rank:
        parts.append(f"lora_rank {c.lora_rank} (alpha {c.lora_alpha:g})")
    return "hyperparameters: " + " ".join(parts)


def _event_dict(ev) -> dict:  # noqa: ANN001 - a JobEvent
    # A step event names the version that step published ("" when it published none); a
    # status event names the version the fleet serves for the job.
    d = {"job_id": ev.status.job_id, "state": ev.status.state.value, "step": ev.step,
         "weights_version": ev.weights_version if ev.step is not None else ev.status.weights_version}
    if ev.step is not None:
        d["metrics"] = dict(sorted(ev.metrics.items()))
    if ev.status.train_config is not None:
        d["train_config"] = dataclasses.asdict(ev.status.train_config)
    if ev.status.error:
        d["error"] = ev.status.error
    return d


async def _watch(client, job_id: str, as_json: bool, verbose: bool = False) -> int:  # noqa: ANN001
    """Print the job's events until it ends; 0 if it succeeded.

    Human form: the job's state when it is not over yet, its hyperparameters once it has started,
    each step, and how it ended, once, last (the stream opens and closes with the job's status: for a
    finished job both say how it ended)."""
    last, shown_state, shown_config = None, None, False
    async for ev in client.watch(job_id):
        last = ev
        if as_json:
            print(json.dumps(_event_dict(ev)), flush=True)
            continue
        if ev.step is None and not ev.status.state.done and ev.status.state is not shown_state:
            print(f"job {job_id} {ev.status.state.value}", flush=True)
            shown_state = ev.status.state
        if ev.status.train_config is not None and not shown_config:
            print(hyperparameters_line(ev.status.kind, ev.status.train_config), flush=True)
            shown_config = True
        if ev.step is not None:
            print(step_line(ev.step, ev.status.total_steps, ev.weights_version, ev.metrics, verbose), flush=True)
    if last is None:
        return 1
    if not as_json and last.status.state.done:
        print(f"job {job_id} {last.status.state.value}" + (f": {last.status.error}" if last.status.error else ""),
              flush=True)
    return 0 if last.status.state.value == "succeeded" else 1


async def _main(args: argparse.Namespace) -> int:
    from zerokl.services.jobs.types import CountdownTask, RLJobSpec, SFTJobSpec
    from zerokl.connect import connect
    from zerokl.services.jobs.service import JobsClient

    where = connect(args, operator=True)
    async with JobsClient(where.target, token=where.security.token, credentials=where.security.credentials()) as client:
        if args.action == "list":
            jobs = await client.list()
            rows = [["JOB", "KIND", "STATE", "STEP", "VERSION", "NAME", "ERROR"]]
            rows += [[s.job_id, s.kind, s.state.value, f"{s.step}/{s.total_steps}", s.weights_version or "-",
                      s.name or "-", s.error] for s in jobs]
            if not any(s.error for s in jobs):
                rows = [r[:-1] for r in rows]
            print(aligned(rows) if jobs else "no jobs")
            return 0
        if args.action == "cancel":
            s = await client.cancel(args.job_id)
            print(f"job {s.job_id} {s.state.value} at step {s.step}")
            return 0
        if args.action == "watch":
            return await _watch(client, args.job_id, args.json, args.verbose)
        sizes = {k: getattr(args, k) for k in ("train_problems", "test_problems") if getattr(args, k) is not None}
        task = CountdownTask(seed=args.seed, **sizes)
        if args.kind == "rl":
            spec = RLJobSpec(**dataclasses.asdict(dataclass_from_args(RLConfig, args)), countdown=task,
                             learning_rate=args.lr, checkpoint_every=args.checkpoint_every, reward=args.reward)
        else:
            spec = SFTJobSpec(args.steps, countdown=task, batch_size=args.batch_size, seed=args.seed,
                              learning_rate=args.lr)
        status = await client.submit(spec, args.name)
        if args.json:
            print(json.dumps({"job_id": status.job_id, "state": status.state.value, "kind": status.kind,
                              "total_steps": status.total_steps}), flush=True)
        else:
            print(f"job {status.job_id} queued ({status.kind}, {status.total_steps} steps; {_spec_summary(spec)})",
                  flush=True)
        return 0 if args.detach else await _watch(client, status.job_id, args.json, args.verbose)


def _spec_summary(spec) -> str:  # noqa: ANN001 - an SFTJobSpec or RLJobSpec
    """What the submitted spec fixes, as one phrase (the trainer's hyperparameters follow once it starts)."""
    lr = f"lr {spec.learning_rate:g}" if spec.learning_rate else "lr: the trainer's"
    if spec.kind == "rl":
        return (f"{spec.prompts_per_step} prompts x {spec.group_size} samples a step, max_tokens {spec.max_tokens}, "
                f"temperature {spec.temperature:g}, reward {spec.reward}, {lr}")
    return f"batch {spec.batch_size}, {lr}"


def run(args: argparse.Namespace) -> int:
    """Run `zerokl jobs ...` with parsed flags; gRPC errors print their status and exit 1."""
    import grpc.aio
    try:
        return asyncio.run(_main(args))
    except grpc.aio.AioRpcError as err:
        print(f"zerokl jobs: {err.code().name}: {err.details()}")
        return 1
