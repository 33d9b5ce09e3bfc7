"""Block-scaled FP8 linear on a GPU: zerokl's fp8_linear vs torch._scaled_mm (cuBLASLt FP8) and
bf16 cuBLAS, side by side in one run, with the invariance check in the same run.

    python tools/bench/bench_fp8.py --json docs/bench/fp8-linear-cuda.json
    python tools/bench/bench_fp8.py --sweep --json fp8-sweep.json    # every candidate tile config: bits + time
    python tools/bench/bench_fp8.py --sweep-grouped --json fp8-grouped.json   # the MoE experts' tile configs
    python tools/bench/bench_fp8.py --smoke --sweep                  # tiny, on the CPU (the CI test)

Grid: (N, K) in {(4096, 4096), (2048, 7168), (7168, 2048)} x M in {1, 64, 512, 2048, 8192}.
Arms, each timed with triton.testing.do_bench (median ms) on the same quantized operands:
- zerokl: ops.fp8_linear (activation quantization + block-scaled GEMM, the numerics definition);
- zerokl GEMM only: the same with the activations quantized beforehand (the kernel alone, with
  the tile config the launch picks: fp8.fp8_launch_config);
- cuBLASLt: torch._scaled_mm on the same e4m3 operands, blockwise 1x128 / 128x128 scales where
  this torch supports them, else per-row / per-column scales (then named "rowwise");
- bf16: torch.mm (cuBLAS) on the dequantized bf16 operands.
TFLOP/s count 2·M·N·K. Invariance: every M's rows equal the M = 8192 run's rows bit for bit.

--sweep (instead of the grid): at every (N, K) x M in SWEEP_MS, on pre-quantized operands, times
fp8_gemm with each config of candidates() beside cuBLASLt, and checks its output equals the
canonical config's (fp8.CANONICAL_CONFIG) with torch.equal: a config whose bits differ is
printed as such, and may never go into the table. A config that does not compile or launch
(shared memory, registers) is reported and skipped. Per (shape, M) it prints the fastest
bit-identical config, its ratio to cuBLASLt and the table's choice beside it: what
fp8._CUDA_BUCKETS is filled from. Exit status 1 when any config's bits differ.

--sweep-grouped: the MoE experts' grouped GEMM (fp8_grouped_linear, one launch over every expert's rows; the
GLM-5 experts' gate/up [G, 2048, 6144] and down [G, 6144, 2048], G = 256) at T tokens of GROUPED_TOKENS routed to
8 experts each (seeded uniform routing; the rows of each expert contiguous, as the MoE layer orders them), with
every pointer-load candidate (the grouped launch takes no TMA or persistent grid). Each config's output must equal
the table's config's (fp8._GROUPED_CUDA_CONFIG) bit for bit. The outside figure is the HBM bound: the bytes of
the experts the tokens touch (e4m3 weights and their fp32 scales) over the GPU's bandwidth
(flops.hbm_bytes_per_s): at decode the experts are weight streams, so that fraction is the one to raise. The
time includes the rows' quantization (one launch, the same for every config).

--smoke runs any mode on the CPU under the Triton interpreter, on tiny shapes, each arm timed
by one wall-clock call: it checks the script runs, its figures mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from flops import hbm_bytes_per_s  # noqa: E402
from provenance import commit  # noqa: E402

SHAPES = [(4096, 4096), (2048, 7168), (7168, 2048)]
MS = [1, 64, 512, 2048, 8192]
SWEEP_MS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
SMOKE_SHAPES, SMOKE_MS = [(200, 96)], [1, 70]
# --sweep-grouped: the GLM-5 experts (G, N, K) for gate/up and down, tokens a step (x 8 routed experts each)
GROUPED_SHAPES = [(256, 2048, 6144), (256, 6144, 2048)]
GROUPED_TOKENS = [64, 256, 2048, 8192]
SMOKE_GROUPED_SHAPES, SMOKE_GROUPED_TOKENS, GROUPED_TOP_K = [(4, 96, 200)], [3, 9], 8


def candidates() -> list:
    """The sweep's tile configs (tests/kernels/test_fp8_configs.py checks each one's bits on the GPU).
    BLOCK_K is always 128; a stage holds (BLOCK_M + BLOCK_N) x 128 bytes of e4m3 in shared memory
    (227 KiB on an H100/H200: 128 x 256 at 5 stages, 240 KiB, cannot fit and is left out). The
    loop keeps a K block's fp32 partial product beside the accumulator, so BLOCK_M x BLOCK_N x 2
    registers over the warps' threads: 64 x 256 and wider need 8 warps. 64 x 32 is narrower than
    the table's choices: at decode on N = 2048 it gives 64 programs to stream the weight. The
    TMA variants load the same tiles through the tensor memory accelerator (fewer instructions
    and registers a stage than the pointer loads' address arithmetic); the persistent ones
    (PROGRAMS_PER_SM) walk the tiles with one or two programs a multiprocessor, as the bf16
    GEMM's large-M kernel does."""
    from zerokl.kernels.triton.fp8 import Fp8GemmConfig as C
    decode = [C(64, 32, 4, 4)] + [C(64, 64, 4, stages) for stages in (3, 4, 5)] + [C(64, 64, 4, 4, TMA=True)]
    mid = [C(64, 128, 4, stages) for stages in (3, 4, 5)] + [C(64, 256, 8, stages) for stages in (3, 4)]
    mid += [C(64, 128, 4, stages, TMA=True) for stages in (4, 5)] + [C(64, 256, 8, 3, TMA=True)]
    large = [C(128, 64, 4, 4)] + [C(128, 128, 8, stages) for stages in (3, 4, 5)]
    large += [C(128, 256, 8, stages) for stages in (3, 4)]
    large += [C(128, 128, 8, stages, TMA=True) for stages in (3, 4, 5)] + [C(128, 256, 8, 3, TMA=True)]
    persistent = [C(128, 128, 8, 4, TMA=True, PROGRAMS_PER_SM=1), C(128, 128, 8, 3, TMA=True, PROGRAMS_PER_SM=2),
                  C(128, 256, 8, 3, TMA=True, PROGRAMS_PER_SM=1), C(64, 128, 4, 4, TMA=True, PROGRAMS_PER_SM=2)]
    return decode + mid + large + persistent


def smoke_candidates() -> list:
    """The smoke run's (the CPU's interpreter, seconds a launch): the table's configs and a spread of a
    quarter of candidates()."""
    from zerokl.kernels.triton import fp8
    table = [cfg for _, configs in fp8._CUDA_BUCKETS for cfg in configs.values()]
    return list(dict.fromkeys(table + candidates()[::4]))


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


def _timer(smoke: bool):
    """ms per call: triton.testing.do_bench (median, L2 flushed between calls); in the smoke run
    one wall-clock call."""
    if not smoke:
        import triton.testing
        return triton.testing.do_bench

    def once(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return once


def _name(cfg) -> str:
    return f"{cfg.BLOCK_M}x{cfg.BLOCK_N} w{cfg.num_warps} s{cfg.num_stages} g{cfg.GROUP_M}" + (" tma" if cfg.TMA else "") \
        + (f" p{cfg.PROGRAMS_PER_SM}" if cfg.PROGRAMS_PER_SM else "")


def _config(fields: dict):
    from zerokl.kernels.triton.fp8 import Fp8GemmConfig
    return Fp8GemmConfig(**fields)


def grid(shapes, ms, dev, time_ms) -> list[dict]:
    """The default mode: every arm at every (N, K) x M."""
    from zerokl.kernels import ops
    from zerokl.kernels.triton import fp8 as tfp8
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        qw, sw = ops.fp8_quantize_weight(w)
        wb = ops.fp8_dequantize_weight(qw, sw, torch.bfloat16)
        x_big = torch.randn(max(ms), k, device=dev, generator=g).to(torch.bfloat16)
        ref_rows = ops.fp8_linear(x_big, qw, sw)
        for m in ms:
            x = x_big[:m]
            qx, sx = ops.fp8_quantize(x)
            xb = (qx.float() * sx.repeat_interleave(128, 1)[:, :k]).to(torch.bfloat16)
            y = ops.fp8_linear(x, qw, sw)
            invariant = bool(torch.equal(y, ref_rows[:m]))
            t_z = time_ms(lambda: ops.fp8_linear(x, qw, sw))
            t_g = time_ms(lambda: tfp8.fp8_gemm(qx, sx, qw, sw, None, torch.bfloat16))
            mm, scaling, _ = _scaled_mm(qx, sx, qw, sw)
            t_c = time_ms(mm)
            t_b = time_ms(lambda: torch.mm(xb, wb.t()))
            cfg = tfp8.fp8_launch_config(m, n, k, interpreted=dev == "cpu")
            tf = lambda t: 2 * m * n * k / (t * 1e-3) / 1e12  # noqa: E731
            row = {"n": n, "k": k, "m": m, "zerokl_ms": t_z, "zerokl_gemm_ms": t_g, "cublaslt_fp8_ms": t_c,
                   "cublaslt_scaling": scaling, "bf16_cublas_ms": t_b, "zerokl_tflops": tf(t_z),
                   "zerokl_gemm_tflops": tf(t_g), "cublaslt_fp8_tflops": tf(t_c), "bf16_tflops": tf(t_b),
                   "gemm_vs_cublaslt": t_c / t_g, "invariant": invariant, "config": dataclasses.asdict(cfg)}
            rows.append(row)
            print(f"N{n} K{k} M{m:5d}: zerokl {tf(t_z):7.1f} TF/s (GEMM alone {tf(t_g):7.1f}, {_name(cfg)}), "
                  f"cuBLASLt fp8 [{scaling}] {tf(t_c):7.1f}, bf16 {tf(t_b):7.1f}; GEMM / cuBLASLt {t_c / t_g:5.2f}x; "
                  f"rows == M={max(ms)} rows: {invariant}", flush=True)
    return rows


def _time_configs(configs, call, reference: torch.Tensor, reference_name: str, time_ms, base: dict, chosen,
                  key: str, ratio, unit: str) -> list[dict]:
    """A row per config: ``call(config)``'s output checked against ``reference`` (torch.equal), its time and
    ``ratio(ms)`` under ``key``; a config that does not compile or launch (shared memory, registers) gets an
    ``error`` instead. ``chosen``: the table's config (marked)."""
    rows = []
    for cfg in configs:
        row = {**base, "config": dataclasses.asdict(cfg), "in_table": cfg == chosen}
        try:
            same = bool(torch.equal(call(cfg), reference))
            t = time_ms(lambda: call(cfg))  # noqa: B023
        except Exception as e:  # noqa: BLE001 - a config that does not fit
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(f"    {_name(cfg):22s} SKIPPED, does not compile or launch: {row['error']}", flush=True)
            rows.append(row)
            continue
        row.update(ms=t, bit_identical=same, **{key: ratio(t)})
        rows.append(row)
        print(f"    {_name(cfg):22s} {t * 1e3:9.1f} us  {ratio(t):5.2f}{unit}"
              + ("  (the table's)" if row["in_table"] else "")
              + ("" if same else f"  <<<<<<<< BITS DIFFER FROM {reference_name.upper()}: never use it"), flush=True)
    return rows


def sweep(shapes, ms, dev, time_ms, configs) -> tuple[list[dict], list[dict]]:
    """Every config at every (N, K) x M: (a row per config and case, the best config per case)."""
    from zerokl.kernels import ops
    from zerokl.kernels.triton import fp8 as tfp8
    g = torch.Generator(device=dev).manual_seed(0)
    rows, best = [], []
    for n, k in shapes:
        qw, sw = ops.fp8_quantize_weight(torch.randn(n, k, device=dev, generator=g) * 0.02)
        x_big = torch.randn(max(ms), k, device=dev, generator=g).to(torch.bfloat16)
        for m in ms:
            qx, sx = ops.fp8_quantize(x_big[:m])
            canonical = tfp8.fp8_gemm(qx, sx, qw, sw, None, torch.bfloat16, config=tfp8.CANONICAL_CONFIG)
            mm, scaling, _ = _scaled_mm(qx, sx, qw, sw)
            t_c = time_ms(mm)
            chosen = tfp8.fp8_launch_config(m, n, k, interpreted=False)
            print(f"N{n} K{k} M{m}: cuBLASLt fp8 [{scaling}] {t_c * 1e3:9.1f} us", flush=True)
            case = _time_configs(
                configs, lambda cfg: tfp8.fp8_gemm(qx, sx, qw, sw, None, torch.bfloat16, config=cfg),  # noqa: B023
                canonical, "the canonical config's", time_ms, {"n": n, "k": k, "m": m}, chosen,
                "vs_cublaslt", lambda t: t_c / t, "x cuBLASLt")  # noqa: B023
            rows += case
            case = [r for r in case if "error" not in r]
            ok = [r for r in case if r["bit_identical"]]
            top = min(ok, key=lambda r: r["ms"]) if ok else None
            table = next((r for r in case if r["in_table"]), None)
            best.append({"n": n, "k": k, "m": m, "cublaslt_ms": t_c, "cublaslt_scaling": scaling,
                         "best": top and top["config"], "best_ms": top and top["ms"],
                         "best_vs_cublaslt": top and top["vs_cublaslt"], "table": dataclasses.asdict(chosen),
                         "table_vs_cublaslt": table and table["vs_cublaslt"]})
    return rows, best


def grouped_candidates() -> list:
    """The grouped sweep's configs: candidates() without TMA loads or a persistent grid (the grouped launch's
    row tiles follow the experts' offsets; it loads by pointer), and the table's own."""
    from zerokl.kernels.triton import fp8
    plain = [c for c in candidates() if not c.TMA and not c.PROGRAMS_PER_SM]
    return list(dict.fromkeys([fp8._GROUPED_CUDA_CONFIG] + plain))


def _routed_offsets(tokens: int, experts: int, top_k: int, dev) -> tuple[torch.Tensor, int]:
    """Expert row offsets [G + 1] (device int64) of `tokens` tokens each sent to top_k distinct experts drawn
    uniformly (seeded), and how many experts got a row."""
    g = torch.Generator().manual_seed(tokens)
    picks = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).reshape(-1)
    counts = torch.bincount(picks, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return offsets.to(dev), int((counts > 0).sum())


def sweep_grouped(shapes, token_counts, dev, time_ms, configs, top_k: int = GROUPED_TOP_K) -> tuple[list[dict], list[dict]]:
    """Every config of the grouped FP8 GEMM at every (G, N, K) x tokens: (a row per config and case, the best
    config per case), each against the HBM bound of the experts the tokens touch."""
    from zerokl.kernels import ops
    from zerokl.kernels.triton import fp8 as tfp8
    gen = torch.Generator(device=dev).manual_seed(0)
    bandwidth = hbm_bytes_per_s() if dev != "cpu" else float("nan")
    rows, best = [], []
    for experts, n, k in shapes:
        qw, sw = ops.fp8_quantize_weight(torch.randn(experts, n, k, device=dev, generator=gen) * 0.02)
        for tokens in token_counts:
            offsets, touched = _routed_offsets(tokens, experts, min(top_k, experts), dev)
            m = int(offsets[-1])
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            table = tfp8.fp8_grouped_linear(x, qw, sw, offsets, config=tfp8._GROUPED_CUDA_CONFIG)
            nbytes = touched * (qw[0].numel() * qw.element_size() + sw[0].numel() * sw.element_size())
            bound_ms = nbytes / bandwidth * 1e3
            print(f"G{experts} N{n} K{k} T{tokens} ({m} rows, {touched} experts touched): HBM bound "
                  f"{bound_ms * 1e3:9.1f} us", flush=True)
            case = _time_configs(
                configs, lambda cfg: tfp8.fp8_grouped_linear(x, qw, sw, offsets, config=cfg),  # noqa: B023
                table, "the table's config's", time_ms,
                {"experts": experts, "n": n, "k": k, "tokens": tokens, "rows": m}, tfp8._GROUPED_CUDA_CONFIG,
                "of_hbm_bound", lambda t: bound_ms / t, " of the HBM bound")  # noqa: B023
            rows += case
            case = [r for r in case if "error" not in r]
            ok = [r for r in case if r["bit_identical"]]
            top = min(ok, key=lambda r: r["ms"]) if ok else None
            mine = next((r for r in case if r["in_table"]), None)
            best.append({"experts": experts, "n": n, "k": k, "tokens": tokens, "hbm_bound_ms": bound_ms,
                         "best": top and top["config"], "best_ms": top and top["ms"],
                         "best_of_hbm_bound": top and top["of_hbm_bound"],
                         "table": dataclasses.asdict(tfp8._GROUPED_CUDA_CONFIG),
                         "table_of_hbm_bound": mine and mine["of_hbm_bound"]})
    return rows, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile config (see the docstring)")
    ap.add_argument("--sweep-grouped", action="store_true",
                    help="time every candidate tile config of the MoE experts' grouped GEMM (see the docstring)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="--sweep-grouped's tokens a step (default: GROUPED_TOKENS)")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help="the M values (default: MS, or SWEEP_MS with --sweep)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before zerokl.kernels.triton is imported
    elif not torch.cuda.is_available():
        print("bench_fp8 needs a CUDA GPU (or --smoke)")
        return 2
    from zerokl.kernels import use_backend
    dev = "cpu" if args.smoke else "cuda"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    ms = args.ms or (SMOKE_MS if args.smoke else SWEEP_MS if args.sweep else MS)
    meta = {"date": str(datetime.date.today()), "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
            "commit": commit(), "torch": torch.__version__}
    status = 0
    with use_backend("triton"):
        if args.sweep_grouped:
            configs = grouped_candidates()[::4] if args.smoke else grouped_candidates()
            meta["sweep_grouped"], meta["best"] = sweep_grouped(
                SMOKE_GROUPED_SHAPES if args.smoke else GROUPED_SHAPES,
                args.tokens or (SMOKE_GROUPED_TOKENS if args.smoke else GROUPED_TOKENS), dev, _timer(args.smoke), configs)
            print("\nper (G, N, K, tokens): the fastest config whose bits are the table's; the table's config")
            for b in meta["best"]:
                top = "none bit-identical" if b["best"] is None else \
                    f"{_name(_config(b['best'])):22s} {b['best_of_hbm_bound']:5.2f} of the HBM bound"
                table = "did not run" if b["table_of_hbm_bound"] is None else f"{b['table_of_hbm_bound']:5.2f}"
                print(f"  G{b['experts']} N{b['n']:5d} K{b['k']:5d} T{b['tokens']:5d}: {top};  table "
                      f"{_name(_config(b['table']))} {table}")
            differ = [r for r in meta["sweep_grouped"] if r.get("bit_identical") is False]
            print(f"{len(differ)} config runs with bits unlike the table's" + (" <<<<<<<< SEE ABOVE" if differ else ""))
            status = 1 if differ else 0
        elif not args.sweep:
            meta["rows"] = grid(shapes, ms, dev, _timer(args.smoke))
        else:
            configs = smoke_candidates() if args.smoke else candidates()
            meta["sweep"], meta["best"] = sweep(shapes, ms, dev, _timer(args.smoke), configs)
            print("\nper (N, K, M): the fastest config whose bits are the canonical config's; the table's choice")
            for b in meta["best"]:
                top = "none bit-identical" if b["best"] is None else \
                    f"{_name(_config(b['best'])):22s} {b['best_vs_cublaslt']:5.2f}x cuBLASLt [{b['cublaslt_scaling']}]"
                table = "did not run" if b["table_vs_cublaslt"] is None else f"{b['table_vs_cublaslt']:5.2f}x"
                print(f"  N{b['n']:5d} K{b['k']:5d} M{b['m']:5d}: {top};  table {_name(_config(b['table']))} {table}")
            differ = [r for r in meta["sweep"] if r.get("bit_identical") is False]
            failed = [r for r in meta["sweep"] if "error" in r]
            print(f"{len(differ)} config runs with bits unlike the canonical config's"
                  + (" <<<<<<<< SEE ABOVE" if differ else "") + f"; {len(failed)} that did not compile or launch")
            status = 1 if differ else 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
