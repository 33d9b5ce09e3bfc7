"""Tests of the Triton backend (zerokl.kernels.triton).

For every op: accuracy against a plain torch reference (fp64 or torch.nn.functional), and
batch invariance with hypothesis: a row computed alone is torch.equal to the same row inside
batches of random size, position and neighbours, contiguous and not. Exact equality only;
tolerances are for accuracy alone. Plus constructed exact ties for the deterministic top-k.

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1,
which must be set before triton.jit decorates them, hence the top of this file); shapes stay
small so the file runs in well under three minutes on two cores. With CUDA the same tests
run the compiled kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math

import pytest
import torch.nn.functional as F
import zerokl.kernels.triton as zt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zerokl.kernels.triton import _common
from zerokl.kernels.triton import attention as zt_attention
from zerokl.kernels.triton import gemm as zt_linear
from zerokl.kernels.triton import norms as zt_norms
from zerokl.kernels.triton import reductions as zt_softmax
from zerokl.kernels.triton import topk as zt_topk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if DEVICE.type == "cpu" and not _common.is_interpreted(zt_linear._linear_kernel):
    pytest.skip(
        "zerokl.kernels.triton was imported before TRITON_INTERPRET=1 was set; its kernels cannot run on CPU",
        allow_module_level=True,
    )

SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(DEVICE)


def gen_of(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(out, ref, dtype, what=""):
    """Accuracy against a (float64) reference: |out - ref| <= tol * (|ref| + max|ref|/10)."""
    ref = ref.double().cpu()
    out = out.double().cpu()
    tol = TOL[dtype]
    scale = ref[torch.isfinite(ref)].abs().max().item() if torch.isfinite(ref).any() else 1.0
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * max(scale, 1e-30) / 10, equal_nan=True, msg=what or None)


def embed_rows(row: torch.Tensor, m: int, at: int, gen, noncontig: bool) -> torch.Tensor:
    """A batch of m rows [m, *row.shape[1:]] with random neighbours and `row` (shape [1, ...]) at index `at`.

    noncontig: the batch is a strided view (rows of a wider buffer) rather than a contiguous tensor.
    """
    shape = tuple(row.shape[1:])
    if noncontig:
        wide = randn(m, *shape[:-1], shape[-1] + 3, gen=gen, dtype=row.dtype)
        batch = wide[..., 1 : 1 + shape[-1]]
    else:
        batch = randn(m, *shape, gen=gen, dtype=row.dtype)
    batch[at] = row[0]
    return batch


batch_args = {
    "m": st.integers(1, 40),
    "frac": st.floats(0.0, 1.0),
    "seed": st.integers(0, 2**31 - 1),
    "noncontig": st.booleans(),
}


def pos_in(m: int, frac: float) -> int:
    return min(m - 1, int(frac * m))


# ----------------------------------------------------------------------------------- linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 24, 40), (37, 70, 100), (5, 33, 130), (130, 17, 64)])
def test_linear_accuracy(dtype, m, n, k):
    g = gen_of(m * 1000 + n * 10 + k)
    x, w, b = randn(m, k, gen=g, dtype=dtype), randn(n, k, gen=g, dtype=dtype), randn(n, gen=g, dtype=dtype)
    for bias in (None, b):
        y = zt.linear(x, w, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        close(y, ref, dtype, f"linear {dtype} {m}x{n}x{k}")


def test_linear_leading_dims_and_strided_weight():
    g = gen_of(1)
    x = randn(2, 3, 20, gen=g)
    w_t = randn(20, 12, gen=g).t()  # [12, 20], non-contiguous weight
    y = zt.linear(x, w_t)
    assert y.shape == (2, 3, 12)
    close(y, F.linear(x.double(), w_t.double()), torch.float32)


def test_linear_mixed_dtypes():
    g = gen_of(2)
    x = randn(4, 24, gen=g, dtype=torch.bfloat16)
    w = randn(8, 24, gen=g)  # fp32 weight, bf16 activations: computed in fp32, out in x.dtype
    y = zt.linear(x, w)
    assert y.dtype == torch.bfloat16
    close(y, F.linear(x.double(), w.double()), torch.bfloat16)


@SETTINGS
@given(**batch_args, nk=st.sampled_from([(1, 1), (7, 33), (24, 100), (70, 130), (16, 64)]),
       dtype=st.sampled_from(DTYPES), bias=st.booleans(), big_m=st.booleans())
def test_linear_batch_invariance(m, frac, seed, noncontig, nk, dtype, bias, big_m):
    n, k = nk
    g = gen_of(seed)
    if big_m:
        m += 130  # spans several M tiles (BLOCK_M is 64 / 128)
    w = randn(n, k, gen=g, dtype=dtype)
    b = randn(n, gen=g, dtype=dtype) if bias else None
    row = randn(1, k, gen=g, dtype=dtype)
    at = pos_in(m, frac)
    batch = embed_rows(row, m, at, g, noncontig)
    alone = zt.linear(row, w, b)
    assert torch.equal(zt.linear(batch, w, b)[at], alone[0])
    # the same row as a 1-D input and as a strided single-row view
    assert torch.equal(zt.linear(row[0], w, b), alone[0])
    assert torch.equal(zt.linear(batch[at : at + 1], w, b), alone)


def test_linear_config_ignores_m():
    # the tile shape is a function of the weight only
    assert zt_linear.gemm_config(4096, 4096, torch.bfloat16) == zt_linear.gemm_config(4096, 4096, torch.bfloat16)
    cfg = zt_linear.gemm_config(154880, 6144, torch.bfloat16)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) == (128, 128, 64)


# --------------------------------------------------------------------------- grouped_linear


def _grouped_ref(x, w, offsets):
    parts = [F.linear(x[offsets[i] : offsets[i + 1]].double(), w[i].double()) for i in range(w.shape[0])]
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_accuracy(dtype):
    g = gen_of(3)
    sizes = [3, 0, 140, 1, 7]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    x = randn(offsets[-1], 50, gen=g, dtype=dtype)
    w = randn(len(sizes), 20, 50, gen=g, dtype=dtype)
    y = zt.grouped_linear(x, w, offsets)
    assert y.dtype == dtype and y.shape == (offsets[-1], 20)
    close(y, _grouped_ref(x, w, offsets), dtype)


@SETTINGS
@given(sizes=st.lists(st.integers(0, 150), min_size=1, max_size=4), frac=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES), noncontig=st.booleans())
def test_grouped_linear_batch_invariance(sizes, frac, seed, dtype, noncontig):
    """A token's result depends only on itself and its expert's weight, not on how many tokens the expert got."""
    if sum(sizes) == 0:
        sizes[0] = 1
    g = gen_of(seed)
    n_groups, n, k = len(sizes), 24, 72
    w = randn(n_groups, n, k, gen=g, dtype=dtype)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    m = offsets[-1]
    at = pos_in(m, frac)
    grp = max(i for i in range(n_groups) if offsets[i] <= at and sizes[i] > 0)
    row = randn(1, k, gen=g, dtype=dtype)
    batch = embed_rows(row, m, at, g, noncontig)
    alone_offsets = [0] * (grp + 1) + [1] * (n_groups - grp)
    alone = zt.grouped_linear(row, w, alone_offsets)
    assert torch.equal(zt.grouped_linear(batch, w, offsets)[at], alone[0])


@SETTINGS
@given(sizes=st.lists(st.integers(0, 70), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(DTYPES), itype=st.sampled_from([torch.int32, torch.int64]))
def test_grouped_linear_device_offsets_same_bits(sizes, seed, dtype, itype):
    """Offsets as a device tensor (tiles found on the device, grid an upper bound) give the bits of
    the host list, empty groups and all."""
    g = gen_of(seed)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    x = randn(offsets[-1], 40, gen=g, dtype=dtype)
    w = randn(len(sizes), 24, 40, gen=g, dtype=dtype)
    want = zt.grouped_linear(x, w, offsets)
    got = zt.grouped_linear(x, w, torch.tensor(offsets, dtype=itype, device=DEVICE))
    assert torch.equal(got, want)


def _wgrad_ref(dy, x, offsets):
    return torch.stack([dy[a:b].double().T @ x[a:b].double() for a, b in zip(offsets[:-1], offsets[1:])])


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_backward_gemms(dtype):
    """The backward's two grouped GEMMs: dX = grouped_linear(dY, W^T) and dW[g] = dY_g^T X_g
    (empty groups get zeros), accurate against float64 and the same bits on every run."""
    g = gen_of(21)
    sizes = [5, 0, 70, 1, 33]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    m, n, k = offsets[-1], 36, 50
    x = randn(m, k, gen=g, dtype=dtype)
    w = randn(len(sizes), n, k, gen=g, dtype=dtype)
    dy = randn(m, n, gen=g, dtype=dtype)
    offs_t = torch.tensor(offsets, device=DEVICE)
    dw = zt.grouped_linear_wgrad(dy, x, offs_t, out_dtype=torch.float32)
    assert dw.shape == (len(sizes), n, k) and torch.equal(dw[1], torch.zeros(n, k, device=DEVICE))
    close(dw, _wgrad_ref(dy, x, offsets), dtype, "dW")
    assert torch.equal(zt.grouped_linear_wgrad(dy, x, offsets, out_dtype=torch.float32), dw)
    assert torch.equal(zt.grouped_linear_wgrad(dy, x, offs_t, out_dtype=torch.float32), dw)
    assert zt.grouped_linear_wgrad(dy, x, offs_t).dtype == dtype
    dx = zt.grouped_linear(dy, w.transpose(1, 2), offs_t)
    close(dx, _grouped_ref(dy, w.transpose(1, 2), offsets), dtype, "dX")
    with pytest.raises(ValueError, match="rows"):
        zt.grouped_linear_wgrad(dy[1:], x, offsets)


def test_grouped_linear_argument_errors():
    x = torch.zeros(4, 8, device=DEVICE)
    w = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="G \\+ 1"):
        zt.grouped_linear(x, w, [0, 4])
    with pytest.raises(ValueError, match="end at M"):
        zt.grouped_linear(x, w, [0, 2, 3])
    with pytest.raises(ValueError, match="non-decreasing"):
        zt.grouped_linear(x, torch.zeros(3, 3, 8, device=DEVICE), [0, 3, 2, 4])
    with pytest.raises(ValueError):
        zt.grouped_linear(x, torch.zeros(2, 3, 9, device=DEVICE), [0, 2, 4])
    with pytest.raises(ValueError, match="G \\+ 1"):
        zt.grouped_linear(x, w, torch.tensor([0, 4], device=DEVICE))
    with pytest.raises(ValueError, match="int32/int64"):
        zt.grouped_linear(x, w, torch.tensor([0.0, 2.0, 4.0], device=DEVICE))


# ------------------------------------------------------------------------------------ norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_norms_accuracy(dtype, n, monkeypatch):
    g = gen_of(n)
    x = randn(5, n, gen=g, dtype=dtype, scale=3.0)
    w, b = randn(n, gen=g, dtype=dtype), randn(n, gen=g, dtype=dtype)
    for max_block in (zt_norms.NORM_MAX_BLOCK, 32):  # one chunk, then a multi-chunk row walk
        monkeypatch.setattr(zt_norms, "NORM_MAX_BLOCK", max_block)
        y = zt.rms_norm(x, w, 1e-6)
        assert y.dtype == dtype
        close(y, F.rms_norm(x.double(), (n,), w.double(), 1e-6), dtype, "rms_norm")
        y = zt.layer_norm(x, w, b, 1e-5)
        assert y.dtype == dtype
        close(y, F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5), dtype, "layer_norm")


@SETTINGS
@given(**batch_args, n=st.sampled_from([1, 7, 64, 300]), dtype=st.sampled_from(DTYPES))
def test_norms_batch_invariance(m, frac, seed, noncontig, n, dtype):
    g = gen_of(seed)
    w, b = randn(n, gen=g, dtype=dtype), randn(n, gen=g, dtype=dtype)
    row = randn(1, n, gen=g, dtype=dtype, scale=2.0)
    at = pos_in(m, frac)
    batch = embed_rows(row, m, at, g, noncontig)
    assert torch.equal(zt.rms_norm(batch, w)[at], zt.rms_norm(row, w)[0])
    assert torch.equal(zt.layer_norm(batch, w, b)[at], zt.layer_norm(row, w, b)[0])
    assert torch.equal(zt.rms_norm(row[0], w), zt.rms_norm(row, w)[0])


# ------------------------------------------------------------------------ softmax / log_softmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 1000, 5000])
def test_softmax_accuracy(dtype, n, monkeypatch):
    g = gen_of(n + 7)
    x = randn(3, n, gen=g, dtype=dtype, scale=4.0)
    if n > 2:
        x[1, ::3] = float("-inf")  # masked logits
    for max_block in (zt_softmax.SOFTMAX_MAX_BLOCK, 64):
        monkeypatch.setattr(zt_softmax, "SOFTMAX_MAX_BLOCK", max_block)
        s, ls = zt.softmax(x), zt.log_softmax(x)
        assert s.dtype == ls.dtype == torch.float32
        close(s, torch.softmax(x.double(), -1), torch.float32, "softmax")
        ref = torch.log_softmax(x.double(), -1)
        assert torch.equal(torch.isneginf(ls).cpu(), torch.isneginf(ref).cpu())
        close(ls, ref, torch.float32, "log_softmax")
        close(zt.row_sum(x), x.double().sum(-1), torch.float32, "row_sum")


@SETTINGS
@given(**batch_args, n=st.sampled_from([1, 5, 333, 5000]), dtype=st.sampled_from(DTYPES))
def test_softmax_batch_invariance(m, frac, seed, noncontig, n, dtype):
    g = gen_of(seed)
    m = min(m, 6) if n == 5000 else m
    row = randn(1, n, gen=g, dtype=dtype, scale=5.0)
    at = pos_in(m, frac)
    batch = embed_rows(row, m, at, g, noncontig)
    for fn in (zt.softmax, zt.log_softmax, zt.row_sum):
        alone = fn(row)[0]
        assert torch.equal(fn(batch)[at], alone)
        assert torch.equal(fn(row[0]), alone)


# ------------------------------------------------------------------------- sigmoid / silu


@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_accuracy(dtype):
    g = gen_of(11)
    x = randn(3, 5, 37, gen=g, dtype=dtype, scale=6.0)
    for fn, ref in ((zt.sigmoid, torch.sigmoid), (zt.silu, F.silu)):
        y = fn(x)
        assert y.dtype == torch.float32 and y.shape == x.shape
        close(y, ref(x.double()), torch.float32, fn.__name__)
    assert zt.sigmoid(x[0].t()).shape == (37, 5)  # non-contiguous 2-D input


@SETTINGS
@given(**batch_args, n=st.sampled_from([1, 17, 1000, 2500]), dtype=st.sampled_from(DTYPES))
def test_activations_batch_invariance(m, frac, seed, noncontig, n, dtype):
    g = gen_of(seed)
    row = randn(1, n, gen=g, dtype=dtype, scale=8.0)
    at = pos_in(m, frac)
    batch = embed_rows(row, m, at, g, noncontig)
    for fn in (zt.sigmoid, zt.silu):
        alone = fn(row)[0]
        assert torch.equal(fn(batch)[at], alone)
        assert torch.equal(fn(batch[at]), alone)  # the row as a 1-D view into the batch


# ------------------------------------------------------------------------------------ rope


def _rope_ref(x, positions, inv_freq, interleaved):
    ang = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    xd = x.double()
    x1, x2 = (xd[..., 0::2], xd[..., 1::2]) if interleaved else xd.chunk(2, dim=-1)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.stack([r1, r2], -1).flatten(-2) if interleaved else torch.cat([r1, r2], -1)


def _inv_freq(d):
    return (1.0 / (10000.0 ** (torch.arange(0, d // 2, dtype=torch.float32) * 2 / d))).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_accuracy(dtype, interleaved):
    g = gen_of(12)
    t, h, d = 7, 5, 64
    x = randn(t, h, d, gen=g, dtype=dtype)
    pos = torch.tensor([0, 1, 2, 100, 4095, 70000, 3], device=DEVICE)
    y = zt.rope(x, pos, _inv_freq(d), interleaved)
    assert y.dtype == dtype and y.shape == x.shape
    # reference angles rounded like the kernel's (fp32 pos * fp32 inv_freq), then exact math
    ang32 = (pos.float()[:, None] * _inv_freq(d)[None, :]).double()
    cos, sin = torch.cos(ang32)[:, None, :], torch.sin(ang32)[:, None, :]
    xd = x.double()
    x1, x2 = (xd[..., 0::2], xd[..., 1::2]) if interleaved else xd.chunk(2, dim=-1)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    ref = torch.stack([r1, r2], -1).flatten(-2) if interleaved else torch.cat([r1, r2], -1)
    close(y, ref, dtype, "rope")
    # small positions: also against the textbook formula in fp64
    close(y[:3], _rope_ref(x[:3], pos[:3], _inv_freq(d), interleaved), dtype, "rope small positions")


@SETTINGS
@given(**batch_args, hd=st.sampled_from([(1, 2), (4, 16), (8, 64), (20, 32)]), dtype=st.sampled_from(DTYPES),
       interleaved=st.booleans())
def test_rope_batch_invariance(m, frac, seed, noncontig, hd, dtype, interleaved):
    h, d = hd
    g = gen_of(seed)
    row = randn(1, h, d, gen=g, dtype=dtype)
    at = pos_in(m, frac)
    batch = embed_rows(row, m, at, g, noncontig)
    positions = torch.randint(0, 200000, (m,), generator=g).to(DEVICE)
    inv = _inv_freq(d)
    alone = zt.rope(row, positions[at : at + 1], inv, interleaved)
    assert torch.equal(zt.rope(batch, positions, inv, interleaved)[at], alone[0])


# ---------------------------------------------------------------------------- MLA attention


def _attn_ref(ql, qr, kv, kr, key_index, scale):
    out = torch.empty(ql.shape, dtype=torch.float64)
    ql, qr, kv, kr, key_index = (t.cpu() for t in (ql, qr, kv, kr, key_index))
    for t in range(ql.shape[0]):
        idx = key_index[t][key_index[t] >= 0]
        s = (ql[t].double() @ kv[idx].double().T + qr[t].double() @ kr[idx].double().T) * scale
        out[t] = torch.softmax(s, -1) @ kv[idx].double()
    return out


def _key_lists(t, s_len, lens, gen):
    """key_index [t, max(lens)]: ascending random slots, -1 padded."""
    width = max(lens) if lens else 0
    ki = torch.full((t, width), -1, dtype=torch.int64)
    for i, n in enumerate(lens):
        ki[i, :n] = torch.randperm(s_len, generator=gen)[:n].sort().values
    return ki.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_attention_accuracy(dtype):
    g = gen_of(13)
    t, h, r, p, s_len = 6, 8, 64, 16, 300
    ql, qr = randn(t, h, r, gen=g, dtype=dtype), randn(t, h, p, gen=g, dtype=dtype)
    kv, kr = randn(s_len, r, gen=g, dtype=dtype), randn(s_len, p, gen=g, dtype=dtype)
    lens = [1, 31, 32, 33, 100, 250]
    ki = _key_lists(t, s_len, lens, g)
    scale = 1 / math.sqrt(r + p)
    out = zt.mla_attention(ql, qr, kv, kr, ki, scale)
    assert out.dtype == torch.float32 and out.shape == (t, h, r)
    close(out, _attn_ref(ql, qr, kv, kr, ki, scale), dtype, "mla_attention")
    # a hole of -1 inside a list (a whole KV block of padding) is skipped
    holey = ki.clone()
    holey[4, 32:96] = -1  # exactly two whole blocks empty, keys continue after
    close(zt.mla_attention(ql, qr, kv, kr, holey, scale)[4], _attn_ref(ql, qr, kv, kr, holey, scale)[4], dtype)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 8), frac=st.floats(0.0, 1.0),
       own=st.integers(1, 90), dtype=st.sampled_from(DTYPES), h=st.sampled_from([4, 5, 8]))
def test_mla_attention_batch_invariance(seed, t, frac, own, dtype, h):
    """Same query, same key list: equal bits whatever the neighbours' (longer or shorter) lists."""
    g = gen_of(seed)
    r, p, s_len = 32, 16, 200
    kv, kr = randn(s_len, r, gen=g, dtype=dtype), randn(s_len, p, gen=g, dtype=dtype)
    ql, qr = randn(t, h, r, gen=g, dtype=dtype), randn(t, h, p, gen=g, dtype=dtype)
    at = pos_in(t, frac)
    lens = torch.randint(1, 120, (t,), generator=g).tolist()
    lens[at] = own
    ki = _key_lists(t, s_len, lens, g)
    alone_idx = ki[at : at + 1, :own]
    scale = 0.125
    alone = zt.mla_attention(ql[at : at + 1], qr[at : at + 1], kv, kr, alone_idx, scale)
    batch = zt.mla_attention(ql, qr, kv, kr, ki, scale)
    assert torch.equal(batch[at], alone[0])
    # the same query padded with -1 far beyond its list
    padded = torch.cat([alone_idx, torch.full((1, 77), -1, device=DEVICE, dtype=torch.int64)], 1)
    assert torch.equal(zt.mla_attention(ql[at : at + 1], qr[at : at + 1], kv, kr, padded, scale), alone)


