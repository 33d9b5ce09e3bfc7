"""Accuracy of both backends against the plain-torch reference (tolerances are for accuracy only)."""
import pytest
import torch

import zerokl.kernels as K
from zerokl.kernels import reference as ref

BACKENDS = ["torch", "triton"]
# (rtol, atol) per input dtype: bf16 inputs are exact in fp32, so only output rounding differs.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1e-2)}


def _g(seed):
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.fixture(params=BACKENDS)
def backend(request):
    # Triton kernels take CUDA tensors on a GPU machine (the gpu tier) and interpret on CPU.
    device = "cuda" if request.param == "triton" and torch.cuda.is_available() else "cpu"
    with K.use_backend(request.param), torch.device(device):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(backend, dtype):
    x = torch.randn(37, 130, generator=_g(0)).to(dtype)
    w = (torch.randn(45, 130, generator=_g(1)) * 0.1).to(dtype)
    b = torch.randn(45, generator=_g(2))
    out = K.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (37, 45)
    close(out, ref.linear(x, w, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear(backend, dtype):
    x = torch.randn(11, 30, generator=_g(3)).to(dtype)
    w = (torch.randn(3, 17, 30, generator=_g(4)) * 0.2).to(dtype)
    offsets = [0, 4, 4, 11]
    want = torch.cat([ref.linear(x[:4], w[0]), ref.linear(x[4:], w[2])])
    close(K.grouped_linear(x, w, offsets), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms(backend, dtype):
    x = (torch.randn(9, 257, generator=_g(5)) * 3 + 0.5).to(dtype)
    w, b = torch.randn(257, generator=_g(6)), torch.randn(257, generator=_g(7))
    close(K.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    close(K.layer_norm(x, w, b, 1e-6), ref.layer_norm(x, w, b, 1e-6), dtype)


def test_softmax_family(backend):
    x = torch.randn(5, 2049, generator=_g(8)) * 6
    close(K.log_softmax(x), ref.log_softmax(x), torch.float32)
    close(K.softmax(x), ref.softmax(x), torch.float32)
    close(K.sigmoid(x), torch.sigmoid(x), torch.float32)
    close(K.silu(x), torch.nn.functional.silu(x), torch.float32)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope(backend, interleaved):
    x = torch.randn(6, 3, 32, generator=_g(9))
    pos = torch.tensor([0, 1, 17, 255, 4096, 70000])
    inv = K.rope_inv_freq(32, 10000.0)
    close(K.rope(x, pos, inv, interleaved), ref.rope(x, pos, inv, interleaved), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_attention(backend, dtype):
    g = _g(10)
    t, h, r, p, s = 5, 4, 40, 8, 70
    ql, qr = torch.randn(t, h, r, generator=g).to(dtype), torch.randn(t, h, p, generator=g).to(dtype)
    kv, kr = torch.randn(s, r, generator=g).to(dtype), torch.randn(s, p, generator=g).to(dtype)
    lens = [1, 16, 17, 40, 70]
    idx = torch.full((t, 70), -1)
    for i, n in enumerate(lens):
        idx[i, :n] = torch.randperm(s, generator=g)[:n].sort().values
    out = K.mla_attention(ql, qr, kv, kr, idx, 0.1)
    close(out, ref.mla_attention(ql, qr, kv, kr, idx, 0.1), dtype)


def test_indexer_scores(backend):
    g = _g(11)
    q, k, w = torch.randn(4, 3, 16, generator=g), torch.randn(30, 16, generator=g), torch.randn(4, 3, generator=g)
    idx = torch.tensor([[0, 1, 2] + [-1] * 27, list(range(30)), [5, 9] + [-1] * 28, list(range(0, 30, 2)) + [-1] * 15])
    got, want = K.indexer_scores(q, k, w, idx), ref.indexer_scores(q, k, w, idx)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    close(got[finite], want[finite], torch.float32)


def test_moe_matches_dense_per_token_math(backend):
    g = _g(12)
    t, d, i, e, k = 7, 16, 12, 5, 2
    x = torch.randn(t, d, generator=g)
    gate, up, down = (torch.randn(e, i, d, generator=g) * 0.3, torch.randn(e, i, d, generator=g) * 0.3,
                      torch.randn(e, d, i, generator=g) * 0.3)
    w, ids = K.moe_route(torch.randn(t, e, generator=g), torch.zeros(e), k, 1, 1, 1.5)
    got = K.moe_experts(x, w, ids, gate, up, down)
    want = torch.zeros(t, d)
    for row in range(t):
        for j in range(k):
            ex = ids[row, j]
            h = torch.nn.functional.silu(x[row] @ gate[ex].T) * (x[row] @ up[ex].T)
            want[row] += w[row, j] * (h @ down[ex].T)
    close(got, want, torch.float32)


def test_router_matches_deepseek_v3_reference(backend):
    g = _g(13)
    t, e, n_group, topk_group, top_k = 6, 16, 4, 2, 4
    logits, bias = torch.randn(t, e, generator=g), torch.randn(e, generator=g) * 0.1
    w, ids = K.moe_route(logits, bias, top_k, n_group, topk_group, 2.5)
    scores = logits.sigmoid()
    choice = scores + bias
    group = choice.view(t, n_group, -1).topk(2, dim=-1).values.sum(-1)
    gmask = torch.zeros(t, n_group).scatter_(1, group.topk(topk_group, dim=-1).indices, 1.0)
    choice = choice.masked_fill(gmask.repeat_interleave(e // n_group, 1) == 0, float("-inf"))
    want_ids = choice.topk(top_k, dim=-1).indices
    want_w = scores.gather(1, want_ids)
    want_w = want_w / want_w.sum(-1, keepdim=True) * 2.5
    assert torch.equal(ids, want_ids)
    close(w, want_w, torch.float32)
