"""Typed requests and results of the inference services (no protobuf here: convert.py converts).

The engine's own types (:mod:`zerokl.services.engine.types`) describe what one
replica computes; these add what crosses the wire around them: a prompt that
may still be text, version pins, per-sample usage, the identity that computed
a response, and the header of a KV handoff.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from zerokl.vocab import FinishReason, SamplingOptions

__all__ = [
    "InferenceRequest",
    "Usage",
    "GenerateDelta",
    "coalesce",
    "SampleResult",
    "fold_samples",
    "GenerateResult",
    "ScoreResult",
    "SleepState",
    "TensorLayout",
    "KVHeader",
]


@dataclass(frozen=True)
class InferenceRequest:
    """A Generate or Score request as a client states it.

    Exactly one of ``prompt_ids`` and ``prompt_text`` is set (the server
    tokenizes text). Empty pins mean "any"; an empty ``request_id`` lets the
    server assign one.
    """

    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    options: SamplingOptions = SamplingOptions()
    request_id: str = ""
    weights_version: str = ""
    numerics_fingerprint: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0          # this sample's tokens so far
    cached_tokens: int = 0              # prompt tokens served from a prefix cache


@dataclass(frozen=True)
class GenerateDelta:
    """One streamed delta of one sample, with the identity that computed it."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str = ""
    finish_reason: FinishReason | None = None      # "stop" | "length" | "abort"; None while running
    prompt_logprobs: tuple[float, ...] | None = None
    usage: Usage = Usage()
    weights_version: str = ""
    numerics_fingerprint: str = ""


def coalesce(deltas: Sequence[GenerateDelta]) -> list[GenerateDelta]:
    """``deltas`` (one request's, in stream order) with each sample's consecutive deltas merged into one.

    What a stream that fell behind sends: the same tokens, logprobs and text in the same
    per-sample order, in fewer messages. A merged delta keeps its first part's prompt
    logprobs and its last part's finish reason and usage (usage counts are running totals);
    deltas stamped with another identity are never merged. Samples keep the order in which
    they first appear (clients fold deltas per sample, so only the order within one counts).
    """
    if len(deltas) < 2:
        return list(deltas)
    merged: dict[int, list[GenerateDelta]] = {}
    out: list[list[GenerateDelta]] = []
    for d in deltas:
        group = merged.get(d.index)
        last = group[-1] if group else None
        if (last is None or last.finish_reason is not None or d.prompt_logprobs is not None
                or (last.weights_version, last.numerics_fingerprint) != (d.weights_version, d.numerics_fingerprint)):
            group = merged[d.index] = [d]
            out.append(group)
        else:
            group.append(d)
    return [g[0] if len(g) == 1 else _merge(g) for g in out]


def _merge(group: list[GenerateDelta]) -> GenerateDelta:
    first, last = group[0], group[-1]
    return GenerateDelta(
        request_id=first.request_id, index=first.index,
        token_ids=tuple(t for d in group for t in d.token_ids), logprobs=tuple(x for d in group for x in d.logprobs),
        text="".join(d.text for d in group), finish_reason=last.finish_reason,
        prompt_logprobs=first.prompt_logprobs, usage=last.usage, weights_version=first.weights_version,
        numerics_fingerprint=first.numerics_fingerprint)


@dataclass
class SampleResult:
    """Everything one sample produced (deltas concatenated)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[float] | None = None


def fold_samples(pieces: Iterable) -> dict[int, SampleResult]:
    """Concatenate per-sample pieces, in any interleaving, into one SampleResult per index.

    A piece is anything with index, token_ids, logprobs, text, finish_reason and
    prompt_logprobs: a stream's GenerateDelta or an engine's SampleOutput. Prompt logprobs
    are the first piece's that has them (they are sent once per request).
    """
    samples: dict[int, SampleResult] = {}
    for p in pieces:
        s = samples.setdefault(p.index, SampleResult(p.index))
        s.token_ids.extend(p.token_ids)
        s.logprobs.extend(p.logprobs)
        s.text += p.text
        if p.finish_reason is not None:
            s.finish_reason = p.finish_reason
        if p.prompt_logprobs is not None and s.prompt_logprobs is None:
            s.prompt_logprobs = list(p.prompt_logprobs)
    return samples


@dataclass
class GenerateResult:
    """A whole Generate stream, collected: samples in index order."""

    request_id: str
    samples: list[SampleResult]
    usage: Usage
    weights_version: str
    numerics_fingerprint: str

    @staticmethod
    def collect(deltas: list[GenerateDelta]) -> "GenerateResult":
        """Fold a stream's deltas (any interleaving of samples) into per-sample results.

        Usage is summed over samples (prompt and cached tokens counted once); the
        identity is the one every delta carried.
        """
        idents = {(d.weights_version, d.numerics_fingerprint) for d in deltas}
        if len(idents) > 1:
            raise ValueError(f"a stream's deltas name more than one weights version / fingerprint: {sorted(idents)}")
        samples = fold_samples(deltas)
        usage = {d.index: d.usage for d in deltas}
        first = next(iter(usage.values()), Usage())
        total = Usage(first.prompt_tokens, sum(u.completion_tokens for u in usage.values()), first.cached_tokens)
        wv, fp = next(iter(idents), ("", ""))
        return GenerateResult(deltas[0].request_id if deltas else "", [samples[i] for i in sorted(samples)],
                              total, wv, fp)


@dataclass(frozen=True)
class ScoreResult:
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]          # len(token_ids) - 1 values
    weights_version: str = ""
    numerics_fingerprint: str = ""


@dataclass(frozen=True)
class SleepState:
    """A replica's (or the fleet's) sleep after a Sleep or Wake call (co-location with a trainer)."""

    level: int                  # 0 awake; 1 the KV cache released; 2 the weights too (the fleet's deepest)
    released_bytes: int = 0     # device bytes the call released (summed over the fleet on the scheduler)


@dataclass(frozen=True)
class TensorLayout:
    """Where one KV tensor lies in a handoff blob (little-endian, row-major)."""

    name: str                            # "latent" | "rope" | "index_k"
    dtype: str                           # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[int, ...]               # [layers, num_tokens, dim]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class KVHeader:
    """What precedes a KV blob: the prompt, the blob's layout and checksum, who computed it, and
    the first token each sample drew from it (``first_token_ids[i]``, ``first_logprobs[i]``)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    num_tokens: int
    tensors: tuple[TensorLayout, ...]
    total_bytes: int
    sha256: bytes
    weights_version: str
    numerics_fingerprint: str
    model_config_hash: str
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[float, ...] | None = None
    first_token_ids: tuple[int, ...] = ()
    first_logprobs: tuple[float, ...] = ()
