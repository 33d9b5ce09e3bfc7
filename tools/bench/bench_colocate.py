"""An RL job through the services with the fleet and the trainer co-located on one device (issue 49).

    python tools/bench/bench_colocate.py                          # GLM-5 2-layer slice, bf16, one GPU
    python tools/bench/bench_colocate.py --preset tiny --device cpu   # the same path on a CPU, < 2 min

`zerokl up --colocate` (one decode replica, the trainer, the weight store, the scheduler) on the model, then
an RL job of --steps steps: before each step trains, the replica sleeps (KV cache and weights released: level
2, `--sleep-level 1` keeps the weights), the trainer keeps its AdamW state in pinned host memory between steps
(--offload-optimizer) and the step's in-place weight switch wakes the replica with the new version. Printed
per step (and written to --out as JSON): KL (must be 0.0), rollout tok/s (completion tokens / rollout_s),
train tok/s (the trainer's tokens / train_s), sync and sleep seconds, and the peak device memory (GPU:
nvidia-smi per process, sampled every 0.2 s; CPU: each process's peak RSS) of the replica (its server and
engine process) and the trainer.

The slice (--preset glm5 --layers 2: 12.2 B parameters, 22.7 GiB in bf16) is written as a checkpoint into
--workdir first (deleted once the store holds it). The services' temp files go under --workdir too (TMPDIR), and
the peak disk under it is reported by part (measured on the CPU: 9.4x the model's bf16 bytes at the last step's
checkpoint with --master-weights off: the store's first version, the job start's resume point and the last one's
bf16 AdamW moments, the record process's delta base and the checkpoint's files, the store's decoded cache; the
replica's copy is hard links into the store; 4.0x with --checkpoint-every 0, the slice's default, and the record
process's first base linked from the store): ~91 GiB for the slice, more than a 64 GiB machine
has (run it on a host with more disk, --gpu picking one of its GPUs). Its trainer defaults to
--master-weights off: fp32 masters (45 GiB) and their AdamW moments (91 GiB) fit neither an 80 GB GPU nor a
128 GB host; bf16 moments (45 GiB) live on the host. A run longer than a device call's 10 minutes goes in the
background (setsid) and is polled: it prints a progress line per step and rewrites --out after each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fleet import stop, wait_up  # noqa: E402


def model_config(args: argparse.Namespace):  # noqa: ANN201
    """The preset, cut to --layers (the first dense) when given."""
    from zerokl.kernels.model import ModelConfig
    config = ModelConfig.preset(args.preset)
    if args.layers is not None:
        config = config.replace(num_hidden_layers=args.layers, first_k_dense_replace=1)
    return config


def model_dir(args: argparse.Namespace, workdir: pathlib.Path) -> pathlib.Path | None:
    """The model as a checkpoint when --layers cuts a preset (None: `zerokl up --preset` makes it)."""
    if args.layers is None:
        return None
    import torch

    from zerokl.kernels.model import Model
    config = model_config(args)
    out = workdir / f"model-{args.preset}-{args.layers}l-seed{args.seed}"
    if (out / "config.json").exists():
        return out
    t0 = time.monotonic()
    print(f"writing the {args.preset} {args.layers}-layer model (bf16) to {out} ...", flush=True)
    if args.device == "cuda":
        # Drawn on the GPU in bf16, in a process of its own (its CUDA context gone before the fleet starts): on
        # the host, Model()'s fp32 draw of the slice and its bf16 copy took the 128 GB machine's memory (killed).
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=_write_on_gpu, args=(config, args.seed, str(out), args.gpu))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"writing the model failed (exit code {proc.exitcode})")
    else:
        model = Model(config, seed=args.seed, dtype=torch.bfloat16)
        model.save_pretrained(out)
        print(f"  {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    print(f"  written in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def _write_on_gpu(config, seed: int, out: str, gpu: str | None) -> None:  # noqa: ANN001
    """bench_train's seeded model drawn on the device (no weight on the host but the file's), saved to ``out``."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import torch
    from bench_train import build_model
    model = build_model(config, "cuda", torch.bfloat16, seed)
    print(f"  {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    model.save_pretrained(out)


# Peak disk of the job, in bf16 copies of the model (the CPU cut's figures, docs/perf.md, issue 49): the start holds
# the bench's checkpoint and the store's first version; a job recording against its start, the store's first
# version and the record being written, and the deltas (2.2-2.6x measured).
_DISK_X = {"start": 2.7, "previous": 4.1, "off": 4.1}


def check_disk(args: argparse.Namespace, workdir: pathlib.Path) -> None:
    """Refuse to start a job its disk cannot hold (a device call found out after the fleet's minutes of start-up)."""
    from flops import total_params

    model_bytes = 2 * total_params(model_config(args))
    need = _DISK_X[args.record_deltas] * model_bytes
    free = shutil.disk_usage(workdir).free
    print(f"disk: {free / 2**30:.1f} GiB free under {workdir}; the job needs about {need / 2**30:.1f} GiB "
          f"({_DISK_X[args.record_deltas]}x the model's {model_bytes / 2**30:.1f} GiB, --record-deltas "
          f"{args.record_deltas})", flush=True)
    if free < need:
        raise SystemExit(f"not enough disk under {workdir}: {free / 2**30:.1f} GiB free, about {need / 2**30:.1f} "
                         "GiB needed (--workdir elsewhere, or --record-deltas start)")


class _Sampler:
    """Calls :meth:`sample` every 0.2 s on a background thread while entered."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):  # noqa: ANN204
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(0.2):
                return

    def sample(self) -> None:
        raise NotImplementedError


def _children() -> dict[int, list[int]]:
    """Every process's children (from /proc/*/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def _process_tree(root: int, children: dict[int, list[int]] | None = None) -> set[int]:
    """``root`` and every process below it."""
    children = _children() if children is None else children
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _status_kib(pid: int, field: str) -> int:
    """A /proc/PID/status field in KiB (0 when the process is gone)."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _service_name(pid: int) -> str:
    """A child of `zerokl up` by what it serves (``serve trainer`` -> trainer), else its first arguments."""
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    if "serve" in argv and argv.index("serve") + 1 < len(argv):
        return argv[argv.index("serve") + 1]
    return " ".join(a for a in argv[:3] if a)[:60] or f"pid {pid} (exited)"


def _kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it (services may run in sessions of their own)."""
    for pid in _process_tree(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class HostWatch(_Sampler):
    """The host's memory while the fleet runs: each service's resident set (the sum over its process tree: a
    replica's engine, the trainer's record process), the peak of each and the least memory available (MemAvailable).

    And a guard. A co-located job of a large model keeps the trainer's optimizer state in pinned host memory, and
    the records copy each version to the host. If that ever outgrows the host, the kernel's OOM killer or a swapless
    stall takes the whole machine down, with every log on it (a device call then brings nothing back). So below
    ``reserve`` bytes available the guard writes what each service held to ``report`` and calls ``on_low`` (stop
    the fleet) once: the bench fails with the figures instead of the machine."""

    def __init__(self, root: int, reserve: float, report: pathlib.Path, on_low) -> None:  # noqa: ANN001
        super().__init__()
        self.root, self.reserve, self.report, self.on_low = root, reserve, report, on_low
        self.peak: dict[str, float] = {}        # service -> peak resident bytes
        self.available_min = float("inf")
        self.tripped: dict | None = None        # the moment the guard stopped the fleet: what each service held

    def _meminfo(self, field: str) -> float:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
        return 0.0

    def sample(self) -> None:
        children = _children()
        now = {}
        for child in children.get(self.root, []):
            rss = sum(_status_kib(pid, "VmRSS") for pid in _process_tree(child, children)) * 1024.0
            if not rss:
                continue                        # exited (a zombie until `zerokl up` reaps it)
            name = _service_name(child)
            now[name] = now.get(name, 0.0) + rss
            self.peak[name] = max(self.peak.get(name, 0.0), now[name])
        available = self._meminfo("MemAvailable")
        self.available_min = min(self.available_min, available)
        if available < self.reserve and self.tripped is None:
            self.tripped = {"available": available, "resident": now, "total": self._meminfo("MemTotal")}
            self.report.write_text(json.dumps(self.tripped, indent=1))
            print(f"host memory: {available / 2**30:.1f} GiB available, under the {self.reserve / 2**30:.0f} GiB "
                  "reserve: stopping the fleet; resident by service: " + ", ".join(
                      f"{k} {v / 2**30:.1f} GiB" for k, v in sorted(now.items(), key=lambda kv: -kv[1])), flush=True)
            self.on_low()

    def summary(self) -> dict:
        return {"what": "host resident bytes by service (VmRSS over each process tree), sampled every 0.2 s",
                "peak_by_service": self.peak, "available_min": self.available_min, "stopped_for_memory": self.tripped}


class MemoryWatch(_Sampler):
    """Peak memory of each process of the fleet, by service."""

    def __init__(self, services: dict[str, dict], device: str) -> None:
        super().__init__()
        self.device = device
        self.roots = {name: s["pid"] for name, s in services.items() if s.get("pid")}
        self.peak: dict[str, float] = {}        # service -> peak bytes (sum over its process tree)
        self.total_peak = 0.0                   # GPU: the device's used memory

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.device == "cpu":
            self.sample()                       # VmHWM: the peak so far, final at the end

    def sample(self) -> None:
        children = _children()                  # one scan of /proc for every service's tree
        trees = {name: _process_tree(pid, children) for name, pid in self.roots.items()}
        if self.device == "cpu":
            for name, pids in trees.items():
                total = sum(_status_kib(pid, "VmHWM") for pid in pids) * 1024.0
                self.peak[name] = max(self.peak.get(name, 0.0), total)
            return
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        by_pid = {}
        for line in apps.strip().splitlines():
            pid, mib = (x.strip() for x in line.split(","))
            if pid.isdigit() and mib.isdigit():
                by_pid[int(pid)] = int(mib) * 2**20
        for name, pids in trees.items():
            self.peak[name] = max(self.peak.get(name, 0.0), float(sum(by_pid.get(p, 0) for p in pids)))
        if used.strip():
            self.total_peak = max(self.total_peak, float(used.strip().splitlines()[0]) * 2**20)


def _place(rel: pathlib.PurePath) -> str:
    """Which part of the job a file under the workdir belongs to (the report's breakdown)."""
    parts = rel.parts
    if parts[0].startswith("model-"):
        return "model dir (the bench's checkpoint)"
    if parts[:2] == ("fleet", "weights"):
        return {"versions": "store: whole shards", "deltas": "store: deltas", "uploads": "store: open uploads",
                ".decoded": "store: decoded cache"}.get(parts[2] if len(parts) > 2 else "", "store: other")
    if parts[:2] == ("fleet", "models"):
        return "replica's served copy (WORKDIR/models)"
    if parts[0] == "tmp" and len(parts) > 1:
        for prefix, what in (("zerokl-trainer-record-", "trainer: record dirs (delta base, next record)"),
                             ("zerokl-trainer-init-", "trainer: --init fetch"),
                             ("zerokl-trainer-resume-", "trainer: resume fetch"),
                             ("zerokl-weights-", "replica: switch fetch"), ("zerokl-publish-", "publish temp"),
                             ("zerokl-preset-", "publish temp")):
            if parts[1].startswith(prefix):
                return what
        return "tmp: other"
    return "other"


class DiskWatch(_Sampler):
    """Disk the job holds under the workdir (the fleet's TMPDIR is inside it), sampled every 0.2 s: the peak,
    by part at that moment (each file once however many hard links it has), and the peak growth of the
    filesystem's used bytes (statvfs: what the workdir misses, other processes' writes included).

    And a guard, as :class:`HostWatch`'s for memory: a full root filesystem can take the machine's own agent down
    with the job (two device runs of the slice came back with nothing, their machine no longer answering). Below
    ``reserve`` bytes free, the guard prints what the workdir held by part and calls ``on_low`` (stop the fleet)
    once, so the bench fails with the figures instead of the machine."""

    def __init__(self, workdir: pathlib.Path, reserve: float = 0.0) -> None:
        super().__init__()
        self.workdir = workdir
        self.reserve = reserve
        self.on_low = None                      # set once there is a fleet to stop
        self.tripped: dict | None = None        # the moment the guard stopped the fleet: free bytes and the parts
        self.peak = 0
        self.peak_parts: dict[str, int] = {}
        self.peak_at = ""                       # the phase at the peak
        self.phase = "start"
        self.fs_start = self._fs_used()
        self.fs_peak = 0

    def _fs_used(self) -> int:
        st = os.statvfs(self.workdir)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def sample(self) -> None:
        parts: dict[str, int] = {}
        seen: set[tuple[int, int]] = set()
        for dirpath, _dirs, files in os.walk(self.workdir):
            for name in files:
                path = pathlib.Path(dirpath, name)
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                what = _place(path.relative_to(self.workdir))
                parts[what] = parts.get(what, 0) + st.st_blocks * 512
        total = sum(parts.values())
        if total > self.peak:
            self.peak, self.peak_parts, self.peak_at = total, parts, self.phase
        self.fs_peak = max(self.fs_peak, self._fs_used() - self.fs_start)
        free = shutil.disk_usage(self.workdir).free
        if free < self.reserve and self.tripped is None and self.on_low is not None:
            self.tripped = {"free": free, "phase": self.phase, "parts": parts}
            print(f"disk: {free / 2**30:.2f} GiB free, under the {self.reserve / 2**30:.1f} GiB reserve ({self.phase}): "
                  "stopping the fleet; the workdir holds " + ", ".join(
                      f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])), flush=True)
            self.on_low()

    def report(self, model_bytes: int) -> dict:
        return {"what": "bytes on disk under the workdir (files counted once), sampled every 0.2 s",
                "model_bytes": model_bytes, "peak": self.peak, "peak_x_model": self.peak / max(model_bytes, 1),
                "peak_phase": self.peak_at,
                "peak_parts": dict(sorted(self.peak_parts.items(), key=lambda kv: -kv[1])),
                "fs_used_growth_peak": self.fs_peak, "stopped_for_disk": self.tripped}


