"""The MoE layer on a GPU: forward and forward + backward, zerokl (Triton, invariant) vs stock.

    python tools/bench/bench_moe.py [--json out.json] [--shapes small glm5] [--tokens 64 4096]

One MoE layer (router, group-limited top-k, dropless routed SwiGLU experts, shared expert) at
the `small` preset's and a GLM-5 layer's sizes (E=256, D=6144, I=2048, top-8), bf16, random
weights, for decode- and prefill-sized token counts. Each backend runs the same module:
`triton` is zerokl's invariant path (device-side routing offsets, grouped GEMMs, grouped-GEMM
backward), `stock` plain torch (torch._grouped_mm experts where it applies, cuBLAS linears).
Printed per case: forward ms, forward + backward ms (grad of the input and every weight),
stock / zerokl ratios, and checks on the zerokl side: a token alone == inside the batch
(forward bits), gradients equal run to run (bits). Times are medians of triton.testing.do_bench.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import triton.testing

import zerokl.kernels as K
from zerokl.kernels.model import ModelConfig
from zerokl.kernels.model.model import MoE

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e-3


def layer(shape: str, dev) -> MoE:
    cfg = ModelConfig.preset(shape)
    g = torch.Generator(device=dev).manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)                      # built on the GPU in bf16: no host copy of 19 GB
    try:
        with torch.device(dev):
            m = MoE(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, device=dev, generator=g) * (0.3 if name == "gate.weight" else 0.02))
    m.gate.float()                                               # the router stays fp32, as in Model
    return m


def grads(m: MoE, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    xx = x.detach().requires_grad_()
    m(xx).backward(dy)
    return [xx.grad] + [p.grad for p in m.parameters()]


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", nargs="+", default=["small", "glm5"], choices=["small", "glm5"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 4096])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    stamp = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name(), "device_type": K.device_name(),
             "commit": commit(), "numerics": K.__version__, "torch": torch.__version__}
    print(stamp, flush=True)
    rows = []
    for shape in args.shapes:
        m = layer(shape, dev)
        c = m.gate.c
        for tokens in args.tokens:
            g = torch.Generator(device=dev).manual_seed(tokens)
            x = torch.randn(tokens, c.hidden_size, device=dev, dtype=torch.bfloat16, generator=g)
            dy = torch.randn(tokens, c.hidden_size, device=dev, dtype=torch.bfloat16, generator=g)
            row = {"shape": shape, "tokens": tokens, "E": c.n_routed_experts, "D": c.hidden_size,
                   "I": c.moe_intermediate_size, "k": c.num_experts_per_tok}
            for backend in ("triton", "stock"):
                with K.use_backend(backend):
                    with torch.no_grad():
                        row[f"{backend}_fwd_ms"] = bench(lambda: m(x)) * 1e3
                    try:
                        row[f"{backend}_fwd_bwd_ms"] = bench(lambda: grads(m, x, dy)) * 1e3
                    except RuntimeError as e:                    # report, keep the other cases
                        row[f"{backend}_fwd_bwd_ms"] = float("nan")
                        print(f"  {backend} fwd+bwd failed: {str(e)[:200]}", flush=True)
                    if backend == "triton":
                        with torch.no_grad():
                            i = tokens // 2
                            row["invariant"] = bool(torch.equal(m(x[i:i + 1])[0], m(x)[i]))
                        a, b = grads(m, x, dy), grads(m, x, dy)
                        row["grads_deterministic"] = all(torch.equal(u, v) for u, v in zip(a, b))
                        del a, b
            row["fwd_ratio"] = row["stock_fwd_ms"] / row["triton_fwd_ms"]
            row["fwd_bwd_ratio"] = row["stock_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]
            rows.append(row)
            print(f"moe {shape:5s} T={tokens:5d}  fwd: zerokl {row['triton_fwd_ms']:8.3f} ms  stock {row['stock_fwd_ms']:8.3f} ms"
                  f"  ratio {row['fwd_ratio']:.2f}   fwd+bwd: zerokl {row['triton_fwd_bwd_ms']:8.3f} ms  "
                  f"stock {row['stock_fwd_bwd_ms']:8.3f} ms  ratio {row['fwd_bwd_ratio']:.2f}   "
                  f"invariant {row['invariant']}  grads deterministic {row['grads_deterministic']}", flush=True)
            del x, dy
        del m
        torch.cuda.empty_cache()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"stamp": stamp, "moe_layer": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
