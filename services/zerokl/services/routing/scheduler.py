"""The scheduler's client-facing ``zerokl.v1.Inference``: one front door over the prefill/decode fleet.

Clients call the scheduler exactly as they would call a replica (same
Generate/Abort/Score/Info messages). For each request the scheduler

1. resolves the request's :class:`~.router.Pin` (its own pins, else the
   scheduler's configured pin, else what the healthy fleet agrees on; a mixed
   fleet is refused with FAILED_PRECONDITION naming the replicas),
2. picks a decode replica and, with prefill replicas available, a prefill
   replica too, and tells the decode replica about it
   (``Decode.GenerateFromPrefill``): the decode replica reads the prompt's KV
   straight from the prefill replica, so no KV byte passes through here;
   without prefill replicas the decode replica prefills itself (``Generate``),
3. relays the decode stream (tokens only), sending the replicas the resolved
   pin so that one whose identity changed since the last poll refuses instead
   of computing other numbers,
4. on UNAVAILABLE (or a replica ending the request with ABORT nobody asked
   for, as a shutting-down replica does) re-runs the request on another
   replica of the same pin: a decode failure (mid-handoff or mid-stream) on
   another decode replica, a prefill failure (reported by the decode replica
   with a KV_HANDOFF ErrorInfo naming it) with another prefill replica. The
   replayed prefix is checked against what the client already has
   (:class:`~.replay.StreamLedger`) and only the rest is forwarded, so the
   client sees one uninterrupted, identical stream.

Errors other than UNAVAILABLE pass through with the replica's code and
details. Health is NOT_SERVING until a decode replica matching the current
pin is healthy.

The fleet converges on its own: the version of the last whole-fleet switch is the
fleet's target (kept in ``fleet.json`` of the state directory, so a restarted
scheduler knows it too). Unpinned requests are served at the target, and a healthy
replica found on another version (restarted at an old one, or left behind by a
switch that could not put it back) is switched to the target by the scheduler
itself, without a canary: the target passed one. A target the weight store can no
longer hand out whole (DATA_LOSS when a replica fetches it: a corrupt shard) cannot
be served by any replica that restarts, so the scheduler moves the whole fleet to
the most recently served good version in its record that switches and passes a
canary, and records the fallback and why (``fleet.json``'s note).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc
import grpc.aio
from google.rpc import error_details_pb2
from opentelemetry import trace

from zerokl.services.inference.client import InferenceClient
from zerokl.services.inference.service import INFERENCE_SERVICE, InferenceServicer
from zerokl.services.inference.types import GenerateDelta, InferenceRequest, ScoreResult, SleepState, coalesce
from zerokl.services.runtime import metrics as runtime_metrics
from zerokl.services.runtime.errors import (
    AlreadyExists,
    CanaryFailed,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    RelayedError,
    ServiceError,
    Unavailable,
    UnservedPin,
    handoff_peer,
    status_details,
)
from zerokl.services.runtime.info import ServiceIdentity, default_replica_id
from zerokl.services.runtime.metrics import LatencyTracker
from zerokl.services.runtime.server import ServiceServer
from zerokl.services.runtime.streams import batches_until_set
from zerokl.services.runtime.tracing import tag_request
from zerokl.services.routing import metrics
from zerokl.services.routing.fleet import FleetRecord, read_fleet, write_fleet
from zerokl.services.routing.registry import ReplicaEndpoint, ReplicaView, Registry
from zerokl.services.routing.replay import StreamLedger
from zerokl.services.routing.router import NoReplica, Pin, Policy, Router, resolve_pin
from zerokl.services.weightstore.shared import SharedExport
from zerokl.v1 import inference_pb2_grpc
from zerokl.vocab import SamplingOptions

__all__ = ["SchedulerConfig", "Scheduler", "add_scheduler_service", "CANARY_PROMPT", "CANARY_TOKENS"]

log = logging.getLogger(__name__)

# Seconds before the scheduler tries again to bring a replica to the fleet's target version after a failure.
_CONVERGE_RETRY_S = 2.0

# The canary of new weights: a fixed probe (ids every vocabulary has) generated greedily on one replica.
CANARY_PROMPT = (3, 4, 5, 6, 7, 8, 9, 10)
CANARY_TOKENS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler routes.

    ``pin`` applies to requests that do not pin a field themselves.
    ``max_attempts`` bounds the replicas one request may fail on before
    UNAVAILABLE. ``route_wait_s`` is how long a request waits for a healthy
    replica of its pin to appear (a replica restarting, weights loading)
    before it fails. ``handoff_timeout_s`` bounds a decode replica's read of
    a prefill replica's KV (prefill included): past it the attempt fails as
    UNAVAILABLE and is retried.
    """

    pin: Pin = Pin()
    policy: Policy = Policy.LEAST_LOADED
    max_attempts: int = 3
    route_wait_s: float = 5.0
    abort_timeout_s: float = 5.0
    canary_timeout_s: float = 60.0
    handoff_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


