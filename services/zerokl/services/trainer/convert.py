"""The only conversions between trainer dataclasses and ``zerokl.v1`` trainer messages.

One function per type and direction; the servicer and the client call these at
the edge and nothing else touches generated classes. Absent optional fields
take the dataclass defaults (:class:`Completion`), so a default has one home.
Logprobs are fp32 and travel as proto ``float`` (exact); every other number
travels as ``double`` (exact for fp32 values and Python floats alike), so a
round trip gives back equal dataclasses and bit-identical tensors.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from zerokl.services.runtime.optrace import trace_from_proto, trace_options_from_proto, trace_to_proto
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.types import (
    AdamParams,
    DPOBatch,
    ForwardBackwardResult,
    OptimResult,
    PPOBatch,
    PPOMetrics,
    Recorded,
    SFTBatch,
    TokenLossBatch,
    TokenSequence,
    TrainBatch,
    TrainerState,
)
from zerokl.services.weightstore.convert import manifest_from_proto, manifest_to_proto
from zerokl.services.weightstore.store import WeightsManifest
from zerokl.v1 import trainer_pb2
from zerokl.vocab import Completion, Rollout

if TYPE_CHECKING:    # tensors and traces: torch only where logprobs are converted (a trace: where one is read)
    import torch

    from zerokl.kernels.trace import Trace

__all__ = [
    "completion_to_proto",
    "completion_from_proto",
    "rollout_to_proto",
    "rollout_from_proto",
    "logprobs_to_proto",
    "logprobs_from_proto",
    "forward_trace_from_proto",
    "logprobs_trace",
    "batch_to_proto",
    "batch_from_proto",
    "token_sequence_to_proto",
    "token_sequence_from_proto",
    "forward_backward_result_to_proto",
    "forward_backward_result_from_proto",
    "adam_params_to_proto",
    "adam_params_from_proto",
    "optim_result_to_proto",
    "optim_result_from_proto",
    "save_result_to_proto",
    "save_result_from_proto",
    "recorded_to_proto",
    "recorded_from_proto",
    "train_config_to_proto",
    "train_config_from_proto",
    "state_to_proto",
    "state_from_proto",
]

_DEFAULT = Completion((), ())


def _fp32_values(t: torch.Tensor) -> list[float]:
    """A logprob tensor's values as fp32 numbers (what proto ``float`` carries exactly)."""
    import torch        # loaded already: whoever made the tensor imported it
    return t.to(torch.float32).tolist()


def _fp32_tensor(values: Sequence[float]) -> torch.Tensor:
    """Proto ``float`` logprobs as an fp32 tensor, bitwise the sender's."""
    import torch        # not at the top: a client that reads no logprobs (the scheduler, `zerokl jobs`) runs without it
    return torch.tensor(list(values), dtype=torch.float32)


def completion_to_proto(c: Completion) -> trainer_pb2.Completion:
    """Completion -> ``zerokl.v1.Completion`` (sampling fields always set explicitly)."""
    return trainer_pb2.Completion(prompt_ids=list(c.prompt_ids), completion_ids=list(c.completion_ids),
                                  temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)


def completion_from_proto(msg: trainer_pb2.Completion) -> Completion:
    """``zerokl.v1.Completion`` -> Completion; absent sampling fields take Completion's defaults.

    Values are not validated here: the service validates (one place, one message).
    """
    def get(name: str):  # noqa: ANN202 - a field of any type
        return getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULT, name)

    return Completion(tuple(msg.prompt_ids), tuple(msg.completion_ids), get("temperature"), get("top_k"),
                      get("top_p"))


def rollout_to_proto(r: Rollout) -> trainer_pb2.Rollout:
    """Rollout -> ``zerokl.v1.Rollout``."""
    return trainer_pb2.Rollout(completion=completion_to_proto(r.sequence), logprobs=list(r.logprobs),
                               reward=r.reward, weights_version=r.weights_version)


def rollout_from_proto(msg: trainer_pb2.Rollout) -> Rollout:
    """``zerokl.v1.Rollout`` -> Rollout."""
    return Rollout(completion_from_proto(msg.completion), tuple(msg.logprobs), msg.reward, msg.weights_version)


