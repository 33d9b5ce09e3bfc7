"""`zerokl demo`: a tiny GLM-5-family model learns countdown with GRPO, KL exactly 0 at every step.

Phases (each with a progress bar):
1. SFT warm start on solver demonstrations (or --init-from a checkpoint directory).
2. On-policy GRPO: generate n samples per prompt on weights version v, reward them,
   update, publish v+1, sample from v+1. Every step prints reward, the exact
   train/inference KL, mismatched tokens, clip fraction and tokens/s; greedy test
   accuracy every few steps.
3. A report in --out: report.md, metrics.jsonl (one object per RL step) and PNG plots.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch
from tqdm import tqdm

__all__ = ["add_arguments", "countdown_config", "countdown_data", "demonstration_batch", "greedy_accuracy",
           "main", "run", "write_report"]

MAX_TOKENS = 24  # sampled tokens per completion: "<answer>" + a 3-number expression + "</answer>" fits


def countdown_config(tok):  # noqa: ANN001, ANN201 - a CountdownTokenizer -> ModelConfig
    """The `tiny` model with the countdown vocabulary."""
    from zerokl.model import ModelConfig
    return ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                              eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)


def countdown_data(seed: int = 0, n_train: int = 20000, n_test: int = 200):  # noqa: ANN201
    """(train problems, test problems, tokenizer) of the demo's countdown distribution."""
    from zerokl.model.tokenizer import CountdownTokenizer
    from zerokl.tasks.countdown import DEMO_PROBLEMS, generate_problems
    train = generate_problems(n_train, seed=seed, **DEMO_PROBLEMS)
    test = generate_problems(n_test, seed=seed + 1, split="test", **DEMO_PROBLEMS)
    return train, test, CountdownTokenizer()


def encode_prompt(problem, tok) -> tuple[int, ...]:  # noqa: ANN001
    from zerokl.tasks.countdown import format_prompt
    return tuple([tok.bos_id] + tok.encode(format_prompt(problem)))


def demonstration_batch(problems, tok) -> list:  # noqa: ANN001
    """SFT completions: the solver's answer, then eos."""
    from zerokl.services.trainer.trainer import Completion
    from zerokl.tasks.countdown import format_demonstration
    return [Completion(encode_prompt(p, tok), tuple(tok.encode(format_demonstration(p)) + [tok.eos_id]))
            for p in problems]


def greedy_accuracy(model, problems, tok) -> float:  # noqa: ANN001
    """Share of `problems` whose greedy completion earns reward 1.0 (offline engine)."""
    from zerokl.services.engine.engine import Engine, run_to_completion
    from zerokl.services.engine.types import EngineConfig, GenerateRequest, SamplingOptions
    from zerokl.tasks.countdown import reward
    opts = SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS)
    reqs = [GenerateRequest(str(i), encode_prompt(p, tok), opts) for i, p in enumerate(problems)]
    outs = run_to_completion(Engine(model.eval(), EngineConfig(max_num_batched_tokens=1024, num_blocks=1024),
                                    tokenizer=tok), reqs)
    texts = ["".join(o.text for o in outs[r.request_id]) for r in reqs]
    return sum(reward(t, p) == 1.0 for t, p in zip(texts, problems)) / max(1, len(problems))


