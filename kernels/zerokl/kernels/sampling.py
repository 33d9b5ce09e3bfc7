"""Sampling as part of the numerical definition.

* The distribution a token is drawn from is the model's logits divided by the
  temperature, restricted by top-k (rank by logit, ties to the lower id) and then
  top-p (smallest prefix of that ranking whose probability reaches top_p), and
  renormalized. `sampling_logprobs` returns log-probabilities under exactly that
  distribution, so the trainer recomputes the number inference sampled with.
* Greedy (temperature 0) takes the highest logit, ties to the lowest id; its
  reported logprob is the unmodified log_softmax (a point mass would say 0).
* Seeded sampling is Gumbel-max with uniforms from a counter-based hash keyed by
  (seed, position, token id): never by batch slot or step, so a request draws the
  same token wherever it sits and whatever shares its batch.
* Every step is defined row by row. The sort, the rank scatter, the masks and the
  gathers are exact; softmax and log_softmax are the backend's row-invariant ops; the
  one scan, top-p's prefix mass, is `row_cumsum`, whose order each backend fixes
  (NUMERICS.md, Sampling).
* A row whose temperature-scaled logits hold a NaN or +inf, or no finite value, has no
  distribution: `sample` flags it (`Draw.ok` False) and computes that row on zeros
  instead, so no NaN ever reaches an index; `filtered_logprobs` gives it NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from zerokl.kernels.backend import backend_module, get_backend
from zerokl.kernels import portable
from zerokl.kernels.ops import log_softmax, softmax

__all__ = ["SamplingParams", "Draw", "filtered_logprobs", "row_cumsum", "sampling_logprobs", "sample", "uniform_noise"]

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters as tensors [T] (built by the engine from each request)."""

    temperature: torch.Tensor  # fp32; 0 means greedy
    top_k: torch.Tensor        # int64; 0 means off
    top_p: torch.Tensor        # fp32; 1.0 means off
    seed: torch.Tensor         # int64; the request's seed
    position: torch.Tensor     # int64; absolute position of the token being sampled

    @staticmethod
    def make(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             position: torch.Tensor | int = 0) -> "SamplingParams":
        """The same parameters for n rows (convenience for tests and tools)."""
        pos = position if isinstance(position, torch.Tensor) else torch.full((n,), position, dtype=torch.int64)
        return SamplingParams(
            temperature=torch.full((n,), float(temperature)),
            top_k=torch.full((n,), top_k, dtype=torch.int64),
            top_p=torch.full((n,), float(top_p)),
            seed=torch.full((n,), seed, dtype=torch.int64),
            position=pos.to(torch.int64),
        )


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 held in int64, without ever overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32): exact integer arithmetic, identical on every device."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _cell_midpoint(bits: torch.Tensor) -> torch.Tensor:
    """fp32 uniform in (0, 1) from 32 hash bits: the top 23 bits pick one of 2**23 equal cells and
    the value is its midpoint (k + 0.5) / 2**23. Exact in fp32 and at least 2**-24 from 0 and 1,
    so the Gumbel noise -log(-log(u)) is always finite. (With 24 bits the top cell's midpoint,
    1 - 2**-25, rounds to 1.0 in fp32: +inf noise, NaN where it met a filtered-out token's -inf.)"""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), [T, vocab] fp32, a pure function of (seed, position, token id)."""
    seed = seed.to(torch.int64)
    key = _hash32(_hash32((seed & _MASK32) ^ 0x9E3779B9) ^ ((seed >> 32) & _MASK32))
    key = _hash32(key ^ (position.to(torch.int64) & _MASK32))
    ids = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    return _cell_midpoint(_hash32(key.unsqueeze(1) ^ _hash32(ids + 0x632BE5AB).unsqueeze(0)))


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums of each row of x [T, N] in fp32, in a fixed order per row.

    The one place sampling's backends differ (bits are promised per backend): `triton`
    runs kernels/zerokl/kernels/triton/sampling.py (one program per row, fp64 chunk scans in ascending
    order); `torch` is CPU torch.cumsum, a sequential left-to-right loop per row that
    accumulates in fp64 and rounds each prefix to fp32 (run on the CPU whatever x's
    device: CUDA's cumsum picks its scan by the tensor's shape); `stock` is plain
    torch.cumsum on x's device (not invariant).
    """
    backend = get_backend()
    if backend == "triton":
        return backend_module("triton").row_cumsum(x)
    if backend == "torch":
        return torch.cumsum(x.double().cpu(), dim=-1).float().to(x.device)
    return torch.cumsum(x, dim=-1)


