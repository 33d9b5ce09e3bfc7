"""The only conversions between Tinker's wire (JSON bodies, and the protobuf of zerokl.v1.tinker) and the
endpoint's typed requests and results (types.py).

One function per type and direction. Requests are checked here for what needs no model (shapes,
types, names, the loss's inputs); what needs the model (token ids in its vocabulary, lengths within
its context) is checked by the service, and the trainer and the replicas check again. A bad field is
an :class:`~zerokl.services.runtime.errors.InvalidArgument` naming it (HTTP 400 at the edge).
Logprobs are fp32 and travel as float32 arrays (exact).
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

import numpy as np
from google.protobuf.message import DecodeError

from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.tinker_api.types import (
    Checkpoint,
    ForwardBackwardCall,
    ForwardBackwardOutcome,
    LoadCall,
    ModelSpec,
    OptimStepCall,
    SampleCall,
    SampleOutcome,
    SaveCall,
)
from zerokl.services.trainer.losses import TOKEN_LOSSES
from zerokl.services.trainer.types import AdamParams
from zerokl.services.trainer.types import TokenSequence
from zerokl.v1 import tinker_pb2
from zerokl.vocab import InvalidOption, SamplingOptions

__all__ = [
    "SAMPLING_KEYS",
    "checkpoint_from_path",
    "model_spec_from_json",
    "call_ids_from_proto",
    "forward_backward_from_proto",
    "forward_backward_output_to_proto",
    "optim_step_from_json",
    "save_from_json",
    "load_from_json",
    "sample_from_json",
    "sample_response_to_proto",
]

#: loss_fn_config keys zerokl adds to every loss: the distribution the training forward takes its
#: logprobs under (sample at the same temperature / top_k / top_p and the ratio is exactly 1).
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
_INPUT_KEYS = {"cross_entropy": ("target_tokens", "weights")}
_RL_INPUT_KEYS = ("target_tokens", "logprobs", "advantages", "weights")   # weights: accepted, unused (as Tinker)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PATH = re.compile(r"tinker://([A-Za-z0-9][A-Za-z0-9_:-]*)/(weights|sampler_weights)/(.+)")
_NP_DTYPES = {tinker_pb2.DTYPE_FLOAT32: np.float32, tinker_pb2.DTYPE_INT64: np.int64,
              tinker_pb2.DTYPE_INT32: np.int32}


# ----------------------------------------------------------------------------- small readers

def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *, required: bool = False,
           default: Any = None, where: str = "") -> Any:
    """``body[name]`` checked to be of ``kind`` (bool is never an int here); absent: ``default``."""
    value = body.get(name)
    path = f"{where}{name}"
    if value is None:
        if required:
            raise InvalidArgument.field(path, "required")
        return default
    ints = kind is int or (isinstance(kind, tuple) and int in kind)
    if isinstance(value, bool) and not (kind is bool or (isinstance(kind, tuple) and bool in kind)):
        raise InvalidArgument.field(path, f"expected {getattr(kind, '__name__', kind)}, got a boolean")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or (ints and isinstance(value, float)):
        raise InvalidArgument.field(path, f"expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _metadata(body: Mapping[str, Any], where: str = "") -> dict[str, str]:
    meta = _field(body, "user_metadata", dict, default={}, where=where)
    return {str(k): str(v) for k, v in meta.items()}


def _name(value: str, path: str) -> str:
    if not _NAME.fullmatch(value):
        raise InvalidArgument.field(path, f"{value!r} is not 1-64 characters of [A-Za-z0-9._-] starting with a "
                                          "letter or digit")
    return value


def checkpoint_from_path(path: str, field: str = "path") -> Checkpoint:
    """``tinker://<model_id>/weights/<name>`` (a resume point) or ``.../sampler_weights/<name>`` -> Checkpoint."""
    match = _PATH.fullmatch(path)
    if not match:
        raise InvalidArgument.field(field, f"{path!r} is not a checkpoint path: expected "
                                           "tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/"
                                           "<name> (what save_state and save_weights_for_sampler return)")
    model_id, kind, name = match.groups()
    return Checkpoint(model_id, "weights" if kind == "weights" else "sampler", _name(name, field))


