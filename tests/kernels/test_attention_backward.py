"""The fused Triton MLA attention backward (kernels/zerokl/kernels/triton/attention_backward.py).

Accuracy against a float64 autograd reference (tolerance), bitwise run-to-run, and batch
invariance (torch.equal: a sequence's gradients alone == among neighbours). On a machine
without CUDA the kernels run under the Triton interpreter at small shapes; the gpu tests
use GLM-5's latent widths.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from zerokl.kernels import ops, use_backend
from zerokl.kernels.triton import attention as zt_attention
from zerokl.kernels.triton.attention_backward import mla_attention_backward, mla_attention_backward_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _packed(lens, h, r, p, dtype, seed):
    """Sequences of `lens` tokens packed from position 0 (the training layout)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    positions = torch.cat([torch.arange(n) for n in lens])
    x = [torch.randn(*shape, generator=g) for shape in ((t, h, r), (t, h, p), (t, r), (t, p), (t, h, r))]
    ql, qr, kv, kr = (v.to(dtype).to(DEVICE) for v in x[:4])
    return ql, qr, kv, kr, positions.to(DEVICE), x[4].to(DEVICE)


def _causal(positions):
    t = positions.shape[0]
    width = int(positions.max()) + 1
    cols = torch.arange(width, device=positions.device)
    start = (torch.arange(t, device=positions.device) - positions).view(-1, 1)
    return torch.where(cols <= positions.view(-1, 1), start + cols, torch.full_like(start + cols, -1))


def _sparse(positions, k, seed):
    """A random ascending selection of <= k keys per row among its causal prefix (always itself)."""
    g = torch.Generator().manual_seed(seed)
    pos = positions.cpu()
    sel = torch.full((pos.shape[0], k), -1, dtype=torch.int64)
    for t, p in enumerate(pos.tolist()):
        keep = torch.randperm(p, generator=g)[: k - 1].tolist() + [p]
        sel[t, : len(keep)] = torch.tensor(sorted(keep)) + (t - p)
    return sel.to(positions.device)


def _backward(ql, qr, kv, kr, key_index, positions, grad, scale):
    if key_index is None:
        out, lse = zt_attention.mla_attention_sequences(ql, qr, kv, kr, positions, scale, return_lse=True)
    else:
        out, lse = zt_attention.mla_attention(ql, qr, kv, kr, key_index, scale, return_lse=True)
    return mla_attention_backward(ql, qr, kv, kr, key_index, positions, out, lse, grad, scale)


def _close(got, want, dtype):
    """Max error within tol of the reference's scale, and the relative norm error under
    1e-5 (fp32) / 1e-2 (bf16 operands; a bf16 pipeline lands near 3e-3)."""
    tol, rel = (2e-5, 1e-5) if dtype == torch.float32 else (3e-2, 1e-2)
    for name, a, b in zip(("dq_latent", "dq_rope", "dkv_latent", "dk_rope"), got, want):
        assert a.dtype == dtype, name
        err = (a.double() - b).abs().max().item()
        assert err <= tol * (1 + b.abs().max().item()), f"{name}: max error {err}"
        assert (a.double() - b).norm().item() <= rel * b.norm().item(), f"{name}: relative norm error"


LENS = [13, 7, 20]
SHAPE = dict(h=3, r=24, p=8)
SCALE = 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["causal", "explicit", "sparse"])
def test_backward_matches_float64_reference(layout, dtype):
    ql, qr, kv, kr, pos, grad = _packed(LENS, **SHAPE, dtype=dtype, seed=1)
    full = _causal(pos)
    key_index = {"causal": None, "explicit": full, "sparse": _sparse(pos, 6, seed=2)}[layout]
    got = _backward(ql, qr, kv, kr, key_index, pos, grad, SCALE)
    want = mla_attention_backward_reference(ql, qr, kv, kr, full if key_index is None else key_index, grad, SCALE)
    _close(got, want, dtype)


@pytest.mark.parametrize("block_k,rows,block_h", [(4, 16, 16), (32, 32, 16), (16, 128, 32)])
@pytest.mark.parametrize("layout", ["causal", "sparse"])
def test_backward_configs_compute_the_same_function(layout, block_k, rows, block_h):
    """Other program shapes change the summation order, never the function."""
    ql, qr, kv, kr, pos, grad = _packed(LENS, **SHAPE, dtype=torch.float32, seed=14)
    sel = None if layout == "causal" else _sparse(pos, 6, seed=15)
    out, lse = zt_attention.mla_attention_sequences(ql, qr, kv, kr, pos, SCALE, sel, return_lse=True)
    got = mla_attention_backward(ql, qr, kv, kr, sel, pos, out, lse, grad, SCALE,
                                 block_k=block_k, rows=rows, block_h=block_h)
    _close(got, mla_attention_backward_reference(ql, qr, kv, kr, _causal(pos) if sel is None else sel, grad, SCALE),
           torch.float32)


