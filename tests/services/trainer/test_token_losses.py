"""Tinker's per-token losses and per-call AdamParams on the trainer (issue 48): in process, and over gRPC.

Parity claims are exact: the token path's logprobs are the engine's sampled logprobs and the
Completion path's bit for bit; an optimizer step with AdamParams is the trainer's AdamW with those
hyperparameters, bit for bit. Loss values are checked against the documented formulas recomputed
from the returned logprobs (a different summation order: a tolerance).
"""
from __future__ import annotations

import asyncio
import copy
import pathlib

import grpc
import grpc.aio
import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.runtime import field_violations
from zerokl.services.trainer.losses import TOKEN_LOSSES, token_loss_terms
from zerokl.services.trainer.optim import grad_norm
from zerokl.services.trainer.types import AdamParams
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import ScoredSequence, Trainer
from zerokl.services.trainer.types import TokenLossBatch, TokenSequence
from zerokl.vocab import Completion

from conftest import below_16, engine_rollouts
from test_trainer_service import trainer_server

TINY = ModelConfig.preset("tiny")


def _datum(prompt: tuple[int, ...], completion: tuple[int, ...]) -> ScoredSequence:
    """A Tinker datum of prompt + completion: every position scored, the prompt's against token 0
    (what the cookbook sends), the completion's against the sampled tokens."""
    ob = len(prompt) - 1
    return ScoredSequence((*prompt, *completion[:-1]), 0, (0,) * ob + tuple(completion))


def test_a_datum_scores_the_sampled_tokens_with_the_engines_exact_logprobs() -> None:
    trainer = Trainer(Model(TINY, seed=0), TrainConfig(lora_rank=4))
    rollouts = engine_rollouts(trainer.serving_model(), [(5, 6, 7), (9, 10, 11, 12, 13)], below_16, n=3)
    seqs = [_datum(r.sequence.prompt_ids, r.sequence.completion_ids) for r in rollouts]
    metrics, logprobs = trainer.forward_backward_tokens("cross_entropy", seqs, forward_only=True)
    for r, lp in zip(rollouts, logprobs, strict=True):
        ob = len(r.sequence.prompt_ids) - 1
        assert torch.equal(lp[ob:], torch.tensor(r.logprobs))             # sampled == trained, bitwise
    completions = trainer.forward_logprobs([r.sequence for r in rollouts])
    assert all(torch.equal(lp[len(r.sequence.prompt_ids) - 1:], c)
               for r, lp, c in zip(rollouts, logprobs, completions, strict=True))
    # Aligned numerics: every RL loss sees ratio exactly 1.
    ob = [len(r.sequence.prompt_ids) - 1 for r in rollouts]
    behaviour = [(0.0,) * o + r.logprobs for o, r in zip(ob, rollouts)]
    advantages = [(0.0,) * o + (r.reward - 0.5,) * len(r.logprobs) for o, r in zip(ob, rollouts)]
    for loss in ("importance_sampling", "ppo", "cispo", "dro"):
        m, _ = trainer.forward_backward_tokens(loss, seqs, behaviour=behaviour, advantages=advantages,
                                               config=dict(TOKEN_LOSSES[loss]), forward_only=True)
        assert (m["kl"], m["mismatched_tokens"], m["ratio_min"], m["ratio_max"]) == (0.0, 0.0, 1.0, 1.0), loss
        assert m["tokens"] == sum(len(r.logprobs) for r in rollouts if r.reward != 0.5)
    assert trainer.params[0].grad is None                      # forward_only accumulated nothing


def test_each_loss_is_its_documented_sum_over_positions() -> None:
    torch.manual_seed(0)
    lp = -torch.rand(2, 5) * 3
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    q = lp + torch.randn(2, 5) * 0.3                           # sampling logprobs off-policy
    adv = torch.randn(2, 5)
    w = torch.rand(2, 5)
    ratio = torch.exp(lp - q)
    expected = {
        "cross_entropy": -(w * lp),
        "importance_sampling": -(ratio * adv),
        "ppo": -torch.minimum(ratio * adv, ratio.clamp(0.9, 1.1) * adv),
        "cispo": -(ratio.clamp(0.0, 4.0) * lp * adv),
        "dro": -(lp * adv - 0.5 * 0.1 * (lp - q) ** 2),
    }
    configs = {"ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "cispo": TOKEN_LOSSES["cispo"],
               "dro": {"beta": 0.1}}
    for loss, per_position in expected.items():
        total, terms = token_loss_terms(loss, lp, valid, w, q, adv, dict(configs.get(loss, {})))
        assert torch.allclose(total, per_position[valid].sum(), rtol=1e-6, atol=1e-6), loss
        if loss in ("ppo", "cispo"):
            low, high = configs[loss]["clip_low_threshold"], configs[loss]["clip_high_threshold"]
            assert terms["clipped_tokens"] == (valid & (adv != 0) & ((ratio < low) | (ratio > high))).sum()
    # CISPO's clipped ratio is a constant: its gradient is -coef * advantage, nothing through the ratio.
    lp_leaf = lp.clone().requires_grad_(True)
    token_loss_terms("cispo", lp_leaf, valid, w, q, adv, dict(TOKEN_LOSSES["cispo"]))[0].backward()
    assert torch.equal(lp_leaf.grad, torch.where(valid, -ratio.clamp(0.0, 4.0) * adv, torch.zeros(())))


