"""What a client has already received of a Generate stream, so a retry continues it exactly.

Outputs are deterministic: the same request on another replica that
computes the same bits (same pin) produces the same tokens, logprobs and
text. When a replica fails mid-stream the scheduler re-runs the request on
another one from the start; :class:`StreamLedger` swallows the replayed
prefix of every sample after checking it equals what was sent (exact token
ids, exact fp32 logprobs, text, prompt logprobs) and forwards only what is
new. A replay that differs means the determinism contract broke somewhere:
the call fails with DATA_LOSS rather than hand the client a spliced output.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zerokl.services.inference.types import GenerateDelta, Usage
from zerokl.services.runtime.errors import DataLoss
from zerokl.services.routing.router import Pin
from zerokl.vocab import FinishReason

__all__ = ["StreamLedger"]


@dataclass
class _Sample:
    """One sample as the client has seen it, plus the current attempt's cursor into it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    attempt_tokens: int = 0      # tokens the current attempt has produced for this sample
    attempt_text: str = ""       # text the current attempt has produced for this sample


class StreamLedger:
    """Per-sample record of one request's forwarded deltas, across attempts on several replicas."""

    def __init__(self, request_id: str, n: int, pin: Pin) -> None:
        self.request_id = request_id
        self.pin = pin
        self._samples = [_Sample() for _ in range(n)]
        self._prompt_logprobs: tuple[float, ...] | None = None
        self._replica = ""          # the replica the current attempt runs on (for messages)
        self._sent_by: str = ""     # the replica that produced the first forwarded delta

    @property
    def done(self) -> bool:
        """Every sample has sent its finish reason."""
        return all(s.finish_reason is not None for s in self._samples)

    @property
    def sent_tokens(self) -> int:
        """Tokens forwarded so far over all samples."""
        return sum(len(s.token_ids) for s in self._samples)

    def begin_attempt(self, replica: str) -> None:
        """A new attempt on ``replica`` starts: its deltas replay every sample from the beginning."""
        self._replica = replica
        for s in self._samples:
            s.attempt_tokens = 0
            s.attempt_text = ""

    def accept(self, d: GenerateDelta) -> GenerateDelta | None:
        """The part of ``d`` the client has not seen yet (None: nothing new), after checking the replayed part."""
        if not 0 <= d.index < len(self._samples):
            raise DataLoss(f"{self._replica} sent sample index {d.index} for a request of {len(self._samples)} samples")
        if (d.weights_version, d.numerics_fingerprint) != (self.pin.weights_version, self.pin.numerics_fingerprint):
            raise DataLoss(f"{self._replica} answered with weights {d.weights_version!r} fingerprint "
                           f"{d.numerics_fingerprint!r}; the request is pinned to {self.pin.describe()}")
        s = self._samples[d.index]
        self._sent_by = self._sent_by or self._replica

        prompt_logprobs = None
        if d.prompt_logprobs is not None:
            if self._prompt_logprobs is None:
                prompt_logprobs = self._prompt_logprobs = d.prompt_logprobs
            elif d.prompt_logprobs != self._prompt_logprobs:
                raise self._diverged(d.index, "prompt logprobs differ")

        # Tokens: the first `overlap` replay what was sent; the rest are new.
        start = s.attempt_tokens
        overlap = max(0, min(len(d.token_ids), len(s.token_ids) - start))
        for k in range(overlap):
            sent = (s.token_ids[start + k], s.logprobs[start + k])
            got = (d.token_ids[k], d.logprobs[k])
            if got != sent:
                raise self._diverged(d.index, f"token {start + k} is id {got[0]} logprob {got[1]!r}; the client "
                                              f"already has id {sent[0]} logprob {sent[1]!r}")
        new_ids, new_logprobs = d.token_ids[overlap:], d.logprobs[overlap:]
        s.attempt_tokens += len(d.token_ids)
        if new_ids and s.finish_reason is not None:
            raise self._diverged(d.index, f"it continues past token {len(s.token_ids)}, where it finished "
                                          f"({s.finish_reason}) before")

        # Text: held-back stop-string text may split differently over deltas, so compare prefixes.
        s.attempt_text += d.text
        common = min(len(s.attempt_text), len(s.text))
        if s.attempt_text[:common] != s.text[:common]:
            raise self._diverged(d.index, f"its text {s.attempt_text!r} does not start like the sent {s.text!r}")
        new_text = s.attempt_text[len(s.text):]

        finish = None
        if d.finish_reason is not None:
            if s.finish_reason is None:
                finish = d.finish_reason
            elif d.finish_reason != s.finish_reason:
                raise self._diverged(d.index, f"it finished with {d.finish_reason}, not {s.finish_reason}")

        if not (new_ids or new_text or finish or prompt_logprobs is not None):
            return None
        s.token_ids += new_ids
        s.logprobs += new_logprobs
        s.text += new_text
        s.finish_reason = finish or s.finish_reason
        s.usage = d.usage
        return dataclasses.replace(d, request_id=self.request_id, token_ids=tuple(new_ids),
                                   logprobs=tuple(new_logprobs), text=new_text, finish_reason=finish,
                                   prompt_logprobs=prompt_logprobs)

    def finish_unfinished(self, reason: FinishReason, prompt_tokens: int = 0) -> list[GenerateDelta]:
        """Closing deltas (e.g. ``abort``) for every sample that has not finished, recorded as sent."""
        out = []
        for index, s in enumerate(self._samples):
            if s.finish_reason is not None:
                continue
            s.finish_reason = reason
            usage = s.usage or Usage(prompt_tokens, 0, 0)
            out.append(GenerateDelta(self.request_id, index, (), (), finish_reason=reason,
                                     usage=dataclasses.replace(usage, completion_tokens=len(s.token_ids)),
                                     weights_version=self.pin.weights_version,
                                     numerics_fingerprint=self.pin.numerics_fingerprint))
        return out

    def _diverged(self, index: int, what: str) -> DataLoss:
        return DataLoss(f"request {self.request_id!r} was retried on {self._replica} after a failure and its replay "
                        f"of sample {index} differs from what {self._sent_by} already streamed: {what}. Outputs "
                        f"must be deterministic under one pin ({self.pin.describe()}); refusing to splice them")
