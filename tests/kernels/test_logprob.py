"""The fused, chunked head + sampling logprob (zerokl.kernels.logprob): forward bitwise the
unfused definition for every sampling mode and chunking, gradient equal to it to tolerance
and bitwise run to run."""
import pytest
import torch

from zerokl.kernels import use_backend
from zerokl.kernels.logprob import chunk_rows_for, fused_logprobs, logprobs_reference
from zerokl.kernels.sampling import SamplingParams
from zerokl.kernels.model import Model, ModelConfig

TINY = ModelConfig.preset("tiny")
N = 13

# name -> (temperature, top_k, top_p) for every row; "mixed" cycles through all of them row by row.
MODES = {
    "greedy": (0.0, 0, 1.0),
    "temperature": (0.7, 0, 1.0),
    "top_k": (1.0, 5, 1.0),
    "top_p": (1.0, 0, 0.8),
    "top_k_top_p": (1.3, 9, 0.6),
}


def _params(mode: str) -> SamplingParams:
    rows = list(MODES.values()) if mode == "mixed" else [MODES[mode]]
    rows = [rows[i % len(rows)] for i in range(N)]
    return SamplingParams(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                          torch.tensor([r[2] for r in rows]), torch.zeros(N, dtype=torch.int64),
                          torch.zeros(N, dtype=torch.int64))


def _case(dtype=torch.float32, seed=0):
    model = Model(TINY, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, TINY.hidden_size, generator=g) * 3).to(dtype).requires_grad_(True)
    targets = torch.randint(0, TINY.vocab_size, (N,), generator=g)
    head = lambda x: model.lm_head(model.norm(x))       # noqa: E731
    return model, hidden, targets, head, [model.norm.weight, model.lm_head.weight]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [*MODES, "mixed"])
def test_forward_is_bitwise_the_unfused_logprobs_for_every_mode_and_chunking(mode, dtype):
    _, hidden, targets, head, weights = _case(dtype)
    params = _params(mode)
    with use_backend("torch"):
        ref = logprobs_reference(hidden, head, targets, params)
        for chunk in (1, 4, N, None):
            got = fused_logprobs(hidden, head, weights, targets, params, chunk)
            assert got.dtype == torch.float32 and torch.equal(got, ref), chunk


def _grads(fn, hidden, weights, seed=3):
    """Gradients of a random weighting of the finite logprobs (a non-uniform upstream gradient)."""
    lp = fn()
    up = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed))
    loss = (torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)) * up).sum()
    return torch.autograd.grad(loss, [hidden, *weights])


@pytest.mark.parametrize("mode", ["temperature", "greedy", "mixed"])
def test_gradient_matches_the_unfused_path_and_is_deterministic(mode):
    _, hidden, targets, head, weights = _case(torch.float32, seed=1)
    params = _params(mode)
    with use_backend("torch"):
        ref = _grads(lambda: logprobs_reference(hidden, head, targets, params), hidden, weights)
        for chunk in (1, 5, None):
            fused = lambda: fused_logprobs(hidden, head, weights, targets, params, chunk)   # noqa: E731
            a, b = _grads(fused, hidden, weights), _grads(fused, hidden, weights)
            for x, y, r in zip(a, b, ref):
                assert torch.equal(x, y)                                      # run to run: bitwise
                torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6)        # vs unfused: tolerance
        # One chunk holding every row differentiates exactly what the unfused path does.
        whole = _grads(lambda: fused_logprobs(hidden, head, weights, targets, params, N), hidden, weights)
        assert all(torch.equal(x, r) for x, r in zip(whole, ref))


@pytest.mark.usefixtures("cpu_backend")
def test_gradient_reaches_only_what_requires_it():
    _, hidden, targets, head, weights = _case()
    weights[0].requires_grad_(False)
    lp = fused_logprobs(hidden, head, weights, targets, _params("temperature"), 4)
    lp.sum().backward()
    assert weights[0].grad is None and weights[1].grad is not None and hidden.grad is not None
    assert weights[1].grad.dtype == weights[1].dtype and hidden.grad.shape == hidden.shape


def test_chunk_size_and_argument_checks():
    assert chunk_rows_for(154880) == 866 and chunk_rows_for(32768) == 4096 and chunk_rows_for(1 << 40) == 1
    _, hidden, targets, head, weights = _case()
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_logprobs(hidden, head, weights, targets, _params("greedy"), 0)
    with pytest.raises(ValueError, match="targets"):
        fused_logprobs(hidden, head, weights, targets[:-1], _params("greedy"))
    empty = fused_logprobs(hidden[:0], head, weights, targets[:0], _params("greedy"))
    assert empty.shape == (0,)
