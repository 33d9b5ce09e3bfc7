"""MLA attention forward + backward on a GPU: zerokl's fused Triton backward vs the stock path.

    python tools/bench/bench_attention_backward.py --json $OUT/attn_bwd.json
    python tools/bench/bench_attention_backward.py --sweep   # also: per-kernel times, backward configs

Absorbed MLA (bf16 inputs, fp32 out) in the training layout, one layer's attention:
  small: H=16, R=256, P=32, 8 x 512 tokens, index_topk 512 (every row dense causal, no key table)
  glm5:  H=64, R=512, P=64, 4 x 4096 tokens, index_topk 2048 (rows past 2048 attend a random
         ascending selection of 2048 keys of their prefix; the rest their whole prefix)
zerokl: ops.mla_attention_sequences under the Triton backend (forward writing its LSE, the
fused dq / dkv kernels of kernels/zerokl/kernels/triton/attention_backward.py). stock: the same op under the
stock backend (gather + bmm + softmax, differentiated by torch autograd: the backward the
Triton forward used before). Each row: forward + backward median time, achieved TFLOP/s of
the attention arithmetic (fwd 2(2R+P), bwd 2(5R+3P) per (query, head, key)), peak memory,
and the gradients' relative error against float64 autograd (where it fits in memory) and
zerokl's against stock's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import triton.testing

from zerokl.kernels import ops, use_backend
from zerokl.kernels.triton import attention as zt_attention
from zerokl.kernels.triton.attention_backward import mla_attention_backward, mla_attention_backward_reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402

CASES = {  # name: (H, R, P, batch, seq, index_topk)
    "small": (16, 256, 32, 8, 512, 512),
    "glm5": (64, 512, 64, 4, 4096, 2048),
    "glm5-16k": (64, 512, 64, 1, 16384, 2048),
}


def make_case(name: str, dev):
    h, r, p, b, s, topk = CASES[name]
    g = torch.Generator(device=dev).manual_seed(0)
    t = b * s
    positions = torch.arange(s, device=dev).repeat(b)
    ql = torch.randn(t, h, r, device=dev, generator=g).to(torch.bfloat16)
    qr = torch.randn(t, h, p, device=dev, generator=g).to(torch.bfloat16)
    kv = torch.randn(t, r, device=dev, generator=g).to(torch.bfloat16)
    kr = torch.randn(t, p, device=dev, generator=g).to(torch.bfloat16)
    grad = torch.randn(t, h, r, device=dev, generator=g)
    selection = None
    if s > topk:                                  # the training layer's [N, index_topk] selection
        cols = torch.arange(s, device=dev)
        start = (torch.arange(t, device=dev) - positions).view(-1, 1)
        causal = cols <= positions.view(-1, 1)
        score = torch.rand(t, s, device=dev, generator=g).masked_fill(~causal, -1.0)
        chosen = torch.topk(score, topk, dim=1).indices.sort(dim=1).values
        keep = torch.gather(causal, 1, chosen)
        selection = torch.where(keep, start + chosen, torch.full_like(chosen, -1))
        selection = torch.sort(torch.where(selection < 0, torch.full_like(selection, 1 << 62), selection), 1).values
        selection = torch.where(selection == 1 << 62, torch.full_like(selection, -1), selection)
        pairs = int((selection >= 0).sum())
    else:
        pairs = int((positions + 1).sum())
    return (ql, qr, kv, kr, positions, selection, grad), pairs * h, (h, r, p)


def fwd_bwd(backend: str, args, scale: float):
    ql, qr, kv, kr, positions, selection, grad = args
    leaves = [x.detach().requires_grad_() for x in (ql, qr, kv, kr)]

    def run():
        for x in leaves:
            x.grad = None
        with use_backend(backend):
            out = ops.mla_attention_sequences(*leaves, positions, scale, selection)
        out.backward(grad)
        return [x.grad for x in leaves]
    return run


def reference_grads(args, scale: float, limit_bytes: float = 16e9):
    """float64 autograd gradients (one-shot softmax over the explicit list), when they fit."""
    ql, qr, kv, kr, positions, selection, grad = args
    if selection is None:
        width = int(positions.max()) + 1
        cols = torch.arange(width, device=positions.device)
        start = (torch.arange(positions.shape[0], device=positions.device) - positions).view(-1, 1)
        selection = torch.where(cols <= positions.view(-1, 1), start + cols, torch.full_like(start + cols, -1))
    t, h, r = ql.shape
    if 3.0 * t * selection.shape[1] * (r + h) * 8 > limit_bytes:
        return None
    return mla_attention_backward_reference(ql, qr, kv, kr, selection, grad, scale)


def pairs_flops_bwd(pairs: int, r: int, p: int) -> float:
    """Backward FLOPs: recomputed scores, dp, dq, dkv (two products), dk_rope per (query, head, key)."""
    return pairs * 2.0 * (5 * r + 3 * p)


def measure(name: str, backend: str, args, scale: float, flops: float) -> dict:
    row = {"case": name, "impl": "zerokl-triton" if backend == "triton" else "stock"}
    fn = fwd_bwd(backend, args, scale)
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = [g.float() for g in fn()]
        torch.cuda.synchronize()
        row["peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        sec = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
        row.update(ms=round(sec * 1e3, 3), tflops=round(flops / sec / 1e12, 1))
        return row | {"grads": grads}
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return row | {"error": "out of memory"}


def kernel_times(args, scale: float) -> dict:
    """Per-kernel CUDA time (ms per fwd+bwd) of the zerokl path, from the torch profiler."""
    fn = fwd_bwd("triton", args, scale)
    fn()
    torch.cuda.synchronize()
    n = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.key[:48]] = round(ev.device_time_total / 1e3 / n, 3)
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:8])


def sweep_configs(name: str, args, scale: float, flops_bwd: float) -> list[dict]:
    """Backward alone (both kernels and the transpose) per (dq heads, dkv keys, dkv rows)."""
    ql, qr, kv, kr, positions, selection, grad = args
    out, lse = zt_attention.mla_attention_sequences(ql, qr, kv, kr, positions, scale, selection, return_lse=True)
    rows = []
    # causal: (dq heads, dkv keys, dkv rows); a key list: (dq heads, dkv parts keys, dkv parts heads)
    configs = ((16, 16, 32), (16, 32, 32), (16, 16, 64), (64, 16, 32)) if selection is None else \
        ((16, 32, 16), (16, 32, 32), (16, 64, 16), (16, 64, 32), (16, 16, 64), (16, 32, 64))
    for bh, bk, nr in configs:
        if selection is None:
            row, kw = {"case": name, "block_h": bh, "block_k": bk, "rows": nr}, dict(block_k=bk, rows=nr, block_h=bh)
        else:
            row = {"case": name, "block_h": bh, "part_keys": bk, "part_heads": nr}
            kw = dict(block_h=bh, part_keys=bk, part_heads=nr)
        try:
            fn = lambda: mla_attention_backward(ql, qr, kv, kr, selection, positions, out, lse, grad, scale,  # noqa: E731
                                                **kw)
            fn()
            sec = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
            row.update(bwd_ms=round(sec * 1e3, 3), bwd_tflops=round(flops_bwd / sec / 1e12, 1))
        except Exception as e:  # a config that does not compile or fit is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--cases", default="small,glm5")
    ap.add_argument("--sweep", action="store_true", help="also per-kernel times and backward configs")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock (plain torch) arm and the float64 "
                    "reference (at 16k tokens neither fits)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(), "commit": commit(), "torch": torch.__version__,
               "triton": triton.__version__, "rows": [], "kernels": {}, "sweep": []}
    for name in a.cases.split(","):
        args, pairs, (h, r, p) = make_case(name, dev)
        flops = pairs * 2.0 * (2 * r + p) + pairs_flops_bwd(pairs, r, p)
        scale = (r // 4 + p) ** -0.5
        rows = [measure(name, be, args, scale, flops) for be in (("triton",) if a.no_stock else ("triton", "stock"))]
        zk, st = rows[0], rows[-1]
        if len(rows) == 2 and "grads" in zk and "grads" in st:
            zk["rel_err_vs_stock"] = [float((a - b).norm() / b.norm()) for a, b in zip(zk["grads"], st["grads"])]
            zk["speedup_vs_stock"] = round(st["ms"] / zk["ms"], 1)
        ref = None if a.no_stock else reference_grads(args, scale)
        for row in rows:
            if "grads" in row and ref is not None:     # ||g - g64|| / ||g64|| per (dq_latent, dq_rope, dkv, dk_rope)
                row["rel_err_vs_float64"] = [float((a.double() - b).norm() / b.norm()) for a, b in zip(row["grads"], ref)]
        del ref
        for row in rows:
            row.pop("grads", None)
            row["gflop"] = round(flops / 1e9, 1)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        if a.sweep:
            results["kernels"][name] = kernel_times(args, scale)
            print(json.dumps({name: results["kernels"][name]}), flush=True)
            results["sweep"] += sweep_configs(name, args, scale, pairs_flops_bwd(pairs, r, p))
        del args
        torch.cuda.empty_cache()
    print(f"\n{'case':6} {'impl':14} {'ms':>10} {'TFLOP/s':>8} {'peak GiB':>9} {'x stock':>8}")
    for row in results["rows"]:
        print(f"{row['case']:6} {row['impl']:14} {row.get('ms', row.get('error', '')):>10} "
              f"{row.get('tflops', ''):>8} {row.get('peak_gib', ''):>9} {row.get('speedup_vs_stock', ''):>8}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
