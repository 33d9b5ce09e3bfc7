"""Trainer: exact KL == 0 against the engine's rollouts, learning on small data, determinism, resume."""
import random

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion

from conftest import below_16, engine_rollouts

TINY = ModelConfig.preset("tiny")


def _prompts(k, seed=0):
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 40))) for _ in range(k)]


@pytest.mark.parametrize("lora,top_p", [(0, 1.0), (0, 0.9), (8, 1.0)])
def test_kl_is_exactly_zero_on_real_rollouts(lora, top_p):
    trainer = Trainer(Model(TINY, seed=1), TrainConfig(lr=3e-3, lora_rank=lora))
    reward = lambda toks: sum(t == 7 for t in toks) / len(toks)   # noqa: E731
    for step in range(2):                     # the second step samples from updated weights
        rollouts = engine_rollouts(trainer.serving_model(), _prompts(3, step), reward, top_p=top_p, max_tokens=10,
                                   seed=step)
        recomputed = trainer.forward_logprobs([r.sequence for r in rollouts])
        for r, lp in zip(rollouts, recomputed):
            assert torch.equal(lp, torch.tensor(r.logprobs, dtype=torch.float32))
        m = trainer.grpo_step(rollouts, group_size=4)
        assert m["kl"] == 0.0 and m["mismatched_tokens"] == 0 and m["clip_fraction"] == 0.0
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["tokens"] == 3 * 4 * 10


def test_mismatched_numerics_show_kl():
    """The check can fail: inference in bf16 while the trainer computes in fp32."""
    trainer = Trainer(Model(TINY, seed=1))
    served = trainer.serving_model().to(torch.bfloat16)
    rollouts = engine_rollouts(served, _prompts(2), lambda t: 0.0, max_tokens=10)
    m = trainer.grpo_step(rollouts, group_size=4)
    assert m["mismatched_tokens"] > 0 and m["kl"] != 0.0


def test_sft_loss_falls():
    trainer = Trainer(Model(TINY, seed=2), TrainConfig(lr=3e-3))
    data = [Completion(p, (7, 8, 9, 10, 11)) for p in _prompts(8, 3)]
    losses = [trainer.sft_step(data)["loss"] for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0]


def test_dpo_loss_falls():
    trainer = Trainer(Model(TINY, seed=3), TrainConfig(lr=3e-3, dpo_beta=0.5))
    pairs = [(Completion(p, (7, 7, 7)), Completion(p, (9, 9, 9))) for p in _prompts(6, 4)]
    first = trainer.dpo_step(pairs)
    for _ in range(8):
        last = trainer.dpo_step(pairs)
    assert last["loss"] < first["loss"] and last["preference_accuracy"] == 1.0


def test_grpo_learns_a_toy_reward():
    trainer = Trainer(Model(TINY, seed=4), TrainConfig(lr=1e-2))
    history = []
    for step in range(6):
        rollouts = engine_rollouts(trainer.serving_model(), _prompts(4, step), below_16, n=4, max_tokens=8, seed=step)
        history.append(trainer.grpo_step(rollouts, group_size=4)["reward"])
    assert sum(history[-2:]) / 2 > history[0] + 0.15, history


def _train(steps, resume_at=None):
    trainer = Trainer(Model(TINY, seed=5), TrainConfig(lr=3e-3, warmup_steps=2, total_steps=6))
    data = [Completion(p, (7, 8, 9)) for p in _prompts(4, 6)]
    for s in range(steps):
        if s == resume_at:
            state = trainer.state_dict()
            trainer = Trainer(Model(TINY, seed=99), TrainConfig(lr=3e-3, warmup_steps=2, total_steps=6))
            trainer.load_state_dict(state)
        trainer.sft_step(data)
    return trainer


def test_training_is_deterministic_and_resumes_exactly():
    a, b, resumed = _train(5), _train(5), _train(5, resume_at=3)
    for (name, x), y, z in zip(a.model.state_dict().items(), b.model.state_dict().values(),
                               resumed.model.state_dict().values()):
        assert torch.equal(x, y), name
        assert torch.equal(x, z), name
    assert resumed.step == 5


