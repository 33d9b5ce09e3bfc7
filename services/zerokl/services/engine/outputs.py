"""What crosses between the engine core and its front: the engine's info, a pass's outputs, the core's errors.

The core (:mod:`zerokl.services.engine.core`) runs in its own process for a served replica: what it
sends back after each pass of its loop is ONE pickle (:func:`dumps`) of a list of events whose
outputs are :class:`StepOutputs` (columns, no object per output). Tensors in a message (a swap's
weights, a prefill replica's exported KV, a handed-over KV) go by shared memory (CPU) or CUDA IPC:
torch's reductions, registered with multiprocessing's ForkingPickler. The same objects cross a
queue unpickled when the core runs on a thread of the front's process.

The core speaks of failures in its own terms (:class:`CoreError`, naming a status); the front maps
them to the service's errors, so this package needs neither gRPC nor the service runtime.

This module imports no torch: a replica's server whose engine runs in a child reads the engine's info
and a pass's outputs (names, numbers, Python lists) without it. A message that holds tensors (a prefill
replica's exported KV, a trace) loads torch where it is unpickled; one that is sent holds tensors only
where torch is loaded (:func:`dumps`).
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any, Sequence

from zerokl.services.engine.types import SampleOutput

__all__ = ["CoreError", "EngineInfo", "StepOutputs", "dumps", "loads", "merge_outputs"]


class CoreError(Exception):
    """A failure the engine core reports: a request it does not admit or ends, a swap or a call that failed.

    ``status`` names the gRPC status code the front reports it as (``UNAVAILABLE``,
    ``FAILED_PRECONDITION``, ``INVALID_ARGUMENT``, ``ALREADY_EXISTS``, ``INTERNAL``);
    ``violations``: ``(type, subject, description)`` of each unmet precondition. Picklable (it
    crosses the pipe), so its arguments are its ``args``.
    """

    def __init__(self, status: str, message: str, violations: Sequence[tuple[str, str, str]] = ()) -> None:
        super().__init__(status, message, tuple(violations))
        self.status = status
        self.message = message
        self.violations = tuple(violations)

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the front (and the replica on it) knows of the engine without touching it.

    Plain data (the config's dict, dtype names): the front of an engine process reads it without torch
    or the numerics library. ``fingerprint``, ``backend``, ``device_name`` and ``numerics_version`` are
    computed where the engine runs (the child process owns the device); None for an engine in a thread
    (the caller computes them itself).
    """

    model_config: dict[str, Any]       # ModelConfig.to_dict(): what its hash (model_config_hash) is of
    dtype: str                         # activations (and KV), a canonical name (zerokl.kernels.dtypes)
    numerics_dtype: str                # what names the numerics: "float8_e4m3fn" for an FP8 model, else dtype
    max_model_len: int
    block_size: int
    num_blocks: int
    device: str
    lockstep: bool = False             # a tensor-parallel rank 0 (cannot trace alone)
    fingerprint: str | None = None
    backend: str | None = None
    device_name: str | None = None
    numerics_version: str | None = None

    @staticmethod
    def of(engine: Any, identify: bool = False, lockstep: bool = False) -> "EngineInfo":
        """The info of ``engine`` (an Engine, or a tensor-parallel rank 0's view of one: ``lockstep``);
        ``identify``: also the numerics version, fingerprint, backend and device name on its device (golden
        vectors run there)."""
        from zerokl.kernels.dtypes import dtype_name
        from zerokl.kernels.model.fp8 import numerics_dtype
        model = engine.model
        device = model.embed_tokens.weight.device
        dtype = numerics_dtype(model)
        extra: dict[str, Any] = {}
        if identify:
            from zerokl.kernels import __version__, device_name, fingerprint, get_backend
            extra = dict(fingerprint=fingerprint(device=device, dtype=dtype), backend=get_backend(),
                         device_name=device_name(), numerics_version=__version__)
        return EngineInfo(model.config.to_dict(), dtype_name(model.dtype), dtype_name(dtype), engine.max_model_len,
                          engine.config.block_size, engine.config.num_blocks, str(device), lockstep, **extra)


# ---------------------------------------------------------------------------- a pass's outputs

