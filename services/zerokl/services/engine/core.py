"""The engine core: the one thread that drives the synchronous Engine, and the engine process around it.

As vLLM's EngineCore: :class:`EngineCore` makes every call into
:class:`~zerokl.services.engine.engine.Engine` on ONE thread (the engine is not thread-safe, and a
forward must not block the front's event loop). Commands (``add``, ``abort``, ``swap``, ``call``,
``stop``) go into its inbox; it drains them before each step and sleeps while there is no work.
What it has to say after one pass of its loop (admissions, every request's outputs of the step as
:class:`~zerokl.services.engine.outputs.StepOutputs`, swap results, fitness, gauges) leaves as ONE
list of events. Its front (:class:`zerokl.services.inference.AsyncEngine`) turns them into streams
and gRPC statuses.

The core runs on a thread of the front's process, or in a process of its own that owns the device
(:func:`serve`, the spawned child's main: it builds the engine from a picklable factory, dies with
its parent and serves the pipe; :mod:`zerokl.services.engine.child` spawns it).

A request the engine refuses fails only its own admission (INVALID_ARGUMENT); a request the engine
fails on while serving it (its "error" output: see ``Engine.step``) ends alone (INTERNAL). The core
cannot serve while the device failed (a lost CUDA context: every request in flight ends UNAVAILABLE,
and the device is probed until it computes again) or weights failed to load midway (until a later
load succeeds); it says so with a ``fitness`` event. A weight swap waits until the requests already
admitted have finished, holds back the ones that arrive meanwhile, replaces the weights and only then
admits them; a request pinned to a weights version is checked against the version the core holds
*when it is admitted*. Sleep (co-location with a trainer on one device) is the same discipline: a
``sleep`` waits for the admitted requests, then releases the KV cache (level 1) or the weights too
(level 2); requests that arrive while it sleeps wait, held, and are admitted when a ``wake`` or a weight
swap (which wakes it: the swap's weights refill a level-2 sleeper) brings the engine back. Failures are
:class:`~zerokl.services.engine.outputs.CoreError` (the front maps them to its statuses).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import logging
import os
import signal
import threading
from typing import Any, Callable

import torch

from zerokl.services.engine.engine import Engine, RequestError, WeightsCorrupted, device_failed
from zerokl.services.engine.outputs import CoreError, EngineInfo, StepOutputs, dumps, loads
from zerokl.services.engine.types import EngineConfig, GenerateRequest, SampleOutput
from zerokl.services.lifetime import die_with_parent

__all__ = ["EngineCore", "engine_of", "serve"]

log = logging.getLogger(__name__)

_PROBE_INTERVAL_S = 1.0  # how often a failed device is probed
_STOP_GRACE_S = 10.0     # a child whose parent went away gets this long to end its step before it exits


def _unavailable(message: str) -> CoreError:
    return CoreError("UNAVAILABLE", message)


def _internal(message: str) -> CoreError:
    return CoreError("INTERNAL", message)


@dataclasses.dataclass
class _Live:
    """Core-side bookkeeping of one admitted request."""

    key: int                                       # the front's stream key (a request id may be reused)
    request: GenerateRequest
    samples: int                                   # samples that must finish (n; 1 for score/prefill)
    finished: set[int] = dataclasses.field(default_factory=set)


class EngineCore:
    """The engine loop: commands in, one list of events out per pass (see the module docstring).

    Commands: ``("add", key, request, pinned_version)``, ``("abort", key, request_id)``,
    ``("swap", token, state_dict, version)``, ``("call", token, fn, args)`` (``fn(engine, *args)``
    between steps), ``("sleep", token, level)``, ``("wake", token)``, ``("version", v)`` (the version the
    engine holds, set by its owner), ``("stop",)``.
    Events: ``("admit", key, error, version)``, ``("done", token, error, result)``, ``("version", v)`` (a
    swap landed), ``("sleep", level)`` (the engine's sleep level changed: 0 awake), ``("fitness", reason)``,
    ``("stats", running, waiting, kv_usage, new_prompt_tokens, new_generation_tokens)`` and, last,
    ``("step", StepOutputs)``: every stream's outputs and ends of the pass, as columns. An error in an event is a :class:`CoreError`, or a swap loader's own error as it raised it.
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
        self._sleep: tuple | None = None                # (token, level) waiting for the batch
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
            dead = _unavailable(why)
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
                while (not self._inbox and not self._stopping and not engine.has_work() and self._swap is None
                       and self._sleep is None):
                    # A failed device is probed now and then; otherwise sleep until told.
                    if not self._cond.wait(_PROBE_INTERVAL_S if "device" in self._unfit else None):
                        break
                commands, self._inbox = self._inbox, []
            if "device" in self._unfit:
                self._probe()
            for command in commands:
                kind = command[0]
                if kind == "add":
                    if self._swap is not None or self._sleep is not None or self._asleep():
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
                elif kind == "sleep":
                    if self._sleep is not None:  # a second sleep before the first ran: the first is moot
                        self._events.append(("done", self._sleep[0], None, 0))
                    self._sleep = command[1:]
                elif kind == "wake":
                    self._wake(command[1])
                elif kind == "version":
                    self.weights_version = command[1]
                elif kind == "stop":
                    self._stopping = True
            if self._stopping:
                break
            if self._swap is not None and not engine.has_work():
                self._run_swap()
                continue
            if self._sleep is not None and not engine.has_work():
                self._run_sleep()
                continue
            if engine.has_work():
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001
                    self._step_failed(err)
                    continue
                self._dispatch(outputs)
            self._update_stats()
        self._end_all(_unavailable("the server is shutting down"))
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
            self._fail_all(_unavailable(f"this replica cannot serve now: {reason}"))
        else:
            log.exception("engine step failed outside any one request")
            self._fail_all(_internal(f"the engine failed: {type(err).__name__}: {err}"))

    def _probe(self) -> None:
        try:
            self.engine.probe()
        except Exception as err:  # noqa: BLE001 - still failed
            log.debug("device probe failed: %s", err)
            return
        self._set_unfit("device", None)

    def _end_all(self, error: CoreError) -> None:
        """Every request in flight, waiting for a swap or the swap itself ends with ``error``."""
        self._fail_all(error)
        if self._swap is not None:
            self._events.append(("done", self._swap[0], error, None))
            self._swap = None
        if self._sleep is not None:
            self._events.append(("done", self._sleep[0], error, None))
            self._sleep = None
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
            error = _unavailable(f"cannot load weights {version!r}: {err}; this replica serves nothing until "
                                 "a load succeeds")
        except Exception as err:  # weights that do not fit: the old ones keep serving
            error = CoreError("FAILED_PRECONDITION", f"cannot load weights {version!r}: {err}")
        del state_dict, source  # shared-memory tensors: let the sender's storage go
        if error is None and self._asleep():
            error = self._woken()       # a swap wakes a sleeping engine (after the loaded copy is gone)
        self._events.append(("done", token, error, None))
        self._admit_held()

    # ---- sleep (co-location with a trainer on one device)

    def _asleep(self) -> bool:
        return bool(getattr(self.engine, "sleep_level", 0))

    def _run_sleep(self) -> None:
        assert self._sleep is not None
        (token, level), self._sleep = self._sleep, None
        try:
            released = self.engine.sleep(level)
        except (AttributeError, ValueError, RuntimeError) as err:
            self._events.append(("done", token, CoreError("FAILED_PRECONDITION", f"cannot sleep: {err}"), None))
            self._admit_held()
            return
        self._events.append(("sleep", self.engine.sleep_level))
        log.info("asleep at level %d (%d bytes released)", self.engine.sleep_level, released)
        self._events.append(("done", token, None, released))

    def _woken(self) -> CoreError | None:
        """Wake the engine (a fresh KV cache); the error that kept it asleep, if any."""
        if self.engine.sleep_level == 2:     # its weights were released and not refilled
            return CoreError("FAILED_PRECONDITION", "cannot wake: the weights were released (sleep level 2); "
                                                    "a weight switch wakes it")
        try:
            self.engine.wake()
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: still asleep, the caller hears why
            log.exception("waking the engine failed")
            return _unavailable(f"cannot wake: {type(err).__name__}: {err}")
        self._events.append(("sleep", 0))
        log.info("awake")
        return None

    def _wake(self, token: int) -> None:
        error = self._woken() if self._asleep() else None
        self._events.append(("done", token, error, None))
        self._admit_held()

    def _admit_held(self) -> None:
        if self._asleep() or self._sleep is not None:
            return                      # they wait for the engine to wake
        held, self._held = self._held, []
        for command in held:
            self._add(*command[1:])

    def _call(self, token: int | None, fn: Callable[..., Any], args: tuple) -> None:
        result, error = None, None
        try:
            result = fn(self.engine, *args)
        except Exception as err:  # noqa: BLE001 - the caller hears it; the core keeps serving
            log.exception("engine call %s failed", getattr(fn, "__name__", fn))
            error = _internal(f"{type(err).__name__}: {err}")
        if token is not None:
            self._events.append(("done", token, error, result))

    def _add(self, key: int, request: GenerateRequest, pinned_version: str) -> None:
        error: CoreError | None = None
        try:
            if self._unfit:
                raise _unavailable(f"this replica cannot serve now: {'; '.join(self._unfit.values())}")
            if pinned_version and pinned_version != self.weights_version:
                raise CoreError(
                    "FAILED_PRECONDITION",
                    f"pinned weights_version {pinned_version!r}, this replica serves {self.weights_version!r}",
                    [("WEIGHTS_VERSION", pinned_version, f"this replica serves {self.weights_version!r}")])
            if request.request_id in self._live:
                raise CoreError("ALREADY_EXISTS", f"request_id {request.request_id!r} is already in flight")
            self.engine.add_request(request)
        except CoreError as err:
            error = err
        except RequestError as err:
            error = CoreError("INVALID_ARGUMENT", str(err))
        except Exception as err:  # an engine bug must not take the core down
            log.exception("add_request failed")
            error = _internal(f"the engine failed to admit the request: {type(err).__name__}: {err}")
        if error is None:
            samples = request.options.n if request.mode == "generate" else 1
            self._live[request.request_id] = _Live(key, request, samples)
        self._events.append(("admit", key, error, self.weights_version))

    def _abort(self, key: int, request_id: str) -> None:
        for i, command in enumerate(self._held):
            if command[1] == key:  # waiting for a swap: never admitted
                del self._held[i]
                self._events.append(("admit", key, _unavailable("aborted before admission"), ""))
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
        failed: dict[str, CoreError] = {}
        for out in outputs:
            live = live_of.get(out.request_id)
            if live is None:
                continue
            if out.finished:
                if out.finish_reason == "error":
                    # The engine failed on this request alone (see Engine.step): it ends with INTERNAL.
                    failed[out.request_id] = _internal(f"the engine failed on request {out.request_id!r}: {out.error}")
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

    def _fail_all(self, error: CoreError) -> None:
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



def engine_of(model: Any, config: Any = None, tokenizer: Any = None) -> Callable[[], Engine]:
    """A factory for an engine process (:meth:`zerokl.services.inference.AsyncEngine.spawn`): an Engine on
    a private copy of ``model``.

    The model's tensors reach the child by shared memory; the child copies them once, so a weight
    swap there never writes into the sender's model (which would change the parent's weights too).
    """
    return functools.partial(_engine_of_copy, model, config, tokenizer)


def _engine_of_copy(model: Any, config: Any, tokenizer: Any) -> Engine:
    return Engine(copy.deepcopy(model), config if config is not None else EngineConfig(), tokenizer)


def serve(conn: Any, parent_pid: int, threads: int | None) -> None:
    """The engine process's main: build the engine from the factory sent first, then serve the pipe.

    The front sends ``dumps((factory, weights_version))`` first and reads back ``("ready", EngineInfo)``
    or ``("failed", why)``; then commands go in and each pass's events come out, one message each.
    """
    if not die_with_parent(parent_pid):     # the parent died before the death signal was armed
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
    except (EOFError, OSError):  # a prestarted process nobody took (child.discard)
        return
    try:
        factory, weights_version = loads(first)
        engine = factory()
        info = EngineInfo.of(engine, identify=True)
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        log.exception("building the engine failed")
        conn.send_bytes(dumps(("failed", f"{type(err).__name__}: {err}")))
        return
    send_lock = threading.Lock()

    def emit(events: list[tuple]) -> None:
        data = dumps(events)
        with send_lock:
            conn.send_bytes(data)

    core = EngineCore(engine, emit, weights_version)
    conn.send_bytes(dumps(("ready", info)))
    # The model, torch and the library live as long as this process: a full collection pass over them
    # would stall a step (as zerokl.services.runtime.server.freeze_startup_heap does for a server).
    gc.collect()
    gc.freeze()

    def read() -> None:
        try:
            while True:
                command = loads(conn.recv_bytes())
                core.post(command)
                if command[0] == "stop":
                    return
        except (EOFError, OSError):  # the parent went away: stop, and exit even if a step hangs
            core.post(("stop",))
            threading.Timer(_STOP_GRACE_S, os._exit, (0,)).start()

    threading.Thread(target=read, name="engine-core-commands", daemon=True).start()
    core.run()
    conn.close()
