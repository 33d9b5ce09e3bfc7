"""The weight store's record of a trainer version: MB/s of write_checkpoint -> publish_checkpoint -> the store.

    python tools/bench/bench_record.py --preset small --dtype bfloat16 --threads 1 --out docs/bench/x.json

What an RL job's trainer does for every version it shares (issue 37): a snapshot of the version
taken at the step boundary (``snapshot_checkpoint``: the serving weights, and at checkpoint steps
the trainer state, fp32 masters, AdamW moments and counters, copied where they are), written to
a temporary directory (``write_snapshot``), then uploaded through a real `zerokl serve
weight-store` subprocess (local-directory storage, gRPC over loopback) by the trainer's own store
client (``RemoteWeights``, ``publish_checkpoint``). Timed per record: the snapshot (on the step's
path, under the trainer's lock), the write and the upload (in the background); MB/s is the
checkpoint's bytes over snapshot + write + upload. (Before commit 343a6d4 the record was
``write_checkpoint`` then the upload; the "before" figures in docs/perf.md are that.) ``--state weights`` records weights-only
versions (every RL step), ``full`` full ones (checkpoint steps), ``both`` alternates them.

The model is the preset's, drawn on the CPU by a seeded generator (any weights do); the trainer's
AdamW moments are made by one optimizer step on zero gradients, so a full record has the size of
a real one. Every record's bytes are read back from the store's files and compared with what was
written (sha256 per shard, as the manifest keeps them).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import shutil
import signal
import sys
import tempfile
import time

import grpc.aio
import torch

from zerokl.kernels.model import ModelConfig
from zerokl.services.trainer.checkpointing import (
    META_RUN,
    META_STATE,
    LineageEntry,
    RemoteWeights,
    publish_checkpoint,
    snapshot_checkpoint,
    write_snapshot,
)
from zerokl.services.trainer.trainer import TrainConfig, Trainer
from zerokl.services.weightstore.store import VersionSpec, file_sha256

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_rl_step import commit, start  # noqa: E402
from bench_train import build_model  # noqa: E402

RUN = "bench-record"


def make_trainer(args: argparse.Namespace) -> Trainer:
    config = ModelConfig.preset(args.preset)
    if args.layers:
        config = config.replace(num_hidden_layers=args.layers)
    model = build_model(config, "cpu", getattr(torch, args.dtype), args.seed)
    trainer = Trainer(model, TrainConfig(lr=1e-5))
    for p in trainer.params:            # one step on zero gradients: AdamW's moments exist, as in a job
        p.grad = torch.zeros_like(p)
    trainer.optim_step()
    return trainer


async def bench(args: argparse.Namespace, work: pathlib.Path) -> dict:
    trainer = make_trainer(args)
    store_root = work / "weights"
    ws, address = start(["zerokl.services.weightstore", "--root", str(store_root), "--port", "0"],
                        work / "weight-store.log", "the weight store")
    repo = RemoteWeights(grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20),
                                                                     ("grpc.max_receive_message_length", 16 << 20)]),
                         address)
    kinds = {"weights": [True], "full": [False], "both": [True, False]}[args.state]
    rows = []
    try:
        for i in range(args.repeats):
            for weights_only in kinds:
                version = f"{RUN}-{i:03d}-{'w' if weights_only else 'f'}"
                lineage = [LineageEntry("init", 0), LineageEntry(version, trainer.step)]
                spec = VersionSpec(step=trainer.step, metadata={META_RUN: RUN,
                                                                META_STATE: "none" if weights_only else "full"})
                tmp = work / f"ckpt-{version}"
                t0 = time.perf_counter()
                snapshot = snapshot_checkpoint(trainer, run=RUN, lineage=lineage, weights_only=weights_only)
                ts = time.perf_counter()
                write_snapshot(snapshot, tmp)
                del snapshot
                t1 = time.perf_counter()
                manifest, created = await publish_checkpoint(repo, tmp, version, spec)
                t2 = time.perf_counter()
                assert created
                nbytes = manifest.total_size
                stored = {s.name: file_sha256(store_root / "versions" / version / s.name) for s in manifest.shards}
                assert stored == {s.name: s.sha256 for s in manifest.shards} == \
                    {p.name: file_sha256(p) for p in tmp.iterdir()}, "the store's bytes are not what was written"
                shutil.rmtree(tmp)
                shutil.rmtree(store_root / "versions" / version)   # the box's disk: keep one version at a time
                row = {"version": version, "weights_only": weights_only, "bytes": nbytes, "snapshot_s": ts - t0,
                       "write_s": t1 - ts,
                       "upload_s": t2 - t1, "total_s": t2 - t0, "mb_per_s": nbytes / 1e6 / (t2 - t0)}
                rows.append(row)
                print(f"{'weights-only' if weights_only else 'full'} record {i + 1}: {nbytes / 1e6:.0f} MB, snapshot "
                      f"{row['snapshot_s']:.2f} s, write {row['write_s']:.2f} s, upload {row['upload_s']:.2f} s, total {row['total_s']:.2f} s "
                      f"({row['mb_per_s']:.0f} MB/s)", flush=True)
    finally:
        await repo.close()
        ws.send_signal(signal.SIGTERM)
        ws.wait(60)
    result = {"date": datetime.date.today().isoformat(), "commit": commit(), "machine": platform.node(),
              "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0], "torch": torch.__version__,
              "threads": torch.get_num_threads(), "preset": args.preset, "layers": args.layers,
              "dtype": args.dtype, "records": rows}
    for weights_only in kinds:
        mine = [r for r in rows if r["weights_only"] == weights_only]
        key = "weights_only" if weights_only else "full"
        result[f"{key}_mb_per_s"] = sum(r["bytes"] for r in mine) / 1e6 / sum(r["total_s"] for r in mine)
        print(f"{key}: {mine[0]['bytes'] / 1e6:.0f} MB a record, {result[f'{key}_mb_per_s']:.0f} MB/s over "
              f"{len(mine)} records")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=0, help="> 0: the preset with this many layers")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--state", default="both", choices=("weights", "full", "both"),
                   help="weights-only records, full ones (trainer state too), or both alternating")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads here")
    p.add_argument("--workdir", default=None, help="where the checkpoints and the store go (default: a temp dir)")
    p.add_argument("--out", default=None, help="the JSON result to this path")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="zerokl-bench-record-", dir=args.workdir) as tmp:
        result = asyncio.run(bench(args, pathlib.Path(tmp)))
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