def test_mla_attention_blocks_to_visit():
    ki = torch.tensor([[3, 4, -1, -1], [-1, -1, -1, -1], [1, -1, 2, -1]], device=DEVICE)
    assert zt_attention.blocks_to_visit(ki, 2).tolist() == [1, 0, 2]
    assert zt_attention.blocks_to_visit(ki[:, :0], 2).tolist() == [0, 0, 0]


# -------------------------------------------------------------------------- indexer scores


def _indexer_ref(q, k, w, key_index):
    q, k, w, key_index = (t.cpu() for t in (q, k, w, key_index))
    kk = k.double()[key_index.clamp(min=0)]  # [T, L, D]
    s = torch.relu(torch.einsum("thd,tld->thl", q.double(), kk))
    out = torch.einsum("th,thl->tl", w.double(), s)
    return out.masked_fill(key_index < 0, float("-inf"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hi,d", [(4, 32), (8, 200)])
def test_indexer_scores_accuracy(dtype, hi, d):
    g = gen_of(14 + d)
    t, s_len = 5, 300
    q, k = randn(t, hi, d, gen=g, dtype=dtype), randn(s_len, d, gen=g, dtype=dtype)
    w = randn(t, hi, gen=g)
    ki = _key_lists(t, s_len, [1, 64, 65, 130, 7], g)
    out = zt.indexer_scores(q, k, w, ki)
    assert out.dtype == torch.float32 and out.shape == ki.shape
    ref = _indexer_ref(q, k, w, ki)
    assert torch.equal(torch.isneginf(out).cpu(), torch.isneginf(ref))
    close(out, ref, dtype, "indexer_scores")


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 8), frac=st.floats(0.0, 1.0),
       own=st.integers(1, 150), dtype=st.sampled_from(DTYPES), hi=st.sampled_from([4, 8]))