def logprobs_to_proto(logprobs: Sequence[torch.Tensor], trace: Trace | None = None) -> trainer_pb2.ForwardLogprobsResponse:
    """Per-completion fp32 logprob tensors (and the trace, when asked) -> ``zerokl.v1.ForwardLogprobsResponse``."""
    msg = trainer_pb2.ForwardLogprobsResponse(logprobs=[
        trainer_pb2.TokenLogprobs(values=_fp32_values(lp)) for lp in logprobs])
    if trace is not None:
        msg.trace.CopyFrom(trace_to_proto(trace))
    return msg


def logprobs_from_proto(msg: trainer_pb2.ForwardLogprobsResponse) -> list[torch.Tensor]:
    """``zerokl.v1.ForwardLogprobsResponse`` -> one fp32 tensor per completion (bitwise the server's)."""
    return [_fp32_tensor(t.values) for t in msg.logprobs]


def forward_trace_from_proto(msg: trainer_pb2.ForwardLogprobsRequest) -> tuple[str, ...] | None:
    """The capture keys when the ForwardLogprobsRequest asks for a trace (zerokl diff), else None."""
    return trace_options_from_proto(msg.trace) if msg.HasField("trace") else None


def logprobs_trace(msg: trainer_pb2.ForwardLogprobsResponse) -> Trace | None:
    """The trace a ForwardLogprobsResponse carries, if any."""
    return trace_from_proto(msg.trace) if msg.HasField("trace") else None


def batch_to_proto(batch: TrainBatch) -> trainer_pb2.ForwardBackwardRequest:
    """SFTBatch | DPOBatch | PPOBatch -> ``zerokl.v1.ForwardBackwardRequest`` (the batch's type is the method)."""
    if isinstance(batch, SFTBatch):
        return trainer_pb2.ForwardBackwardRequest(sft=trainer_pb2.SFTBatch(
            completions=[completion_to_proto(c) for c in batch.completions]))
    if isinstance(batch, DPOBatch):
        return trainer_pb2.ForwardBackwardRequest(dpo=trainer_pb2.DPOBatch(pairs=[
            trainer_pb2.PreferencePair(chosen=completion_to_proto(c), rejected=completion_to_proto(r))
            for c, r in batch.pairs], reset_reference=batch.reset_reference))
    if isinstance(batch, PPOBatch):
        ppo = trainer_pb2.PPOBatch(rollouts=[rollout_to_proto(r) for r in batch.rollouts],
                                   advantages=list(batch.advantages or ()))
        if batch.group_size is not None:
            ppo.group_size = batch.group_size
        if batch.max_staleness is not None:
            ppo.max_staleness = batch.max_staleness
        return trainer_pb2.ForwardBackwardRequest(ppo=ppo)
    if isinstance(batch, TokenLossBatch):
        return trainer_pb2.ForwardBackwardRequest(token=trainer_pb2.TokenLossBatch(
            loss=batch.loss, sequences=[token_sequence_to_proto(s) for s in batch.sequences],
            config=dict(batch.config), forward_only=batch.forward_only, temperature=batch.temperature,
            top_k=batch.top_k, top_p=batch.top_p))
    raise TypeError(f"not a training batch: {type(batch).__name__}")


def token_sequence_to_proto(s: TokenSequence) -> trainer_pb2.TokenSequence:
    """TokenSequence -> ``zerokl.v1.TokenSequence`` (an unused per-position input travels empty)."""
    return trainer_pb2.TokenSequence(input_ids=list(s.input_ids), target_ids=list(s.target_ids),
                                     weights=list(s.weights or ()), logprobs=list(s.logprobs or ()),
                                     advantages=list(s.advantages or ()))


def token_sequence_from_proto(msg: trainer_pb2.TokenSequence) -> TokenSequence:
    """``zerokl.v1.TokenSequence`` -> TokenSequence (an empty per-position input is None: unused)."""
    def optional(values) -> tuple[float, ...] | None:  # noqa: ANN001 - a repeated float field
        return tuple(values) if len(values) else None

    return TokenSequence(tuple(msg.input_ids), tuple(msg.target_ids), optional(msg.weights), optional(msg.logprobs),
                         optional(msg.advantages))


