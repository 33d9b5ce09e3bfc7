"""The scheduler's replica registry: where prefill/decode replicas are, and what each computes now.

Addresses come from pluggable :class:`ReplicaSource` s: :class:`StaticSource`
(flags or a YAML file, the one-machine default) today, a Kubernetes
EndpointSlice watcher later. A source only says *where* replicas are; the
registry finds out *what* they compute by polling each one: grpc.health.v1
``Check`` every period, and the ``Info`` RPC (numerics version and
fingerprint, weights version, model config hash, service) whenever a replica
(re)enters SERVING (a weight swap passes through NOT_SERVING) and at a slower
period besides. Polls go over an untraced channel: probes every second would
bury the traces of real requests. The router reads immutable
:class:`ReplicaView` snapshots; nothing here decides which replica serves a
request.

A replica is routable only when its last poll succeeded, its health is
SERVING and its Info names the role it was registered under. A failed call
(:meth:`Registry.report_failure`) marks it unhealthy at once and wakes the
poller, so a dead replica stops receiving requests before the next period.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import logging
import math
import pathlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

import grpc
import grpc.aio
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from zerokl.services.inference.client import InferenceClient
from zerokl.services.runtime.info import ServiceIdentity, identity_from_proto
from zerokl.services.runtime.server import create_channel
from zerokl.services.routing import metrics
from zerokl.v1 import common_pb2, inference_pb2_grpc

__all__ = [
    "ROLES",
    "ReplicaEndpoint",
    "ReplicaSource",
    "StaticSource",
    "parse_addresses",
    "load_static_config",
    "ReplicaView",
    "Registry",
]

log = logging.getLogger(__name__)

#: Roles the scheduler routes to. A replica serves exactly one (its Info's ``service``).
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ReplicaEndpoint:
    """Where one replica listens and in which role; the registry's key is ``(role, address)``.

    ``name`` is a human name when the source knows one (the pod name from an
    EndpointSlice's targetRef); on one machine it stays empty and the
    replica's own ``replica_id`` from Info names it in messages.
    """

    role: str
    address: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown replica role {self.role!r}; expected one of {ROLES}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"replica address {self.address!r} is not host:port")

    @property
    def key(self) -> tuple[str, str]:
        return self.role, self.address


class ReplicaSource(abc.ABC):
    """Where replica addresses come from.

    :meth:`watch` yields the source's *complete* current set of endpoints:
    first as soon as it is known, then again after every change (a watch
    event, a config reload). The registry reconciles each set against what it
    holds: new endpoints are added and polled, missing ones are dropped once
    their in-flight requests end. A source whose iterator ends has no more
    changes (its last set stays); one that raises is restarted after a delay,
    keeping its last set meanwhile. A Kubernetes EndpointSlice source fits as
    is: list + watch the slices of the prefill and decode Services, map ready
    addresses to endpoints (role from the Service, name from the targetRef
    pod) and yield the union after each event.
    """

    #: Distinguishes the sets of several sources in one registry.
    name: str = "source"

    @abc.abstractmethod
    def watch(self) -> AsyncIterator[Sequence[ReplicaEndpoint]]:
        """Complete endpoint sets, one per change."""


class StaticSource(ReplicaSource):
    """A fixed list of endpoints (``--decode``/``--prefill`` flags or a YAML file)."""

    def __init__(self, endpoints: Iterable[ReplicaEndpoint], name: str = "static") -> None:
        self.endpoints = tuple(endpoints)
        self.name = name
        keys = [e.key for e in self.endpoints]
        dupes = sorted({f"{role} {addr}" for role, addr in keys if keys.count((role, addr)) > 1})
        if dupes:
            raise ValueError(f"replica listed twice: {', '.join(dupes)}")

    @classmethod
    def from_addresses(cls, decode: Iterable[str] = (), prefill: Iterable[str] = (),
                       name: str = "static") -> "StaticSource":
        """Endpoints from plain address lists, decode replicas first."""
        return cls([*(ReplicaEndpoint("decode", a) for a in decode),
                    *(ReplicaEndpoint("prefill", a) for a in prefill)], name)

    async def watch(self) -> AsyncIterator[Sequence[ReplicaEndpoint]]:
        yield self.endpoints


def parse_addresses(values: Iterable[str] | None) -> tuple[str, ...]:
    """Flag values as addresses: each value may hold several, comma-separated (``a:1,b:2``)."""
    return tuple(a for v in (values or ()) for a in (s.strip() for s in v.split(",")) if a)


def load_static_config(path: str | pathlib.Path) -> StaticSource:
    """A :class:`StaticSource` from a YAML file of address lists::

        decode: [127.0.0.1:50052, 127.0.0.1:50062]
        prefill: [127.0.0.1:50051]

    Unknown keys are refused, so a typo does not silently drop a role.
    """
    data = yaml.safe_load(pathlib.Path(path).read_text()) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping with 'decode' and 'prefill' address lists")
    unknown = sorted(set(data) - set(ROLES))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; expected {list(ROLES)}")

    def addresses(role: str) -> list[str]:
        value = data.get(role) or []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ValueError(f"{path}: '{role}' must be a list of host:port strings")
        return list(parse_addresses(value))

    return StaticSource.from_addresses(addresses("decode"), addresses("prefill"), name=f"file:{path}")


@dataclass(frozen=True)
class ReplicaView:
    """An immutable snapshot of one replica, what the router decides on."""

    endpoint: ReplicaEndpoint
    identity: ServiceIdentity | None       # last Info answer (kept while unreachable, to name it)
    healthy: bool                          # routable: reachable, SERVING, and Info names its role
    reason: str                            # why not healthy ("" when healthy)
    in_flight: int                         # requests the scheduler has on it now
    routed: int                            # requests the scheduler sent it in total

    @property
    def role(self) -> str:
        return self.endpoint.role

    @property
    def address(self) -> str:
        return self.endpoint.address

    def describe(self) -> str:
        """``decode 127.0.0.1:50052 (decode-host-123)``: role, address and the best name known."""
        name = self.endpoint.name or (self.identity.replica_id if self.identity else "")
        return f"{self.role} {self.address}" + (f" ({name})" if name else "")


@dataclass
class _Replica:
    """The registry's mutable record of one replica (views are copied out of it)."""

    endpoint: ReplicaEndpoint
    client: InferenceClient                # requests (traced)
    probe: grpc.aio.Channel                # health and Info polls (untraced)
    identity: ServiceIdentity | None = None
    serving: bool = False
    reason: str = "not polled yet"
    in_flight: int = 0
    routed: int = 0
    info_at: float = -math.inf             # when Info was last read
    retired: bool = False                  # dropped by its source; closed when in_flight reaches 0

    @property
    def healthy(self) -> bool:
        return self.serving and self.identity is not None and not self.reason

    def view(self) -> ReplicaView:
        return ReplicaView(self.endpoint, self.identity, self.healthy, self.reason, self.in_flight, self.routed)


class Registry:
    """Replicas from the sources, polled for health and identity; the only owner of their channels.

    ``token`` and ``credentials`` are what the scheduler presents to replicas
    (one cluster, one token); ``tracer_provider`` makes the hops part of the
    caller's trace.
    """

    def __init__(self, sources: Sequence[ReplicaSource], *, poll_interval_s: float = 1.0,
                 poll_timeout_s: float = 2.0, info_interval_s: float = 30.0, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 tracer_provider: trace.TracerProvider | None = None) -> None:
        if not sources:
            raise ValueError("a registry needs at least one replica source")
        self.sources = tuple(sources)
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.info_interval_s = info_interval_s
        self._token = token
        self._credentials = credentials
        self._tracer_provider = tracer_provider
        self._replicas: dict[tuple[str, str], _Replica] = {}   # insertion order = source order
        self._source_sets: dict[str, tuple[ReplicaEndpoint, ...]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self._first_sets: dict[str, asyncio.Event] = {s.name: asyncio.Event() for s in self.sources}
        if len(self._first_sets) != len(self.sources):
            raise ValueError("replica sources need distinct names")

    # ------------------------------------------------------------------ lifecycle

    async def start(self, first_set_timeout_s: float = 10.0) -> None:
        """Follow the sources and poll the replicas; returns after one poll of the first sets."""
        for source in self.sources:
            self._tasks.append(asyncio.ensure_future(self._follow(source)))
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._first_sets.values())),
                                   first_set_timeout_s)
        except asyncio.TimeoutError:
            missing = [n for n, e in self._first_sets.items() if not e.is_set()]
            log.warning("replica sources %s gave no endpoints within %.0fs", missing, first_set_timeout_s)
        await self.refresh()
        self._tasks.append(asyncio.ensure_future(self._poll_loop()))

    async def close(self) -> None:
        """Stop polling and following sources; close every channel."""
        # The flag as well as the cancel: Python 3.11's wait_for can swallow a cancellation that
        # arrives as its inner wait completes, and the poll loop would then run on forever.
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await asyncio.gather(*(self._close(r) for r in self._replicas.values()), return_exceptions=True)
        self._replicas.clear()

    # ------------------------------------------------------------------ reading

    def views(self) -> list[ReplicaView]:
        """Every current replica, in the order its source listed it."""
        return [r.view() for r in self._replicas.values() if not r.retired]

    def client(self, endpoint: ReplicaEndpoint) -> InferenceClient:
        """The channel to ``endpoint`` (valid while it is registered or leased)."""
        return self._replicas[endpoint.key].client

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (synchronously, in the event loop) after every change of any view."""
        self._listeners.append(callback)

    async def wait_changed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the next change; True if one happened."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ routing feedback

    @contextlib.contextmanager
    def lease(self, endpoint: ReplicaEndpoint) -> Iterator[InferenceClient]:
        """Count a request on ``endpoint`` for its duration (least-loaded routing reads the count)."""
        replica = self._replicas[endpoint.key]
        replica.in_flight += 1
        replica.routed += 1
        self._notify()
        try:
            yield replica.client
        finally:
            replica.in_flight -= 1
            if replica.retired and replica.in_flight == 0:
                self._forget(replica)
            self._notify()

    def report_failure(self, endpoint: ReplicaEndpoint, reason: str) -> None:
        """A call to ``endpoint`` failed as if it were gone: stop routing to it until a poll says otherwise."""
        replica = self._replicas.get(endpoint.key)
        if replica is None or replica.retired:
            return
        log.warning("%s %s failed: %s", endpoint.role, endpoint.address, reason)
        replica.serving = False
        replica.reason = f"failed a call: {reason}"
        self._notify()
        self._wake.set()

    # ------------------------------------------------------------------ polling

    async def refresh(self, read_info: bool = False) -> None:
        """Poll every replica now (health, and Info when due or ``read_info``; concurrently).

        ``read_info`` after a fleet-wide weight switch: a swap can pass through
        NOT_SERVING between two polls, unseen.
        """
        replicas = [r for r in self._replicas.values() if not r.retired]
        await asyncio.gather(*(self._poll(r, read_info) for r in replicas))
        self._notify()

    async def _poll_loop(self) -> None:
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
            except asyncio.TimeoutError:
                pass
            if self._closing:
                return
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad round must not end polling for good
                log.exception("replica poll failed")

    async def _poll(self, replica: _Replica, read_info: bool = False) -> None:
        timeout = self.poll_timeout_s
        was_serving = replica.serving
        try:
            health = await health_pb2_grpc.HealthStub(replica.probe).Check(health_pb2.HealthCheckRequest(),
                                                                           timeout=timeout)
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
            now = time.monotonic()
            if replica.identity is None or (serving and (read_info or not was_serving or now - replica.info_at
                                                         >= self.info_interval_s)):
                info = await inference_pb2_grpc.InferenceStub(replica.probe).Info(common_pb2.InfoRequest(),
                                                                                   timeout=timeout)
                self._set_identity(replica, identity_from_proto(info))
                replica.info_at = now
        except grpc.aio.AioRpcError as err:
            replica.serving = False
            replica.reason = f"unreachable: {err.code().name}: {err.details()}"
            # A channel that failed to connect backs off exponentially (up to minutes) and
            # fails calls fast meanwhile; fresh ones reconnect at once when the replica is
            # back. Only when idle: closing the request channel would cancel calls in flight.
            if err.code() is grpc.StatusCode.UNAVAILABLE and replica.in_flight == 0:
                old = dataclasses.replace(replica)
                replica.client, replica.probe = self._connect(replica.endpoint)
                await self._close(old)
            return
        replica.serving = serving
        assert replica.identity is not None
        if replica.identity.service != replica.endpoint.role:
            replica.reason = (f"registered as a {replica.endpoint.role} replica but its Info says "
                              f"{replica.identity.service!r}")
        elif not serving:
            replica.reason = f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
        else:
            replica.reason = ""

    @staticmethod
    def _set_identity(replica: _Replica, identity: ServiceIdentity) -> None:
        if replica.identity is not None and replica.identity != identity:
            log.info("%s %s now serves weights %s fingerprint %s", replica.endpoint.role, replica.endpoint.address,
                     identity.weights_version, identity.numerics_fingerprint)
        replica.identity = identity

    # ------------------------------------------------------------------ sources

    async def _follow(self, source: ReplicaSource) -> None:
        delay = 1.0
        while True:
            try:
                async for endpoints in source.watch():
                    self._reconcile(source.name, tuple(endpoints))
                    self._first_sets[source.name].set()
                    self._wake.set()  # poll the new ones now
                    delay = 1.0
                return  # the source has no more changes; its last set stays
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a watch that breaks is restarted, as Kubernetes clients do
                log.exception("replica source %s failed; retrying in %.0fs", source.name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _reconcile(self, source_name: str, endpoints: tuple[ReplicaEndpoint, ...]) -> None:
        self._source_sets[source_name] = endpoints
        wanted: dict[tuple[str, str], ReplicaEndpoint] = {}
        for name in self._first_sets:  # sources in their configured order
            for e in self._source_sets.get(name, ()):
                wanted.setdefault(e.key, e)
        for key, replica in list(self._replicas.items()):
            if key not in wanted and not replica.retired:
                replica.retired = True
                log.info("%s %s left the fleet", *key)
                if replica.in_flight == 0:
                    self._forget(replica)
        for key, endpoint in wanted.items():
            replica = self._replicas.get(key)
            if replica is not None and not replica.retired:
                if replica.endpoint != endpoint:  # e.g. a new pod name at the same address
                    replica.endpoint = endpoint
                continue
            # New, or back while its retired record still drains (that one closes when its leases end).
            self._replicas[key] = _Replica(endpoint, *self._connect(endpoint))
            log.info("%s %s joined the fleet", *key)
        self._notify()

    def _forget(self, replica: _Replica) -> None:
        if self._replicas.get(replica.endpoint.key) is replica:
            del self._replicas[replica.endpoint.key]
        asyncio.ensure_future(self._close(replica))

    def _connect(self, endpoint: ReplicaEndpoint) -> tuple[InferenceClient, grpc.aio.Channel]:
        """The request client (traced, in the caller's trace) and the probe channel (never traced)."""
        client = InferenceClient(endpoint.address, token=self._token, credentials=self._credentials,
                                 tracer_provider=self._tracer_provider,
                                 on_received=metrics.REPLICA_BYTES.labels(endpoint.role).inc)
        probe = create_channel(endpoint.address, token=self._token, credentials=self._credentials,
                               tracer_provider=trace.NoOpTracerProvider())
        return client, probe

    @staticmethod
    async def _close(replica: _Replica) -> None:
        await replica.client.close()
        await replica.probe.close()

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        for callback in self._listeners:
            callback()

