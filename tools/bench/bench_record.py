"""The weight store's record of an RL job's versions: what changes per step, what the store writes, and how fast.

    python tools/bench/bench_record.py --preset small --dtype bfloat16 --steps 6 --out docs/bench/x.json
    python tools/bench/bench_record.py --preset tiny --steps 4 --backend s3      # a real S3 server on loopback

What an RL job's trainer does for every version it shares (issues 37 and 49), on a real optimizer trajectory:
each step is one training step (``--method sft`` on random token completions, or ``ppo`` on random
rewards with behaviour logprobs from the trainer itself) with AdamW at an RL learning rate (``--lr``,
default 1e-5; fp32 masters for bf16), then the version's record: a snapshot (``snapshot_checkpoint``:
the serving weights, and every ``--checkpoint-every`` steps the trainer state too), written to files of
at most 64 MiB (``write_snapshot``), uploaded through a real `zerokl serve weight-store` subprocess
(``--backend local``: a directory; ``s3``: a bucket on moto's S3 server on loopback, the minio client as
against MinIO) by the trainer's own store client (``RemoteWeights``, ``publish_checkpoint``), each
file after the first version as a delta against the version before (``--no-delta``: whole, as before
issue 49). Several files travel at once (``PARALLEL_SHARDS``).

Printed per step: the fraction of the serving weights' elements (and bytes) that changed since the step
before, the record's bytes and the bytes the store wrote, the write and upload seconds and the rates:
**GB/s of the record** (its bytes over write + upload) and of what was written. Every version is read
back through the store (decoded) and compared byte for byte with the files written. And the delta layers
the store decoded to accept the record (its ``zerokl_weightstore_delta_layers`` metric; without the store's
cache of decoded shards that is the sum of the delta files' chain depths, also printed).

With ``--beside``, what a record in flight costs the step beside it (the trainer service's case): --steps
training steps timed on one compute thread (as the service runs them) three times, (1) alone, (2) with the
newest version recorded over and over beside them in this process's threads and event loop (the trainer's
record before the record process: snapshot, ``write_snapshot``, ``publish_checkpoint`` with deltas), (3) the
same records in the trainer's record process (``trainer/recorder.py``: the version exported to shared
memory, the child writes, hashes and uploads); printed: the median step of each and the records each arm
completed (and their GB/s).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import pathlib
import platform
import random
import shutil
import re
import signal
import sys
import tempfile
import time
import urllib.request

import grpc.aio
import torch

from zerokl.kernels.model import ModelConfig
from zerokl.services.trainer.checkpointing import (
    LineageEntry,
    RemoteWeights,
    publish_checkpoint,
    snapshot_checkpoint,
    write_snapshot,
)
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.losses import group_advantages
from zerokl.services.trainer.recorder import DeltaBases, RecordWorker
from zerokl.services.trainer.server import build_parser as trainer_parser
from zerokl.services.trainer.store_marks import META_RUN, META_STATE
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.weightstore.client import UploadBase, is_serving_file
from zerokl.services.weightstore.store import VersionSpec
from zerokl.services.weightstore.sync import export_shared
from zerokl.vocab import Completion, Rollout

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_rl_step import start  # noqa: E402
from bench_train import build_model  # noqa: E402
from provenance import commit  # noqa: E402

RUN = "bench-record"


def delta_layers(metrics_port: int | None) -> dict[str, float]:
    """The store's delta layers decoded so far, by purpose (accept, read); {} from a store without the metric."""
    if metrics_port is None:
        return {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^zerokl_weightstore_delta_layers_total\{purpose="(\w+)"\} (\S+)$', text, re.M)}


def make_trainer(args: argparse.Namespace) -> Trainer:
    config = ModelConfig.preset(args.preset)
    if args.layers:
        config = config.replace(num_hidden_layers=args.layers)
    model = build_model(config, args.device, getattr(torch, args.dtype), args.seed)
    return Trainer(model, TrainConfig(lr=args.lr))


def train_step(trainer: Trainer, rng: random.Random, args: argparse.Namespace) -> None:
    """One optimizer step at --lr on random tokens: SFT, or PPO with random rewards (on-policy: the behaviour
    logprobs are the trainer's own)."""
    vocab = trainer.model.config.vocab_size
    prompts = [tuple(rng.randrange(3, vocab) for _ in range(16)) for _ in range(args.batch // args.group)]
    seqs = [Completion(p, tuple(rng.randrange(3, vocab) for _ in range(args.tokens))) for p in prompts
            for _ in range(args.group)]
    if args.method == "sft":
        trainer.forward_backward("sft", seqs)
    else:
        logprobs = trainer.forward_logprobs(seqs)
        rollouts = [Rollout(s, tuple(lp.tolist()), float(rng.random() < 0.5), "v") for s, lp in zip(seqs, logprobs)]
        trainer.forward_backward("ppo", rollouts, advantages=group_advantages(
            torch.tensor([r.reward for r in rollouts]), args.group))
    trainer.optim_step()


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(fraction of elements, fraction of bytes) of the serving weights that differ bitwise."""
    elements = total = nbytes = moved = 0
    for name, a in after.items():
        x = a.contiguous().view(torch.uint8).reshape(-1) ^ before[name].contiguous().view(torch.uint8).reshape(-1)
        per = a.element_size()
        elements += int((x.reshape(-1, per) != 0).any(dim=1).sum())
        total += a.numel()
        moved += int((x != 0).sum())
        nbytes += x.numel()
    return elements / total, moved / nbytes


def sha256_dir(path: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def _s3_store(work: pathlib.Path) -> tuple[list[str], dict[str, str], object]:
    """moto's S3 server on loopback (the tests' S3), and the weight store's flags and environment for it."""
    import logging
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"ZEROKL_S3_ACCESS_KEY": "bench", "ZEROKL_S3_SECRET_KEY": "bench-secret"}
    return (["--s3-endpoint", f"{host}:{port}", "--s3-bucket", "bench-record", "--s3-insecure",
             "--s3-region", "us-east-1"], env, server)


async def bench(args: argparse.Namespace, work: pathlib.Path) -> dict:
    torch.manual_seed(args.seed)
    trainer = make_trainer(args)
    rng = random.Random(args.seed)
    s3 = None
    if args.backend == "s3":
        flags, env, s3 = _s3_store(work)
        os.environ.update(env)
    else:
        flags = ["--root", str(work / "weights")]
    ws, address = start(["zerokl.services.weightstore", *flags, "--port", "0", "--metrics-port", "0"],
                        work / "weight-store.log", "the weight store")
    found = re.search(r" metrics on :(\d+)", (work / "weight-store.log").read_text())
    metrics_port = int(found.group(1)) if found else None
    repo = RemoteWeights(grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20),
                                                                     ("grpc.max_receive_message_length", 16 << 20)]),
                         address)
    rows = []
    base: UploadBase | None = None
    before = {k: v.clone() for k, v in trainer.serving_state_dict().items()}
    try:
        for step in range(args.steps + 1):      # record 0: the starting weights (whole: no version before it)
            if step:
                t = time.perf_counter()
                train_step(trainer, rng, args)
                train_s = time.perf_counter() - t
            else:
                train_s = 0.0
            after = trainer.serving_state_dict()
            frac_elements, frac_bytes = changed(before, after) if step else (1.0, 1.0)
            before = {k: v.clone() for k, v in after.items()}
            full = step % args.checkpoint_every == 0
            version = f"{RUN}-{step:04d}"
            lineage = [LineageEntry("init", 0), LineageEntry(version, trainer.step)]
            spec = VersionSpec(step=trainer.step, metadata={META_RUN: RUN, META_STATE: "full" if full else "none"})
            tmp = work / f"ckpt-{version}"
            t0 = time.perf_counter()
            snapshot = snapshot_checkpoint(trainer, run=RUN, lineage=lineage, weights_only=not full)
            ts = time.perf_counter()
            write_snapshot(snapshot, tmp)
            del snapshot
            t1 = time.perf_counter()
            layers0 = delta_layers(metrics_port)
            manifest, created = await publish_checkpoint(repo, tmp, version, spec, None if args.no_delta else base)
            t2 = time.perf_counter()
            layers1 = delta_layers(metrics_port)
            assert created
            if args.verify:
                with tempfile.TemporaryDirectory(dir=work) as back:
                    await repo.fetch(version, pathlib.Path(back))
                    got = {k: v for k, v in sha256_dir(pathlib.Path(back)).items() if k != "zerokl_manifest.json"}
                assert got == sha256_dir(tmp), f"{version}: the store's bytes are not what was written"
            for path in tmp.iterdir():       # the next record's base: the serving files of this one
                if not is_serving_file(path.name):
                    path.unlink()
            if base is not None:
                shutil.rmtree(base.directory)
            base = UploadBase(manifest, tmp)
            row = {"step": step, "checkpoint": full, "train_s": train_s, "changed_elements": frac_elements,
                   "changed_bytes": frac_bytes, "bytes": manifest.total_size, "written": manifest.stored_size,
                   "serving_bytes": sum(s.size for s in manifest.shards if is_serving_file(s.name)),
                   "serving_written": sum(s.stored_bytes for s in manifest.shards if is_serving_file(s.name)),
                   "files": len(manifest.shards), "deltas": sum(1 for s in manifest.shards if s.base),
                   "snapshot_s": ts - t0, "write_s": t1 - ts, "upload_s": t2 - t1,
                   "chain_layers": sum(s.depth for s in manifest.shards if s.base),
                   "accept_layers": layers1.get("accept", 0.0) - layers0.get("accept", 0.0) if layers1 else None}
            row["gb_per_s"] = row["bytes"] / 1e9 / (t2 - t0)
            row["written_gb_per_s"] = row["written"] / 1e9 / (t2 - t0)
            rows.append(row)
            print(f"step {step}{' (checkpoint)' if full else ''}: {100 * frac_elements:.2f}% of elements changed "
                  f"({100 * frac_bytes:.2f}% of bytes) | record {row['bytes'] / 1e6:.1f} MB in {row['files']} files "
                  f"({row['deltas']} deltas), the store wrote {row['written'] / 1e6:.1f} MB "
                  f"({100 * row['written'] / row['bytes']:.1f}%; serving weights {row['serving_written'] / 1e6:.1f} "
                  f"of {row['serving_bytes'] / 1e6:.1f} MB) | snapshot {row['snapshot_s']:.2f} s write "
                  f"{row['write_s']:.2f} s upload {row['upload_s']:.2f} s: {row['gb_per_s']:.3f} GB/s of record, "
                  f"{row['written_gb_per_s']:.3f} GB/s written | delta layers decoded to accept: "
                  f"{'?' if row['accept_layers'] is None else int(row['accept_layers'])} (chain depths "
                  f"{row['chain_layers']})", flush=True)
    finally:
        await repo.close()
        ws.send_signal(signal.SIGTERM)
        ws.wait(60)
        if s3 is not None:
            s3.stop()
    later = [r for r in rows if r["step"]]
    weights = [r for r in later if not r["checkpoint"]] or later
    result = {"date": datetime.date.today().isoformat(), "commit": commit(), "machine": platform.node(),
              "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0], "torch": torch.__version__,
              "threads": torch.get_num_threads(), "device": args.device, "preset": args.preset, "layers": args.layers,
              "dtype": args.dtype,
              "backend": args.backend, "method": args.method, "lr": args.lr, "delta": not args.no_delta,
              "records": rows}
    if weights:
        seconds = sum(r["snapshot_s"] + r["write_s"] + r["upload_s"] for r in weights)
        result |= {
            "changed_elements_mean": sum(r["changed_elements"] for r in later) / len(later),
            "changed_bytes_mean": sum(r["changed_bytes"] for r in later) / len(later),
            "weights_only_bytes": weights[0]["bytes"],
            "weights_only_written_mean": sum(r["written"] for r in weights) / len(weights),
            "weights_only_written_fraction": sum(r["written"] for r in weights) / sum(r["bytes"] for r in weights),
            "weights_only_gb_per_s": sum(r["bytes"] for r in weights) / 1e9 / seconds,
            "weights_only_written_gb_per_s": sum(r["written"] for r in weights) / 1e9 / seconds,
            "whole_gb_per_s": rows[0]["gb_per_s"],
        }
        print(f"steps 1..{args.steps}: {100 * result['changed_elements_mean']:.2f}% of the bf16 elements change per "
              f"step ({100 * result['changed_bytes_mean']:.2f}% of bytes); a weights-only record is "
              f"{result['weights_only_bytes'] / 1e6:.1f} MB of which the store writes "
              f"{result['weights_only_written_mean'] / 1e6:.1f} MB ({100 * result['weights_only_written_fraction']:.1f}%)"
              f"; {result['weights_only_gb_per_s']:.3f} GB/s of record ({result['weights_only_written_gb_per_s']:.3f}"
              f" GB/s written); the first, whole record {result['whole_gb_per_s']:.3f} GB/s")
    return result


