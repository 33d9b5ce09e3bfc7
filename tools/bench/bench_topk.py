"""The indexer's decode-time top-k (`topk_positions(scores, None, k)`, the radix-select kernel) beside a candidate
with 8-bit digits and beside torch.topk, at decode shapes (issue 50: the step at 2,048 context vs 64).

    python tools/bench/bench_topk.py --json out.json       # one GPU, ~1 minute

Each row: T rows of W scores, k chosen. Every variant's answer must equal the shipped kernel's bit for bit (the
answer is a set, so neither the tile nor the digit width can change it; checked, not assumed). Times are per call,
from a CUDA graph of REPEATS calls replayed (the decode step runs from a graph, so launch overhead is not what is
measured), median of 5 replays. torch.topk (values and indices, unsorted, not tie-deterministic) is the floor an
invariant select is held against. The shipped kernel's tile was swept on 2026-12-07 (docs/perf.md, tenth stop):
1,024 scores with 8 warps was the fastest of nine at every shape; the candidate replaces it once it is faster.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys

import torch
import triton
import triton.language as tl

from zerokl.kernels.triton import topk as topk_module
from zerokl.kernels.triton.topk import _monotone_key

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402

REPEATS = 20


@triton.jit(do_not_specialize=["W", "K"])
def _topk_columns_radix8_kernel(score_ptr, out_ptr, W, K, s_score, s_out, BLOCK: tl.constexpr):
    """Candidate (not shipped): the shipped radix select with 8-bit digits, one 256-bin count a pass (tl.histogram),
    and the count of entries above the threshold gathered on the way: 4 counting passes and the write pass, where
    the shipped kernel makes 8 + 1 + 1. The same answer by construction (the same threshold, the same tie rule);
    the bench checks it."""
    row = tl.program_id(0).to(tl.int64)
    base = score_ptr + row * s_score
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 512)
    tau = tl.zeros((), dtype=tl.int64)            # the threshold's digits chosen so far
    above = tl.zeros((), dtype=tl.int32)          # valid entries known to be above the threshold
    n_valid = tl.zeros((), dtype=tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        counts = tl.zeros((512,), dtype=tl.int32)
        for start in range(0, W, BLOCK):
            j = start + offs
            key, valid = _monotone_key(tl.load(base + j, mask=j < W, other=float("-inf")).to(tl.float32))
            match = valid & ((key >> (shift + 8)) == (tau >> (shift + 8)))       # the prefix chosen so far
            digit = tl.where(match, (key >> shift) & 255, 256).to(tl.int32)        # bin 256: not counted
            counts += tl.histogram(digit, 512)
        counts = tl.where(bins < 256, counts, 0)
        total = tl.sum(counts)
        if p == 0:
            n_valid = total
        suffix = total - tl.cumsum(counts, axis=0) + counts                      # matching entries with digit >= d
        step = tl.sum(((above + suffix >= K) & (bins >= 1) & (bins < 256)).to(tl.int32))
        above += tl.sum(tl.where(bins > step, counts, 0))
        tau = tau + (step.to(tl.int64) << shift)
    take_all = n_valid <= K
    need = K - above
    written = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for start in range(0, W, BLOCK):
        j = start + offs
        key, valid = _monotone_key(tl.load(base + j, mask=j < W, other=float("-inf")).to(tl.float32))
        eq = valid & (key == tau)
        tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0)
        sel = valid & ((key > tau) | (eq & (tie_rank <= need)))
        sel = tl.where(take_all, valid, sel)
        slot = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * s_out + slot, j.to(tl.int64), mask=sel)
        written += tl.sum(sel.to(tl.int32))
        ties += tl.sum(eq.to(tl.int32))
    for start in range(0, K, BLOCK):
        i = start + offs
        tl.store(out_ptr + row * s_out + i, tl.full((BLOCK,), -1, dtype=tl.int64), mask=(i >= written) & (i < K))


def _graph_time(fn, replays: int = 5) -> float:
    """Seconds per call of fn, from a CUDA graph of REPEATS calls (median of `replays` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / REPEATS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64, help="T: decode rows (default %(default)s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    # (W, k): `small` (index_topk 512) at decode contexts past 512, GLM-5 (index_topk 2,048) at 4k and 16k.
    shapes = [(1024, 512), (2048, 512), (4096, 512), (8192, 512), (4096, 2048), (16384, 2048)]
    shipped = ("radix4", topk_module.TOPK_COLUMNS_BLOCK, 8)
    kernels = {"radix4": topk_module._topk_columns_kernel, "radix8": _topk_columns_radix8_kernel}
    # The shipped kernel at its tile and the next best of the 2026-12-07 sweep; the candidate at five tiles.
    variants = [shipped, ("radix4", 2048, 16)] + [("radix8", b, w) for b, w in
                                                  ((1024, 4), (1024, 8), (2048, 8), (2048, 16), (4096, 16))]
    rows = []
    for w, k in shapes:
        # ReLU-like indexer scores: many exact zeros (ties) beside positive values, as the model makes them.
        scores = torch.relu(torch.randn(args.rows, w, device=device, generator=g)).contiguous()
        want = topk_module.topk_positions(scores, None, k)
        row = {"W": w, "k": k, "T": args.rows, "variants": {}}
        for name, block, warps in variants:
            out = torch.empty((args.rows, k), dtype=torch.int64, device=device)

            def call(kernel=kernels[name], block=block, warps=warps, out=out):
                kernel[(args.rows,)](scores, out, w, k, scores.stride(0), out.stride(0), BLOCK=block, num_warps=warps)
            call()
            torch.cuda.synchronize()
            row["variants"][f"{name} {block}/{warps}"] = {"us": 1e6 * _graph_time(call),
                                                         "same_bits": bool(torch.equal(out, want))}
        row["torch_topk_us"] = 1e6 * _graph_time(lambda: torch.topk(scores, k, dim=1, sorted=False))
        base = row["variants"]["%s %d/%d" % shipped]["us"]
        best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
        row["shipped_us"], row["best"], row["best_us"] = base, best[0], best[1]["us"]
        rows.append(row)
        print(f"T {args.rows} W {w:6d} k {k:5d}: shipped {base:7.1f} us, best {best[0]:>17s} {best[1]['us']:7.1f} us "
              f"({base / best[1]['us']:.2f}x), torch.topk {row['torch_topk_us']:6.1f} us; every variant the same bits: "
              f"{all(v['same_bits'] for v in row['variants'].values())}", flush=True)
        print("   " + "  ".join(f"{name} {v['us']:.1f}" for name, v in row["variants"].items()), flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "commit": commit(),
            "torch": torch.__version__, "triton": triton.__version__, "shipped": "%s %d/%d" % shipped}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
