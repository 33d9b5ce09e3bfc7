"""One serving replica: its engine, what it computes with, and the request rules it applies.

:class:`Replica` turns a client's :class:`InferenceRequest` into an engine
request (pins checked, text tokenized, limits applied) and the engine's
:class:`SampleOutput` s into :class:`GenerateDelta` s stamped with the
replica's weights version and numerics fingerprint. Both services use it: a
decode replica to generate, a prefill replica to prefill and score.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from zerokl.tokenizer import Tokenizer
from zerokl.services.engine.types import GenerateRequest, KVHandoff, SampleOutput
from zerokl.services.inference.async_engine import AsyncEngine, RequestStream, collect
from zerokl.services.inference.types import GenerateDelta, InferenceRequest, ScoreResult, SleepState, Usage
from zerokl.services.runtime.errors import (
    Cancelled,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PreconditionViolation,
    ResourceExhausted,
    Unavailable,
)
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.runtime.optrace import identity_meta
from zerokl.vocab import SamplingOptions

if TYPE_CHECKING:    # a trace holds tensors: torch only where one is made (the engine's core) or read
    from zerokl.kernels.trace import Trace

__all__ = ["ServingLimits", "Replica"]


@dataclass(frozen=True)
class ServingLimits:
    """Per-request limits a replica enforces on top of the engine's own checks."""

    max_n: int = 16                      # samples per request
    stream_interval: int = 1             # after a stream's first message, engine outputs per message


