"""The RL step's trainer work through the trainer service vs the in-process Trainer, same rollouts (issue 37).

    python tools/bench/bench_rl_step.py --device cuda --dtype bfloat16 --preset small --out docs/bench
    python tools/bench/bench_rl_step.py --device cpu --preset small --layers 2 --prompts 2 --group 4 --steps 3 \\
        --threads 1

Each step draws fresh random-length rollouts (--prompts x --group), takes their behaviour
logprobs from the in-process trainer's forward_logprobs (the same weights the service holds,
so the step's KL is exactly 0), then runs on them:

- service: the RPCs an RL job sends (`zerokl jobs submit rl`, services/zerokl/services/jobs/manager.py):
  ForwardBackward(ppo, group_size) + OptimStep, then SaveWeights (the new version, with its
  trainer state, into a weight-store service), against `zerokl serve trainer` and
  `zerokl serve weight-store` started here as subprocesses, on --device;
- in process: `Trainer.forward_backward("ppo", ...)` + `optim_step` on the same batch.

Printed per step: the service's ForwardBackward / OptimStep / SaveWeights seconds, the bytes
SaveWeights published and their rate, the in-process forward_backward / optim_step seconds, and
the service's KL and mismatched tokens. The summary gives train tok/s (completion tokens over
ForwardBackward + OptimStep) of each, the ratio service / in-process, and SaveWeights' share of
the service's step, over the steps after the first (the first compiles); the bits check is
torch.equal of the two trainers' forward_logprobs after the last step. The fleet's switch to
each version (the rest of an RL step's sync_s) is not in this bench: the job events carry it.

With --job PATH (issue 37's targets) it instead runs a whole RL job twice on the same weights and
seeds, and writes the per-step breakdown to PATH (rewritten after every step of either half, so a
time limit still leaves the figures so far; --half-time caps each half's steps, 90 s by default,
and the in-process half runs as many steps as the services did):

    python tools/bench/bench_rl_step.py --job docs/bench/bench-rl-job-cuda-sm90.json --device cuda \\
        --dtype bfloat16 --preset small --prompts 64 --group 8 --steps 20

- services: `zerokl up --preset P --dtype D` (weight store, one decode replica, trainer,
  scheduler; the replica's engine sized by --num-blocks/--max-num-seqs/--max-num-batched-tokens),
  then `zerokl jobs submit rl`'s RLJobSpec through the Jobs API; each step's event gives
  rollout_s, train_s, sync_s (optimizer step's end -> the replica serving the new version, in
  place from the trainer's memory), record_wait_s and record_lag (the store's background records:
  weights only, the trainer state every --checkpoint-every steps; a step waits only behind
  checkpoints), superseded (weights-only versions nobody read, never recorded), the bytes the
  records that landed held and wrote, sync_bytes, tokens, KL, mismatched tokens;
- in process: the same RL loop (`run_rl`) on the same first version (the fleet's version 1 read
  back from its store) with the experiment's in-process ports (one Engine of the same size,
  reloaded in place; the Trainer), the same RLConfig and seeds.

Printed at the end: a per-step table (the service's rollout_s, train_s, sync_s, record wait, record
lag, checkpoint, KL, mismatched tokens; the in-process rollout_s, train_s, KL, mismatched tokens)
and the summary (steps after the first, which compiles, that both halves ran): the service step
(rollout + train + sync + record wait) over the in-process rollout + train (target <= 1.25), train tok/s service / in
process (>= 0.8), sync_s's share of the service step (<= 5%) with bytes and GB/s, and KL == 0.0
with 0 mismatched tokens at every step; also whether the two runs took the same trajectory
(equal loss, reward and tokens each step: the same numbers on the same device).

The starting weights are Normal(0, 0.02) drawn by torch's generator on --device (fast; any
weights do), published as the store's first version; the service starts from it (--init) and
the in-process trainer loads the same files, so both begin with the same bits. On the CPU give
--threads 1: the backward's bits depend on the intra-op thread count there (docs/perf.md).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.types import EngineConfig
from zerokl.services.rl.loop import RLConfig
from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments, dataclass_from_args

from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.losses import group_advantages
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.store import VersionSpec
from zerokl.vocab import Completion, Rollout

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_train import build_model  # noqa: E402  (its seeded on-device init, no portable draw)
from fleet import stop, wait_up  # noqa: E402
from provenance import commit  # noqa: E402

INIT = "bench-init"
RUN = "bench"
#: The RLConfig and EngineConfig fields this benchmark takes (a flag each, generated), with its defaults:
#: --prompts, --group, --steps, --seed both modes; --max-tokens, --ignore-eos and the engine's with --job.
#: The job's other RLConfig fields keep RLConfig's defaults, except eval_every (0: the job never evaluates).
_RL_FIELDS = ("steps", "prompts_per_step", "group_size", "max_tokens", "seed", "ignore_eos")
_RL_SKIP = tuple(f.name for f in dataclasses.fields(RLConfig) if f.name not in _RL_FIELDS)
_RL_DEFAULTS = RLConfig(steps=5, prompts_per_step=64, group_size=8, max_tokens=24, seed=0, ignore_eos=False)
_ENGINE_SKIP = tuple(f.name for f in dataclasses.fields(EngineConfig)
                     if f.name not in ("num_blocks", "max_num_seqs", "max_num_batched_tokens"))
_ENGINE_DEFAULTS = EngineConfig(num_blocks=8192, max_num_seqs=512, max_num_batched_tokens=2048)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollouts(rng: random.Random, args: argparse.Namespace, vocab: int, version: str) -> list[Rollout]:
    """--prompts groups of --group completions with random lengths and rewards (logprobs filled in later)."""
    out = []
    for _ in range(args.prompts_per_step):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len)))
        for _ in range(args.group_size):
            completion = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(*args.completion_len)))
            out.append(Rollout(Completion(prompt, completion), (), float(rng.random() < 0.5), version))
    return out


def start(argv: list[str], log: pathlib.Path, what: str) -> tuple[subprocess.Popen, str]:
    """A service subprocess (its output to ``log``: a pipe nobody reads could fill and block it)
    and the address from its listening line."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=out, stderr=subprocess.STDOUT)
    while proc.poll() is None:
        for line in log.read_text().splitlines():
            if " listening on " in line:
                return proc, line.split(" listening on ")[1].split()[0]
        time.sleep(0.2)
    raise SystemExit(f"{what} exited with {proc.returncode} before listening; see {log}")


