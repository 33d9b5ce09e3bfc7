"""Generation throughput of the invariant engine vs the same engine on plain torch ops.

    python tools/bench/bench_engine.py                    # tiny model, CPU
    python tools/bench/bench_engine.py --out docs/bench   # also write markdown + PNG

Both arms run the same requests through the same Engine; only the kernel backend
differs (`torch`: zerokl's invariant ops; `stock`: plain torch, what a stock server
computes). Arms alternate over repetitions in one process, and the figure reported is
the ratio of their median times. The same run checks the invariance claim: one request
alone vs inside the batch, torch.equal on tokens and logprobs, for each arm.
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

import zerokl.kernels as K
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402


def requests(n: int, max_tokens: int, seed: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(3, 64) for _ in range(rng.randint(16, 64))),
                            SamplingOptions(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True))
            for i in range(n)]


def run(model: Model, reqs, backend: str, budget: int):
    with K.use_backend(backend):
        eng = Engine(model, EngineConfig(max_num_batched_tokens=budget, num_blocks=1024))
        start = time.perf_counter()
        outs = run_to_completion(eng, reqs)
        elapsed = time.perf_counter() - start
    result = {rid: ([t for d in ds for t in d.token_ids], [x for d in ds for x in d.logprobs]) for rid, ds in outs.items()}
    return elapsed, result


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256, help="tokens per engine step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = Model(ModelConfig.preset("tiny"), seed=0)
    reqs = requests(args.requests, args.max_tokens)
    times = {"torch": [], "stock": []}
    batch_out = {}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for backend in ("torch", "stock"):
            t, out = run(model, reqs, backend, args.budget)
            times[backend].append(t)
            batch_out[backend] = out
    invariant = {}
    for backend in ("torch", "stock"):
        alone = {r.request_id: run(model, [r], backend, args.budget)[1][r.request_id] for r in reqs[:4]}
        invariant[backend] = all(alone[k] == batch_out[backend][k] for k in alone)
    tokens = args.requests * args.max_tokens
    med = {b: statistics.median(v) for b, v in times.items()}
    commit_ = commit()
    stamp = f"{datetime.date.today()} · {K.device_name()} · tiny · {args.threads} thread(s) · commit {commit_}"
    lines = [f"# Engine: invariant vs stock ({K.device_name()})", "", stamp, "",
             f"{args.requests} requests, {args.max_tokens} sampled tokens each (temperature 1), "
             f"{args.budget}-token steps, median of {args.repeats} alternating runs.", "",
             "| arm | median s | generated tok/s | alone == in batch (4 requests) |", "|---|---|---|---|"]
    for b in ("torch", "stock"):
        lines.append(f"| {'zerokl (invariant)' if b == 'torch' else 'stock torch'} | {med[b]:.2f} | "
                     f"{tokens / med[b]:.0f} | {'yes' if invariant[b] else 'NO'} |")
    lines += ["", f"**invariant throughput / stock throughput = {med['stock'] / med['torch']:.2f}x**"]
    print("\n".join(lines))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"engine-{K.device_name()}"
        (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 2.6))
        ax.bar(["zerokl (invariant)", "stock torch"], [tokens / med["torch"], tokens / med["stock"]], color=["#3b7dd8", "#999"])
        ax.set_ylabel("generated tokens / s")
        ax.set_title(stamp, fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{tag}.png", dpi=120)
        print(f"wrote {out / tag}.md and .png")


if __name__ == "__main__":
    main()