def test_indexer_scores_batch_invariance(seed, t, frac, own, dtype, hi):
    g = gen_of(seed)
    d, s_len = 64, 256
    k = randn(s_len, d, gen=g, dtype=dtype)
    q, w = randn(t, hi, d, gen=g, dtype=dtype), randn(t, hi, gen=g)
    at = pos_in(t, frac)
    lens = torch.randint(1, 200, (t,), generator=g).tolist()
    lens[at] = own
    ki = _key_lists(t, s_len, lens, g)
    alone = zt.indexer_scores(q[at : at + 1], k, w[at : at + 1], ki[at : at + 1, :own])
    batch = zt.indexer_scores(q, k, w, ki)
    assert torch.equal(batch[at, :own], alone[0])
    assert torch.isneginf(batch[at, own:]).all()


# ------------------------------------------------------------------------------------ top-k


def _topk_ref(scores, positions, k):
    out = []
    for srow, prow in zip(scores.cpu().tolist(), positions.cpu().tolist()):
        cand = [(-(s + 0.0), p) for s, p in zip(srow, prow) if not math.isnan(s) and s != float("-inf") and p >= 0]
        chosen = sorted(p for _, p in sorted(cand)[:k])
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out, dtype=torch.int64).reshape(len(out), k)


def _check_topk(scores, positions, k):
    got = zt.topk_positions(scores, positions, k)
    assert got.dtype == torch.int64 and got.shape == (scores.shape[0], k)
    assert torch.equal(got.cpu(), _topk_ref(scores, positions, k))
    return got