def test_a_short_row_that_skips_a_key_is_not_taken_for_its_causal_prefix():
    """Rows whose list is their whole causal prefix go through the key blocks, the others by
    (query, key) parts: a row within the list's width that leaves a key out must take the second."""
    ql, qr, kv, kr, pos, grad = _packed(LENS, **SHAPE, dtype=torch.float32, seed=18)
    sel = _sparse(pos, 6, seed=19)
    row = 13 + 4                                       # second sequence, position 4: keys 13..17
    sel[row] = torch.tensor([13, 15, 16, 17, -1, -1], device=sel.device)
    out, lse = zt_attention.mla_attention_sequences(ql, qr, kv, kr, pos, SCALE, sel, return_lse=True)
    got = mla_attention_backward(ql, qr, kv, kr, sel, pos, out, lse, grad, SCALE)
    _close(got, mla_attention_backward_reference(ql, qr, kv, kr, sel, grad, SCALE), torch.float32)


def test_key_list_gradients_do_not_depend_on_the_chunking():
    """A key list's dkv parts are made and summed in chunks of queries (memory only): any chunk
    size gives the same bits (one running sum per key, ascending queries)."""
    ql, qr, kv, kr, pos, grad = _packed(LENS, **SHAPE, dtype=torch.bfloat16, seed=16)
    sel = _sparse(pos, 6, seed=17)
    out, lse = zt_attention.mla_attention_sequences(ql, qr, kv, kr, pos, SCALE, sel, return_lse=True)
    runs = [mla_attention_backward(ql, qr, kv, kr, sel, pos, out, lse, grad, SCALE, dkv_chunk=c) for c in (None, 1, 7)]
    assert all(torch.equal(x, y) for run in runs[1:] for x, y in zip(runs[0], run))


def test_backward_over_a_cache_layout():
    """No positions: slots are arbitrary cache rows (key blocks by slot), sparse and holey lists."""
    g = torch.Generator().manual_seed(3)
    t, s, h, r, p = 9, 40, 2, 20, 8
    ql, qr = torch.randn(t, h, r, generator=g), torch.randn(t, h, p, generator=g)
    kv, kr = torch.randn(s, r, generator=g), torch.randn(s, p, generator=g)
    idx = torch.full((t, 12), -1, dtype=torch.int64)
    for i in range(t):
        n = 1 + i
        idx[i, :n] = torch.randperm(s, generator=g)[:n].sort().values
    idx[2, 0] = -1                                                    # a hole before valid keys
    grad = torch.randn(t, h, r, generator=g)
    args = [x.to(DEVICE) for x in (ql, qr, kv, kr, idx, grad)]
    got = _backward(*args[:5], None, args[5], SCALE)
    _close(got, mla_attention_backward_reference(*args[:5], args[5], SCALE), torch.float32)


@pytest.mark.parametrize("layout", ["causal", "sparse"])
def test_backward_is_bitwise_deterministic(layout):
    ql, qr, kv, kr, pos, grad = _packed(LENS, **SHAPE, dtype=torch.float32, seed=4)
    key_index = None if layout == "causal" else _sparse(pos, 6, seed=5)
    a = _backward(ql, qr, kv, kr, key_index, pos, grad, SCALE)
    b = _backward(ql, qr, kv, kr, key_index, pos, grad, SCALE)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["causal", "sparse"])
def test_a_sequences_gradients_do_not_depend_on_its_neighbours(layout):
    """Sequence B alone vs packed between A and C (other lengths, other offsets): its dq rows
    and the dkv / dk_rope rows of its keys are bitwise equal."""
    ql, qr, kv, kr, pos, grad = _packed([11, 19, 6], **SHAPE, dtype=torch.float32, seed=6)
    sel = None if layout == "causal" else _sparse(pos, 5, seed=7)
    b = slice(11, 30)
    together = _backward(ql, qr, kv, kr, sel, pos, grad, SCALE)
    alone_sel = None if sel is None else torch.where(sel[b] >= 0, sel[b] - 11, sel[b])
    alone = _backward(ql[b], qr[b], kv[b], kr[b], alone_sel, pos[b], grad[b], SCALE)
    for name, x, y in zip(("dq_latent", "dq_rope", "dkv_latent", "dk_rope"), together, alone):
        assert torch.equal(x[b], y), name
    fwd = zt_attention.mla_attention_sequences(ql, qr, kv, kr, pos, SCALE, sel, return_lse=True)
    fwd_alone = zt_attention.mla_attention_sequences(ql[b], qr[b], kv[b], kr[b], pos[b], SCALE, alone_sel, return_lse=True)
    assert all(torch.equal(x[b], y) for x, y in zip(fwd, fwd_alone))


