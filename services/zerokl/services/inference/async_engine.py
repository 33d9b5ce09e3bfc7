"""Drive the synchronous Engine from asyncio: an engine core (a thread, or its own process) and
per-request async streams.

Two halves, as vLLM's EngineCore / AsyncLLM split:

- the **core** (:class:`_Core`) makes every call into :class:`~zerokl.services.engine.engine.Engine`
  on ONE thread (the engine is not thread-safe, and a forward must not block the event loop). Commands
  (``add``, ``abort``, ``swap``, ``call``, ``stop``) go into its inbox; it drains them before each
  step and sleeps while there is no work. What it has to say after one pass of its loop (admissions,
  every request's outputs of the step, swap results, fitness, gauges) leaves as ONE list of events;
- the **front** (:class:`AsyncEngine`) lives on the event loop: it turns those events into
  :class:`RequestStream` deliveries (one wake-up of the loop per step, and of a stream's consumer only
  when the stream has what it waits for), resolves the futures of submits and swaps, tells fitness
  callbacks and keeps the ``zerokl_`` serving metrics (TTFT, inter-token and end-to-end latency,
  running/waiting, KV usage, token totals).

Where the core runs (:meth:`AsyncEngine.__init__` vs :meth:`AsyncEngine.spawn`):

- **in a thread** of this process, given an :class:`Engine` object: a step's Python and every gRPC
  message's protobuf work share one interpreter lock. Tests that build or break an in-memory engine use
  it, as does a tensor-parallel replica (its rank 0 runs collectives with followers this process started);
- **in its own process** (spawned; it builds the engine from a picklable factory and owns the device):
  the events of a pass go back over a pipe as one message, its outputs as columns
  (:class:`StepOutputs`: flat token / logprob lists, no object per output), commands go in over the
  same pipe. Tensors crossing (weights of a swap, a prefill replica's exported KV, a handed-over KV)
  are pickled by torch's ForkingPickler: shared memory (CPU) or CUDA IPC, not copies through the pipe.
  The child dies with its parent (PR_SET_PDEATHSIG, and an end of the pipe stops it); its death ends
  every request in flight with UNAVAILABLE and makes the engine unfit (NOT_SERVING health).

A request the engine refuses (RequestError) fails only its own submit, as INVALID_ARGUMENT; nothing
else in the batch notices. A request the engine fails on while serving it (its "error" output: see
``Engine.step``) ends with INTERNAL, alone; its neighbours complete with their usual bits.

Fitness: the engine cannot serve when its core died (thread or process), when the device failed (a
lost CUDA context: every request in flight ends UNAVAILABLE, so a scheduler retries them elsewhere,
and the device is probed until it computes again) or when weights failed to load midway (until a later
load succeeds). Meanwhile submits are refused with UNAVAILABLE, and :meth:`AsyncEngine.on_fitness`
callbacks hear the reason (the servers turn it into NOT_SERVING health).

Weights swap between requests (:meth:`AsyncEngine.load_weights`): the swap waits in the core until
the requests already admitted have finished, holds back the ones that arrive meanwhile, replaces the
weights and only then admits them. A request pinned to a weights version is checked against the
version the core holds *when it is admitted*, and every stream records that version, so an output is
never stamped with weights that did not compute it.
"""
from __future__ import annotations

import asyncio
import copy
import ctypes
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, AsyncIterator, Callable

import torch
import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler
from multiprocessing.reduction import ForkingPickler

from zerokl.kernels.model import ModelConfig
from zerokl.services.engine.engine import Engine, RequestError, WeightsCorrupted, device_failed
from zerokl.services.engine.types import GenerateRequest, SampleOutput
from zerokl.services.runtime import metrics
from zerokl.services.runtime.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PreconditionViolation,
    ServiceError,
    Unavailable,
)
from zerokl.services.runtime.metrics import LatencyTracker
from zerokl.services.runtime.server import freeze_startup_heap

__all__ = ["AsyncEngine", "EngineInfo", "engine_of", "RequestStream", "StepOutputs", "collect", "merge_outputs"]

log = logging.getLogger(__name__)

