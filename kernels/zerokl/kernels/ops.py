"""The public ops of the numerics library, dispatched to the active backend.

Every op here is part of zerokl's numerical definition (NUMERICS.md states each
one). Elementary ops (GEMMs, norms, softmax, RoPE, attention, indexer scores)
come from the backend; composite ops (top-k selection, MoE routing and expert
combine) are written once here on top of them, so both backends share the
composite's order of operations.

Autograd: the torch backend is differentiable as written. A Triton forward is
wrapped so that its backward recomputes the same function with the torch backend
and differentiates that: gradients are deterministic, forward bits are Triton's.
On CUDA, linear, grouped_linear, split_linear, rms_norm, rope, the SwiGLU product and the MoE
combine and pair gather take their own backward instead (GEMMs and one Triton kernel each: no
recompute, no fp32 copies of the glue); mla_attention has its own fused Triton backward
(kernels/zerokl/kernels/triton/attention_backward.py).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, NamedTuple

import torch

from zerokl.kernels import torch_ops
from zerokl.kernels.backend import backend_module, get_backend
from zerokl.kernels.fp8_format import FP8_BLOCK, FP8_MAX, fp8_dequantize_weight
from zerokl.kernels.portable import exp64, log64

__all__ = [
    "REDUCTION_SPLITS",
    "linear",
    "split_linear",
    "split_partial",
    "split_combine",
    "tree_sum",
    "grouped_linear",
    "rms_norm",
    "layer_norm",
    "softmax",
    "log_softmax",
    "sigmoid",
    "silu",
    "rope",
    "rope_inv_freq",
    "mla_attention",
    "mla_attention_sequences",
    "indexer_scores",
    "topk_positions",
    "moe_route",
    "moe_experts",
    "moe_expert_outputs",
    "moe_combine",
    "swiglu",
    "swiglu_mlp",
    "FP8_BLOCK",
    "FP8_MAX",
    "Fp8Weight",
    "fp8_quantize",
    "fp8_quantize_weight",
    "fp8_dequantize_weight",
    "fp8_linear",
    "one_cpu_thread",
]

# Row-parallel projections (attention o_proj, MLP down_proj) reduce over K in this many
# equal contiguous segments, each summed in fp32 and joined by a fixed pairwise tree
# (split_linear). A numerics constant: changing it changes bits. Tensor parallelism
# over a row-parallel layer works for any power-of-two TP degree that divides it.
REDUCTION_SPLITS = 4


class _RecomputeGrad(torch.autograd.Function):
    """Forward with `fast`, backward by differentiating `slow` (same math, torch backend)."""

    @staticmethod
    def forward(ctx, fast: Callable, slow: Callable, spec: tuple, *tensors: torch.Tensor):
        ctx.slow, ctx.spec = slow, spec
        ctx.save_for_backward(*tensors)
        return fast(*_merge(spec, tensors))

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.slow(*_merge(ctx.spec, inputs))
        wrt = [t for t in inputs if t.requires_grad]
        got = iter(torch.autograd.grad(out, wrt, grads, allow_unused=True)) if wrt else iter(())
        return (None, None, None) + tuple(next(got) if t.requires_grad else None for t in inputs)


def _grad_backend(tensors) -> str:
    """The backend whose autograd gives a Triton op's backward: the torch backend on CPU
    (one thread, deterministic); plain torch ("stock") on CUDA, where the torch backend's
    16-row tiles would cost thousands of launches. Both are deterministic for a given batch;
    gradients are not promised batch-invariant (NUMERICS.md)."""
    return "stock" if any(t.device.type == "cuda" for t in tensors) else "torch"


class _LinearGrad(torch.autograd.Function):
    """Triton linear forward; backward by the two GEMMs of y = x W^T + b (no recompute).

    grad_x = g @ W and grad_W = g^T @ x in the operands' dtype with fp32 accumulation (what
    plain torch autograd computes), grad_b = column sums of g in fp32, through torch.mm
    (deterministic per shape). CUDA only; on CPU linear keeps the torch-backend recompute.
    """

    @staticmethod
    def forward(ctx, fast, x, weight, bias=None, out_dtype=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return fast(x, weight, bias) if out_dtype is None else fast(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw = _linear_grads(grad, x, weight, *ctx.needs_input_grad[1:3])
        gb = None
        if ctx.has_bias and ctx.needs_input_grad[3]:
            gb = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)
        return None, gx, gw, gb, None


def _linear_grads(grad, x, weight, want_x: bool, want_w: bool):
    """(grad_x, grad_W) of y = x W^T: g @ W and g^T @ x in the operands' dtype, fp32 accumulation
    (torch.mm); None where not wanted. grad [..., N], x [..., K], weight [N, K]."""
    g2 = grad.reshape(-1, grad.shape[-1])
    gx = (g2.to(weight.dtype) @ weight).to(x.dtype).reshape(x.shape) if want_x else None
    gw = (g2.t().to(x.dtype) @ x.reshape(-1, x.shape[-1])).to(weight.dtype) if want_w else None
    return gx, gw


class _GroupedLinearGrad(torch.autograd.Function):
    """Triton grouped_linear forward; backward by grouped GEMMs (dropless, no per-group loop).

    dX = grouped_linear(dY, W^T): each row's dY times its group's weight; dW[g] = dY_g^T X_g
    (grouped_linear_wgrad: one program per output tile walks the group's rows in a fixed order,
    no atomics), so gradients are the same bits on every run. Offsets may be a device tensor:
    the backward makes no host sync either.
    """

    @staticmethod
    def forward(ctx, fast, x, weight, offsets):
        off_t = offsets if isinstance(offsets, torch.Tensor) else None
        ctx.save_for_backward(x, weight, off_t)
        ctx.offsets = None if off_t is not None else offsets
        return fast(x, weight, offsets)

    @staticmethod
    def backward(ctx, grad):
        x, weight, off_t = ctx.saved_tensors
        offsets = off_t if off_t is not None else ctx.offsets
        return (None, *_grouped_linear_grads(grad, x, weight, offsets, *ctx.needs_input_grad[1:3]), None)


def _grouped_linear_grads(grad, x, weight, offsets, want_x: bool, want_w: bool):
    """(grad_x, grad_W) of grouped_linear by the Triton grouped GEMMs; None where not wanted."""
    tri = backend_module("triton")
    gx = tri.grouped_linear(grad.to(x.dtype), weight.transpose(1, 2), offsets) if want_x else None
    gw = tri.grouped_linear_wgrad(grad.to(x.dtype), x, offsets, out_dtype=weight.dtype) if want_w else None
    return gx, gw


class _RMSNormGrad(torch.autograd.Function):
    """Triton rms_norm forward; backward by one Triton kernel (triton.rms_norm_backward: grad_x per
    row, grad_weight from fixed per-program fp32 partials), rows up to NORM_MAX_BLOCK wide."""

    @staticmethod
    def forward(ctx, fast, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return fast(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw = backend_module("triton").rms_norm_backward(x, weight, grad, ctx.eps)
        return None, gx, gw, None

    @staticmethod
    def applies(x, weight, eps) -> bool:
        from zerokl.kernels.triton.norms import NORM_MAX_BLOCK
        return x.shape[-1] <= NORM_MAX_BLOCK


class _RopeGrad(torch.autograd.Function):
    """Triton rope forward; backward by the same kernel rotating the gradient back (inverse=True):
    a rotation's gradient is the transposed rotation."""

    @staticmethod
    def forward(ctx, fast, x, positions, inv_freq, interleaved):
        ctx.save_for_backward(positions, inv_freq)
        ctx.interleaved = interleaved
        return fast(x, positions, inv_freq, interleaved)

    @staticmethod
    def backward(ctx, grad):
        positions, inv_freq = ctx.saved_tensors
        return None, backend_module("triton").rope(grad, positions, inv_freq, ctx.interleaved, inverse=True), None, \
            None, None


