"""End to end on a GPU (`small` config, bf16): invariant vs non-invariant, side by side in one run.

    python tools/bench/bench_e2e.py --out docs/bench

1. Decode: the same Engine serving B requests (batch B decode after their prefills), once
   on the Triton backend (zerokl's invariant kernels) and once on the `stock` backend (plain
   torch: cuBLAS, SDPA-free gather+bmm attention), alternating, median of the repeats.
   Reported: generated tokens/s in the decode phase (steps that run only decode tokens) and
   the ratio invariant / stock. The run also checks that one request alone gives the same
   tokens and logprobs as inside the batch (torch.equal), for each arm.
2. Trainer: forward + backward of a next-token loss over B x S tokens, tokens/s with the
   invariant forward (Triton backend; backward by plain torch GEMMs / stock recompute)
   vs the plain torch forward/backward (stock backend). Median of the repeats.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import statistics
import sys
import time

import torch

import zerokl.kernels as K
from zerokl.kernels.model import Model, ModelConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from engine_steps import timed_step  # noqa: E402
from provenance import commit  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_requests(n: int, max_tokens: int, vocab: int, seed: int = 0):
    from zerokl.services.engine.types import GenerateRequest
    from zerokl.vocab import SamplingOptions
    rng = random.Random(seed)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))),
                            SamplingOptions(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True))
            for i in range(n)]


def run_engine(model, reqs, backend: str, budget: int):
    """(decode seconds, decode tokens, total seconds, outputs) for one pass of reqs."""
    from zerokl.services.engine.engine import Engine
    from zerokl.services.engine.types import EngineConfig
    with K.use_backend(backend):
        eng = Engine(model, EngineConfig(max_num_batched_tokens=budget, num_blocks=2048, max_num_seqs=len(reqs)))
        for r in reqs:
            eng.add_request(r)
        outs: dict[str, tuple[list, list]] = {r.request_id: ([], []) for r in reqs}
        dec_t, dec_tok = 0.0, 0
        _sync()
        t_all = time.perf_counter()
        while eng.has_work():
            decode_only = not eng.waiting and eng.running
            dt, n = timed_step(eng, outs, _sync)
            if decode_only:
                dec_t += dt
                dec_tok += n
        total = time.perf_counter() - t_all
    return dec_t, dec_tok, total, outs


def bench_decode(model, args) -> dict:
    reqs = make_requests(args.batch, args.max_tokens, model.config.vocab_size)
    for b in ("triton", "stock"):
        run_engine(model, reqs[:4], b, args.budget)               # warm-up: compile, allocator
    rates = {"triton": [], "stock": []}
    outs = {}
    for _ in range(args.repeats):
        for b in ("triton", "stock"):
            dt, n, _, o = run_engine(model, reqs, b, args.budget)
            rates[b].append(n / dt)
            outs[b] = o
    alone_ok = {}
    for b in ("triton", "stock"):
        ok = True
        for r in reqs[:2]:
            _, _, _, o = run_engine(model, [r], b, args.budget)
            ok &= o[r.request_id] == outs[b][r.request_id]
        alone_ok[b] = ok
    med = {b: statistics.median(v) for b, v in rates.items()}
    res = {"batch": args.batch, "max_tokens": args.max_tokens, "decode_tok_s": med, "all": rates,
           "ratio": med["triton"] / med["stock"], "alone_equals_batch": alone_ok}
    print(f"decode batch {args.batch}: invariant {med['triton']:.0f} tok/s, stock {med['stock']:.0f} tok/s, "
          f"ratio {res['ratio']:.3f}; alone==batch {alone_ok}", flush=True)
    return res


def bench_trainer(model, args) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.train_batch, args.train_seq + 1), device="cuda", generator=g)
    model.train()

    def step():
        logits = model(ids[:, :-1])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])
        (-lp.mean()).backward()
        for p in model.parameters():
            p.grad = None

    times = {"triton": [], "stock": []}
    for b in ("triton", "stock"):
        t0 = time.perf_counter()
        with K.use_backend(b):
            step()
        torch.cuda.synchronize()
        print(f"  trainer warm-up {b}: {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(args.repeats):
        for b in ("triton", "stock"):
            with K.use_backend(b):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.train_steps):
                    step()
                torch.cuda.synchronize()
                times[b].append((time.perf_counter() - t0) / args.train_steps)
    model.eval()
    tokens = args.train_batch * args.train_seq
    tps = {b: tokens / statistics.median(v) for b, v in times.items()}
    res = {"batch": args.train_batch, "seq": args.train_seq, "tokens_per_s": tps, "ratio": tps["triton"] / tps["stock"],
           "step_s": times}
    print(f"trainer {args.train_batch}x{args.train_seq}: invariant fwd {tps['triton']:.0f} tok/s, plain {tps['stock']:.0f} "
          f"tok/s, ratio {res['ratio']:.3f}", flush=True)
    return res


def profile_trainer(model, args) -> None:
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.train_batch, args.train_seq + 1), device="cuda", generator=g)
    model.train()
    for b in ("triton", "stock"):
        with K.use_backend(b):
            for prof_it in range(2):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    t0 = time.perf_counter()
                    logits = model(ids[:, :-1])
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])
                    (-lp.mean()).backward()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                for p in model.parameters():
                    p.grad = None
            print(f"== {b}: forward {t1 - t0:.2f} s, loss+backward {t2 - t1:.2f} s", flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60), flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per engine step (prefill chunking)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: decode,trainer")
    ap.add_argument("--profile", action="store_true", help="profile one trainer step per arm (top ops) and exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    model = Model(ModelConfig.preset(args.preset), seed=0, dtype=torch.bfloat16).cuda().eval()
    stamp = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name(), "device_type": K.device_name(),
             "commit": commit(), "numerics": K.__version__, "preset": args.preset}
    print(stamp, flush=True)
    res = {"stamp": stamp}
    skip = set(args.skip.split(","))
    if args.profile:
        profile_trainer(model, args)
        return 0
    t0 = time.perf_counter()
    if "trainer" not in skip:
        res["trainer"] = bench_trainer(model, args)
        print(f"  trainer part took {time.perf_counter() - t0:.0f} s", flush=True)
    if "decode" not in skip:
        res["decode"] = bench_decode(model, args)
        print(f"  decode part took {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"bench-e2e-{stamp['device_type']}"
        (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        parts = [p for p in ("decode", "trainer") if p in res]
        fig, axes = plt.subplots(1, len(parts), figsize=(4 * len(parts), 3))
        axes = [axes] if len(parts) == 1 else axes
        for ax, p in zip(axes, parts):
            vals = res[p]["decode_tok_s" if p == "decode" else "tokens_per_s"]
            ax.bar(["zerokl (invariant)", "plain torch"], [vals["triton"], vals["stock"]], color=["#3b7dd8", "#999"])
            ax.set_title(f"{p}: ratio {res[p]['ratio']:.2f}", fontsize=9)
            ax.set_ylabel("tokens / s")
        fig.suptitle(f"{stamp['device']} · {args.preset} bf16 · commit {stamp['commit']} · {stamp['date']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{tag}.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
