"""The experiment's estimators and corrections (zerokl.services.trainer.losses.policy_loss_terms)."""
import math

import pytest
import torch

from conftest import engine_rollouts
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer

from zerokl.services.trainer.losses import (CORRECTIONS, ESTIMATORS, LOW_PROB, PolicyObjective, policy_loss_terms,
                                            ppo_clip_terms)

# Two sequences of two tokens; rho = pi_train / pi_infer = 0.5, 1 (equal logprobs), 3, 4 (masked out).
TRAIN = [[0.2, 0.3], [0.6, 0.4]]
RHO = [[0.5, 1.0], [3.0, 4.0]]
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])


def _inputs():
    train = torch.log(torch.tensor(TRAIN)).requires_grad_()
    infer = train.detach() - torch.log(torch.tensor(RHO))
    return train, infer


def _run(objective, train=None, infer=None, mask=MASK, adv=ADV):
    if train is None:
        train, infer = _inputs()
    loss, terms = policy_loss_terms(train, infer, adv, mask, objective)
    loss.backward()
    return float(loss.detach()), {k: float(v) for k, v in terms.items()}, train.grad


def test_grpo_clip_without_correction_is_the_trainers_ppo_clip_bit_for_bit():
    a, infer = _inputs()
    b = a.detach().clone().requires_grad_()
    la, ta = policy_loss_terms(a, infer, ADV, MASK, PolicyObjective())
    lb, tb = ppo_clip_terms(b, infer, ADV, MASK, 0.2)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)
    for k in ("mismatched_tokens", "clip_fraction", "ratio_min", "ratio_max", "tokens"):
        assert torch.equal(ta[k].float(), tb[k].float()), k
    assert torch.equal(ta["kl"], tb["kl_behaviour"])


