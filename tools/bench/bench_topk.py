"""The indexer's decode-time top-k (`topk_positions(scores, None, k)`, the radix-select kernel) at its tiles and
beside torch.topk, at decode shapes (issue 50: the step at 2,048 context vs 64).

    python tools/bench/bench_topk.py --json out.json       # one GPU, ~1 minute

Each row: T rows of W scores, k chosen. `topk_positions` launches the kernel at the tile its wrapper picks for W.
The kernel at every tile of the sweep must give the sort path's bits (positions given: the bitonic tournament); the
answer is a set, so no tile can change it, and this checks it rather than assuming it. The fastest tile says whether
the wrapper's pick is right. Times are per call, from a CUDA graph of REPEATS calls replayed (the decode step runs
from a graph, so launch overhead is not what is measured), median of 5 replays. torch.topk (values and indices,
unsorted, not tie-deterministic) is the floor an invariant select is held against. History (docs/perf.md): 8-bit
digits replaced 4-bit ones on 2026-12-07 at the same bits, 1.21x to 1.91x faster on an H100.
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

from zerokl.kernels.triton import topk as topk_module

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402

REPEATS = 20


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
    # the tiles (scores a pass, warps) the wrapper picks among, and two beside them
    tiles = [(1024, 4), (1024, 8), (2048, 8), (2048, 16), (4096, 16), (4096, 32)]
    rows = []
    for w, k in shapes:
        # ReLU-like indexer scores: many exact zeros (ties) beside positive values, as the model makes them.
        scores = torch.relu(torch.randn(args.rows, w, device=device, generator=g)).contiguous()
        # the sort path's answer (positions given: the bitonic tournament), an algorithm of its own
        want = topk_module.topk_positions(scores, torch.arange(w, device=device).expand(args.rows, w).contiguous(), k)
        row = {"W": w, "k": k, "T": args.rows, "tiles": {}}
        for block, warps in tiles:
            out = torch.empty((args.rows, k), dtype=torch.int64, device=device)

            def call(block=block, warps=warps, out=out):
                topk_module._topk_columns_kernel[(args.rows,)](scores, out, w, k, scores.stride(0), out.stride(0),
                                                               BLOCK=block, num_warps=warps)
            call()
            torch.cuda.synchronize()
            row["tiles"][f"{block}/{warps}"] = {"us": 1e6 * _graph_time(call), "same_bits": bool(torch.equal(out, want))}
        row["shipped_us"] = 1e6 * _graph_time(lambda: topk_module.topk_positions(scores, None, k))
        row["torch_topk_us"] = 1e6 * _graph_time(lambda: torch.topk(scores, k, dim=1, sorted=False))
        best = min(row["tiles"].items(), key=lambda kv: kv[1]["us"])
        row["best"], row["best_us"] = best[0], best[1]["us"]
        rows.append(row)
        print(f"T {args.rows} W {w:6d} k {k:5d}: topk_positions {row['shipped_us']:7.1f} us, best tile {best[0]:>7s} "
              f"{best[1]['us']:7.1f} us, torch.topk {row['torch_topk_us']:6.1f} us "
              f"({row['shipped_us'] / row['torch_topk_us']:.2f}x); every tile the same bits: "
              f"{all(v['same_bits'] for v in row['tiles'].values())}", flush=True)
        print("   " + "  ".join(f"{name} {v['us']:.1f}" for name, v in row["tiles"].items()), flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "commit": commit(),
            "torch": torch.__version__, "triton": triton.__version__}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