def test_topk_constructed_ties():
    pos = torch.arange(12, device=DEVICE).repeat(3, 1) * 10
    s = torch.tensor([
        [1.0, 2.0, 2.0, 2.0, 0.5, 2.0, -1.0, 2.0, 0.0, 3.0, 2.0, 2.0],  # plateau at 2.0: lower positions win
        [0.0, -0.0, 0.0, -0.0, -0.0, 0.0, -1.0, -2.0, 0.0, -0.0, 0.0, -0.0],  # zero plateau, signed zeros equal
        [float("-inf")] * 12,  # nothing valid
    ], device=DEVICE)
    got = _check_topk(s, pos, 4)
    assert got[0].tolist() == [10, 20, 30, 90]
    assert got[1].tolist() == [0, 10, 20, 30]
    assert got[2].tolist() == [-1, -1, -1, -1]


def test_topk_fewer_valid_than_k_and_k_beyond_l():
    s = torch.tensor([[0.5, float("-inf"), 0.25, float("nan"), 7.0]], device=DEVICE)
    pos = torch.tensor([[4, 9, 2, 3, -1]], device=DEVICE)  # position -1 is padding, never selected
    got = _check_topk(s, pos, 3)
    assert got.tolist() == [[2, 4, -1]]
    assert _check_topk(s, pos, 8).tolist() == [[2, 4] + [-1] * 6]
    assert zt.topk_positions(s, pos, 0).shape == (1, 0)


