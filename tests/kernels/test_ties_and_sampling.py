"""Constructed exact ties, and the sampling contract (seeded by (seed, position), never by slot)."""
import dataclasses

import pytest
import torch

import zerokl.kernels as K
from zerokl.kernels.sampling import SamplingParams, uniform_noise

BACKENDS = ["torch", "triton"]


def _skip_unrunnable(name: str, device: str) -> None:
    if device == "cuda" and name == "torch":
        pytest.skip("CUDA runs the triton backend")
    if device == "cpu" and name == "triton" and torch.cuda.is_available():
        pytest.skip("on a CUDA machine Triton compiles for the GPU: its CPU interpreter runs on CPU-only machines")


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


@pytest.mark.usefixtures("cpu_backend")
def test_greedy_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    tokens = K.sample(logits, SamplingParams.make(2, temperature=0.0)).tokens
    assert tokens.tolist() == [1, 0]


@pytest.mark.usefixtures("cpu_backend")
def test_seeded_sample_independent_of_batch_slot_and_neighbours():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 500, generator=g) * 2
    one = SamplingParams.make(1, temperature=1.0, top_p=0.95, seed=42, position=7)
    want, want_lp, _ = K.sample(logits, one)
    for size, slot in [(2, 1), (9, 4), (17, 16)]:
        batch = torch.randn(size, 500, generator=g) * 2
        batch[slot] = logits[0]
        params = SamplingParams(
            temperature=torch.ones(size), top_k=torch.zeros(size, dtype=torch.int64), top_p=torch.full((size,), 0.95),
            seed=torch.randint(0, 1000, (size,), generator=g), position=torch.randint(0, 100, (size,), generator=g))
        params.seed[slot], params.position[slot] = 42, 7
        got, got_lp, _ = K.sample(batch, params)
        assert got[slot] == want[0] and torch.equal(got_lp[slot], want_lp[0])


@pytest.mark.usefixtures("cpu_backend")
def test_different_seeds_differ_and_same_seed_repeats():
    logits = torch.zeros(64, 1000)                # uniform: the draw is all noise
    a = K.sample(logits, SamplingParams.make(64, seed=1, position=torch.arange(64))).tokens
    b = K.sample(logits, SamplingParams.make(64, seed=2, position=torch.arange(64))).tokens
    c = K.sample(logits, SamplingParams.make(64, seed=1, position=torch.arange(64))).tokens
    assert torch.equal(a, c)
    assert (a != b).sum() > 50


@pytest.mark.usefixtures("cpu_backend")
def test_noise_is_uniform_enough():
    u = uniform_noise(torch.tensor([7]), torch.tensor([3]), 200000)[0]
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert float(hist.min()) > 0.95 * 20000


@pytest.mark.usefixtures("cpu_backend")
def test_filtered_distribution_is_top_k_then_top_p_renormalized():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    lp = K.filtered_logprobs(logits, SamplingParams.make(1, temperature=1.0, top_k=3, top_p=0.75))
    # top-k keeps {0,1,2} -> probs 4/9, 3/9, 2/9; top-p 0.75: mass before 2 is 7/9 >= 0.75 -> drop 2.
    probs = lp.exp()[0]
    assert probs[2] == 0 and probs[3] == 0
    torch.testing.assert_close(probs[:2], torch.tensor([4 / 7, 3 / 7]))
    tokens, tok_lp, ok = K.sample(logits, SamplingParams.make(1, temperature=1.0, top_k=3, top_p=0.75, seed=5))
    assert ok.tolist() == [True]
    assert int(tokens) in (0, 1)
    assert torch.equal(tok_lp, K.sampling_logprobs(logits, tokens, SamplingParams.make(1, temperature=1.0, top_k=3, top_p=0.75)))


@pytest.mark.usefixtures("cpu_backend")
def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = torch.log(probs).expand(4000, 4)
    tokens = K.sample(logits, SamplingParams.make(4000, seed=9, position=torch.arange(4000))).tokens
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


