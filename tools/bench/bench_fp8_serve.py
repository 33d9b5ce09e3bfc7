"""FP8 end to end on one GPU (issue 35), side by side in one run: decode of the GLM-5 slice in bf16
and in block-scaled FP8, every FP8 request alone == inside the batch, and a trainer step on the
FP8 forward vs the bf16 step on `small` (same batch).

    python tools/bench/bench_fp8_serve.py --json docs/bench/fp8-serve-h200.json     # ~4-6 min on an H200
    python tools/bench/bench_fp8_serve.py --device cpu --slice-preset tiny --train-preset tiny \\
        --batch 4 --new-tokens 4 --invariance-tokens 3 --train-batch 2 --train-seq 32 --steps 1 --json /tmp/f.json
                                                                                    # the CPU smoke of the code paths

Parts:
  decode     the slice (--slice-preset at real dimensions, --slice-layers layers, the first dense) at
             --batch, prompts of --prompt-len random tokens, --new-tokens generated (temperature 1,
             ignore_eos), the invariant backend + CUDA graphs. The bf16 model runs first; it is then
             quantized in place (zerokl.kernels.model.fp8.quantize_fp8: e4m3 projections and experts,
             bf16 activations) and the FP8 model runs the same requests. Decode tok/s counts the
             tokens of decode-only steps over their wall time (after a warm-up pass of the same
             shapes). Reported: tok/s of each, the ratio, and each against its HBM bound: the bytes
             one decode step reads (every weight tensor but the embedding, which is gathered by row;
             of the stacked routed experts only the expected touched fraction, 1 - (1 - k/E)^batch)
             at the GPU's HBM bandwidth (flops.hbm_bytes_per_s: H100 3.35, H200 4.8 TB/s), counted
             from the model's own tensors (e4m3 1 byte, scales 4 per 128 x 128 block, bf16 2, the fp32
             router 4). KV-cache reads are not counted (as bench_serve's bound).
  invariance every FP8 request of --batch alone == inside the batch: --invariance-tokens generated,
             tokens and fp32 logprobs compared exactly (torch.equal); also trainer == engine: the FP8
             trainer's recomputed logprobs of those samples equal the engine's bit for bit.
  train      `--train-preset` (small), --train-batch x --train-seq next-token SFT: the bf16 trainer
             (fp32 masters) vs the FP8 trainer (TrainConfig.dtype "fp8": FP8 forward, straight-through
             bf16 backward, fp32 masters re-quantized after each step), the same batch. Median
             seconds of forward+backward and of a whole step (forward+backward+optimizer step, the
             FP8 re-quantization included) and their FP8 / bf16 ratios (target <= 1.15); and the
             re-quantization alone, on the Triton kernel and on the torch ops it replaced.
Weights are random, drawn on the device by a seeded generator (bench_train.build_model).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import pathlib
import random
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_train import build_model, commit  # noqa: E402  (seeded on-device init, no portable draw)
from flops import hbm_bytes_per_s  # noqa: E402

import zerokl.kernels as K  # noqa: E402
from zerokl.kernels.model import ModelConfig  # noqa: E402
from zerokl.kernels.model.fp8 import is_fp8, quantize_fp8  # noqa: E402
from zerokl.services.engine.engine import Engine, run_to_completion  # noqa: E402
from zerokl.services.engine.types import EngineConfig, GenerateRequest  # noqa: E402
from zerokl.vocab import SamplingOptions  # noqa: E402
from zerokl.services.trainer.config import TrainConfig  # noqa: E402
from zerokl.services.trainer.trainer import Trainer  # noqa: E402
from zerokl.vocab import Completion  # noqa: E402

_EXPERT_NAMES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")      # MoE's stacked [E, out, in] experts


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_bytes(model, batch: int) -> dict:
    """Bytes one decode step of `batch` rows reads from the model's tensors (see the module doc)."""
    c = model.config
    e, k = c.n_routed_experts, c.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch) if e else 0.0
    total = expert = 0.0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("embed_tokens") or name == "inv_freq":
            continue
        nbytes = t.numel() * t.element_size()
        base = name.removesuffix("_scale_inv").removesuffix("_fp8")
        if base.endswith(_EXPERT_NAMES) and t.dim() == 3:      # [E, ...] routed experts (and their scales)
            nbytes = nbytes * touched / e
            expert += nbytes
        total += nbytes
    return {"bytes": total, "expert_bytes": expert, "touched_experts": touched,
            "hbm_bytes_per_s": hbm_bytes_per_s(), "hbm_bound_tok_s": batch / (total / hbm_bytes_per_s())}