async def heartbeat(workdir: pathlib.Path, host: HostWatch, disk: DiskWatch, every_s: float = 30.0) -> None:
    """A line every ``every_s`` while the job runs: the disk free under the workdir and the host's least available
    memory, so a run that never reaches a step (or whose machine stops answering) still leaves their trend in the
    log brought back (two device runs of the slice lost their machine before a step, cause unknown)."""
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        free = shutil.disk_usage(workdir).free
        print(f"[{time.monotonic() - t0:.0f} s into the job] disk: {free / 2**30:.1f} GiB free (peak under the workdir "
              f"{disk.peak / 2**30:.1f} GiB, at '{disk.peak_at}') | host: least available "
              f"{host.available_min / 2**30:.1f} GiB, peak " + ", ".join(
                  f"{k} {v / 2**30:.1f}" for k, v in host.peak.items()), flush=True)


async def run_job(args: argparse.Namespace, services: dict[str, dict], result: dict, out: pathlib.Path,
                  host: HostWatch, disk: DiskWatch, workdir: pathlib.Path) -> None:
    from zerokl.services.jobs.types import CountdownTask, RLJobSpec
    spec = RLJobSpec(steps=args.steps, countdown=CountdownTask(seed=args.seed), prompts_per_step=args.prompts,
                     group_size=args.group, max_tokens=args.max_tokens, seed=args.seed, eval_every=0,
                     reward="vowel_share", ignore_eos=True, learning_rate=args.lr,
                     checkpoint_every=args.checkpoint_every)
    beat = asyncio.ensure_future(heartbeat(workdir, host, disk))
    try:
        await _watch_job(spec, services, result, out, host)
    finally:
        beat.cancel()