class StepOutputs:
    """What one pass of the engine core delivers to the streams, as columns: one object per pass (one
    pickle through the pipe), no object per output or per token.

    Output ``i`` of the pass belongs to the stream ``keys[i]`` (a stream's key, unique per submit) and is
    sample ``index[i]``'s next ``ntok[i]`` tokens: ``tokens[starts[i]:starts[i + 1]]`` and the same span of
    ``logprobs`` (Python floats: exact). Every column but ``tokens`` / ``logprobs`` is [outputs];
    ``texts`` is None when every text is empty; ``reasons`` holds the finished outputs' finish reasons
    (finished == a reason is there) and ``extras`` the rare fields ``(prompt_logprobs, handoff, error)``,
    both by output. ``ends``: ``(key, True | error)`` of the streams that end after this pass's outputs.
    ``starts`` is computed by the receiver (:meth:`index_tokens`), not sent.
    """

    __slots__ = ("keys", "index", "ntok", "tokens", "logprobs", "prompt", "cached", "texts", "reasons", "extras",
                 "ends", "starts")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.index: list[int] = []
        self.ntok: list[int] = []
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.prompt: list[int] = []
        self.cached: list[int] = []
        self.texts: list[str] | None = []
        self.reasons: dict[int, str] = {}
        self.extras: dict[int, tuple] = {}
        self.ends: list[tuple[int, Any]] = []
        self.starts: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.keys or self.ends)

    def __getstate__(self) -> tuple:
        texts = self.texts if self.texts is not None and any(self.texts) else None
        return (self.keys, self.index, self.ntok, self.tokens, self.logprobs, self.prompt, self.cached, texts,
                self.reasons, self.extras, self.ends)

    def __setstate__(self, state: tuple) -> None:
        (self.keys, self.index, self.ntok, self.tokens, self.logprobs, self.prompt, self.cached, self.texts,
         self.reasons, self.extras, self.ends) = state
        self.starts = []

    def add(self, key: int, out: SampleOutput) -> None:
        """Append one engine output of the stream ``key`` (the core)."""
        i = len(self.keys)
        self.keys.append(key)
        self.index.append(out.index)
        self.ntok.append(len(out.token_ids))
        self.tokens += out.token_ids
        self.logprobs += out.logprobs
        self.prompt.append(out.num_prompt_tokens)
        self.cached.append(out.num_cached_tokens)
        self.texts.append(out.text)  # type: ignore[union-attr]
        if out.finished:
            self.reasons[i] = out.finish_reason
        if out.prompt_logprobs is not None or out.handoff is not None or out.error is not None:
            self.extras[i] = (out.prompt_logprobs, out.handoff, out.error)

    def end(self, key: int, what: Any = True) -> None:
        """The stream ``key`` ends after this pass's outputs: done (True) or with the error ``what`` (the core)."""
        self.ends.append((key, what))

    def index_tokens(self) -> None:
        """Compute ``starts`` (the receiver, once)."""
        self.starts = list(itertools.accumulate(self.ntok, initial=0))

    def output(self, i: int, request_id: str) -> SampleOutput:
        """Output ``i`` as the engine produced it (``index_tokens`` first)."""
        a, b = self.starts[i], self.starts[i + 1]
        plp, handoff, error = self.extras.get(i, (None, None, None))
        reason = self.reasons.get(i)
        return SampleOutput(request_id, self.index[i], self.tokens[a:b], self.logprobs[a:b], reason is not None,
                            reason, plp, self.prompt[i], self.cached[i],
                            self.texts[i] if self.texts is not None else "", handoff, error)


def merge_outputs(pieces: list[tuple[StepOutputs, int]], request_id: str) -> list[SampleOutput]:
    """The outputs ``pieces`` (one stream's, in arrival order) name, each sample's merged into one.

    A sample's merged output carries its tokens, logprobs and text in order, the first part's prompt
    logprobs and the last part's finish, counts, KV handoff and error (a sample has nothing after its
    finished output, so no part follows a finish). Samples keep the order in which they first appear.
    What a stream that fell behind, or waits for ``every`` outputs (:meth:`RequestStream.batches`),
    hands on: a client folds a request's outputs per sample, so the bits are the same as one output at
    a time, in fewer, larger messages.
    """
    merged: dict[int, list] = {}
    for step, i in pieces:
        index = step.index[i]
        a, b = step.starts[i], step.starts[i + 1]
        m = merged.get(index)
        if m is None:
            # [tokens, logprobs, texts, first piece, last piece]
            merged[index] = [step.tokens[a:b], step.logprobs[a:b], [step.texts[i]] if step.texts else [],
                             (step, i), (step, i)]
        else:
            m[0] += step.tokens[a:b]
            m[1] += step.logprobs[a:b]
            if step.texts:
                m[2].append(step.texts[i])
            m[4] = (step, i)
    outputs = []
    for index, (tokens, logprobs, texts, (first, fi), (last, li)) in merged.items():
        plp = first.extras[fi][0] if fi in first.extras else None
        _, handoff, error = last.extras.get(li, (None, None, None))
        reason = last.reasons.get(li)
        outputs.append(SampleOutput(request_id, index, tokens, logprobs, reason is not None, reason, plp,
                                    last.prompt[li], last.cached[li], "".join(texts), handoff, error))
    return outputs




def dumps(obj: Any) -> bytes:
    """Pickle for the pipe: tensors by shared memory (CPU) or CUDA IPC (torch's reductions, registered
    with multiprocessing's ForkingPickler when torch.multiprocessing is imported)."""
    if "torch" in sys.modules:
        # A message holds tensors only where torch is loaded (a front whose engine runs in a child loads it only
        # on the paths that make them): register their reductions then, or they would be pickled by value.
        import torch.multiprocessing  # noqa: F401
    return bytes(ForkingPickler.dumps(obj))


def loads(data: bytes) -> Any:
    """What :func:`dumps` pickled."""
    return ForkingPickler.loads(data)
