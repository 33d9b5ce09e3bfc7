"""Micro-batched steps (TrainConfig.micro_batch_tokens): a batch larger than the budget runs as consecutive
micro-batches with accumulated gradients, and is still the batch's step: the same update (to summation
order), the same metrics, the same logprobs (KL 0.0 against the engine), and the same bits on any trainer
that splits it the same way."""
import dataclasses
import math

import pytest
import torch

from conftest import engine_rollouts
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.losses import PolicyObjective, group_advantages
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import InvalidOption

PROMPTS = [(3, 4, 5, 6), (7, 8, 9), (10, 11, 12, 13, 14), (15, 16)]
GROUP = 4


def _trainer(micro: int, **kw) -> Trainer:
    return Trainer(Model(ModelConfig.preset("tiny"), seed=1), TrainConfig(lr=1e-3, micro_batch_tokens=micro, **kw))


@pytest.fixture(scope="module")
def rollouts():
    # Completions of 3..8 tokens (lengths vary as an RL batch's do), sampled by the engine on the weights
    # every trainer below starts from.
    model = _trainer(0).serving_model()
    out = []
    for i, p in enumerate(PROMPTS):
        out += engine_rollouts(model, [p], lambda ids: float(sum(ids) % 3), n=GROUP, max_tokens=3 + i + i % 2,
                               seed=i)
    return out


def _packed(r) -> int:
    return len(r.sequence.prompt_ids) + len(r.sequence.completion_ids) - 1


def test_the_split_is_consecutive_whole_sequences_within_the_budget(rollouts) -> None:
    trainer = _trainer(20)
    parts = trainer.micro_batches("ppo", rollouts)
    assert parts[0][0] == 0 and parts[-1][1] == len(rollouts) and len(parts) > 2
    assert all(a < b and b == c for (a, b), (c, _) in zip(parts, parts[1:]))
    for a, b in parts:
        assert sum(_packed(r) for r in rollouts[a:b]) <= 20
    # Off (0), and a budget below one sequence: that sequence alone.
    assert _trainer(0).micro_batches("ppo", rollouts) == [(0, len(rollouts))]
    assert _trainer(1).micro_batches("ppo", rollouts) == [(i, i + 1) for i in range(len(rollouts))]


def test_a_micro_batched_grpo_step_is_the_batchs_step(rollouts) -> None:
    whole, split, again = _trainer(0), _trainer(20), _trainer(20)
    adv = group_advantages(torch.tensor([r.reward for r in rollouts]), GROUP)
    a = whole.forward_backward("ppo", rollouts, advantages=adv)
    b = split.forward_backward("ppo", rollouts, advantages=adv)
    # Logprobs are computed row by row whatever the batch: KL is exactly 0 against the engine either way.
    for m in (a, b):
        assert m["kl"] == 0.0 and m["mismatched_tokens"] == 0 and m["ratio_min"] == m["ratio_max"] == 1.0
        assert m["clip_fraction"] == 0.0
    assert a["tokens"] == b["tokens"] == sum(len(r.sequence.completion_ids) for r in rollouts)
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7)
    # The gradient is the batch's (accumulated in another order: equal to rounding) ...
    _assert_close_grads(whole, split)
    # ... and the step bitwise the same on every trainer that splits the batch the same way.
    split.optim_step()
    again.grpo_step(rollouts, GROUP)
    assert all(torch.equal(p, q) for p, q in zip(split.model.parameters(), again.model.parameters()))


def _assert_close_grads(whole: Trainer, split: Trainer) -> None:
    for p, q in zip(whole.params, split.params):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is None:
            continue                                    # a parameter the objective does not reach (the indexer's)
        scale = p.grad.abs().max().item()
        assert torch.allclose(p.grad.float(), q.grad.float(), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("objective", [PolicyObjective(estimator="gspo"),
                                       PolicyObjective(estimator="reinforce", correction="tis")])
def test_an_objectives_micro_batched_loss_and_telemetry_are_the_batchs(rollouts, objective) -> None:
    # Off-policy by hand: behaviour logprobs shifted per token so that ratios, clipping and the correction act.
    shifted = [dataclasses.replace(r, logprobs=tuple(lp + 0.05 * ((i + j) % 5 - 2) for j, lp in enumerate(r.logprobs)))
               for i, r in enumerate(rollouts)]
    adv = group_advantages(torch.tensor([r.reward for r in shifted]), GROUP)
    whole, split = _trainer(0), _trainer(20)
    a = whole.forward_backward("ppo", shifted, advantages=adv, objective=objective)
    b = split.forward_backward("ppo", shifted, advantages=adv, objective=objective)
    assert a.keys() == b.keys()
    for k in ("tokens", "mismatched_tokens", "ratio_min", "ratio_max", "max_abs_log_ratio"):
        assert a[k] == b[k], k
    assert a["mismatched_tokens"] > 0
    for k in ("loss", "kl", "clip_fraction", "low_prob_fraction", "entropy"):
        assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-7), k
    _assert_close_grads(whole, split)


def test_micro_batched_sft_and_dpo_are_the_batchs(rollouts) -> None:
    seqs = [r.sequence for r in rollouts]
    for method, items in (("sft", seqs), ("dpo", list(zip(seqs[0::2], seqs[1::2])))):
        whole, split = _trainer(0), _trainer(24)
        assert len(split.micro_batches(method, items)) > 1
        a, b = whole.forward_backward(method, items), split.forward_backward(method, items)
        assert a["tokens"] == b["tokens"]
        for k in a.keys() - {"tokens", "tokens_per_s"}:
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-7), (method, k)
        _assert_close_grads(whole, split)


def test_the_budget_is_checked_where_the_config_enters() -> None:
    with pytest.raises(InvalidOption, match="integer") as err:
        TrainConfig(micro_batch_tokens=-1).check()
    assert err.value.field == "micro_batch_tokens"
    TrainConfig(micro_batch_tokens=65536).check()