# Device types on which a Triton op with its own backward (linear: two torch.mm; grouped_linear:
# grouped Triton GEMMs; rms_norm, rope: one Triton kernel) uses it; elsewhere the backward
# recomputes with the torch backend. An entry's `applies(*args)`, where it has one, can decline.
_OWN_GRAD_DEVICES = ("cuda",)
_OWN_GRAD = {"linear": _LinearGrad, "grouped_linear": _GroupedLinearGrad, "rms_norm": _RMSNormGrad,
             "rope": _RopeGrad}


def _merge(spec: tuple, tensors) -> list:
    """Rebuild the positional argument list: spec holds non-tensor args, None marks a tensor slot."""
    it = iter(tensors)
    return [next(it) if s is _TENSOR else s for s in spec]


_TENSOR = object()


def _call(name: str, *args):
    """Run op `name` on the active backend, keeping autograd when the backend is Triton."""
    backend = get_backend()
    fast = getattr(backend_module(backend), name)
    if backend == "torch":
        return _single_threaded(fast, args)
    if backend == "stock":
        return fast(*args)                    # plain torch: differentiable as it is
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return fast(*args)
    own = _OWN_GRAD.get(name)
    if own is not None and _own_grad_applies(*tensors) and getattr(own, "applies", lambda *a: True)(*args):
        return own.apply(fast, *args)
    slow = getattr(backend_module(_grad_backend(tensors)), name)
    spec = tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
    return _RecomputeGrad.apply(fast, slow, spec, *tensors)


_ONE_THREAD = threading.RLock()


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Run the body on one intra-op CPU thread (torch.set_num_threads(1)), then restore the count.

    The torch backend's forward bits do not need it (every sum is exact, kernels/zerokl/kernels/portable.py),
    but a training step's gradients go through plain torch GEMMs and sums, whose bits follow MKL's
    thread split: every torch-backend op runs under it, and so does the trainer's backward, which
    keeps a training step's gradients independent of the machine's core count. The lock keeps
    concurrent callers from restoring the count under each other; nesting is free.
    """
    with _ONE_THREAD:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def _single_threaded(fn: Callable, args: tuple):
    """fn(*args) under one_cpu_thread when any argument is a CPU tensor."""
    if not any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
        return fn(*args)
    with one_cpu_thread():
        return fn(*args)


# ---------------------------------------------------------------- elementary ops

class Fp8Weight(NamedTuple):
    """A block-scaled FP8 weight as the GEMM ops take it in place of a tensor (NUMERICS.md, "FP8"):
    data [..., N, K] float8_e4m3fn and scale [..., ceil(N/128), ceil(K/128)] fp32, w ~= data * scale.
    linear, split_linear and grouped_linear (so swiglu, the MLPs and the MoE experts) accept it.

    master: the trainer's weight that data and scale were quantized from. When a gradient is
    needed the op's forward is still the FP8 product (the bits the replicas compute) and its
    backward is the model-dtype op's on the master (straight-through: quantization counts as
    the identity)."""

    data: torch.Tensor
    scale: torch.Tensor
    master: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def __getitem__(self, g: int) -> "Fp8Weight":   # group g of a stacked [G, N, K] weight
        return Fp8Weight(self.data[g], self.scale[g], None if self.master is None else self.master[g])

    def trains(self, input: torch.Tensor) -> bool:
        """A gradient is wanted through this weight's product (its master, or the input)."""
        return self.master is not None and _needs_grad(input, self.master)


