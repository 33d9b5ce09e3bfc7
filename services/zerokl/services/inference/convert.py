"""The only conversions between inference dataclasses and ``zerokl.v1`` inference messages.

One function per type and direction; servicers and the client call these at
the edge and nothing else touches generated classes. Absent optional fields
take the engine's defaults (:class:`SamplingOptions`), so a default has one
home. Logprobs are fp32 numbers and travel as proto ``float``: exact.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zerokl.services.inference.types import (
    GenerateDelta,
    InferenceRequest,
    KVHeader,
    ScoreResult,
    SleepState,
    TensorLayout,
    Usage,
)
from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.runtime.optrace import trace_from_proto, trace_options_from_proto, trace_to_proto
from zerokl.v1 import inference_pb2
from zerokl.vocab import InvalidOption, SamplingOptions

if TYPE_CHECKING:    # the trace types hold tensors: torch only where a trace is made or read
    from zerokl.kernels.trace import Trace

__all__ = [
    "sampling_to_proto",
    "sampling_from_proto",
    "request_to_proto",
    "request_from_proto",
    "score_request_to_proto",
    "score_trace_from_proto",
    "delta_to_proto",
    "delta_from_proto",
    "score_result_to_proto",
    "score_result_from_proto",
    "score_response_trace",
    "kv_header_to_proto",
    "kv_header_from_proto",
    "sleep_level_from_proto",
    "sleep_state_to_proto",
    "sleep_state_from_proto",
]

_DEFAULTS = SamplingOptions()

_FINISH_TO_PROTO = {
    None: inference_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "abort": inference_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def sampling_to_proto(o: SamplingOptions) -> inference_pb2.SamplingParams:
    """SamplingOptions -> ``zerokl.v1.SamplingParams`` (every field set explicitly)."""
    return inference_pb2.SamplingParams(
        temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, seed=o.seed, max_tokens=o.max_tokens,
        stop=list(o.stop), stop_token_ids=list(o.stop_token_ids), n=o.n, ignore_eos=o.ignore_eos,
        prompt_logprobs=o.prompt_logprobs)


def sampling_from_proto(msg: inference_pb2.SamplingParams) -> SamplingOptions:
    """``zerokl.v1.SamplingParams`` -> SamplingOptions; absent fields take the engine's defaults.

    Values are checked by meaning here, where a request enters any service
    (:meth:`SamplingOptions.check`: ranges, finite floats, non-empty stop strings),
    so a scheduler refuses what its replicas would: INVALID_ARGUMENT naming
    ``sampling.<field>``. What needs the model (the vocabulary) the engine checks.
    """
    def get(name: str):  # noqa: ANN202 - a field of any type
        return getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULTS, name)

    options = SamplingOptions(
        temperature=get("temperature"), top_p=get("top_p"), top_k=get("top_k"), seed=get("seed"),
        max_tokens=get("max_tokens"), stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, n=get("n"), prompt_logprobs=msg.prompt_logprobs)
    try:
        options.check()
    except InvalidOption as err:
        raise InvalidArgument.field(f"sampling.{err.field}", str(err)) from None
    return options


def _set_prompt(msg, r: InferenceRequest) -> None:  # noqa: ANN001 - GenerateRequest or ScoreRequest
    if r.prompt_ids is not None and r.prompt_text is not None:
        raise ValueError("set at most one of prompt_ids and prompt_text")
    if r.prompt_ids is not None:
        msg.prompt_token_ids.ids.extend(r.prompt_ids)
        msg.prompt_token_ids.SetInParent()  # present even when empty: an empty prompt is refused, not missing
    elif r.prompt_text is not None:
        msg.prompt_text = r.prompt_text


def _get_prompt(msg) -> tuple[tuple[int, ...] | None, str | None]:  # noqa: ANN001
    which = msg.WhichOneof("prompt")
    if which == "prompt_token_ids":
        return tuple(msg.prompt_token_ids.ids), None
    if which == "prompt_text":
        return None, msg.prompt_text
    return None, None


def request_to_proto(r: InferenceRequest) -> inference_pb2.GenerateRequest:
    """InferenceRequest -> ``zerokl.v1.GenerateRequest``."""
    msg = inference_pb2.GenerateRequest(request_id=r.request_id, sampling=sampling_to_proto(r.options),
                                        weights_version=r.weights_version,
                                        numerics_fingerprint=r.numerics_fingerprint)
    _set_prompt(msg, r)
    return msg


def request_from_proto(msg: inference_pb2.GenerateRequest | inference_pb2.ScoreRequest) -> InferenceRequest:
    """``zerokl.v1.GenerateRequest`` or ``ScoreRequest`` (the same fields) -> InferenceRequest
    (no prompt at all leaves both fields None)."""
    ids, text = _get_prompt(msg)
    return InferenceRequest(ids, text, sampling_from_proto(msg.sampling), msg.request_id, msg.weights_version,
                            msg.numerics_fingerprint)


def score_request_to_proto(r: InferenceRequest) -> inference_pb2.ScoreRequest:
    """InferenceRequest -> ``zerokl.v1.ScoreRequest`` (only temperature, top_k, top_p are sent)."""
    msg = inference_pb2.ScoreRequest(
        request_id=r.request_id, weights_version=r.weights_version, numerics_fingerprint=r.numerics_fingerprint,
        sampling=inference_pb2.SamplingParams(temperature=r.options.temperature, top_p=r.options.top_p,
                                              top_k=r.options.top_k))
    _set_prompt(msg, r)
    return msg


def score_trace_from_proto(msg: inference_pb2.ScoreRequest) -> tuple[str, ...] | None:
    """The capture keys when the ScoreRequest asks for a trace (zerokl diff), else None."""
    return trace_options_from_proto(msg.trace) if msg.HasField("trace") else None


def delta_to_proto(d: GenerateDelta) -> inference_pb2.GenerateResponse:
    """GenerateDelta -> ``zerokl.v1.GenerateResponse``."""
    msg = inference_pb2.GenerateResponse(
        request_id=d.request_id, index=d.index, token_ids=list(d.token_ids), logprobs=list(d.logprobs),
        text=d.text, finish_reason=_FINISH_TO_PROTO[d.finish_reason],
        usage=inference_pb2.Usage(prompt_tokens=d.usage.prompt_tokens, completion_tokens=d.usage.completion_tokens,
                                  cached_tokens=d.usage.cached_tokens),
        weights_version=d.weights_version, numerics_fingerprint=d.numerics_fingerprint)
    if d.prompt_logprobs is not None:
        msg.prompt_logprobs.values.extend(d.prompt_logprobs)
        msg.prompt_logprobs.SetInParent()
    return msg


def delta_from_proto(msg: inference_pb2.GenerateResponse) -> GenerateDelta:
    """``zerokl.v1.GenerateResponse`` -> GenerateDelta."""
    u = msg.usage
    return GenerateDelta(
        request_id=msg.request_id, index=msg.index, token_ids=tuple(msg.token_ids), logprobs=tuple(msg.logprobs),
        text=msg.text, finish_reason=_FINISH_FROM_PROTO.get(msg.finish_reason),
        prompt_logprobs=tuple(msg.prompt_logprobs.values) if msg.HasField("prompt_logprobs") else None,
        usage=Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
        weights_version=msg.weights_version, numerics_fingerprint=msg.numerics_fingerprint)


def score_result_to_proto(r: ScoreResult, trace: Trace | None = None) -> inference_pb2.ScoreResponse:
    """ScoreResult (and the trace, when one was asked for) -> ``zerokl.v1.ScoreResponse``."""
    msg = inference_pb2.ScoreResponse(request_id=r.request_id, token_ids=list(r.token_ids),
                                      logprobs=list(r.logprobs), weights_version=r.weights_version,
                                      numerics_fingerprint=r.numerics_fingerprint)
    if trace is not None:
        msg.trace.CopyFrom(trace_to_proto(trace))
    return msg


def score_result_from_proto(msg: inference_pb2.ScoreResponse) -> ScoreResult:
    """``zerokl.v1.ScoreResponse`` -> ScoreResult."""
    return ScoreResult(msg.request_id, tuple(msg.token_ids), tuple(msg.logprobs), msg.weights_version,
                       msg.numerics_fingerprint)


def score_response_trace(msg: inference_pb2.ScoreResponse) -> Trace | None:
    """The trace a ScoreResponse carries, if any."""
    return trace_from_proto(msg.trace) if msg.HasField("trace") else None


def kv_header_to_proto(h: KVHeader) -> inference_pb2.KVHeader:
    """KVHeader -> ``zerokl.v1.KVHeader``."""
    msg = inference_pb2.KVHeader(
        request_id=h.request_id, prompt_token_ids=list(h.prompt_ids), num_tokens=h.num_tokens,
        tensors=[inference_pb2.TensorLayout(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset,
                                            nbytes=t.nbytes) for t in h.tensors],
        total_bytes=h.total_bytes, sha256=h.sha256, weights_version=h.weights_version,
        numerics_fingerprint=h.numerics_fingerprint, model_config_hash=h.model_config_hash,
        num_cached_tokens=h.num_cached_tokens, first_token_ids=list(h.first_token_ids),
        first_logprobs=list(h.first_logprobs))
    if h.prompt_logprobs is not None:
        msg.prompt_logprobs.values.extend(h.prompt_logprobs)
        msg.prompt_logprobs.SetInParent()
    return msg


def kv_header_from_proto(msg: inference_pb2.KVHeader) -> KVHeader:
    """``zerokl.v1.KVHeader`` -> KVHeader (checked against the model by :func:`kv.check_header`)."""
    return KVHeader(
        request_id=msg.request_id, prompt_ids=tuple(msg.prompt_token_ids), num_tokens=msg.num_tokens,
        tensors=tuple(TensorLayout(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in msg.tensors),
        total_bytes=msg.total_bytes, sha256=msg.sha256, weights_version=msg.weights_version,
        numerics_fingerprint=msg.numerics_fingerprint, model_config_hash=msg.model_config_hash,
        num_cached_tokens=msg.num_cached_tokens,
        prompt_logprobs=tuple(msg.prompt_logprobs.values) if msg.HasField("prompt_logprobs") else None,
        first_token_ids=tuple(msg.first_token_ids), first_logprobs=tuple(msg.first_logprobs))


def sleep_level_from_proto(request: inference_pb2.SleepRequest) -> int:
    """A Sleep call's level (1 or 2); INVALID_ARGUMENT naming the field otherwise."""
    if request.level not in (1, 2):
        raise InvalidArgument.field("level", f"must be 1 (the KV cache) or 2 (the KV cache and the weights), "
                                             f"got {request.level}")
    return int(request.level)


def sleep_state_to_proto(state: SleepState) -> inference_pb2.SleepResponse:
    return inference_pb2.SleepResponse(level=state.level, released_bytes=state.released_bytes)


def sleep_state_from_proto(msg: inference_pb2.SleepResponse) -> SleepState:
    return SleepState(int(msg.level), int(msg.released_bytes))
