"""The torch backend's CPU primitives against correctly rounded or exactly defined references.

The torch backend promises the same bits on every CPU because each of its primitives is
either an IEEE-754 basic operation (correctly rounded, so one answer exists) or a fixed
composition of them (kernels/zerokl/kernels/portable.py). A golden vector checks a handful of inputs on
the machine that recorded it; this module checks the promise itself, on this machine, on
~10^6 random inputs per primitive plus the edge cases (zeros, infinities, NaN, subnormals,
powers of two, values next to rounding midpoints), against references computed another
way: numpy's IEEE arithmetic, and integer arithmetic where a sum must be exact.

* correctly rounded (`sqrt`, + - * /, float64 -> fp32 and fp32 -> bf16 conversion): equal
  bits to the IEEE result (numpy's float64 op rounded to fp32 is the correctly rounded fp32
  op: for + - * / and sqrt, float64 holds more than 2 x 24 + 2 bits, so the double rounding
  is innocuous);
* exactly defined (`row_sum`, `contract`, `rms_norm`, `layer_norm`, float64 `cumsum`,
  `round`, stable sort, rounding onto the e4m3 grid, `fp8_linear`): equal bits to the definition in NUMERICS.md evaluated with numpy
  (integer slice sums in int64, the same element-wise float64 steps, IEEE fp32 arithmetic);
* transcendentals (`exp`, `log`, `cos_sin`, `sigmoid`, `silu`): their definition is the
  fixed polynomial, so the reference is an accuracy bound (ulps from the float64 result),
  and their bits are compared across CPU code paths by digest (`check_primitives`' digests;
  tests/kernels/test_portable.py runs it under each ATen and MKL path).

A vendor routine reaching the bits (as MKL's vector-math `torch.sqrt` did, numerics 0.3.1)
shows up as mismatches here on any machine whose MKL path is inexact, and as differing
digests between code paths on any machine.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import numpy as np
import torch

from zerokl.kernels import portable, torch_ops
from zerokl.kernels.ops import one_cpu_thread

__all__ = ["CODE_PATHS", "PrimitiveCheck", "PRIMITIVE_CHECKS", "check_primitives", "code_path_env"]

# The CPU code paths a process can be put on with environment variables (set before torch loads):
# ATen's vectorized kernels (exp/log/sin/cos, lane-wise sums, randn) follow ATEN_CPU_CAPABILITY;
# MKL's kernels (GEMMs, and the vector math behind torch.sqrt) follow MKL_ENABLE_INSTRUCTIONS (and
# the CPU vendor, which no variable switches). On an Intel AVX-512 CPU MKL's native, AVX2 and SSE4.2
# square roots are three different functions (portable.py). The tests run the torch backend's
# primitives and golden digests (tests/kernels/test_stock_torch.py) and the CPU trainer's steps
# (tests/services/trainer/test_cpu_trainer_bits.py) under each, asserting the same bits.
CODE_PATHS = {
    "native": {},
    "mkl-avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "aten-default+mkl-sse4_2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def code_path_env(name: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` (e.g. os.environ) with the variables of code path ``name`` and no others of those two."""
    env = {k: v for k, v in base.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    return {**env, **CODE_PATHS[name]}


@dataclasses.dataclass(frozen=True)
class PrimitiveCheck:
    """One primitive's verdict: inputs compared, how many disagree with the reference, and a
    digest of the outputs (equal on every CPU code path when the primitive is portable)."""

    name: str
    cases: int
    mismatches: int
    digest: str


def _digest(*tensors: torch.Tensor) -> str:
    """Hash of the outputs' bits, NaN payloads made one (IEEE leaves them to the machine)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        if t.is_floating_point():
            t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# Inputs come from integer draws only (torch.randint is serial; torch.rand/randn and exp2 run
# ISA-dependent vector code), so every code path checks the same inputs.

def _f32_bits(g: torch.Generator, n: int, signed: bool = True) -> torch.Tensor:
    """n fp32 values with uniformly random bit patterns over the finite range (subnormals,
    powers of two and every exponent included)."""
    x = torch.randint(0, 0x7F800000, (n,), generator=g, dtype=torch.int32).view(torch.float32)
    return x * _signs(g, n) if signed else x


def _signs(g: torch.Generator, n: int) -> torch.Tensor:
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float()


def _uniform64(g: torch.Generator, n: int) -> torch.Tensor:
    """float64 uniforms in (0, 1) on 2^53 cell midpoints."""
    return (torch.randint(0, 1 << 52, (n,), generator=g, dtype=torch.int64).double() + 0.5) * 2.0 ** -52


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as float64 for integer e in [-1022, 1023], from the exponent bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _normal64(g: torch.Generator, n: int, lo: int, hi: int) -> torch.Tensor:
    """float64 normals times 2^e, e uniform in [lo, hi): every magnitude in between."""
    return portable.standard_normal((n,), g).double() * _pow2(torch.randint(lo, hi, (n,), generator=g))


def _specials() -> torch.Tensor:
    powers = [2.0 ** e for e in range(-149, 128)]
    edge = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -1.0, 1.0, 1.1754942e-38, 1.4e-45,
            3.4028235e38, 1.0000001, 0.99999994]
    return torch.tensor(powers + edge, dtype=torch.float32)


def _near_sqrt_midpoints(g: torch.Generator, n: int) -> torch.Tensor:
    """fp32 values at and beside m^2 for m the midpoint between two fp32 neighbours: the
    inputs whose square roots sit closest to a rounding boundary."""
    c = (_uniform64(g, n) * 2.0 ** 20 + 2.0 ** -20).float()
    up = (c.view(torch.int32) + 1).view(torch.float32)
    mid = (c.double() + up.double()) * 0.5
    x = (mid * mid).float()
    step = x.view(torch.int32)
    return torch.cat([x, (step - 1).view(torch.float32), (step + 1).view(torch.float32)])


def _equal_bits(got: torch.Tensor, want: np.ndarray) -> int:
    """Elements whose bits differ (NaNs of any payload count as equal)."""
    want_t = torch.from_numpy(np.ascontiguousarray(want))
    same = (got.view(torch.int32 if got.dtype == torch.float32 else torch.int64)
            == want_t.view(torch.int32 if want_t.dtype == torch.float32 else torch.int64))
    same |= torch.isnan(got) & torch.isnan(want_t)
    return int((~same).sum())


def _quiet(fn: Callable[[], np.ndarray]) -> np.ndarray:
    with np.errstate(all="ignore"):
        return fn()


# ----------------------------------------------------------------------------- correctly rounded

def _check_sqrt(g, n):
    x = torch.cat([_f32_bits(g, n, signed=False), (_uniform64(g, n) * 1000 + 1e-6).float(),
                   _near_sqrt_midpoints(g, n // 8), _specials()])
    out = portable.sqrt(x)
    want = _quiet(lambda: np.sqrt(x.numpy().astype(np.float64)).astype(np.float32))
    return x.numel(), _equal_bits(out, want), _digest(out)


def _check_arithmetic(g, n):
    a = torch.cat([_f32_bits(g, n), _specials()])
    b = torch.cat([_f32_bits(g, n), _specials().flip(0)])
    a64, b64 = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
    outs, bad = [], 0
    for got, want in [(a + b, lambda: a64 + b64), (a - b, lambda: a64 - b64), (a * b, lambda: a64 * b64),
                      (a / b, lambda: a64 / b64), (1.0 / b, lambda: 1.0 / b64)]:
        bad += _equal_bits(got, _quiet(lambda: want().astype(np.float32)))
        outs.append(got)
    return 5 * a.numel(), bad, _digest(*outs)


def _check_float64_arithmetic(g, n):
    """float64 + * / as portable's polynomials and joins use them, against numpy's IEEE ops."""
    a, b = _normal64(g, n, -60, 60), _normal64(g, n, -60, 60)
    an, bn = a.numpy(), b.numpy()
    bad, outs = 0, []
    for got, want in [(a + b, an + bn), (a * b, an * bn), (a / b, an / bn)]:
        bad += int((got.view(torch.int64) != torch.from_numpy(want).view(torch.int64)).sum())
        outs.append(got)
    return 3 * n, bad, _digest(*outs)


def _check_conversions(g, n):
    d = _normal64(g, n, -140, 130)
    f = d.float()
    bad = _equal_bits(f, _quiet(lambda: d.numpy().astype(np.float32)))
    x = torch.cat([_f32_bits(g, n), _specials()])
    bf = x.to(torch.bfloat16)
    # fp32 -> bf16: round to nearest even on the top 16 bits (NaN stays NaN)
    u = x.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(x.numpy())
    want = np.where(nan, 0x7FC0, rounded & 0xFFFF)
    got = bf.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    bad += int(((got != want) & ~nan).sum()) + int((~np.isnan(bf.float().numpy()) & nan).sum())
    return f.numel() + x.numel(), bad, _digest(f, bf.float())


# ----------------------------------------------------------------------------- exactly defined

def _check_round(g, n):
    x = _normal64(g, n, -4, 60)
    x = torch.cat([x, torch.arange(-8, 8, dtype=torch.float64) + 0.5])          # ties: half to even
    out = torch.round(x)
    mant, exp = torch.frexp(x)
    bad = int((out.view(torch.int64) != torch.from_numpy(np.rint(x.numpy())).view(torch.int64)).sum())
    nm, ne = np.frexp(x.numpy())
    bad += int((mant != torch.from_numpy(nm)).sum()) + int((exp != torch.from_numpy(ne)).sum())
    return 2 * x.numel(), bad, _digest(out, mant)


def _slices_np(x: np.ndarray, bits: int):
    """kernels/zerokl/kernels/portable._slices in numpy: integer slices (int64) and row exponents."""
    amax = np.abs(x).max(axis=-1, keepdims=True).astype(np.float64)
    e = np.frexp(amax)[1].astype(np.int64)
    scaled = np.ldexp(x.astype(np.float64), bits - e)
    hi = np.rint(scaled)
    lo = np.rint((scaled - hi) * 2.0 ** bits)
    return hi.astype(np.int64), lo.astype(np.int64), e


def _contract_np(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """portable.contract's definition with integer sums: a [M, K] x b [N, K] -> [M, N] fp32."""
    bits = portable.slice_bits(a.shape[-1], terms=2)
    ah, al, ae = _slices_np(a, bits)
    bh, bl, be = _slices_np(b, bits)
    hh = (ah @ bh.T).astype(np.float64)                                       # exact int64 sums
    cross = (ah @ bl.T).astype(np.float64) + (al @ bh.T).astype(np.float64)  # one float64 rounding
    scale = np.ldexp(1.0, ae - bits) * np.ldexp(1.0, be - bits).T
    return ((cross * 2.0 ** -bits + hh) * scale).astype(np.float32)


def _row_sum_np(x: np.ndarray) -> np.ndarray:
    bits = portable.slice_bits(x.shape[-1], terms=1)
    hi, lo, e = _slices_np(x, bits)
    total = hi.sum(-1, keepdims=True).astype(np.float64) + lo.sum(-1, keepdims=True).astype(np.float64) * 2.0 ** -bits
    return np.ldexp(total, e - bits)[..., 0].astype(np.float32)


def _rows(g, rows: int, k: int) -> torch.Tensor:
    """fp32 rows of mixed magnitude (each row its own scale) with exact zeros and ties."""
    x = portable.standard_normal((rows, k), g) * _pow2(torch.randint(-20, 20, (rows, 1), generator=g)).float()
    x[torch.randint(0, 20, (rows, k), generator=g) == 0] = 0.0
    return x


def _check_contract(g, n):
    rows = max(8, n // 4096)
    a, b = _rows(g, rows, 96), _rows(g, 48, 96)
    out = portable.contract(a, b)
    s = _rows(g, rows, 333)
    total = portable.row_sum(s)
    bad = _equal_bits(out, _contract_np(a.numpy(), b.numpy())) + _equal_bits(total, _row_sum_np(s.numpy()))
    return out.numel() + total.numel(), bad, _digest(out, total)


def _check_norms(g, n):
    """rms_norm and layer_norm: the row sums above, then IEEE fp32 steps and the IEEE sqrt."""
    x = _rows(g, max(8, n // 256), 96) * 3.0
    w, bias = portable.standard_normal((96,), g), portable.standard_normal((96,), g)
    eps = np.float32(1e-6)
    xn, wn, bn = x.numpy(), w.numpy(), bias.numpy()
    d = np.float32(96)
    mean_sq = _row_sum_np(xn * xn) / d
    want_rms = xn * (np.float32(1.0) / np.sqrt(mean_sq + eps))[:, None] * wn
    mean = _row_sum_np(xn) / d
    centered = xn - mean[:, None]
    var = _row_sum_np(centered * centered) / d
    want_ln = centered * (np.float32(1.0) / np.sqrt(var + eps))[:, None] * wn + bn
    rms = torch_ops.rms_norm(x, w, 1e-6)
    ln = torch_ops.layer_norm(x, w, bias, 1e-6)
    return rms.numel() + ln.numel(), _equal_bits(rms, want_rms) + _equal_bits(ln, want_ln), _digest(rms, ln)


def _check_cumsum_and_sort(g, n):
    """float64 cumsum (top-p's prefix mass on CPUs: one left-to-right loop per row) and the
    stable descending sort with ties in index order (top-k, sampling order)."""
    x = _uniform64(g, max(4, n // 1024) * 1024).view(-1, 1024)
    cs = torch.cumsum(x, dim=-1)
    want = np.cumsum(x.numpy(), axis=-1)
    bad = int((cs.view(torch.int64) != torch.from_numpy(want).view(torch.int64)).sum())
    ties = torch.randint(-4, 4, (max(4, n // 1024), 1024), generator=g).float()
    order = torch.sort(ties + 0.0, dim=-1, descending=True, stable=True).indices
    bad += int((order != torch.from_numpy(np.argsort(-ties.numpy(), axis=-1, kind="stable"))).sum())
    return cs.numel() + order.numel(), bad, _digest(cs, order)


def _e4m3_grid() -> np.ndarray:
    """Every finite non-negative float8_e4m3fn value, ascending, as float64 (codes 0..126)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


def _round_e4m3_np(y: np.ndarray) -> np.ndarray:
    """Nearest e4m3 value, ties to the even code, by search in the table of values."""
    grid = _e4m3_grid()
    a = np.abs(y.astype(np.float64))
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (np.sign(y) * grid[pick]).astype(np.float32)


def _check_fp8(g, n):
    """FP8 (NUMERICS.md, "FP8"): rounding onto the e4m3 grid (random values, every grid point
    and every midpoint between neighbours) and fp8_linear's block-scaled sum, against the
    definition with int64 block dots (e4m3 values are integers times 2^-9)."""
    grid = torch.from_numpy(_e4m3_grid()).float()
    mids = (grid[:-1].double() + grid[1:].double()) * 0.5
    y = torch.cat([((_uniform64(g, n) * 2 - 1) * _pow2(torch.randint(-12, 9, (n,), generator=g))).clamp(-448, 448).float(),
                   grid, -grid, mids.float(), -mids.float()])
    r = torch_ops.round_to_e4m3(y)
    bad = int((r != torch.from_numpy(_round_e4m3_np(y.numpy()))).sum())
    rows = max(4, n // 8192)
    x = portable.standard_normal((rows, 300), g) * _pow2(torch.randint(-8, 8, (rows, 1), generator=g)).float()
    w = portable.standard_normal((130, 300), g) * 0.05
    from zerokl.kernels.ops import fp8_quantize_weight
    qw, sw = fp8_quantize_weight(w)
    out = torch_ops.fp8_linear(x, qw, sw)
    qx, sx = torch_ops.fp8_quantize(x)
    ia = np.rint(qx.double().numpy() * 512).astype(np.int64)
    iw = np.rint(qw.double().numpy() * 512).astype(np.int64)
    acc = np.zeros((rows, 130), np.float32)
    swn, sxn = sw.numpy(), sx.numpy()
    for b in range(sx.shape[1]):
        sl = slice(b * 128, min(300, b * 128 + 128))
        part = ((ia[:, sl] @ iw[:, sl].T).astype(np.float64) * 2.0 ** -18).astype(np.float32)
        acc = acc + part * (sxn[:, b:b + 1] * np.repeat(swn[:, b], 128)[:130][None, :])
    bad += _equal_bits(out, acc)
    return r.numel() + out.numel(), bad, _digest(r, qx.float(), out)


# ----------------------------------------------------------------------------- transcendentals

def _ulps(got: torch.Tensor, want: np.ndarray) -> torch.Tensor:
    """|got - want| in units of fp32 ulps, by the ordered bit patterns (both finite)."""
    def ordered(t):
        i = t.view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(got) - ordered(torch.from_numpy(want.astype(np.float32)))).abs()


def _check_transcendentals(g, n):
    """exp within 2 ulps, log/cos/sin (float64 rounded once) within 1, sigmoid/silu within 4, of
    numpy's float64 result rounded to fp32: an accuracy bound; the bits are their definition."""
    x = (_uniform64(g, n) * 160 - 80).float()
    pos = torch.cat([_f32_bits(g, n, signed=False).clamp(min=1e-30), torch.tensor([1.0, 2.0, 0.5])])
    ang = (_uniform64(g, n) * 2e4 - 1e4).float()
    z = (_uniform64(g, n) * 60 - 30).float()
    e, lg = portable.exp(x), portable.log(pos)
    cos, sin = portable.cos_sin(ang)
    sg, sl = portable.sigmoid(z), portable.silu(z)
    xd, pd, ad, zd = (t.numpy().astype(np.float64) for t in (x, pos, ang, z))
    bad = int((_ulps(e, np.exp(xd)) > 2).sum()) + int((_ulps(lg, np.log(pd)) > 1).sum())
    bad += int((_ulps(cos, np.cos(ad)) > 1).sum()) + int((_ulps(sin, np.sin(ad)) > 1).sum())
    bad += int((_ulps(sg, 1 / (1 + np.exp(-zd))) > 4).sum()) + int((_ulps(sl, zd / (1 + np.exp(-zd))) > 4).sum())
    return 6 * n, bad, _digest(e, lg, cos, sin, sg, sl)


PRIMITIVE_CHECKS: dict[str, Callable[[torch.Generator, int], tuple[int, int, str]]] = {
    "sqrt": _check_sqrt,
    "fp32 + - * /": _check_arithmetic,
    "float64 + * /": _check_float64_arithmetic,
    "conversions": _check_conversions,
    "round, frexp": _check_round,
    "contract, row_sum": _check_contract,
    "rms_norm, layer_norm": _check_norms,
    "cumsum, stable sort": _check_cumsum_and_sort,
    "fp8 rounding, fp8_linear": _check_fp8,
    "exp, log, cos_sin, sigmoid, silu": _check_transcendentals,
}


def check_primitives(n: int = 1 << 20, seed: int = 0) -> list[PrimitiveCheck]:
    """Run every check on ~n random inputs each (CPU, one intra-op thread as the backend runs)."""
    results = []
    with one_cpu_thread():
        for name, check in PRIMITIVE_CHECKS.items():
            cases, mismatches, digest = check(torch.Generator().manual_seed(seed), n)
            results.append(PrimitiveCheck(name, cases, mismatches, digest))
    return results