def batch_from_proto(msg: trainer_pb2.ForwardBackwardRequest) -> TrainBatch | None:
    """``zerokl.v1.ForwardBackwardRequest`` -> its batch; None when no batch (no known method) is set."""
    which = msg.WhichOneof("batch")
    if which == "sft":
        return SFTBatch(tuple(completion_from_proto(c) for c in msg.sft.completions))
    if which == "dpo":
        return DPOBatch(tuple((completion_from_proto(p.chosen), completion_from_proto(p.rejected))
                              for p in msg.dpo.pairs), msg.dpo.reset_reference)
    if which == "ppo":
        p = msg.ppo
        return PPOBatch(
            rollouts=tuple(rollout_from_proto(r) for r in p.rollouts),
            group_size=p.group_size if p.HasField("group_size") else None,
            # An empty list means "none given": a batch of rollouts always has at least one advantage.
            advantages=tuple(p.advantages) if len(p.advantages) else None,
            max_staleness=p.max_staleness if p.HasField("max_staleness") else None)
    if which == "token":
        t = msg.token
        default = TokenLossBatch("", ())
        return TokenLossBatch(
            loss=t.loss, sequences=tuple(token_sequence_from_proto(s) for s in t.sequences), config=dict(t.config),
            forward_only=t.forward_only,
            temperature=t.temperature if t.HasField("temperature") else default.temperature,
            top_k=t.top_k if t.HasField("top_k") else default.top_k,
            top_p=t.top_p if t.HasField("top_p") else default.top_p)
    return None


def forward_backward_result_to_proto(r: ForwardBackwardResult) -> trainer_pb2.ForwardBackwardResponse:
    """ForwardBackwardResult -> ``zerokl.v1.ForwardBackwardResponse``."""
    msg = trainer_pb2.ForwardBackwardResponse(
        method=r.method, loss=r.loss, tokens=r.tokens, tokens_per_s=r.tokens_per_s, metrics=dict(r.metrics),
        step=r.step, accumulated_batches=r.accumulated_batches)
    if r.ppo is not None:
        p = r.ppo
        msg.ppo.CopyFrom(trainer_pb2.PPOMetrics(
            kl=p.kl, mismatched_tokens=p.mismatched_tokens, clip_fraction=p.clip_fraction, ratio_min=p.ratio_min,
            ratio_max=p.ratio_max, kl_reference=p.kl_reference, reward_mean=p.reward_mean,
            stale_rollouts=p.stale_rollouts, max_staleness=p.max_staleness))
    for lp in r.token_logprobs or ():
        msg.token_logprobs.add(values=_fp32_values(lp))
    return msg


def forward_backward_result_from_proto(msg: trainer_pb2.ForwardBackwardResponse) -> ForwardBackwardResult:
    """``zerokl.v1.ForwardBackwardResponse`` -> ForwardBackwardResult."""
    ppo = None
    if msg.HasField("ppo"):
        p = msg.ppo
        ppo = PPOMetrics(kl=p.kl, mismatched_tokens=p.mismatched_tokens, clip_fraction=p.clip_fraction,
                         ratio_min=p.ratio_min, ratio_max=p.ratio_max, kl_reference=p.kl_reference,
                         reward_mean=p.reward_mean, stale_rollouts=p.stale_rollouts, max_staleness=p.max_staleness)
    token_logprobs = None
    if msg.method == "token":
        token_logprobs = tuple(_fp32_tensor(t.values) for t in msg.token_logprobs)
    return ForwardBackwardResult(method=msg.method, loss=msg.loss, tokens=msg.tokens, tokens_per_s=msg.tokens_per_s,
                                 step=msg.step, accumulated_batches=msg.accumulated_batches, ppo=ppo,
                                 metrics=dict(msg.metrics), token_logprobs=token_logprobs)


def adam_params_to_proto(a: AdamParams) -> trainer_pb2.AdamParams:
    """AdamParams -> ``zerokl.v1.AdamParams``."""
    return trainer_pb2.AdamParams(learning_rate=a.learning_rate, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                                  weight_decay=a.weight_decay, grad_clip_norm=a.grad_clip_norm)


def adam_params_from_proto(msg: trainer_pb2.AdamParams) -> AdamParams:
    """``zerokl.v1.AdamParams`` -> AdamParams (values are checked by the service)."""
    return AdamParams(learning_rate=msg.learning_rate, beta1=msg.beta1, beta2=msg.beta2, eps=msg.eps,
                      weight_decay=msg.weight_decay, grad_clip_norm=msg.grad_clip_norm)


