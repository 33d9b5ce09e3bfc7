"""Trainer forward + backward on one GPU, side by side in one run (issue 22).

    python tools/bench/bench_train.py --out docs/bench                      # every part, issue 22's sizes
    python tools/bench/bench_train.py --parts small --profile small/triton  # one part, plus a profile
    python tools/bench/bench_train.py --smoke --device cpu --out /tmp/b     # tiny, on the CPU (the CI test)
    python tools/bench/bench_train.py --plot-from docs/bench/bench_train.json   # re-render table + PNG

Parts (bf16 on CUDA; next-token loss = mean cross-entropy over every position but the last):
  small  `small` preset, --batch x --seq (8 x 512): tokens/s of the zerokl trainer's SFT
         forward_backward (fused head + logprob) on each --backends backend, on CUDA also with
         TrainConfig.cuda_graphs (the step replayed from a CUDA graph), and of transformers'
         GlmMoeDsaForCausalLM (its default attention and experts implementations, eager) on the
         same config.json and loss; MFU; peak memory. Also the invariant backend in FP8
         (TrainConfig.dtype "fp8": e4m3 forward, straight-through bf16 backward, fp32 masters; with
         CUDA graphs on CUDA), with its throughput over the bf16 arm's (--no-fp8 skips it).
  slice  GLM-5 at real dimensions, --slice-layers layers (one dense, the rest MoE):
         --slice-batch x --slice-seq (halved until it fits), on the invariant backend: tokens/s,
         MFU with and without attention FLOPs, peak memory (activation checkpointing off); then
         the same batch in FP8 (its fp32 masters add 4 bytes a parameter: out of memory is a result).
  long   one --long-seq sequence on that slice, activation checkpointing on and off: peak memory.
  rl     the RL step in process (issue 34, target 4): --rl-prompts x --rl-group rollouts a step
         (prompts of 16-64 tokens, completions of --rl-completion MIN MAX tokens, behaviour
         logprobs the trainer's own: KL 0), GRPO's forward_backward + optim_step over --rl-steps
         steps (each step new lengths; the default trainer: CUDA graphs, fp32 masters); beside
         it the SFT forward + backward on 512-token rows of the same token count: tok/s of both
         and their ratio (completion tokens / forward_backward seconds, median step).
Ratios: each backend's tokens/s over the stock backend's and over transformers'.

MFU = 6 x active params x tokens/s / 989e12 (H100 / H200 dense bf16), the counts of flops.py: active
params are those a token multiplies by (the lm_head included, the embedding table not: a lookup;
num_experts_per_tok of the routed experts; before 2026-12-06 the embedding was counted too, which
put the GLM-5 slice's MFU about a quarter too high). With attention: + 3 x (the absorbed MLA's
2*H*(2R+P) FLOPs per attended key, plus the indexer's 2*Hi*Di per causal key on its full layers,
counted once: it has no backward) per token. Big models are built on the device (meta, then a seeded torch.randn on the device
per tensor): cheap and deterministic per GPU, never GLM-5's weights through the CPU's
portable RNG. A part that runs out of memory is recorded as such, with the peak reached.
Results are written after every measurement (JSON, markdown table, PNG when matplotlib is there).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import pathlib
import sys
import time

import torch

from zerokl.kernels import ops, use_backend
from zerokl.kernels.backend import default_backend
from zerokl.kernels.dtypes import dtype_name
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion, Rollout

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from flops import PEAK_BF16, active_params, total_params, train_attention_flops_per_token  # noqa: E402
from provenance import commit  # noqa: E402



# ----------------------------------------------------------------------------- models

class _Uninitialized(Model):
    """A Model whose constructor draws nothing (its weights are filled on the device afterwards)."""

    def init_weights(self, seed):
        pass


def build_model(config: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> Model:
    """The model on `device` with Normal(0, 0.02) projections drawn there by a seeded generator
    (depth-scaled output projections, unit norms, as Model.init_weights), built through the
    meta device: no weight ever exists on the CPU. Deterministic for a given device."""
    with torch.device("meta"):
        model = _Uninitialized(config, dtype=dtype)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        model.inv_freq.copy_(ops.rope_inv_freq(config.qk_rope_head_dim, config.rope_theta).to(device))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    # Model.init_weights' recipe, drawn on the device (the subclass's own init_weights draws nothing).
    Model.init_weights(model, seed, normal=lambda shape: torch.randn(shape, generator=g, device=device,
                                                                     dtype=torch.float32))
    return model


def hf_model(config: ModelConfig, device: str, dtype: torch.dtype):
    """transformers' GlmMoeDsaForCausalLM on the same config.json (random weights), or None."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
        return None, f"transformers {transformers.__version__} has no GlmMoeDsaForCausalLM"
    from zerokl.kernels.model.checkpoint import transformers_config
    hf_config = transformers_config(config, dtype)
    with torch.device(device):
        model = transformers.GlmMoeDsaForCausalLM._from_config(hf_config, dtype=dtype)
    impl = getattr(model.config, "_attn_implementation", "?")
    experts = getattr(model.config, "_experts_implementation", None)
    return model.train(), f"transformers {transformers.__version__}, attention {impl}" + (
        f", experts {experts}" if experts else "")


