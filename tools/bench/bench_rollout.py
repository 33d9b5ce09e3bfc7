"""Rollout-shaped work on the engine: long prompts, long answers (issue 33's benchmark).

    python tools/bench/bench_rollout.py --json rollout.json                       # the default cases
    python tools/bench/bench_rollout.py --cases small:64x1024x512,slice:16x2048x32 --json out.json
    python tools/bench/bench_rollout.py --cases tiny:4x64x8 --device cpu           # a smoke run

A case is ``MODEL:BxLxG``: B requests of L random prompt tokens each, G generated tokens each
(temperature 1, ignore_eos, seeds 0..B-1), all submitted at once to one Engine (bf16 on CUDA,
the invariant backend, CUDA graphs on, --budget tokens per step). MODEL is a preset (`small`,
`tiny`) or `slice` (GLM-5 at real dimensions, --slice-layers layers, the first dense).
Reported per case, from the engine's own steps timed on the host (each step ends in its one
device->host copy):
  prefill   prompt tokens / time of the steps that ran prompt tokens; MFU = flops.prefill_flops / s over
            --peak-tflops (the work done: no FLOPs for the embedding lookup, the lm_head on one row a
            prompt; before 2026-12-06 both were counted on every prompt token, about 2x the slice's work)
  decode    generated tokens / time of the steps that ran decode rows only; the median step
  end2end   generated tokens / wall time from the first add_request to the last token
  cold      one engine per case (as a server keeps one); a first pass of other prompts of the
            same shapes compiles and captures its graphs: its wall time is `first_call_s`, its
            tok/s `cold_end2end_tok_s`; the figures above are the second pass's
  invariant 2 requests of the batch run again alone on that engine (their prompts now prefix-
            cache hits): tokens and logprobs equal (==) or not.
  overlap   every case runs twice, side by side: overlapped decode on (the CUDA default: step N+1
            staged and launched while step N runs) and off (`sync`: each step waited for); the
            two passes' tokens and logprobs equal (==) or not (`overlap_equals_sync`).
  compiles  each engine warms up when it is built (EngineConfig.warm_up: every decode graph, the
            prefill shapes; `engine_start_s`); Triton kernels compiled in this process after
            that (a jit post-compile hook: disk-cache loads count too) are `compiles_after_warm_up`,
            with the first few kernels' signatures, and the Triton cache's file count before/after.
The `scaling` part times decode steps at batch --scaling-batch with a short and a long context,
overlap on and off (step = wall time of 16 consecutive steps / 16, the device synchronized at the
end), and profiles a few steps of each (kernels per step, GPU busy fraction = summed kernel time
over wall time). The `mixed` part is target 4's count: one engine, built and warmed up as a server
is, then --mixed-seconds of requests of mixed lengths (prompts 16..--mixed-max-prompt tokens, answers
1..--mixed-max-new tokens, up to --mixed-in-flight at once, a new one admitted whenever one ends)
stepped without pause: Triton compiles after the warm-up counted, with a progress line every 30 s.
The `transformers` part runs GlmMoeDsaForCausalLM.generate on the same config and
prompts (B x L, --hf-new-tokens new tokens) for the outside reference.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import statistics
import sys
import time

import torch

import zerokl.kernels as K
from zerokl.kernels.model import ModelConfig
from zerokl.services.engine.engine import Engine
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_train import build_model, commit, hf_model  # noqa: E402
from flops import prefill_flops  # noqa: E402
from engine_steps import timed_step  # noqa: E402

DEFAULT_CASES = "small:64x1024x512,small:256x1024x1024,small:16x2048x4,slice:16x2048x32"


# ----------------------------------------------------------------------------- the workload

def parse_case(text: str) -> tuple[str, int, int, int]:
    """'small:64x1024x512' -> ('small', 64, 1024, 512)."""
    model, _, shape = text.partition(":")
    b, l, g = (int(x) for x in shape.split("x"))
    return model, b, l, g


def make_requests(n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(3, vocab) for _ in range(prompt_len)),
                            SamplingOptions(temperature=1.0, seed=i, max_tokens=new_tokens, ignore_eos=True))
            for i in range(n)]


def model_config(name: str, slice_layers: int) -> ModelConfig:
    if name == "slice":
        return ModelConfig.preset("glm5").replace(num_hidden_layers=slice_layers, first_k_dense_replace=1)
    return ModelConfig.preset(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Compiles:
    """Triton kernels compiled (or loaded from the disk cache) in this process, counted by the JIT's
    post-compile hook, and the Triton cache directory's file count."""

    def __init__(self):
        self.kernels: list[str] = []
        try:
            import triton
            self._knobs = triton.knobs
            self._previous = triton.knobs.runtime.jit_post_compile_hook
            triton.knobs.runtime.jit_post_compile_hook = self._hook
        except (ImportError, AttributeError):      # no Triton, or one without knobs: files only
            self._knobs = None

    def _hook(self, *args, **kwargs):
        self.kernels.append(str(kwargs.get("repr", "?"))[:160])
        if self._previous:
            return self._previous(*args, **kwargs)
        return None

    def cache_files(self) -> int | None:
        import os
        root = os.environ.get("TRITON_CACHE_DIR") or (self._knobs.cache.dir if self._knobs else None)
        if not root or not os.path.isdir(root):
            return None
        return sum(len(files) for _, _, files in os.walk(root))