def test_topk_unsorted_positions_and_extremes():
    g = gen_of(15)
    s = torch.tensor([[float("inf"), -3e38, 3e38, -1e-45, 1e-45, 0.0, -0.0, 5.0]], device=DEVICE)
    pos = torch.tensor([[70, 60, 50, 40, 30, 20, 10, 0]], device=DEVICE)
    for k in range(1, 9):
        _check_topk(s, pos, k)
    s = torch.randint(-3, 3, (4, 300), generator=g).float().to(DEVICE)  # heavy ties
    pos = torch.stack([torch.randperm(1000, generator=g)[:300] for _ in range(4)]).to(DEVICE)
    for k in (1, 5, 64, 100):
        _check_topk(s, pos, k)


@pytest.mark.parametrize("max_chunk", [16, 64])
def test_topk_tournament_matches_one_sort(max_chunk, monkeypatch):
    """Rows longer than one chunk go through the per-chunk tournament; same answer as one sort."""
    g = gen_of(16 + max_chunk)
    s = torch.relu(torch.randn(3, 500, generator=g)).to(DEVICE)  # ~half exact zeros
    s[:, ::7] = float("-inf")
    s = torch.where(torch.rand(3, 500, generator=g).to(DEVICE) < 0.1, -s, s)  # some -0.0
    pos = torch.arange(500, device=DEVICE).repeat(3, 1)
    expect = {k: _check_topk(s, pos, k) for k in (1, 3, 8, 40)}
    monkeypatch.setattr(zt_topk, "TOPK_MAX_CHUNK", max_chunk)
    for k, e in expect.items():
        assert torch.equal(zt.topk_positions(s, pos, k), e)
    if DEVICE.type == "cuda":  # compiled kernels: the hand-written bitonic sort instead of tl.sort
        monkeypatch.setattr(zt_topk, "TOPK_USE_TL_SORT", False)
        for k, e in expect.items():
            assert torch.equal(zt.topk_positions(s, pos, k), e)


