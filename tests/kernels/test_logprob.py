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
    up = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed)).to(lp.device)
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


def test_triton_logprob_backward_matches_float64_autograd():
    """triton.logprob_backward: the logits' gradient of log_softmax(x / temperature)[target] x grad,
    a zero row where scale is 0 (a row without a distribution, NaN logits and all)."""
    from zerokl.kernels.triton.reductions import logprob_backward
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(5, 300, generator=g) * 4).to(torch.bfloat16)
    logits[4, 7] = float("nan")
    targets = torch.tensor([0, 299, 17, 150, 3])
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0])
    grad = torch.rand(5, generator=g)
    scale = torch.where(torch.arange(5) == 4, torch.zeros(5), grad / temp)
    dev = "cuda" if torch.cuda.is_available() else "cpu"    # Triton kernels: CUDA, or the interpreter on CPU
    got = logprob_backward(*(t.to(dev) for t in (logits, targets, temp, scale))).cpu()
    x = logits[:4].double().requires_grad_(True)
    lp = torch.log_softmax(x / temp[:4].double().unsqueeze(1), -1).gather(1, targets[:4].view(-1, 1)).squeeze(1)
    (want,) = torch.autograd.grad(lp, x, grad[:4].double())
    assert got.dtype == torch.bfloat16 and not got[4].any()
    torch.testing.assert_close(got[:4].double(), want, rtol=2e-2, atol=2e-3)
    alone = logprob_backward(*(t[1:3].to(dev) for t in (logits, targets, temp, scale))).cpu()
    assert torch.equal(alone, got[1:3])                                                            # per row


@pytest.mark.parametrize("mode", ["temperature", "greedy"])
def test_direct_logits_gradient_matches_differentiating_the_sampling_steps(mode, monkeypatch):
    """The CUDA backward of rows without filters (triton.logprob_backward), run here by the
    interpreter: the forward's bits unchanged, gradients equal to the differentiated path to tolerance."""
    import dataclasses
    from zerokl.kernels import logprob, ops
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, hidden, targets, head, _ = _case(torch.float32, seed=2)
    model.to(dev)
    hidden, targets = hidden.detach().to(dev).requires_grad_(True), targets.to(dev)
    weights = [model.norm.weight, model.lm_head.weight]
    params = _params(mode)
    params = SamplingParams(*(getattr(params, f.name).to(dev) for f in dataclasses.fields(params)))
    with use_backend("triton"):
        fused = lambda: fused_logprobs(hidden, head, weights, targets, params, 5, (False, False))  # noqa: E731
        monkeypatch.setattr(ops, "_OWN_GRAD_DEVICES", ())           # differentiate the sampling steps
        base_lp, base = fused(), _grads(fused, hidden, weights)
        monkeypatch.setattr(ops, "_OWN_GRAD_DEVICES", ("cuda", "cpu"))
        calls = []
        direct = logprob._logits_grad
        monkeypatch.setattr(logprob, "_logits_grad", lambda *a: calls.append(1) or direct(*a))
        lp, got = fused(), _grads(fused, hidden, weights)
    assert len(calls) == 3                                       # three chunks of 5, 5 and 3 rows
    assert torch.equal(lp, base_lp)
    for x, r in zip(got, base):
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-5)