async def bench(args: argparse.Namespace, work: pathlib.Path) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = ModelConfig.preset(args.preset)
    if args.layers:
        config = config.replace(num_hidden_layers=args.layers)
    model = build_model(config, str(device), dtype, args.seed)   # bench_train's: seeded on the device, no portable draw
    init_dir = work / "init"
    model.save_pretrained(init_dir)
    store = VersionStore(LocalDirBackend(work / "weights"))
    store.publish_dir(init_dir, INIT, VersionSpec())
    train = TrainConfig(lr=args.lr, master_weights={"auto": None, "on": True, "off": False}[args.master_weights])
    reference = Trainer(Model.from_pretrained(init_dir).to(device), train)
    del model

    threads = ["--threads", str(args.threads)] if args.threads else []
    if args.threads:
        torch.set_num_threads(args.threads)
    ws, ws_addr = start(["zerokl.services.weightstore", "--root", str(work / "weights"), "--port", "0"],
                        work / "weight-store.log", "the weight store")
    flags = ["--lr", repr(args.lr), "--master-weights", args.master_weights]
    tr, tr_addr = start(["zerokl.services.trainer", "--weight-store", ws_addr, "--init", INIT, "--run", RUN,
                         "--device", args.device, "--port", "0", *threads, *flags], work / "trainer.log",
                        "the trainer")
    rng = random.Random(args.seed)
    steps = []
    try:
        async with TrainerClient(tr_addr) as client:
            version = INIT
            for step in range(1, args.steps + 1):
                batch = rollouts(rng, args, config.vocab_size, version)
                behaviour = reference.forward_logprobs([r.sequence for r in batch])
                batch = [Rollout(r.sequence, tuple(lp.tolist()), r.reward, r.weights_version)
                         for r, lp in zip(batch, behaviour, strict=True)]
                t0 = time.perf_counter()
                fb = await client.forward_backward("ppo", batch, group_size=args.group_size)
                t1 = time.perf_counter()
                opt = await client.optim_step()
                t2 = time.perf_counter()
                manifest, _ = await client.save_weights()
                t3 = time.perf_counter()
                version = manifest.version
                saved = sum(s.size for s in manifest.shards)
                t4 = time.perf_counter()
                adv = group_advantages(torch.tensor([r.reward for r in batch]), args.group_size)
                m = reference.forward_backward("ppo", batch, advantages=adv)
                sync(device)
                t5 = time.perf_counter()
                ref_opt = reference.optim_step()
                sync(device)
                t6 = time.perf_counter()
                assert fb.ppo is not None
                row = {"step": step, "tokens": fb.tokens, "service_forward_backward_s": t1 - t0,
                       "service_optim_step_s": t2 - t1, "service_save_weights_s": t3 - t2, "saved_bytes": saved,
                       "in_process_forward_backward_s": t5 - t4, "in_process_optim_step_s": t6 - t5,
                       "kl": fb.ppo.kl, "mismatched_tokens": fb.ppo.mismatched_tokens,
                       "same_metrics": (fb.loss, opt.grad_norm) == (m["loss"], ref_opt["grad_norm"])}
                steps.append(row)
                print(f"step {step}: {fb.tokens} tokens | service fb {row['service_forward_backward_s']:.3f} s "
                      f"opt {row['service_optim_step_s']:.3f} s save {row['service_save_weights_s']:.3f} s "
                      f"({saved / 1e6:.0f} MB, {saved / 1e6 / row['service_save_weights_s']:.0f} MB/s) | "
                      f"in process fb {row['in_process_forward_backward_s']:.3f} s "
                      f"opt {row['in_process_optim_step_s']:.3f} s | kl {fb.ppo.kl} mismatched "
                      f"{fb.ppo.mismatched_tokens} same loss/grad norm {row['same_metrics']}", flush=True)
            probe = [r.sequence for r in batch]
            bitwise = all(torch.equal(a, b) for a, b in zip(await client.forward_logprobs(probe),
                                                               reference.forward_logprobs(probe), strict=True))
    finally:
        for proc in (tr, ws):
            proc.terminate()
            proc.wait()
    return summarize(args, steps, bitwise)


