"""`zerokl demo`: a tiny GLM-5-family model runs GRPO on countdown through the five services.

Phases (each with a progress bar or step lines):
1. Start the five services on loopback (`zerokl up` as a child process): the weight
   store publishes the starting checkpoint, prefill and decode replicas serve it,
   the trainer loads it, the scheduler fronts them and runs jobs.
2. Warm start: the SFT checkpoint shipped in zerokl/assets/countdown-sft (made by
   tools/train_countdown_sft.py), or, with --sft-steps N, an SFT job through the
   scheduler from the seeded `tiny` model.
3. An RL job through the scheduler: n samples per prompt generated on weights
   version v (every request pinned to v), rewards, a GRPO/PPO-clip update on the
   trainer, publish v+1 to the weight store, every replica switches to v+1, next
   step. The hyperparameters the job trains with come first; then each step prints
   the line `zerokl jobs watch` prints: reward, the exact train/inference KL, clip
   fraction, mismatched tokens, greedy test accuracy every few steps, loss, gradient
   norm, learning rate and tokens/s.
4. A report in --out: report.md, metrics.jsonl (one object per RL step) and PNG plots.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from tqdm import tqdm

from zerokl.services.rl.loop import RLConfig
from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments, dataclass_from_args
from zerokl.tasks.setup import SFT_CHECKPOINT

__all__ = ["add_arguments", "main", "run", "write_report"]


def _plot(records: list[dict], out: pathlib.Path, title: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in records]
    panels = [("reward", "mean reward"), ("kl", "train/inference KL (exact)"),
              ("clip_fraction", "PPO clip fraction"), ("test_accuracy", "greedy test accuracy")]
    names = []
    for key, label in panels:
        pts = [(s, r[key]) for s, r in zip(steps, records) if r.get(key) is not None]
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=8)
        if key in ("kl", "clip_fraction") and all(p[1] == 0 for p in pts):
            ax.set_ylim(-1e-3, 1e-2)
            ax.text(0.5, 0.5, "exactly 0 at every step", transform=ax.transAxes, ha="center")
        fig.tight_layout()
        name = f"{key}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def write_report(records: list[dict], out: pathlib.Path, header: dict) -> None:
    """metrics.jsonl, PNG plots and report.md for a run."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    plots = _plot(records, out, header.get("title", "zerokl countdown GRPO"))
    kls = [r["kl"] for r in records]
    lines = [f"# {header.get('title', 'zerokl countdown GRPO')}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items() if k != "title"]
    lines += ["", f"KL exactly 0 at every step: **{'yes' if all(k == 0.0 for k in kls) else 'NO'}** "
              f"(max |KL| {max(abs(k) for k in kls):.3g}, mismatched tokens {sum(r['mismatched_tokens'] for r in records)})", "",
              "| step | version | reward | KL | mismatched | clip frac | tokens/s | test acc |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        acc = "" if r.get("test_accuracy") is None else f"{r['test_accuracy']:.2f}"
        lines.append(f"| {r['step']} | {r['weights_version']} | {r['reward']:.3f} | {r['kl']!r} | {r['mismatched_tokens']} | "
                     f"{r['clip_fraction']:.3f} | {r['tokens_per_s']:.0f} | {acc} |")
    lines += [""] + [f"![{p}]({p})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")




def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The demo's flags (shared by `zerokl demo` and `python -m zerokl.demo`)."""
    ap.add_argument("--out", default="runs/demo", help="report folder")
    ap.add_argument("--lr", type=float, default=1e-4, help="the trainer's learning rate")
    # One flag per RLConfig field, generated (--steps, --prompts, --group, --eval-every, --seed, ...): the GRPO
    # job's settings; the demo's own defaults where they differ.
    add_dataclass_arguments(ap.add_argument_group("the GRPO job"), RLConfig,
                            defaults=RLConfig(prompts_per_step=16, eval_prompts=64))
    ap.add_argument("--sft-steps", type=int, default=0,
                    help="> 0: warm start by an SFT job of N steps from the seeded tiny model instead of the "
                         "shipped checkpoint")
    ap.add_argument("--sft-batch", type=int, default=32,
                    help="with --sft-steps: demonstrations per SFT step (default %(default)s)")
    ap.add_argument("--train-problems", type=int, default=20000,
                    help="countdown training problems (default %(default)s)")
    ap.add_argument("--lora-rank", type=int, default=0, help="> 0: the trainer trains LoRA adapters only")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="zerokl demo", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


class _Cluster:
    """`zerokl up` as a child process, torn down on exit."""

    def __init__(self, workdir: pathlib.Path, up_flags: list[str]) -> None:
        self.workdir = workdir
        self.log = open(workdir / "up.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0",
                                      *up_flags], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        state = self.workdir / "up.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"zerokl up exited ({self.proc.returncode}):\n"
                                 f"{(self.workdir / 'up.log').read_text()[-3000:]}")
            if state.exists():
                services = json.loads(state.read_text())["services"]
                if all(s["status"] == "SERVING" for s in services):
                    return {s["name"]: s for s in services}
            time.sleep(0.25)
        raise SystemExit(f"the services did not come up in {timeout_s:.0f}s; see {self.workdir / 'up.log'}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def _run_jobs(scheduler: str, args: argparse.Namespace) -> list[dict]:
    from zerokl.jobs_cli import hyperparameters_line, step_line
    from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec, SFTJobSpec
    from zerokl.services.jobs.service import JobsClient

    task = CountdownTask(seed=args.seed, train_problems=args.train_problems)
    records: list[dict] = []
    async with JobsClient(scheduler) as jobs:
        if args.sft_steps:
            job = await jobs.submit(SFTJobSpec(args.sft_steps, countdown=task, batch_size=args.sft_batch,
                                               seed=args.seed), "countdown SFT warm start")
            bar = tqdm(total=args.sft_steps, desc="SFT job", unit="step", disable=None)  # None: no bar off a TTY
            async for ev in jobs.watch(job.job_id):
                if ev.step is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{ev.metrics['loss']:.3f}")
                if ev.status.state.done and ev.status.state is not JobState.SUCCEEDED:
                    raise SystemExit(f"the SFT job {ev.status.state.value}: {ev.status.error}")
            bar.close()
        spec = RLJobSpec(**dataclasses.asdict(dataclass_from_args(RLConfig, args)), countdown=task)
        job = await jobs.submit(spec, "countdown GRPO")
        bar = tqdm(total=args.steps, desc="GRPO job", unit="step", disable=None)
        shown_config = False
        async for ev in jobs.watch(job.job_id):
            if ev.status.train_config is not None and not shown_config:
                tqdm.write(hyperparameters_line("rl", ev.status.train_config))
                shown_config = True
            if ev.step is not None:
                m = ev.metrics
                tqdm.write(step_line(ev.step, ev.status.total_steps, ev.weights_version, m))   # as `zerokl jobs watch`
                bar.update(1)
                records.append({"step": ev.step, "weights_version": ev.weights_version,
                                **{k: (int(v) if k in ("mismatched_tokens", "tokens", "stale_rollouts") else v)
                                   for k, v in m.items()}})
            if ev.status.state.done and ev.status.state is not JobState.SUCCEEDED:
                raise SystemExit(f"the RL job {ev.status.state.value}: {ev.status.error}")
        bar.close()
    return records


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed flags."""
    from zerokl.kernels import __version__, fingerprint

    t0 = time.perf_counter()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sft_steps:
        start = ["--preset", "tiny", "--seed", str(args.seed)]
        origin = f"seeded tiny model + SFT job of {args.sft_steps} steps"
    else:
        if not (SFT_CHECKPOINT / "model.safetensors").exists():
            raise SystemExit(f"no SFT checkpoint at {SFT_CHECKPOINT}: run tools/train_countdown_sft.py, or pass "
                             "--sft-steps N")
        start = ["--model", str(SFT_CHECKPOINT)]
        made = json.loads((SFT_CHECKPOINT / "sft.json").read_text())
        origin = f"shipped SFT checkpoint ({made['steps']} steps; reproduce: `{made['command']}`)"
    trainer_flags = [f"--trainer-flag=--lr={args.lr}", "--trainer-flag=--run=countdown",
                     f"--trainer-flag=--lora-rank={args.lora_rank}", f"--trainer-flag=--seed={args.seed}"]
    with tempfile.TemporaryDirectory(prefix="zerokl-demo-") as tmp:
        print(f"starting the five services on loopback ({origin}) ...", flush=True)
        # A prefill replica too (not `zerokl up`'s one-device default): the demo shows all five services.
        cluster = _Cluster(pathlib.Path(tmp), [*start, "--threads", "1", "--prefill-replicas", "1", *trainer_flags])
        try:
            services = cluster.wait_ready()
            for name, s in services.items():
                print(f"  {name:13s} {s['address']:21s} weights {s['weights_version'] or '-':6s} "
                      f"fingerprint {s['numerics_fingerprint'] or '-'}", flush=True)
            records = asyncio.run(_run_jobs(services["scheduler"]["address"], args))
        finally:
            cluster.stop()
    wall = time.perf_counter() - t0
    write_report(records, out, {
        "title": "zerokl countdown GRPO through the five services (tiny model, CPU)",
        "numerics": f"{__version__} fingerprint {fingerprint()}",
        "start": origin, "GRPO steps": args.steps, "samples per step": args.prompts_per_step * args.group_size,
        "learning rate": args.lr, "wall time (s)": f"{wall:.0f}",
    })
    kl_zero = all(r["kl"] == 0.0 and r["mismatched_tokens"] == 0 for r in records)
    print(f"KL exactly 0 at every step: {'yes' if kl_zero else 'NO'}; wall time {wall:.0f}s; report: "
          f"{out / 'report.md'}", flush=True)
    return 0 if kl_zero else 1


if __name__ == "__main__":
    raise SystemExit(main())
