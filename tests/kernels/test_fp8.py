"""Block-scaled FP8 (NUMERICS.md, "FP8"): the quantization's definition, fp8_linear's accuracy,
and its invariance (a row alone == the row in any batch, a column shard == the full op's
columns), exactly, on the torch backend and on the Triton kernels (interpreted on CPU)."""
import pytest
import torch

import zerokl.kernels as K
from zerokl.kernels import ops, torch_ops
from zerokl.kernels.backend import backend_module
from zerokl.kernels.portable import standard_normal

BACKENDS = ["torch", "triton"]


def _normal(seed, *shape, scale=1.0):
    return standard_normal(shape, torch.Generator().manual_seed(seed)) * scale


def _on(backend, *tensors):
    """The tensors where the backend runs: Triton compiled on a CUDA machine, else the CPU."""
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    moved = tuple(t.to(dev) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def test_rounding_onto_the_e4m3_grid_is_round_to_nearest_even():
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()    # 0 .. 448
    assert torch.equal(torch_ops.round_to_e4m3(grid), grid)                           # grid points stay
    mids = (grid[:-1] + grid[1:]) / 2                                                 # exact in fp32
    even = torch.where(torch.arange(126) % 2 == 0, grid[:-1], grid[1:])               # even code wins a tie
    assert torch.equal(torch_ops.round_to_e4m3(mids), even)
    assert torch.equal(torch_ops.round_to_e4m3(-mids), -even)
    y = torch.tensor([1.0624, 1.0626, 0.001, 0.0009, 447.0, 2.0 ** -10, 2.0 ** -10 * 1.01])
    want = torch.tensor([1.0, 1.125, 2.0 ** -9, 0.0, 448.0, 0.0, 2.0 ** -9])
    assert torch.equal(torch_ops.round_to_e4m3(y), want)
    # the same as torch's own RNE cast wherever both define it (torch keeps -0, we give +0)
    x = _normal(1, 100_000, scale=50.0).clamp(-448, 448)
    assert torch.equal(torch_ops.round_to_e4m3(x), x.to(torch.float8_e4m3fn).float() + 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_quantization(backend):
    x = _normal(2, 5, 300, scale=3.0)
    x[1] = 0.0                                              # an all-zero row: scale 1, values 0
    x[2, :128] *= 1000.0                                    # one loud group does not touch the others
    with K.use_backend(backend):
        q, s = (t.cpu() for t in ops.fp8_quantize(_on(backend, x)))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    assert torch.equal(s[1], torch.ones(3)) and torch.equal(q[1].float(), torch.zeros(300))
    assert q.float().abs().max() == 448.0                   # each group's amax maps to 448
    quiet = x[2:3].clone()
    quiet[0, :128] /= 1000.0
    assert torch.equal(s[2, 1:], torch_ops.fp8_quantize(quiet)[1][0, 1:])
    deq = q.float() * s.repeat_interleave(128, 1)[:, :300]
    assert (deq - x).abs().max() <= (s.repeat_interleave(128, 1)[:, :300] * 16).max()   # half a quantum at 448


def test_weight_quantization_layout_and_accuracy():
    w = _normal(3, 200, 300, scale=0.05)
    q, s = ops.fp8_quantize_weight(w)
    assert q.shape == (200, 300) and q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    deq = ops.fp8_dequantize_weight(q, s)
    rel = ((deq - w).abs() / w.abs().clamp(min=1e-3)).median()
    assert rel < 0.04                                       # 3 mantissa bits: half an ulp is 1/16
    assert torch.equal(ops.fp8_quantize_weight(w)[0].view(torch.uint8), q.view(torch.uint8))


def test_a_stack_of_experts_quantizes_in_slices_as_each_expert_alone(monkeypatch):
    """The reference over a stack [E, N, K]: in slices of whole experts (memory only) when N is a multiple of
    128, one expert at a time otherwise; either way each expert gets the bits it gets alone."""
    for shape in ((5, 256, 384), (3, 130, 200)):
        w = _normal(3, *shape)
        w[1, 10:20] = 0.0                                                           # zero rows inside a block
        alone = [torch_ops.fp8_quantize_weight(x) for x in w]
        monkeypatch.setattr(torch_ops, "QUANTIZE_SLICE_ELEMENTS", 2 * shape[1] * shape[2])   # 2 experts a slice
        q, scale = torch_ops.fp8_quantize_weight(w)
        assert torch.equal(q.view(torch.uint8), torch.stack([a[0] for a in alone]).view(torch.uint8))
        assert torch.equal(scale, torch.stack([a[1] for a in alone]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(200, 300), (3, 256, 200), (2, 130, 140)])
def test_the_weight_quantization_kernel_gives_the_references_bits(shape, dtype):
    """Triton's fp8_quantize_weight (one launch for a whole stack of experts) == torch_ops' definition, byte
    for byte and scale for scale: partial blocks at the edges, an all-zero block (scale 1), a loud value
    that pushes its block's other values into e4m3's subnormals and to zero, bf16 and fp32 weights."""
    w = _normal(7, *shape, scale=0.05).to(dtype)
    w[..., :128, :128] = 0.0
    w[..., 129, 131] = 40.0
    q, s = (t.cpu() for t in backend_module("triton").fp8_quantize_weight(_on("triton", w)))
    want_q, want_s = torch_ops.fp8_quantize_weight(w)
    assert q.shape == w.shape and s.shape == want_s.shape and q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    b = q.view(torch.uint8)
    assert ((b & 0x7F) == 0).any() and (((b & 0x78) == 0) & ((b & 0x07) != 0)).any()     # zeros and subnormals


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_linear_is_accurate(backend):
    x, w, b = _normal(4, 9, 300, scale=2.0), _normal(5, 130, 300, scale=0.05), _normal(6, 130)
    q, s = ops.fp8_quantize_weight(w)
    with K.use_backend(backend):
        y = ops.fp8_linear(*_on(backend, x.to(torch.bfloat16), q, s, b), out_dtype=torch.float32).cpu()
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert (y.double() - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_row_alone_equals_row_in_any_batch(backend, dtype):
    w = _normal(7, 256, 272, scale=0.05)
    q, s = ops.fp8_quantize_weight(w)
    row, q, s = _on(backend, _normal(8, 1, 272, scale=4.0).to(dtype), q, s)
    with K.use_backend(backend):
        alone = ops.fp8_linear(row, q, s)
        for m, at, seed in [(2, 1, 9), (17, 0, 10), (33, 20, 11), (40, 39, 12), (300, 150, 13)]:
            batch = _on(backend, _normal(seed, m, 272, scale=float(seed)).to(dtype))   # neighbours of other magnitudes
            batch[at] = row[0]
            assert torch.equal(ops.fp8_linear(batch, q, s)[at], alone[0]), (m, at)


@pytest.mark.skipif(torch.cuda.is_available(), reason="compiled, the block dot is the tensor cores' (another key)")
def test_the_interpreted_kernel_computes_the_torch_backends_bits():
    x, w = _normal(13, 21, 300, scale=2.0).to(torch.bfloat16), _normal(14, 130, 300, scale=0.05)
    q, s = ops.fp8_quantize_weight(w)
    with K.use_backend("torch"):
        want = ops.fp8_linear(x, q, s, out_dtype=torch.float32), ops.fp8_quantize(x)
    with K.use_backend("triton"):
        got = ops.fp8_linear(x, q, s, out_dtype=torch.float32), ops.fp8_quantize(x)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1][0].view(torch.uint8), want[1][0].view(torch.uint8)) and torch.equal(got[1][1], want[1][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_column_shard_computes_the_full_ops_columns(backend):
    """Tensor parallelism: a shard of 128-row weight blocks gives exactly those columns."""
    x, w = _normal(15, 6, 256), _normal(16, 384, 256, scale=0.05)
    x, (q, s) = _on(backend, x), _on(backend, *ops.fp8_quantize_weight(w))
    with K.use_backend(backend):
        full = ops.fp8_linear(x, q, s)
        shard = ops.fp8_linear(x, q[128:256], s[1:2])
    assert torch.equal(shard, full[:, 128:256])


def test_bad_fp8_arguments_are_refused_by_name():
    q, s = ops.fp8_quantize_weight(_normal(17, 130, 300))
    x = _normal(18, 2, 300)
    with pytest.raises(ValueError, match="weight_scale must be float32 \\[2, 3\\]"):
        ops.fp8_linear(x, q, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ops.fp8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match="K=299"):
        ops.fp8_linear(x[:, :299], q, s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_experts_a_tokens_result_is_its_own_whatever_its_expert_received(backend):
    """Grouped FP8 (MoE): a row's output equals fp8_linear with its group's weight, for any group
    sizes (empty groups too) and with host or device offsets."""
    w = _normal(19, 3, 130, 200, scale=0.05)
    parts = [ops.fp8_quantize_weight(w[g]) for g in range(3)]
    weight = ops.Fp8Weight(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    weight = ops.Fp8Weight(*_on(backend, weight.data, weight.scale))
    x = _on(backend, _normal(20, 37, 200, scale=3.0).to(torch.bfloat16))
    with K.use_backend(backend):
        for offsets in ([0, 5, 5, 37], [0, 0, 30, 37], _on(backend, torch.tensor([0, 17, 18, 37]))):
            out = ops.grouped_linear(x, weight, offsets)
            bounds = offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets
            for g in range(3):
                rows = slice(bounds[g], bounds[g + 1])
                if bounds[g + 1] > bounds[g]:
                    assert torch.equal(out[rows], ops.fp8_linear(x[rows], *weight[g]))
            group = next(g for g in range(3) if bounds[g] <= 20 < bounds[g + 1])
            alone = [0] * (group + 1) + [1] * (3 - group)                  # row 20 alone in its group
            assert torch.equal(ops.grouped_linear(x[20:21], weight, alone), out[20:21])


@pytest.mark.parametrize("backend,own_grad_on_cpu", [("torch", False), ("triton", False), ("triton", True)])
def test_the_straight_through_gradient_is_the_model_dtype_ops_on_the_master(backend, own_grad_on_cpu, monkeypatch):
    """Training on the FP8 forward: the backward of linear, split_partial (row-parallel) and
    grouped_linear (experts) through an Fp8Weight with a master is exactly the gradient the bf16
    op gives on the master (on CUDA by the op's own backward GEMMs, without its forward;
    ``own_grad_on_cpu`` takes that path on the CPU too, so CI runs its wiring)."""
    if own_grad_on_cpu:
        monkeypatch.setattr(ops, "_OWN_GRAD_DEVICES", ("cuda", "cpu"))
    def grads(op, x, weight, master):
        x = x.detach().requires_grad_(True)
        master.grad = None
        out = op(x, weight)
        out.backward(torch.ones_like(out) * _on(backend, torch.linspace(-1, 1, out.shape[-1])).to(out.dtype))
        return x.grad, master.grad

    w = _normal(21, 3, 256, 512, scale=0.05).to(torch.bfloat16)
    q, s = zip(*(ops.fp8_quantize_weight(w[g].float()) for g in range(3)))
    x = _on(backend, _normal(22, 19, 512).to(torch.bfloat16))
    master = _on(backend, w).requires_grad_(True)
    stacked = ops.Fp8Weight(*_on(backend, torch.stack(q), torch.stack(s)), master)
    with K.use_backend(backend):
        cases = [(lambda x, w: ops.linear(x, w), stacked[0], lambda x, m: ops.linear(x, m[0])),
                 (lambda x, w: ops.split_partial(x, w, 4), stacked[1], lambda x, m: ops.split_partial(x, m[1], 4)),
                 (lambda x, w: ops.grouped_linear(x, w, [0, 7, 7, 19]), stacked,
                  lambda x, m: ops.grouped_linear(x, m, [0, 7, 7, 19]))]
        for fp8_op, weight, reference in cases:
            got = grads(fp8_op, x, weight, master)
            want = grads(reference, x, master, master)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
