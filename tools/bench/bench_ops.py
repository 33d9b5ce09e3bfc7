"""Time each op: zerokl's invariant kernel vs plain torch, side by side in one run.

    python tools/bench/bench_ops.py                     # active backend, CPU shapes
    python tools/bench/bench_ops.py --backend triton    # on a GPU machine
    python tools/bench/bench_ops.py --out docs/bench    # also write a markdown table and a PNG

Each figure is a ratio measured in the same process (invariant time / plain time, so
1.0 is free and 2.0 is twice as slow), with the date, device and commit recorded.
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import time
from typing import Callable

import torch

import zerokl.kernels as K
from zerokl.kernels import portable
from zerokl.kernels import reference as ref

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402


def _timeit(fn: Callable[[], object], sync: Callable[[], None], min_time: float = 0.2) -> float:
    fn(); sync()
    n, start = 0, time.perf_counter()
    while True:
        fn(); n += 1
        if n >= 3 and time.perf_counter() - start > min_time:
            break
    sync()
    return (time.perf_counter() - start) / n


def cases(device: str, dtype: torch.dtype, scale: str):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    big = scale == "gpu"
    m, k, n = (4096, 4096, 4096) if big else (256, 512, 512)
    x, w = r(m, k), r(n, k) * 0.02
    yield "linear", f"{m}x{k}x{n}", (lambda: K.linear(x, w)), (lambda: torch.nn.functional.linear(x, w))
    v = 154880 if big else 32000
    logits = r(64 if big else 16, v).float()
    yield "log_softmax", f"{logits.shape[0]}x{v}", (lambda: K.log_softmax(logits)), (lambda: torch.log_softmax(logits, -1))
    h = r(m, k)
    nw = torch.ones(k, device=device)
    yield "rms_norm", f"{m}x{k}", (lambda: K.rms_norm(h, nw)), (lambda: ref.rms_norm(h, nw))
    if device == "cpu":   # the torch backend's IEEE square root vs MKL's vector math (torch.sqrt)
        row_ms, flat = h.float().pow(2).mean(-1) + 1e-6, h.float().abs().reshape(-1)
        yield "sqrt", f"{m} (one per row)", (lambda: portable.sqrt(row_ms)), (lambda: torch.sqrt(row_ms))
        yield "sqrt", f"{flat.numel()}", (lambda: portable.sqrt(flat)), (lambda: torch.sqrt(flat))
    t, heads, rank, rope, keys = (2048, 64, 512, 64, 2048) if big else (128, 4, 32, 16, 64)
    ql, qr = r(t, heads, rank), r(t, heads, rope)
    kv, kr = r(keys, rank), r(keys, rope)
    idx = torch.arange(keys, device=device).expand(t, keys).contiguous()
    yield ("mla_attention", f"T{t} H{heads} R{rank} L{keys}", (lambda: K.mla_attention(ql, qr, kv, kr, idx, 0.1)),
           (lambda: _sdpa_latent(ql, qr, kv, kr)))
    e, tok, d, inter, topk = (64, 4096, 2048, 1024, 8) if big else (16, 256, 128, 96, 2)
    xs = r(tok, d)
    gate, up, down = r(e, inter, d) * 0.02, r(e, inter, d) * 0.02, r(e, d, inter) * 0.02
    wts, ids = K.moe_route(torch.randn(tok, e, generator=g).to(device), torch.zeros(e, device=device), topk, 1, 1, 1.0)
    yield ("moe_experts", f"E{e} T{tok} D{d} I{inter} k{topk}", (lambda: K.moe_experts(xs, wts, ids, gate, up, down)),
           (lambda: _plain_moe(xs, wts, ids, gate, up, down)))


def _sdpa_latent(ql, qr, kv, kr):
    q = torch.cat([ql, qr], -1).transpose(0, 1).unsqueeze(0)             # [1, H, T, R+P]
    k = torch.cat([kv, kr], -1).unsqueeze(0).unsqueeze(0)                 # [1, 1, L, R+P]
    v = kv.unsqueeze(0).unsqueeze(0)
    return torch.nn.functional.scaled_dot_product_attention(q, k.expand(-1, q.shape[1], -1, -1),
                                                            v.expand(-1, q.shape[1], -1, -1), scale=0.1)


def _plain_moe(x, w, ids, gate, up, down):
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
    for e in range(gate.shape[0]):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            h = torch.nn.functional.silu(x[rows] @ gate[e].T) * (x[rows] @ up[e].T)
            out.index_add_(0, rows, (h @ down[e].T).float() * w[rows, slot].unsqueeze(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="folder for bench-ops-<device>.md and .png")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    backend = args.backend or K.default_backend()
    dtype = getattr(torch, args.dtype)
    commit_ = commit()
    stamp = f"{datetime.date.today()} · {K.device_name()} · backend {backend} · {args.dtype} · commit {commit_}"
    rows = []
    with K.use_backend(backend):
        for name, shape, inv, plain in cases(device, dtype, "gpu" if device == "cuda" else "cpu"):
            t_inv, t_plain = _timeit(inv, sync), _timeit(plain, sync)
            rows.append((name, shape, t_plain * 1e3, t_inv * 1e3, t_inv / t_plain))
            print(f"{name:<14} {shape:<28} plain {t_plain * 1e3:9.3f} ms  invariant {t_inv * 1e3:9.3f} ms  ratio {t_inv / t_plain:6.2f}x", flush=True)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"{K.device_name()}-{backend}-{args.dtype}"
        lines = [f"# Op timings: invariant vs plain torch ({tag})", "", stamp, "",
                 "| op | shape | plain ms | invariant ms | invariant / plain |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {s} | {a:.3f} | {b:.3f} | {r:.2f}x |" for n, s, a, b, r in rows]
        (out / f"bench-ops-{tag}.md").write_text("\n".join(lines) + "\n")
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.barh([r[0] for r in rows], [r[4] for r in rows], color="#3b7dd8")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("invariant time / plain torch time (lower is better)")
        ax.set_title(stamp, fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"bench-ops-{tag}.png", dpi=120)
        print(f"wrote {out / f'bench-ops-{tag}.md'} and .png")


if __name__ == "__main__":
    main()
