"""Constructed exact ties, and the sampling contract (seeded by (seed, position), never by slot)."""
import pytest
import torch

import zerokl.kernels as K
from zerokl.kernels.sampling import SamplingParams, uniform_noise

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    # Triton kernels take CUDA tensors on a GPU machine (the gpu tier) and interpret on CPU.
    device = "cuda" if request.param == "triton" and torch.cuda.is_available() else "cpu"
    with K.use_backend(request.param), torch.device(device):
        yield request.param


def test_router_ties_go_to_lower_expert_and_group(backend):
    logits = torch.zeros(2, 8)                 # every expert and every group ties
    w, ids = K.moe_route(logits, torch.zeros(8), top_k=3, n_group=4, topk_group=2, route_scale=1.0)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    logits = torch.tensor([[0.0, 0.0, 5.0, 5.0, 0.0, 0.0, 5.0, 5.0]])
    _, ids = K.moe_route(logits, torch.zeros(8), top_k=2, n_group=4, topk_group=1, route_scale=1.0)
    assert ids.tolist() == [[2, 3]]             # group 1 beats the tied group 3


def test_router_bias_selects_but_does_not_weight(backend):
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    w, ids = K.moe_route(logits, torch.tensor([0.0, 0.0, 0.0, 1.0]), 1, 1, 1, 1.0, norm_topk_prob=False)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[1.0]])))   # accuracy: unbiased sigmoid weight


def test_indexer_topk_zero_plateau_goes_to_lower_positions(backend):
    scores = torch.tensor([[0.0, -0.0, 3.0, 0.0, 0.0, float("-inf")]])
    pos = torch.tensor([[10, 11, 12, 13, 14, -1]])
    assert K.topk_positions(scores, pos, 3).tolist() == [[10, 11, 12]]
    assert K.topk_positions(scores, pos, 8).tolist() == [[10, 11, 12, 13, 14, -1, -1, -1]]


def test_greedy_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    tokens, _ = K.sample(logits, SamplingParams.make(2, temperature=0.0))
    assert tokens.tolist() == [1, 0]


def test_seeded_sample_independent_of_batch_slot_and_neighbours():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 500, generator=g) * 2
    one = SamplingParams.make(1, temperature=1.0, top_p=0.95, seed=42, position=7)
    want, want_lp = K.sample(logits, one)
    for size, slot in [(2, 1), (9, 4), (17, 16)]:
        batch = torch.randn(size, 500, generator=g) * 2
        batch[slot] = logits[0]
        params = SamplingParams(
            temperature=torch.ones(size), top_k=torch.zeros(size, dtype=torch.int64), top_p=torch.full((size,), 0.95),
            seed=torch.randint(0, 1000, (size,), generator=g), position=torch.randint(0, 100, (size,), generator=g))
        params.seed[slot], params.position[slot] = 42, 7
        got, got_lp = K.sample(batch, params)
        assert got[slot] == want[0] and torch.equal(got_lp[slot], want_lp[0])


def test_different_seeds_differ_and_same_seed_repeats():
    logits = torch.zeros(64, 1000)                # uniform: the draw is all noise
    a, _ = K.sample(logits, SamplingParams.make(64, seed=1, position=torch.arange(64)))
    b, _ = K.sample(logits, SamplingParams.make(64, seed=2, position=torch.arange(64)))
    c, _ = K.sample(logits, SamplingParams.make(64, seed=1, position=torch.arange(64)))
    assert torch.equal(a, c)
    assert (a != b).sum() > 50


def test_noise_is_uniform_enough():
    u = uniform_noise(torch.tensor([7]), torch.tensor([3]), 200000)[0]
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert float(hist.min()) > 0.95 * 20000


def test_filtered_distribution_is_top_k_then_top_p_renormalized():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    lp = K.filtered_logprobs(logits, SamplingParams.make(1, temperature=1.0, top_k=3, top_p=0.75))
    # top-k keeps {0,1,2} -> probs 4/9, 3/9, 2/9; top-p 0.75: mass before 2 is 7/9 >= 0.75 -> drop 2.
    probs = lp.exp()[0]
    assert probs[2] == 0 and probs[3] == 0
    torch.testing.assert_close(probs[:2], torch.tensor([4 / 7, 3 / 7]))
    tokens, tok_lp = K.sample(logits, SamplingParams.make(1, temperature=1.0, top_k=3, top_p=0.75, seed=5))
    assert int(tokens) in (0, 1)
    assert torch.equal(tok_lp, K.sampling_logprobs(logits, tokens, SamplingParams.make(1, temperature=1.0, top_k=3, top_p=0.75)))


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = torch.log(probs).expand(4000, 4)
    tokens, _ = K.sample(logits, SamplingParams.make(4000, seed=9, position=torch.arange(4000)))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
