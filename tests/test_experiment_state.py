"""The routing-flip arm's router (zerokl.experiment_state.FlippingRouter): only flipped tokens differ."""
import copy

import torch

from zerokl.experiment_state import FlippingRouter, RouterFlips
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.model import MoE


def test_a_flipping_router_changes_only_the_tokens_whose_expert_set_flips_and_counts_them():
    model = Model(ModelConfig.preset("tiny"), seed=0).eval()
    served = copy.deepcopy(model)
    flips = RouterFlips()
    FlippingRouter.install(served, flips)
    moe, flipping = next(m for m in model.modules() if isinstance(m, MoE)), \
        next(m for m in served.modules() if isinstance(m, MoE))
    assert isinstance(flipping.gate, FlippingRouter) and not isinstance(moe.gate, FlippingRouter)
    x = torch.randn(4096, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact_w, exact_ids = moe.gate(x)
        w, ids = flipping.gate(x)
        out, flipped_out = moe(x), flipping(x)
    flipped = (exact_ids.sort(1).values != ids.sort(1).values).any(1)
    # Some tokens flip (a bf16 router on fp32 activations), most do not; those keep the exact route and output.
    assert 0 < int(flipped.sum()) < 0.1 * len(x)
    assert torch.equal(w[~flipped], exact_w[~flipped]) and torch.equal(ids[~flipped], exact_ids[~flipped])
    assert torch.equal(flipped_out[~flipped], out[~flipped])
    assert not torch.equal(flipped_out[flipped], out[flipped])
    # The counts: two calls of the first MoE layer (two forwards) of 4096 rows each.
    counts = flips.read()
    assert counts["router_decisions"] == 2 * 4096
    assert counts["router_flip_fraction"] == counts["router_flip_row_fraction"] == int(flipped.sum()) / 4096
    # The served copy's weights are the trainer's (the engine reloads them by name).
    assert served.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in served.state_dict().items())


def test_router_flips_count_a_row_once_across_layers():
    flips = RouterFlips()
    flips.add(True, torch.tensor([True, False, False, False]))      # forward 1, layer 1
    flips.add(False, torch.tensor([True, True, False, False]))      # forward 1, layer 2
    flips.add(True, torch.tensor([False, False]))                   # forward 2, layer 1
    flips.add(False, torch.tensor([False, True]))                   # forward 2, layer 2
    counts = flips.read()
    assert counts["router_decisions"] == 12 and counts["router_flip_fraction"] == 4 / 12
    assert counts["router_flip_row_fraction"] == 3 / 6
    flips.reset()
    assert flips.read()["router_decisions"] == 0
