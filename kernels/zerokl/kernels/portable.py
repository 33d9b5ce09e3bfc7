"""Portable CPU arithmetic for the torch backend: the same bits on every machine.

Plain torch on a CPU is not one machine but several. Measured (NUMERICS.md, "Why plain
torch is not enough"): MKL's sgemm picks its micro-kernel, K blocking and thread split by
CPU vendor and ISA, so the same `torch.mm` gives different bits on an Intel and an AMD
AVX-512 CPU; ATen's exp/log/sin/cos run SLEEF vector code whose implementation follows
`ATEN_CPU_CAPABILITY` (AVX2 vs AVX-512) and libm in loop tails; its vectorized `sum` adds
in lanes whose width follows the ISA; its `sqrt` of a CPU tensor is MKL's vector math (VML),
which is not correctly rounded and follows the instruction set MKL picks (measured on an
Intel AVX-512 CPU: 25,336 of 4M fp32 results off by an ulp natively, 0 under MKL's AVX2
path, 758,179 under its SSE4.2 path). Only IEEE-754's basic operations (+, -, *, /,
conversions, comparisons), which ATen computes with the instruction itself, are correctly
rounded everywhere, and they are what this module is built from:

* **Exact contractions** (`contract`, `row_sum`). Each operand row is split into two
  integer-valued float64 slices, `x = (H + L * 2^-b) * 2^(e-b)` with `|H|, |L| <= 2^b`, where
  `2^e` bounds the row's largest magnitude (bits below `2^(e-2b)` are rounded off: at most
  2^-41 of the row maximum, far below fp32 rounding). Every product of two slices is an
  integer of at most 2^2b and any sum of K of them stays within 2^53, so the
  float64 GEMM of two slices is EXACT: no rounding happens, so the result does not depend
  on the summation order, the blocking, the thread count, FMA or the BLAS library. The three
  slice products are then combined by fixed element-wise operations and rounded once to
  fp32. A row's result depends only on its own values: batch size, neighbours, column
  shards and thread count cannot change it.
* **Transcendentals** (`exp`, `log`, `sigmoid`, `silu`, `cos_sin`) by exact range reduction
  (Cody-Waite with split constants) and fixed polynomials (Horner, one rounding per
  operation, no fused multiply-add): exp (and so sigmoid, SiLU) in fp32 arithmetic (Cephes'
  expf, about one ulp), log, cos and sin in float64 rounded once to fp32. Deterministic
  everywhere because every step is a basic operation.
* **Square root** (`sqrt`) correctly rounded, from division and multiplication only: Newton
  in float64 from an exponent-halving guess, rounded to fp32, then corrected exactly (the
  squares of the midpoints to the candidate's fp32 neighbours are exact in float64).

Inputs are fp32, bf16 or fp64 CPU tensors; NaN and inf propagate as IEEE says (a
non-finite input to a contraction gives NaN in the outputs that read it). Gradients
(`torch.autograd`) are the textbook derivatives, built the same way: a contraction's are exact
contractions, a transcendental's derivative uses these primitives and basic operations, so a
CPU training step has the same bits on every machine (NUMERICS.md, "The trainer's update on a CPU").
"""
from __future__ import annotations

import math
import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["contract", "contract_grouped", "contract_gathered", "row_sum", "exp", "exp32", "log", "sigmoid", "silu", "cos_sin", "exp64", "log64", "sqrt",
           "sqrt32", "slice_bits", "uniform", "standard_normal"]

# ----------------------------------------------------------------------------- exact slicing

_MANT = 53   # float64 significand bits: every partial sum of slice products must stay below 2^53