def test_tis_truncates_and_reports_the_discarded_weight():
    loss, t, grad = _run(PolicyObjective(correction="tis", cap=2.0))
    # Weights min(rho, 2) = 0.5, 1, 2 on a PPO ratio of exactly 1: loss = -(0.5 + 1 - 2) / 3.
    assert math.isclose(loss, 0.5 / 3, rel_tol=1e-6)
    assert math.isclose(t["correction_discarded_weight"], 1.0 / 4.5, rel_tol=1e-6)
    assert math.isclose(t["correction_dropped_fraction"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(t["behaviour_clip_fraction"], 2 / 3, rel_tol=1e-6)
    assert t["clip_fraction"] == 0.0 and t["mismatched_tokens"] == 2 and t["tokens"] == 3
    # d loss / d logprob = -weight * advantage / tokens.
    assert torch.allclose(grad, -torch.tensor([[0.5, 1.0], [-2.0, 0.0]]) / 3)


def test_mis_masks_the_tokens_above_the_cap():
    loss, t, grad = _run(PolicyObjective(estimator="reinforce", correction="mis", cap=2.0))
    # Weights 0.5, 1, 0 (rho 3 > 2 masked).
    assert torch.allclose(grad, -torch.tensor([[0.5, 1.0], [0.0, 0.0]]) / 3)
    assert math.isclose(t["correction_dropped_fraction"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(t["correction_discarded_weight"], 3.0 / 4.5, rel_tol=1e-6)


def test_seq_mis_weights_each_sequence_by_its_ratio_and_drops_those_above_the_cap():
    # Sequence ratios: 0.5 * 1 = 0.5 (kept, weight 0.5 on both tokens), 3 (> 2: dropped).
    loss, t, grad = _run(PolicyObjective(correction="seq-mis", cap=2.0))
    assert torch.allclose(grad, -torch.tensor([[0.5, 0.5], [0.0, 0.0]]) / 3)
    assert math.isclose(t["correction_dropped_fraction"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(t["correction_discarded_weight"], 3.0 / 3.5, rel_tol=1e-6)
    # A long sequence whose product overflows fp32 is dropped without a NaN.
    train = torch.zeros(1, 400, requires_grad=True)
    _, t, grad = _run(PolicyObjective(correction="seq-mis"), train, train.detach() - 1.0, torch.ones(1, 400),
                      torch.tensor([1.0]))
    assert torch.equal(grad, torch.zeros(1, 400)) and t["correction_dropped_fraction"] == 1.0
    assert t["correction_discarded_weight"] == 1.0 and math.isfinite(t["loss"])


def test_reinforce_does_not_clip():
    train, infer = _inputs()
    loss, t, grad = _run(PolicyObjective(estimator="reinforce"), train, infer)
    # r * A with r = rho: the gradient is -r * A / tokens, unclipped (3, not 1.2).
    assert torch.allclose(grad, -torch.tensor([[0.5, 1.0], [-3.0, 0.0]]) / 3)
    assert t["clip_fraction"] == 0.0


def test_gspo_takes_one_clipped_geometric_mean_ratio_per_sequence():
    train, infer = _inputs()
    loss, t, grad = _run(PolicyObjective(estimator="gspo"), train, infer)
    # s = sqrt(0.5 * 1) = 0.707 with A = 1 and s = 3 with A = -1: both outside [1 - 3e-4, 1 + 4e-4], and for
    # both min(s A, clip(s) A) is the unclipped s A. Mean over the 2 sequences; d s / d logprob = s / len.
    s1 = math.sqrt(0.5)
    assert math.isclose(loss, -(s1 - 3) / 2, rel_tol=1e-6)
    assert torch.allclose(grad, torch.tensor([[-s1 / 4, -s1 / 4], [1.5, 0.0]]))
    assert t["clip_fraction"] == 1.0
    with pytest.raises(ValueError, match="seq-mis"):
        PolicyObjective(estimator="gspo", correction="tis")


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_aligned_numerics_give_exact_zero_kl_unit_ratio_and_the_same_update_with_or_without_correction(
        estimator, correction):
    if estimator == "gspo" and correction in ("tis", "mis"):
        return
    train = torch.log(torch.tensor(TRAIN)).requires_grad_()
    _, t, grad = _run(PolicyObjective(estimator=estimator, correction=correction), train, train.detach().clone())
    assert t["kl"] == 0.0 and t["mismatched_tokens"] == 0 and t["max_abs_log_ratio"] == 0.0
    assert t["ratio_min"] == t["ratio_max"] == 1.0 and t["clip_fraction"] == 0.0
    assert t.get("correction_dropped_fraction", 0.0) == 0.0 and t.get("correction_discarded_weight", 0.0) == 0.0
    plain = torch.log(torch.tensor(TRAIN)).requires_grad_()
    _, _, expected = _run(PolicyObjective(estimator=estimator), plain, plain.detach().clone())
    assert torch.equal(grad, expected)


def test_low_probability_tokens_are_counted_under_inferences_probabilities():
    train = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]])).requires_grad_()
    infer = torch.log(torch.tensor([[LOW_PROB / 2, 0.5], [LOW_PROB * 2, 0.5]]))
    _, t, _ = _run(PolicyObjective(), train, infer)
    assert math.isclose(t["low_prob_fraction"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(t["max_abs_log_ratio"], math.log(0.5 / (LOW_PROB / 2)), rel_tol=1e-5)


def test_the_trainers_step_with_an_objective_is_its_grpo_step_for_the_default_one() -> None:
    """Trainer.grpo_step(objective=PolicyObjective()) (the experiment's arms' update) gives the built-in
    PPO-clip step's weights bit for bit, and adds the objective's telemetry (entropy) to its metrics; KL 0.0
    against the trainer's own engine."""
    def make() -> Trainer:
        return Trainer(Model(ModelConfig.preset("tiny"), seed=1), TrainConfig(lr=1e-3))

    plain, with_objective = make(), make()
    rollouts = engine_rollouts(plain.serving_model(), [(3, 4, 5, 6), (7, 8, 9)], lambda ids: float(sum(ids) % 3), n=4)
    a = plain.grpo_step(rollouts, 4)
    b = with_objective.grpo_step(rollouts, 4, PolicyObjective())
    assert all(torch.equal(x, y) for x, y in zip(plain.model.parameters(), with_objective.model.parameters()))
    assert a["kl"] == b["kl"] == 0.0 and b["mismatched_tokens"] == 0 and a["loss"] == b["loss"]
    assert "entropy" in b and "entropy" not in a
    with pytest.raises(ValueError, match="objective"):
        plain.forward_backward("sft", [r.sequence for r in rollouts], objective=PolicyObjective())
