"""Serving on one GPU, side by side in one run: decode tok/s of the engine (zerokl Triton
backend + CUDA graphs, the same engine on the `stock` backend + graphs), transformers'
generate on the same config, the GLM-5 slice against its HBM bound, prefill MFU, the
GPU-busy fraction of a decode step, and the invariance check alone == batched.

    python tools/bench/bench_serve.py                         # everything (minutes on an H200)
    python tools/bench/bench_serve.py --parts small --batches 64 --new-tokens 32
    python tools/bench/bench_serve.py --json out.json

Workload (issue 17): prompts of --prompt-len random tokens, --new-tokens generated with
ignore_eos, temperature 1. Decode tok/s counts tokens produced by decode-only steps over
their wall time (prefill steps excluded). Weights are random (bf16), made on the device by
a cheap deterministic init (normal_ with a seeded CUDA generator): building the 31.9B-
parameter slice through the portable CPU RNG would take hours. Parts:

  small        `small` at each batch: triton+graphs, stock+graphs, transformers generate
  small-dense  the same with every layer dense (graph-capturable before MoE is sync-free)
  slice        GLM-5 slice (4 layers, 1 dense), triton+graphs, with the HBM bound beside
  prefill      slice prefill of --prefill-prompts x --prefill-len tokens: MFU vs 989 TFLOP/s
  busy         GPU-busy fraction of a b64 decode step (torch.profiler kernel time / wall)
  invariance   every request alone == inside the batch (tokens, logprobs), graphs on
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import sys
import tempfile
import time

import torch

import zerokl.kernels as K
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_train import build_model  # noqa: E402  (seeded on-device init, Model.init_weights' recipe)
from flops import PEAK_BF16, decode_weight_bytes, hbm_bytes_per_s, prefill_flops  # noqa: E402
from engine_steps import timed_step  # noqa: E402
from provenance import commit  # noqa: E402

SLICE = ModelConfig.preset("glm5").replace(num_hidden_layers=4, first_k_dense_replace=1)


def config_of(name: str) -> ModelConfig:
    if name == "small":
        return ModelConfig.preset("small")
    if name == "small-dense":
        c = ModelConfig.preset("small")
        return c.replace(first_k_dense_replace=c.num_hidden_layers)
    if name == "slice":
        return SLICE
    raise ValueError(name)


def make_requests(n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(3, vocab) for _ in range(prompt_len)),
                            SamplingOptions(temperature=1.0, seed=i, max_tokens=new_tokens, ignore_eos=True))
            for i in range(n)]


def engine_config(batch: int, prompt_len: int, new_tokens: int, graphs: bool, budget: int) -> EngineConfig:
    per_seq = -(-(prompt_len + new_tokens) // 16) + 1
    return EngineConfig(num_blocks=batch * per_seq + 16, block_size=16, max_num_seqs=batch,
                        max_num_batched_tokens=budget, max_model_len=prompt_len + new_tokens + 16, cuda_graphs=graphs)


def serve(model: Model, reqs, cfg: EngineConfig, backend: str, profile: bool = False) -> dict:
    """Run reqs through a fresh Engine; decode tok/s over decode-only steps (the first decode
    steps of each new batch shape capture graphs: a warm-up pass runs first)."""
    with K.use_backend(backend):
        eng = Engine(model, cfg)
        run_to_completion(eng, [GenerateRequest("w" + r.request_id, r.prompt_ids, r.options) for r in reqs])  # warm-up
        for r in reqs:
            eng.add_request(r)
        outs = {r.request_id: ([], []) for r in reqs}
        dec_t, dec_tok, steps = 0.0, 0, 0
        prof, prof_t, prof_steps, busy = None, 0.0, 0, None
        torch.cuda.synchronize()
        while eng.has_work():
            decode_only = not eng.waiting and bool(eng.running)
            if profile and decode_only and steps == 10 and prof is None:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            dt, n = timed_step(eng, outs, torch.cuda.synchronize)
            if prof is not None and busy is None:
                prof_t, prof_steps = prof_t + dt, prof_steps + 1
                if prof_steps == 5 or not decode_only:
                    prof.__exit__(None, None, None)
                    busy = (device_busy_seconds(prof) / prof_t, 1e3 * prof_t / prof_steps)
            if decode_only:
                dec_t += dt
                dec_tok += n
                steps += 1
    res = {"decode_tok_s": dec_tok / dec_t if dec_t else 0.0, "ms_per_step": 1e3 * dec_t / max(steps, 1),
           "decode_steps": steps, "graphs": len(eng.runner._graphs), "capturable": eng.runner._capturable,
           "outs": outs}
    if busy is not None:
        res["busy"], res["busy_step_ms"] = busy
    return res


def device_busy_seconds(prof) -> float:
    """Sum of the device's kernel, memcpy and memset durations in a profile (its chrome trace)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        trace = json.load(open(fh.name))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return 1e-6 * sum(e.get("dur", 0) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def hf_generate(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """transformers' generate (eager, its own KV cache) on the same config, random bf16 weights."""
    import transformers
    from zerokl.kernels.model.checkpoint import transformers_config
    hf_cfg = transformers_config(config, torch.bfloat16)
    with torch.device("cuda"):
        hf = transformers.GlmMoeDsaForCausalLM._from_config(hf_cfg, torch_dtype=torch.bfloat16).eval()
    ids = torch.randint(3, config.vocab_size, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)

    def timed(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(2)
    t1, tn = timed(1), timed(new_tokens)
    del hf
    torch.cuda.empty_cache()
    return {"decode_tok_s": batch * (new_tokens - 1) / (tn - t1)}


def hbm_bound(c: ModelConfig, batch: int) -> float:
    """Decode tok/s if a step only read its weights at HBM speed (flops.decode_weight_bytes, bf16)."""
    return batch / (decode_weight_bytes(c, batch) / hbm_bytes_per_s())


def prefill(model: Model, prompts: int, length: int, budget: int) -> dict:
    c = model.config
    reqs = make_requests(prompts, length, 1, c.vocab_size, seed=7)
    cfg = engine_config(prompts, length, 1, True, budget)
    with K.use_backend("triton"):
        eng = Engine(model, cfg)
        run_to_completion(eng, make_requests(2, length, 1, c.vocab_size, seed=8))     # compile
        torch.cuda.synchronize()
        t = time.perf_counter()
        run_to_completion(eng, reqs)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    flops = prefill_flops(c, prompts, length)
    return {"seconds": dt, "tflops": flops / dt / 1e12, "mfu": flops / dt / PEAK_BF16, "tokens": prompts * length}


def invariance(model: Model, reqs, cfg: EngineConfig) -> bool:
    with K.use_backend("triton"):
        batched = run_to_completion(Engine(model, cfg), reqs)
        for r in reqs:
            alone = run_to_completion(Engine(model, cfg), [r])[r.request_id]
            a = ([t for d in alone for t in d.token_ids], torch.tensor([x for d in alone for x in d.logprobs]))
            b = batched[r.request_id]
            b = ([t for d in b for t in d.token_ids], torch.tensor([x for d in b for x in d.logprobs]))
            if a[0] != b[0] or not torch.equal(a[1], b[1]):
                return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="small,small-dense,slice,prefill,busy,invariance",
                    help="comma list of: small, small-dense, slice, prefill, busy, invariance")
    ap.add_argument("--batches", default="1,64,256", help="decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock-backend arm")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--prefill-prompts", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-budget", type=int, default=8192)
    ap.add_argument("--invariance-requests", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "device": torch.cuda.get_device_name(), "commit": commit(), "torch": torch.__version__,
                 "args": vars(args), "rows": []}
    rows = res["rows"]

    def add(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    busy_on = "small-dense" if "small-dense" in parts or "small" not in parts else "small"
    invariance_on = "small-dense" if "small-dense" in parts or "small" not in parts else "small"
    for name in ("small-dense", "small"):
        if name not in parts and not ("busy" in parts and name == busy_on) \
                and not ("invariance" in parts and name == invariance_on):
            continue
        c = config_of(name)
        model = build_model(c, "cuda", torch.bfloat16).eval()
        for b in batches if name in parts else []:
            reqs = make_requests(b, args.prompt_len, args.new_tokens, c.vocab_size)
            cfg = engine_config(b, args.prompt_len, args.new_tokens, True, args.budget)
            tri = serve(model, reqs, cfg, "triton")
            row = {"config": name, "batch": b, "triton_tok_s": tri["decode_tok_s"], "ms_per_step": tri["ms_per_step"],
                   "graphs": tri["graphs"], "capturable": tri["capturable"]}
            if not args.no_stock:
                st = serve(model, reqs, cfg, "stock")
                row.update(stock_tok_s=st["decode_tok_s"], stock_graphs=st["graphs"],
                           ratio_vs_stock=tri["decode_tok_s"] / st["decode_tok_s"])
            if not args.no_hf:
                try:
                    hf = hf_generate(c, b, args.prompt_len, args.new_tokens)
                    row.update(hf_tok_s=hf["decode_tok_s"], ratio_vs_hf=tri["decode_tok_s"] / hf["decode_tok_s"])
                except Exception as err:  # noqa: BLE001 - reported, not fatal
                    row["hf_error"] = f"{type(err).__name__}: {err}"[:300]
            add(row)
        if "busy" in parts and name == busy_on:
            reqs = make_requests(64, args.prompt_len, min(args.new_tokens, 32), c.vocab_size)
            tri = serve(model, reqs, engine_config(64, args.prompt_len, args.new_tokens, True, args.budget), "triton",
                        profile=True)
            add({"config": name, "part": "busy", "batch": 64, "busy": tri.get("busy"), "step_ms": tri.get("busy_step_ms"),
                 "graphs": tri["graphs"]})
        if "invariance" in parts and name == invariance_on:
            reqs = make_requests(args.invariance_requests, args.prompt_len, min(args.new_tokens, 32), c.vocab_size, seed=3)
            ok = invariance(model, reqs, engine_config(len(reqs), args.prompt_len, args.new_tokens, True, args.budget))
            add({"config": name, "part": "invariance", "alone_equals_batched": ok})
        del model
        torch.cuda.empty_cache()

    if "slice" in parts or "prefill" in parts:
        model = build_model(SLICE, "cuda", torch.bfloat16).eval()
        for b in batches if "slice" in parts else []:
            reqs = make_requests(b, args.prompt_len, args.new_tokens, SLICE.vocab_size)
            tri = serve(model, reqs, engine_config(b, args.prompt_len, args.new_tokens, True, args.budget), "triton")
            bound = hbm_bound(SLICE, b)
            add({"config": "slice", "batch": b, "triton_tok_s": tri["decode_tok_s"], "ms_per_step": tri["ms_per_step"],
                 "hbm_bound_tok_s": bound, "fraction_of_bound": tri["decode_tok_s"] / bound, "graphs": tri["graphs"],
                 "capturable": tri["capturable"]})
        if "prefill" in parts:
            add({"config": "slice", "part": "prefill", "prompts": args.prefill_prompts, "len": args.prefill_len,
                 **prefill(model, args.prefill_prompts, args.prefill_len, args.prefill_budget)})
        del model
        torch.cuda.empty_cache()

    print(f"\n## bench_serve ({res['date']}, {res['device']}, commit {res['commit']})\n")
    print("| config | batch | zerokl triton+graphs tok/s | ms/step | stock+graphs tok/s | ratio | HF generate tok/s | "
          "ratio vs HF | HBM bound tok/s | graphs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "part" in r:
            continue
        f = lambda k, fmt="{:,.0f}": fmt.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        print(f"| {r['config']} | {r['batch']} | {f('triton_tok_s')} | {f('ms_per_step', '{:.2f}')} | {f('stock_tok_s')} | "
              f"{f('ratio_vs_stock', '{:.2f}')} | {f('hf_tok_s')} | {f('ratio_vs_hf', '{:.1f}')} | "
              f"{f('hbm_bound_tok_s')} | {r.get('graphs', '-')} |")
    for r in rows:
        if r.get("part") == "prefill":
            print(f"\nprefill (slice, {r['prompts']} x {r['len']}): {r['tflops']:.0f} TFLOP/s, MFU {100 * r['mfu']:.1f}%")
        elif r.get("part") == "busy":
            print(f"\nGPU-busy fraction, {r['config']} b64 decode step: {r['busy']:.2f} (step {r['step_ms']:.2f} ms)"
                  if r.get("busy") is not None else "\nGPU-busy fraction: not measured")
        elif r.get("part") == "invariance":
            print(f"\ninvariance ({r['config']}, graphs on): alone == batched: {r['alone_equals_batched']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