_END = object()  # how a stream ends when the request is done (else: the error it ended with)
_PROBE_INTERVAL_S = 1.0  # how often a failed device is probed
_SPAWN_TIMEOUT_S = 600.0  # building the engine in the child (model load, device init) may take this long
_STOP_GRACE_S = 10.0     # a child whose parent went away gets this long to end its step before it exits


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the front (and the replica on it) knows of the engine without touching it.

    ``fingerprint``, ``backend``, ``device_name`` are computed where the engine runs (the child
    process owns the device); None for an engine in a thread (the caller computes them itself).
    """

    model_config: ModelConfig
    dtype: torch.dtype                 # activations (and KV)
    numerics_dtype: torch.dtype        # what names the numerics: float8_e4m3fn for an FP8 model, else dtype
    max_model_len: int
    block_size: int
    num_blocks: int
    device: str
    lockstep: bool = False             # a tensor-parallel rank 0 (cannot trace alone)
    fingerprint: str | None = None
    backend: str | None = None
    device_name: str | None = None

    @staticmethod
    def of(engine: Any, identify: bool = False) -> "EngineInfo":
        """The info of ``engine`` (an Engine or a LockstepEngine); ``identify``: also the numerics
        fingerprint, backend and device name on its device (golden vectors run there)."""
        from zerokl.kernels.model.fp8 import numerics_dtype
        from zerokl.services.inference.tensor_parallel import LockstepEngine
        model = engine.model
        device = model.embed_tokens.weight.device
        dtype = numerics_dtype(model)
        extra: dict[str, Any] = {}
        if identify:
            from zerokl.kernels import device_name, fingerprint, get_backend
            extra = dict(fingerprint=fingerprint(device=device, dtype=dtype), backend=get_backend(),
                         device_name=device_name())
        return EngineInfo(model.config, model.dtype, dtype, engine.max_model_len, engine.config.block_size,
                          engine.config.num_blocks, str(device), isinstance(engine, LockstepEngine), **extra)


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


# ---------------------------------------------------------------------------- the core

@dataclasses.dataclass
class _Live:
    """Core-side bookkeeping of one admitted request."""

    key: int                                       # the front's stream key (a request id may be reused)
    request: GenerateRequest
    samples: int                                   # samples that must finish (n; 1 for score/prefill)
    finished: set[int] = dataclasses.field(default_factory=set)


class _Core:
    """The engine loop: commands in, one list of events out per pass (see the module docstring).

    Commands: ``("add", key, request, pinned_version)``, ``("abort", key, request_id)``,
    ``("swap", token, state_dict, version)``, ``("call", token, fn, args)`` (``fn(engine, *args)``
    between steps), ``("version", v)`` (the version the engine holds, set by its owner), ``("stop",)``.
    Events: ``("admit", key, error, version)``, ``("done", token, error, result)``, ``("version", v)`` (a
    swap landed), ``("fitness", reason)``, ``("stats", running, waiting, kv_usage, new_prompt_tokens,
    new_generation_tokens)`` and, last, ``("step", StepOutputs)``: every stream's outputs and ends of the
    pass, as columns.
    """

    def __init__(self, engine: Any, emit: Callable[[list[tuple]], None], weights_version: str = "",
                 name: str = "the engine core") -> None:
        self.engine = engine
        self.name = name                                # what its death is reported as
        self.weights_version = weights_version
        self._emit = emit
        self._events: list[tuple] = []
        self._step = StepOutputs()                      # this pass's outputs, sent with its events
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._stopping = False
        self._swap: tuple | None = None                 # (token, state_dict, version) waiting for the batch
        self._held: list[tuple] = []                    # add commands waiting for the swap
        self._live: dict[str, _Live] = {}
        self._unfit: dict[str, str] = {}                # why it cannot serve, by cause
        self._stats = dict(engine.stats)
        self._gauges: tuple | None = None

    def post(self, command: tuple) -> None:
        """Queue a command (any thread)."""
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    def run(self) -> None:
        """Serve until a ``stop`` command; a bug in this loop ends what waits on it, UNAVAILABLE."""
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - say so, end what waits on it
            log.exception("%s died", self.name)
            why = f"{self.name} died ({type(err).__name__}: {err})"
            self._set_unfit("core", why)
            dead = Unavailable(why)
            with self._cond:
                commands, self._inbox = self._inbox, []
            for command in commands:
                if command[0] == "add":
                    self._events.append(("admit", command[1], dead, ""))
                elif command[0] in ("swap", "call") and command[1] is not None:
                    self._events.append(("done", command[1], dead, None))
            self._end_all(dead)
            self._flush()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            self._flush()
            with self._cond:
                while not self._inbox and not self._stopping and not engine.has_work() and self._swap is None:
                    # A failed device is probed now and then; otherwise sleep until told.
                    if not self._cond.wait(_PROBE_INTERVAL_S if "device" in self._unfit else None):
                        break
                commands, self._inbox = self._inbox, []
            if "device" in self._unfit:
                self._probe()
            for command in commands:
                kind = command[0]
                if kind == "add":
                    if self._swap is not None:
                        self._held.append(command)
                    else:
                        self._add(*command[1:])
                elif kind == "abort":
                    self._abort(*command[1:])
                elif kind == "swap":
                    if self._swap is not None:  # a second swap before the first ran: the first is moot
                        self._events.append(("done", self._swap[0], None, None))
                    self._swap = command[1:]
                elif kind == "call":
                    self._call(*command[1:])
                elif kind == "version":
                    self.weights_version = command[1]
                elif kind == "stop":
                    self._stopping = True
            if self._stopping:
                break
            if self._swap is not None and not engine.has_work():
                self._run_swap()
                continue
            if engine.has_work():
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001
                    self._step_failed(err)
                    continue
                self._dispatch(outputs)
            self._update_stats()
        self._end_all(Unavailable("the server is shutting down"))
        self._flush()

    def _flush(self) -> None:
        """Send what this pass has to say as one message (nothing when there is nothing)."""
        if self._step:
            self._events.append(("step", self._step))
            self._step = StepOutputs()
        if self._events:
            events, self._events = self._events, []
            self._emit(events)

    def _set_unfit(self, cause: str, reason: str | None) -> None:
        before = dict(self._unfit)
        if reason is None:
            self._unfit.pop(cause, None)
        else:
            self._unfit[cause] = reason
        if self._unfit != before:
            log.log(logging.ERROR if reason else logging.INFO, "engine %s: %s", cause, reason or "serving again")
            self._events.append(("fitness", "; ".join(self._unfit.values()) or None))

    def _step_failed(self, err: Exception) -> None:
        """A step raised past the engine's per-request isolation: the device failed, or a bug.

        Either way the engine's state is not to be trusted for what it held, so every request in
        flight ends. A failed device makes the replica unfit (UNAVAILABLE: the scheduler retries
        elsewhere) until a probe computes again.
        """
        if device_failed(err):
            log.exception("the device failed during a step")
            reason = f"the device failed ({type(err).__name__}: {err})"
            self._set_unfit("device", reason)
            self._fail_all(Unavailable(f"this replica cannot serve now: {reason}"))
        else:
            log.exception("engine step failed outside any one request")
            self._fail_all(Internal(f"the engine failed: {type(err).__name__}: {err}"))

    def _probe(self) -> None:
        try:
            self.engine.probe()
        except Exception as err:  # noqa: BLE001 - still failed
            log.debug("device probe failed: %s", err)
            return
        self._set_unfit("device", None)

    def _end_all(self, error: ServiceError) -> None:
        """Every request in flight, waiting for a swap or the swap itself ends with ``error``."""
        self._fail_all(error)
        if self._swap is not None:
            self._events.append(("done", self._swap[0], error, None))
            self._swap = None
        for command in self._held:
            self._events.append(("admit", command[1], error, ""))
        self._held = []

    def _run_swap(self) -> None:
        assert self._swap is not None
        token, source, version = self._swap
        self._swap = None
        error: BaseException | None = None
        try:
            # A loader (``source(engine) -> state_dict``) reads the weights here, where the engine and its
            # device are: e.g. a copy from the trainer's memory. Its own error reaches the swapper as it is.
            state_dict = source(self.engine) if callable(source) else source
        except Exception as err:  # noqa: BLE001 - nothing changed: the old weights keep serving
            self._events.append(("done", token, err, None))
            self._admit_held()
            return
        try:
            self.engine.load_weights(state_dict, weights_version=version)
            self.weights_version = version
            self._events.append(("version", version))  # before "done": the swapper reads the new identity
            self._set_unfit("weights", None)
            log.info("now serving weights %s", version)
        except WeightsCorrupted as err:  # a mix of two versions: nothing may be served until a load succeeds
            self._set_unfit("weights", f"loading weights {version!r} failed midway ({err})")
            error = Unavailable(f"cannot load weights {version!r}: {err}; this replica serves nothing until "
                                "a load succeeds")
        except Exception as err:  # weights that do not fit: the old ones keep serving
            error = FailedPrecondition(f"cannot load weights {version!r}: {err}")
        del state_dict, source  # shared-memory tensors: let the sender's storage go
        self._events.append(("done", token, error, None))
        self._admit_held()

    def _admit_held(self) -> None:
        held, self._held = self._held, []
        for command in held:
            self._add(*command[1:])

    def _call(self, token: int | None, fn: Callable[..., Any], args: tuple) -> None:
        result, error = None, None
        try:
            result = fn(self.engine, *args)
        except ServiceError as err:
            error = err
        except Exception as err:  # noqa: BLE001 - the caller hears it; the core keeps serving
            log.exception("engine call %s failed", getattr(fn, "__name__", fn))
            error = Internal(f"{type(err).__name__}: {err}")
        if token is not None:
            self._events.append(("done", token, error, result))

    def _add(self, key: int, request: GenerateRequest, pinned_version: str) -> None:
        error: ServiceError | None = None
        try:
            if self._unfit:
                raise Unavailable(f"this replica cannot serve now: {'; '.join(self._unfit.values())}")
            if pinned_version and pinned_version != self.weights_version:
                raise FailedPrecondition(
                    f"pinned weights_version {pinned_version!r}, this replica serves {self.weights_version!r}",
                    precondition_violations=[PreconditionViolation(
                        "WEIGHTS_VERSION", pinned_version, f"this replica serves {self.weights_version!r}")])
            if request.request_id in self._live:
                raise AlreadyExists(f"request_id {request.request_id!r} is already in flight")
            self.engine.add_request(request)
        except ServiceError as err:
            error = err
        except RequestError as err:
            error = InvalidArgument(str(err))
        except Exception as err:  # an engine bug must not take the core down
            log.exception("add_request failed")
            error = Internal(f"the engine failed to admit the request: {type(err).__name__}: {err}")
        if error is None:
            samples = request.options.n if request.mode == "generate" else 1
            self._live[request.request_id] = _Live(key, request, samples)
        self._events.append(("admit", key, error, self.weights_version))

    def _abort(self, key: int, request_id: str) -> None:
        for i, command in enumerate(self._held):
            if command[1] == key:  # waiting for a swap: never admitted
                del self._held[i]
                self._events.append(("admit", key, Unavailable("aborted before admission"), ""))
                return
        live = self._live.get(request_id)
        if live is None or live.key != key:
            # Finished already, or never admitted: a second end marker is harmless and
            # releases the request id of a stream whose consumer left before admission.
            self._step.end(key)
            return
        try:
            outputs = self.engine.abort(request_id)
        except Exception:  # keep the core alive; the request ends below either way
            log.exception("abort failed")
            outputs = []
        self._dispatch(outputs, aborted=request_id)

    def _dispatch(self, outputs: list[SampleOutput], aborted: str | None = None) -> None:
        """Add ``outputs`` (a step's, or an abort's) to this pass's columns; end the streams they finish.

        One pass over the outputs, nothing per request: the per-request work is only for requests that
        finish, fail or are aborted.
        """
        live_of, step = self._live, self._step
        finishing: list[str] = []
        aborting: set[str] = set() if aborted is None else {aborted}
        failed: dict[str, Internal] = {}
        for out in outputs:
            live = live_of.get(out.request_id)
            if live is None:
                continue
            if out.finished:
                if out.finish_reason == "error":
                    # The engine failed on this request alone (see Engine.step): it ends with INTERNAL.
                    failed[out.request_id] = Internal(f"the engine failed on request {out.request_id!r}: {out.error}")
                    continue
                live.finished.add(out.index)
                finishing.append(out.request_id)
                if out.finish_reason == "abort":
                    aborting.add(out.request_id)
            step.add(live.key, out)
        if aborted is not None:
            finishing.append(aborted)
        for rid, error in failed.items():
            step.end(live_of.pop(rid).key, error)
        for rid in dict.fromkeys(finishing):
            live = live_of.get(rid)
            if live is None:
                continue
            if rid in aborting:
                # The engine reports abort only for samples that existed (an n > 1 request
                # forks its siblings after the prompt): the others end here, too.
                for index in range(live.samples):
                    if index not in live.finished:
                        step.add(live.key, SampleOutput(rid, index, [], [], True, "abort",
                                                        num_prompt_tokens=len(live.request.prompt_ids)))
                        live.finished.add(index)
            if len(live.finished) >= live.samples:
                del live_of[rid]
                step.end(live.key)

    def _fail_all(self, error: ServiceError) -> None:
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort after an engine failure")
            self._step.end(live.key, error)
        self._live.clear()
        self._update_stats()

    def _update_stats(self) -> None:
        e = self.engine
        stats = e.stats
        gauges = (e.num_running, e.num_waiting, e.kv_usage())
        new_prompt = max(0, stats["prompt_tokens"] - self._stats["prompt_tokens"])
        new_generated = max(0, stats["generation_tokens"] - self._stats["generation_tokens"])
        if gauges != self._gauges or new_prompt or new_generated:
            self._events.append(("stats", *gauges, new_prompt, new_generated))
            self._gauges = gauges
        self._stats = dict(stats)


# ---------------------------------------------------------------------------- the process transport

def engine_of(model: Any, config: Any = None, tokenizer: Any = None) -> Callable[[], Engine]:
    """A factory for :meth:`AsyncEngine.spawn` that builds an Engine on a private copy of ``model``.

    The model's tensors reach the child by shared memory; the child copies them once, so a weight
    swap there never writes into the sender's model (which would change the parent's weights too).
    """
    return functools.partial(_engine_of_copy, model, config, tokenizer)


def _engine_of_copy(model: Any, config: Any, tokenizer: Any) -> Engine:
    from zerokl.services.engine.types import EngineConfig
    return Engine(copy.deepcopy(model), config if config is not None else EngineConfig(), tokenizer)


def _dumps(obj: Any) -> bytes:
    """Pickle for the pipe: tensors by shared memory (CPU) or CUDA IPC (torch's reductions, registered
    with multiprocessing's ForkingPickler when torch.multiprocessing is imported)."""
    return bytes(ForkingPickler.dumps(obj))


def _loads(data: bytes) -> Any:
    return ForkingPickler.loads(data)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphan holding the device)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