class _Fp8StraightThrough(torch.autograd.Function):
    """forward: the FP8 product (no graph); backward: the gradient of `reference(x, master)`, the
    model-dtype op on the master weight.

    ``grads(grad, x, master, want_x, want_w)``, where given, is that gradient's own formula (the
    op's backward GEMMs, the bits the reference's autograd gives, without its forward); otherwise
    the reference is recomputed and differentiated (its forward paid again)."""

    @staticmethod
    def forward(ctx, fp8_product, reference, grads, x, master):
        ctx.reference, ctx.grads = reference, grads
        ctx.save_for_backward(x, master)
        with torch.no_grad():
            return fp8_product(x.detach())

    @staticmethod
    def backward(ctx, grad):
        x, master = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[3:]
        if ctx.grads is not None:
            return (None, None, None, *ctx.grads(grad, x, master, want_x, want_w))
        wrt = [t.detach().requires_grad_(need) for t, need in zip((x, master), (want_x, want_w))]
        with torch.enable_grad():
            out = ctx.reference(*wrt)
        want = [t for t in wrt if t.requires_grad]
        got = iter(torch.autograd.grad(out, want, grad)) if want else iter(())
        return (None, None, None) + tuple(next(got) if t.requires_grad else None for t in wrt)


def _own_grad_applies(*tensors: torch.Tensor) -> bool:
    """Whether the model-dtype op on these tensors takes its own backward (_OWN_GRAD), as _call decides."""
    return get_backend() == "triton" and any(t.device.type in _OWN_GRAD_DEVICES for t in tensors)


def _split_grads(splits: int):
    """split_partial's gradient formula: its segments' linear gradients (the tree passes the
    gradient to every segment unchanged), grad_x and grad_W put together along K."""
    def grads(grad, x, weight, want_x, want_w):
        seg = x.shape[-1] // splits
        parts = [_linear_grads(grad, x[..., i:i + seg], weight[:, i:i + seg], want_x, want_w)
                 for i in range(0, x.shape[-1], seg)]
        return (torch.cat([p[0] for p in parts], -1) if want_x else None,
                torch.cat([p[1] for p in parts], -1) if want_w else None)
    return grads