# ---------------------------------------------------------------- no NaN, and filters invariant row by row

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# (seed, position, token id) whose 32 hash bits are the top 24-bit cell: the old 24-bit
# uniform rounded its midpoint to 1.0 -> +inf Gumbel noise -> NaN next to a filtered-out
# token's -inf -> _first_argmax returned the vocab size -> an out-of-range gather.
TOP_CELL_HITS = [(261600, 12, 22), (280273, 12, 62), (425994, 14, 0), (484629, 14, 37), (526226, 14, 20)]


@pytest.mark.usefixtures("cpu_backend")
def test_noise_stays_inside_the_open_interval_and_gumbel_is_finite():
    from zerokl.kernels.sampling import _cell_midpoint
    extremes = _cell_midpoint(torch.tensor([0, (1 << 32) - 1, (1 << 32) - 257], dtype=torch.int64))
    assert 0.0 < float(extremes[0]) and float(extremes.max()) < 1.0
    for seed, position, token in TOP_CELL_HITS:
        u = uniform_noise(torch.tensor([seed]), torch.tensor([position]), 64)[0]
        assert float(u[token]) == 1.0 - 2.0 ** -24          # the top cell, inside (0, 1) now
        assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", BACKENDS)
def test_top_k_on_the_top_noise_cell_draws_inside_the_filter(name, device):
    """The GPU crash on CPU: top_k=20 at a (seed, position) whose noise hit the top cell."""
    _skip_unrunnable(name, device)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(len(TOP_CELL_HITS), 64, generator=g) * 2).to(torch.bfloat16).to(device)
    for row, (_, _, token) in enumerate(TOP_CELL_HITS):
        logits[row, token] = -30.0                           # far outside every row's top 20
    seeds, positions = zip(*[(s, p) for s, p, _ in TOP_CELL_HITS])
    params = SamplingParams(torch.ones(len(seeds)), torch.full((len(seeds),), 20), torch.ones(len(seeds)),
                            torch.tensor(seeds), torch.tensor(positions))
    params = SamplingParams(*(t.to(device) for t in dataclasses.astuple(params)))
    with K.use_backend(name):
        tokens, logprobs, ok = K.sample(logits.float(), params)
        allowed = torch.isfinite(K.filtered_logprobs(logits.float(), params))
    assert ok.all() and bool(torch.isfinite(logprobs).all())
    assert bool(allowed.gather(1, tokens.unsqueeze(1)).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", BACKENDS)
def test_rows_without_a_distribution_are_flagged_not_nan(name, device):
    _skip_unrunnable(name, device)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 50, generator=g) * 3
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    logits[4, :45] = float("-inf")                           # a few finite tokens: a real distribution
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.7, 1e-45, 1.0])   # row 5: logits / 1e-45 overflow
    top_p = torch.tensor([0.9, 0.9, 1.0, 0.9, 0.5, 1.0, 0.0])             # row 6: top_p 0 keeps the top token
    params = SamplingParams(temperature, torch.tensor([0, 20, 0, 20, 3, 0, 0]), top_p,
                            torch.arange(7), torch.arange(7))
    logits, params = logits.to(device), SamplingParams(*(t.to(device) for t in dataclasses.astuple(params)))
    with K.use_backend(name):
        tokens, logprobs, ok = K.sample(logits, params)
        filtered = K.filtered_logprobs(logits, params)
        alone = [K.sample(logits[i:i + 1], SamplingParams(*(t[i:i + 1] for t in dataclasses.astuple(params))))
                 for i in range(7)]
    assert ok.tolist() == [True, False, False, False, True, False, True]
    assert bool(((tokens >= 0) & (tokens < 50)).all()) and not bool(torch.isnan(logprobs).any())
    assert bool(torch.isnan(filtered[~ok]).all()) and not bool(torch.isnan(filtered[ok]).any())
    assert int(tokens[6]) == int(logits[6].argmax()) and float(logprobs[6]) == 0.0
    assert int(tokens[4]) >= 45
    for i, draw in enumerate(alone):                         # a bad neighbour changes nothing
        assert bool(draw.ok[0]) == bool(ok[i])
        if ok[i]:
            assert int(draw.tokens[0]) == int(tokens[i]) and torch.equal(draw.logprobs[0], logprobs[i])


