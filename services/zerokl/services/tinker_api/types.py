"""The Tinker endpoint's typed requests and results (plain dataclasses; convert.py maps the wire to them).

A training request names a model and its place in the model's order (``seq_id``); a sampling
request names a sampling session. The datums of a forward_backward become the trainer's own
:class:`~zerokl.services.trainer.types.TokenSequence` (a sequence scored at every position), its
optimizer parameters the trainer's :class:`~zerokl.services.trainer.types.AdamParams`: the Tinker
types are translated once, at the edge, and nothing deeper knows the wire.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch

from zerokl.services.trainer.types import AdamParams
from zerokl.services.trainer.types import TokenSequence
from zerokl.vocab import FinishReason, SamplingOptions

__all__ = [
    "BaseModel",
    "ModelSpec",
    "ForwardBackwardCall",
    "OptimStepCall",
    "SaveCall",
    "LoadCall",
    "SampleCall",
    "ForwardBackwardOutcome",
    "SampledSequence",
    "SampleOutcome",
    "FutureFailure",
    "Checkpoint",
    "CheckpointKind",
    "version_prefix",
]

#: "weights": a resume point (weights, LoRA adapters, optimizer state); "sampler": serving weights only.
CheckpointKind = Literal["weights", "sampler"]


@dataclass(frozen=True)
class BaseModel:
    """A model this cluster serves and trains, under the names Tinker's ``base_model`` may use."""

    name: str                           # the canonical name (e.g. "zerokl/tiny")
    aliases: tuple[str, ...]            # other names that mean it (the preset, the checkpoint directory)
    version: str                        # the weight-store version holding its weights
    numerics_fingerprint: str           # the fingerprint its version was made under ("" when none is claimed)
    tokenizer_dir: str                  # a local tokenizer directory transformers' AutoTokenizer loads offline
    vocab_size: int
    max_context_length: int


@dataclass(frozen=True)
class ModelSpec:
    """What create_model asks for: a training run of a base model, LoRA of this rank or full weights."""

    session_id: str
    model_seq_id: int                   # the session's training-client number
    base_model: str
    lora_rank: int                      # 0: full weights
    seed: int | None                    # LoRA initialization (None: the server picks one)
    user_metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardBackwardCall:
    """forward / forward_backward: one of the trainer's per-token losses on datums, in the model's order."""

    model_id: str
    seq_id: int | None                  # None: after everything the model has received
    loss: str
    sequences: tuple[TokenSequence, ...]
    config: Mapping[str, float]         # the loss's keys (clip thresholds, beta)
    forward_only: bool
    # the distribution logprobs are taken under (zerokl's loss_fn_config extension: temperature,
    # top_k, top_p); the model's own by default, the distribution of temperature-1 sampling
    sampling: SamplingOptions = SamplingOptions()


@dataclass(frozen=True)
class OptimStepCall:
    model_id: str
    seq_id: int | None
    adam: AdamParams


@dataclass(frozen=True)
class SaveCall:
    """save_state (kind "weights") or save_weights_for_sampler (kind "sampler")."""

    model_id: str
    seq_id: int | None
    kind: CheckpointKind
    name: str | None                    # None: an ephemeral sampler (save_weights_and_get_sampling_client)
    sampling_session_seq_id: int | None = None
    user_metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadCall:
    """load_state (an existing model: model_id, seq_id) or create-via-load (a new model: session_id,
    model_seq_id): the checkpoint at ``path``, with its optimizer state when ``optimizer``."""

    path: str
    optimizer: bool
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SampleCall:
    """sample / compute_logprobs against a sampling session (or straight at a base model or a path)."""

    prompt_ids: tuple[int, ...]
    options: SamplingOptions            # n, max_tokens, temperature, top_k, top_p, seed, stops, prompt_logprobs
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None


@dataclass(frozen=True)
class ForwardBackwardOutcome:
    """A forward / forward_backward's result: the loss and metrics (Tinker's ``name:reduction`` keys)
    and the trainer's logprob of every target of every datum."""

    metrics: Mapping[str, float]
    logprobs: tuple[torch.Tensor, ...]  # fp32, one per datum


@dataclass(frozen=True)
class SampledSequence:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]         # fp32 values, one per token, under the sampling distribution
    stop_reason: FinishReason           # "stop" or "length"


@dataclass(frozen=True)
class SampleOutcome:
    sequences: tuple[SampledSequence, ...]
    prompt_logprobs: tuple[float, ...] | None   # one per prompt token after the first, when asked
    weights_version: str                # what computed it (the replica's stamp)
    numerics_fingerprint: str


@dataclass(frozen=True)
class FutureFailure:
    """A request that failed: the message the SDK raises, and whose fault it was."""

    message: str
    category: Literal["user", "server"]


@dataclass(frozen=True)
class Checkpoint:
    """A saved checkpoint: its ``tinker://`` path and the weight-store version holding it."""

    model_id: str
    kind: CheckpointKind
    name: str

    @property
    def path(self) -> str:
        return f"tinker://{self.model_id}/{'weights' if self.kind == 'weights' else 'sampler_weights'}/{self.name}"

    @property
    def version(self) -> str:
        """The weight-store version: deterministic, so a path names the same version after a restart."""
        return f"{version_prefix(self.model_id)}-{'state' if self.kind == 'weights' else 'sampler'}-{self.name}"


def version_prefix(model_id: str) -> str:
    """How a model's weight-store versions begin (model ids, ``<session>:train:<n>``, hold colons;
    version ids may not)."""
    return f"tinker-{model_id.replace(':', '.')}"
