"""Block-scaled FP8 linear on a GPU: zerokl's fp8_linear vs torch._scaled_mm (cuBLASLt FP8) and
bf16 cuBLAS, side by side in one run, with the invariance check in the same run.

    python tools/bench/bench_fp8.py --json docs/bench/fp8-linear-cuda.json

Grid: (N, K) in {(4096, 4096), (2048, 7168), (7168, 2048)} x M in {1, 64, 512, 2048, 8192}.
Arms, each timed with triton.testing.do_bench (median ms) on the same quantized operands:
- zerokl: ops.fp8_linear (activation quantization + block-scaled GEMM, the numerics definition);
- zerokl GEMM only: the same with the activations quantized beforehand (the kernel alone);
- cuBLASLt: torch._scaled_mm on the same e4m3 operands, blockwise 1x128 / 128x128 scales where
  this torch supports them, else per-row / per-column scales (then named "rowwise");
- bf16: torch.mm (cuBLAS) on the dequantized bf16 operands.
TFLOP/s count 2·M·N·K. Invariance: every M's rows equal the M = 8192 run's rows bit for bit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import triton.testing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import commit  # noqa: E402

SHAPES = [(4096, 4096), (2048, 7168), (7168, 2048)]
MS = [1, 64, 512, 2048, 8192]


def _scaled_mm(qx, sx, qw, sw):
    """cuBLASLt FP8 on the same operands: (callable, scaling name)."""
    try:   # blockwise: activations 1x128, weights 128x128 (DeepSeek-V3 layout)
        out = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return (lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)), "blockwise", out
    except Exception:   # noqa: BLE001 - fall back to the scaling this torch/cuBLASLt supports
        ra = sx.amax(1, keepdim=True).contiguous()
        rb = sw.amax(1).repeat_interleave(128)[:qw.shape[0]].view(1, -1).contiguous()
        fn = lambda: torch._scaled_mm(qx, qw.t(), scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16)  # noqa: E731
        return fn, "rowwise", fn()


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    from zerokl.kernels import ops
    from zerokl.kernels.triton import fp8 as tfp8
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        qw, sw = ops.fp8_quantize_weight(w)
        wb = ops.fp8_dequantize_weight(qw, sw, torch.bfloat16)
        x_big = torch.randn(max(MS), k, device=dev, generator=g).to(torch.bfloat16)
        ref_rows = ops.fp8_linear(x_big, qw, sw)
        for m in MS:
            x = x_big[:m]
            qx, sx = ops.fp8_quantize(x)
            xb = (qx.float() * sx.repeat_interleave(128, 1)[:, :k]).to(torch.bfloat16)
            y = ops.fp8_linear(x, qw, sw)
            invariant = bool(torch.equal(y, ref_rows[:m]))
            t_z = triton.testing.do_bench(lambda: ops.fp8_linear(x, qw, sw))
            t_g = triton.testing.do_bench(lambda: tfp8.fp8_gemm(qx, sx, qw, sw, None, torch.bfloat16))
            mm, scaling, _ = _scaled_mm(qx, sx, qw, sw)
            t_c = triton.testing.do_bench(mm)
            t_b = triton.testing.do_bench(lambda: torch.mm(xb, wb.t()))
            tf = lambda t: 2 * m * n * k / (t * 1e-3) / 1e12  # noqa: E731
            row = {"n": n, "k": k, "m": m, "zerokl_ms": t_z, "zerokl_gemm_ms": t_g, "cublaslt_fp8_ms": t_c,
                   "cublaslt_scaling": scaling, "bf16_cublas_ms": t_b, "zerokl_tflops": tf(t_z),
                   "zerokl_gemm_tflops": tf(t_g), "cublaslt_fp8_tflops": tf(t_c), "bf16_tflops": tf(t_b),
                   "gemm_vs_cublaslt": t_c / t_g, "invariant": invariant}
            rows.append(row)
            print(f"N{n} K{k} M{m:5d}: zerokl {tf(t_z):7.1f} TF/s (GEMM alone {tf(t_g):7.1f}), cuBLASLt fp8 "
                  f"[{scaling}] {tf(t_c):7.1f}, bf16 {tf(t_b):7.1f}; GEMM / cuBLASLt {t_c / t_g:5.2f}x; "
                  f"rows == M=8192 rows: {invariant}", flush=True)
    meta = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name(), "commit": commit(),
            "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