# ----------------------------------------------------------------------------- measurement

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _tokens(config: ModelConfig, batch: int, seq: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, seq), generator=g)


def zerokl_step(trainer: Trainer, ids: torch.Tensor):
    """One SFT forward + backward over every next token of ids [B, S] (prompt = the first token)."""
    seqs = [Completion((row[0],), tuple(row[1:])) for row in ids.tolist()]
    def step():
        trainer.forward_backward("sft", seqs)
        trainer.optimizer.zero_grad(set_to_none=True)
    return step


def hf_step(model, ids: torch.Tensor):
    ids = ids.to(next(model.parameters()).device)
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def measure(step, device: str, steps: int, warmup: int, profile: str | None = None) -> dict:
    """Median seconds per step, peak memory (CUDA), and the profiler's top kernels when asked."""
    for _ in range(warmup):
        step()
    _sync(device)
    # The peak counts the warm-up too (run_case reset it before the build): a CUDA graph's memory
    # pool is allocated when the step is captured, during the warm-up.
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    out = {"seconds_per_step": sorted(times)[len(times) // 2], "steps": steps}
    if device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with prof(activities=acts, with_stack=True, record_shapes=True) as p:
            step()
            _sync(device)
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        table = p.key_averages().table(sort_by=key, row_limit=25)
        out["profile_top"] = table
        if device == "cuda":
            # the GPU's share of the step: summed kernel time over the profiled step's wall time
            kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            out["profile_kernels"] = len(kernels)
            out["profile_kernel_ms"] = sum(e.device_time_total for e in kernels) / 1e3
        # where the time is launched from: ops and autograd nodes by inclusive time (with_stack adds the
        # Python functions as events where the profiler records them: torch 2.13 on CPU, not 2.11 on the H200)
        inclusive = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        out["profile_functions"] = p.key_averages().table(sort_by=inclusive, row_limit=70, max_name_column_width=70)
        # which tensors the glue's ops (copies, element-wise) spend their time on
        out["profile_shapes"] = p.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=30,
                                                                                max_name_column_width=40)
        print(f"--- profile: {profile}, ops and Python functions by {inclusive} ---\n{out['profile_functions']}",
              flush=True)
        print(f"--- profile: {profile}, ops by input shapes, by {key} ---\n{out['profile_shapes']}", flush=True)
        print(f"--- profile: {profile}, top kernels by {key} ---\n{table}\n"
              f"kernels {out.get('profile_kernels')}, summed kernel time {out.get('profile_kernel_ms')} ms", flush=True)
    return out


def _oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def run_case(name: str, build, device: str, steps: int, warmup: int, tokens: int, profile: str | None) -> dict:
    """Build and measure one arm; out-of-memory is a result, not a crash."""
    row = {"name": name, "tokens_per_step": tokens}
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        step, note = build()
        if step is None:
            return row | {"skipped": note}
        row["note"] = note
        row |= measure(step, device, steps, warmup, profile if profile == name else None)
        row["tokens_per_s"] = tokens / row["seconds_per_step"]
    except Exception as err:              # noqa: BLE001  (recorded in the results)
        if not _oom(err):
            raise
        row["oom"] = str(err).splitlines()[0][:300]
        if device == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        step = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------- report

def _fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def markdown(results: dict) -> str:
    m = results["meta"]
    lines = [f"Trainer forward + backward ({m['date']}, {m['device']}, commit {m['commit']}, {m['dtype']}, "
             f"torch {m['torch']}); MFU vs {PEAK_BF16 / 1e12:.0f} TFLOP/s.", "",
             "| part | implementation | batch x seq | tokens/s | MFU | MFU with attention | peak memory GiB | "
             "vs stock | vs transformers | FP8 vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "skipped" in r:
            tps, extra = None, f"skipped: {r['skipped']}"
        elif "oom" in r:
            tps, extra = None, "out of memory"
        else:
            tps, extra = r["tokens_per_s"], ""
        mfu = _fmt(r.get("mfu"), ".2%") if "mfu" in r else "-"
        mfu_a = _fmt(r.get("mfu_with_attention"), ".2%") if "mfu_with_attention" in r else "-"
        lines.append(f"| {r['part']} | {r['name']}{' (' + extra + ')' if extra else ''} | {r['shape']} | {_fmt(tps)} | "
                     f"{mfu} | {mfu_a} | {_fmt(r.get('peak_memory_gib'), '.1f')} | "
                     f"{_fmt(r.get('vs_stock'), '.2f')} | {_fmt(r.get('vs_transformers'), '.3f')} | "
                     f"{_fmt(r.get('vs_bf16'), '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results["rows"] if "tokens_per_s" in r]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    labels = [f"{r['part']}: {r['name']} ({r['shape']})" for r in rows]
    ax.barh(labels, [r["tokens_per_s"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(r["tokens_per_s"], i, f" {r['tokens_per_s']:,.0f}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s (forward + backward), log scale")
    ax.invert_yaxis()
    m = results["meta"]
    ax.set_title(f"zerokl trainer vs transformers, {m['device']}, {m['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(results: dict, out: pathlib.Path | None) -> None:
    _derive(results)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps(results, indent=1))
    (out / "bench_train.md").write_text(markdown(results))
    plot(results, out / "bench_train.png")


def _derive(results: dict) -> None:
    """Ratios within each part: vs the stock backend's tokens/s and vs transformers'."""
    for part in {r["part"] for r in results["rows"]}:
        rows = [r for r in results["rows"] if r["part"] == part]
        tps = {r["name"]: r.get("tokens_per_s") for r in rows}
        stock = next((v for k, v in tps.items() if k.endswith("/stock") and v), None)
        hf = tps.get("transformers")
        for r in rows:
            bf16 = tps.get(r["name"].replace("/fp8", "")) if "/fp8" in r["name"] else None
            if r.get("tokens_per_s") and bf16:
                r["vs_bf16"] = r["tokens_per_s"] / bf16      # FP8 over the same arm in bf16 (throughput)
            if r.get("tokens_per_s") and r["name"].startswith("zerokl"):
                if stock:
                    r["vs_stock"] = r["tokens_per_s"] / stock
                if hf:
                    r["vs_transformers"] = r["tokens_per_s"] / hf


# ----------------------------------------------------------------------------- parts

def _zerokl_arm(config, device, dtype, backend, ids, checkpointing, graphs=False, fp8=False):
    def build():
        with use_backend(backend):
            model = build_model(config, device, dtype)
            # forward + backward only (the issue's workload, weights and gradients): no fp32 master
            # weights, which only the optimizer step reads (4 more bytes per parameter, 49 GB on the slice).
            # FP8 (TrainConfig.dtype "fp8": the e4m3 forward, the straight-through bf16 backward) always keeps
            # them: its e4m3 values are quantized from them.
            trainer = Trainer(model, TrainConfig(activation_checkpointing=checkpointing,
                                                 master_weights=None if fp8 else False, cuda_graphs=graphs,
                                                 dtype="fp8" if fp8 else None))
            step = zerokl_step(trainer, ids)

        def run():
            with use_backend(backend):
                step()
        return run, (f"backend {backend}, activation checkpointing {'on' if checkpointing else 'off'}"
                     + (", CUDA graphs (TrainConfig.cuda_graphs)" if graphs else "")
                     + (", FP8 (e4m3 forward, fp32 masters)" if fp8 else ""))
    return build


def rl_part(config: ModelConfig, device: str, dtype: torch.dtype, args) -> dict:
    """GRPO steps in process on fresh random rollouts vs the SFT step at the same token count."""
    import random
    rng = random.Random(0)
    model = build_model(config, device, dtype)
    trainer = Trainer(model, TrainConfig(lr=1e-5))
    lo, hi = args.rl_completion
    fb, opt, tokens, packed, kl = [], [], [], [], []
    for step in range(args.rl_steps):
        seqs = []
        for _ in range(args.rl_prompts):
            prompt = tuple(rng.randrange(3, config.vocab_size) for _ in range(rng.randint(16, 64)))
            for _ in range(args.rl_group):
                seqs.append(Completion(prompt, tuple(rng.randrange(3, config.vocab_size)
                                                     for _ in range(rng.randint(lo, hi)))))
        behaviour = trainer.forward_logprobs(seqs)
        rollouts = [Rollout(s, tuple(b.tolist()), float(rng.random() < 0.5)) for s, b in zip(seqs, behaviour)]
        _sync(device)
        t0 = time.perf_counter()
        adv = torch.tensor([r.reward for r in rollouts]).view(-1, args.rl_group)
        adv = (adv - adv.mean(1, keepdim=True)).view(-1)
        metrics = trainer.forward_backward("ppo", rollouts, advantages=adv)
        _sync(device)
        t1 = time.perf_counter()
        trainer.optim_step()
        _sync(device)
        fb.append(t1 - t0)
        opt.append(time.perf_counter() - t1)
        tokens.append(metrics["tokens"])
        packed.append(sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in seqs))   # forwarded and backpropagated
        kl.append(metrics["kl"])
        print(f"  rl step {step + 1}/{args.rl_steps}: {packed[-1]} tokens ({metrics['tokens']} scored), "
              f"forward_backward {t1 - t0:.3f} s, "
              f"optim_step {opt[-1]:.3f} s, kl {metrics['kl']}", flush=True)
    later = slice(len(fb) // 2, None)          # the second half: bucket shapes seen before, graphs replayed
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    # tokens: every token forwarded and backpropagated (prompt and completion, as verl counts a step's
    # throughput); scored: the completion tokens, the ones with a loss
    row = {"steps": args.rl_steps, "tokens_per_step_median": med(packed), "scored_per_step_median": med(tokens),
           "forward_backward_s_median": med(fb[later]), "optim_step_s_median": med(opt[later]),
           "kl_max": max(abs(k) for k in kl), "graph_replays": trainer._graphs.replays if trainer._graphs is not None else 0}
    row["rl_fb_tok_s"] = med([t / f for t, f in zip(packed[later], fb[later])])
    row["rl_fb_scored_tok_s"] = med([t / f for t, f in zip(tokens[later], fb[later])])
    row["rl_step_tok_s"] = med([t / (f + o) for t, f, o in zip(packed[later], fb[later], opt[later])])
    del trainer, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    # SFT at the same token count: rows of 512 tokens (as the small part), as many as the RL step's tokens
    seq = 512 if not args.smoke else 48
    batch = max(1, round(row["tokens_per_step_median"] / (seq - 1)))
    ids = _tokens(config, batch, seq, device, seed=3)
    sft = run_case("zerokl/sft", _zerokl_arm(config, device, dtype, default_backend() if device == "cuda" else "torch",
                                             ids, False, graphs=device == "cuda"),
                   device, args.steps, 2, batch * (seq - 1), None)
    row["sft_shape"] = f"{batch} x {seq}"
    row["sft_tok_s"] = sft.get("tokens_per_s")
    if row["sft_tok_s"]:
        row["rl_fb_vs_sft"] = row["rl_fb_tok_s"] / row["sft_tok_s"]
    return row


def _with_mfu(row: dict, config: ModelConfig, seq: int) -> dict:
    if "tokens_per_s" in row:
        act = active_params(config)
        row["active_params"] = act
        row["mfu"] = 6 * act * row["tokens_per_s"] / PEAK_BF16
        row["mfu_with_attention"] = (6 * act + train_attention_flops_per_token(config, seq)) * row["tokens_per_s"] / PEAK_BF16
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="small,slice,long", help="comma list of: small, slice, long, rl")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", default=None, help="zerokl backends for the small part (default: the "
                    "device's invariant backend, then stock)")
    ap.add_argument("--preset", default="small", help="model of the small part")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers arm")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph arm (TrainConfig.cuda_graphs)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 arms (TrainConfig.dtype fp8) of small and slice")
    ap.add_argument("--slice-preset", default="glm5")
    ap.add_argument("--slice-layers", type=int, default=2)
    ap.add_argument("--slice-batch", type=int, default=4)
    ap.add_argument("--slice-seq", type=int, default=4096)
    ap.add_argument("--long-seq", type=int, default=16384)
    ap.add_argument("--rl-prompts", type=int, default=64)
    ap.add_argument("--rl-group", type=int, default=8)
    ap.add_argument("--rl-completion", type=int, nargs=2, default=(8, 40), metavar=("MIN", "MAX"))
    ap.add_argument("--rl-steps", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--profile", default=None, help="profile one step of this arm, e.g. small/zerokl/triton (a comma list: one arm per part)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes everywhere (CPU smoke test)")
    ap.add_argument("--out", default=None, help="folder for bench_train.json / .md / .png")
    ap.add_argument("--append", action="store_true", help="add this run's rows to --out's existing results")
    ap.add_argument("--plot-from", default=None, help="re-render the table and PNG from a results JSON")
    args = ap.parse_args(argv)

    if args.plot_from:
        src = pathlib.Path(args.plot_from)
        results = json.loads(src.read_text())
        write(results, pathlib.Path(args.out) if args.out else src.parent)
        print(markdown(results))
        return 0
    if args.smoke:
        args.preset, args.batch, args.seq = "tiny", 2, 48
        args.slice_preset, args.slice_batch, args.slice_seq, args.long_seq = "tiny", 1, 48, 80
        args.steps, args.warmup = 1, 0
        args.rl_prompts, args.rl_group, args.rl_completion, args.rl_steps = 2, 2, (2, 6), 2
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    invariant = default_backend() if device == "cuda" else "torch"
    backends = args.backends.split(",") if args.backends else [invariant, "stock"]
    parts = set(args.parts.split(","))
    if parts - {"small", "slice", "long", "rl"}:
        ap.error(f"--parts: unknown {sorted(parts - {'small', 'slice', 'long', 'rl'})}")
    out = pathlib.Path(args.out) if args.out else None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    results = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "device": name,
                        "commit": commit(), "dtype": dtype_name(dtype), "torch": torch.__version__,
                        "args": vars(args)}, "rows": []}
    if args.append and out is not None and (out / "bench_train.json").exists():
        results["rows"] = json.loads((out / "bench_train.json").read_text())["rows"]

    def record(part, shape, row, config=None, seq=None):
        row = {"part": part, "shape": shape} | row
        if config is not None:
            row = _with_mfu(row, config, seq)
        results["rows"].append(row)
        write(results, out)
        shown = {k: v for k, v in row.items() if k not in ("profile_top", "profile_functions", "profile_shapes")}
        print(json.dumps(shown), flush=True)

    if "small" in parts:
        config = ModelConfig.preset(args.preset)
        ids = _tokens(config, args.batch, args.seq, device)
        tokens = args.batch * (args.seq - 1)
        shape = f"{args.batch} x {args.seq}"
        for backend in backends:
            arm = f"zerokl/{backend}"
            record("small", shape, run_case(arm, _zerokl_arm(config, device, dtype, backend, ids, False), device,
                                            args.steps, args.warmup, tokens, _arm(args.profile, "small")), config, args.seq)
            if device == "cuda" and backend == invariant and not args.no_graphs:
                # warm-up: the first step of a shape runs eagerly, the second captures
                record("small", shape, run_case(arm + "+graphs", _zerokl_arm(config, device, dtype, backend, ids, False,
                                                                             graphs=True), device, args.steps,
                                                max(args.warmup, 2), tokens, _arm(args.profile, "small")),
                       config, args.seq)
            if backend == invariant and not args.no_fp8:
                graphs = device == "cuda" and not args.no_graphs
                record("small", shape, run_case(arm + "/fp8" + ("+graphs" if graphs else ""),
                                                _zerokl_arm(config, device, dtype, backend, ids, False, graphs=graphs,
                                                            fp8=True), device, args.steps,
                                                max(args.warmup, 2 if graphs else 0), tokens,
                                                _arm(args.profile, "small")), config, args.seq)
        if not args.no_transformers:
            def build_hf():
                model, note = hf_model(config, device, dtype)
                return (None, note) if model is None else (hf_step(model, ids), note)
            record("small", shape, run_case("transformers", build_hf, device, args.steps, args.warmup, tokens,
                                            _arm(args.profile, "small")), config, args.seq)

    slice_config = ModelConfig.preset(args.slice_preset).replace(num_hidden_layers=args.slice_layers,
                                                                  first_k_dense_replace=1)
    results["meta"]["slice"] = {"total_params": total_params(slice_config),
                                "active_params": active_params(slice_config)}
    if "slice" in parts:
        # The largest batch that fits: --slice-batch, halved after each out-of-memory (each one recorded).
        batch = args.slice_batch
        while batch >= 1:
            ids = _tokens(slice_config, batch, args.slice_seq, device, seed=1)
            row = run_case(f"zerokl/{invariant}", _zerokl_arm(slice_config, device, dtype, invariant, ids, False),
                           device, args.steps, args.warmup, batch * (args.slice_seq - 1), _arm(args.profile, "slice"))
            record("slice", f"{batch} x {args.slice_seq}", row, slice_config, args.slice_seq)
            if "oom" not in row:
                break
            batch //= 2
        if batch >= 1 and not args.no_fp8:
            # The same batch in FP8 (its fp32 masters add 4 bytes a parameter: an out-of-memory is its result)
            row = run_case(f"zerokl/{invariant}/fp8", _zerokl_arm(slice_config, device, dtype, invariant, ids, False,
                                                                  fp8=True),
                           device, args.steps, args.warmup, batch * (args.slice_seq - 1), _arm(args.profile, "slice"))
            record("slice", f"{batch} x {args.slice_seq}", row, slice_config, args.slice_seq)
    if "long" in parts:
        # Both memory trade-offs: activation checkpointing on (the forward runs twice, least memory),
        # then off (TrainConfig's default) when it fits; each arm's peak memory is printed.
        ids = _tokens(slice_config, 1, args.long_seq, device, seed=2)
        for name, checkpointing in ((f"zerokl/{invariant}", True), (f"zerokl/{invariant}+no-checkpointing", False)):
            record("long", f"1 x {args.long_seq}",
                   run_case(name, _zerokl_arm(slice_config, device, dtype, invariant, ids, checkpointing), device,
                            args.steps, args.warmup, args.long_seq - 1, _arm(args.profile, "long")),
                   slice_config, args.long_seq)
    if "rl" in parts:
        row = rl_part(ModelConfig.preset(args.preset), device, dtype, args)
        results["rl"] = row
        write(results, out)
        print(json.dumps(row), flush=True)
    print(markdown(results))
    return 0


def _arm(profile: str | None, part: str) -> str | None:
    """The arm name run_case compares against: --profile small/zerokl/triton -> zerokl/triton for part small
    (a comma list profiles one arm per part, e.g. slice/zerokl/triton,long/zerokl/triton)."""
    for one in (profile or "").split(","):
        if one.startswith(part + "/"):
            return one[len(part) + 1:]
    return None


if __name__ == "__main__":
    sys.exit(main())