@dataclass
class _Flight:
    """A Generate in flight: where it runs now, and whether the client aborted it."""

    request_id: str
    cut: asyncio.Event = field(default_factory=asyncio.Event)   # stop reading upstream now
    aborted: bool = False
    endpoint: ReplicaEndpoint | None = None
    client: InferenceClient | None = None


class _Attempt(Exception):
    """One attempt failed in a way another replica may not (the reason names the replica)."""

    def __init__(self, view: ReplicaView, reason: str) -> None:
        super().__init__(f"{view.describe()}: {reason}")
        self.view = view
        self.reason = reason


# What a replica refuses a pinned request for when it no longer serves what its last poll said
# (a weight swap between polls): another replica of the pin can serve it.
_STALE_VIOLATIONS = frozenset({"WEIGHTS_VERSION", "NUMERICS_FINGERPRINT", "MODEL_CONFIG_HASH"})


def _attempt_or_relay(view: ReplicaView, err: grpc.aio.AioRpcError,
                      views: Sequence[ReplicaView] = ()) -> Exception:
    """A replica's error as a retryable :class:`_Attempt`, or as the status to relay to the client.

    Retryable: UNAVAILABLE (gone, draining), and FAILED_PRECONDITION about the
    pin itself, since requests are only routed to replicas whose polled
    identity matches: the refusal means the poll is stale, not the request bad.
    A relayed status names replicas (``views``: the fleet), never their internal addresses.
    """
    code = err.code()
    if code is grpc.StatusCode.UNAVAILABLE:
        return _Attempt(view, f"{code.name}: {err.details()}")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        kinds = {v.type for d in status_details(err) if isinstance(d, error_details_pb2.PreconditionFailure)
                 for v in d.violations}
        if kinds and kinds <= _STALE_VIOLATIONS:
            return _Attempt(view, f"it no longer serves the pin its last poll showed: {err.details()}")
    return _relayed(view, err, views)


def _relayed(view: ReplicaView, err: grpc.aio.AioRpcError, views: Sequence[ReplicaView] = ()) -> RelayedError:
    """A replica's error as the status to relay to the client, with its code; replicas named (``views``: the
    fleet), never their internal addresses."""
    details = err.details() or ""
    for v in views:
        details = details.replace(v.address, _name(v))
    return RelayedError(err, _name(view), details=details)


def _name(view: ReplicaView) -> str:
    """A replica as a client may see it: role and replica id, no address (``decode replica decode-0``)."""
    name = view.endpoint.name or (view.identity.replica_id if view.identity is not None else "")
    return f"{view.role} replica {name}".rstrip()


def _check_prompt(r: InferenceRequest) -> None:
    """INVALID_ARGUMENT at the front door for a prompt no replica could read (what needs no model: the replicas
    check the vocabulary and the context, naming the same fields)."""
    if r.prompt_ids is not None and r.prompt_text is not None:
        raise InvalidArgument.field("prompt", "set only one of prompt_text and prompt_token_ids")
    if r.prompt_ids is None and r.prompt_text is None:
        raise InvalidArgument.field("prompt", "set prompt_text or prompt_token_ids")
    if not (r.prompt_ids if r.prompt_ids is not None else r.prompt_text):
        raise InvalidArgument.field("prompt", "the prompt is empty")


