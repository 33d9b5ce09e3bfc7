"""Fused per-token logprobs over the vocabulary: the model's head and the sampling
distribution's logprob, computed in row chunks forward and backward.

The unfused training path builds logits [N, V] in the model dtype, then the sampling
distribution's fp32 copies of them (scaled logits, log_softmax, and for top-k/top-p the
sort and masks), and autograd keeps several of those [N, V] tensors alive until the
backward. At GLM-5's vocabulary (154,880) one fp32 copy of 16,384 tokens is 10 GB.

`fused_logprobs` runs `head` (final norm + lm_head) and `sampling_logprobs` on at most
`chunk_rows` rows at a time and keeps only the hidden rows [N, D] for the backward,
which recomputes one chunk's logits, differentiates that chunk, and moves on: at most
one chunk's [C, V] intermediates exist at any time, forward or backward.

Bits. The head (RMSNorm, then the invariant GEMM) and every step of
`sampling_logprobs` are defined row by row, so on the invariant backends a chunk's
logprobs are exactly the rows of the unfused result (the engine relies on the same
property when it computes logits only for the rows it samples): the forward is
bitwise the unfused one. The backward is deterministic (fixed chunk order, the head's
parameter gradients summed over chunks in fp32 in ascending order, then rounded once
to the parameter dtype; on CUDA, when no row filters by top-k/top-p, the logits'
gradient is one Triton pass per row, triton.logprob_backward); it equals the unfused
gradient to accuracy tolerance, not bitwise, since the unfused path reduces the
parameter gradient over all rows in one GEMM (a different summation order).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from zerokl.kernels.backend import backend_module
from zerokl.kernels.ops import _own_grad_applies
from zerokl.kernels.sampling import SamplingParams, sampling_logprobs

__all__ = ["CHUNK_ELEMENTS", "chunk_rows_for", "fused_logprobs", "logprobs_reference"]

# fp32 elements of one chunk's [C, V] logits: 2**27 (512 MiB) keeps a few live copies of a
# chunk far below the activations of a long sequence, while C stays large enough (866 rows
# at V = 154,880; 4,096 at 32,768) for the lm_head GEMM to run at full speed.
CHUNK_ELEMENTS = 1 << 27


def chunk_rows_for(vocab: int) -> int:
    """Rows per chunk for a vocabulary of `vocab` (CHUNK_ELEMENTS fp32 logits per chunk)."""
    return max(1, CHUNK_ELEMENTS // vocab)


def _rows(params: SamplingParams, start: int, end: int) -> SamplingParams:
    """The sampling parameters of rows start:end (every field is a per-row [T] tensor)."""
    return SamplingParams(**{f.name: getattr(params, f.name)[start:end] for f in dataclasses.fields(params)})


def logprobs_reference(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                       targets: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The unfused definition: sampling_logprobs(head(hidden), targets, params) -> [N] fp32."""
    return sampling_logprobs(head(hidden), targets, params)


class _FusedLogprobs(torch.autograd.Function):
    """Chunked head + sampling logprobs; the backward recomputes each chunk (see module docstring)."""

    @staticmethod
    def forward(ctx, head, params, filters, chunk, hidden, targets, *weights):
        ctx.head, ctx.params, ctx.filters, ctx.chunk, ctx.weights = head, params, filters, chunk, weights
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            out[start:end] = sampling_logprobs(head(hidden[start:end]), targets[start:end], _rows(params, start, end),
                                               filters)
        ctx.save_for_backward(hidden, targets, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, targets, out = ctx.saved_tensors
        need_hidden = ctx.needs_input_grad[4]
        # No row filters (known on the host) and a CUDA Triton step: the logits' gradient in one
        # Triton pass per row, not by differentiating sampling_logprobs' [C, V] fp32 steps.
        direct = ctx.filters == (False, False) and _own_grad_applies(hidden)
        weights = [w for w, need in zip(ctx.weights, ctx.needs_input_grad[6:]) if need]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulators, summed chunk by chunk in ascending order, rounded once at the end.
        acc = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights]
        n, chunk = hidden.shape[0], ctx.chunk
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            h = hidden[start:end].detach().requires_grad_(need_hidden)
            rows = _rows(ctx.params, start, end)
            wrt = ([h] if need_hidden else []) + weights
            with torch.enable_grad():
                logits = ctx.head(h)
                y = logits if direct else sampling_logprobs(logits, targets[start:end], rows, ctx.filters)
            dy = (_logits_grad(logits.detach(), targets[start:end], rows, out[start:end], grad_out[start:end])
                  if direct else grad_out[start:end])
            grads = list(torch.autograd.grad(y, wrt, dy, allow_unused=True))
            if need_hidden:
                g = grads.pop(0)
                grad_hidden[start:end] = 0 if g is None else g
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g)                # fp32 += the model-dtype gradient (promoted in the add: no copy)
        got = iter(a.to(w.dtype) for a, w in zip(acc, weights))
        grad_weights = tuple(next(got) if need else None for need in ctx.needs_input_grad[6:])
        return (None, None, None, None, grad_hidden, None) + grad_weights


def _logits_grad(logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams, lp: torch.Tensor,
                 grad: torch.Tensor) -> torch.Tensor:
    """d(sum grad * lp) / d logits [C, V] of unfiltered sampling logprobs lp [C]: (onehot(target) -
    softmax(z)) * grad / temperature with z = logits / temperature (greedy rows: 1), zero for a
    row without a distribution (lp NaN), as differentiating filtered_logprobs gives."""
    temp = torch.where(params.temperature <= 0, torch.ones_like(params.temperature), params.temperature).float()
    scale = torch.where(torch.isnan(lp), torch.zeros_like(grad), grad / temp)
    return backend_module("triton").logprob_backward(logits, targets, temp, scale)


def fused_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                   weights: Sequence[torch.Tensor], targets: torch.Tensor, params: SamplingParams,
                   chunk_rows: int | None = None, filters: tuple[bool, bool] | None = None) -> torch.Tensor:
    """Logprob [N] (fp32) of targets [N] under each row's sampling distribution of head(hidden).

    hidden [N, D]: the rows whose next token is scored (e.g. the residual stream before the
    final norm); head maps rows [C, D] -> logits [C, V] row by row; weights: every tensor
    head reads that may need a gradient (gradients reach them through this op's backward);
    params: per-row SamplingParams [N]. chunk_rows: rows per chunk (default
    chunk_rows_for(V), found from one row of the head). filters: (some row may use top-k or
    top-p, some row may use top-p) when the caller knows them (sampling._distribution: then
    nothing is read back from the device, so a CUDA graph can hold the op). Bitwise equal to
    logprobs_reference on row-invariant heads; see the module docstring for the gradient.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"fused_logprobs: hidden must be [N, D] and targets [N], got {tuple(hidden.shape)}, "
                         f"{tuple(targets.shape)}")
    n = hidden.shape[0]
    if n == 0:
        return hidden.new_zeros(0, dtype=torch.float32).requires_grad_(hidden.requires_grad)
    if chunk_rows is None:
        with torch.no_grad():
            chunk_rows = chunk_rows_for(head(hidden[:1]).shape[-1])
    if chunk_rows < 1:
        raise ValueError(f"fused_logprobs: chunk_rows must be >= 1, got {chunk_rows}")
    return _FusedLogprobs.apply(head, params, filters, int(chunk_rows), hidden, targets, *weights)
