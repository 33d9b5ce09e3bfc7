"""The engine's asyncio front: per-request async streams over an engine core (a thread, or its own process).

Two halves, as vLLM's EngineCore / AsyncLLM split:

- the **core** (:class:`~zerokl.services.engine.core.EngineCore`, in the engine package) makes every
  call into the Engine on ONE thread and sends what one pass of its loop has to say (admissions,
  every request's outputs of the step, swap results, fitness, gauges) as ONE list of events;
- the **front** (:class:`AsyncEngine`, here) lives on the event loop: it turns those events into
  :class:`RequestStream` deliveries (one wake-up of the loop per step, and of a stream's consumer only
  when the stream has what it waits for), resolves the futures of submits and swaps, maps the core's
  errors (:class:`~zerokl.services.engine.outputs.CoreError`) to the service's statuses, tells fitness
  callbacks and keeps the ``zerokl_`` serving metrics (TTFT, inter-token and end-to-end latency,
  running/waiting, KV usage, token totals).

Where the core runs (:meth:`AsyncEngine.__init__` vs :meth:`AsyncEngine.spawn`):

- **in a thread** of this process, given an :class:`Engine` object: a step's Python and every gRPC
  message's protobuf work share one interpreter lock. Tests that build or break an in-memory engine use
  it, as does a tensor-parallel replica (its rank 0 runs collectives with followers this process started);
- **in its own process** (spawned by :mod:`zerokl.services.engine.child`; it builds the engine from a
  picklable factory and owns the device): the events of a pass come back over a pipe as one message, its
  outputs as columns (:class:`~zerokl.services.engine.outputs.StepOutputs`), commands go in over the same
  pipe (:mod:`zerokl.services.engine.outputs` is the wire format). The child dies with its parent; its
  death ends every request in flight with UNAVAILABLE and makes the engine unfit (NOT_SERVING health).

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

Sleep (:meth:`AsyncEngine.sleep` / :meth:`AsyncEngine.wake`; co-location with a trainer on one device):
the core waits for the admitted requests, then releases the KV cache (level 1) or the weights too (level
2). Requests submitted while it sleeps wait (held in the core, as during a swap) and are admitted when it
wakes: by :meth:`AsyncEngine.wake`, or by the next weight swap, which refills a level-2 sleeper's weights.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from zerokl.services.engine import child
from zerokl.services.engine.outputs import CoreError, EngineInfo, StepOutputs, dumps, loads, merge_outputs
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

if TYPE_CHECKING:   # the engine (torch, the numerics library): only where it runs on a thread of this process
    from zerokl.services.engine.engine import Engine

__all__ = ["AsyncEngine", "RequestStream", "collect"]

log = logging.getLogger(__name__)

_END = object()  # how a stream ends when the request is done (else: the error it ended with)
_SPAWN_TIMEOUT_S = 600.0  # building the engine in the child (model load, device init) may take this long

# The statuses the core names (CoreError.status), as the service's errors.
_STATUS: dict[str, type[ServiceError]] = {
    "UNAVAILABLE": Unavailable,
    "FAILED_PRECONDITION": FailedPrecondition,
    "INVALID_ARGUMENT": InvalidArgument,
    "ALREADY_EXISTS": AlreadyExists,
    "INTERNAL": Internal,
}


def _service_error(error: Any) -> Any:
    """The service's error for what the core reported (a CoreError); anything else (None, True, a swap
    loader's own error) as it is."""
    if isinstance(error, CoreError):
        return _STATUS[error.status](error.message, precondition_violations=[
            PreconditionViolation(*v) for v in error.violations])
    return error


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
        self.sleep_level = 0                               # the core's last sleep report (0: awake)
        self.sleeps = 0                                    # sleeps and wakes so far (co-location)
        self.wakes = 0
        self._dead: str | None = None                      # the core (thread or process) ended unasked
        self._fitness_callbacks: list[Callable[[str | None], None]] = []
        self._thread: threading.Thread | None = None
        if _process is None:
            assert engine is not None
            # Imported here: an engine on a thread was built in this process, torch and all; a front whose engine
            # runs in a child process never loads the core (nor torch).
            from zerokl.services.engine.core import EngineCore
            from zerokl.services.inference.tensor_parallel import LockstepEngine
            self.info = EngineInfo.of(engine, lockstep=isinstance(engine, LockstepEngine))
            self._core: EngineCore | None = EngineCore(engine, self._from_core_thread, weights_version,
                                                       "the engine thread")
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

        ``started``: a (process, pipe) spawned earlier (:func:`zerokl.services.engine.child.take`) to use
        instead of a new one. Call from a thread that lives as long as the engine (the main thread): the child is
        armed to die with the thread that spawned it.
        """
        process, parent = started if started is not None else child.start(name, threads)
        try:
            parent.send_bytes(dumps((factory, weights_version)))
            if not parent.poll(_SPAWN_TIMEOUT_S):
                raise RuntimeError(f"the engine process did not start in {_SPAWN_TIMEOUT_S:.0f} s")
            kind, what = loads(parent.recv_bytes())
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
                events = loads(data)
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
        result, error = await self._request(("call", functools.partial(_answer, fn), args))
        if error is not None:
            raise error
        return result

    async def sleep(self, level: int) -> int:
        """Release the KV cache (``level`` 1) or the weights too (2) once the admitted requests are done;
        returns the bytes released. Requests submitted meanwhile wait for :meth:`wake` or a weight swap.
        FAILED_PRECONDITION for an engine that cannot sleep (another level, a tensor-parallel engine)."""
        self._check_open()
        return await self._request(("sleep", level))

    async def wake(self) -> None:
        """Allocate the KV cache again and admit the requests that waited. FAILED_PRECONDITION while the
        weights are released (level 2): a weight swap wakes it."""
        self._check_open()
        await self._request(("wake",))

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
            data = await asyncio.to_thread(dumps, full)  # a state dict moves to shared memory here
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
            self._send(dumps(command))

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
                        stream._close(_END if end is True else _service_error(end))
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
                    _resolve(future, _service_error(error))
            elif kind == "done":
                _, token, error, result = event
                future = self._pending.pop(token, None)
                if future is not None:
                    _resolve(future, _service_error(error), result)
            elif kind == "version":
                self._weights_version = event[1]
            elif kind == "sleep":
                if event[1] and not self.sleep_level:
                    self.sleeps += 1
                    metrics.ENGINE_SLEEPS.inc()
                elif not event[1] and self.sleep_level:
                    self.wakes += 1
                    metrics.ENGINE_WAKES.inc()
                self.sleep_level = event[1]
                metrics.ENGINE_SLEEP_LEVEL.set(event[1])
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


def _answer(fn: Callable[..., Any], engine: Any, *args: Any) -> tuple[Any, ServiceError | None]:
    """What the core runs for :meth:`AsyncEngine.call`: a ServiceError ``fn`` raises is the caller's answer,
    handed back beside the result (the core reports any other error as INTERNAL, knowing no ServiceError)."""
    try:
        return fn(engine, *args), None
    except ServiceError as err:
        return None, err


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