class Scheduler:
    """Routes Generate/Score/Abort over the replicas of a :class:`Registry`.

    Use in process (tests) or behind the shared Inference servicer (:meth:`attach`). Call
    :meth:`start` before serving and :meth:`close` after. ``state_dir``: where the
    fleet's target version is kept (:mod:`.fleet`; None: memory only).
    """

    def __init__(self, registry: Registry, config: SchedulerConfig = SchedulerConfig(),
                 replica_id: str | None = None, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.registry = registry
        self.config = config
        self.router = Router(config.policy)
        self.replica_id = replica_id or default_replica_id("scheduler")
        self.state_dir = state_dir
        # The version of the last whole-fleet switch and the good ones before it (.fleet; empty before the first).
        self.fleet = read_fleet(state_dir) if state_dir is not None else FleetRecord()
        # The trainer's in-memory copy of the target when the fleet switched to it in place: its store record may
        # still be on its way (or have failed), so a switch back to it after a failed switch copies it from there.
        self._in_place: SharedExport | None = None
        self._flights: dict[str, _Flight] = {}
        self._server: ServiceServer | None = None
        self._health_dirty = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._converging: asyncio.Task[None] | None = None
        self._switching = asyncio.Lock()     # one fleet switch or convergence at a time
        self._published: ServiceIdentity | None = None
        registry.add_listener(self._on_fleet_change)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start following and polling the fleet (one poll done on return)."""
        await self.registry.start()
        self._health_task = asyncio.ensure_future(self._health_loop())
        self._on_fleet_change()

    async def close(self) -> None:
        for task in (self._health_task, self._converging):
            if task is not None:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        await self.registry.close()

    def attach(self, server: ServiceServer) -> None:
        """Serve ``zerokl.v1.Inference`` on ``server`` (before it starts) and drive its health."""
        self._server = server
        server.add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server,
                            InferenceServicer(self, self.switch_weights), INFERENCE_SERVICE)

    async def sync_health(self) -> bool:
        """Report SERVING iff a healthy decode replica matches the current pin; returns that."""
        serving = self.default_pin() is not None
        if self._server is not None:
            await self._server.set_serving(serving)
        return serving

    # ------------------------------------------------------------------ what it serves

    def default_pin(self) -> Pin | None:
        """The pin of a request that pins nothing, when one resolves and a decode replica serves it."""
        views = self.registry.views()
        try:
            pin = resolve_pin(views, Pin(), self._fallback_pin())
        except ServiceError:
            return None
        return pin if self.router.candidates(views, "decode", pin) else None

    def _fallback_pin(self) -> Pin:
        """What a request gets for the fields it does not pin: the configured pin, else the fleet's target."""
        return self.config.pin.over(Pin(weights_version=self.target_version))

    @property
    def identity(self) -> ServiceIdentity:
        """The scheduler's Info: the numbers an unpinned request gets now (empty while there are none)."""
        base = ServiceIdentity("scheduler", self.replica_id, weights_version=self.config.pin.weights_version,
                               numerics_fingerprint=self.config.pin.numerics_fingerprint)
        pin = self.default_pin()
        if pin is None:
            return base
        ref = self.router.candidates(self.registry.views(), "decode", pin)[0].identity
        assert ref is not None
        return dataclasses.replace(ref, service="scheduler", replica_id=self.replica_id,
                                   zerokl_version=base.zerokl_version, cluster_id=base.cluster_id)

    @property
    def target_version(self) -> str:
        """The fleet's target weights version: the last whole-fleet switch's ("" before the first one)."""
        return self.fleet.weights_version

    def _record(self, record: FleetRecord) -> None:
        """Keep ``record`` as the fleet's, in the state directory too."""
        self.fleet = record if self.state_dir is None else write_fleet(self.state_dir, record)

    def replicas(self) -> list[ReplicaView]:
        """The fleet as the scheduler sees it now."""
        return self.registry.views()

    def flight_replica(self, request_id: str) -> ReplicaEndpoint | None:
        """Where a Generate in flight runs now (None if not in flight or between replicas)."""
        flight = self._flights.get(request_id)
        return flight.endpoint if flight is not None else None

    # ------------------------------------------------------------------ Generate

    async def generate(self, r: InferenceRequest) -> AsyncIterator[GenerateDelta]:
        """Stream ``r``'s deltas from the fleet (see the module docstring)."""
        code = grpc.StatusCode.OK
        inner = self._generate(r)
        try:
            async for delta in inner:
                yield delta
        except ServiceError as err:
            code = err.code
            raise
        except (GeneratorExit, asyncio.CancelledError):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            await inner.aclose()
            metrics.REQUESTS.labels("Generate", code.name).inc()

    async def _generate(self, r: InferenceRequest) -> AsyncIterator[GenerateDelta]:
        _check_prompt(r)
        rid = r.request_id or uuid.uuid4().hex
        tag_request(rid)
        if rid in self._flights:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        flight = self._flights[rid] = _Flight(rid)
        runtime_metrics.REQUESTS_RUNNING.inc()
        try:
            pin = await self._resolve(r, ("decode",))
            # Every hop carries the complete pin: a replica that changed since the last poll refuses.
            request = dataclasses.replace(r, request_id=rid, weights_version=pin.weights_version,
                                          numerics_fingerprint=pin.numerics_fingerprint)
            async with aclosing(self._run(flight, request, pin)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            runtime_metrics.REQUESTS_RUNNING.dec()
            del self._flights[rid]

    async def _run(self, flight: _Flight, request: InferenceRequest, pin: Pin) -> AsyncIterator[GenerateDelta]:
        ledger = StreamLedger(flight.request_id, request.options.n, pin)
        latency = LatencyTracker()
        failures: list[str] = []
        failed: set[tuple[str, str]] = set()
        prompt_tokens = len(request.prompt_ids or ())
        while not ledger.done:
            if flight.aborted:
                for delta in ledger.finish_unfinished("abort", prompt_tokens):
                    yield delta
                break
            if len(failures) >= self.config.max_attempts:
                raise Unavailable(f"request {flight.request_id!r} failed on {len(failures)} replicas: "
                                  + "; ".join(failures))
            try:
                prefill = self._choose("prefill", pin, failed)
                decode = await self._choose_waiting("decode", pin, failed)
                if flight.aborted:
                    continue  # aborted while waiting for a replica
                if decode is None:
                    raise NoReplica(f"no healthy decode replica serves {pin.describe()}"
                                    + (f" (failed: {'; '.join(failures)})" if failures else ""))
                ledger.begin_attempt(decode.describe())
                async with aclosing(self._decode(flight, decode, prefill, request, ledger)) as deltas:
                    async for delta in deltas:
                        latency.tokens(delta.index, len(delta.token_ids))
                        if delta.usage is not None:
                            prompt_tokens = delta.usage.prompt_tokens
                        yield delta
                if not ledger.done and not flight.aborted:
                    raise _Attempt(decode, "the stream ended before every sample finished")
            except _Attempt as failure:
                view = failure.view
                failures.append(str(failure))
                failed.add(view.endpoint.key)
                self.registry.report_failure(view.endpoint, failure.reason)
                metrics.RETRIES.labels(view.role).inc()
                trace.get_current_span().add_event("zerokl.scheduler.retry", {
                    "replica": view.address, "role": view.role, "reason": failure.reason,
                    "tokens_sent": ledger.sent_tokens})
                log.warning("request %s: %s; retrying elsewhere (%d tokens already sent)", flight.request_id,
                            failure, ledger.sent_tokens)
        latency.done()

    async def _decode(self, flight: _Flight, view: ReplicaView, prefill: ReplicaView | None,
                      request: InferenceRequest, ledger: StreamLedger) -> AsyncIterator[GenerateDelta]:
        """One attempt on a decode replica (reading its KV from ``prefill`` when given): its deltas with the
        replayed prefix removed."""
        with self._on(flight, view) as client, contextlib.ExitStack() as prefill_lease:
            if prefill is None:
                stream = client.generate(request)
            else:
                # Counted on the prefill replica until the first token: by then its KV has been read.
                prefill_lease.enter_context(self.registry.lease(prefill.endpoint))
                metrics.ROUTED.labels(prefill.role, prefill.address).inc()
                trace.get_current_span().add_event("zerokl.scheduler.route",
                                                   {"replica": prefill.address, "role": prefill.role})
                stream = client.generate_from_prefill(request, prefill.address,
                                                      handoff_timeout=self.config.handoff_timeout_s)
            stopped = ""
            try:
                # What arrived while the client took the last message goes on as one message per sample.
                async with aclosing(batches_until_set(stream, flight.cut)) as upstream:
                    async for batch in upstream:
                        prefill_lease.close()
                        for delta in coalesce(batch):
                            if delta.finish_reason == "abort" and not flight.aborted:
                                # Nobody asked: the replica is shutting down. Keep its tokens, retry the rest.
                                stopped = "it ended the request with ABORT (shutting down?)"
                                delta = dataclasses.replace(delta, finish_reason=None)
                            try:
                                out = ledger.accept(delta)
                            except DataLoss:
                                metrics.REPLAY_MISMATCHES.inc()
                                raise
                            if out is not None:
                                yield out
            except grpc.aio.AioRpcError as err:
                if flight.aborted:
                    return
                # A failure of the prefill side, as the decode replica reports it, is the prefill replica's.
                blamed = prefill if prefill is not None and handoff_peer(err) == prefill.address else view
                raise _attempt_or_relay(blamed, err, self.registry.views()) from None
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            if stopped and not ledger.done:
                raise _Attempt(view, stopped)

    @contextlib.contextmanager
    def _on(self, flight: _Flight, view: ReplicaView) -> Iterator[InferenceClient]:
        """``flight`` runs on ``view`` for the duration: leased in the registry and reachable by Abort."""
        with self.registry.lease(view.endpoint) as client:
            flight.endpoint, flight.client = view.endpoint, client
            metrics.ROUTED.labels(view.role, view.address).inc()
            trace.get_current_span().add_event("zerokl.scheduler.route", {"replica": view.address, "role": view.role})
            try:
                yield client
            finally:
                flight.endpoint = flight.client = None

    # ------------------------------------------------------------------ Abort / Score

    async def abort(self, request_id: str) -> bool:
        """Abort a Generate in flight through this scheduler; False if there is none by that id."""
        flight = self._flights.get(request_id)
        if flight is None:
            return False
        flight.aborted = True
        client, endpoint = flight.client, flight.endpoint
        found = False
        if client is not None:
            try:
                found = await asyncio.wait_for(client.abort(request_id), self.config.abort_timeout_s)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as err:
                log.warning("abort of %s on %s failed: %s", request_id, endpoint, err)
        if not found:
            # Not (yet, or no longer) on the replica: stop relaying ourselves; its call is cancelled.
            flight.cut.set()
        return True

    async def score(self, r: InferenceRequest) -> ScoreResult:
        """Per-token logprobs from a prefill replica (the prompt-reading path), else a decode replica."""
        code = grpc.StatusCode.OK
        try:
            return await self._score(r)
        except ServiceError as err:
            code = err.code
            raise
        finally:
            metrics.REQUESTS.labels("Score", code.name).inc()

    async def _score(self, r: InferenceRequest) -> ScoreResult:
        _check_prompt(r)
        pin = await self._resolve(r, ("prefill", "decode"))
        request = dataclasses.replace(r, weights_version=pin.weights_version,
                                      numerics_fingerprint=pin.numerics_fingerprint)
        failures: list[str] = []
        failed: set[tuple[str, str]] = set()
        while len(failures) < self.config.max_attempts:
            view = self._choose("prefill", pin, failed) or await self._choose_waiting("decode", pin, failed)
            if view is None:
                break
            with self.registry.lease(view.endpoint) as client:
                metrics.ROUTED.labels(view.role, view.address).inc()
                try:
                    return await client.score(request)
                except grpc.aio.AioRpcError as err:
                    failure = _attempt_or_relay(view, err, self.registry.views())
                    if not isinstance(failure, _Attempt):
                        raise failure from None
                    reason = failure.reason
            failures.append(f"{view.describe()}: {reason}")
            failed.add(view.endpoint.key)
            self.registry.report_failure(view.endpoint, reason)
            metrics.RETRIES.labels(view.role).inc()
        raise NoReplica(f"no replica could score the request under {pin.describe()}"
                        + (f": {'; '.join(failures)}" if failures else ""))

    # ------------------------------------------------------------------ weights

    async def switch_weights(self, version: str, shared: SharedExport | None = None) -> ServiceIdentity:
        """Switch every replica to weight-store ``version`` (or ``latest``), after a canary, or not at all.

        ``shared``: the trainer's in-memory copy of ``version`` (SaveWeights with share), passed to
        every replica: one on the trainer's host copies it in place, another fetches from the store.
        A switch back after a failure returns to the version served before from the trainer's memory
        when the fleet switched to it in place (its store record may not have landed yet), else from
        the store.

        One healthy decode replica switches first and serves a canary
        (:meth:`_canary`: a short greedy Generate of a fixed probe with prompt
        logprobs, every number finite); a version that fails it is never
        served by the others: the canary replica switches back and
        :class:`CanaryFailed` names why. Then the others switch, concurrently;
        each lets the requests it admitted finish on the old weights first. If
        any fails, every replica that switched goes back to the version it
        served before, and the call fails naming the replica. Returns the
        scheduler's identity once the registry has seen every replica serve
        the new version; requests pinned to the old one then stop finding
        replicas, which is the point of a step boundary. A configured weights
        pin follows the switch, and the new version becomes the fleet's target
        (recorded in the state directory).

        A replica that becomes unreachable meanwhile, the canary's included,
        fails the switch with UNAVAILABLE (after the switch back), never with
        :class:`CanaryFailed`: the caller may try again once it is back.
        """
        try:
            async with self._switching:
                return await self._switch_all(version, shared)
        finally:
            self._health_dirty.set()   # a replica that lagged while the switch held the fleet converges now

    async def _switch_all(self, version: str, shared: SharedExport | None = None) -> ServiceIdentity:
        views = self.registry.views()
        if not views:
            raise NoReplica("no replica is registered")
        # A healthy decode replica if there is one (one that cannot serve fails the canary, naming why).
        canaries = sorted((v for v in views if v.role == "decode"), key=lambda v: not v.healthy)
        if not canaries:
            raise NoReplica("no decode replica to run the canary of the new weights on")
        canary, rest = canaries[0], [v for v in views if v is not canaries[0]]
        before = {v.endpoint.key: v.identity.weights_version for v in views if v.identity is not None}

        t0 = time.perf_counter()
        first = await self._switch_one(canary, version, shared)
        new = first.weights_version             # "latest" resolved once: every other replica gets this id
        t1 = time.perf_counter()
        try:
            problem = await self._canary(canary, new)
        except Unavailable as err:
            undone = await self._switch_back([canary], before)
            raise Unavailable(f"the canary of {new} could not run: {err.message}{undone}") from None
        if problem:
            undone = await self._switch_back([canary], before)
            raise CanaryFailed(f"weights version {new} failed its canary on {canary.describe()}: {problem}; "
                               f"no other replica switched{undone}")
        t2 = time.perf_counter()
        results = await asyncio.gather(*(self._switch_one(v, new, shared) for v in rest), return_exceptions=True)
        t3 = time.perf_counter()
        failed = [(v, r) for v, r in zip(rest, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            switched = [canary, *(v for v, r in zip(rest, results, strict=True) if not isinstance(r, BaseException))]
            undone = await self._switch_back(switched, before)
            view, err = failed[0]
            raise Unavailable(f"switching to {new} failed on {len(failed)} replica(s), e.g. {view.describe()}: "
                              f"{err}{undone}") from None
        if self.config.pin.weights_version:
            self.config = dataclasses.replace(self.config, pin=dataclasses.replace(self.config.pin,
                                                                                   weights_version=new))
        self._record(self.fleet.served(new))
        self._in_place = shared if shared is not None and shared.version == new else None
        await self.registry.refresh(read_info=True)
        log.info("switched the fleet to %s%s: canary replica %.3f s, canary %.3f s, %d other replica(s) %.3f s, "
                 "registry refresh %.3f s", new, " (shared in place)" if shared is not None else "", t1 - t0,
                 t2 - t1, len(rest), t3 - t2, time.perf_counter() - t3)
        return self.identity

    async def sleep(self, level: int) -> SleepState:
        """Every replica releases its KV cache (``level`` 1) or its weights too (2) for a trainer sharing
        their device (co-location), once the requests it admitted finished; requests that arrive meanwhile
        wait on their replica until :meth:`wake` or :meth:`switch_weights` wakes it. Serialized with
        switches. A replica's refusal is relayed naming it; one that is unreachable is UNAVAILABLE."""
        async with self._switching:
            return await self._on_every_replica(lambda client: client.sleep(level), "sleep")

    async def wake(self) -> SleepState:
        """Every replica serves again (one whose weights were released wakes by :meth:`switch_weights`)."""
        async with self._switching:
            return await self._on_every_replica(lambda client: client.wake(), "wake")

    async def _on_every_replica(self, call, what: str) -> SleepState:  # noqa: ANN001 - InferenceClient -> SleepState
        views = self.registry.views()
        if not views:
            raise NoReplica("no replica is registered")

        async def one(view: ReplicaView) -> SleepState:
            with self.registry.lease(view.endpoint) as client:
                try:
                    return await call(client)
                except grpc.aio.AioRpcError as err:
                    if err.code() is grpc.StatusCode.UNAVAILABLE:
                        raise Unavailable(f"{_name(view)} could not {what}: {err.details()}") from None
                    raise _relayed(view, err, views) from None

        states = await asyncio.gather(*(one(v) for v in views))
        return SleepState(max(s.level for s in states), sum(s.released_bytes for s in states))

    async def _switch_one(self, view: ReplicaView, to: str,
                          shared: SharedExport | None = None) -> ServiceIdentity:
        """SwitchWeights on one replica; its refusal relayed with its code (a version trained under other numerics
        is FAILED_PRECONDITION, for good: never an outage to wait out), UNAVAILABLE naming it."""
        with self.registry.lease(view.endpoint) as client:
            try:
                return await client.switch_weights(to, shared=shared if shared is not None and
                                                   shared.version == to else None)
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.UNAVAILABLE:
                    raise Unavailable(f"{view.describe()}: {err.code().name}: {err.details()}") from None
                raise _relayed(view, err, self.registry.views()) from None

    async def _canary(self, view: ReplicaView, version: str) -> str:
        """Why ``view`` cannot serve ``version`` ("" when it can): the probe must complete on that version with
        finite prompt and sampled logprobs."""
        options = SamplingOptions(temperature=0.0, max_tokens=CANARY_TOKENS, ignore_eos=True, prompt_logprobs=True)
        request = InferenceRequest(prompt_ids=CANARY_PROMPT, options=options, weights_version=version,
                                   request_id=f"canary-{uuid.uuid4().hex[:8]}")
        with self.registry.lease(view.endpoint) as client:
            try:
                result = await client.generate_all(request, timeout=self.config.canary_timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.UNAVAILABLE:
                    # The replica went away: that says nothing about the weights.
                    raise Unavailable(f"{view.describe()}: {err.details()}") from None
                return f"the probe Generate failed with {err.code().name}: {err.details()}"
        if result.weights_version != version:
            return f"the probe was computed by {result.weights_version!r}"
        numbers = [x for s in result.samples for x in (*s.logprobs, *(s.prompt_logprobs or ())) if x is not None]
        if len(numbers) < CANARY_TOKENS or not all(math.isfinite(x) for x in numbers):
            return f"the probe's logprobs are not all finite: {numbers}"
        return ""

    async def _switch_back(self, views: list[ReplicaView], before: dict[tuple, str]) -> str:
        """Switch ``views`` back to what they served before; a clause for the caller's error message. A version the
        fleet switched to in place comes from the trainer's memory (a replica that cannot open it there reads the
        store, waiting for the record): the store may not hold it yet (the job's start, recorded in the background
        while its first step trains) or ever (a record that failed). A co-located trainer keeps no copy past its
        backward, and the memory of one it let go may hold other bytes on CUDA (DATA_LOSS, nothing served): then
        the store's."""
        async def back(view: ReplicaView) -> str:
            old = before.get(view.endpoint.key, "")
            if not old:
                return f"{view.describe()} (its previous version is unknown)"
            shared = self._in_place if self._in_place is not None and self._in_place.version == old else None
            with self.registry.lease(view.endpoint) as client:
                try:
                    try:
                        await client.switch_weights(old, shared=shared)
                    except grpc.aio.AioRpcError as err:
                        if shared is None or err.code() is grpc.StatusCode.UNAVAILABLE:
                            raise
                        await client.switch_weights(old)
                except grpc.aio.AioRpcError as err:
                    log.error("could not switch %s back to %s: %s", view.describe(), old, err.details())
                    return f"{view.describe()} ({err.code().name}: {err.details()})"
            return ""

        stuck = [s for s in await asyncio.gather(*(back(v) for v in views)) if s]
        await self.registry.refresh(read_info=True)
        olds = sorted({before[v.endpoint.key] for v in views if v.endpoint.key in before})
        if stuck:
            return f"; switching back failed on {', '.join(stuck)}"
        return f"; switched back to {', '.join(olds)}" if olds else ""

    # ------------------------------------------------------------------ routing helpers

    async def _resolve(self, r: InferenceRequest, roles: tuple[str, ...]) -> Pin:
        """The request's complete pin, waiting up to ``route_wait_s`` for a replica of one of ``roles``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.route_wait_s
        while True:
            views = self.registry.views()
            try:
                pin = resolve_pin(views, Pin(r.weights_version, r.numerics_fingerprint), self._fallback_pin())
                if any(self.router.candidates(views, role, pin) for role in roles):
                    return pin
                raise NoReplica(f"no healthy {' or '.join(roles)} replica serves {pin.describe()}")
            except (NoReplica, UnservedPin):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
                await self.registry.wait_changed(remaining)

    def _choose(self, role: str, pin: Pin, failed: set[tuple[str, str]]) -> ReplicaView | None:
        return self.router.choose(self.registry.views(), role, pin, avoid=lambda v: v.endpoint.key in failed)

    async def _choose_waiting(self, role: str, pin: Pin, failed: set[tuple[str, str]]) -> ReplicaView | None:
        """:meth:`_choose`, waiting up to ``route_wait_s`` for a candidate to become healthy."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.route_wait_s
        while (view := self._choose(role, pin, failed)) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            await self.registry.wait_changed(remaining)
        return view

    # ------------------------------------------------------------------ fleet changes

    def _on_fleet_change(self) -> None:
        self._health_dirty.set()

    def _laggards(self) -> list[ReplicaView]:
        """Healthy replicas that serve another weights version than the fleet's target."""
        if not self.target_version:
            return []
        return [v for v in self.registry.views()
                if v.healthy and v.identity is not None and v.identity.weights_version != self.target_version]

    def _converge_soon(self) -> None:
        """Start bringing laggards to the target, unless that or a fleet switch is under way."""
        if self._laggards() and not self._switching.locked() and (self._converging is None or self._converging.done()):
            self._converging = asyncio.ensure_future(self._converge())

    async def _converge(self) -> None:
        """Switch every laggard to the fleet's target version (see the module docstring); on a failure, try
        again in a moment. A target the store can no longer hand out whole (DATA_LOSS) is given up: the fleet
        falls back to the newest good version (:meth:`_fall_back`)."""
        async with self._switching:
            laggards, target = self._laggards(), self.target_version
            if not laggards:
                return
            results = await asyncio.gather(*(self._switch_one(v, target) for v in laggards), return_exceptions=True)
            for view, result in zip(laggards, results, strict=True):
                was = view.identity.weights_version if view.identity is not None else "?"
                if isinstance(result, BaseException):
                    log.warning("could not bring %s from %s to the fleet's version %s: %s", view.describe(), was,
                                target, result)
                else:
                    log.warning("%s served %s; switched it to the fleet's version %s", view.describe(), was, target)
            lost = next((r for r in results if isinstance(r, ServiceError) and r.code is grpc.StatusCode.DATA_LOSS),
                        None)
            settled = lost is not None and await self._fall_back(target, f"{lost.code.name}: {lost.message}")
            await self.registry.refresh(read_info=True)
            if not settled and any(isinstance(r, BaseException) for r in results):
                asyncio.get_running_loop().call_later(_CONVERGE_RETRY_S, self._health_dirty.set)

    async def _fall_back(self, corrupt: str, reason: str) -> bool:
        """Move the whole fleet off ``corrupt`` (its bytes in the store are lost: no replica that restarts can
        load it) to the most recently served good version that still switches and passes its canary, and record
        why (``fleet.json``'s note, which ``zerokl status`` shows). True once the fleet serves one."""
        for version in self.fleet.fallbacks(corrupt):
            try:
                await self._switch_all(version)
            except ServiceError as err:
                log.warning("falling back from %s to %s failed: %s", corrupt, version, err)
                if err.code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND) or isinstance(err, CanaryFailed):
                    continue              # that one is lost too, or gone, or bad: the next older one
                return False              # a replica is away: try again later
            self._record(self.fleet.fell_back(corrupt, version, reason))
            log.error("%s", self.fleet.note)
            return True
        log.error("weights version %s is corrupt in the weight store (%s) and no good version to fall back to is "
                  "left (tried %s)", corrupt, reason, self.fleet.fallbacks(corrupt) or "none")
        return False

    async def _health_loop(self) -> None:
        """One task applies fleet changes to health, gauges and serving info, in order."""
        while True:
            await self._health_dirty.wait()
            self._health_dirty.clear()
            try:
                await self.sync_health()
                self._publish()
                self._converge_soon()
            except Exception:  # noqa: BLE001 - health reporting must outlive one bad update
                log.exception("updating the scheduler's health failed")

    def _publish(self) -> None:
        views = self.registry.views()
        pin = self.default_pin()
        counts = {(role, state): 0 for role in ("prefill", "decode")
                  for state in ("serving", "other_pin", "unhealthy")}
        for v in views:
            state = "unhealthy" if not v.healthy else "serving" if pin and pin.admits(v.identity) else "other_pin"
            counts[(v.role, state)] += 1
        for (role, state), count in counts.items():
            metrics.REPLICAS.labels(role, state).set(count)
        identity = self.identity
        if identity != self._published:
            runtime_metrics.set_serving_info(identity)
            self._published = identity


def add_scheduler_service(server: ServiceServer, scheduler: Scheduler) -> None:
    """Serve ``scheduler`` as ``zerokl.v1.Inference`` on ``server`` (before the server starts)."""
    scheduler.attach(server)