def slice_bits(k: int, terms: int = 2) -> int:
    """Bits per slice so that k products of `terms` slices' integers sum exactly in float64.

    terms=2 (a contraction, products of two b-bit integers): k * 2^(2b) <= 2^53.
    terms=1 (a row sum of b-bit integers): k * 2^b <= 2^53. Capped so that two slices never
    exceed float64's own precision.
    """
    need = max(k - 1, 0).bit_length()                 # ceil(log2 k)
    return min((_MANT - need) // terms, 26 if terms == 2 else 52)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as float64 for integer e in [-1022, 1023], built from the exponent bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _slices(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split rows (last dim) of x into integer-valued float64 slices H, L and a row exponent e
    (int64 [..., 1]): x ~= (H + L * 2^-bits) * 2^(e - bits), |H| <= 2^bits, |L| <= 2^(bits-1).
    Every step is exact (frexp, scaling by a power of two, rounding to an integer, an exact
    remainder); 2^e bounds the row's largest magnitude (e = 0 for a zero row)."""
    x = x.detach()
    if x.shape[-1] == 0:
        empty = x.to(torch.float64)
        return empty, empty, torch.zeros(*x.shape[:-1], 1, dtype=torch.int64, device=x.device)
    lo_val, hi_val = torch.aminmax(x, dim=-1, keepdim=True)
    amax = torch.maximum(hi_val, -lo_val).to(torch.float64)
    e = torch.frexp(amax).exponent.to(torch.int64).clamp_(-900, 900)   # inf/NaN rows: NaN out anyway
    scaled = torch.mul(x, _pow2(bits - e))                   # float64, |scaled| < 2^bits, exact (power of two)
    hi = torch.round(scaled)                                 # |hi| <= 2^bits
    lo = scaled.sub_(hi).mul_(float(2 ** bits)).round_()     # the remainder (exact, |.| <= 1/2): next b bits
    return hi, lo, e


# Slices of tensors that are used again unchanged (weights, and views of them such as one
# expert's or one K segment's): keyed by the base tensor, then by the view's geometry, valid
# while the version counter (shared by a base and its views, bumped by every in-place update
# such as an optimizer step) and the data's address are the ones recorded. A Parameter whose
# data is replaced (``p.data = t``: a sleeping engine adopting new weights) keeps its version
# counter: whoever swaps data bumps it (torch.autograd.graph.increment_version), and the address
# catches a swap that did not. Entries die with their base tensor.
_SLICE_CACHE = WeakIdKeyDictionary()
_SLICE_CACHE_LOCK = threading.Lock()


def _weight_slices(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_slices` of a weight, cached: a decode step re-reads every weight."""
    base = w._base if w._base is not None else w
    view = (bits, w.dtype, tuple(w.shape), w.stride(), w.storage_offset())
    with _SLICE_CACHE_LOCK:
        entries = _SLICE_CACHE.get(base)
        hit = entries.get(view) if entries is not None else None
    stamp = (w._version, base.data_ptr())
    if hit is not None and hit[0] == stamp:
        return hit[1]
    value = _slices(w, bits)
    with _SLICE_CACHE_LOCK:
        entries = _SLICE_CACHE.setdefault(base, {})
        if any(recorded != stamp for recorded, _ in entries.values()):
            entries.clear()                                  # the base changed: drop stale views
        entries[view] = (stamp, value)
    return value


def _combine(hh: torch.Tensor, cross: torch.Tensor, ae: torch.Tensor, be: torch.Tensor, bits: int) -> torch.Tensor:
    """Join the exact slice products into fp32: (hh + cross * 2^-b) * 2^(ea-b) * 2^(eb-b).
    ae [..., M, 1], be [..., N, 1] are the rows' exponents; every scaling is exact."""
    scale = _pow2(ae - bits) * _pow2(be - bits).transpose(-1, -2)
    return cross.mul_(float(2.0 ** -bits)).add_(hh).mul_(scale).to(torch.float32)


def _exact_from_slices(a: torch.Tensor, bits: int, bh: torch.Tensor, bl: torch.Tensor, be: torch.Tensor) -> torch.Tensor:
    """contract(a, b) given b's slices (rows over the last dim): [..., M, K] x [..., N, K] -> [..., M, N]."""
    return _join(*_slices(a, bits), bh, bl, be, bits)


def _join(ah, al, ae, bh, bl, be, bits: int) -> torch.Tensor:
    """The three exact slice GEMMs of a contraction, joined into fp32 (_combine)."""
    bh_t, bl_t = bh.transpose(-1, -2), bl.transpose(-1, -2)
    cross = torch.matmul(ah, bl_t) + torch.matmul(al, bh_t)  # each exact; their sum rounds once
    return _combine(torch.matmul(ah, bh_t), cross, ae, be, bits)   # hh: exact integers <= 2^53


def _contract_exact(a: torch.Tensor, b: torch.Tensor, cache_b: bool = False) -> torch.Tensor:
    """fp32 a @ b^T over the last dim, exactly summed: a [..., M, K], b [..., N, K] -> [..., M, N]."""
    bits = slice_bits(a.shape[-1], terms=2)
    return _exact_from_slices(a, bits, *(_weight_slices(b, bits) if cache_b else _slices(b, bits)))


class _Contract(torch.autograd.Function):
    """Exact forward; the backward's pair of GEMMs are exact contractions too (no BLAS order reaches them)."""

    @staticmethod
    def forward(ctx, a, b, cache_b):
        ctx.save_for_backward(a, b)
        return _contract_exact(a, b, cache_b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _contract_exact(g, b.transpose(-1, -2)).to(a.dtype)          # g [.., M, N] b [.., N, K]
        if ctx.needs_input_grad[1]:
            gb = _contract_exact(g.transpose(-1, -2), a.transpose(-1, -2)).to(b.dtype)
        return ga, gb, None


def contract(a: torch.Tensor, b: torch.Tensor, b_is_weight: bool = False) -> torch.Tensor:
    """a @ b^T over the shared last dim in fp32, identical bits on every machine.

    a [..., M, K], b [..., N, K] (leading dims broadcast as in torch.matmul) -> [..., M, N].
    An output element depends only on its row of a and its row of b (see module docstring).
    b_is_weight: b is reused unchanged across calls (a weight), so its slices are cached.
    """
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"contract: K differs: {tuple(a.shape)} vs {tuple(b.shape)}")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _Contract.apply(a, b, b_is_weight)
    return _contract_exact(a, b, b_is_weight)


def contract_grouped(x: torch.Tensor, weight: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [M, K] contracted with weight[g] [N, K] -> [M, N] fp32.

    The same bits as `contract` per group (a row's slices depend only on the row); x is
    sliced once for all groups and the weights' slices are cached.
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        parts = [contract(x[offsets[g]:offsets[g + 1]], weight[g], b_is_weight=True) for g in range(weight.shape[0])]
        return torch.cat(parts) if parts else x.new_zeros((0, weight.shape[1]), dtype=torch.float32)
    bits = slice_bits(x.shape[-1], terms=2)
    xh, xl, xe = _slices(x, bits)
    out = torch.empty(x.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    for g in range(weight.shape[0]):
        lo, hi = offsets[g], offsets[g + 1]
        if hi == lo:
            continue
        out[lo:hi] = _join(xh[lo:hi], xl[lo:hi], xe[lo:hi], *_weight_slices(weight[g], bits), bits)
    return out


def contract_gathered(a: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """contract(a, table[index]): a [T, X, D], table [S, D], index [T, L] (valid rows) -> [T, X, L].

    The same bits as gathering first (a row's slices depend only on the row); each table
    row is sliced once however many queries read it (a causal prefix is read by every later
    query of its sequence).
    """
    if torch.is_grad_enabled() and (a.requires_grad or table.requires_grad):
        return contract(a, table[index])
    bits = slice_bits(a.shape[-1], terms=2)
    rows, inverse = torch.unique(index.reshape(-1), return_inverse=True)
    th, tl, te = _slices(table[rows], bits)
    shape = (*index.shape, -1)
    return _exact_from_slices(a, bits, th[inverse].view(shape), tl[inverse].view(shape), te[inverse].view(shape))


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if ctx is not None:
            ctx.shape = x.shape
        bits = slice_bits(x.shape[-1], terms=1)
        hi, lo, e = _slices(x, bits)
        total = hi.sum(-1, keepdim=True) + lo.sum(-1, keepdim=True) * float(2.0 ** -bits)   # exact sums
        return (total * _pow2(e - bits)).squeeze(-1).to(torch.float32)

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(-1).expand(ctx.shape)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in fp32, exactly summed in float64 slices (any order gives these bits)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RowSum.apply(x)
    return _RowSum.forward(None, x)


# ----------------------------------------------------------------------------- transcendentals

_LN2_HI = 6.93147180369123816490e-01    # ln 2 with 21 trailing zero bits: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
_EXP_TAYLOR = [1.0 / math.factorial(i) for i in range(13, -1, -1)]    # degree 13, |r| <= ln2/2


def _horner(coeffs: list[float], r: torch.Tensor) -> torch.Tensor:
    acc = torch.full_like(r, coeffs[0])
    for c in coeffs[1:]:
        acc = acc * r + c                                    # two roundings: no FMA in torch's mul/add
    return acc


def exp64(x: torch.Tensor) -> torch.Tensor:
    """e^x in float64 from basic operations (x float64). Overflows to inf above ~200 and
    underflows to 0 below ~-200, far outside what fp32 results can hold."""
    nan = torch.isnan(x)
    xc = torch.where(nan, torch.zeros_like(x), x).clamp(-200.0, 200.0)
    n = torch.round(xc * _INV_LN2)                          # |n| <= 289: 2^n is a normal float64
    r = (xc - n * _LN2_HI) - n * _LN2_LO                     # |r| <= ln2/2, Cody-Waite (n * _LN2_HI exact)
    out = _horner(_EXP_TAYLOR, r) * _pow2(n)                 # times a power of two: exact
    out = torch.where(x > 200.0, torch.full_like(x, math.inf), torch.where(x < -200.0, torch.zeros_like(x), out))
    return torch.where(nan, x, out)


_SQRT2 = math.sqrt(2.0)
_ATANH_SERIES = [1.0 / (2 * i + 1) for i in range(12, -1, -1)]         # 2 atanh(f) = 2 f sum s^i / (2i+1)


def log64(x: torch.Tensor) -> torch.Tensor:
    """ln x in float64 from basic operations (x float64, normal or zero). ln 0 = -inf, ln of a
    negative number NaN, ln inf = inf."""
    pos = (x > 0) & torch.isfinite(x)
    xs = torch.where(pos, x, torch.ones_like(x))
    e = ((xs.view(torch.int64) >> 52) & 0x7FF) - 1023       # xs = m * 2^e, m in [1, 2)
    m = xs * _pow2(-e)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)                         # m in [sqrt2/2, sqrt2]: |f| <= 0.1716
    e = (e + big.to(torch.int64)).to(torch.float64)
    f = (m - 1.0) / (m + 1.0)
    log_m = 2.0 * f * _horner(_ATANH_SERIES, f * f)
    out = e * _LN2_HI + (e * _LN2_LO + log_m)
    out = torch.where(x == 0, torch.full_like(x, -math.inf), out)
    out = torch.where(x == math.inf, x, out)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(x, math.nan), out)


# exp in fp32 (Cephes' expf): |r| <= ln2/2 after reduction by n * ln2 in two parts (C1 has 9
# significant bits, so n * C1 is exact for |n| < 2^15), then a degree-7 polynomial.
_C1 = 0.693359375
_C2 = -2.12194440e-4
_EXPF_POLY = [1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1]


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as fp32 for integer e in [-126, 127], from the exponent bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """e^x for fp32 x in fp32 arithmetic, accurate to about one ulp: IEEE basic operations only."""
    nan = torch.isnan(x)
    xc = torch.where(nan, torch.zeros_like(x), x).clamp(-104.0, 89.0)
    n = torch.round(xc * _INV_LN2)                           # |n| <= 150
    r = (xc - n * _C1) - n * _C2
    p = _horner(_EXPF_POLY, r) * (r * r) + r + 1.0
    half = torch.div(n, 2, rounding_mode="floor")            # 2^n as two normal factors: n may be -150 or 128
    out = p * _pow2_f32(half) * _pow2_f32(n - half)
    return torch.where(nan, x, out)


class _Pointwise(torch.autograd.Function):
    """An fp32 element-wise op with a portable forward and a textbook derivative."""

    @staticmethod
    def forward(ctx, x, fn, derivative):
        out = fn(x.detach().float())
        ctx.save_for_backward(x, out)
        ctx.derivative = derivative
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        return g * ctx.derivative(x.float(), out), None, None


def _pointwise(x: torch.Tensor, fn, derivative) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _Pointwise.apply(x, fn, derivative)
    return fn(x.float())


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in fp32 (exp32)."""
    return _pointwise(x, exp32, lambda x, out: out)


def _log32(x: torch.Tensor) -> torch.Tensor:
    return log64(x.to(torch.float64)).to(torch.float32)


def log(x: torch.Tensor) -> torch.Tensor:
    """ln x in fp32, rounded once from a float64 evaluation (log64)."""
    return _pointwise(x, _log32, lambda x, out: 1.0 / x)


def _sigmoid32(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + exp32(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x) in fp32."""
    return _pointwise(x, _sigmoid32, lambda x, out: out * (1.0 - out))


def _silu_derivative(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    s = _sigmoid32(x)
    return s * (1.0 + x * (1.0 - s))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + e^-x) in fp32."""
    return _pointwise(x, lambda x32: x32 / (1.0 + exp32(-x32)), _silu_derivative)


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of fp32 x (IEEE-754's sqrt), from + - * / only.

    torch.sqrt on a CPU tensor is MKL's vector math, whose last bit follows the CPU (module
    docstring). Here: a float64 guess from the halved exponent bits (within 6%), four Newton
    steps y = (y + x/y) / 2 (error 6e-2 -> 2e-3 -> 2e-6 -> 1e-12 -> float64 rounding), rounded
    to an fp32 candidate c within one ulp; then the exact choice among c and its neighbours:
    sqrt(x) lies above the midpoint m between c and its upper neighbour iff x > m^2, and m^2
    (a 25-bit significand squared: 50 bits) and x are exact in float64. sqrt(x) is never a
    midpoint (m^2 needs more than 24 bits), so there is no tie. Zero keeps its sign, +inf
    stays inf, negatives and NaN give NaN.
    """
    x = x.float()
    x64 = x.to(torch.float64)
    pos = (x64 > 0) & (x64 < math.inf)                       # fp32 subnormals are normal float64
    xs = torch.where(pos, x64, torch.ones_like(x64))
    y = ((xs.view(torch.int64) >> 1) + (1023 << 51)).view(torch.float64)   # exponent halved
    for _ in range(4):
        y = (y + xs / y) * 0.5
    c = y.to(torch.float32)
    up = (c.view(torch.int32) + 1).view(torch.float32)
    down = (c.view(torch.int32) - 1).view(torch.float32)
    c64 = c.to(torch.float64)
    above = (c64 + up.to(torch.float64)) * 0.5               # exact: two close fp32 values, halved
    below = (c64 + down.to(torch.float64)) * 0.5
    c = torch.where(xs > above * above, up, torch.where(xs < below * below, down, c))
    special = torch.where(x < 0, torch.full_like(x, math.nan), x)   # +-0, +inf, NaN: themselves; x < 0: NaN
    return torch.where(pos, c, special)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt(x) in fp32, correctly rounded (sqrt32)."""
    return _pointwise(x, sqrt32, lambda x, out: 0.5 / out)


_PIO2_1 = 1.57079632673412561417e+00    # pi/2 in three parts of 33 bits (fdlibm): k * part exact for k < 2^20
_PIO2_2 = 6.07710050650619224932e-11
_PIO2_3 = 2.02226624879595063154e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_SIN_TAYLOR = [(-1) ** i / math.factorial(2 * i + 1) for i in range(9, -1, -1)]   # sin r = r * P(r^2)
_COS_TAYLOR = [(-1) ** i / math.factorial(2 * i) for i in range(9, -1, -1)]       # cos r = Q(r^2)


def cos_sin(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of fp32 angles, each rounded once to fp32 from a float64 evaluation.

    Range reduction by the nearest multiple of pi/2 with a three-part constant is exact for
    |angle| < 2^20 * pi/2 (RoPE angles are position * inv_freq <= position); beyond that the
    bits stay deterministic but lose accuracy.
    """
    a = angle.to(torch.float64)
    k = torch.round(a * _TWO_OVER_PI)
    r = ((a - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3      # |r| <= pi/4
    r2 = r * r
    s = r * _horner(_SIN_TAYLOR, r2)
    c = _horner(_COS_TAYLOR, r2)
    q = torch.remainder(k.to(torch.int64), 4)                # quadrant
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    return cos.to(torch.float32), sin.to(torch.float32)


# ----------------------------------------------------------------------------- seeded random tensors

def uniform(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Uniforms in (0, 1) as fp32, from 24-bit integers (torch.randint draws integers serially
    from the generator; torch.rand/randn use ISA-dependent vector code on CPUs)."""
    k = torch.randint(0, 1 << 24, shape, generator=generator, dtype=torch.int64)
    return ((k.to(torch.float64) + 0.5) * 2.0 ** -24).to(torch.float32)


def standard_normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Approximately standard-normal fp32 samples, the same on every machine: the centred sum of
    four uniforms scaled to unit variance (Irwin-Hall; bounded by +-2 sqrt(3), ample for seeded
    weights and test inputs). Only additions and one multiplication, each correctly rounded."""
    n = math.prod(shape)
    u = uniform((4, n), generator).to(torch.float64)
    total = ((u[0] + u[1]) + (u[2] + u[3])) - 2.0
    return (total * math.sqrt(3.0)).to(torch.float32).view(shape)