def linear(input: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = input @ weight.T + bias with weight [N, K]; fp32 accumulation, K order fixed by weight's K.

    The result is rounded to out_dtype (default input.dtype); out_dtype=torch.float32 returns
    the fp32 accumulator itself. An output column's bits never depend on M or N, so a column
    shard of the weight computes exactly the matching columns (column parallelism). An
    Fp8Weight runs fp8_linear.
    """
    if isinstance(weight, Fp8Weight):
        if weight.trains(input):
            own = _linear_grads if _own_grad_applies(input, weight.master) else None
            return _Fp8StraightThrough.apply(lambda x: fp8_linear(x, weight.data, weight.scale, bias, out_dtype),
                                             lambda x, w: linear(x, w, bias, out_dtype), own, input, weight.master)
        return fp8_linear(input, weight.data, weight.scale, bias, out_dtype)
    if input.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: input has K={input.shape[-1]} but weight is {tuple(weight.shape)}")
    if out_dtype not in (None, input.dtype, torch.float32):
        raise ValueError(f"linear: out_dtype must be input's dtype or torch.float32, got {out_dtype}")
    if out_dtype is None or out_dtype == input.dtype:
        return _call("linear", input, weight, bias)
    return _call("linear", input, weight, bias, out_dtype)


def _check_splits(splits: int) -> None:
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Fixed pairwise tree: adjacent pairs summed level by level, ((p0+p1)+(p2+p3)) for four.

    For a power-of-two count, the sum over a contiguous aligned half is a subtree, so
    tree_sum([tree_sum(a), tree_sum(b)]) == tree_sum(a + b) bit for bit: what lets each
    tensor-parallel rank pre-reduce its own segments.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("tree_sum of nothing")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def split_partial(input: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """fp32 tree sum of `splits` segment products: K is cut into `splits` equal contiguous
    segments, each `linear(..., out_dtype=float32)` (no rounding), joined by tree_sum.

    A tensor-parallel rank calls this on its own K shard with splits = REDUCTION_SPLITS / tp.
    """
    _check_splits(splits)
    k = input.shape[-1]
    if isinstance(weight, Fp8Weight):
        if weight.trains(input):
            own = _split_grads(splits) if _own_grad_applies(input, weight.master) and k % splits == 0 else None
            return _Fp8StraightThrough.apply(lambda x: _fp8_split_partial(x, weight, splits),
                                             lambda x, w: split_partial(x, w, splits), own, input, weight.master)
        return _fp8_split_partial(input, weight, splits)
    if k % splits:
        raise ValueError(f"split_linear: K={k} is not divisible into {splits} equal segments")
    if weight.shape[-1] != k:
        raise ValueError(f"split_linear: input has K={k} but weight is {tuple(weight.shape)}")
    fused = _fused_split(input, weight)
    if fused is not None:
        return fused(input, weight, splits)
    seg = k // splits
    # Views, not copies: neither backend's bits depend on the layout (the torch backend's sums
    # are exact; Triton kernels read any strides with the same loads).
    return tree_sum([linear(input[..., i:i + seg], weight[:, i:i + seg], out_dtype=torch.float32)
                     for i in range(0, k, seg)])


def _fused_split(input: torch.Tensor, weight: torch.Tensor):
    """The Triton backend's two-launch split_partial when no gradient is needed (the same bits
    as the per-segment composite: each segment is linear's K order, then the same tree)."""
    if get_backend() != "triton" or _needs_grad(input, weight):
        return None
    return backend_module("triton").split_partial


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def split_combine(partials: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Join fp32 partials (rank order) with tree_sum, add the bias, round to `dtype`."""
    total = tree_sum(partials)
    if bias is not None:
        total = total + bias.float()
    return total.to(dtype)


def split_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 splits: int = REDUCTION_SPLITS) -> torch.Tensor:
    """linear with the canonical split-tree K reduction of row-parallel layers.

    K is cut into `splits` equal contiguous segments; each segment's product is accumulated
    in fp32 (linear's own fixed order) and kept in fp32; the partials are summed by a fixed
    pairwise tree ((p0+p1)+(p2+p3)); the bias is added after; the result is rounded to
    input.dtype. A TP rank holding 1/tp of K computes its subtree and the ranks' subtrees
    are joined by the same tree, so any tp dividing `splits` gives these exact bits.
    """
    if bias is None and not isinstance(weight, Fp8Weight):
        if _needs_grad(input, weight) and _own_grad_applies(input, weight):
            _check_split_shapes(input, weight, splits)
            return _SplitLinearGrad.apply(input, weight, splits)
        fused = _fused_split(input, weight)
        if fused is not None:
            _check_split_shapes(input, weight, splits)
            return fused(input, weight, splits, input.dtype)      # tree and rounding in one pass
    return split_combine([split_partial(input, weight, splits)], bias, input.dtype)


def _check_split_shapes(input: torch.Tensor, weight: torch.Tensor, splits: int) -> None:
    _check_splits(splits)
    if input.shape[-1] % splits or weight.shape[-1] != input.shape[-1]:
        raise ValueError(f"split_linear: K={input.shape[-1]} (weight {tuple(weight.shape)}) is not divisible "
                         f"into {splits} equal segments")


class _SplitLinearGrad(torch.autograd.Function):
    """split_linear (no bias) forward by the Triton two-launch split (the composite's bits); backward
    by linear's two GEMMs over the whole K: the tree passes the gradient to every segment
    unchanged, so grad_x and grad_W are y = x W^T's. Not one GEMM pair, a zero-filled gradient
    and an fp32 cast per segment, as differentiating the composite would give."""

    @staticmethod
    def forward(ctx, x, weight, splits):
        ctx.save_for_backward(x, weight)
        return backend_module("triton").split_partial(x, weight, splits, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*_linear_grads(grad, x, weight, *ctx.needs_input_grad[:2]), None)


def grouped_linear(input: torch.Tensor, weight: torch.Tensor | Fp8Weight, offsets: list[int] | torch.Tensor) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of input [M, K] times weight[g].T, weight [G, N, K] -> [M, N].

    offsets: G + 1 non-decreasing ints from 0 to M, a list or an int32/int64 tensor on input's
    device. The Triton backend never reads a tensor back on the host (no sync, CUDA-graph
    capturable), so only its shape is checked here: its values are the caller's promise.
    An Fp8Weight runs each row through fp8_linear's product with its group's weight (Triton: one
    grouped launch from the device offsets; torch backend: per group).
    """
    if isinstance(weight, Fp8Weight):
        product = lambda x: _fp8_call("fp8_grouped_linear", x, weight.data, weight.scale, offsets)  # noqa: E731
        if weight.trains(input):
            own = ((lambda g, x, w, want_x, want_w: _grouped_linear_grads(g, x, w, offsets, want_x, want_w))
                   if _own_grad_applies(input, weight.master) else None)
            return _Fp8StraightThrough.apply(product, lambda x, w: grouped_linear(x, w, offsets), own, input,
                                             weight.master)
        if _needs_grad(input):
            raise ValueError("fp8 grouped_linear has no gradient without a master weight (Fp8Weight.master)")
        return product(input)
    if isinstance(offsets, torch.Tensor):
        if offsets.dim() != 1 or offsets.shape[0] != weight.shape[0] + 1 or offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"grouped_linear: offsets tensor {offsets.dtype} {tuple(offsets.shape)} is not int [G + 1] "
                             f"for {weight.shape[0]} groups")
        return _call("grouped_linear", input, weight, offsets)
    if len(offsets) != weight.shape[0] + 1 or offsets[0] != 0 or offsets[-1] != input.shape[0]:
        raise ValueError(f"grouped_linear: offsets {offsets} do not cover {input.shape[0]} rows in {weight.shape[0]} groups")
    return _call("grouped_linear", input, weight, list(offsets))


def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim in fp32; output in input.dtype."""
    return _call("rms_norm", input, weight, float(eps))


def layer_norm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm over the last dim in fp32 (the indexer's k_norm); output in input.dtype."""
    return _call("layer_norm", input, weight, bias, float(eps))


def softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over the last dim, fp32 output."""
    _last_dim_only("softmax", input, dim)
    return _call("softmax", input)


def log_softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax over the last dim, fp32 output."""
    _last_dim_only("log_softmax", input, dim)
    return _call("log_softmax", input)


def sigmoid(input: torch.Tensor) -> torch.Tensor:
    """Element-wise sigmoid in fp32."""
    return _call("sigmoid", input)


def silu(input: torch.Tensor) -> torch.Tensor:
    """Element-wise SiLU in fp32."""
    return _call("silu", input)


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """inv_freq[i] = theta ** (-2i / dim) as fp32: exp(-(2i/dim) ln theta) evaluated in float64 from
    IEEE basic operations (kernels/zerokl/kernels/portable.py) and rounded once, so these constants are the same on
    every machine (libm's and torch's pow are dispatched by ISA)."""
    ln_theta = log64(torch.tensor([float(theta)], dtype=torch.float64))
    exponents = torch.tensor([-2.0 * i / dim for i in range(dim // 2)], dtype=torch.float64)
    return exp64(exponents * ln_theta).to(torch.float32)


def rope(input: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotary embedding of input [T, H, D] at integer positions [T]; output in input.dtype."""
    if input.dim() != 3 or input.shape[-1] != 2 * inv_freq.numel() or positions.shape != input.shape[:1]:
        raise ValueError(f"rope: input {tuple(input.shape)}, positions {tuple(positions.shape)}, inv_freq {inv_freq.numel()}")
    return _call("rope", input, positions, inv_freq.to(input.device), bool(interleaved))


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    key_index: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA attention; see NUMERICS.md. Shapes: q_latent [T, H, R], q_rope [T, H, P],
    kv_latent [S, R], k_rope [S, P], key_index [T, L] (ascending slots, -1 padded) -> [T, H, R] fp32."""
    t, h, r = q_latent.shape
    if q_rope.shape[:2] != (t, h) or kv_latent.shape[-1] != r or k_rope.shape[-1] != q_rope.shape[-1] \
            or key_index.shape[0] != t or kv_latent.shape[0] != k_rope.shape[0]:
        raise ValueError("mla_attention: inconsistent shapes "
                         f"{tuple(q_latent.shape)} {tuple(q_rope.shape)} {tuple(kv_latent.shape)} "
                         f"{tuple(k_rope.shape)} {tuple(key_index.shape)}")
    if get_backend() == "triton" and _needs_grad(q_latent, q_rope, kv_latent, k_rope):
        return _MLAttentionGrad.apply(q_latent, q_rope, kv_latent, k_rope, key_index, None, float(scale))
    return _call("mla_attention", q_latent, q_rope, kv_latent, k_rope, key_index, float(scale))


def mla_attention_sequences(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    selection: torch.Tensor | None = None,
) -> torch.Tensor:
    """mla_attention in the training layout, with no [T, L] key table: the keys are the T query
    tokens (kv_latent [T, R], k_rope [T, P]), sequences packed contiguously from position 0
    (positions [T]). Without `selection` each query attends its causal prefix; with
    `selection` [T, K] (ascending token slots, -1 padded) that list. Same bits as
    mla_attention over the explicit list."""
    _check_sequences(q_latent, q_rope, kv_latent, k_rope, positions, selection)
    if get_backend() == "triton" and _needs_grad(q_latent, q_rope, kv_latent, k_rope):
        return _MLAttentionGrad.apply(q_latent, q_rope, kv_latent, k_rope, selection, positions, float(scale))
    if selection is None:
        return _call("mla_attention_sequences", q_latent, q_rope, kv_latent, k_rope, positions, float(scale))
    return _call("mla_attention_sequences", q_latent, q_rope, kv_latent, k_rope, positions, float(scale), selection)


def _check_sequences(q_latent, q_rope, kv_latent, k_rope, positions, selection) -> None:
    """mla_attention_sequences' argument checks, the only ones: every backend assumes them."""
    op = "mla_attention_sequences"
    floats = (q_latent, q_rope, kv_latent, k_rope)
    if [x.dim() for x in floats] != [3, 3, 2, 2]:
        raise ValueError(f"{op}: q_latent, q_rope must be [T, H, R], [T, H, P] and kv_latent, k_rope [T, R], [T, P], "
                         f"got {[tuple(x.shape) for x in floats]}")
    t, h, r = q_latent.shape
    p = q_rope.shape[2]
    if q_rope.shape[:2] != (t, h) or tuple(kv_latent.shape) != (t, r) or tuple(k_rope.shape) != (t, p):
        raise ValueError(f"{op}: q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, kv_latent "
                         f"{tuple(kv_latent.shape)}, k_rope {tuple(k_rope.shape)}: the keys are the T query tokens")
    dtypes = {x.dtype for x in floats}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        raise ValueError(f"{op}: q_latent, q_rope, kv_latent and k_rope must share one dtype (float32, bfloat16 "
                         f"or float16), got {[x.dtype for x in floats]}")
    for name, x, ndim in (("positions", positions, 1), ("selection", selection, 2)):
        if x is not None and (x.dtype not in (torch.int32, torch.int64) or x.dim() != ndim or x.shape[0] != t):
            raise ValueError(f"{op}: {name} must be int32/int64 with {ndim} dim(s) and T = {t} rows, "
                             f"got {x.dtype} {tuple(x.shape)}")
    # Sequences are packed from position 0, so position <= token index (not checked on CUDA: a sync).
    if selection is None and positions.device.type != "cuda" and t \
            and bool((positions > torch.arange(t, device=positions.device)).any()):
        raise ValueError(f"{op}: a position exceeds its token index (sequences must start at position 0)")


class _MLAttentionGrad(torch.autograd.Function):
    """Triton mla_attention forward (writing its log-sum-exp) with the fused Triton backward
    (kernels/zerokl/kernels/triton/attention_backward.py) over the same key list: deterministic, no atomics.
    key_index None = the causal training layout over `positions`."""

    @staticmethod
    def forward(ctx, q_latent, q_rope, kv_latent, k_rope, key_index, positions, scale):
        from zerokl.kernels.triton import attention
        if positions is None:
            out, lse = attention.mla_attention(q_latent, q_rope, kv_latent, k_rope, key_index, scale, return_lse=True)
        else:
            out, lse = attention.mla_attention_sequences(q_latent, q_rope, kv_latent, k_rope, positions, scale,
                                                         key_index, return_lse=True)
        ctx.save_for_backward(q_latent, q_rope, kv_latent, k_rope, key_index, positions, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        from zerokl.kernels.triton.attention_backward import mla_attention_backward
        q_latent, q_rope, kv_latent, k_rope, key_index, positions, out, lse = ctx.saved_tensors
        grads = mla_attention_backward(q_latent, q_rope, kv_latent, k_rope, key_index, positions, out, lse,
                                       grad, ctx.scale)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None)


def indexer_scores(q: torch.Tensor, k_cache: torch.Tensor, head_weights: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    """DSA lightning-indexer scores [T, L] in fp32 (-inf at padding); see NUMERICS.md."""
    return _call("indexer_scores", q, k_cache, head_weights, key_index)


def _last_dim_only(name: str, x: torch.Tensor, dim: int) -> None:
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"{name}: only the last dim is supported (got dim={dim})")


# ---------------------------------------------------------------- composite ops

def _canonical(x: torch.Tensor) -> torch.Tensor:
    """fp32 with -0.0 turned into +0.0, so ordering never tells the two zeros apart."""
    return x.float() + 0.0


def _rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """Indices that order each row by score descending, ties to the LOWER index (stable sort)."""
    return torch.sort(_canonical(scores), dim=-1, descending=True, stable=True).indices


def topk_positions(scores: torch.Tensor, positions: torch.Tensor | None, k: int) -> torch.Tensor:
    """The k highest-scoring positions of each row, returned ascending.

    scores [T, L] fp32 with -inf at invalid entries; positions [T, L] int64, or None for
    "the column index" (the same answer as arange(L) in every row; the Triton backend then
    selects without sorting). Ties go to the
    lower position and -0.0 equals +0.0, so the order is total and the selected set is
    the same on every backend; -inf and NaN scores and negative positions are never
    selected. Returns [T, k] int64 (a width independent of L, so a row's result never
    depends on its neighbours' lengths), -1 padded at the end of a row.
    """
    return _call("topk_positions", scores, positions, int(k))


def moe_route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with correction bias and group-limited top-k (DeepSeek-V3 'noaux_tc').

    logits [T, E] fp32 -> (weights [T, top_k] fp32, expert_ids [T, top_k] int64), both in
    selection-rank order. The bias steers selection only; weights come from the unbiased
    sigmoid scores. Every tie goes to the lower group / expert index.
    """
    t, e = logits.shape
    scores = sigmoid(logits.float())
    choice = _canonical(scores.detach() + correction_bias.float())
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        top2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
        group_score = top2[..., 0] + top2[..., 1]                      # [T, n_group]
        keep = _rank_desc(group_score)[:, :topk_group]
        group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(2).expand(t, n_group, e // n_group).reshape(t, e)   # (no sync, unlike repeat_interleave)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    expert_ids = _rank_desc(choice)[:, :top_k]
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (_sum_columns(weights) + 1e-20).unsqueeze(1)
    return weights * route_scale, expert_ids


def _sum_columns(x: torch.Tensor) -> torch.Tensor:
    """Left-to-right sum over the (few) columns of x [T, k]: a fixed order on every backend."""
    total = x[:, 0]
    for j in range(1, x.shape[1]):
        total = total + x[:, j]
    return total


def swiglu(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor) -> torch.Tensor:
    """The SwiGLU hidden state silu(gate(x)) * up(x), formed in fp32 and rounded to x.dtype
    (element-wise per hidden unit, so a column shard of gate/up gives the matching units)."""
    return _swiglu_product(linear(x, gate_proj), linear(x, up_proj))


def _swiglu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) in fp32, rounded to gate.dtype: the SwiGLU hidden state of the dense MLP,
    the shared and the routed experts. On CUDA under Triton its backward is one kernel."""
    if _needs_grad(gate, up) and _own_grad_applies(gate, up):
        return _SwigluGrad.apply(gate, up)
    return _swiglu_hidden(gate, up)


def _swiglu_hidden(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (silu(gate) * up.float()).to(gate.dtype)


class _SwigluGrad(torch.autograd.Function):
    """_swiglu_product's forward as composed (the same op calls, so the same bits); backward by
    triton.swiglu_backward from the saved gate and up (model dtype: no fp32 intermediates kept)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        with torch.no_grad():
            return _swiglu_hidden(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return backend_module("triton").swiglu_backward(gate, up, grad)


def swiglu_mlp(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """down(swiglu(x)); down_proj is row-parallel under TP, so it uses split_linear."""
    return split_linear(swiglu(x, gate_proj, up_proj), down_proj)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Dropless routed SwiGLU experts with a fixed-order combine.

    x [T, D]; weights, expert_ids [T, k]; gate_proj/up_proj [E, I, D]; down_proj [E, D, I].
    (token, slot) pairs are sorted by expert (stable) and run through grouped GEMMs, so an
    expert's result for a token does not depend on how many tokens it received. The k
    results are combined in selection-rank order in fp32. Returns [T, D] fp32.

    No host sync: every pair is routed here, so the pair order, the per-expert offsets and the
    grouped GEMMs' tiles are all computed on the device (a decode step can be graph-captured).
    """
    t, k = expert_ids.shape
    outputs = _all_pairs_outputs(x, expert_ids, gate_proj, up_proj, down_proj)
    return moe_combine(weights, outputs.view(t, k, -1))         # every pair is here, in (token, slot) order


def moe_expert_outputs(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    first_expert: int = 0,
    num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert outputs of the (token, slot) pairs routed to the experts held here.

    gate_proj/up_proj [E_here, I, D] and down_proj [E_here, D, I] are experts first_expert ..
    first_expert + E_here - 1: all of them on one device, an expert-parallel rank's share
    under TP. Returns (pairs [P] int64, outputs [P, D] in x.dtype): the flat pair indices
    t * k + slot in ascending order, and their outputs. Pairs are stably sorted by expert
    and run through grouped GEMMs, so a pair's result depends only on its token and its
    expert's weights (never on how many tokens the expert or the rank received).

    num_experts: the model's expert count. When the experts here are all of them
    (first_expert == 0 and E_here == num_experts) every pair is here and no host sync is made;
    otherwise finding the local pairs reads their count P back to the host (one sync).
    """
    n_here = gate_proj.shape[0]
    t, k = expert_ids.shape
    if first_expert == 0 and num_experts == n_here:
        pairs = torch.arange(t * k, device=expert_ids.device)
        return pairs, _all_pairs_outputs(x, expert_ids, gate_proj, up_proj, down_proj)
    flat = expert_ids.reshape(-1) - first_expert
    pairs = torch.nonzero((flat >= 0) & (flat < n_here)).squeeze(1)     # ascending (token, slot) pairs: the sync
    local = flat[pairs]
    order, offsets = _expert_order(local, n_here)
    return pairs, _expert_mlp(x[pairs[order] // k], order, offsets, gate_proj, up_proj, down_proj)


def _all_pairs_outputs(x, expert_ids, gate_proj, up_proj, down_proj) -> torch.Tensor:
    """Outputs [T * k, D] of every (token, slot) pair, in pair order, with no host sync."""
    k = expert_ids.shape[1]
    order, offsets = _expert_order(expert_ids.reshape(-1), gate_proj.shape[0])
    return _expert_mlp(_PairRows.apply(x, order, k), order, offsets, gate_proj, up_proj, down_proj)


def _expert_order(local: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert: (order [P], offsets [E + 1] int64), both on the device.

    order is a stable sort of the pairs by expert index; offsets[e] counts the pairs whose expert
    is below e (a binary search over the sorted indices: no counts read back, no atomics).
    """
    sorted_ids, order = torch.sort(local, stable=True)
    bounds = torch.arange(n_experts + 1, device=local.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, bounds)


def _expert_mlp(xs, order, offsets, gate_proj, up_proj, down_proj) -> torch.Tensor:
    """The SwiGLU experts over rows xs [P, D] sorted by expert (offsets), returned in pair order."""
    h = _swiglu_product(grouped_linear(xs, gate_proj, offsets), grouped_linear(xs, up_proj, offsets))
    out_sorted = grouped_linear(h, down_proj, offsets)                   # [P, D], expert order
    return torch.empty_like(out_sorted).index_copy(0, order, out_sorted)   # back to pair order (a permutation)


class _PairRows(torch.autograd.Function):
    """xs = x[order // k]: the token row of each (token, slot) pair, pairs taken in `order`.

    The backward puts each pair's gradient back in (token, slot) order and sums a token's k
    slots left to right in fp32: a fixed order (plain indexing would accumulate duplicates
    with atomics, whose order varies run to run on CUDA).
    """

    @staticmethod
    def forward(ctx, x, order, k):
        ctx.save_for_backward(order)
        ctx.k = k
        return x[order // k]

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        if _own_grad_applies(grad):
            return backend_module("triton").pair_rows_backward(grad, order, ctx.k), None, None
        per_pair = torch.empty_like(grad).index_copy_(0, order, grad).view(-1, ctx.k, grad.shape[-1]).float()
        total = per_pair[:, 0]
        for j in range(1, ctx.k):
            total = total + per_pair[:, j]
        return total.to(grad.dtype), None, None


def moe_combine(weights: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """sum_j w[:, j] * y[:, j] in fp32, left to right in selection-rank order. [T, k], [T, k, D] -> [T, D]."""
    if _needs_grad(weights, outputs) and _own_grad_applies(weights, outputs):
        return _CombineGrad.apply(weights, outputs)
    return _combine(weights, outputs)


class _CombineGrad(torch.autograd.Function):
    """moe_combine's forward as composed (the same bits); backward by triton.moe_combine_backward
    (one pass over the [T, k, D] outputs, kept in their dtype: no fp32 copy saved, no per-slot
    zero-filled gradient)."""

    @staticmethod
    def forward(ctx, weights, outputs):
        ctx.save_for_backward(weights, outputs)
        with torch.no_grad():
            return _combine(weights, outputs)

    @staticmethod
    def backward(ctx, grad):
        weights, outputs = ctx.saved_tensors
        return backend_module("triton").moe_combine_backward(weights, outputs, grad)


def _combine(weights: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    out = outputs.float()
    w = weights.float()
    total = w[:, 0:1] * out[:, 0]
    for j in range(1, out.shape[1]):
        total = total + w[:, j:j + 1] * out[:, j]
    return total


# ---------------------------------------------------------------- FP8 (block-scaled e4m3)

# FP8_BLOCK (channels per activation scale; one weight scale per 128 x 128 block) and FP8_MAX (448,
# the largest e4m3 value) come from fp8_format, shared with both backends.


def fp8_quantize(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (q [M, K] float8_e4m3fn, scale [M, ceil(K/128)] fp32): per row and
    128-channel group, s = amax / 448 (1 for an all-zero group), q = the nearest e4m3 value to
    clamp(x / s, +-448), ties to even.
    A row's values depend only on the row."""
    if input.dim() != 2:
        raise ValueError(f"fp8_quantize: input must be [M, K], got {tuple(input.shape)}")
    return backend_module().fp8_quantize(input)


def fp8_quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (q [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] fp32), one scale
    per 128 x 128 block: s = amax / 448 (1 for an all-zero block), q = the nearest e4m3 value to
    clamp(w / s, +-448), ties to even (torch_ops.round_to_e4m3). A stack of experts [E, N, K] gives
    each expert's (q [E, N, K], scale [E, ceil(N/128), ceil(K/128)]), every expert exactly as alone.

    The layout of DeepSeek-V3 / GLM-5-FP8 checkpoints (`weight_scale_inv` is `scale`: w ~= q * s).
    Every step is exact or correctly rounded (max, IEEE division, the e4m3 cast), so every backend
    and device gives the same bits: the trainer quantizing its fp32 masters on the GPU and a
    converter quantizing a checkpoint on the CPU agree (tests/kernels/test_fp8.py).
    """
    if weight.dim() not in (2, 3):
        raise ValueError(f"fp8_quantize_weight: weight must be [N, K] or [E, N, K], got {tuple(weight.shape)}")
    # The same bits on every backend: off CUDA the reference (a checkpoint on the host, under the interpreter).
    return (backend_module() if weight.device.type == "cuda" else torch_ops).fp8_quantize_weight(weight)


def fp8_linear(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = fp8_quantize(input) @ (weight * weight_scale).T (+ bias) by the block-scaled definition.

    input [..., K] fp32/bf16; weight [N, K] float8_e4m3fn; weight_scale [ceil(N/128), ceil(K/128)]
    fp32. For the K blocks b in ascending order: acc += dot_b(q_x[m], q_w[n]) * (s_x[m, b] *
    s_w[n // 128, b]) in fp32, the block dot in fp32 (NUMERICS.md, "FP8"). An element depends
    only on its row of input and its column of weight. No autograd: the trainer's FP8 forward
    differentiates its bf16 path (straight-through).
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"fp8_linear: weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if input.shape[-1] != k:
        raise ValueError(f"fp8_linear: input has K={input.shape[-1]} but weight is {tuple(weight.shape)}")
    want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != want:
        raise ValueError(f"fp8_linear: weight_scale must be float32 {list(want)}, got {weight_scale.dtype} "
                         f"{list(weight_scale.shape)}")
    if _needs_grad(input) or (bias is not None and _needs_grad(bias)):
        raise ValueError("fp8_linear has no gradient: a trainer's FP8 forward passes its master weight "
                         "(ops.Fp8Weight.master) and differentiates the model-dtype op (straight-through)")
    return _fp8_call("fp8_linear", input, weight, weight_scale, bias, out_dtype)


def _fp8_call(name: str, *args):
    fn = getattr(backend_module(), name)
    return _single_threaded(fn, args) if get_backend() == "torch" else fn(*args)


def _fp8_split_partial(input: torch.Tensor, weight: Fp8Weight, splits: int) -> torch.Tensor:
    """split_partial of an FP8 weight: the row is quantized once over all of K; segment s is the
    block-scaled sum over K blocks [s KB / splits, (s + 1) KB / splits) (floors; a segment may
    hold none, a zero partial) in fp32, and the segments are joined by tree_sum."""
    k = input.shape[-1]
    if weight.shape[-1] != k:
        raise ValueError(f"split_linear: input has K={k} but weight is {tuple(weight.shape)}")
    lead = input.shape[:-1]
    q, sx = fp8_quantize(input.reshape(-1, k))
    kb = sx.shape[1]
    parts = []
    for s in range(splits):
        b0, b1 = s * kb // splits, (s + 1) * kb // splits
        k0, k1 = b0 * FP8_BLOCK, min(k, b1 * FP8_BLOCK)
        parts.append(_fp8_call("fp8_gemm", q[:, k0:k1], sx[:, b0:b1], weight.data[:, k0:k1], weight.scale[:, b0:b1],
                               None, torch.float32))
    return tree_sum(parts).reshape(*lead, weight.shape[0])
