"""The RL step's trainer work through the trainer service vs the in-process Trainer, same rollouts (issue 37).

    python tools/bench/bench_rl_step.py --device cuda --dtype bfloat16 --preset small --out docs/bench
    python tools/bench/bench_rl_step.py --device cpu --preset small --layers 2 --prompts 2 --group 4 --steps 3 \
        --threads 1

Each step draws fresh random-length rollouts (--prompts x --group), takes their behaviour
logprobs from the in-process trainer's forward_logprobs (the same weights the service holds,
so the step's KL is exactly 0), then runs on them:

- service: the RPCs an RL job sends (`zerokl jobs submit rl`, services/jobs/manager.py):
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

The starting weights are Normal(0, 0.02) drawn by torch's generator on --device (fast; any
weights do), published as the store's first version; the service starts from it (--init) and
the in-process trainer loads the same files, so both begin with the same bits. On the CPU give
--threads 1: the backward's bits depend on the intra-op thread count there (docs/perf.md).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from zerokl.kernels.model import Model, ModelConfig

from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.losses import group_advantages
from zerokl.services.trainer.trainer import TrainConfig, Trainer
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.store import VersionSpec
from zerokl.vocab import Completion, Rollout

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_train import build_model  # noqa: E402  (its seeded on-device init, no portable draw)

INIT = "bench-init"
RUN = "bench"


def commit() -> str:
    return os.environ.get("ZEROKL_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollouts(rng: random.Random, args: argparse.Namespace, vocab: int, version: str) -> list[Rollout]:
    """--prompts groups of --group completions with random lengths and rewards (logprobs filled in later)."""
    out = []
    for _ in range(args.prompts):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len)))
        for _ in range(args.group):
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
                fb = await client.forward_backward("ppo", batch, group_size=args.group)
                t1 = time.perf_counter()
                opt = await client.optim_step()
                t2 = time.perf_counter()
                manifest, _ = await client.save_weights()
                t3 = time.perf_counter()
                version = manifest.version
                saved = sum(s.size for s in manifest.shards)
                t4 = time.perf_counter()
                adv = group_advantages(torch.tensor([r.reward for r in batch]), args.group)
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
        "dtype": args.dtype, "master_weights": args.master_weights, "prompts": args.prompts, "group": args.group,
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=0, help="> 0: the preset with this many layers (default: its own)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--master-weights", default="auto", choices=("auto", "on", "off"),
                   help="fp32 master weights: auto = on for bf16 (default %(default)s)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (default %(default)s)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (default %(default)s)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--completion-len", type=int, nargs=2, default=(8, 40), metavar=("MIN", "MAX"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads here and in the trainer")
    p.add_argument("--out", default=None, help="directory for bench-rl-step-<device>-<dtype>.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="zerokl-bench-rl-step-") as tmp:
        result = asyncio.run(bench(args, pathlib.Path(tmp)))
    if args.out:
        out = pathlib.Path(args.out) / f"bench-rl-step-{'cpu' if args.device == 'cpu' else 'cuda'}-{args.dtype}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