def optim_result_to_proto(r: OptimResult) -> trainer_pb2.OptimStepResponse:
    """OptimResult -> ``zerokl.v1.OptimStepResponse``."""
    return trainer_pb2.OptimStepResponse(grad_norm=r.grad_norm, lr=r.lr, step=r.step)


def optim_result_from_proto(msg: trainer_pb2.OptimStepResponse) -> OptimResult:
    """``zerokl.v1.OptimStepResponse`` -> OptimResult."""
    return OptimResult(grad_norm=msg.grad_norm, lr=msg.lr, step=msg.step)


def save_result_to_proto(manifest: WeightsManifest, created: bool) -> trainer_pb2.SaveWeightsResponse:
    """(manifest, created) -> ``zerokl.v1.SaveWeightsResponse``."""
    return trainer_pb2.SaveWeightsResponse(manifest=manifest_to_proto(manifest), created=created)


def save_result_from_proto(msg: trainer_pb2.SaveWeightsResponse) -> tuple[WeightsManifest, bool]:
    """``zerokl.v1.SaveWeightsResponse`` -> (manifest, created)."""
    return manifest_from_proto(msg.manifest), msg.created


def recorded_to_proto(r: Recorded) -> trainer_pb2.SaveWeightsResponse:
    """Recorded -> RecordWeights' ``zerokl.v1.SaveWeightsResponse`` (no manifest when superseded)."""
    if r.manifest is None:
        return trainer_pb2.SaveWeightsResponse(superseded_by=r.superseded_by)
    return trainer_pb2.SaveWeightsResponse(manifest=manifest_to_proto(r.manifest), created=True, record_s=r.record_s)


def recorded_from_proto(msg: trainer_pb2.SaveWeightsResponse) -> Recorded:
    """RecordWeights' ``zerokl.v1.SaveWeightsResponse`` -> Recorded."""
    if msg.superseded_by:
        return Recorded(None, superseded_by=msg.superseded_by)
    return Recorded(manifest_from_proto(msg.manifest), msg.record_s)


# TrainConfig fields carried by several proto fields; every other field has a proto field of its name.
_SPLIT_FIELDS = {"betas": ("beta1", "beta2")}


def train_config_to_proto(c: TrainConfig) -> trainer_pb2.TrainConfig:
    """TrainConfig -> ``zerokl.v1.TrainConfig``, field by field by name (None: left unset)."""
    msg = trainer_pb2.TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(c, f.name)
        if f.name in _SPLIT_FIELDS:
            for name, part in zip(_SPLIT_FIELDS[f.name], value, strict=True):
                setattr(msg, name, part)
        elif value is not None:
            setattr(msg, f.name, value)
    return msg


def train_config_from_proto(msg: trainer_pb2.TrainConfig) -> TrainConfig:
    """``zerokl.v1.TrainConfig`` -> TrainConfig: every field read by name; an unset one keeps the dataclass's
    default (betas part by part). Values are not checked here (:meth:`TrainConfig.check`, where it enters)."""
    values: dict = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in _SPLIT_FIELDS:
            values[f.name] = tuple(getattr(msg, name) if msg.HasField(name) else part
                                   for name, part in zip(_SPLIT_FIELDS[f.name], f.default, strict=True))
        elif msg.HasField(f.name):
            values[f.name] = getattr(msg, f.name)
    return TrainConfig(**values)


def state_to_proto(s: TrainerState) -> trainer_pb2.TrainerState:
    """TrainerState -> ``zerokl.v1.TrainerState``."""
    return trainer_pb2.TrainerState(
        run=s.run, step=s.step, weights_version=s.weights_version, weights_step=s.weights_step,
        tokens_seen=s.tokens_seen, accumulated_batches=s.accumulated_batches, config=train_config_to_proto(s.config),
        model_config_json=s.model_config_json, numerics_version=s.numerics_version,
        numerics_fingerprint=s.numerics_fingerprint)


def state_from_proto(msg: trainer_pb2.TrainerState) -> TrainerState:
    """``zerokl.v1.TrainerState`` -> TrainerState."""
    return TrainerState(
        run=msg.run, step=msg.step, weights_version=msg.weights_version, weights_step=msg.weights_step,
        tokens_seen=msg.tokens_seen, accumulated_batches=msg.accumulated_batches,
        config=train_config_from_proto(msg.config), model_config_json=msg.model_config_json,
        numerics_version=msg.numerics_version, numerics_fingerprint=msg.numerics_fingerprint)