def test_adam_params_are_the_trainers_adamw_with_those_hyperparameters_bit_for_bit() -> None:
    trainer = Trainer(Model(TINY, seed=0), TrainConfig(lora_rank=4, grad_clip=1.0))
    seqs = [_datum((5, 6, 7), (8, 9, 10))]
    adam = AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.5)
    for step in range(2):
        trainer.forward_backward_tokens("cross_entropy", seqs)
        params = [p.detach().clone().requires_grad_(True) for p in trainer.params]
        for p, mine in zip(params, trainer.params, strict=True):
            p.grad = mine.grad.detach().clone()
        if step == 0:
            # The trainer's own AdamW (optim.PortableAdamW on a CPU, torch's on CUDA: optim.adamw) with
            # this call's hyperparameters.
            reference = type(trainer.optimizer)(params, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                                                eps=adam.eps, weight_decay=adam.weight_decay)
        else:
            reference.param_groups[0]["params"] = params
            reference.state = {p: s for p, s in zip(params, saved.values(), strict=True)}
        norm = grad_norm([p.grad for p in params])
        if norm > adam.grad_clip_norm:                         # the per-call clip, not TrainConfig's 1.0
            for p in params:
                p.grad.mul_(adam.grad_clip_norm / (float(norm) + 1e-6))
        reference.step()
        saved = copy.deepcopy(dict(reference.state))
        result = trainer.optim_step(adam=adam)
        assert result["lr"] == adam.learning_rate and result["step"] == step + 1
        assert all(torch.equal(p, mine) for p, mine in zip(params, trainer.params, strict=True))
    # A step without AdamParams is the configuration's again (betas, eps, weight decay restored).
    trainer.forward_backward_tokens("cross_entropy", seqs)
    trainer.optim_step()
    group = trainer.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.95), 1e-8, 0.0)


def test_token_batches_and_adam_params_over_grpc(tmp_path: pathlib.Path) -> None:
    """The service's edge: the same numbers as in process, and every bad field named."""
    local = Trainer(Model(TINY, seed=0), TrainConfig(lora_rank=4))
    seqs = [TokenSequence((5, 6, 7, 8, 9), (0, 0, 8, 9, 10), weights=(0.0, 0.0, 1.0, 1.0, 0.5)),
            TokenSequence((11, 12), (12, 13))]
    adam = AdamParams(learning_rate=1e-3)

    async def main() -> None:
        async with trainer_server(tmp_path / "w", "--lora-rank", "4") as (client, _):
            remote = await client.forward_backward_batch(TokenLossBatch("cross_entropy", tuple(seqs)))
            mine, logprobs = local.forward_backward_tokens(
                "cross_entropy", [ScoredSequence(s.input_ids, 0, s.target_ids) for s in seqs],
                weights=[seqs[0].weights, (1.0, 1.0)])
            assert remote.method == "token" and remote.accumulated_batches == 1
            assert remote.loss == mine["loss"] and all(torch.equal(a, b) for a, b in
                                                       zip(remote.token_logprobs, logprobs, strict=True))
            forward = await client.forward_backward_batch(TokenLossBatch("cross_entropy", tuple(seqs),
                                                                         forward_only=True))
            assert forward.accumulated_batches == 1                      # a forward accumulates nothing
            step = await client.optim_step(adam=adam)
            assert step.lr == 1e-3 and step.step == 1
            local.optim_step(adam=adam)
            state = await client.get_state()
            assert state.step == local.step
            for bad, fields in [
                (TokenLossBatch("gspo", tuple(seqs)), ["token.loss"]),
                (TokenLossBatch("cross_entropy", (TokenSequence((5, 6), (6,)),)), ["token.sequences[0].target_ids"]),
                (TokenLossBatch("cross_entropy", (TokenSequence((5, 99), (6, 7)),)),
                 ["token.sequences[0].input_ids"]),
                (TokenLossBatch("importance_sampling", (TokenSequence((5, 6), (6, 7), logprobs=(0.0, 0.0)),)),
                 ["token.sequences[0].advantages"]),
                (TokenLossBatch("ppo", (TokenSequence((5, 6), (6, 7), logprobs=(0.0, 0.0), advantages=(1.0, 1.0)),),
                                config={"beta": 0.1}), ["token.config.beta"]),
                (TokenLossBatch("cross_entropy", tuple(seqs), temperature=-1.0), ["token.temperature"]),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.forward_backward_batch(bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert [v.field for v in field_violations(err.value)] == fields, err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.forward_backward_batch(TokenLossBatch("cross_entropy", tuple(seqs)))
                await client.optim_step(adam=AdamParams(learning_rate=1e-3, beta1=1.5))
            assert [v.field for v in field_violations(err.value)] == ["adam.beta1"]
            with pytest.raises(grpc.aio.AioRpcError) as err:        # above the learning rate ceiling (MAX_LR 1)
                await client.optim_step(adam=AdamParams(learning_rate=1.5))
            assert [v.field for v in field_violations(err.value)] == ["adam.learning_rate"], err.value.details()
            again = await client.optim_step(adam=adam)             # the trainer kept serving
            assert again.step == 2
    asyncio.run(main())
