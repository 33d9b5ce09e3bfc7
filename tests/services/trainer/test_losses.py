"""GRPO's group advantages (zerokl.services.trainer.losses.group_advantages)."""
import torch

from zerokl.services.trainer.losses import group_advantages


def test_a_group_of_equal_rewards_gets_exactly_zero_advantage():
    # fp32's mean of eight 0.1s is not 0.1: without the equal-rewards case every sample would get -0.0074.
    rewards = torch.tensor([0.1] * 8 + [1.0] * 8 + [0.0] * 8 + [0.1] * 7 + [1.0])
    adv = group_advantages(rewards, 8)
    assert torch.equal(adv[:24], torch.zeros(24))
    # A mixed group is centred and scaled by its std: seven at -1/sqrt(7)-ish, one at +sqrt(7).
    mixed = adv[24:]
    assert torch.allclose(mixed, torch.tensor([-1 / 7 ** 0.5] * 7 + [7 ** 0.5]), atol=1e-5)
    assert mixed[-1] > 0 > mixed[0]
