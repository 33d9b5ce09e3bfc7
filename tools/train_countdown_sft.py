"""Train the SFT checkpoint `zerokl demo` starts from: the `tiny` model on countdown demonstrations.

    python tools/train_countdown_sft.py            # writes zerokl/assets/countdown-sft (~25 min on 2 CPU cores)

Deterministic: the torch backend's forward and the CPU trainer's backward and AdamW
step have the same bits on every CPU and thread count (NUMERICS.md), and the data order
comes from --seed, so under one numerics version and trainer the same command writes the
same bytes. sft.json records the version and the file's sha256: the shipped checkpoint was
made under numerics 0.2.0, whose bits later versions changed, so a run today writes other
bytes (a checkpoint of the same recipe). The demo's RL phase then starts from a model that
answers in the right format and solves a few problems.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import random
import sys
import time

import torch
from tqdm import tqdm

from zerokl.tasks.setup import countdown_config, countdown_data, demonstration_batch, greedy_accuracy
from zerokl.kernels import __version__, fingerprint
from zerokl.kernels.model import Model
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer

DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "zerokl" / "assets" / "countdown-sft"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    train, test, tok = countdown_data(args.seed)
    trainer = Trainer(Model(countdown_config(tok), seed=args.seed),
                      TrainConfig(lr=args.lr, warmup_steps=50, total_steps=args.steps, seed=args.seed))
    rng = random.Random(args.seed)
    t0, curve = time.perf_counter(), []
    bar = tqdm(range(1, args.steps + 1), desc="SFT", unit="step")
    for step in bar:
        loss = trainer.sft_step(demonstration_batch(rng.sample(train, args.batch), tok))["loss"]
        bar.set_postfix(loss=f"{loss:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            acc = greedy_accuracy(trainer.serving_model(), test[:100], tok)
            curve.append({"step": step, "loss": loss, "test_accuracy": acc})
            tqdm.write(f"step {step} loss {loss:.4f} greedy test accuracy {acc:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    trainer.serving_model().save_pretrained(args.out)
    weights = (args.out / "model.safetensors").read_bytes()
    (args.out / "sft.json").write_text(json.dumps({
        "command": " ".join(["python tools/train_countdown_sft.py", *(sys.argv[1:] if argv is None else argv)]),
        "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
        "numerics_version": __version__, "numerics_fingerprint": fingerprint(),
        "model.safetensors sha256": hashlib.sha256(weights).hexdigest(),
        "wall_time_s": round(time.perf_counter() - t0), "curve": curve,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