async def beside(args: argparse.Namespace, work: pathlib.Path) -> dict:
    """--beside: the step's seconds alone, with the record in this process, with it in the record process."""
    import concurrent.futures
    import statistics
    torch.manual_seed(args.seed)
    trainer = make_trainer(args)
    rng = random.Random(args.seed)
    ws, address = start(["zerokl.services.weightstore", "--root", str(work / "weights"), "--port", "0"],
                        work / "weight-store.log", "the weight store")
    repo = RemoteWeights(grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20),
                                                                     ("grpc.max_receive_message_length", 16 << 20)]),
                         address)
    compute = concurrent.futures.ThreadPoolExecutor(1)     # the trainer service's one compute thread
    loop = asyncio.get_running_loop()
    dtype = trainer.model.dtype
    counter = iter(range(1_000_000))

    async def steps() -> list[float]:
        out = []
        for _ in range(args.steps):
            t = time.perf_counter()
            await loop.run_in_executor(compute, train_step, trainer, rng, args)
            out.append(time.perf_counter() - t)
        return out

    def spec() -> VersionSpec:
        return VersionSpec(step=trainer.step, metadata={META_RUN: RUN, META_STATE: "none"})

    async def in_process(stop: asyncio.Event, done: list[int]) -> None:
        bases = DeltaBases()
        while not stop.is_set():
            name, s = f"{RUN}-{next(counter):05d}", spec()
            snap = await loop.run_in_executor(compute, lambda: snapshot_checkpoint(
                trainer, run=RUN, lineage=[LineageEntry("init", 0)], weights_only=True))
            directory = pathlib.Path(tempfile.mkdtemp(dir=work))
            await asyncio.to_thread(write_snapshot, snap, directory)
            del snap
            async with bases.use() as base:
                manifest, _ = await publish_checkpoint(repo, directory, name, s, None if args.no_delta else base)
            await bases.offer(s.step, manifest, directory)
            done.append(manifest.total_size)
        await bases.close()

    worker = RecordWorker(trainer_parser().parse_args(["--weight-store", address]), deltas="off" if args.no_delta else "previous")

    async def in_worker(stop: asyncio.Event, done: list[int]) -> None:
        while not stop.is_set():
            name, s = f"{RUN}-{next(counter):05d}", spec()
            shared = await loop.run_in_executor(compute, lambda: export_shared(trainer.serving_state_dict(), name))
            try:
                directory = await worker.write(shared.export, trainer.model.config, dtype)
            finally:
                shared.close()
            manifest = await worker.upload(directory, name, s, s.step)
            done.append(manifest.total_size)

    arms: dict[str, dict] = {}
    try:
        # The record process is started (its imports) before any arm is timed.
        warm = export_shared(trainer.serving_state_dict(), "warm")
        await worker.write(warm.export, trainer.model.config, dtype)
        warm.close()
        await steps()   # warm-up: the first steps compile and allocate
        for arm, recorder in (("alone", None), ("record in the trainer's process", in_process),
                              ("record process", in_worker)):
            stop, done = asyncio.Event(), []
            task = asyncio.ensure_future(recorder(stop, done)) if recorder else None
            t0 = time.perf_counter()
            seconds = await steps()
            wall = time.perf_counter() - t0
            stop.set()
            if task is not None:
                await task
            arms[arm] = {"step_s": seconds, "median_step_s": statistics.median(seconds), "records": len(done),
                         "record_gb_per_s": sum(done) / 1e9 / wall}
            print(f"{arm}: median step {arms[arm]['median_step_s']:.3f} s over {len(seconds)} steps "
                  f"({', '.join(f'{x:.2f}' for x in seconds)}); {len(done)} records beside them, "
                  f"{arms[arm]['record_gb_per_s']:.3f} GB/s", flush=True)
    finally:
        await worker.close()
        await repo.close()
        ws.send_signal(signal.SIGTERM)
        ws.wait(60)
    alone = arms["alone"]["median_step_s"]
    return {"date": datetime.date.today().isoformat(), "commit": commit(), "machine": platform.node(),
            "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0], "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": args.device, "preset": args.preset, "layers": args.layers,
            "dtype": args.dtype, "delta": not args.no_delta, "beside": arms,
            "slowdown": {arm: a["median_step_s"] / alone for arm, a in arms.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=0, help="> 0: the preset with this many layers")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cpu", help="where the trainer steps (the record's snapshot, write and upload "
                                                   "are host work either way; default %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="training steps, each recorded (after the first record)")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="record the trainer state every N steps (step 0 included), as an RL job does")
    p.add_argument("--method", default="ppo", choices=("sft", "ppo"))
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default %(default)s: RL's)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--group", type=int, default=4, help="sequences per prompt")
    p.add_argument("--tokens", type=int, default=32, help="completion tokens per sequence")
    p.add_argument("--backend", default="local", choices=("local", "s3"))
    p.add_argument("--no-delta", action="store_true", help="record every file whole (as before issue 49)")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip reading each version back")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads here")
    p.add_argument("--workdir", default=None, help="where the checkpoints and the store go (default: a temp dir)")
    p.add_argument("--out", default=None, help="the JSON result to this path")
    p.add_argument("--beside", action="store_true",
                   help="time the steps alone and beside a record (in process, in the record process)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="zerokl-bench-record-", dir=args.workdir) as tmp:
        result = asyncio.run((beside if args.beside else bench)(args, pathlib.Path(tmp)))
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