def _mixed_params(n: int, g: torch.Generator) -> SamplingParams:
    """Every row its own sampling mode: plain, greedy, top-k, top-p, top-k + top-p, low temperature."""
    modes = [(1.0, 0, 1.0), (0.0, 0, 1.0), (1.0, 20, 1.0), (1.0, 0, 0.9), (0.8, 20, 0.9), (0.6, 0, 0.95)]
    pick = [modes[int(i)] for i in torch.randint(0, len(modes), (n,), generator=g)]
    return SamplingParams(torch.tensor([m[0] for m in pick]), torch.tensor([m[1] for m in pick]),
                          torch.tensor([m[2] for m in pick]), torch.randint(0, 1000, (n,), generator=g),
                          torch.randint(0, 500, (n,), generator=g))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", BACKENDS)
def test_filtered_logprobs_of_a_row_are_its_own_in_any_batch(name, device):
    """Each row's filtered logprobs (and draw) torch.equal alone, in batches of several sizes at
    several positions, next to rows with other sampling parameters. V spans several of the
    Triton scan's chunks (5000 on CPU; the small preset's 32768 on CUDA, where torch.cumsum's
    scan changed with the batch); bf16-rounded logits make ties at the k-th value and in the sort."""
    _skip_unrunnable(name, device)
    g = torch.Generator().manual_seed(11)
    v = 5000 if device == "cpu" else 32768
    rows = (torch.randn(6, v, generator=g) * 2).to(torch.bfloat16).float()
    params = _mixed_params(6, g)
    rows, params = rows.to(device), SamplingParams(*(t.to(device) for t in dataclasses.astuple(params)))
    with K.use_backend(name):
        alone = [(K.filtered_logprobs(rows[i:i + 1], _take(params, [i])), K.sample(rows[i:i + 1], _take(params, [i])))
                 for i in range(6)]
        for size in (2, 7) if device == "cpu" else (2, 5, 9, 24, 64):     # the interpreter is slow
            for slot in sorted({0, size // 2, size - 1}):
                noise = (torch.randn(size, v, generator=g) * 2).to(torch.bfloat16).float().to(device)
                other = SamplingParams(*(t.to(device) for t in dataclasses.astuple(_mixed_params(size, g))))
                i = (size + slot) % 6
                noise[slot] = rows[i]
                batch = SamplingParams(*(torch.cat([o[:slot], p[i:i + 1], o[slot + 1:]])
                                         for o, p in zip(dataclasses.astuple(other), dataclasses.astuple(params))))
                lp = K.filtered_logprobs(noise, batch)
                draw = K.sample(noise, batch)
                assert torch.equal(lp[slot], alone[i][0][0]), f"row {i} in a batch of {size} at slot {slot}"
                assert int(draw.tokens[slot]) == int(alone[i][1].tokens[0])
                assert torch.equal(draw.logprobs[slot], alone[i][1].logprobs[0])


def _take(params: SamplingParams, idx: list[int]) -> SamplingParams:
    return SamplingParams(*(t[idx] for t in dataclasses.astuple(params)))


def test_torch_backend_prefix_mass_is_a_sequential_fp64_loop():
    """The torch backend's scan is defined as a left-to-right fp64 loop rounded per prefix (CPU cumsum)."""
    g = torch.Generator().manual_seed(12)
    x = torch.rand(3, 300, generator=g) ** 4
    with K.use_backend("torch"):
        got = K.sampling.row_cumsum(x)
    for r in range(3):
        acc, want = 0.0, []
        for value in x[r].tolist():
            acc += value                                   # Python floats are IEEE doubles
            want.append(acc)
        assert torch.equal(got[r], torch.tensor(want, dtype=torch.float64).float())


@pytest.mark.parametrize("device", DEVICES)
def test_triton_prefix_mass_is_row_invariant_across_chunks(device):
    _skip_unrunnable("triton", device)
    g = torch.Generator().manual_seed(13)
    x = (torch.rand(4, 9000, generator=g) ** 4).to(device)       # three 4096-wide chunks
    with K.use_backend("triton"):
        batch = K.sampling.row_cumsum(x)
        for i in (0, 3):
            assert torch.equal(K.sampling.row_cumsum(x[i:i + 1])[0], batch[i])
    torch.testing.assert_close(batch.double().cpu(), torch.cumsum(x.double().cpu(), -1), rtol=1e-6, atol=0)
