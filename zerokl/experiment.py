"""`zerokl experiment countdown`: the same GRPO run with aligned and with mismatched numerics.

Two arms, same starting weights, seeds, prompts and hyperparameters:

* **zerokl**: inference samples with the trainer's own kernels (the invariant
  backend), so the behaviour logprobs the trainer receives are bitwise its own.
* **mismatch**: inference samples with the ``stock`` backend (plain torch ops,
  the fast non-invariant path a typical serving stack runs) while the trainer
  keeps the invariant forward, as in an RL stack with separate engines.

The report puts KL, mismatched tokens, clip fraction, reward and test accuracy
side by side per step, and plots them overlaid. It records what happens; it does
not assume the mismatch arm learns worse.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch
from tqdm import tqdm

__all__ = ["ARMS", "add_arguments", "main", "run", "run_arm"]

#: arm name -> inference backend (None: the trainer's own)
ARMS = {"zerokl": None, "mismatch": "stock"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("task", choices=["countdown"], help="the experiment to run")
    ap.add_argument("--out", default="runs/experiment", help="report folder")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-problems", type=int, default=20000)
    ap.add_argument("--from-scratch", action="store_true",
                    help="start from the seeded tiny model instead of the shipped SFT checkpoint")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="zerokl experiment", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run_arm(arm: str, args: argparse.Namespace, on_step=None) -> list[dict]:  # noqa: ANN001
    """One arm in process; one dict per RL step (the demo's metrics.jsonl fields)."""
    from zerokl.demo import SFT_CHECKPOINT
    from zerokl.model import Model
    from zerokl.services.rl.loop import RLConfig, Task, as_dict, run_rl
    from zerokl.services.rl.ports import LocalEnginePort, LocalTrainerPort
    from zerokl.services.trainer.trainer import TrainConfig, Trainer
    from zerokl.tasks.countdown import reward
    from zerokl.tasks.setup import MAX_TOKENS, countdown_config, countdown_data, encode_prompt

    train, test, tok = countdown_data(args.seed, args.train_problems)
    if args.from_scratch or not (SFT_CHECKPOINT / "model.safetensors").exists():
        model = Model(countdown_config(tok), seed=args.seed)
    else:
        model = Model.from_pretrained(SFT_CHECKPOINT)
    trainer = Trainer(model.train(), TrainConfig(lr=args.lr, seed=args.seed))
    trainer_port = LocalTrainerPort(trainer, run=f"countdown-{arm}")
    engine_port = LocalEnginePort(trainer_port, tok, backend=ARMS[arm])
    task = Task(train, test, lambda p: encode_prompt(p, tok), reward)
    config = RLConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group, max_tokens=MAX_TOKENS,
                      seed=args.seed, eval_every=args.eval_every, eval_prompts=args.eval_prompts)
    return [as_dict(r) for r in run_rl(task, engine_port, trainer_port, config, on_step)]


def _first_part(args: argparse.Namespace) -> str:
    """Where the mismatch arm's inference first computes other bits than the trainer, on the start weights."""
    from zerokl.demo import SFT_CHECKPOINT
    from zerokl.diff import describe, diff_backends
    from zerokl.kernels import get_backend
    from zerokl.model import Model
    from zerokl.tasks.setup import countdown_config, countdown_data, encode_prompt
    _, test, tok = countdown_data(args.seed, args.train_problems)
    if args.from_scratch or not (SFT_CHECKPOINT / "model.safetensors").exists():
        model = Model(countdown_config(tok), seed=args.seed)
    else:
        model = Model.from_pretrained(SFT_CHECKPOINT)
    return describe(diff_backends(model, encode_prompt(test[0], tok), get_backend(), ARMS["mismatch"]))


def _plot(arms: dict[str, list[dict]], out: pathlib.Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("reward", "mean reward"), ("kl", "train/inference KL (exact)"),
              ("clip_fraction", "PPO clip fraction"), ("test_accuracy", "greedy test accuracy")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for arm, records in arms.items():
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=arm)
        ax.set_xlabel("RL step")
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("countdown GRPO: zerokl numerics vs mismatched inference (stock backend)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "experiment.png", dpi=110)
    plt.close(fig)
    return ["experiment.png"]


def write_report(arms: dict[str, list[dict]], out: pathlib.Path, header: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for arm, records in arms.items():
        with open(out / f"metrics-{arm}.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    plots = _plot(arms, out)
    a, b = arms["zerokl"], arms["mismatch"]
    lines = ["# zerokl experiment countdown", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]

    def summary(name: str, rs: list[dict]) -> str:
        accs = [r["test_accuracy"] for r in rs if r.get("test_accuracy") is not None]
        return (f"| {name} | {max(abs(r['kl']) for r in rs):.3g} | {sum(r['mismatched_tokens'] for r in rs)} / "
                f"{sum(r['tokens'] for r in rs)} | {sum(r['clip_fraction'] for r in rs) / len(rs):.4f} | "
                f"{sum(r['reward'] for r in rs[:5]) / len(rs[:5]):.3f} -> {sum(r['reward'] for r in rs[-5:]) / len(rs[-5:]):.3f} | "
                f"{accs[-1] if accs else float('nan'):.3f} |")
    lines += ["| arm | max abs KL | mismatched / total tokens | mean clip fraction | reward (first 5 -> last 5 steps) "
              "| final test accuracy |", "|---|---|---|---|---|---|", summary("zerokl", a), summary("mismatch", b), "",
              "| step | KL zerokl | KL mismatch | mismatched (mismatch) | clip zerokl | clip mismatch | reward zerokl "
              "| reward mismatch |", "|---|---|---|---|---|---|---|---|"]
    for x, y in zip(a, b, strict=True):
        lines.append(f"| {x['step']} | {x['kl']!r} | {y['kl']:.3g} | {y['mismatched_tokens']} | "
                     f"{x['clip_fraction']:.4f} | {y['clip_fraction']:.4f} | {x['reward']:.3f} | {y['reward']:.3f} |")
    lines += [""] + [f"![{p}]({p})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    from zerokl.kernels import __version__, fingerprint
    t0 = time.perf_counter()
    arms: dict[str, list[dict]] = {}
    for arm in ARMS:
        bar = tqdm(total=args.steps, desc=f"arm {arm}", unit="step")

        def on_step(r, arm=arm, bar=bar) -> None:  # noqa: ANN001
            acc = "" if r.test_accuracy is None else f" test_acc {r.test_accuracy:.2f}"
            tqdm.write(f"[{arm}] step {r.step:3d} reward {r.reward:.3f} kl {r.kl!r} mismatched {r.mismatched_tokens} "
                       f"clip {r.clip_fraction:.4f}{acc}")
            bar.update(1)
        arms[arm] = run_arm(arm, args, on_step)
        bar.close()
    out = pathlib.Path(args.out)
    write_report(arms, out, {"numerics": f"{__version__} fingerprint {fingerprint()}",
                             "start": "seeded tiny model" if args.from_scratch else "shipped SFT checkpoint",
                             "steps": args.steps, "samples per step": args.prompts * args.group, "lr": args.lr,
                             "seed": args.seed, "wall time (s)": f"{time.perf_counter() - t0:.0f}",
                             "where the stock path first parts (zerokl diff, first test prompt)": _first_part(args)})
    print(f"report: {out / 'report.md'}")
    return 0
