"""The Triton backward kernels of the glue ops (rms_norm, rope, the SwiGLU product) and the ops
that take them on CUDA (kernels/zerokl/kernels/ops.py `_OWN_GRAD`, split_linear, _swiglu_product).

Accuracy against float64 autograd (tolerance), bitwise run-to-run and per-row invariance
(torch.equal: a row's gradient alone == among neighbours), and the forward's bits unchanged
when the own backward is taken (torch.equal against the recompute path). On a machine
without CUDA the kernels run under the Triton interpreter and the ops' CUDA choice is
forced onto the CPU.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from zerokl.kernels import ops, reference, use_backend
from zerokl.kernels.triton import norms, rotary
from zerokl.kernels.triton.combine import moe_combine_backward, pair_rows_backward
from zerokl.kernels.triton.elementwise import swiglu_backward

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _close(got, want, rel):
    """Max error within rel of the reference's largest magnitude."""
    got, want = got.double().cpu(), want.double().cpu()
    assert (got - want).abs().max().item() <= rel * want.abs().max().item() + 1e-12


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_backward_matches_float64(dtype, rel):
    x, w, g = _randn(37, 96, dtype=dtype), _randn(96, dtype=dtype, seed=1), _randn(37, 96, dtype=dtype, seed=2)
    dx, dw = norms.rms_norm_backward(x, w, g, 1e-5)
    want_dx, want_dw = reference.rms_norm_backward(x, w, g, 1e-5)
    assert dx.dtype == dtype and dw.dtype == dtype and dx.shape == x.shape and dw.shape == w.shape
    _close(dx, want_dx, rel)
    _close(dw, want_dw, rel)


def test_rms_norm_backward_rows_alone_equal_rows_among_neighbours():
    x, w, g = _randn(40, 64, dtype=torch.bfloat16), _randn(64, seed=1), _randn(40, 64, dtype=torch.bfloat16, seed=2)
    dx, dw = norms.rms_norm_backward(x, w, g)
    again = norms.rms_norm_backward(x, w, g)
    assert torch.equal(dx, again[0]) and torch.equal(dw, again[1])
    for rows in (slice(3, 4), slice(17, 33)):      # another batch size, other neighbours and offsets
        assert torch.equal(norms.rms_norm_backward(x[rows], w, g[rows])[0], dx[rows])


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_inverse_is_the_backward(interleaved):
    x, grad = _randn(9, 3, 16), _randn(9, 3, 16, seed=1)
    positions = torch.tensor([0, 1, 2, 5, 9, 100, 1000, 4095, 7], device=DEVICE)
    inv_freq = ops.rope_inv_freq(16, 10000.0).to(DEVICE)
    got = rotary.rope(grad, positions, inv_freq, interleaved, inverse=True)
    _close(got, reference.rope_backward(x, positions, inv_freq, interleaved, grad), 1e-5)
    back = rotary.rope(rotary.rope(x, positions, inv_freq, interleaved), positions, inv_freq, interleaved, inverse=True)
    _close(back, x, 1e-5)


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_swiglu_backward_matches_float64(dtype, rel):
    gate, up, grad = (_randn(13, 40, dtype=dtype, seed=s, scale=3.0) for s in range(3))
    dg, du = swiglu_backward(gate, up, grad)
    want_dg, want_du = reference.swiglu_backward(gate, up, grad)
    assert dg.dtype == du.dtype == dtype
    _close(dg, want_dg, rel)
    _close(du, want_du, rel)
    rows = slice(4, 9)
    assert torch.equal(swiglu_backward(gate[rows], up[rows], grad[rows])[0], dg[rows])


def test_moe_combine_backward_matches_float64_and_is_per_token():
    w = _randn(11, 4, seed=0)
    y, grad = _randn(11, 4, 40, dtype=torch.bfloat16, seed=1), _randn(11, 40, seed=2)
    gw, gy = moe_combine_backward(w, y, grad)
    want_gw, want_gy = reference.moe_combine_backward(w, y, grad)
    assert gw.dtype == torch.float32 and gy.dtype == torch.bfloat16
    _close(gw, want_gw, 1e-5)
    _close(gy, want_gy, 1e-2)
    rows = slice(2, 7)
    alone = moe_combine_backward(w[rows], y[rows], grad[rows])
    assert torch.equal(alone[0], gw[rows]) and torch.equal(alone[1], gy[rows])


def test_pair_rows_backward_sums_each_tokens_pairs():
    k, t = 3, 7
    order = torch.randperm(t * k, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    grad = _randn(t * k, 24, dtype=torch.bfloat16, seed=1)
    dx = pair_rows_backward(grad, order, k)
    _close(dx, reference.pair_rows_backward(grad, order, k), 1e-2)
    assert torch.equal(pair_rows_backward(grad, order, k), dx)
    # a token's gradient reads only its own pairs: other tokens' pair gradients do not enter
    noisy = grad.clone()
    mine = (order // k == 2).nonzero().squeeze(1)            # the rows of grad holding token 2's pairs
    others = torch.ones(t * k, dtype=torch.bool, device=DEVICE)
    others[mine] = False
    noisy[others] = _randn(int(others.sum()), 24, dtype=torch.bfloat16, seed=5)
    assert torch.equal(pair_rows_backward(noisy, order, k)[2], dx[2])


@pytest.fixture
def own_grad_here(monkeypatch):
    """The ops' CUDA choice (their own backward) on this machine's device too."""
    monkeypatch.setattr(ops, "_OWN_GRAD_DEVICES", ("cuda", "cpu"))


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _forward_backward(fn, inputs, grad):
    leaves = _leaves(*inputs)
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, grad)


CASES = {
    # name: (op on leaves, input shapes, output shape)
    "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-5), [(24, 64), (64,)], (24, 64)),
    "rope": (lambda x: ops.rope(x, torch.arange(24, device=DEVICE) * 3, ops.rope_inv_freq(16, 1e4), True),
             [(24, 2, 16)], (24, 2, 16)),
    "split_linear": (lambda x, w: ops.split_linear(x, w), [(24, 64), (32, 64)], (24, 32)),
    "swiglu": (lambda x, g, u: ops.swiglu(x, g, u), [(24, 32), (48, 32), (48, 32)], (24, 48)),
    "moe_combine": (lambda w, y: ops.moe_combine(w, y), [(24, 4), (24, 4, 32)], (24, 32)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_own_backward_keeps_the_forward_bits(name, own_grad_here):
    """The op with its own backward (the CUDA path) returns the same forward bits as with the
    recompute backward and as without gradients, and gradients close to the recompute's."""
    fn, shapes, out_shape = CASES[name]
    inputs = [_randn(*s, dtype=torch.bfloat16, seed=i, scale=0.5) for i, s in enumerate(shapes)]
    grad = _randn(*out_shape, dtype=torch.bfloat16, seed=9)
    with use_backend("triton"):
        out, grads = _forward_backward(fn, inputs, grad)
        with torch.no_grad():
            plain = fn(*inputs)
        ops._OWN_GRAD_DEVICES = ("cuda",) if DEVICE.type == "cpu" else ()
        base_out, base_grads = _forward_backward(fn, inputs, grad)
    assert type(out.grad_fn).__name__ != type(base_out.grad_fn).__name__      # the two paths both ran
    assert torch.equal(out, plain) and torch.equal(out, base_out)
    for got, want in zip(grads, base_grads):
        assert got.dtype == want.dtype
        _close(got, want, 2e-2)