@pytest.mark.parametrize("block", [16, 1024])
def test_topk_columns_equals_the_sort(block, monkeypatch):
    """positions=None (the radix-select kernel) == positions=arange (the sort), bit for bit: ties
    at the threshold, signed zeros, -inf/NaN, fewer valid than k, k beyond L, rows over several tiles."""
    monkeypatch.setattr(zt_topk, "TOPK_COLUMNS_MIN_BLOCK", block)
    monkeypatch.setattr(zt_topk, "TOPK_COLUMNS_MAX_BLOCK", block)
    g = gen_of(41 + block)
    s = torch.tensor([[float("inf"), -3e38, 3e38, -1e-45, 1e-45, 0.0, -0.0, 5.0, float("nan"), float("-inf")]])
    rows = [s.to(DEVICE)]
    for width in ((1, 33, 100) if block == 16 else (33,)):
        r = torch.randn(5, width, generator=g)
        r[0] = torch.relu(r[0].round())                                   # plateaus of exact zeros
        r[1] = r[1].round()                                               # heavy ties at the threshold
        r[2, ::3] = float("-inf")
        r[3] = torch.where(torch.rand(width, generator=g) < 0.3, -0.0, r[3])
        r[4, ::5] = float("nan")
        rows.append(r.to(DEVICE))
    for r in rows:
        pos = torch.arange(r.shape[1], device=DEVICE).expand(r.shape).contiguous()
        for k in (2, 64, r.shape[1] + 3):
            assert torch.equal(zt.topk_positions(r, None, k), _check_topk(r, pos, k)), (r.shape, k)
    assert zt.topk_positions(rows[1], None, 0).shape == (rows[1].shape[0], 0)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 8), frac=st.floats(0.0, 1.0),
       own=st.integers(1, 200), k=st.integers(1, 70), ties=st.booleans())