def summarize(args: argparse.Namespace, steps: list[dict], bitwise: bool) -> dict:
    warm = steps[1:] or steps       # the first step compiles (CUDA), or warms caches
    tokens = sum(r["tokens"] for r in warm)
    service_train = sum(r["service_forward_backward_s"] + r["service_optim_step_s"] for r in warm)
    service_step = service_train + sum(r["service_save_weights_s"] for r in warm)
    in_process = sum(r["in_process_forward_backward_s"] + r["in_process_optim_step_s"] for r in warm)
    saved = statistics.mean(r["saved_bytes"] for r in warm)
    save_s = statistics.mean(r["service_save_weights_s"] for r in warm)
    result = {
        "date": datetime.date.today().isoformat(), "commit": commit(), "machine": platform.node(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(args.device),
        "torch": torch.__version__, "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
        "threads": args.threads, "preset": args.preset,
        "layers": args.layers or ModelConfig.preset(args.preset).num_hidden_layers,
        "dtype": args.dtype, "master_weights": args.master_weights, "prompts": args.prompts_per_step, "group": args.group_size,
        "activation_checkpointing": args.activation_checkpointing,
        "prompt_len": args.prompt_len, "completion_len": args.completion_len, "steps": steps,
        "service_train_tokens_per_s": tokens / service_train, "in_process_train_tokens_per_s": tokens / in_process,
        "ratio": in_process / service_train, "save_weights_share_of_service_step": (service_step - service_train)
        / service_step, "save_weights_mean_s": save_s, "save_weights_mean_bytes": saved,
        "kl_all_zero": all(r["kl"] == 0.0 and r["mismatched_tokens"] == 0 for r in steps),
        "same_metrics_every_step": all(r["same_metrics"] for r in steps), "bitwise_logprobs_after": bitwise,
    }
    print(f"train tok/s over steps 2..{len(steps)} ({tokens} tokens): service {result['service_train_tokens_per_s']:.1f}"
          f", in process {result['in_process_train_tokens_per_s']:.1f}, service / in process {result['ratio']:.3f}; "
          f"SaveWeights {save_s:.2f} s for {saved / 1e6:.0f} MB ({saved / 1e6 / save_s:.0f} MB/s), "
          f"{100 * result['save_weights_share_of_service_step']:.0f}% of the service's step; KL 0 every step: "
          f"{result['kl_all_zero']}; bitwise the same logprobs after: {bitwise}")
    return result


# ----------------------------------------------------------------------------- --job: a whole RL job, both ways

def _rl_config(args: argparse.Namespace) -> RLConfig:
    return dataclass_from_args(RLConfig, args, skip=_RL_SKIP, eval_every=0)


async def _service_job(args: argparse.Namespace, workdir: pathlib.Path,
                       on_step: Callable[[list[dict]], None]) -> list[dict]:
    """The RL job through `zerokl up`: its per-step events (``on_step`` after each). Past --half-time seconds
    the job is cancelled at its next step boundary (the steps so far are the result)."""
    from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec
    from zerokl.services.jobs.service import JobsClient
    engine = [f"--replica-flag=--num-blocks={args.num_blocks}", f"--replica-flag=--max-num-seqs={args.max_num_seqs}",
              f"--replica-flag=--max-num-batched-tokens={args.max_num_batched_tokens}"]
    argv = [sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0", "--preset", args.preset,
            "--seed", str(args.seed), "--dtype", args.dtype, f"--trainer-flag=--lr={args.lr!r}",
            f"--trainer-flag=--master-weights={args.master_weights}", "--trainer-flag=--run=bench",
            # one step's batch is every sample's prompt + answer (512 x ~1,050 ids at 1,024-token answers)
            f"--trainer-flag=--max-batch-tokens={max(262144, args.prompts_per_step * args.group_size * (args.max_tokens + 128))}",
            *(["--trainer-flag=--activation-checkpointing"] if args.activation_checkpointing else []),
            f"--trainer-flag=--micro-batch-tokens={args.micro_batch_tokens}",
            f"--trainer-flag=--record-deltas={args.record_deltas}", *engine]
    workdir.mkdir(parents=True, exist_ok=True)
    with (workdir / "up.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t_up = time.monotonic()
        services = wait_up(workdir, proc, args.up_timeout)
        print(f"services: the fleet is up after {time.monotonic() - t_up:.1f} s", flush=True)
        spec = RLJobSpec(**dataclasses.asdict(_rl_config(args)), countdown=CountdownTask(seed=args.seed),
                         checkpoint_every=args.checkpoint_every, reward=args.reward)
        async with JobsClient(services["scheduler"]["address"]) as jobs:
            job = await jobs.submit(spec, "bench-rl-job")
            started, cancelled, rows = time.monotonic(), False, []
            async for ev in jobs.watch(job.job_id):
                if ev.step is not None:
                    rows.append({"step": ev.step, "weights_version": ev.weights_version, **ev.metrics})
                    m = ev.metrics
                    if len(rows) == 1:
                        # Submit -> step 1's event, less step 1 itself: the job's start (publishing the trainer's
                        # weights, switching the fleet to them) and the job's queueing.
                        rows[0]["job_start_s"] = time.monotonic() - started - sum(
                            m.get(k, 0.0) for k in ("rollout_s", "train_s", "sync_s", "record_wait_s"))
                        print(f"services: the job's start took {rows[0]['job_start_s']:.1f} s", flush=True)
                    print(f"service step {ev.step}: rollout {m['rollout_s']:.2f} s train {m['train_s']:.2f} s "
                          f"sync {m['sync_s']:.3f} s (export {m.get('sync_export_s', 0):.3f} s, switch "
                          f"{m.get('sync_switch_s', 0):.3f} s; {m.get('sync_bytes', 0) / 1e6:.0f} MB) record wait "
                          f"{m.get('record_wait_s', 0):.3f} s lag {m.get('record_lag', 0):.0f}"
                          f"{' checkpoint' if m.get('checkpoint') else ''} | {m['tokens']:.0f} tokens kl {m['kl']} "
                          f"mismatched {m['mismatched_tokens']:.0f} | durable up to step {m.get('durable_step', -1):.0f}"
                          f" (checkpoint {m.get('checkpoint_step', -1):.0f}); records landed: "
                          f"{m.get('record_bytes', 0) / 1e6:.0f} MB, {m.get('record_written_bytes', 0) / 1e6:.0f} MB "
                          f"written, {m.get('superseded', 0):.0f} superseded", flush=True)
                    on_step(rows)
                    if args.half_time and time.monotonic() - started > args.half_time and not cancelled:
                        print(f"services: past --half-time {args.half_time:g} s; cancelling the job after step "
                              f"{ev.step}", flush=True)
                        await jobs.cancel(job.job_id)
                        cancelled = True
                elif ev.status.state.done:
                    if ev.status.state is JobState.SUCCEEDED or cancelled and ev.status.state is JobState.CANCELLED:
                        print(f"services: the job {ev.status.state.value} after {time.monotonic() - started:.1f} s "
                              "(the last versions' records included)", flush=True)
                    else:
                        raise SystemExit(f"the job ended {ev.status.state.value}: {ev.status.error}")
        return rows
    finally:
        stop(proc)


class _HalfTime(Exception):
    """The in-process half ran past --half-time: stop after this step."""


def _in_process_job(args: argparse.Namespace, first_version: pathlib.Path, steps: int,
                    on_step: Callable[[list[dict]], None]) -> list[dict]:
    """The same job in this process (``steps`` of it): run_rl with the experiment's in-process ports on the
    fleet's first version; ``on_step`` after each step; stops past --half-time."""
    from zerokl.experiment_state import ArmEnginePort, ArmTrainerPort
    from zerokl.services.jobs.manager import _countdown_data
    from zerokl.services.jobs.types import CountdownTask
    from zerokl.services.rl.loop import Task, as_dict, run_rl
    from zerokl.tasks.countdown import reward
    from zerokl.tasks.setup import encode_prompt
    from zerokl.tasks.synthetic import vowel_share
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = Model.from_pretrained(first_version, dtype=dtype).to(device)
    trainer = Trainer(model, TrainConfig(lr=args.lr, master_weights={"auto": None, "on": True,
                                                                      "off": False}[args.master_weights],
                                         activation_checkpointing=args.activation_checkpointing,
                                         micro_batch_tokens=args.micro_batch_tokens))
    train, test, tok = _countdown_data(CountdownTask(seed=args.seed))
    task = Task(train, test, lambda p: encode_prompt(p, tok), vowel_share if args.reward == "vowel_share" else reward)
    port = ArmTrainerPort(trainer, "bench")
    engine = ArmEnginePort(port, tok, dataclass_from_args(EngineConfig, args, skip=_ENGINE_SKIP))
    rows, started = [], time.monotonic()

    def step_done(r) -> None:  # noqa: ANN001
        rows.append(as_dict(r))
        print(f"in-process step {r.step}: rollout {r.rollout_s:.2f} s train {r.train_s:.2f} s publish "
              f"{r.sync_s:.3f} s | {r.tokens} tokens kl {r.kl} mismatched {r.mismatched_tokens}", flush=True)
        on_step(rows)
        if args.half_time and time.monotonic() - started > args.half_time and r.step < steps:
            raise _HalfTime()

    try:
        run_rl(task, engine, port, dataclasses.replace(_rl_config(args), steps=steps), step_done)
    except _HalfTime:
        print(f"in process: past --half-time {args.half_time:g} s; stopped after step {len(rows)}", flush=True)
    return rows


_KEYS = ("rollout_s", "train_s", "sync_s", "sync_export_s", "sync_switch_s", "record_wait_s", "record_lag",
         "checkpoint", "sync_bytes", "tokens", "kl", "mismatched_tokens", "loss", "reward", "durable_step",
         "checkpoint_step", "record_bytes", "record_written_bytes", "record_s", "superseded")


def summarize_job(args: argparse.Namespace, service: list[dict], local: list[dict]) -> dict:
    """The JSON of a --job run so far (either half may be partial or empty): targets over the steps after
    the first (which compiles) that both halves ran."""
    result = {
        "date": datetime.date.today().isoformat(), "commit": commit(), "machine": platform.node(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(args.device),
        "torch": torch.__version__, "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
        "preset": args.preset, "dtype": args.dtype, "master_weights": args.master_weights,
        "activation_checkpointing": args.activation_checkpointing, "micro_batch_tokens": args.micro_batch_tokens,
        "steps": args.steps, "prompts": args.prompts_per_step, "group": args.group_size, "max_tokens": args.max_tokens,
        "reward": args.reward, "ignore_eos": args.ignore_eos,
        "checkpoint_every": args.checkpoint_every, "half_time_s": args.half_time,
        "engine": {"num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens},
        "job_start_s": service[0].get("job_start_s") if service else None,
        "service_steps": [{k: r.get(k) for k in ("step", *_KEYS)} for r in service],
        "in_process_steps": [{k: r.get(k) for k in ("step", *_KEYS)} for r in local],
        "kl_all_zero": all(r["kl"] == 0.0 and r["mismatched_tokens"] == 0 for r in service),
        "in_process_kl_all_zero": all(r["kl"] == 0.0 and r["mismatched_tokens"] == 0 for r in local),
    }
    n = min(len(service), len(local))
    warm_s, warm_l = service[1:n] or service[:n], local[1:n] or local[:n]
    if not warm_s:
        return result
    service_step = sum(r["rollout_s"] + r["train_s"] + r["sync_s"] + (r.get("record_wait_s") or 0.0) for r in warm_s)
    local_step = sum(r["rollout_s"] + r["train_s"] for r in warm_l)
    service_tps = sum(r["tokens"] for r in warm_s) / sum(r["train_s"] for r in warm_s)
    local_tps = sum(r["tokens"] for r in warm_l) / sum(r["train_s"] for r in warm_l)
    sync = sum(r["sync_s"] for r in warm_s)
    moved = sum(r.get("sync_bytes") or 0.0 for r in warm_s)
    recorded = sum(r.get("record_bytes") or 0.0 for r in service)
    written = sum(r.get("record_written_bytes") or 0.0 for r in service)
    record_s = sum(r.get("record_s") or 0.0 for r in service)
    result |= {
        # Issue 49: rollout tok/s (completion tokens over rollout_s) of both halves, the median step of each,
        # the job's wall (sum of its steps), and the store's side: bytes recorded and written per step, GB/s.
        "service_rollout_tokens_per_s": sum(r["tokens"] for r in warm_s) / sum(r["rollout_s"] for r in warm_s),
        "in_process_rollout_tokens_per_s": sum(r["tokens"] for r in warm_l) / sum(r["rollout_s"] for r in warm_l),
        "service_step_median_s": statistics.median(r["rollout_s"] + r["train_s"] + r["sync_s"]
                                                   + (r.get("record_wait_s") or 0.0) for r in warm_s),
        "in_process_step_median_s": statistics.median(r["rollout_s"] + r["train_s"] for r in warm_l),
        "step_median_ratio": statistics.median(r["rollout_s"] + r["train_s"] + r["sync_s"]
                                               + (r.get("record_wait_s") or 0.0) for r in warm_s)
        / statistics.median(r["rollout_s"] + r["train_s"] for r in warm_l),
        # The job's wall, steps only (the start aside: job_start_s), service over in process (<= 1.15).
        "job_wall_ratio": service_step / local_step,
        "record_bytes_per_step": recorded / len(service), "record_written_bytes_per_step": written / len(service),
        "record_written_fraction": written / recorded if recorded else None,
        "record_gb_per_s": recorded / 1e9 / record_s if record_s else None,
        # Weights-only versions never recorded (served in place, read by no one: ARCHITECTURE.md "Durable versions").
        "superseded_versions": sum(r.get("superseded") or 0 for r in service),
        "compared_steps": [r["step"] for r in warm_s],
        # Target 1 (<= 1.25): the service's whole step over the in-process rollout + train.
        "step_ratio": (service_step / len(warm_s)) / (local_step / len(warm_l)),
        # Target 2 (>= 0.8): training tok/s, service over in process.
        "train_tokens_per_s_ratio": service_tps / local_tps,
        "service_train_tokens_per_s": service_tps, "in_process_train_tokens_per_s": local_tps,
        # Target 3 (<= 0.05): sync_s's share of the service step; what moved and how fast.
        "sync_share_of_step": sync / service_step, "sync_mean_s": sync / len(warm_s),
        "sync_mean_bytes": moved / len(warm_s), "sync_bytes_per_s": moved / max(sync, 1e-9),
        "record_wait_share_of_step": sum(r.get("record_wait_s") or 0.0 for r in warm_s) / service_step,
        "same_trajectory": [(r["loss"], r["reward"], r["tokens"]) for r in service[:n]]
        == [(r["loss"], r["reward"], r["tokens"]) for r in local[:n]],
    }
    return result


def print_job_table(result: dict) -> None:
    """Per step: the service's rollout_s, train_s, sync_s, record wait and lag, KL and mismatched tokens, beside
    the in-process rollout_s and train_s; then the targets."""
    local = {r["step"]: r for r in result["in_process_steps"]}
    print("step | service rollout_s train_s sync_s record_wait_s lag ckpt kl mismatched | in process rollout_s "
          "train_s kl mismatched")
    for r in result["service_steps"]:
        l = local.get(r["step"])
        there = (f"{l['rollout_s']:.3f} {l['train_s']:.3f} {l['kl']} {l['mismatched_tokens']}" if l else "-")
        print(f"{r['step']:>4} | {r['rollout_s']:.3f} {r['train_s']:.3f} {r['sync_s']:.3f} "
              f"{r['record_wait_s'] or 0.0:.3f} {r['record_lag'] or 0:.0f} {'yes' if r['checkpoint'] else 'no'} "
              f"{r['kl']} {r['mismatched_tokens']:.0f} | {there}")
    if "step_ratio" not in result:
        print("no step ran in both halves: no ratios")
        return
    print(f"steps {result['compared_steps'][0]}..{result['compared_steps'][-1]}: service step / in-process "
          f"(rollout + train) {result['step_ratio']:.3f} (target <= 1.25); train tok/s service "
          f"{result['service_train_tokens_per_s']:.0f} / in process {result['in_process_train_tokens_per_s']:.0f} = "
          f"{result['train_tokens_per_s_ratio']:.3f} (>= 0.8); sync {100 * result['sync_share_of_step']:.2f}% of the "
          f"step (<= 5%), {result['sync_mean_bytes'] / 1e6:.0f} MB at {result['sync_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"record wait {100 * result['record_wait_share_of_step']:.2f}% of the step; median step service "
          f"{result['service_step_median_s']:.3f} s / in process {result['in_process_step_median_s']:.3f} s = "
          f"{result['step_median_ratio']:.3f} (issue 49: <= 1.10 at 1,024 tokens, 1.25 at 24); rollout tok/s service "
          f"{result['service_rollout_tokens_per_s']:.0f} / in process {result['in_process_rollout_tokens_per_s']:.0f}; "
          f"store: {result['record_bytes_per_step'] / 1e6:.0f} MB recorded and "
          f"{result['record_written_bytes_per_step'] / 1e6:.0f} MB written per step"
          + (f" ({100 * result['record_written_fraction']:.1f}%), {result['record_gb_per_s']:.3f} GB/s of record "
             "(share -> commit)" if result['record_gb_per_s'] else "")
          + f"; {result['superseded_versions']} weights-only versions superseded (never recorded); KL 0.0 every step: "
          f"{result['kl_all_zero']} (in process {result['in_process_kl_all_zero']}); same trajectory: "
          f"{result['same_trajectory']}")


def job_main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    out = pathlib.Path(args.job)
    out.parent.mkdir(parents=True, exist_ok=True)
    halves: dict[str, list[dict]] = {"service": [], "local": []}
    if args.half == "in-process":
        # The service half ran in an earlier call (a device call is 10 minutes): its steps from this JSON.
        if not out.exists() or not args.job_workdir:
            raise SystemExit(f"--half in-process compares with a service half run before: it needs that run's {out} "
                             "and its --job-workdir")
        prior = json.loads(out.read_text())
        halves["service"] = prior["service_steps"]
        if halves["service"] and prior.get("job_start_s") is not None:
            halves["service"][0]["job_start_s"] = prior["job_start_s"]

    def write() -> dict:
        # After every step of either half: a time limit that stops the bench still leaves its figures.
        result = summarize_job(args, halves["service"], halves["local"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out)
        return result

    def progress(half: str) -> Callable[[list[dict]], None]:
        def update(rows: list[dict]) -> None:
            halves[half] = list(rows)
            write()
        return update

    kept = contextlib.nullcontext(args.job_workdir) if args.job_workdir else \
        tempfile.TemporaryDirectory(prefix="zerokl-bench-rl-job-")
    with kept as tmp:
        workdir = pathlib.Path(tmp) / "up"
        if args.half != "in-process":
            halves["service"] = asyncio.run(_service_job(args, workdir, progress("service")))
        if args.half != "service":
            t0 = time.monotonic()
            halves["local"] = _in_process_job(args, workdir / "weights" / "versions" / "1",
                                              len(halves["service"]) or args.steps, progress("local"))
            print(f"in process: {len(halves['local'])} steps in {time.monotonic() - t0:.1f} s (the model's load "
                  "included)", flush=True)
    result = write()
    print_job_table(result)
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if plot_job(result, out.with_suffix(".png")) else ""))


def plot_job(result: dict, path: pathlib.Path) -> bool:
    """The per-step breakdown as stacked bars, the service's step beside the in-process one's
    (rollout, train, sync, record wait), KL in the title. False without matplotlib or steps."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    service, local = result.get("service_steps") or [], result.get("in_process_steps") or []
    if not service:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(service) + 2), 4.2))
    parts = (("rollout_s", "rollout", "tab:blue"), ("train_s", "train", "tab:orange"),
             ("sync_s", "sync", "tab:green"), ("record_wait_s", "record wait", "tab:red"))
    for offset, rows, hatch in ((-0.2, service, ""), (0.2, local, "//")):
        bottom = [0.0] * len(rows)
        steps = [r["step"] + offset for r in rows]
        for key, label, color in parts:
            heights = [r.get(key) or 0.0 for r in rows]
            if not any(heights):
                continue
            ax.bar(steps, heights, 0.38, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                   label=label if rows is service else None)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks([r["step"] for r in service])
    ax.set_xlabel("RL step (left bar: through `zerokl up`; right, hatched: in process)")
    ax.set_ylabel("seconds")
    top = sorted(sum(r.get(k) or 0.0 for k, *_ in parts) for r in service + local)
    ax.set_ylim(0, top[int(0.9 * (len(top) - 1))] * 1.6)       # step 1 (compiles) and outliers run off the top
    ax.legend(fontsize=8, loc="upper right")
    kl = "KL 0.0 every step" if result.get("kl_all_zero") and result.get("in_process_kl_all_zero") else "KL != 0"
    ax.set_title(f"RL job, {result.get('preset')} {result.get('dtype')}, {result.get('device')}, "
                 f"{result.get('commit')}: {kl}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # A time limit's SIGTERM unwinds like an error: the `finally` that stops the fleet runs (Python's
    # default would end the process at once and leave the fleet, and its GPU memory, behind).
    raise SystemExit(f"stopped by signal {signum}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=0, help="> 0: the preset with this many layers (default: its own)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--master-weights", default="auto", choices=("auto", "on", "off"),
                   help="fp32 master weights: auto = on for bf16 (default %(default)s)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--completion-len", type=int, nargs=2, default=(8, 40), metavar=("MIN", "MAX"))
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=None, help="torch threads here and in the trainer")
    p.add_argument("--out", default=None, help="directory for bench-rl-step-<device>-<dtype>.json")
    p.add_argument("--job", default=None, metavar="PATH",
                   help="run a whole RL job through `zerokl up` and in process; the per-step JSON to PATH")
    p.add_argument("--reward", default="countdown", choices=("countdown", "vowel_share"),
                   help="--job: the RL reward (vowel_share: synthetic, earned by any policy, so every step moves "
                        "the weights; zerokl/tasks/synthetic.py)")
    p.add_argument("--record-deltas", default="previous", choices=("previous", "start", "off"),
                   help="--job: the trainer records versions as deltas of the one before (previous), of the job's "
                        "start (start) or whole (off)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="--job: both halves' trainers recompute each block's activations in the backward")
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="--job: both halves' trainers run a step's batch as micro-batches of this many packed tokens "
                        "(TrainConfig.micro_batch_tokens; 0: the whole batch in one forward + backward, default)")
    p.add_argument("--half", choices=("both", "service", "in-process"), default="both",
                   help="--job: run one half only (both: the services, then in process, in one run); `in-process` "
                        "compares with the service half a run before wrote to the same --job JSON, from its "
                        "--job-workdir's first version: a 20-step job of 1,024-token answers takes two device calls")
    p.add_argument("--job-workdir", default=None, metavar="DIR",
                   help="--job: keep the fleet's workdir here (default: a temporary directory, removed)")
    p.add_argument("--up-timeout", type=float, default=600.0, help="--job: seconds for the fleet to come up")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="--job: the RL job records the trainer state every N steps and at the last (default "
                        "%(default)s)")
    p.add_argument("--half-time", type=float, default=90.0,
                   help="--job: seconds each half's steps may take (the fleet's start and the model's load aside); "
                        "past them the half stops after its current step, and the in-process half runs as many "
                        "steps as the services did (0: no cap; default %(default)s)")
    p.add_argument("--plot-only", default=None, metavar="JSON",
                   help="draw a --job JSON's per-step breakdown to the same path with .png, and exit")
    # One flag per RLConfig and EngineConfig field the benchmark takes, generated, with its defaults.
    add_dataclass_arguments(p.add_argument_group("the RL steps (--seed also seeds the model; --max-tokens, --ignore-eos: --job only)"),
                            RLConfig, skip=_RL_SKIP, defaults=_RL_DEFAULTS)
    add_dataclass_arguments(p.add_argument_group("--job: the engines"), EngineConfig, skip=_ENGINE_SKIP,
                            defaults=_ENGINE_DEFAULTS)
    return p


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser().parse_args(argv)
    if args.plot_only:
        src = pathlib.Path(args.plot_only)
        if not plot_job(json.loads(src.read_text()), src.with_suffix(".png")):
            raise SystemExit(f"{src}: no steps to plot, or no matplotlib")
        print(f"wrote {src.with_suffix('.png')}")
        return
    if args.job:
        job_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="zerokl-bench-rl-step-") as tmp:
        result = asyncio.run(bench(args, pathlib.Path(tmp)))
    if args.out:
        out = pathlib.Path(args.out) / f"bench-rl-step-{'cpu' if args.device == 'cpu' else 'cuda'}-{args.dtype}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