async def _watch_job(spec, services: dict[str, dict], result: dict, out: pathlib.Path,  # noqa: ANN001 - RLJobSpec
                     host: HostWatch) -> None:
    from zerokl.services.jobs.types import JobState
    from zerokl.services.jobs.service import JobsClient
    async with JobsClient(services["scheduler"]["address"]) as jobs:
        job = await jobs.submit(spec, "bench-colocate")
        async for ev in jobs.watch(job.job_id):
            if ev.step is not None:
                m = ev.metrics
                row = {"step": ev.step, "weights_version": ev.weights_version, **m,
                       "rollout_tok_s": m["tokens"] / max(m["rollout_s"], 1e-9), "train_tok_s": m["tokens_per_s"]}
                result["steps"].append(row)
                print(f"step {ev.step}: kl {m['kl']} mismatched {m['mismatched_tokens']:.0f} | {m['tokens']:.0f} tokens"
                      f" | rollout {m['rollout_s']:.2f} s ({row['rollout_tok_s']:.0f} tok/s) train {m['train_s']:.2f} s "
                      f"({row['train_tok_s']:.0f} tok/s; waiting for records {m.get('export_wait_s', 0):.2f} s) | "
                      f"sleep {m.get('sleep_s', 0):.2f} s "
                      f"({m.get('sleep_bytes', 0) / 2**20:.1f} MiB released) sync {m['sync_s']:.2f} s (wake + "
                      f"{m.get('sync_bytes', 0) / 2**20:.1f} MiB in place) | host: least available "
                      f"{host.available_min / 2**30:.1f} GiB, peak " + ", ".join(
                          f"{k} {v / 2**30:.1f}" for k, v in host.peak.items()), flush=True)
                result["host_memory"] = host.summary()
                out.write_text(json.dumps(result, indent=1))
            elif ev.status.state.done:
                if ev.status.state is not JobState.SUCCEEDED:
                    raise SystemExit(f"the job ended {ev.status.state.value}: {ev.status.error}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--preset", default="glm5", help="model preset (default %(default)s)")
    ap.add_argument("--layers", type=int, default=None,
                    help="cut the preset to this many layers, the first dense (default: 2 for glm5, the preset's own "
                         "otherwise)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES for the fleet (one GPU of a larger host)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="prompts a step (default %(default)s)")
    ap.add_argument("--group", type=int, default=8, help="answers a prompt (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens an answer, past eos (default %(default)s)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep-level", type=int, choices=(1, 2), default=2)
    ap.add_argument("--master-weights", choices=("auto", "on", "off"), default=None,
                    help="the trainer's fp32 masters (default: off for glm5, auto otherwise)")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help="the job records the trainer state every N steps and at its first and last; 0: never, "
                         "every version weights only (default: 0 for glm5, whose trainer state the disk cannot "
                         "hold, 10 otherwise)")
    ap.add_argument("--record-deltas", choices=("previous", "start", "off"), default=None,
                    help="what the trainer's records are deltas against (default: start for glm5, whose bytes the "
                         "disk cannot hold twice more; previous otherwise)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="the trainer's packed tokens per forward + backward (default: 2048 for glm5, whose "
                         "logits over 154,880 tokens of a whole step ran out of an H100's memory; 0 otherwise)")
    ap.add_argument("--num-blocks", type=int, default=None, help="replica KV blocks (default: enough for the batch)")
    ap.add_argument("--workdir", default=None, help="the fleet's workdir (default /tmp/bench-colocate-PRESET)")
    ap.add_argument("--out", default=None, help="JSON (default docs/bench/colocate-PRESET-DEVICE.json)")
    ap.add_argument("--up-timeout", type=float, default=1800.0)
    ap.add_argument("--host-reserve-gib", type=float, default=8.0,
                    help="stop the fleet when the host has less memory available than this, and report what each "
                         "service held (a host out of memory takes the machine and its logs down; default %(default)s)")
    ap.add_argument("--store-wait", type=float, default=900.0,
                    help="the scheduler's --store-wait: how long a job waits for a record it needs (its last ones, a "
                         "checkpoint beyond the lag, a failed step's wake) before it fails; the slice's whole start "
                         "record is 22.7 GiB, more than the default 120 s carries (default %(default)s)")
    ap.add_argument("--disk-reserve-gib", type=float, default=3.0,
                    help="stop the fleet when the workdir's disk has less free than this, and report what the workdir "
                         "held by part (a full root disk can take the machine and its logs down; default %(default)s)")
    args = ap.parse_args()
    if args.layers is None and args.preset == "glm5":
        args.layers = 2
    master = args.master_weights or ("off" if args.preset == "glm5" else "auto")
    if args.checkpoint_every is None:
        args.checkpoint_every = 0 if args.preset == "glm5" else 10
    if args.record_deltas is None:
        args.record_deltas = "start" if args.preset == "glm5" else "previous"
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = 2048 if args.preset == "glm5" else 0
    name = f"{args.preset}{f'-{args.layers}l' if args.layers else ''}"
    workdir = pathlib.Path(args.workdir or f"/tmp/bench-colocate-{name}").resolve()
    out = pathlib.Path(args.out or ROOT / "docs" / "bench" / f"colocate-{name}-{args.device}.json")
    workdir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(args, workdir)
    fleet = workdir / "fleet"
    disk = DiskWatch(workdir, args.disk_reserve_gib * 2**30).__enter__()
    disk.phase = "model written"
    model = model_dir(args, workdir)
    tokens = args.prompts * args.group * (args.max_tokens + 64)
    blocks = args.num_blocks or max(64, -(-tokens // 16) + 16)
    argv = [sys.executable, "-m", "zerokl", "up", "--workdir", str(fleet), "--port", "0", "--colocate",
            *(["--model", str(model)] if model else ["--preset", args.preset, "--seed", str(args.seed)]),
            "--dtype", "bfloat16", f"--trainer-flag=--master-weights={master}", "--trainer-flag=--run=colocate",
            f"--trainer-flag=--record-deltas={args.record_deltas}",
            f"--trainer-flag=--micro-batch-tokens={args.micro_batch_tokens}",
            f"--scheduler-flag=--colocate-sleep-level={args.sleep_level}",
            f"--scheduler-flag=--store-wait={args.store_wait}",
            f"--replica-flag=--num-blocks={blocks}", f"--replica-flag=--max-num-seqs={args.prompts * args.group}",
            "--replica-flag=--max-num-batched-tokens=4096"]
    env = dict(os.environ)
    env["TMPDIR"] = str(workdir / "tmp")        # the services' temp files on the workdir's disk (and in its figure)
    (workdir / "tmp").mkdir(exist_ok=True)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif args.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.gpu
    result: dict = {"meta": {"preset": args.preset, "layers": args.layers, "device": args.device, "steps": args.steps,
                             "prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
                             "sleep_level": args.sleep_level, "master_weights": master,
                             "checkpoint_every": args.checkpoint_every, "record_deltas": args.record_deltas,
                             "micro_batch_tokens": args.micro_batch_tokens,
                             "argv": argv[2:]},
                    "steps": []}
    print("starting:", " ".join(argv[2:]), flush=True)
    disk.phase = "fleet start"
    with (workdir / "up.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    host = HostWatch(proc.pid, args.host_reserve_gib * 2**30, out.with_name(out.stem + "-host-memory.json"),
                     lambda: _kill_tree(proc.pid)).__enter__()
    disk.on_low = lambda: _kill_tree(proc.pid)
    try:
        t0 = time.monotonic()
        if model is not None:
            # Gone as soon as the store holds it (its first version; the replica's copy is linked from there), not
            # once the fleet is up: the trainer's start fetches the version meanwhile.
            while not (fleet / "weights" / "manifests" / "1.json").exists() and proc.poll() is None:
                time.sleep(0.2)
            shutil.rmtree(model)
        services = wait_up(fleet, proc, args.up_timeout)
        result["meta"]["up_s"] = time.monotonic() - t0
        print(f"the fleet is up after {result['meta']['up_s']:.0f} s", flush=True)
        disk.phase = "job"
        with MemoryWatch(services, args.device) as memory:
            try:
                asyncio.run(run_job(args, services, result, out, host, disk, workdir))
            except Exception as err:
                # A guard stopped the fleet (its line above says why and what was held): that, not the job
                # stream's broken connection, is what this run ends with.
                guard = "disk" if disk.tripped else "host memory" if host.tripped else None
                if guard is None:
                    raise
                raise SystemExit(f"the {guard} guard stopped the fleet during the job ({type(err).__name__})") from None
        replica = sum(v for k, v in memory.peak.items() if k.startswith("decode"))
        result["peak_memory"] = {"by_service": memory.peak, "replica": replica,
                                 "trainer": memory.peak.get("trainer", 0.0), "device_total": memory.total_peak,
                                 "what": "GPU bytes (nvidia-smi, per process tree)" if args.device == "cuda"
                                 else "peak RSS bytes (VmHWM, per process tree)"}
    finally:
        if proc.poll() is None:
            stop(proc)
        host.__exit__(None, None, None)
        result["host_memory"] = host.summary()
        out.write_text(json.dumps(result, indent=1))
        disk.__exit__(None, None, None)
        v1 = fleet / "weights" / "versions" / "1"
        model_bytes = sum(f.stat().st_size for f in v1.iterdir() if f.name.startswith("model")) if v1.is_dir() else 0
        result["peak_disk"] = disk.report(model_bytes)
    steps = result["steps"]
    result["kl_all_zero"] = bool(steps) and all(r["kl"] == 0.0 and r["mismatched_tokens"] == 0 for r in steps)
    result["rollout_tok_s"] = sorted(r["rollout_tok_s"] for r in steps)[len(steps) // 2] if steps else None
    result["train_tok_s"] = sorted(r["train_tok_s"] for r in steps)[len(steps) // 2] if steps else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    p = result["peak_memory"]
    print(f"KL 0.0 every step: {result['kl_all_zero']} | median rollout {result['rollout_tok_s']:.0f} tok/s, train "
          f"{result['train_tok_s']:.0f} tok/s | peak memory ({p['what']}): replica {p['replica'] / 2**30:.2f} GiB, "
          f"trainer {p['trainer'] / 2**30:.2f} GiB, device {p['device_total'] / 2**30:.2f} GiB | {out}", flush=True)
    d = result["peak_disk"]
    h = result["host_memory"]
    print("peak host memory by service: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in h["peak_by_service"].items())
          + f"; least available {h['available_min'] / 2**30:.1f} GiB", flush=True)
    print(f"peak disk {d['peak'] / 2**30:.2f} GiB = {d['peak_x_model']:.2f}x the model's {d['model_bytes'] / 2**30:.2f} "
          f"GiB (during {d['peak_phase']}): " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in d["peak_parts"].items()),
          flush=True)
    return 0 if result["kl_all_zero"] else 1


if __name__ == "__main__":
    sys.exit(main())