def test_forward_lse_and_causal_layout_keep_the_forward_bits():
    ql, qr, kv, kr, pos, _ = _packed(LENS, **SHAPE, dtype=torch.float32, seed=8)
    full = _causal(pos)
    plain = zt_attention.mla_attention(ql, qr, kv, kr, full, SCALE)
    out, lse = zt_attention.mla_attention(ql, qr, kv, kr, full, SCALE, return_lse=True)
    causal, lse2 = zt_attention.mla_attention_sequences(ql, qr, kv, kr, pos, SCALE, return_lse=True)
    assert torch.equal(out, plain) and torch.equal(causal, plain) and torch.equal(lse, lse2)
    s = torch.einsum("thr,tlr->thl", ql.double(), kv.double()[full.clamp(min=0)]) \
        + torch.einsum("thp,tlp->thl", qr.double(), kr.double()[full.clamp(min=0)])
    want = torch.logsumexp((s * SCALE).masked_fill(~(full >= 0).unsqueeze(1), float("-inf")), -1)
    assert torch.allclose(lse.double(), want, atol=1e-5)


def test_ops_autograd_uses_the_fused_backward():
    """ops.mla_attention / mla_attention_sequences under the Triton backend: forward bits are the
    no-grad forward's, gradients are the fused kernel's (equal to calling it directly)."""
    ql, qr, kv, kr, pos, grad = _packed(LENS, **SHAPE, dtype=torch.float32, seed=9)
    sel = _sparse(pos, 6, seed=10)
    for key_index in (None, sel):
        leaves = [x.clone().requires_grad_() for x in (ql, qr, kv, kr)]
        with use_backend("triton"):
            if key_index is None:
                out = ops.mla_attention_sequences(*leaves, pos, SCALE)
                plain = ops.mla_attention_sequences(ql, qr, kv, kr, pos, SCALE)
            else:
                out = ops.mla_attention(*leaves, key_index, SCALE)
                plain = ops.mla_attention(ql, qr, kv, kr, key_index, SCALE)
            out.backward(grad)
        assert torch.equal(out.detach(), plain)
        direct = _backward(ql, qr, kv, kr, key_index, None if key_index is not None else pos, grad, SCALE)
        assert all(torch.equal(leaf.grad, d) for leaf, d in zip(leaves, direct))


@pytest.mark.parametrize("backend", ["torch", "stock"])
def test_torch_backends_training_layout_equals_explicit_list(backend):
    ql, qr, kv, kr, pos, _ = _packed(LENS, **SHAPE, dtype=torch.float32, seed=11)
    with use_backend(backend):
        assert torch.equal(ops.mla_attention_sequences(ql, qr, kv, kr, pos, SCALE),
                           ops.mla_attention(ql, qr, kv, kr, _causal(pos), SCALE))


# ------------------------------------------------------------------ GPU: GLM-5 latent widths


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["causal", "sparse"])
def test_gpu_glm5_widths_bf16(layout):
    """H = 16, R = 512, P = 64 in bf16: accuracy, run-to-run bits, neighbour invariance."""
    lens = [300, 77, 160]
    ql, qr, kv, kr, pos, grad = _packed(lens, h=16, r=512, p=64, dtype=torch.bfloat16, seed=12)
    sel = None if layout == "causal" else _sparse(pos, 64, seed=13)
    scale = 192 ** -0.5
    got = _backward(ql, qr, kv, kr, sel, pos, grad, scale)
    want = mla_attention_backward_reference(ql, qr, kv, kr, _causal(pos) if sel is None else sel, grad, scale)
    _close(got, want, torch.bfloat16)
    again = _backward(ql, qr, kv, kr, sel, pos, grad, scale)
    assert all(torch.equal(x, y) for x, y in zip(got, again))
    b = slice(300, 377)
    alone_sel = None if sel is None else torch.where(sel[b] >= 0, sel[b] - 300, sel[b])
    alone = _backward(ql[b], qr[b], kv[b], kr[b], alone_sel, pos[b], grad[b], scale)
    assert all(torch.equal(x[b], y) for x, y in zip(got, alone))
