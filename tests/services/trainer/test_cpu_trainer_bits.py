"""The CPU trainer's bits (gradients, weights, AdamW moments) do not depend on the machine.

A trainer resumed on another machine or with another thread count must continue bit for bit. Three
things decided it: the backward's GEMMs ran outside the torch backend's one-thread guard (MKL splits
their K sums by thread count), they were MKL's sgemm (its order and FMA use follow MKL's code path),
and the optimizer took torch's AdamW (``torch.sqrt``: MKL's vector math; ``lerp``/``addcmul``/``addcdiv``
vectorized per ATen's code path) and ``torch.sqrt`` for the clip norm. Now the step runs under the
guard, the backward's contractions are exact (``portable.contract``), and the norm and AdamW are
IEEE basic operations with ``portable.sqrt32`` (services/zerokl/services/trainer/optim.py).
Measured before (this Intel AVX-512 CPU): 1 vs 2 threads changed 48 of 63 gradients at the first SFT
step; MKL's SSE4.2 path changed all 63 at the first step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from zerokl.kernels.portable_check import CODE_PATHS, code_path_env
from zerokl.services.trainer.optim import PortableAdamW, grad_norm

# A few steps of the tiny model, the same ones at 1 and at 2 intra-op threads (asserted equal here),
# then one digest of every parameter, gradient-derived AdamW moment and reported metric. SFT steps
# with the clip engaged and weight decay, then a GRPO step (PPO-clip) on rollouts scored by the
# trainer itself (their logprobs are its own: KL 0), then a LoRA SFT step on a bf16 model with fp32
# masters (adapters, masters, the bf16 backward).
_STEPS = """
import hashlib, json, random, torch
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion, Rollout

def run():
    rng = random.Random(0)
    seqs = [Completion(tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 24))),
                       tuple(rng.randrange(3, 64) for _ in range(8))) for _ in range(6)]
    tiny = ModelConfig.preset("tiny")
    full = Trainer(Model(tiny, seed=5), TrainConfig(lr=3e-3, grad_clip=0.5, weight_decay=0.1))
    metrics = [full.sft_step(seqs) for _ in range(2)]
    lps = full.forward_logprobs(seqs)
    rollouts = [Rollout(s, tuple(lp.tolist()), float(i % 3), "") for i, (s, lp) in enumerate(zip(seqs, lps))]
    metrics.append(full.grpo_step(rollouts, group_size=3))
    lora = Trainer(Model(tiny, seed=6).to(torch.bfloat16), TrainConfig(lr=1e-2, lora_rank=4, master_weights=True))
    metrics.append(lora.sft_step(seqs))
    tensors = [*full.model.state_dict().values(), *lora.model.state_dict().values(), *lora.masters]
    tensors += [v for t in (full, lora) for s in t.optimizer.state.values() for v in s.values()]
    return tensors, [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics]

torch.set_num_threads(1)
one = run()
torch.set_num_threads(2)
two = run()
same = all(torch.equal(a, b) for a, b in zip(one[0], two[0], strict=True)) and one[1] == two[1]
digest = hashlib.sha256()
for t in one[0]:
    digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
print(json.dumps({"threads_agree": same, "digest": digest.hexdigest(), "metrics": one[1]}))
"""


def test_sft_grpo_and_lora_steps_have_the_same_bits_at_any_thread_count_and_on_every_cpu_code_path():
    runs = {}
    for name in CODE_PATHS:
        r = subprocess.run([sys.executable, "-c", _STEPS], env=code_path_env(name, os.environ), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert {name: run["threads_agree"] for name, run in runs.items()} == dict.fromkeys(CODE_PATHS, True)
    native = runs.pop("native")
    assert native["metrics"][0]["grad_norm"] > 0.5          # the clip was engaged
    for name, run in runs.items():
        assert run["digest"] == native["digest"] and run["metrics"] == native["metrics"], name


def test_portable_adamw_is_adamw():
    """Against torch's AdamW evaluated in float64 (the reference: same formula, one rounding less per
    step), and state dicts load either way (a trainer state written before this optimizer resumes)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(300, generator=g) * 0.1, torch.randn(40, 7, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) * s for p in params] for s in (1.0, 0.01, 3.0, 1e-4)]
    ours = [p.clone() for p in params]
    reference = [p.double() for p in params]
    opt = PortableAdamW(ours, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for step in grads:
        for p, q, gr in zip(ours, reference, step):
            p.grad, q.grad = gr.clone(), gr.double()
        opt.step()
        ref.step()
    for p, q in zip(ours, reference):
        torch.testing.assert_close(p.double(), q, rtol=0, atol=1e-6)
    moved = torch.optim.AdamW([p.clone() for p in params], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    moved.load_state_dict(opt.state_dict())
    back = PortableAdamW([p.clone() for p in params], lr=1.0)
    back.load_state_dict(moved.state_dict())
    assert back.param_groups[0]["lr"] == 1e-2 and int(back.state[back.param_groups[0]["params"][0]]["step"]) == 4
    assert torch.equal(back.state[back.param_groups[0]["params"][1]]["exp_avg_sq"],
                       opt.state[ours[1]]["exp_avg_sq"])


def test_grad_norm_is_the_correctly_rounded_norm_of_the_fp32_squares():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4096, generator=g) * 1e-3, torch.randn(33, 65, generator=g), torch.zeros(7)]
    exact = sum(float((t.double() ** 2).sum()) for t in grads) ** 0.5
    assert abs(grad_norm(grads) - exact) <= 4 * torch.finfo(torch.float32).eps * exact
    assert grad_norm([]) == 0.0 and grad_norm([torch.zeros(3)]) == 0.0