def _plot(records: list[dict], out: pathlib.Path, title: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in records]
    panels = [("reward", "mean reward"), ("kl", "train/inference KL (exact)"),
              ("clip_fraction", "PPO clip fraction"), ("test_accuracy", "greedy test accuracy")]
    names = []
    for key, label in panels:
        pts = [(s, r[key]) for s, r in zip(steps, records) if r.get(key) is not None]
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=8)
        if key in ("kl", "clip_fraction") and all(p[1] == 0 for p in pts):
            ax.set_ylim(-1e-3, 1e-2)
            ax.text(0.5, 0.5, "exactly 0 at every step", transform=ax.transAxes, ha="center")
        fig.tight_layout()
        name = f"{key}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def write_report(records: list[dict], out: pathlib.Path, header: dict) -> None:
    """metrics.jsonl, PNG plots and report.md for a run."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    plots = _plot(records, out, header.get("title", "zerokl countdown GRPO"))
    kls = [r["kl"] for r in records]
    lines = [f"# {header.get('title', 'zerokl countdown GRPO')}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items() if k != "title"]
    lines += ["", f"KL exactly 0 at every step: **{'yes' if all(k == 0.0 for k in kls) else 'NO'}** "
              f"(max |KL| {max(abs(k) for k in kls):.3g}, mismatched tokens {sum(r['mismatched_tokens'] for r in records)})", "",
              "| step | version | reward | KL | mismatched | clip frac | tokens/s | test acc |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        acc = "" if r.get("test_accuracy") is None else f"{r['test_accuracy']:.2f}"
        lines.append(f"| {r['step']} | {r['weights_version']} | {r['reward']:.3f} | {r['kl']!r} | {r['mismatched_tokens']} | "
                     f"{r['clip_fraction']:.3f} | {r['tokens_per_s']:.0f} | {acc} |")
    lines += [""] + [f"![{p}]({p})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The demo's flags (shared by `zerokl demo` and `python -m zerokl.demo`)."""
    ap.add_argument("--out", default="runs/demo", help="report folder")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per GRPO step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--backend", default=None, help="inference kernels: default = the trainer's; 'stock' = mismatched arm")
    ap.add_argument("--threads", type=int, default=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zerokl demo", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed flags."""
    torch.set_num_threads(args.threads)

    from zerokl.kernels import __version__, fingerprint
    from zerokl.model import Model, ModelConfig
    from zerokl.model.tokenizer import CountdownTokenizer
    from zerokl.services.scheduler.rl_loop import LocalEnginePort, LocalTrainerPort, RLConfig, Task, as_dict, run_rl
    from zerokl.services.trainer.trainer import Completion, TrainConfig, Trainer
    from zerokl.tasks.countdown import format_demonstration, format_prompt, generate_problems, reward

    tok = CountdownTokenizer()
    t0 = time.perf_counter()
    print("generating countdown problems ...", flush=True)
    train = generate_problems(600, seed=args.seed)
    test = generate_problems(64, seed=args.seed + 1, split="test")
    encode = lambda p: tuple([tok.bos_id] + tok.encode(format_prompt(p)))  # noqa: E731
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    trainer = Trainer(Model(cfg, seed=args.seed), TrainConfig(lr=3e-3, warmup_steps=10, total_steps=args.sft_steps))
    rng = random.Random(args.seed)
    for _ in (bar := tqdm(range(args.sft_steps), desc="SFT warm start", unit="step")):
        batch = [Completion(encode(p), tuple(tok.encode(format_demonstration(p)) + [tok.eos_id]))
                 for p in rng.sample(train, args.sft_batch)]
        bar.set_postfix(loss=f"{trainer.sft_step(batch)['loss']:.3f}")
    # RL: a fresh optimizer state for the policy-gradient phase (LoRA on top when asked).
    rl_trainer = Trainer(trainer.serving_model().train(), TrainConfig(lr=1e-3, lora_rank=args.lora_rank, seed=args.seed))
    trainer_port = LocalTrainerPort(rl_trainer, run="countdown")
    engine_port = LocalEnginePort(trainer_port, tok, backend=args.backend)
    task = Task(train, test, encode, reward)
    config = RLConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group, max_tokens=24,
                      seed=args.seed, eval_every=5, eval_prompts=32)
    bar = tqdm(total=args.steps, desc="GRPO", unit="step")

    def on_step(r):
        acc = "" if r.test_accuracy is None else f" test_acc {r.test_accuracy:.2f}"
        tqdm.write(f"step {r.step:3d} {r.weights_version} reward {r.reward:.3f} kl {r.kl!r} mismatched "
                   f"{r.mismatched_tokens} clip {r.clip_fraction:.3f} tok/s {r.tokens_per_s:.0f}{acc}")
        bar.update(1)

    records = [as_dict(r) for r in run_rl(task, engine_port, trainer_port, config, on_step)]
    bar.close()
    out = pathlib.Path(args.out)
    write_report(records, out, {
        "title": "zerokl countdown GRPO (tiny model, CPU)",
        "numerics": f"{__version__} fingerprint {fingerprint()}",
        "inference kernels": args.backend or "same as trainer",
        "SFT steps": args.sft_steps, "GRPO steps": args.steps,
        "samples per step": args.prompts * args.group, "wall time (s)": f"{time.perf_counter() - t0:.0f}",
    })
    print(f"report: {out / 'report.md'}")
    return 0
