"""Drive the synchronous Engine from asyncio: one engine thread, per-request async streams.

Every call into :class:`~zerokl.services.engine.engine.Engine` happens on ONE
background thread (the engine is not thread-safe, and a forward must not block
the event loop). The event loop talks to it through an inbox guarded by a
condition: ``add`` and ``abort`` commands go in, the thread drains them before
each step, and it sleeps on the condition while there is no work. A step's
outputs go back in one ``loop.call_soon_threadsafe`` (one wake-up of the loop
per step, not per request) into the :class:`RequestStream` of each request,
where a consumer that fell behind takes all that arrived meanwhile at once
(:meth:`RequestStream.batches`).

A request the engine refuses (RequestError) fails only its own submit, as
INVALID_ARGUMENT; nothing else in the batch notices. A request the engine
fails on while serving it (its "error" output: see ``Engine.step``) ends with
INTERNAL, alone; its neighbours complete with their usual bits.

Fitness: the engine cannot serve when its thread died, when the device failed
(a lost CUDA context: every request in flight ends UNAVAILABLE, so a scheduler
retries them elsewhere, and the device is probed until it computes again) or
when weights failed to load midway (until a later load succeeds). Meanwhile
submits are refused with UNAVAILABLE, and :meth:`AsyncEngine.on_fitness`
callbacks hear the reason (the servers turn it into NOT_SERVING health).

Weights swap between requests (:meth:`AsyncEngine.load_weights`): the swap
waits on the engine thread until the requests already admitted have finished,
holds back the ones that arrive meanwhile, replaces the weights and only then
admits them. A request pinned to a weights version is checked against the
version the engine holds *when it is admitted*, and every stream records that
version, so an output is never stamped with weights that did not compute it.

The thread also keeps the ``zerokl_`` serving metrics: TTFT, inter-token and end-to-end latency,
running/waiting, KV usage, prompt and generation token totals.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from typing import Any, AsyncIterator, Callable

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

__all__ = ["AsyncEngine", "RequestStream", "collect"]

log = logging.getLogger(__name__)

_END = object()  # a stream's last item: the request is done
_PROBE_INTERVAL_S = 1.0  # how often a failed device is probed


class RequestStream:
    """The outputs of one submitted request, in engine order; ends when the request is done.

    Iterate with ``async for`` (one output at a time) or :meth:`batches` (everything that
    arrived since the last batch: what a consumer that fell behind forwards at once). Use
    as an async context manager (or call :meth:`aclose`) so a consumer that stops early,
    or is cancelled because its client went away, aborts the request in the engine.
    """

    def __init__(self, owner: "AsyncEngine", request: GenerateRequest, pinned_version: str = "") -> None:
        self.request = request
        self.pinned_version = pinned_version   # "" = any; else admission requires this weights version
        self.weights_version = ""              # the version that computes this request (set at admission)
        self._owner = owner
        self._buffer: list[Any] = []           # outputs not yet consumed, then maybe _END or an error
        self._waiter: asyncio.Future[None] | None = None
        self._want = 1                         # buffered outputs that wake the consumer (see batches)
        self._complete = False  # the end marker (or an error) was delivered
        self._ended = False     # the consumer saw the end (or an error)
        self._detached = False  # the consumer left: drop outputs, keep only the end marker

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> SampleOutput:
        self._want = 1
        if not self._buffer:
            await self._arrival()
        item = self._buffer.pop(0)
        if item is _END or isinstance(item, BaseException):
            self._ended = True
            if item is _END:
                raise StopAsyncIteration
            raise item
        return item

    async def batches(self, every: int = 1) -> AsyncIterator[list[SampleOutput]]:
        """The outputs, in batches of all that arrived since the last one (never empty); raises the
        stream's error after the outputs that came before it.

        After the first batch, a batch waits for ``every`` outputs (engine steps of a sample), or
        the end: fewer, larger messages for a stream whose tokens are relayed one message each.
        """
        first = True
        while not self._ended:
            self._want = 1 if first else every
            first = False
            if len(self._buffer) < self._want and not self._complete:
                await self._arrival()
            items, self._buffer = self._buffer, []
            last = items[-1]
            if last is not _END and not isinstance(last, BaseException):
                yield items
                continue
            self._ended = True
            if len(items) > 1:
                yield items[:-1]
            if last is not _END:
                raise last

    async def _arrival(self) -> None:
        """Wait until the engine thread delivered something (StopAsyncIteration once ended)."""
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
            self._owner._post_abort(self)

    # Called on the event loop (via call_soon_threadsafe) by the engine thread. ``items`` ends with the
    # end marker or an error when the request is done; whatever comes after that (a second marker
    # from an abort that crossed the end) is dropped.
    def _put(self, items: list[Any]) -> None:
        if not items or self._complete:
            return
        last = items[-1]
        if last is _END or isinstance(last, BaseException):
            self._complete = True
            self._owner._unregister(self)
        if self._detached:
            return
        self._buffer.extend(items)
        if (self._waiter is not None and not self._waiter.done()
                and (len(self._buffer) >= self._want or self._complete)):
            self._waiter.set_result(None)


@dataclasses.dataclass
class _Live:
    """Engine-thread bookkeeping of one admitted request."""

    stream: RequestStream
    samples: int                                   # samples that must finish (n; 1 for score/prefill)
    latency: LatencyTracker | None                 # generate mode only
    finished: set[int] = dataclasses.field(default_factory=set)


class AsyncEngine:
    """An :class:`Engine` run by one background thread, with an asyncio front.

    Create it, call :meth:`start` from the event loop that will use it, then
    :meth:`submit` requests. :meth:`close` stops the thread; streams still
    open end with UNAVAILABLE.
    """

    def __init__(self, engine: Engine, name: str = "zerokl-engine", weights_version: str = "") -> None:
        self.engine = engine
        self.weights_version = weights_version   # written by the engine thread only (at a swap)
        self._swap: tuple[dict, str, asyncio.Future[None]] | None = None   # engine thread: pending swap
        self._held: list[tuple[RequestStream, asyncio.Future[None]]] = []  # adds waiting for the swap
        self._name = name
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}       # event-loop side: request id -> open stream
        self._live: dict[str, _Live] = {}                  # engine-thread side
        self._stats = dict(engine.stats)
        self._unfit: dict[str, str] = {}                   # engine thread: why it cannot serve, by cause
        self._fitness_callbacks: list[Callable[[str | None], None]] = []

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the engine thread; requests still running end with UNAVAILABLE."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        # Let the thread's last deliveries (the UNAVAILABLE endings) run.
        await asyncio.sleep(0)

    def in_flight(self, request_id: str) -> bool:
        """True while a stream for ``request_id`` is open."""
        return request_id in self._streams

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def unfit_reason(self) -> str | None:
        """Why the engine cannot serve now (None: it can)."""
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            return self._unfit.get("thread", "the engine thread is not running")
        return "; ".join(self._unfit.values()) or None

    def on_fitness(self, callback: Callable[[str | None], None]) -> None:
        """Call ``callback(reason)`` on the event loop whenever the engine becomes unable to
        serve (``reason`` says why) or able again (None); at once if it cannot serve now."""
        self._fitness_callbacks.append(callback)
        reason = self.unfit_reason
        if reason is not None:
            callback(reason)

    def _fitness_changed(self) -> None:
        """From the engine thread: tell the callbacks (on the event loop) the state now."""
        reason = "; ".join(self._unfit.values()) or None
        for callback in self._fitness_callbacks:
            self._call_soon(callback, reason)

    def _set_unfit(self, cause: str, reason: str | None) -> None:
        before = dict(self._unfit)
        if reason is None:
            self._unfit.pop(cause, None)
        else:
            self._unfit[cause] = reason
        if self._unfit != before:
            log.log(logging.ERROR if reason else logging.INFO, "engine %s: %s", cause, reason or "serving again")
            self._fitness_changed()

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def submit(self, request: GenerateRequest, pinned_version: str = "") -> RequestStream:
        """Queue ``request``; returns its stream once the engine admitted it.

        Raises INVALID_ARGUMENT with the engine's message for a request it
        refuses, ALREADY_EXISTS when the request id is in flight, UNAVAILABLE
        once closing, FAILED_PRECONDITION when ``pinned_version`` is set and
        the engine holds other weights at admission.
        """
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        if self._stopping:
            raise Unavailable("the engine is shutting down")
        unfit = self.unfit_reason
        if unfit is not None:
            raise Unavailable(f"this replica cannot serve now: {unfit}")
        rid = request.request_id
        if rid in self._streams:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        stream = RequestStream(self, request, pinned_version)
        self._streams[rid] = stream
        admitted: asyncio.Future[None] = self._loop.create_future()
        self._post(("add", (stream, admitted)))
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

    async def load_weights(self, state_dict: dict, version: str) -> None:
        """Swap the engine's weights to ``version`` once the admitted requests are done.

        Requests submitted meanwhile wait and are admitted after the swap. Raises
        the engine's error (weights that do not fit the model: nothing changed)
        and UNAVAILABLE once closing.
        """
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        if self._stopping:
            raise Unavailable("the engine is shutting down")
        done: asyncio.Future[None] = self._loop.create_future()
        self._post(("swap", (state_dict, version, done)))
        await done

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight; its stream ends with 'abort' outputs. False if unknown."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._post_abort(stream)
        return True

    def _post_abort(self, stream: RequestStream) -> None:
        self._post(("abort", stream))

    def _unregister(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _post(self, command: tuple[str, Any]) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    def _deliver(self, stream: RequestStream, items: list[Any]) -> None:
        """From the engine thread: hand ``items`` to ``stream`` on the event loop."""
        self._call_soon(stream._put, items)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - a bug in this loop: say so, end what waits on it
            log.exception("the engine thread died")
            self._set_unfit("thread", f"the engine thread died ({type(err).__name__}: {err})")
            dead = Unavailable(f"the engine thread died ({type(err).__name__}: {err})")
            with self._cond:
                commands, self._inbox = self._inbox, []
            for kind, arg in commands:
                if kind == "add":
                    self._resolve(arg[1], dead)
                elif kind == "swap":
                    self._resolve(arg[2], dead)
            self._end_all(dead)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not engine.has_work() and self._swap is None:
                    # A failed device is probed now and then; otherwise sleep until told.
                    if not self._cond.wait(_PROBE_INTERVAL_S if "device" in self._unfit else None):
                        break
                if self._stopping:
                    break
                commands, self._inbox = self._inbox, []
            if "device" in self._unfit:
                self._probe()
            for kind, arg in commands:
                if kind == "add":
                    if self._swap is not None:
                        self._held.append(arg)
                    else:
                        self._add(*arg)
                elif kind == "swap":
                    if self._swap is not None:  # a second swap before the first ran: the first is moot
                        self._resolve(self._swap[2], None)
                    self._swap = arg
                else:
                    self._abort(arg)
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
            self._update_metrics()
        self._end_all(Unavailable("the server is shutting down"))

    def _step_failed(self, err: Exception) -> None:
        """A step raised past the engine's per-request isolation: the device failed, or a bug.

        Either way the engine's state is not to be trusted for what it held, so every
        request in flight ends. A failed device makes the replica unfit (UNAVAILABLE:
        the scheduler retries elsewhere) until a probe computes again.
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
            self._resolve(self._swap[2], error)
            self._swap = None
        for _, admitted in self._held:
            self._resolve(admitted, error)
        self._held = []

    def _resolve(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        self._call_soon(_resolve, future, error)

    def _run_swap(self) -> None:
        assert self._swap is not None
        state_dict, version, done = self._swap
        self._swap = None
        error: BaseException | None = None
        try:
            self.engine.load_weights(state_dict, weights_version=version)
            self.weights_version = version
            self._set_unfit("weights", None)
            log.info("now serving weights %s", version)
        except WeightsCorrupted as err:  # a mix of two versions: nothing may be served until a load succeeds
            self._set_unfit("weights", f"loading weights {version!r} failed midway ({err})")
            error = Unavailable(f"cannot load weights {version!r}: {err}; this replica serves nothing until "
                                "a load succeeds")
        except Exception as err:  # weights that do not fit: the old ones keep serving
            error = FailedPrecondition(f"cannot load weights {version!r}: {err}")
        self._resolve(done, error)
        held, self._held = self._held, []
        for stream, admitted in held:
            if not stream._detached:  # its submitter left while it waited: nothing to admit
                self._add(stream, admitted)

    def _add(self, stream: RequestStream, admitted: asyncio.Future[None]) -> None:
        request = stream.request
        error: ServiceError | None = None
        try:
            if self._unfit:
                raise Unavailable(f"this replica cannot serve now: {'; '.join(self._unfit.values())}")
            if stream.pinned_version and stream.pinned_version != self.weights_version:
                raise FailedPrecondition(
                    f"pinned weights_version {stream.pinned_version!r}, this replica serves {self.weights_version!r}",
                    precondition_violations=[PreconditionViolation(
                        "WEIGHTS_VERSION", stream.pinned_version,
                        f"this replica serves {self.weights_version!r}")])
            stream.weights_version = self.weights_version
            self.engine.add_request(request)
        except ServiceError as err:
            error = err
        except RequestError as err:
            error = InvalidArgument(str(err))
        except Exception as err:  # an engine bug must not take the thread down
            log.exception("add_request failed")
            error = Internal(f"the engine failed to admit the request: {type(err).__name__}: {err}")
        if error is None:
            generate = request.mode == "generate"
            self._live[request.request_id] = _Live(stream, request.options.n if generate else 1,
                                                   LatencyTracker() if generate else None)
        self._resolve(admitted, error)

    def _abort(self, stream: RequestStream) -> None:
        live = self._live.get(stream.request_id)
        if live is None or live.stream is not stream:
            # Finished already, or never admitted: a second end marker is harmless and
            # releases the request id of a stream whose consumer left before admission.
            self._deliver(stream, [_END])
            return
        try:
            outputs = self.engine.abort(stream.request_id)
        except Exception:  # keep the thread alive; the request ends below either way
            log.exception("abort failed")
            outputs = []
        self._dispatch(outputs, aborted=stream.request_id)

    def _dispatch(self, outputs: list[SampleOutput], aborted: str | None = None) -> None:
        now = time.monotonic()
        by_request: dict[str, list[Any]] = defaultdict(list)
        failed: dict[str, Internal] = {}
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.finish_reason == "error":
                # The engine failed on this request alone (see Engine.step): it ends with INTERNAL.
                failed[out.request_id] = Internal(f"the engine failed on request {out.request_id!r}: {out.error}")
                continue
            by_request[out.request_id].append(out)
            if live.latency is not None:
                live.latency.tokens(out.index, len(out.token_ids), now)
            if out.finished:
                live.finished.add(out.index)
        if aborted is not None:
            by_request.setdefault(aborted, [])
        deliveries: list[tuple[RequestStream, list[Any]]] = []
        for rid, error in failed.items():
            live = self._live.pop(rid)
            if live.latency is not None:
                live.latency.done(now)
            deliveries.append((live.stream, [*by_request.pop(rid, []), error]))
        for rid, items in by_request.items():
            live = self._live[rid]
            if rid == aborted or any(o.finish_reason == "abort" for o in items):
                # The engine reports abort only for samples that existed (an n > 1 request
                # forks its siblings after the prompt): the others end here, too.
                for index in range(live.samples):
                    if index not in live.finished:
                        items.append(SampleOutput(rid, index, [], [], True, "abort",
                                                  num_prompt_tokens=len(live.stream.request.prompt_ids)))
                        live.finished.add(index)
            if len(live.finished) >= live.samples:
                del self._live[rid]
                if live.latency is not None:
                    live.latency.done(now)
                items.append(_END)
            deliveries.append((live.stream, items))
        # One hop to the event loop per step, whatever the batch size: it wakes every consumer at once.
        if deliveries:
            self._call_soon(_deliver_all, deliveries)

    def _fail_all(self, error: ServiceError) -> None:
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort after an engine failure")
            self._deliver(live.stream, [error])
        self._live.clear()
        self._update_metrics()

    def _update_metrics(self) -> None:
        e = self.engine
        metrics.REQUESTS_RUNNING.set(e.num_running)
        metrics.REQUESTS_WAITING.set(e.num_waiting)
        metrics.KV_CACHE_USAGE.set(e.kv_usage())
        stats = e.stats
        if stats["prompt_tokens"] > self._stats["prompt_tokens"]:
            metrics.PROMPT_TOKENS.inc(stats["prompt_tokens"] - self._stats["prompt_tokens"])
        if stats["generation_tokens"] > self._stats["generation_tokens"]:
            metrics.GENERATION_TOKENS.inc(stats["generation_tokens"] - self._stats["generation_tokens"])
        self._stats = dict(stats)


def _deliver_all(deliveries: list[tuple[RequestStream, list[Any]]]) -> None:
    for stream, items in deliveries:
        stream._put(items)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the submitter was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


async def collect(stream: RequestStream) -> list[SampleOutput]:
    """Every output of ``stream`` (a convenience for score and prefill requests)."""
    async with stream:
        return [out async for out in stream]