class Replica:
    """An :class:`AsyncEngine` plus the identity it serves under and its request rules."""

    def __init__(self, engine: AsyncEngine, identity: ServiceIdentity, tokenizer: Tokenizer | None = None,
                 limits: ServingLimits = ServingLimits()) -> None:
        self.engine = engine
        self._identity = identity
        engine.weights_version = identity.weights_version
        engine.set_cache_identity(identity.weights_version, identity.numerics_fingerprint)
        self.tokenizer = tokenizer
        self.limits = limits
        # What the engine reported of itself (it may run in another process): read-only.
        info = engine.info
        self.model_config = info.model_config      # the config's dict (ModelConfig.to_dict())
        self.dtype = info.dtype                    # the activations' (and KV's) dtype name
        self.max_model_len = info.max_model_len
        self._block_size = info.block_size
        self._num_blocks = info.num_blocks
        self._lockstep = info.lockstep

    @property
    def identity(self) -> ServiceIdentity:
        """What this replica computes with now (the weights version changes at a swap)."""
        return dataclasses.replace(self._identity, weights_version=self.engine.weights_version)

    async def load_weights(self, state_dict: dict | Callable[[Any], dict], version: str) -> ServiceIdentity:
        """Serve ``version`` from now on: waits for admitted requests, then swaps (see AsyncEngine)."""
        await self.engine.load_weights(state_dict, version)
        return self.identity

    async def sleep(self, level: int) -> SleepState:
        """Release the KV cache (``level`` 1) or the weights too (2) for a co-located trainer, once the
        admitted requests finished; requests wait meanwhile (see AsyncEngine.sleep)."""
        released = await self.engine.sleep(level)
        return SleepState(self.engine.sleep_level, int(released or 0))

    async def wake(self) -> SleepState:
        """Serve again (FAILED_PRECONDITION while the weights are released: a weight switch wakes it)."""
        await self.engine.wake()
        return SleepState(self.engine.sleep_level)

    # ------------------------------------------------------------------ request rules

    def check_pins(self, r: InferenceRequest) -> None:
        """FAILED_PRECONDITION when the request is pinned to weights or numerics this replica lacks."""
        if not r.weights_version and not r.numerics_fingerprint:
            return
        violations = [
            PreconditionViolation(kind, want, f"pinned {kind.lower()} {want!r}, this replica serves {have!r}")
            for kind, want, have in (("WEIGHTS_VERSION", r.weights_version, self.engine.weights_version),
                                     ("NUMERICS_FINGERPRINT", r.numerics_fingerprint,
                                      self._identity.numerics_fingerprint))
            if want and want != have]
        if violations:
            raise FailedPrecondition("; ".join(v.description for v in violations),
                                     precondition_violations=violations)

    def prompt_ids(self, r: InferenceRequest) -> tuple[int, ...]:
        """The prompt as token ids (text goes through the tokenizer, no special tokens added)."""
        if r.prompt_ids is not None and r.prompt_text is not None:
            raise InvalidArgument.field("prompt", "set only one of prompt_text and prompt_token_ids")
        if r.prompt_ids is not None:
            return tuple(r.prompt_ids)
        if r.prompt_text is None:
            raise InvalidArgument.field("prompt", "set prompt_text or prompt_token_ids")
        if self.tokenizer is None:
            raise InvalidArgument.field("prompt_text", "this replica has no tokenizer; send prompt_token_ids")
        unknown = list(dict.fromkeys(self.tokenizer.unknown_pieces(r.prompt_text)))    # distinct, in order
        if unknown:
            # Encoding them as unk would compute a prompt the client did not write.
            shown = ", ".join(repr(u) for u in unknown[:10]) + (f" and {len(unknown) - 10} more"
                                                               if len(unknown) > 10 else "")
            raise InvalidArgument.field("prompt_text", f"characters outside the tokenizer's vocabulary: {shown}")
        return tuple(self.tokenizer.encode(r.prompt_text))

    def check_generate(self, ids: tuple[int, ...], o: SamplingOptions) -> None:
        """Limits of a generate request the engine does not know about.

        n beyond ``max_n`` is INVALID_ARGUMENT; a request whose samples could
        not all hold their KV at once, even alone on this replica, is
        RESOURCE_EXHAUSTED (the engine would otherwise fail while forking).
        """
        if o.n > self.limits.max_n:
            raise InvalidArgument.field("sampling.n", f"n={o.n} exceeds this replica's limit of {self.limits.max_n}")
        if not ids or o.n < 1 or o.max_tokens < 1:
            return  # the engine names the problem
        bs = self._block_size
        total = min(len(ids) + o.max_tokens, self.max_model_len)
        per_sample = -(-total // bs)
        shared = len(ids) // bs                     # full prompt blocks the siblings share
        need = per_sample + (o.n - 1) * (per_sample - shared)
        if need > self._num_blocks:
            raise ResourceExhausted(
                f"the request needs up to {need} KV blocks of {bs} tokens ({o.n} samples of up to {total} tokens); "
                f"this replica has {self._num_blocks}")

    def check_fits_context(self, ids: tuple[int, ...]) -> None:
        """Generation needs room for at least one new token (the prefill engine only checks <=).

        Checked before any prefill work, naming the client's field (not the KV handoff's).
        """
        if len(ids) >= self.max_model_len:
            raise InvalidArgument.field(
                "prompt", f"the prompt has {len(ids)} tokens and does not fit the context of {self.max_model_len} "
                          f"(max_model_len) with room for a new token: a Generate prompt may have at most "
                          f"{self.max_model_len - 1}")

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    # ------------------------------------------------------------------ serving

    def delta(self, out: SampleOutput, completion_tokens: int, prompt_logprobs: list[float] | None,
              cached_tokens: int | None = None, weights_version: str | None = None) -> GenerateDelta:
        """One engine output as a client delta stamped with the weights that computed it."""
        return GenerateDelta(
            request_id=out.request_id, index=out.index, token_ids=tuple(out.token_ids),
            logprobs=tuple(out.logprobs), text=out.text, finish_reason=out.finish_reason,
            prompt_logprobs=tuple(prompt_logprobs) if prompt_logprobs is not None else None,
            usage=Usage(out.num_prompt_tokens, completion_tokens,
                        out.num_cached_tokens if cached_tokens is None else cached_tokens),
            weights_version=self.identity.weights_version if weights_version is None else weights_version,
            numerics_fingerprint=self._identity.numerics_fingerprint)

    async def generate(self, r: InferenceRequest) -> AsyncIterator[GenerateDelta]:
        """Generate locally (this replica's own chunked prefill)."""
        self.check_pins(r)
        ids = self.prompt_ids(r)
        if ids:
            self.check_fits_context(ids)
        self.check_generate(ids, r.options)
        request = GenerateRequest(r.request_id or self.new_request_id(), ids, r.options)
        async for d in self.stream_deltas(await self.engine.submit(request, r.weights_version)):
            yield d

    async def generate_from_handoff(self, r: InferenceRequest, ids: tuple[int, ...], handoff: KVHandoff,
                                    prompt_logprobs: Sequence[float] | None,
                                    cached_tokens: int, kv_weights_version: str) -> AsyncIterator[GenerateDelta]:
        """Generate from prompt KV computed elsewhere (pins and header already checked).

        The handoff covers the whole prompt and carries each sample's first
        token: the engine emits those in its next step, without a forward, and
        computes from the second token on. The handed-over positions have no
        logits here, so prompt logprobs come from the prefill replica
        (``prompt_logprobs``) and the engine is not asked for them.
        """
        self.check_generate(ids, r.options)
        if r.options.prompt_logprobs and prompt_logprobs is None:
            raise InvalidArgument.field("kv.prompt_logprobs", "the request asks for prompt logprobs and the KV "
                                                              "header carries none")
        options = dataclasses.replace(r.options, prompt_logprobs=False)
        request = GenerateRequest(r.request_id or self.new_request_id(), ids, options, handoff=handoff)
        # Admitted only while this replica still holds the weights that computed the KV.
        stream = await self.engine.submit(request, kv_weights_version)
        injected = list(prompt_logprobs) if r.options.prompt_logprobs and prompt_logprobs is not None else None
        async for d in self.stream_deltas(stream, injected, cached_tokens):
            yield d

    async def stream_deltas(self, stream: RequestStream, prompt_logprobs: list[float] | None = None,
                            cached_tokens: int | None = None) -> AsyncIterator[GenerateDelta]:
        """Deltas of a generate stream; prompt logprobs ride on the request's first delta.

        ``prompt_logprobs`` replaces the engine's (a handoff); otherwise the
        first output's are used. The first output is always sample 0's (its
        siblings fork after it), and the siblings share the prompt, so once
        per request is enough. What arrived since the last message goes out as
        one delta per sample (the stream merges each sample's outputs); after
        the first, a message waits for ``limits.stream_interval`` outputs.
        """
        completion: dict[int, int] = {}
        first = True
        async with stream:
            # n samples produce n outputs a step: the interval counts steps.
            async for batch in stream.batches(self.limits.stream_interval * stream.request.options.n):
                for out in batch:
                    completion[out.index] = completion.get(out.index, 0) + len(out.token_ids)
                    if first:
                        plp = prompt_logprobs if prompt_logprobs is not None else out.prompt_logprobs
                        first = False
                    else:
                        plp = None
                    yield self.delta(out, completion[out.index], plp, cached_tokens, stream.weights_version)

    async def score(self, r: InferenceRequest) -> ScoreResult:
        """Per-token logprobs of the prompt under the request's temperature / top-k / top-p."""
        self.check_pins(r)
        ids = self.prompt_ids(r)
        request = GenerateRequest(r.request_id or self.new_request_id(), ids, r.options, mode="score")
        stream = await self.engine.submit(request, r.weights_version)
        outputs = await collect(stream)
        last = outputs[-1] if outputs else None
        if last is None or last.finish_reason == "abort" or last.prompt_logprobs is None:
            raise Cancelled(f"score request {request.request_id!r} was aborted")
        if len(last.prompt_logprobs) != len(ids) - 1:
            raise Internal(f"the engine returned {len(last.prompt_logprobs)} logprobs for {len(ids)} tokens")
        return ScoreResult(request.request_id, ids, tuple(last.prompt_logprobs), stream.weights_version,
                           self._identity.numerics_fingerprint)

    async def trace(self, ids: tuple[int, ...], options: SamplingOptions, capture: tuple[str, ...] = ()) -> Trace:
        """The per-op trace of ``ids`` (zerokl diff) on this replica's model, backend and dtype.

        Computed by the engine's core between two steps (it may run in another process: the
        model lives there). A weights swap that lands meanwhile makes it UNAVAILABLE; `zerokl diff`
        also checks the trace's logprobs against the Score's.
        """
        if self._lockstep:
            # Its forward runs collectives in lockstep with the followers' engines: not one rank alone.
            raise FailedPrecondition("a tensor-parallel replica cannot trace (trace a --tp 1 replica of the same "
                                     "fingerprint: it computes the same bits)")
        before = self.engine.weights_version
        identity = self.identity
        trace = await self.engine.call(_trace, ids, options.temperature, options.top_k, options.top_p, capture,
                                       identity_meta(identity))
        if self.engine.weights_version != before or self.engine.weights_version != identity.weights_version:
            raise Unavailable("the weights changed while the trace ran; ask again")
        return trace

    async def prefill(self, request_id: str, ids: tuple[int, ...], options: SamplingOptions,
                      pinned_version: str = "") -> tuple[SampleOutput, str] | None:
        """Run the prompt through the engine in prefill mode: the output carrying the KV handoff
        (the whole prompt's KV and each sample's first token), and the weights version that computed it.

        None when the request was aborted before its KV was complete.
        """
        request = GenerateRequest(request_id, ids, options, mode="prefill")
        stream = await self.engine.submit(request, pinned_version)
        outputs = await collect(stream)
        last = outputs[-1] if outputs else None
        if last is None or last.finish_reason == "abort" or last.handoff is None:
            return None
        return last, stream.weights_version

    def abort(self, request_id: str) -> bool:
        """Abort a request running in this replica's engine."""
        return self.engine.abort(request_id)


def _trace(engine, ids, temperature, top_k, top_p, capture, meta) -> Trace:  # noqa: ANN001
    """Run by the engine core: the per-op trace of ``ids`` on the engine's model."""
    from zerokl.kernels.trace import trace_sequence    # here: where the model is, torch with it
    return trace_sequence(engine.model, ids, temperature, top_k, top_p, capture, meta)
