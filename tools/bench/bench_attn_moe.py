"""Sparse MLA attention and the grouped MoE GEMM on a GPU: zerokl vs the best plain alternative.

    python tools/bench/bench_attn_moe.py --out docs/bench
    python tools/bench/bench_attn_moe.py --sweep        # also: attention heads-per-program variants (bits + time)

Attention (absorbed MLA, bf16 inputs, fp32 out) at the `small` and a GLM-5 layer's shapes:
  prefill-dense:  T queries, causal over the same T keys (T <= index_topk: every key selected)
  prefill-sparse: T queries, each over index_topk selected keys out of its causal prefix
  decode:         B queries, each over its own index_topk keys of a paged cache
The alternatives are torch SDPA (one shared KV head, enable_gqa; dense causal, or with a
boolean mask for the sparse lists), and the plain gather + bmm of the stock backend; the
figure is throughput vs the fastest of them (alternative time / zerokl time).
MoE experts (dropless, top-k routing, SwiGLU): zerokl's grouped GEMMs vs a plain per-expert
torch.mm loop, at the `small` and GLM-5 layer shapes, prefill- and decode-sized token counts.
Each case also checks batch invariance (a query / token alone == inside the batch).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import torch.nn.functional as F
import triton.testing

import zerokl.kernels as K
from zerokl.kernels import stock_ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


ATTN = {  # name: (H, R, P, index_topk)
    "small": (16, 256, 32, 512),
    "glm5": (64, 512, 64, 2048),
}
MOE = {  # name: (E, D, I, k)
    "small": (16, 1024, 512, 4),
    "glm5": (256, 6144, 2048, 8),
}


def attn_case(kind: str, shape: str, dev, g):
    h, r, p, topk = ATTN[shape]
    dt = torch.bfloat16
    if kind == "prefill-dense":
        t = topk
        s = t
        pos = torch.arange(t, device=dev)
        idx = torch.where(pos[None, :] <= pos[:, None], pos[None, :].expand(t, t), torch.full((t, t), -1, device=dev))
    elif kind == "prefill-sparse":
        t = 2 * topk if shape == "small" else topk + 512
        s = t
        # each query: its last topk causal keys are random picks -> `topk` ascending slots of its prefix
        scores = torch.rand(t, t, device=dev, generator=g)
        causal = torch.arange(t, device=dev)[None, :] <= torch.arange(t, device=dev)[:, None]
        scores = scores.masked_fill(~causal, -1.0)
        chosen = scores.topk(topk, dim=1).indices
        chosen = torch.where(scores.gather(1, chosen) >= 0, chosen, torch.full_like(chosen, -1))
        idx = torch.sort(torch.where(chosen < 0, torch.full_like(chosen, 1 << 40), chosen), 1).values
        idx = torch.where(idx >= 1 << 40, torch.full_like(idx, -1), idx)
    else:  # decode
        t = 64
        s = t * topk
        idx = torch.randperm(s, device=dev, generator=g).view(t, topk).sort(1).values
    ql = torch.randn(t, h, r, device=dev, dtype=dt, generator=g)
    qr = torch.randn(t, h, p, device=dev, dtype=dt, generator=g)
    kv = torch.randn(s, r, device=dev, dtype=dt, generator=g)
    kr = torch.randn(s, p, device=dev, dtype=dt, generator=g)
    return ql, qr, kv, kr, idx, (r + p) ** -0.5


def attn_alternatives(kind, ql, qr, kv, kr, idx, scale):
    t, h, r = ql.shape
    alts = {"stock gather+bmm": lambda: stock_ops.mla_attention(ql, qr, kv, kr, idx, scale)}
    q = torch.cat([ql, qr], -1).transpose(0, 1).unsqueeze(0)                         # [1, H, T, R+P]
    if kind == "prefill-dense":
        k = torch.cat([kv, kr], -1)[None, None]                                       # [1, 1, S, R+P]
        v = kv[None, None]
        alts["sdpa causal"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif kind == "prefill-sparse":
        k = torch.cat([kv, kr], -1)[None, None]
        v = kv[None, None]
        mask = torch.zeros(t, kv.shape[0], dtype=torch.bool, device=ql.device)
        mask.scatter_(1, idx.clamp(min=0), idx >= 0)
        alts["sdpa masked"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale,
                                                                     enable_gqa=True)
    else:
        def sdpa_gathered():
            i = idx.clamp(min=0)
            k = torch.cat([kv[i], kr[i]], -1).unsqueeze(1)                           # [T, 1, L, R+P]
            v = kv[i].unsqueeze(1)
            qq = torch.cat([ql, qr], -1).unsqueeze(2)                                 # [T, H, 1, R+P]
            return F.scaled_dot_product_attention(qq, k, v, attn_mask=(idx >= 0)[:, None, None, :], scale=scale,
                                                  enable_gqa=True)
        alts["sdpa gathered"] = sdpa_gathered
    return alts


def moe_case(shape: str, tokens: int, dev, g):
    e, d, i, k = MOE[shape]
    dt = torch.bfloat16
    x = torch.randn(tokens, d, device=dev, dtype=dt, generator=g)
    gate = torch.randn(e, i, d, device=dev, dtype=dt, generator=g) * 0.02
    up = torch.randn(e, i, d, device=dev, dtype=dt, generator=g) * 0.02
    down = torch.randn(e, d, i, device=dev, dtype=dt, generator=g) * 0.02
    logits = torch.randn(tokens, e, device=dev, generator=g)
    w, ids = K.moe_route(logits, torch.zeros(e, device=dev), k, 1, 1, 1.0)
    return x, w, ids, gate, up, down


def plain_moe(x, w, ids, gate, up, down):
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
    for e in range(gate.shape[0]):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            hdn = F.silu(x[rows] @ gate[e].T) * (x[rows] @ up[e].T)
            out.index_add_(0, rows, (hdn @ down[e].T).float() * w[rows, slot].unsqueeze(1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    from zerokl.kernels import triton as zt
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    stamp = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name(), "device_type": K.device_name(),
             "commit": commit(), "numerics": K.__version__}
    print(stamp, flush=True)
    res = {"stamp": stamp, "attention": [], "moe": []}
    with K.use_backend("triton"):
        for shape in ("small", "glm5"):
            for kind in ("prefill-dense", "prefill-sparse", "decode"):
                ql, qr, kv, kr, idx, scale = attn_case(kind, shape, dev, g)
                ours = K.mla_attention(ql, qr, kv, kr, idx, scale)
                q1 = ours.shape[0] // 2
                alone = K.mla_attention(ql[q1:q1 + 1], qr[q1:q1 + 1], kv, kr, idx[q1:q1 + 1], scale)
                inv = bool(torch.equal(alone[0], ours[q1]))
                t_ours = bench(lambda: K.mla_attention(ql, qr, kv, kr, idx, scale))
                alt_t = {}
                for name, fn in attn_alternatives(kind, ql, qr, kv, kr, idx, scale).items():
                    try:
                        alt_t[name] = bench(fn) * 1e6
                    except Exception as e:  # noqa: BLE001 - an SDPA backend may refuse a shape
                        alt_t[name] = None
                        print(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
                best = min((v, n) for n, v in alt_t.items() if v)
                row = {"shape": shape, "kind": kind, "T": ql.shape[0], "H": ql.shape[1], "R": ql.shape[2],
                       "L": idx.shape[1], "zerokl_us": t_ours * 1e6, "alternatives_us": alt_t, "best": best[1],
                       "throughput_ratio": best[0] / (t_ours * 1e6), "invariant": inv}
                if args.sweep:
                    row["variants"] = []
                    for bh in (16, 32, 64):
                        for nw in (4, 8):
                            if bh > ql.shape[1]:
                                continue
                            try:
                                y = zt.mla_attention(ql, qr, kv, kr, idx, scale, block_h=bh, num_warps=nw)
                                same = bool(torch.equal(y, ours))
                                tt = bench(lambda: zt.mla_attention(ql, qr, kv, kr, idx, scale, block_h=bh, num_warps=nw))
                                row["variants"].append({"block_h": bh, "num_warps": nw, "us": tt * 1e6, "bit_identical": same})
                                print(f"    block_h {bh} warps {nw}: {tt*1e6:9.1f} us bits {'==' if same else 'DIFFER'}", flush=True)
                            except Exception as e:  # noqa: BLE001
                                row["variants"].append({"block_h": bh, "num_warps": nw, "error": str(e)[:200]})
                                print(f"    block_h {bh} warps {nw}: {type(e).__name__} {str(e)[:100]}", flush=True)
                res["attention"].append(row)
                print(f"attn {shape:5s} {kind:14s} T={row['T']:5d} L={row['L']:5d} zerokl {row['zerokl_us']:9.1f} us  "
                      f"alts {alt_t}  ratio {row['throughput_ratio']:.2f}  invariant {inv}", flush=True)
                del ql, qr, kv, kr, idx
        for shape in ("small", "glm5"):
            for tokens in (64, 4096):
                x, w, ids, gate, up, down = moe_case(shape, tokens, dev, g)
                ours = K.moe_experts(x, w, ids, gate, up, down)
                alone = K.moe_experts(x[:1], w[:1], ids[:1], gate, up, down)
                inv = bool(torch.equal(alone[0], ours[0]))
                t_ours = bench(lambda: K.moe_experts(x, w, ids, gate, up, down))
                t_plain = bench(lambda: plain_moe(x, w, ids, gate, up, down))
                row = {"shape": shape, "tokens": tokens, "E": gate.shape[0], "D": x.shape[1], "I": gate.shape[1],
                       "k": ids.shape[1], "zerokl_us": t_ours * 1e6, "plain_us": t_plain * 1e6,
                       "throughput_ratio": t_plain / t_ours, "invariant": inv}
                res["moe"].append(row)
                print(f"moe  {shape:5s} T={tokens:5d} zerokl {t_ours*1e6:9.1f} us  per-expert torch {t_plain*1e6:9.1f} us  "
                      f"ratio {t_plain/t_ours:.2f}  invariant {inv}", flush=True)
                del x, gate, up, down
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"bench-attn-moe-{stamp['device_type']}"
        (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        labels = [f"attn {r['shape']} {r['kind']}" for r in res["attention"]] + \
                 [f"moe {r['shape']} T{r['tokens']}" for r in res["moe"]]
        vals = [r["throughput_ratio"] for r in res["attention"]] + [r["throughput_ratio"] for r in res["moe"]]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.barh(labels, vals, color=["#3b7dd8" if v >= 0.8 else "#d8553b" for v in vals])
        ax.axvline(0.8, color="k", lw=0.8, ls="--")
        ax.set_xlabel("throughput vs best plain alternative (>= 0.8 is the target)")
        ax.set_title(f"{stamp['device']} · bf16 · commit {stamp['commit']} · {stamp['date']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{tag}.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