def _scaled(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, ok): logits / temperature in fp32 (greedy rows unscaled), with every row that has no
    distribution (a NaN or +inf, or no finite value) flagged in ok [T] and replaced by zeros."""
    greedy = params.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature).float()
    z = logits.float() / temp.unsqueeze(1)
    ok = ~(torch.isnan(z) | (z == float("inf"))).any(dim=1) & torch.isfinite(z).any(dim=1)
    return torch.where(ok.unsqueeze(1), z, torch.zeros_like(z)), ok


def _distribution(z: torch.Tensor, params: SamplingParams, filters: tuple[bool, bool] | None = None) -> torch.Tensor:
    """Log-probabilities [T, V] of the sampling distribution of sane scaled logits z.

    ``filters`` = (some row may use top-k or top-p, some row may use top-p), when the caller
    knows it on the host (the engine does, from the requests): then no device value is read
    back (a CUDA graph can hold the whole draw). None: read from params (a host sync). Saying
    True where no row filters only costs time: the result is the same.
    """
    use_top_k, use_top_p = params.top_k > 0, params.top_p < 1.0
    any_filter, any_top_p = filters if filters is not None else (None, None)
    # The vocab sort is skipped when no row filters: a row that keeps every token gets
    # the same bits either way, so this saves work without changing any result.
    if any_filter if any_filter is not None else bool(use_top_k.any() or use_top_p.any()):
        # Greedy rows have temperature 1 here (z is their unscaled logits) and keep them.
        greedy = params.temperature <= 0
        z = torch.where(greedy.unsqueeze(1), z, _top_k_top_p(z, params.top_k, params.top_p, use_top_p, any_top_p))
    return log_softmax(z)


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams,
                      filters: tuple[bool, bool] | None = None) -> torch.Tensor:
    """Log-probabilities [T, V] of the sampling distribution (-inf outside top-k/top-p).

    Rows with temperature 0 get the unmodified log_softmax (see module docstring); rows
    without a distribution (NaN or +inf logits, or none finite) are NaN. ``filters``: as
    :func:`_distribution` (known on the host: no device value read back).
    """
    z, ok = _scaled(logits, params)
    return _distribution(z, params, filters).masked_fill(~ok.unsqueeze(1), float("nan"))


def _top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_top_p: torch.Tensor,
                 any_top_p: bool | None = None) -> torch.Tensor:
    """Mask z [T, V] to each row's top-k by rank (ties to the lower id), then its top-p prefix
    (skipped when ``any_top_p`` is False, or None and no row of use_top_p is set)."""
    t, v = z.shape
    order = torch.sort(z + 0.0, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(v, device=z.device).expand(t, v))
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    z = z.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    if any_top_p if any_top_p is not None else bool(use_top_p.any()):
        probs_sorted = softmax(z.detach()).gather(1, order)         # only picks a mask: no gradient
        before = row_cumsum(probs_sorted) - probs_sorted                 # mass ranked before each token
        keep_sorted = before < top_p.float().unsqueeze(1)
        keep_sorted[:, 0] = True            # the top token always stays (before is 0 there; top_p <= 0 kept none)
        keep_p = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        z = torch.where(use_top_p.unsqueeze(1), z.masked_fill(~keep_p, float("-inf")), z)
    return z


def sampling_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingParams,
                      filters: tuple[bool, bool] | None = None) -> torch.Tensor:
    """Logprob [T] of token_ids under each row's sampling distribution (``filters``: see :func:`_distribution`)."""
    return filtered_logprobs(logits, params, filters).gather(1, token_ids.view(-1, 1).long()).squeeze(1)


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the row maximum, ties to the lowest index (x has no NaN: every row has one)."""
    v = x.shape[-1]
    is_max = x == x.amax(dim=-1, keepdim=True)
    ids = torch.arange(v, device=x.device).expand_as(x)
    return torch.where(is_max, ids, torch.full_like(ids, v)).amin(dim=-1)


class Draw(NamedTuple):
    """What `sample` drew: one token per row, its logprob, and whether the row had a distribution."""

    tokens: torch.Tensor     # [T] int64
    logprobs: torch.Tensor   # [T] fp32, under the sampling distribution
    ok: torch.Tensor         # [T] bool; False: NaN/+inf logits or none finite (token and logprob meaningless)


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)). On CPUs through portable.log (torch.log's CPU code follows
    the machine's vendor and ISA); on GPUs torch.log, one instruction sequence per element."""
    log = torch.log if u.is_cuda else portable.log
    return -log(-log(u))


def sample(logits: torch.Tensor, params: SamplingParams, filters: tuple[bool, bool] | None = None) -> Draw:
    """Draw one token per row: Draw(tokens, logprobs under the sampling distribution, ok).

    Callers must check `ok` (on the host) and fail the requests of rows where it is False;
    those rows are drawn from zeros, so every index stays in range and no NaN appears.
    ``filters``: (any row may use top-k/top-p, any row may use top-p) known on the host; with
    it the draw reads nothing back from the device (see _distribution); the bits are the same.
    """
    z, ok = _scaled(logits, params)
    logp = _distribution(z, params, filters)
    greedy = params.temperature <= 0
    gumbel = _gumbel(uniform_noise(params.seed, params.position, logits.shape[-1]))
    drawn = _first_argmax(logp + gumbel)
    tokens = torch.where(greedy, _first_argmax(z), drawn)
    return Draw(tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1), ok)