def _child_main(conn: Any, parent_pid: int, threads: int | None) -> None:
    """The engine-core process: build the engine from the factory sent first, then serve the pipe."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
    # A Ctrl-C or a SIGTERM sent to the process group is the parent's to handle: it drains its calls and then
    # stops this process through the pipe (a parent that dies instead takes this one with it: SIGKILL above).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core %(message)s")
    if threads:
        torch.set_num_threads(threads)
    try:
        first = conn.recv_bytes()
    except (EOFError, OSError):  # a prestarted process nobody took (engine_child.discard)
        return
    try:
        factory, weights_version = _loads(first)
        engine = factory()
        info = EngineInfo.of(engine, identify=True)
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        log.exception("building the engine failed")
        conn.send_bytes(_dumps(("failed", f"{type(err).__name__}: {err}")))
        return
    send_lock = threading.Lock()

    def emit(events: list[tuple]) -> None:
        data = _dumps(events)
        with send_lock:
            conn.send_bytes(data)

    core = _Core(engine, emit, weights_version)
    conn.send_bytes(_dumps(("ready", info)))
    # The model, torch and the library live as long as this process: a full collection pass over them
    # would stall a step (see freeze_startup_heap).
    freeze_startup_heap()

    def read() -> None:
        try:
            while True:
                command = _loads(conn.recv_bytes())
                core.post(command)
                if command[0] == "stop":
                    return
        except (EOFError, OSError):  # the parent went away: stop, and exit even if a step hangs
            core.post(("stop",))
            threading.Timer(_STOP_GRACE_S, os._exit, (0,)).start()

    threading.Thread(target=read, name="engine-core-commands", daemon=True).start()
    core.run()
    conn.close()


# ---------------------------------------------------------------------------- streams and the front

class RequestStream:
    """The outputs of one submitted request, in engine order; ends when the request is done.

    Iterate with ``async for`` or :meth:`batches` (everything that arrived since the last batch: what
    a consumer that fell behind forwards at once). Either way each sample's outputs that arrived
    meanwhile come merged into one (:func:`merge_outputs`). Use as an async context manager (or call
    :meth:`aclose`) so a consumer that stops early, or is cancelled because its client went away,
    aborts the request in the engine.

    The front hands a stream each output as a reference into its pass's columns, and wakes the
    consumer only once it has what the consumer waits for (``batches``' ``every``): a step costs a
    stream that has nothing to send one list append, no object per token. Latency (generate mode) is
    observed as the consumer takes the outputs: what its client is sent, when.
    """

    def __init__(self, owner: "AsyncEngine", request: GenerateRequest, key: int, pinned_version: str = "") -> None:
        self.request = request
        self.pinned_version = pinned_version   # "" = any; else admission requires this weights version
        self.weights_version = ""              # the version that computes this request (set at admission)
        self.key = key                         # unique per submit (request ids may be reused)
        self.latency: LatencyTracker | None = None   # generate mode, from admission
        self._owner = owner
        self._pieces: list[tuple[StepOutputs, int]] = []   # outputs arrived, not yet taken
        self._end: Any = None                  # _END or the error the request ended with, once it arrived
        self._ready: list[SampleOutput] = []   # taken, not yet returned by __anext__ (reversed)
        self._waiter: asyncio.Future[None] | None = None
        self._want = 1                         # arrived outputs that wake the consumer (see batches)
        self._ended = False     # the consumer saw the end (or an error)
        self._detached = False  # the consumer left: drop outputs, keep only the end

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> SampleOutput:
        if not self._ready:
            self._want = 1
            if not self._pieces and self._end is None:
                await self._arrival()
            self._ready = self._take()[::-1]
            if not self._ready:
                error = self._finish()
                if error is not None:
                    raise error
                raise StopAsyncIteration
        return self._ready.pop()

    async def batches(self, every: int = 1) -> AsyncIterator[list[SampleOutput]]:
        """The outputs, in batches of all that arrived since the last one (never empty, one merged
        output per sample); raises the stream's error after the outputs that came before it.

        After the first batch, a batch waits for ``every`` outputs (engine steps of a sample), or
        the end: fewer, larger messages for a stream whose tokens are relayed one message each.
        The first batch goes as soon as there is one output: the first token waits for no interval.
        """
        self._want = 1
        while not self._ended:
            if len(self._pieces) < self._want and self._end is None:
                await self._arrival()
            outputs = self._take()
            if outputs:
                self._want = every
                yield outputs
            elif self._end is not None:
                error = self._finish()
                if error is not None:
                    raise error

    def _take(self) -> list[SampleOutput]:
        """Every output that arrived, merged per sample; the latency of what is taken."""
        pieces, self._pieces = self._pieces, []
        outputs = merge_outputs(pieces, self.request.request_id) if pieces else []
        latency = self.latency
        if latency is not None:
            now = time.monotonic()
            for out in outputs:
                latency.tokens(out.index, len(out.token_ids), now)
            if self._end is not None:
                latency.done(now)
                self.latency = None
        return outputs

    def _finish(self) -> BaseException | None:
        """The consumer reached the end; the request's error, if it ended with one."""
        self._ended = True
        return None if self._end is _END else self._end

    async def _arrival(self) -> None:
        """Wait until the core delivered what the consumer wants (StopAsyncIteration once ended)."""
        if self._ended:
            raise StopAsyncIteration
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop consuming; aborts the request if it is still running."""
        if not self._ended:
            self._ended = self._detached = True
            self._pieces = []
            self._owner._post_abort(self)

    # Called on the event loop by the front: output ``i`` of ``step`` is this stream's.
    def _arrive(self, step: StepOutputs, i: int) -> None:
        if self._detached or self._end is not None:
            return
        self._pieces.append((step, i))
        if self._waiter is not None and len(self._pieces) >= self._want and not self._waiter.done():
            self._waiter.set_result(None)

    # Called on the event loop by the front: the request ended (``what``: _END or an error); whatever
    # comes after that (a second end from an abort that crossed the end) is dropped.
    def _close(self, what: Any) -> None:
        if self._end is not None:
            return
        self._end = what
        self._owner._unregister(self)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class AsyncEngine:
    """An :class:`Engine` driven by an engine core (a thread of this process, or its own process),
    with an asyncio front.

    ``AsyncEngine(engine)`` runs the core on a thread; :meth:`spawn` builds the engine in a child
    process. Either way: call :meth:`start` from the event loop that will use it, then
    :meth:`submit` requests. :meth:`close` stops the core; streams still open end with UNAVAILABLE.
    """

    def __init__(self, engine: Engine | None, name: str = "zerokl-engine", weights_version: str = "",
                 *, _process: tuple | None = None) -> None:
        self.engine = engine                   # the Engine in a thread; None when it lives in a child process
        self._name = name
        self._weights_version = weights_version
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}       # request id -> open stream
        self._by_key: dict[int, RequestStream] = {}        # stream key -> stream, until it ended
        self._admits: dict[int, asyncio.Future[None]] = {}
        self._pending: dict[int, asyncio.Future[Any]] = {}  # swaps and calls by token
        self._keys = itertools.count(1)
        self._unfit: str | None = None                     # the core's last fitness report
        self._dead: str | None = None                      # the core (thread or process) ended unasked
        self._fitness_callbacks: list[Callable[[str | None], None]] = []
        self._thread: threading.Thread | None = None
        if _process is None:
            assert engine is not None
            self.info = EngineInfo.of(engine)
            self._core: _Core | None = _Core(engine, self._from_core_thread, weights_version, "the engine thread")
            self._process = self._conn = None
        else:
            self._core = None
            self._process, self._conn, self.info = _process
        self._send_lock = threading.Lock()

    @classmethod
    def spawn(cls, factory: Callable[[], Any], name: str = "zerokl-engine", weights_version: str = "",
              threads: int | None = None, started: tuple[Any, Any] | None = None) -> "AsyncEngine":
        """Build the engine in its own (spawned) process: ``factory()`` runs there and returns the
        Engine; ``factory`` is pickled by torch's ForkingPickler (a model's tensors go by shared
        memory). Blocks until the engine is built; raises RuntimeError with the child's error.

        ``started``: a (process, pipe) spawned earlier (``engine_child.take()``) to use instead of a
        new one. Call from a thread that lives as long as the engine (the main thread): the child is
        armed to die with the thread that spawned it.
        """
        if started is not None:
            process, parent = started
        else:
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe(duplex=True)
            process = ctx.Process(target=_child_main, args=(child, os.getpid(), threads), name=name, daemon=True)
            process.start()
            child.close()
        try:
            parent.send_bytes(_dumps((factory, weights_version)))
            if not parent.poll(_SPAWN_TIMEOUT_S):
                raise RuntimeError(f"the engine process did not start in {_SPAWN_TIMEOUT_S:.0f} s")
            kind, what = _loads(parent.recv_bytes())
        except (EOFError, OSError) as err:
            process.join(5)
            raise RuntimeError(f"the engine process died while starting (exit code {process.exitcode})") from err
        except BaseException:
            process.kill()
            raise
        if kind != "ready":
            process.join(5)
            raise RuntimeError(f"the engine process could not build the engine: {what}")
        return cls(None, name, weights_version, _process=(process, parent, what))

    @property
    def in_process(self) -> bool:
        """True when the engine runs in its own process."""
        return self._process is not None

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None for an engine in a thread)."""
        return self._process.pid if self._process is not None else None

    @property
    def weights_version(self) -> str:
        """The weights version the engine holds (set by the replica at start; a swap changes it)."""
        return self._weights_version

    @weights_version.setter
    def weights_version(self, version: str) -> None:
        self._weights_version = version
        self._post(("version", version))

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Start the core (thread) or the reader of its pipe (process), bound to the running loop."""
        if self._loop is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        if self._core is not None:
            self._thread = threading.Thread(target=self._run_core, name=self._name, daemon=True)
        else:
            self._thread = threading.Thread(target=self._read_pipe, name=f"{self._name}-events", daemon=True)
        self._thread.start()

    def _run_core(self) -> None:
        assert self._core is not None
        self._core.run()
        if not self._stopping:
            self._call_soon(self._lost, "the engine thread ended")

    def _read_pipe(self) -> None:
        """Reader thread: one message per core pass, handed to the loop in one hop."""
        assert self._conn is not None
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                events = _loads(data)
            except Exception:  # noqa: BLE001 - a message we cannot read: the core is not to be trusted
                log.exception("unreadable message from the engine process")
                break
            self._call_soon(self._on_events, events)
        if not self._stopping:
            code = self._process.exitcode if self._process is not None else None
            self._call_soon(self._lost, f"the engine process ended (exit code {code})")

    async def close(self) -> None:
        """Stop the core; requests still running end with UNAVAILABLE."""
        if self._stopping:
            return
        self._stopping = True
        self._post(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 30)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
            self._conn.close()
        # Let the core's last deliveries (the UNAVAILABLE endings) run, then end what is still open.
        await asyncio.sleep(0)
        self._lost("the server is shutting down", report=False)

    def kill(self) -> None:
        """Kill the engine process (what a crash does; tests and the operator's last resort)."""
        if self._process is not None:
            self._process.kill()

    def in_flight(self, request_id: str) -> bool:
        """True while a stream for ``request_id`` is open."""
        return request_id in self._streams

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def unfit_reason(self) -> str | None:
        """Why the engine cannot serve now (None: it can)."""
        return "; ".join(r for r in (self._dead, self._unfit) if r) or None

    def on_fitness(self, callback: Callable[[str | None], None]) -> None:
        """Call ``callback(reason)`` on the event loop whenever the engine becomes unable to
        serve (``reason`` says why) or able again (None); at once if it cannot serve now."""
        self._fitness_callbacks.append(callback)
        reason = self.unfit_reason
        if reason is not None:
            callback(reason)

    def _tell_fitness(self) -> None:
        reason = self.unfit_reason
        for callback in self._fitness_callbacks:
            callback(reason)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _check_open(self) -> None:
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        if self._stopping:
            raise Unavailable("the engine is shutting down")

    async def submit(self, request: GenerateRequest, pinned_version: str = "") -> RequestStream:
        """Queue ``request``; returns its stream once the engine admitted it.

        Raises INVALID_ARGUMENT with the engine's message for a request it
        refuses, ALREADY_EXISTS when the request id is in flight, UNAVAILABLE
        once closing or while unfit, FAILED_PRECONDITION when ``pinned_version``
        is set and the engine holds other weights at admission.
        """
        self._check_open()
        unfit = self.unfit_reason
        if unfit is not None:
            raise Unavailable(f"this replica cannot serve now: {unfit}")
        rid = request.request_id
        if rid in self._streams:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        stream = RequestStream(self, request, next(self._keys), pinned_version)
        self._streams[rid] = stream
        self._by_key[stream.key] = stream
        admitted: asyncio.Future[None] = self._loop.create_future()
        self._admits[stream.key] = admitted
        self._post(("add", stream.key, request, pinned_version))
        try:
            await admitted
        except ServiceError:
            self._unregister(stream)  # never admitted: nothing in the engine to abort
            raise
        except asyncio.CancelledError:
            # Admission may still happen; the abort queued behind it undoes it.
            await stream.aclose()
            raise
        return stream

    async def load_weights(self, state_dict: dict | Callable[[Any], dict], version: str) -> None:
        """Swap the engine's weights to ``version`` once the admitted requests are done.

        ``state_dict`` may be a loader, ``loader(engine) -> state_dict``, called by the core when the
        swap runs (picklable for an engine process): the weights are then read where the engine is;
        an error it raises is raised here, with nothing changed.

        Requests submitted meanwhile wait and are admitted after the swap. Raises
        the engine's error (weights that do not fit the model: nothing changed)
        and UNAVAILABLE once closing. To an engine process the tensors go by shared memory.
        """
        self._check_open()
        await self._request(("swap", state_dict, version), pickle_off_loop=True)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` run by the core between steps (picklable ``fn`` and args for an engine
        process); returns its result. A ServiceError it raises is raised here; another error, INTERNAL."""
        self._check_open()
        return await self._request(("call", fn, args))

    def set_cache_identity(self, weights_version: str, numerics_fingerprint: str) -> None:
        """Key the engine's prefix cache by these (before the first request, or at a swap)."""
        self._post(("call", None, _set_cache_identity, (weights_version, numerics_fingerprint)))

    async def _request(self, command: tuple, pickle_off_loop: bool = False) -> Any:
        assert self._loop is not None
        token = next(self._keys)
        done: asyncio.Future[Any] = self._loop.create_future()
        self._pending[token] = done
        full = (command[0], token, *command[1:])
        if pickle_off_loop and self._conn is not None:
            data = await asyncio.to_thread(_dumps, full)  # a state dict moves to shared memory here
            if self._dead:
                self._pending.pop(token, None)
                raise Unavailable(f"this replica cannot serve now: {self._dead}")
            self._send(data)
        else:
            self._post(full)
        return await done

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight; its stream ends with 'abort' outputs. False if unknown."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._post_abort(stream)
        return True

    def _post_abort(self, stream: RequestStream) -> None:
        self._post(("abort", stream.key, stream.request_id))

    def _unregister(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        self._by_key.pop(stream.key, None)

    def _post(self, command: tuple) -> None:
        if self._core is not None:
            self._core.post(command)
        elif self._dead is None:
            self._send(_dumps(command))

    def _send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError):  # the process is gone: the reader thread reports it
            pass

    def _from_core_thread(self, events: list[tuple]) -> None:
        self._call_soon(self._on_events, events)

    # ------------------------------------------------------------------ events from the core (event loop)

    def _on_events(self, events: list[tuple]) -> None:
        for event in events:
            kind = event[0]
            if kind == "step":
                # A step of 256 streams: one lookup and one append per output, and a consumer wakes only
                # when its stream has what it waits for (RequestStream.batches).
                step: StepOutputs = event[1]
                step.index_tokens()
                by_key = self._by_key
                for i, key in enumerate(step.keys):
                    stream = by_key.get(key)
                    if stream is not None:
                        stream._arrive(step, i)
                for key, end in step.ends:
                    stream = by_key.pop(key, None)
                    if stream is not None:
                        stream._close(_END if end is True else end)
            elif kind == "admit":
                _, key, error, version = event
                future = self._admits.pop(key, None)
                stream = self._by_key.get(key)
                if error is None and stream is not None:
                    stream.weights_version = version
                    if stream.request.mode == "generate":
                        stream.latency = LatencyTracker()
                elif stream is not None:
                    self._unregister(stream)  # never admitted: its request id is free again
                if future is not None:
                    _resolve(future, error)
            elif kind == "done":
                _, token, error, result = event
                future = self._pending.pop(token, None)
                if future is not None:
                    _resolve(future, error, result)
            elif kind == "version":
                self._weights_version = event[1]
            elif kind == "fitness":
                self._unfit = event[1]
                self._tell_fitness()
            elif kind == "stats":
                _, running, waiting, kv, new_prompt, new_generated = event
                metrics.REQUESTS_RUNNING.set(running)
                metrics.REQUESTS_WAITING.set(waiting)
                metrics.KV_CACHE_USAGE.set(kv)
                if new_prompt:
                    metrics.PROMPT_TOKENS.inc(new_prompt)
                if new_generated:
                    metrics.GENERATION_TOKENS.inc(new_generated)

    def _lost(self, reason: str, report: bool = True) -> None:
        """The core is gone (crash, or shutdown): everything waiting on it ends UNAVAILABLE."""
        if report and self._dead is None:
            log.error("%s", reason)
            self._dead = reason
            self._tell_fitness()
        error = Unavailable(f"this replica cannot serve now: {reason}" if report else reason)
        for future in [*self._admits.values(), *self._pending.values()]:
            _resolve(future, error)
        self._admits.clear()
        self._pending.clear()
        for stream in list(self._by_key.values()):
            stream._close(error)
        self._by_key.clear()


def _set_cache_identity(engine: Any, weights_version: str, numerics_fingerprint: str) -> None:
    engine.set_cache_identity(weights_version, numerics_fingerprint)


def _resolve(future: asyncio.Future[Any], error: BaseException | None, result: Any = None) -> None:
    if future.done():  # the submitter was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def collect(stream: RequestStream) -> list[SampleOutput]:
    """Every output of ``stream`` (a convenience for score and prefill requests)."""
    async with stream:
        return [out async for out in stream]
