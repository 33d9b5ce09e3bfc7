"""An RL loop and an SFT loop written against the official `tinker` SDK only, checked for exact logprobs.

    # against a running endpoint (zerokl up --tinker; TINKER_API_KEY=tml-<client token> with auth on)
    python tools/tinker_sdk_check.py --base-url http://127.0.0.1:8000 --base-model zerokl/tiny

    # or start the cluster too: `zerokl up --tinker --preset PRESET --dtype DTYPE` in a fresh workdir
    python tools/tinker_sdk_check.py --up --preset small --dtype bfloat16 --steps 5

The loops (``rl_loop``, ``sft_loop``) use nothing but the SDK's public, documented API --
ServiceClient(base_url), create_lora_training_client (rank 0: full weights on zerokl),
forward_backward with importance_sampling and cross_entropy, forward_backward_custom,
optim_step(AdamParams), save_weights_and_get_sampling_client, sample with logprobs,
compute_logprobs, futures submitted before they are awaited -- so they run unchanged against Tinker
itself. At every RL step they check what only aligned numerics give: the trainer's logprob of every
sampled token equals the sampler's (``==`` on float32), so the importance ratio is exactly 1 and the
KL 0.0; and compute_logprobs of prompt + completion reproduces the sampled logprobs. Exit status 0
when every check held; a JSON summary (per step: reward, KL, mismatched tokens, ratio range, loss)
goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import tinker
from tinker import types


def reward(tokens: list[int]) -> float:
    """A tokenizer-free reward the model can learn: the fraction of even token ids (the check is about
    exact numbers, not about what is learned)."""
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def rl_loop(service: tinker.ServiceClient, base_model: str, *, steps: int, group: int, max_tokens: int,
            rank: int, lr: float) -> dict:
    """GRPO-style: sample a group per prompt, center the rewards, importance_sampling, optim_step, sample
    the new version. Checks exact equality of sampled, computed and trained logprobs at every step."""
    training = service.create_lora_training_client(base_model=base_model, rank=rank, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in ("nums 3 4 target 7", "nums 2 5 target 10")]
    sampler = training.save_weights_and_get_sampling_client().result()
    history, failures = [], []
    for step in range(steps):
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=group,
                                  sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                       seed=1000 * step + i))
                   for i, p in enumerate(prompts)]
        data, sampled, rewards = [], [], []
        for prompt, future in zip(prompts, futures):
            result = future.result()
            group_rewards = [reward(s.tokens) for s in result.sequences]
            mean = sum(group_rewards) / len(group_rewards)
            rewards += group_rewards
            ob = len(prompt) - 1
            for seq, r in zip(result.sequences, group_rewards):
                # compute_logprobs of prompt + completion: the same numbers as the sample's own logprobs
                computed = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
                if computed[len(prompt):] != seq.logprobs:
                    failures.append(f"step {step}: compute_logprobs differs from the sampled logprobs")
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                    loss_fn_inputs={"target_tokens": [0] * ob + seq.tokens,
                                    "logprobs": [0.0] * ob + seq.logprobs,
                                    "advantages": [0.0] * ob + [r - mean] * len(seq.tokens)}))
                sampled.append((ob, seq.logprobs))
        # Futures: submit both, then wait (the server runs them in submission order).
        fwd_bwd = training.forward_backward(data, "importance_sampling")
        optim = training.optim_step(types.AdamParams(learning_rate=lr))
        out = fwd_bwd.result()
        optim.result()
        trained = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
        equal = all(t[ob:] == lp for t, (ob, lp) in zip(trained, sampled))
        ratios = [out.metrics["zerokl/ratio_min:min"], out.metrics["zerokl/ratio_max:max"]]
        if not equal or ratios != [1.0, 1.0] or out.metrics["zerokl/kl:sum"] != 0.0:
            failures.append(f"step {step}: trainer logprobs differ from the sampler's (ratio {ratios})")
        history.append({"step": step, "reward": sum(rewards) / len(rewards), "kl": out.metrics["zerokl/kl:sum"],
                        "mismatched_tokens": out.metrics["zerokl/mismatched_tokens:sum"], "ratio": ratios,
                        "loss": out.metrics["loss:sum"], "trained_equals_sampled": equal})
        sampler = training.save_weights_and_get_sampling_client().result()   # the next step samples the new weights
    return {"steps": history, "failures": failures}


def sft_loop(service: tinker.ServiceClient, base_model: str, *, steps: int, rank: int, lr: float) -> dict:
    """cross_entropy on fixed demonstrations (prompt weight 0, completion 1), then the same loss as a
    custom loss through forward_backward_custom; checks that the loss falls and both agree."""
    training = service.create_lora_training_client(base_model=base_model, rank=rank, seed=1).result()
    tokenizer = training.get_tokenizer()
    data = []
    for prompt, completion in (("nums 3 4 target 7", "<answer>3+4</answer>"),
                               ("nums 2 5 target 10", "<answer>2*5</answer>")):
        p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
        tokens = p + c
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:],
                                                "weights": [0.0] * (len(p) - 1) + [1.0] * len(c)}))
    losses, failures = [], []
    for _ in range(steps):
        fwd_bwd = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fwd_bwd.result().metrics["loss:sum"])
        optim.result()

    def weighted_nll(batch, logprobs):           # the SDK differentiates it and sends the gradient back
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom_nll:sum": float(loss.detach())}

    forward = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    custom = training.forward_backward_custom(data, weighted_nll).result()
    training.optim_step(types.AdamParams(learning_rate=lr)).result()
    if not losses[-1] < losses[0]:
        failures.append(f"SFT loss did not fall: {losses}")
    # The gradient the SDK sends back for this loss is exactly the weights: the server's surrogate
    # cross_entropy over it is the forward's loss, bit for bit (the custom loss itself sums in Python).
    if custom.metrics["surrogate_loss:sum"] != forward:
        failures.append(f"the custom loss's surrogate {custom.metrics['surrogate_loss:sum']} differs from "
                        f"cross_entropy's {forward}")
    return {"losses": losses, "custom_loss": custom.metrics["loss:sum"], "forward_loss": forward,
            "failures": failures}


def _start_up(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`zerokl up --tinker` in a fresh workdir; (process, base url) once it serves."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="zerokl-tinker-check-"))
    cmd = [sys.executable, "-m", "zerokl", "up", "--tinker", "--tinker-port", "0", "--port", "0", "--workdir",
           str(workdir), "--preset", args.preset, *(["--dtype", args.dtype] if args.dtype else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", file=sys.stderr)
        if m := re.search(r"TINKER_BASE_URL=(\S+)", line):
            # Its later lines keep going to stderr (a full pipe would stall it).
            threading.Thread(target=lambda: [print(x, end="", file=sys.stderr) for x in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"zerokl up exited ({proc.wait()}) before serving the Tinker endpoint")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"), help="the endpoint (default $TINKER_BASE_URL)")
    p.add_argument("--base-model", default=None, help="Tinker's base_model (default zerokl/<preset>)")
    p.add_argument("--up", action="store_true", help="start `zerokl up --tinker --preset P --dtype D` first")
    p.add_argument("--preset", default="tiny", help="with --up: the preset (default %(default)s)")
    p.add_argument("--dtype", default=None, help="with --up: the fleet's dtype, e.g. bfloat16 (default: zerokl up's)")
    p.add_argument("--steps", type=int, default=3, help="steps of each loop (default %(default)s)")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per sample (default %(default)s)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of the RL run; 0 trains full weights (default %(default)s)")
    p.add_argument("--sft-rank", type=int, default=0, help="LoRA rank of the SFT run (default %(default)s: full weights)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamParams learning rate (default %(default)s)")
    args = p.parse_args()
    proc = None
    if args.up:
        proc, args.base_url = _start_up(args)
    if not args.base_url:
        p.error("give --base-url (or $TINKER_BASE_URL), or --up")
    base_model = args.base_model or f"zerokl/{args.preset}"
    try:
        start = time.monotonic()
        service = tinker.ServiceClient(base_url=args.base_url, api_key=os.environ.get("TINKER_API_KEY", "tml-local"))
        summary = {"base_url": args.base_url, "base_model": base_model,
                   "rl": rl_loop(service, base_model, steps=args.steps, group=args.group, max_tokens=args.max_tokens,
                                 rank=args.rank, lr=args.lr),
                   "sft": sft_loop(service, base_model, steps=args.steps, rank=args.sft_rank, lr=args.lr)}
        summary["seconds"] = round(time.monotonic() - start, 1)
        service.close("success").result()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    print(json.dumps(summary, indent=1))
    failures = summary["rl"]["failures"] + summary["sft"]["failures"]
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