def test_kl_penalty_to_reference_is_finite_under_top_p():
    """The reference may give a top-p-sampled token probability 0; the penalty compares full distributions."""
    trainer = Trainer(Model(TINY, seed=6), TrainConfig(lr=3e-3, kl_coef=0.1))
    for step in range(2):
        rollouts = engine_rollouts(trainer.serving_model(), _prompts(2, step), lambda t: float(t[0] % 2), top_p=0.5,
                                   max_tokens=10, seed=step)
        m = trainer.grpo_step(rollouts, group_size=4)
        assert m["kl"] == 0.0 and 0.0 <= m["kl_reference"] < float("inf") and m["loss"] == m["loss"]
    assert m["kl_reference"] > 0.0          # the policy has moved away from the reference


def test_a_step_that_makes_a_weight_non_finite_is_undone():
    """An infinite gradient (clipping turns it into NaN) would poison the weights: the step raises NonFiniteStep
    naming the tensor, and weights, optimizer state and step counter are bitwise as before it."""
    from zerokl.services.trainer.optim import NonFiniteStep

    trainer = Trainer(Model(ModelConfig.preset("tiny"), seed=0), TrainConfig(lr=3e-3))
    data = [Completion((5, 6, 7, 8), (9, 10, 11))] * 2
    trainer.sft_step(data)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = [v.clone() for s in trainer.optimizer.state.values() for v in s.values()]
    trainer.forward_backward("sft", data)
    trainer.params[0].grad[0] = float("inf")
    with pytest.raises(NonFiniteStep, match="non-finite"):
        trainer.optim_step()
    assert trainer.step == 1 and all(p.grad is None for p in trainer.params)
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in
               zip([v for s in trainer.optimizer.state.values() for v in s.values()], moments, strict=True))


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_indexer_loss_coef_trains_the_indexer_only_when_set(coef):
    """TrainConfig.indexer_loss_coef adds the indexer's KL loss (zerokl.kernels.model.indexer_loss): with
    sequences longer than index_topk the indexer gets gradients; at the default 0 it gets none."""
    trainer = Trainer(Model(TINY.replace(num_hidden_layers=2), seed=2), TrainConfig(indexer_loss_coef=coef))
    rng = random.Random(3)
    seqs = [Completion(tuple(rng.randrange(3, 64) for _ in range(30)), tuple(rng.randrange(3, 64) for _ in range(10)))
            for _ in range(2)]                                    # 40 tokens > index_topk = 32
    trainer.forward_backward("sft", seqs)
    grads = [p.grad for n, p in trainer.model.named_parameters() if ".indexer." in n]
    assert any(g is not None and g.abs().sum() > 0 for g in grads) == (coef > 0)


@pytest.mark.parametrize("lora", [0, 4])
def test_serving_state_without_a_copy_is_the_models_own_tensors_and_the_same_bits(lora):
    """An export packs ``serving_state_dict(copy=False)``: the model's own tensors wherever no merge computes one
    (a whole clone of the GLM-5 slice beside its export did not fit the H100), the same bits as the copy."""
    trainer = Trainer(Model(TINY, seed=2, dtype=torch.bfloat16), TrainConfig(lr=3e-3, lora_rank=lora))
    copied, own = trainer.serving_state_dict(), trainer.serving_state_dict(copy=False)
    assert list(copied) == list(own) and all(torch.equal(copied[k], own[k]) for k in own)
    weights = {t.untyped_storage().data_ptr() for t in trainer.model.state_dict().values()}
    assert not any(t.untyped_storage().data_ptr() in weights for t in copied.values())
    shared = {k for k, t in own.items() if t.untyped_storage().data_ptr() in weights}
    # LoRA: an adapted weight is the merge, computed (the model holds it under other names); the rest are the
    # model's own.
    merged = {k for k in own if k not in trainer.model.state_dict()}
    assert shared == set(own) - merged and "embed_tokens.weight" in shared
    assert bool(merged) == bool(lora)