COMPILES: Compiles | None = None


def make_engine(model, reqs: list[GenerateRequest], budget: int, max_len: int, overlap: bool | None = None) -> Engine:
    """An engine with room for every request of ``reqs`` at once (and its own CUDA graphs, warmed up on CUDA)."""
    blocks = sum(-(-(len(r.prompt_ids) + r.options.max_tokens) // 16) for r in reqs) + 64
    return Engine(model, EngineConfig(max_num_batched_tokens=budget, num_blocks=blocks, max_num_seqs=len(reqs),
                                      max_model_len=max_len, overlap_decode=overlap,
                                      warm_up=model_device(model).type == "cuda"))


def run_engine(eng: Engine, reqs: list[GenerateRequest]) -> dict:
    """One pass: every request submitted at once, stepped to completion; per-step host times."""
    model = eng.runner.model
    out: dict[str, tuple[list[int], list[float]]] = {r.request_id: ([], []) for r in reqs}
    prefill_s = decode_s = 0.0
    decode_steps: list[float] = []
    decode_tokens = 0
    _sync(model_device(model))
    start = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        prefilling = prompt_pending(eng)
        dt, n = timed_step(eng, out)              # host times: no device sync
        if prefilling:
            prefill_s += dt
        else:
            decode_s += dt
            decode_steps.append(dt)
            decode_tokens += n
    wall = time.perf_counter() - start
    generated = sum(len(t) for t, _ in out.values())
    return {"wall_s": wall, "prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens": decode_tokens,
            "decode_step_median_s": statistics.median(decode_steps) if decode_steps else None,
            "generated": generated, "outputs": out}


def prompt_pending(eng: Engine) -> bool:
    """Whether the next step runs prompt tokens (a request waits, or one has not read its whole prompt)."""
    return bool(eng.waiting) or any(s.num_computed < len(s.request.prompt_ids) for s in eng.running)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def run_case(model, config: ModelConfig, b: int, l: int, g: int, args) -> dict:
    reqs = make_requests(b, l, g, config.vocab_size)
    max_len = l + g + 16
    prompt_tokens = b * l
    flops = prefill_flops(config, b, l)
    row: dict = {"case": f"{args.model_name}:{b}x{l}x{g}"}
    outputs = {}
    for mode in ("overlap", "sync"):
        files, compiled = COMPILES.cache_files(), len(COMPILES.kernels)
        t0 = time.perf_counter()
        # One engine per case and mode, as a server keeps one (built = warmed up on CUDA). The
        # overlap engine's cold pass (other prompts of the same shapes, so the measured pass has no
        # prefix-cache hit) is the first call a fresh server sees.
        eng = make_engine(model, reqs, args.budget, max_len, overlap=mode == "overlap")
        _sync(model_device(model))
        start_s = time.perf_counter() - t0
        after_warm_up = len(COMPILES.kernels)
        part: dict = {"engine_start_s": start_s}
        if mode == "overlap":
            cold = run_engine(eng, make_requests(b, l, g, config.vocab_size, seed=100))
            part["first_call_s"] = time.perf_counter() - t0
            part["cold_end2end_tok_s"] = cold["generated"] / cold["wall_s"]
        r = run_engine(eng, reqs)
        part.update({
            "wall_s": r["wall_s"], "prefill_tok_s": prompt_tokens / r["prefill_s"],
            "prefill_mfu": flops / r["prefill_s"] / (args.peak_tflops * 1e12),
            "decode_tok_s": r["decode_tokens"] / r["decode_s"] if r["decode_s"] else None,
            "decode_step_median_ms": 1e3 * r["decode_step_median_s"] if r["decode_step_median_s"] else None,
            "end2end_tok_s": r["generated"] / r["wall_s"], "generated": r["generated"],
            "compiles_in_warm_up": after_warm_up - compiled,
            "compiles_after_warm_up": len(COMPILES.kernels) - after_warm_up,
            "compiled_after_warm_up": COMPILES.kernels[after_warm_up:][:8],
            "triton_cache_files_before_after": [files, COMPILES.cache_files()]})
        outputs[mode] = r["outputs"]
        if mode == "overlap":
            same = True
            for req in reqs[:2]:      # alone, on the same engine: its prompt now a prefix-cache hit, as well
                alone = run_engine(eng, [req])["outputs"][req.request_id]
                same &= alone == r["outputs"][req.request_id]
            part["alone_equals_batch"] = same
        row[mode] = part
        print(f"  {row['case']} overlap {'on ' if mode == 'overlap' else 'off'}: prefill {part['prefill_tok_s']:,.0f} "
              f"tok/s (MFU {part['prefill_mfu']:.1%}), decode {part['decode_tok_s'] or 0:,.0f} tok/s (step "
              f"{part['decode_step_median_ms'] or 0:.2f} ms), end-to-end {part['end2end_tok_s']:,.0f} tok/s, engine start "
              f"{start_s:.1f} s, compiles after warm-up {part['compiles_after_warm_up']}"
              + (f", first call {part['first_call_s']:.1f} s, alone==batch {part['alone_equals_batch']}"
                 if mode == "overlap" else ""), flush=True)
        del eng
        if model_device(model).type == "cuda":
            torch.cuda.empty_cache()
    row["overlap_equals_sync"] = outputs["overlap"] == outputs["sync"]
    print(f"  {row['case']}: overlap on == off (tokens and logprobs): {row['overlap_equals_sync']}", flush=True)
    return row


# ----------------------------------------------------------------------------- decode scaling with context

def profile_decode(model, reqs, args, steps: int, overlap: bool | None = None) -> dict:
    """Decode steps of ``reqs`` after their prefill: the step time (16 consecutive steps, synchronized
    at the end), and a profile of ``steps`` of them (kernels per step, summed kernel time over wall time)."""
    from torch.profiler import ProfilerActivity, profile
    dev = model_device(model)
    max_len = max(len(r.prompt_ids) for r in reqs) + reqs[0].options.max_tokens + 16
    blocks = sum(-(-max_len // 16) for _ in reqs) + 64
    eng = Engine(model, EngineConfig(max_num_batched_tokens=args.budget, num_blocks=blocks, max_num_seqs=len(reqs),
                                     max_model_len=max_len, overlap_decode=overlap, warm_up=dev.type == "cuda"))
    for r in reqs:
        eng.add_request(r)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    _sync(dev)
    with profile(activities=acts) as p:
        t0, n = time.perf_counter(), 0
        while prompt_pending(eng):
            eng.step()
            n += 1
        _sync(dev)
        wall = time.perf_counter() - t0
    prefill = _summary(p, wall, n)
    for _ in range(8):                 # past the prefill: every row decodes; graphs captured at this width
        eng.step()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(16):
        eng.step()
    _sync(dev)
    step_s = (time.perf_counter() - t0) / 16
    with profile(activities=acts) as p:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync(dev)
        wall = time.perf_counter() - t0
    decode = _summary(p, wall, steps)
    return {"step_ms": 1e3 * step_s, **decode, "prefill_profile": prefill}


def _summary(p, wall: float, steps: int) -> dict:
    """Kernels per step, GPU busy (summed kernel time / wall) and the top kernels (ms in all) of a profile."""
    # The raw kineto events: kernels (also those a replayed CUDA graph ran) with their device durations.
    kernels = [(e.name(), e.duration_ns()) for e in p.profiler.kineto_results.events()
               if e.device_type() == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name()
               and "Memset" not in e.name()]
    busy = sum(ns for _, ns in kernels) / 1e9
    top: dict[str, float] = {}
    for name, ns in kernels:
        top[name[:80]] = top.get(name[:80], 0.0) + ns / 1e6
    # The host side: the ops with the most self CPU time (a sync shows as cudaStreamSynchronize /
    # aten::item / aten::_local_scalar_dense; a host-built tensor as aten::copy_ or aten::to).
    host = sorted(p.key_averages(), key=lambda a: -a.self_cpu_time_total)[:12]
    return {"steps": steps, "wall_ms": 1e3 * wall, "kernels_per_step": len(kernels) / max(steps, 1),
            "gpu_busy": busy / wall if wall else None,
            "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:10]),
            "top_host_ms": {a.key[:60]: [round(a.self_cpu_time_total / 1e3, 2), a.count] for a in host}}


def scaling(model, config, args) -> dict:
    out: dict = {}
    for mode in ("overlap", "sync"):
        part = out[mode] = {}
        for ctx in (64, args.scaling_context):
            reqs = make_requests(args.scaling_batch, ctx, 64, config.vocab_size, seed=3)
            got = part[str(ctx)] = profile_decode(model, reqs, args, steps=8, overlap=mode == "overlap")
            print(f"  decode batch {args.scaling_batch} at context {ctx}, overlap {'on' if mode == 'overlap' else 'off'}: "
                  f"step {got['step_ms']:.2f} ms, {got['kernels_per_step']:.0f} kernels/step, GPU busy "
                  f"{got['gpu_busy'] or 0:.2f}; prefill before it: GPU busy {got['prefill_profile']['gpu_busy'] or 0:.2f}",
                  flush=True)
        part["ratio_long_over_short"] = part[str(args.scaling_context)]["step_ms"] / part["64"]["step_ms"]
        print(f"  overlap {'on' if mode == 'overlap' else 'off'}: step at {args.scaling_context} / at 64 = "
              f"{part['ratio_long_over_short']:.2f}", flush=True)
    return out


# ----------------------------------------------------------------------------- mixed lengths: compiles after start-up

def mixed(model, config: ModelConfig, args) -> dict:
    """Target 4: compiles after the warm-up over --mixed-seconds of mixed-length traffic on one engine."""
    rng = random.Random(7)
    max_len = args.mixed_max_prompt + args.mixed_max_new + 16
    blocks = args.mixed_in_flight * (-(-max_len // 16)) + 64
    t0 = time.perf_counter()
    before = len(COMPILES.kernels)
    eng = Engine(model, EngineConfig(max_num_batched_tokens=args.budget, num_blocks=blocks,
                                     max_num_seqs=args.mixed_in_flight, max_model_len=max_len,
                                     warm_up=model_device(model).type == "cuda"))
    _sync(model_device(model))
    start_s = time.perf_counter() - t0
    after_warm_up = len(COMPILES.kernels)
    n = done = generated = steps = 0
    prompt_lengths: list[int] = []

    def submit() -> None:
        nonlocal n
        length = rng.randint(16, args.mixed_max_prompt)
        prompt_lengths.append(length)
        eng.add_request(GenerateRequest(f"m{n}", tuple(rng.randrange(3, config.vocab_size) for _ in range(length)),
                                        SamplingOptions(temperature=1.0, seed=n, ignore_eos=True,
                                                        max_tokens=rng.randint(1, args.mixed_max_new))))
        n += 1

    for _ in range(args.mixed_in_flight):
        submit()
    start = last_print = time.perf_counter()
    while time.perf_counter() - start < args.mixed_seconds:
        for d in eng.step():
            generated += len(d.token_ids)
            if d.finished:
                done += 1
                submit()
        steps += 1
        if time.perf_counter() - last_print >= 30:
            last_print = time.perf_counter()
            print(f"  mixed: {last_print - start:.0f} s, {steps} steps, {done} requests done, {generated:,} tokens, "
                  f"compiles after warm-up {len(COMPILES.kernels) - after_warm_up}", flush=True)
    wall = time.perf_counter() - start
    row = {"seconds": wall, "engine_start_s": start_s, "compiles_in_warm_up": after_warm_up - before,
           "compiles_after_warm_up": len(COMPILES.kernels) - after_warm_up,
           "compiled_after_warm_up": COMPILES.kernels[after_warm_up:][:8], "steps": steps, "requests_done": done,
           "generated": generated, "tok_s": generated / wall, "prompt_len_min_max": [min(prompt_lengths), max(prompt_lengths)],
           "in_flight": args.mixed_in_flight}
    print(f"  mixed lengths for {wall:.0f} s: {done} requests, {generated:,} tokens, compiles after warm-up "
          f"{row['compiles_after_warm_up']} (warm-up compiled {row['compiles_in_warm_up']} in {start_s:.1f} s)", flush=True)
    del eng
    return row


# ----------------------------------------------------------------------------- transformers beside it

def transformers_generate(config: ModelConfig, b: int, l: int, new_tokens: int, device: str) -> dict:
    model, note = hf_model(config, device, torch.bfloat16)
    if model is None:
        return {"note": note}
    model.eval()
    reqs = make_requests(b, l, new_tokens, config.vocab_size)
    ids = torch.tensor([r.prompt_ids for r in reqs], device=device)
    row = {"note": note, "shape": f"{b}x{l}x{new_tokens}"}
    try:
        with torch.no_grad():
            times = {}
            for n in (1, new_tokens):
                _sync(torch.device(device))
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_k=0)
                _sync(torch.device(device))
                times[n] = time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001 - an out-of-memory or unsupported generate is a result
        row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        return row
    row["prefill_tok_s"] = b * l / times[1]
    row["decode_tok_s"] = b * (new_tokens - 1) / (times[new_tokens] - times[1]) if new_tokens > 1 else None
    row["end2end_tok_s"] = b * new_tokens / times[new_tokens]
    print(f"  transformers {row['shape']}: prefill {row['prefill_tok_s']:,.0f} tok/s, decode "
          f"{row['decode_tok_s'] or 0:,.0f} tok/s ({note})", flush=True)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    return row


# ----------------------------------------------------------------------------- plot

def plot(results: dict, path: pathlib.Path) -> bool:
    """Bars of each case's prefill / decode / end-to-end tok/s, overlap on beside off (a PNG), when
    matplotlib is there."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = [c for c in results.get("cases", []) if "overlap" in c]
    if not cases:
        return False
    metrics = [("prefill_tok_s", "prefill"), ("decode_tok_s", "decode"), ("end2end_tok_s", "end to end")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2))
    for ax, (key, title) in zip(axes, metrics):
        x = range(len(cases))
        for i, mode in enumerate(("overlap", "sync")):
            ax.bar([j + 0.4 * i for j in x], [c[mode].get(key) or 0 for c in cases], width=0.4,
                   label="overlap on" if mode == "overlap" else "overlap off")
        ax.set_xticks([j + 0.2 for j in x], [c["case"] for c in cases], fontsize=7)
        ax.set_title(f"{title} tok/s", fontsize=9)
    axes[0].legend(fontsize=7)
    m = results["meta"]
    fig.suptitle(f"bench_rollout, {m['device']}, {m['commit']}, {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of MODEL:BxLxG")
    ap.add_argument("--parts", default="cases,scaling,transformers", help="comma list of: cases, scaling, mixed, transformers")
    ap.add_argument("--budget", type=int, default=8192, help="tokens per engine step")
    ap.add_argument("--slice-layers", type=int, default=4, help="layers of the GLM-5 slice")
    ap.add_argument("--scaling-batch", type=int, default=64)
    ap.add_argument("--scaling-context", type=int, default=2048)
    ap.add_argument("--mixed-seconds", type=float, default=600.0, help="length of the mixed part's run")
    ap.add_argument("--mixed-max-prompt", type=int, default=4096)
    ap.add_argument("--mixed-max-new", type=int, default=1024)
    ap.add_argument("--mixed-in-flight", type=int, default=64)
    ap.add_argument("--hf-shape", default="small:64x1024x32", help="transformers' case, MODEL:BxLxG")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device (H200: 989)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the results here (and the cases' plot beside it, .png)")
    ap.add_argument("--plot-only", default=None, metavar="JSON", help="redraw a saved results JSON's plot and exit")
    args = ap.parse_args(argv)
    if args.plot_only:
        src = pathlib.Path(args.plot_only)
        return 0 if plot(json.loads(src.read_text()), src.with_suffix(".png")) else 1
    parts = set(args.parts.split(","))
    global COMPILES
    COMPILES = Compiles()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    stamp = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
             "commit": commit(), "numerics": K.__version__, "budget": args.budget}
    print(stamp, flush=True)
    results: dict = {"meta": stamp, "cases": []}
    models: dict[str, object] = {}

    def save() -> None:
        """Rewritten after every part, so a time limit still leaves what ran."""
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
            plot(results, pathlib.Path(args.json).with_suffix(".png"))

    def get(name: str):
        if name not in models:
            models.clear()
            if device == "cuda":
                torch.cuda.empty_cache()
            config = model_config(name, args.slice_layers)
            models[name] = (build_model(config, device, dtype).eval(), config)
        return models[name]

    with K.use_backend("triton" if device == "cuda" else "torch"):
        if "cases" in parts:
            for text in args.cases.split(","):
                name, b, l, g = parse_case(text)
                model, config = get(name)
                args.model_name = name
                try:
                    results["cases"].append(run_case(model, config, b, l, g, args))
                except torch.cuda.OutOfMemoryError as err:
                    results["cases"].append({"case": text, "error": f"out of memory: {str(err)[:160]}"})
                    print(f"  {text}: out of memory", flush=True)
                save()
        if "scaling" in parts:
            name = args.cases.split(",")[0].partition(":")[0]
            model, config = get(name)
            results["scaling"] = scaling(model, config, args)
            save()
        if "mixed" in parts:
            model, config = get(args.cases.split(",")[0].partition(":")[0])
            results["mixed"] = mixed(model, config, args)
            save()
    if "transformers" in parts:
        name, b, l, g = parse_case(args.hf_shape)
        models.clear()
        results["transformers"] = transformers_generate(model_config(name, args.slice_layers), b, l, g, device)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
