"""The indexer's decode-time top-k (`topk_positions(scores, None, k)`, the radix-select kernel), swept over its tile
and warps, beside torch.topk, at decode shapes (issue 50: the step at 2,048 context vs 64).

    python tools/bench/bench_topk.py --json out.json       # one GPU, ~1 minute

Each row: T rows of W scores, k chosen. Every variant's answer must equal the shipped kernel's bit for bit (the
answer is a set, so the tile cannot change it; checked, not assumed). Times are per call, from a CUDA graph of
REPEATS calls replayed (the decode step runs from a graph, so launch overhead is not what is measured), median of
5 replays. torch.topk (values and indices, unsorted, not tie-deterministic) is the floor an invariant select is
held against.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys

import torch

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
    from zerokl.kernels.triton import topk as topk_module
    kernel = topk_module._topk_columns_kernel
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    # (W, k): `small` (index_topk 512) at decode contexts past 512, GLM-5 (index_topk 2,048) at 4k and 16k.
    shapes = [(1024, 512), (2048, 512), (4096, 512), (8192, 512), (4096, 2048), (16384, 2048)]
    variants = [(block, warps) for block in (1024, 2048, 4096) for warps in (4, 8, 16)]
    shipped = (topk_module.TOPK_COLUMNS_BLOCK, 8)
    rows = []
    for w, k in shapes:
        # ReLU-like indexer scores: many exact zeros (ties) beside positive values, as the model makes them.
        scores = torch.relu(torch.randn(args.rows, w, device=device, generator=g)).contiguous()
        want = topk_module.topk_positions(scores, None, k)
        row = {"W": w, "k": k, "T": args.rows, "variants": {}}
        for block, warps in variants:
            out = torch.empty((args.rows, k), dtype=torch.int64, device=device)

            def call(block=block, warps=warps, out=out):
                kernel[(args.rows,)](scores, out, w, k, scores.stride(0), out.stride(0), BLOCK=block, num_warps=warps)
            call()
            torch.cuda.synchronize()
            same = bool(torch.equal(out, want))
            row["variants"][f"{block}/{warps}"] = {"us": 1e6 * _graph_time(call), "same_bits": same}
        row["torch_topk_us"] = 1e6 * _graph_time(lambda: torch.topk(scores, k, dim=1, sorted=False))
        base = row["variants"][f"{shipped[0]}/{shipped[1]}"]["us"]
        best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
        row["shipped_us"], row["best"], row["best_us"] = base, best[0], best[1]["us"]
        rows.append(row)
        print(f"T {args.rows} W {w:6d} k {k:5d}: shipped {base:7.1f} us, best {best[0]:>9s} {best[1]['us']:7.1f} us "
              f"({base / best[1]['us']:.2f}x), torch.topk {row['torch_topk_us']:6.1f} us; every variant the same bits: "
              f"{all(v['same_bits'] for v in row['variants'].values())}", flush=True)
        print("   " + "  ".join(f"{name} {v['us']:.1f}" for name, v in row["variants"].items()), flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "commit": commit(),
            "torch": torch.__version__, "shipped": f"{shipped[0]}/{shipped[1]}"}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