def test_topk_batch_invariance(seed, t, frac, own, k, ties):
    g = gen_of(seed)
    width = int(torch.randint(own, own + 100, (1,), generator=g))
    scores = torch.randn(t, width, generator=g)
    if ties:
        scores = torch.relu(scores.round())  # plateaus and zeros
    positions = torch.arange(width).repeat(t, 1)
    at = pos_in(t, frac)
    scores[at, own:] = float("-inf")
    positions[at, own:] = -1
    scores, positions = scores.to(DEVICE), positions.to(DEVICE)
    alone = zt.topk_positions(scores[at : at + 1, :own], positions[at : at + 1, :own], k)
    assert torch.equal(zt.topk_positions(scores, positions, k)[at], alone[0])
    assert torch.equal(alone.cpu(), _topk_ref(scores[at : at + 1, :own], positions[at : at + 1, :own], k))


# ---------------------------------------------------------------------------------- errors


def test_argument_errors():
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="last dim"):
        zt.linear(x, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="float32, bfloat16"):
        zt.linear(x.long(), torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        zt.linear(x, torch.zeros(4, 8, device=DEVICE), torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        zt.rms_norm(x, torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="even"):
        zt.rope(torch.zeros(2, 1, 5, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE),
                torch.zeros(2, device=DEVICE), True)
    with pytest.raises(ValueError, match="key_index"):
        zt.mla_attention(torch.zeros(2, 4, 32, device=DEVICE), torch.zeros(2, 4, 16, device=DEVICE),
                         torch.zeros(9, 32, device=DEVICE), torch.zeros(9, 16, device=DEVICE),
                         torch.zeros(3, 4, dtype=torch.long, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="k must be"):
        zt.topk_positions(x, torch.zeros(3, 8, dtype=torch.long, device=DEVICE), -1)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="slot"):
            zt.indexer_scores(torch.zeros(1, 4, 16), torch.zeros(5, 16), torch.zeros(1, 4),
                              torch.tensor([[0, 5]]))


def test_exports():
    expected = {"linear", "grouped_linear", "rms_norm", "layer_norm", "softmax", "log_softmax", "silu",
                "sigmoid", "rope", "mla_attention", "indexer_scores", "topk_positions"}
    assert expected <= set(zt.__all__)
    assert zt.KV_BLOCK == zt_attention.KV_BLOCK


# ------------------------------------------------------------------- real GLM-5 dims (GPU)


def _topk_ref_torch(scores, positions, k):
    """Vectorized reference for topk_positions (any device)."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores)
    valid = (s > float("-inf")) & (positions >= 0)  # NaN compares false
    s = torch.where(valid, s, torch.full_like(s, float("-inf")))
    by_pos = torch.sort(torch.where(valid, positions, torch.full_like(positions, 2**62)), dim=1, stable=True)
    s_by_pos = torch.gather(s, 1, by_pos.indices)
    order = torch.sort(-s_by_pos, dim=1, stable=True).indices[:, :k]
    chosen = torch.gather(by_pos.values, 1, order)
    chosen_valid = torch.gather(torch.gather(valid, 1, by_pos.indices), 1, order)
    chosen = torch.where(chosen_valid, chosen, torch.full_like(chosen, 2**62)).sort(dim=1).values
    out = torch.where(chosen == 2**62, torch.full_like(chosen, -1), chosen)
    if out.shape[1] < k:
        out = torch.cat([out, out.new_full((out.shape[0], k - out.shape[1]), -1)], 1)
    return out


def test_topk_torch_reference_agrees_with_python_reference():
    g = gen_of(17)
    s = torch.relu(torch.randn(3, 50, generator=g).round())
    s[0, ::5] = float("-inf")
    pos = torch.stack([torch.randperm(80, generator=g)[:50] for _ in range(3)])
    for k in (1, 7, 60):
        assert torch.equal(_topk_ref_torch(s, pos, k), _topk_ref(s, pos, k))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_glm5_dims_on_gpu():
    """Every op at GLM-5 layer dims: launchable, accurate, and a row alone == the row in the batch."""
    g = gen_of(99)
    bf = torch.bfloat16
    rows = [0, 37, 200]

    def invariant(fn, batch, *args):
        full = fn(batch, *args)
        for i in rows:
            if i < batch.shape[0]:
                assert torch.equal(fn(batch[i : i + 1], *args)[0], full[i])
        return full

    for n, k in [(4096, 4096), (2048, 7168), (7168, 2048), (2048, 6144)]:
        x, w = randn(257, k, gen=g, dtype=bf), randn(n, k, gen=g, dtype=bf, scale=k**-0.5)
        y = invariant(zt.linear, x, w)
        close(y, F.linear(x.float(), w.float()), bf, f"linear {n}x{k}")
    x, w = randn(64, 6144, gen=g, dtype=bf), randn(154880, 6144, gen=g, dtype=bf, scale=6144**-0.5)
    logits = invariant(zt.linear, x, w)  # lm head
    close(logits, F.linear(x.float(), w.float()), bf, "lm head")
    del w

    sizes = [0, 300, 1, 17, 64, 0, 5, 2]
    offsets = [0]
    for s_ in sizes:
        offsets.append(offsets[-1] + s_)
    xg, wg = randn(offsets[-1], 6144, gen=g, dtype=bf), randn(8, 2048, 6144, gen=g, dtype=bf, scale=0.0128)
    yg = zt.grouped_linear(xg, wg, offsets)
    close(yg, _grouped_ref(xg, wg, offsets), bf, "grouped_linear")
    assert torch.equal(zt.grouped_linear(xg[300:301], wg, [0, 0, 0] + [1] * 6)[0], yg[300])  # row 300 is group 2
    assert torch.equal(zt.grouped_linear(xg, wg, torch.tensor(offsets, device=DEVICE)), yg)  # device offsets: same bits
    dyg = randn(offsets[-1], 2048, gen=g, dtype=bf)
    close(zt.grouped_linear_wgrad(dyg, xg, offsets, out_dtype=torch.float32), _wgrad_ref(dyg, xg, offsets), bf, "dW")

    lg = logits.float() * 4
    for fn, ref in ((zt.softmax, torch.softmax), (zt.log_softmax, torch.log_softmax)):
        close(invariant(fn, lg), ref(lg.double(), -1), torch.float32, fn.__name__)
    hn = randn(300, 6144, gen=g, dtype=bf, scale=3.0)
    wn, bn = randn(6144, gen=g, dtype=bf), randn(6144, gen=g, dtype=bf)
    close(invariant(zt.rms_norm, hn, wn), F.rms_norm(hn.float(), (6144,), wn.float(), 1e-6), bf, "rms_norm")
    close(invariant(zt.layer_norm, hn, wn, bn), F.layer_norm(hn.float(), (6144,), wn.float(), bn.float(), 1e-6), bf)
    close(invariant(zt.silu, hn), F.silu(hn.double()), torch.float32, "silu")

    xr = randn(300, 64, 64, gen=g, dtype=bf)
    pos = torch.randint(0, 200000, (300,), generator=g).to(DEVICE)
    yr = zt.rope(xr, pos, _inv_freq(64), True)
    assert torch.equal(zt.rope(xr[37:38], pos[37:38], _inv_freq(64), True)[0], yr[37])

    t, h, r, p, s_len = 24, 64, 512, 64, 8192
    ql, qr = randn(t, h, r, gen=g, dtype=bf), randn(t, h, p, gen=g, dtype=bf)
    kv, kr = randn(s_len, r, gen=g, dtype=bf), randn(s_len, p, gen=g, dtype=bf)
    lens = torch.randint(1, 2049, (t,), generator=g).tolist()
    lens[3], lens[5] = 2048, 1
    ki = _key_lists(t, s_len, lens, g)
    scale = (r + p) ** -0.5
    out = zt.mla_attention(ql, qr, kv, kr, ki, scale)
    close(out, _attn_ref(ql, qr, kv, kr, ki, scale), bf, "mla_attention")
    for i in (3, 5, 7):
        alone = zt.mla_attention(ql[i : i + 1], qr[i : i + 1], kv, kr, ki[i : i + 1, : lens[i]], scale)
        assert torch.equal(alone[0], out[i])

    t, hi, d, s_len = 16, 32, 128, 16384
    q, kc, hw = randn(t, hi, d, gen=g, dtype=bf), randn(s_len, d, gen=g, dtype=bf), randn(t, hi, gen=g)
    lens = torch.randint(1, 16385, (t,), generator=g).tolist()
    ki = _key_lists(t, s_len, lens, g)
    sc = zt.indexer_scores(q, kc, hw, ki)
    close(sc, _indexer_ref(q, kc, hw, ki), bf, "indexer_scores")
    i = 4
    assert torch.equal(zt.indexer_scores(q[i : i + 1], kc, hw[i : i + 1], ki[i : i + 1, : lens[i]])[0], sc[i, : lens[i]])

    pos_idx = torch.where(ki >= 0, ki, torch.full_like(ki, -1))
    top = zt.topk_positions(sc, pos_idx, 2048)
    assert torch.equal(top, _topk_ref_torch(sc, pos_idx, 2048))
    assert torch.equal(zt.topk_positions(sc[i : i + 1, : lens[i]], pos_idx[i : i + 1, : lens[i]], 2048)[0], top[i])
    tied = torch.relu(sc.round())  # heavy ties and zero plateaus
    assert torch.equal(zt.topk_positions(tied, pos_idx, 2048), _topk_ref_torch(tied, pos_idx, 2048))