def make_requests(n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(3, vocab) for _ in range(prompt_len)),
                            SamplingOptions(temperature=1.0, seed=i, max_tokens=new_tokens, ignore_eos=True))
            for i in range(n)]


def engine_config(batch: int, prompt_len: int, new_tokens: int, budget: int) -> EngineConfig:
    per_seq = -(-(prompt_len + new_tokens) // 16) + 1
    return EngineConfig(num_blocks=batch * per_seq + 16, block_size=16, max_num_seqs=batch,
                        max_num_batched_tokens=budget, max_model_len=prompt_len + new_tokens + 16, cuda_graphs=True)


def serve(model, reqs, cfg: EngineConfig, device: str) -> dict:
    """The requests through one Engine after a warm-up pass of the same shapes: decode tok/s over
    decode-only steps, and every request's (tokens, logprobs)."""
    eng = Engine(model, cfg)
    run_to_completion(eng, [GenerateRequest("w" + r.request_id, r.prompt_ids, r.options) for r in reqs])
    for r in reqs:
        eng.add_request(r)
    outs = {r.request_id: ([], []) for r in reqs}
    dec_t, dec_tok, steps = 0.0, 0, 0
    _sync(device)
    while eng.has_work():
        decode_only = not eng.waiting and bool(eng.running)
        t0 = time.perf_counter()
        deltas = eng.step()
        _sync(device)
        dt = time.perf_counter() - t0
        for d in deltas:
            outs[d.request_id][0].extend(d.token_ids)
            outs[d.request_id][1].extend(d.logprobs)
        if decode_only:
            dec_t += dt
            dec_tok += sum(len(d.token_ids) for d in deltas)
            steps += 1
    return {"decode_tok_s": dec_tok / dec_t if dec_t else 0.0, "ms_per_step": 1e3 * dec_t / max(steps, 1),
            "decode_steps": steps, "graphs": len(getattr(eng.runner, "_graphs", {})), "outs": outs}


def alone_equals_batched(model, reqs, cfg: EngineConfig) -> dict:
    """Every request alone (one engine, one request at a time) == inside the whole batch."""
    batched = run_to_completion(Engine(model, cfg), reqs)
    eng = Engine(model, cfg)
    differing, samples = [], []
    for r in reqs:
        alone = run_to_completion(eng, [r])[r.request_id]
        a = ([t for d in alone for t in d.token_ids], torch.tensor([x for d in alone for x in d.logprobs]))
        b = ([t for d in batched[r.request_id] for t in d.token_ids],
             torch.tensor([x for d in batched[r.request_id] for x in d.logprobs]))
        if a[0] != b[0] or not torch.equal(a[1], b[1]):
            differing.append(r.request_id)
        samples.append((r.prompt_ids, tuple(b[0]), b[1]))
    return {"requests": len(reqs), "differing": differing, "alone_equals_batched": not differing,
            "samples": samples}


def trainer_equals_engine(trainer: Trainer, samples) -> bool:
    """The FP8 trainer's recomputed logprobs of the engine's samples == the engine's, bit for bit."""
    seqs = [Completion(p, c, 1.0) for p, c, _ in samples]
    got = trainer.forward_logprobs(seqs)
    return all(torch.equal(g, lp) for g, (_, _, lp) in zip(got, samples, strict=True))


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def train_part(config: ModelConfig, device: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """bf16 vs FP8 trainer on the same batch: fwd+bwd and whole-step medians (seconds)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=g)
    seqs = [Completion((row[0],), tuple(row[1:])) for row in ids.tolist()]
    out = {"tokens_per_step": batch * (seq - 1)}
    for arm, dtype in (("bf16", None), ("fp8", "fp8")):
        trainer = Trainer(build_model(config, device, torch.bfloat16), TrainConfig(lr=1e-5, dtype=dtype))
        fb, whole = [], []
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            trainer.forward_backward("sft", seqs)
            _sync(device)
            t1 = time.perf_counter()
            trainer.optim_step()
            _sync(device)
            t2 = time.perf_counter()
            if i >= warmup:
                fb.append(t1 - t0)
                whole.append(t2 - t0)
        out[arm] = {"fwd_bwd_s": _median(fb), "step_s": _median(whole), "fp8": trainer.fp8,
                    "tokens_per_s": out["tokens_per_step"] / _median(whole)}
        if trainer.fp8:
            out[arm]["requantize_s"] = requantize_times(trainer, device, steps)
        if device.startswith("cuda"):
            out[arm]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        del trainer
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    out["fwd_bwd_ratio_fp8_vs_bf16"] = out["fp8"]["fwd_bwd_s"] / out["bf16"]["fwd_bwd_s"]
    out["step_ratio_fp8_vs_bf16"] = out["fp8"]["step_s"] / out["bf16"]["step_s"]
    return out


def requantize_times(trainer: Trainer, device: str, steps: int) -> dict:
    """Median seconds of the optimizer step's re-quantization of every FP8 weight from its fp32 master
    (Trainer._refresh_fp8), on the active backend's fp8_quantize_weight (Triton on CUDA) and on the
    torch ops' definition (what every backend ran before 272af10), side by side; the same bytes."""
    times = {}
    for name, backend in (("kernel", K.get_backend()), ("torch ops", "torch")):
        runs = []
        with K.use_backend(backend):
            for _ in range(steps + 1):
                _sync(device)
                t0 = time.perf_counter()
                trainer._refresh_fp8()
                _sync(device)
                runs.append(time.perf_counter() - t0)
        times[name] = _median(runs[1:])
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--parts", default="decode,invariance,train", help="comma list of: decode, invariance, train")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default=None, help="default: the device's invariant backend (triton on CUDA)")
    ap.add_argument("--slice-preset", default="glm5")
    ap.add_argument("--slice-layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--invariance-tokens", type=int, default=32)
    ap.add_argument("--train-preset", default="small")
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - {"decode", "invariance", "train"}:
        ap.error(f"--parts: unknown {sorted(parts - {'decode', 'invariance', 'train'})}")
    device = args.device
    backend = args.backend or ("triton" if device.startswith("cuda") else "torch")
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
                 "commit": commit(), "torch": torch.__version__, "numerics": K.__version__, "backend": backend,
                 "args": vars(args)}
    start = time.monotonic()

    def write() -> None:
        res["wall_s"] = round(time.monotonic() - start, 1)
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1) + "\n")

    with K.use_backend(backend):
        if parts & {"decode", "invariance"}:
            sl = ModelConfig.preset(args.slice_preset).replace(num_hidden_layers=args.slice_layers,
                                                               first_k_dense_replace=1)
            model = build_model(sl, device, torch.bfloat16).eval().requires_grad_(False)
            reqs = make_requests(args.batch, args.prompt_len, args.new_tokens, sl.vocab_size)
            cfg = engine_config(args.batch, args.prompt_len, args.new_tokens, args.budget)
            if "decode" in parts:
                b = serve(model, reqs, cfg, device)
                bb = step_bytes(model, args.batch)
                res["decode_bf16"] = {k: v for k, v in b.items() if k != "outs"} | bb | {
                    "fraction_of_bound": b["decode_tok_s"] / bb["hbm_bound_tok_s"]}
                print(json.dumps({"decode_bf16": res["decode_bf16"]}), flush=True)
                write()
            with torch.no_grad():
                quantize_fp8(model)                 # in place: the bf16 projections and experts are freed
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            assert is_fp8(model)
            if "decode" in parts:
                f = serve(model, reqs, cfg, device)
                fb = step_bytes(model, args.batch)
                res["decode_fp8"] = {k: v for k, v in f.items() if k != "outs"} | fb | {
                    "fraction_of_bound": f["decode_tok_s"] / fb["hbm_bound_tok_s"]}
                res["decode_fp8_vs_bf16"] = f["decode_tok_s"] / res["decode_bf16"]["decode_tok_s"]
                res["bytes_fp8_vs_bf16"] = fb["bytes"] / res["decode_bf16"]["bytes"]
                print(json.dumps({"decode_fp8": res["decode_fp8"], "ratio": res["decode_fp8_vs_bf16"]}), flush=True)
                write()
            if "invariance" in parts:
                ireqs = make_requests(args.batch, args.prompt_len, args.invariance_tokens, model.config.vocab_size,
                                      seed=3)
                inv = alone_equals_batched(model, ireqs, engine_config(args.batch, args.prompt_len,
                                                                       args.invariance_tokens, args.budget))
                res["invariance_fp8"] = {k: v for k, v in inv.items() if k != "samples"}
                print(json.dumps({"invariance_fp8": res["invariance_fp8"]}), flush=True)
                write()
            del model
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        if "train" in parts:
            tc = ModelConfig.preset(args.train_preset)
            res["train"] = train_part(tc, device, args.train_batch, args.train_seq, args.steps, args.warmup)
            # trainer == engine in FP8 on this device: samples of the FP8 engine, recomputed by the FP8 trainer.
            trainer = Trainer(build_model(tc, device, torch.bfloat16), TrainConfig(dtype="fp8"))
            served = trainer.serving_model()
            ireqs = make_requests(8, 32, 16, tc.vocab_size, seed=5)
            inv = alone_equals_batched(served, ireqs, engine_config(8, 32, 16, args.budget))
            res["train"]["fp8_engine_alone_equals_batched"] = inv["alone_equals_batched"]
            res["train"]["fp8_trainer_equals_engine"] = trainer_equals_engine(trainer, inv["samples"])
            print(json.dumps({"train": res["train"]}), flush=True)
            write()
    write()
    d, f = res.get("decode_bf16"), res.get("decode_fp8")
    if d and f:
        print(f"\nslice decode b{args.batch}: bf16 {d['decode_tok_s']:,.0f} tok/s ({d['fraction_of_bound']:.2f} of "
              f"{d['hbm_bound_tok_s']:,.0f}), FP8 {f['decode_tok_s']:,.0f} tok/s ({f['fraction_of_bound']:.2f} of "
              f"{f['hbm_bound_tok_s']:,.0f}); FP8 / bf16 {res['decode_fp8_vs_bf16']:.2f}x "
              f"(bytes {res['bytes_fp8_vs_bf16']:.2f}x)")
    if "invariance_fp8" in res:
        print(f"FP8 alone == batched ({res['invariance_fp8']['requests']} requests): "
              f"{res['invariance_fp8']['alone_equals_batched']}")
    if "train" in res:
        t = res["train"]
        print(f"trainer step ({args.train_preset}, {args.train_batch} x {args.train_seq}): bf16 "
              f"{t['bf16']['step_s'] * 1e3:.1f} ms, FP8 {t['fp8']['step_s'] * 1e3:.1f} ms: {t['step_ratio_fp8_vs_bf16']:.2f}x "
              f"(fwd+bwd {t['fwd_bwd_ratio_fp8_vs_bf16']:.2f}x); FP8 trainer == engine: {t['fp8_trainer_equals_engine']}")
        rq = t["fp8"]["requantize_s"]
        print(f"re-quantization of every FP8 weight: kernel {rq['kernel'] * 1e3:.1f} ms, torch ops "
              f"{rq['torch ops'] * 1e3:.1f} ms")
    print(f"wrote {args.json} in {res['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
