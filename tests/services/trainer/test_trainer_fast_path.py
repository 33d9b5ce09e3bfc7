"""The trainer's fast path: fused chunked logprobs and per-block activation checkpointing.

* Logprobs are torch.equal to the unfused path (full-sequence logits, then
  sampling_logprobs) for greedy, temperature, top-k and top-p rows in one batch, for any
  chunking of the fused head.
* Gradients: equal to the unfused path's to tolerance (the head's parameter gradient is
  summed chunk by chunk); with and without activation checkpointing, loss and every
  gradient are bitwise equal; two runs are bitwise equal.
* LoRA trains through the same path (checkpointing on, fused head).

Devices: "cpu" always, "cuda" (gpu tier: bf16, the machine's default backend) where there is one.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from zerokl.kernels import use_backend
from zerokl.kernels.backend import default_backend
from zerokl.kernels.sampling import sampling_logprobs
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.losses import sft_loss
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion, Rollout

TINY = ModelConfig.preset("tiny")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _backend(device: str) -> str:
    return default_backend() if device == "cuda" else "torch"


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _sequences(k: int = 6, seed: int = 0) -> list[Completion]:
    """Mixed sampling modes in one batch, prompts long enough (> index_topk) for sparse attention."""
    rng = random.Random(seed)
    modes = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (1.2, 9, 0.6)]
    out = []
    for i in range(k):
        prompt = tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 40)))
        completion = tuple(rng.randrange(3, 64) for _ in range(rng.randint(2, 8)))
        out.append(Completion(prompt, completion, *modes[i % len(modes)]))
    return out


def _unfused_logprobs(trainer: Trainer, seqs):
    """(logprobs [Ntok], batch) by the trainer's previous path: logits of every position, the rows, sampling_logprobs."""
    batch = trainer.batch_of(seqs)
    logits = trainer.model.forward_tokens(batch.input_ids, batch.layout())
    logits = logits.reshape(-1, logits.shape[-1])[batch.rows]
    return sampling_logprobs(logits, batch.targets[batch.mask > 0], batch.params), batch


def _trainer(device: str, **config) -> Trainer:
    return Trainer(Model(TINY, seed=3, dtype=_dtype(device)).to(device), TrainConfig(**config))


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_bitwise_the_unfused_path_in_every_mode_and_chunking(device):
    seqs = _sequences()
    with use_backend(_backend(device)), torch.no_grad():
        ref, batch = _unfused_logprobs(_trainer(device), seqs)
        for chunk, ckpt in [(0, False), (1, False), (7, True)]:
            trainer = _trainer(device, logprob_chunk_rows=chunk, activation_checkpointing=ckpt)
            got = trainer.token_logprobs(trainer.model, batch)[batch.mask > 0]
            assert torch.equal(got, ref), (chunk, ckpt)
            per_seq = trainer.forward_logprobs(seqs)
            assert torch.equal(torch.cat(per_seq), ref.cpu())


def _sft_grads(trainer: Trainer, seqs) -> tuple[float, dict[str, torch.Tensor]]:
    metrics = trainer.forward_backward("sft", seqs)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return metrics["loss"], grads


def test_gradients_match_the_unfused_path_to_tolerance():
    seqs = _sequences(seed=1)
    with use_backend("torch"):
        trainer = _trainer("cpu")
        lp, batch = _unfused_logprobs(trainer, seqs)
        mask = batch.mask > 0
        full = torch.zeros(batch.mask.shape).masked_scatter(mask, lp)
        sft_loss(full, batch.mask).backward()
        ref = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        trainer.optimizer.zero_grad(set_to_none=True)
        for chunk in (0, 3):
            fused = _trainer("cpu", logprob_chunk_rows=chunk)
            _, got = _sft_grads(fused, seqs)
            assert got.keys() == ref.keys() and len(got) > 20
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lora", [0, 4])
def test_checkpointing_gives_bitwise_the_same_loss_and_gradients_run_to_run(device, lora):
    seqs = _sequences(seed=2)
    with use_backend(_backend(device)):
        runs = [_sft_grads(_trainer(device, lora_rank=lora, activation_checkpointing=ckpt, logprob_chunk_rows=5),
                           seqs) for ckpt in (False, True, True, False)]
    loss, grads = runs[0]
    assert len(grads) > (10 if lora else 20)
    if lora:
        assert all("lora_" in name for name in grads)
    for other_loss, other in runs[1:]:
        assert other_loss == loss and other.keys() == grads.keys()
        for name in grads:
            assert torch.equal(other[name], grads[name]), name


@pytest.mark.parametrize("lora", [0, 4])
def test_ppo_and_dpo_steps_run_on_the_fast_path_with_checkpointing(lora):
    """Every objective through the fused head and checkpointed blocks gives the same update as without."""
    seqs = [dataclasses.replace(s, top_k=0, top_p=1.0, temperature=1.0) for s in _sequences(4, seed=5)]
    with use_backend("torch"):
        probe = _trainer("cpu")
        behaviour = probe.forward_logprobs(seqs)
        rollouts = [Rollout(s, tuple(lp.tolist()), float(i % 2)) for i, (s, lp) in enumerate(zip(seqs, behaviour))]
        pairs = [(seqs[0], seqs[1]), (seqs[2], seqs[3])]
        states = []
        for ckpt in (False, True):
            trainer = _trainer("cpu", lora_rank=lora, activation_checkpointing=ckpt, kl_coef=0.1, lr=1e-2)
            before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            ppo = trainer.grpo_step(rollouts, group_size=2)
            assert ppo["kl"] == 0.0 and ppo["mismatched_tokens"] == 0
            dpo = trainer.dpo_step(pairs)
            states.append((ppo["loss"], dpo["loss"], {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    assert states[0][:2] == states[1][:2]
    assert all(torch.equal(v, states[1][2][k]) for k, v in states[0][2].items())
    assert any(not torch.equal(v, before[k]) for k, v in states[1][2].items())   # the steps moved the weights


def test_checkpointing_leaves_the_model_as_it_was(cpu_backend):
    trainer = _trainer("cpu", activation_checkpointing=True)
    trainer.forward_backward("sft", _sequences(2))
    assert all("forward" not in vars(block) for block in trainer.model.layers)
    assert set(trainer.model.state_dict()) == set(Model(TINY).state_dict())