def _prompt_ids(model_input: Any, where: str) -> tuple[int, ...]:
    """A JSON ModelInput ({"chunks": [{"tokens": [...], "type": "encoded_text"}, ...]}) -> its token ids."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise InvalidArgument.field(where, "expected a ModelInput: {\"chunks\": [...]}")
    ids: list[int] = []
    for i, chunk in enumerate(model_input["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise InvalidArgument.field(f"{where}.chunks[{i}]", f"{kind!r} chunks are not supported: zerokl's models "
                                                                "read token ids (EncodedTextChunk)")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidArgument.field(f"{where}.chunks[{i}].tokens", "expected a list of token ids")
        ids += tokens
    return tuple(ids)


# ----------------------------------------------------------------------------- training requests

def model_spec_from_json(body: Mapping[str, Any]) -> ModelSpec:
    """CreateModelRequest -> ModelSpec. No lora_config, or rank 0, trains full weights."""
    lora = _field(body, "lora_config", dict, default=None)
    rank, seed = 0, None
    if lora is not None:
        rank = _field(lora, "rank", int, required=True, where="lora_config.")
        seed = _field(lora, "seed", int, where="lora_config.")
        if rank < 0:
            raise InvalidArgument.field("lora_config.rank", f"{rank} must be >= 0 (0: train full weights)")
        for part in ("train_mlp", "train_attn"):
            if _field(lora, part, bool, default=True, where="lora_config.") is False:
                raise InvalidArgument.field(f"lora_config.{part}", "zerokl's LoRA adapts the attention and MLP "
                                                                   "projections together: this must be true")
    optimizer = _field(body, "optimizer_config", dict, default={"type": "adamw"})
    if optimizer.get("type", "adamw") != "adamw":
        raise InvalidArgument.field("optimizer_config.type", f"{optimizer.get('type')!r}: only adamw is supported")
    return ModelSpec(session_id=_field(body, "session_id", str, required=True),
                     model_seq_id=_field(body, "model_seq_id", int, required=True),
                     base_model=_field(body, "base_model", str, required=True), lora_rank=rank, seed=seed,
                     user_metadata=_metadata(body))


def _array(t: tinker_pb2.Tensor, path: str) -> np.ndarray:
    """A dense 1-D tinker_pb2.Tensor -> numpy (in its declared dtype)."""
    np_dtype = _NP_DTYPES.get(t.dtype)
    if np_dtype is None:
        raise InvalidArgument.field(path, f"dtype {tinker_pb2.DType.Name(t.dtype)} is not supported "
                                          "(float32, int64 or int32)")
    if t.WhichOneof("data") == "sparse_csr" or len(t.shape) > 1:
        raise InvalidArgument.field(path, f"shape {list(t.shape)}: zerokl's losses take one value per position "
                                          "([N], dense)")
    raw = t.dense
    if len(raw) % np.dtype(np_dtype).itemsize:
        raise InvalidArgument.field(path, f"{len(raw)} bytes is not a whole number of {np.dtype(np_dtype).name}")
    values = np.frombuffer(raw, dtype=np_dtype)
    if t.shape and t.shape[0] != values.size:
        raise InvalidArgument.field(path, f"shape {list(t.shape)} but {values.size} values")
    return values


def _loss_config(msg: tinker_pb2.ForwardBackwardRequest, loss: str) -> tuple[dict[str, float], SamplingOptions]:
    """The request's loss_fn_config (v2 preferred, as the SDK writes both): the loss's keys, and zerokl's
    sampling keys as the SamplingOptions the logprobs are taken under."""
    values: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise InvalidArgument.field(f"loss_fn_config.{key}", "zerokl's losses take numbers")
        values[key] = value.number
    sampling = {k: values.pop(k) for k in SAMPLING_KEYS if k in values}
    allowed = TOKEN_LOSSES[loss]
    for key, value in values.items():
        if key not in allowed:
            keys = ", ".join((*allowed, *SAMPLING_KEYS))
            raise InvalidArgument.field(f"loss_fn_config.{key}", f"not a key of the {loss} loss (its keys: {keys})")
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgument.field(f"loss_fn_config.{key}", f"{value} must be finite and >= 0")
    if "top_k" in sampling and not float(sampling["top_k"]).is_integer():
        raise InvalidArgument.field("loss_fn_config.top_k", f"{sampling['top_k']} is not a whole number")
    options = SamplingOptions(temperature=sampling.get("temperature", 1.0), top_k=int(sampling.get("top_k", 0)),
                              top_p=sampling.get("top_p", 1.0))
    try:
        options.check()
    except InvalidOption as err:
        raise InvalidArgument.field(f"loss_fn_config.{err.field}", str(err)) from None
    return values, options


def call_ids_from_proto(body: bytes) -> tuple[str | None, int | None]:
    """(model_id, seq_id) of a ForwardBackwardRequest body, read before the rest is checked (so a refused
    call's number can be passed over); (None, None) when the body is not one."""
    try:
        msg = tinker_pb2.ForwardBackwardRequest.FromString(body)
    except DecodeError:
        return None, None
    return msg.model_id, msg.seq_id or None


def forward_backward_from_proto(body: bytes) -> ForwardBackwardCall:
    """A ForwardBackwardRequest body (zstd already undone) -> ForwardBackwardCall.

    Every datum is text (EncodedTextChunks) with one value per position of each input the loss
    reads: cross_entropy target_tokens (and weights, default 1), the RL losses target_tokens,
    logprobs (the sampling logprobs) and advantages.
    """
    try:
        msg = tinker_pb2.ForwardBackwardRequest.FromString(body)
    except DecodeError as err:
        raise InvalidArgument.field("body", f"not a ForwardBackwardRequest protobuf: {err}") from None
    loss = msg.loss_fn
    if loss not in TOKEN_LOSSES:
        why = (" (forward_backward_custom runs a custom loss through the SDK: it takes logprobs from forward and "
               "sends the loss's gradient back as cross_entropy weights)") if loss == "custom" else ""
        raise InvalidArgument.field("loss_fn", f"{loss!r} is not supported: expected one of "
                                               f"{', '.join(TOKEN_LOSSES)}{why}")
    if not msg.data:
        raise InvalidArgument.field("data", "no datums")
    config, sampling = _loss_config(msg, loss)
    allowed = _INPUT_KEYS.get(loss, _RL_INPUT_KEYS)
    sequences = []
    for i, datum in enumerate(msg.data):
        where = f"data[{i}]"
        ids: list[int] = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise InvalidArgument.field(f"{where}.model_input[{j}]", f"{kind} chunks are not supported: "
                                                                         "zerokl's models read token ids")
            ids += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        n = len(ids)
        inputs = {}
        for key in datum.loss_fn_inputs:
            if key not in allowed:
                raise InvalidArgument.field(f"{where}.loss_fn_inputs.{key}", f"not an input of the {loss} loss "
                                                                             f"(its inputs: {', '.join(allowed)})")
            values = _array(datum.loss_fn_inputs[key], f"{where}.loss_fn_inputs.{key}")
            if values.size != n:
                raise InvalidArgument.field(f"{where}.loss_fn_inputs.{key}", f"{values.size} values for the "
                                                                             f"{n} positions of model_input")
            inputs[key] = values
        needed = ("target_tokens",) if loss == "cross_entropy" else ("target_tokens", "logprobs", "advantages")
        for key in needed:
            if key not in inputs:
                raise InvalidArgument.field(f"{where}.loss_fn_inputs.{key}", f"required by the {loss} loss")
        floats = {k: tuple(inputs[k].astype(np.float32).tolist()) if k in inputs else None
                  for k in ("weights", "logprobs", "advantages")}
        sequences.append(TokenSequence(tuple(ids), tuple(int(t) for t in inputs["target_tokens"].tolist()),
                                       weights=floats["weights"] if loss == "cross_entropy" else None,
                                       logprobs=floats["logprobs"], advantages=floats["advantages"]))
    return ForwardBackwardCall(model_id=msg.model_id, seq_id=msg.seq_id or None, loss=loss,
                               sequences=tuple(sequences), config=config, forward_only=msg.forward_only,
                               sampling=sampling)


def optim_step_from_json(body: Mapping[str, Any]) -> OptimStepCall:
    """OptimStepRequest (AdamParams under adam_params) -> OptimStepCall."""
    params = body.get("adam_params")
    if params is None:
        kind = (body.get("optimizer_params") or {}).get("type")
        raise InvalidArgument.field("optim_params", f"{kind!r} optimizer parameters: only AdamParams are supported")
    if not isinstance(params, dict):
        raise InvalidArgument.field("adam_params", "expected an object")
    defaults = AdamParams(learning_rate=1e-4)    # the SDK's AdamParams defaults
    values = {name: _field(params, name, float, default=getattr(defaults, name), where="adam_params.")
              for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}
    return OptimStepCall(_field(body, "model_id", str, required=True), _field(body, "seq_id", int),
                         AdamParams(**values))


def save_from_json(body: Mapping[str, Any], kind: str) -> SaveCall:
    """SaveWeightsRequest (kind "weights") / SaveWeightsForSamplerRequest (kind "sampler") -> SaveCall."""
    name = _field(body, "path", str)
    if name is not None:
        _name(name, "path")
    seq = _field(body, "sampling_session_seq_id", int)
    if kind == "sampler" and name is None and seq is None:
        raise InvalidArgument.field("path", "give a name (save_weights_for_sampler) or a sampling_session_seq_id")
    if kind == "weights" and name is None:
        raise InvalidArgument.field("path", "required: the checkpoint's name")
    if _field(body, "kind", str, default="snapshot") != "snapshot":
        raise InvalidArgument.field("kind", f"{body.get('kind')!r}: only snapshot sampling clients are supported")
    return SaveCall(model_id=_field(body, "model_id", str, required=True), seq_id=_field(body, "seq_id", int),
                    kind="weights" if kind == "weights" else "sampler", name=name, sampling_session_seq_id=seq,
                    user_metadata=_metadata(body))


def load_from_json(body: Mapping[str, Any]) -> LoadCall:
    """LoadWeightsRequest -> LoadCall: load_state on a model (model_id, seq_id), or create-via-load."""
    call = LoadCall(path=_field(body, "path", str, required=True), optimizer=_field(body, "optimizer", bool,
                                                                                    required=True),
                    model_id=_field(body, "model_id", str), seq_id=_field(body, "seq_id", int),
                    session_id=_field(body, "session_id", str), model_seq_id=_field(body, "model_seq_id", int),
                    base_model=_field(body, "base_model", str), user_metadata=_metadata(body))
    if (call.model_id is None) == (call.session_id is None):
        raise InvalidArgument.field("model_id", "give model_id (load into a model) or session_id and model_seq_id "
                                                "(a new model from the checkpoint), not both or neither")
    if call.session_id is not None and call.model_seq_id is None:
        raise InvalidArgument.field("model_seq_id", "required with session_id")
    checkpoint_from_path(call.path)
    return call


# ----------------------------------------------------------------------------- sampling

def _stops(stop: Any) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    """SamplingParams.stop -> (stop strings, stop ids, ignore_eos). None keeps eos; [] disables every stop."""
    if stop is None:
        return (), (), False
    if isinstance(stop, str):
        return (stop,), (), False
    if not isinstance(stop, list):
        raise InvalidArgument.field("sampling_params.stop", "expected a string, a list of strings or of token ids")
    if not stop:
        return (), (), True
    if all(isinstance(s, str) for s in stop):
        return tuple(stop), (), False
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return (), tuple(stop), False
    raise InvalidArgument.field("sampling_params.stop", "a list of strings or a list of token ids, not a mix")


def sample_from_json(body: Mapping[str, Any], random_seed: int) -> SampleCall:
    """SampleRequest -> SampleCall (``random_seed`` for a request without a seed, as Tinker draws one)."""
    for name, off in (("topk_prompt_logprobs", 0), ("topk_sample_logprobs", 0), ("prompt_alt_tokens_k", 0)):
        if _field(body, name, int, default=off) != off:
            raise InvalidArgument.field(name, "top-k logprobs and alternative tokens are not supported by zerokl's "
                                              "engine yet")
    for name in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
        if body.get(name) is not None:
            raise InvalidArgument.field(name, "not supported by zerokl's engine yet (prompt_logprobs scores every "
                                              "prompt token)")
    params = _field(body, "sampling_params", dict, required=True)
    stop, stop_ids, ignore_eos = _stops(params.get("stop"))
    top_k = _field(params, "top_k", int, default=-1, where="sampling_params.")
    max_tokens = _field(params, "max_tokens", int, where="sampling_params.")
    seed = _field(params, "seed", int, where="sampling_params.")
    options = SamplingOptions(
        temperature=_field(params, "temperature", float, default=1.0, where="sampling_params."),
        top_p=_field(params, "top_p", float, default=1.0, where="sampling_params."),
        top_k=0 if top_k == -1 else top_k,
        seed=random_seed if seed is None else seed % 2**63,
        max_tokens=SamplingOptions.max_tokens if max_tokens is None else max_tokens,
        stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos,
        n=_field(body, "num_samples", int, default=1),
        prompt_logprobs=bool(_field(body, "prompt_logprobs", bool, default=False)))
    try:
        options.check()
    except InvalidOption as err:
        field = "num_samples" if err.field == "n" else f"sampling_params.{err.field}"
        raise InvalidArgument.field(field, str(err)) from None
    call = SampleCall(prompt_ids=_prompt_ids(body.get("prompt"), "prompt"), options=options,
                      sampling_session_id=_field(body, "sampling_session_id", str),
                      base_model=_field(body, "base_model", str), model_path=_field(body, "model_path", str))
    if not call.prompt_ids:
        raise InvalidArgument.field("prompt", "must hold at least one token id")
    if call.sampling_session_id is None and (call.base_model is None) == (call.model_path is None):
        raise InvalidArgument.field("sampling_session_id", "give a sampling session, or exactly one of base_model "
                                                           "and model_path")
    return call


# ----------------------------------------------------------------------------- results

def forward_backward_output_to_proto(outcome: ForwardBackwardOutcome) -> bytes:
    """ForwardBackwardOutcome -> a ForwardBackwardOutput body: every datum's logprobs (float32, one per
    position) in one batched record, and the metrics."""
    arrays = [lp.numpy().astype(np.float32, copy=False) for lp in outcome.logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    batched = tinker_pb2.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                                       dtype=tinker_pb2.DTYPE_FLOAT32)
    record = tinker_pb2.ArrayRecord(type_tag="ArrayRecord", fields={"logprobs": batched}, num_datums=len(arrays))
    return tinker_pb2.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                            metrics=dict(outcome.metrics)).SerializeToString()


def sample_response_to_proto(outcome: SampleOutcome) -> bytes:
    """SampleOutcome -> a SampleResponse body (prompt logprobs NaN at the first token, which has none)."""
    msg = tinker_pb2.SampleResponse()
    for seq in outcome.sequences:
        msg.sequences.add(stop_reason=tinker_pb2.STOP_REASON_STOP if seq.stop_reason == "stop"
                          else tinker_pb2.STOP_REASON_LENGTH,
                          tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes())
    if outcome.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray((math.nan, *outcome.prompt_logprobs), dtype=np.float32).tobytes()
    return msg.SerializeToString()
