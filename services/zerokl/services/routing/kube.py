"""Kubernetes discovery: prefill/decode replicas from the EndpointSlices of their Services.

    source = EndpointSliceSource("zerokl", {"decode": "r-zerokl-decode", "prefill": "r-zerokl-prefill"})
    registry = Registry([source])

In a cluster the Helm chart gives each role a headless Service whose pods
are the replicas; the EndpointSlice controller keeps one or more slices per
Service (label ``kubernetes.io/service-name``) listing each pod's address,
readiness and name. :class:`EndpointSliceSource` lists those slices, then
watches them (one ``kubernetes`` client watch per role, each on its own
thread: the client is synchronous), and yields the complete set of ready
endpoints after every change, as :class:`~.registry.ReplicaSource` asks.

It only says *where* replicas are. What each computes (fingerprint, weights
version) is still read by the registry's own Info polls, so a pod of a new
numerics version that a rolling upgrade adds is seen, and a mixed fleet is
refused by the same router rule as on one machine.

Watches expire: the API server ends a watch after its timeout (we ask for
``watch_timeout_s``) and forgets old resource versions (HTTP 410 Gone). The
first is resumed from the last resource version seen, the second by listing
again; any other failure ends :meth:`EndpointSliceSource.watch` with the
error and the registry restarts the source after a delay, keeping the last
set meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client as kube_client
from kubernetes import config as kube_config
from kubernetes import watch as kube_watch
from kubernetes.client.rest import ApiException
from zerokl.services.routing.registry import ROLES, ReplicaEndpoint, ReplicaSource

__all__ = [
    "DEFAULT_PORT_NAME",
    "SERVICE_NAME_LABEL",
    "EndpointSliceSource",
    "endpoints_from_slice",
    "in_cluster_namespace",
    "load_api_client",
]

log = logging.getLogger(__name__)

#: The label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
#: The Service port the chart names for gRPC; slices carry the port under the same name.
DEFAULT_PORT_NAME = "grpc"
_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_HTTP_GONE = 410


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> kube_client.ApiClient:
    """An API client: in-cluster credentials inside a pod, else ``kubeconfig`` (default ``~/.kube/config``).

    An explicit ``kubeconfig`` wins over the in-cluster service account, so
    an operator's tool run from a pod can still target another cluster.
    """
    configuration = kube_client.Configuration()
    if kubeconfig is None and context is None:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
            return kube_client.ApiClient(configuration)
        except kube_config.ConfigException:
            pass  # not in a pod: fall back to the kubeconfig
    kube_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    return kube_client.ApiClient(configuration)


def in_cluster_namespace(default: str = "default") -> str:
    """The namespace of this pod's service account, else ``default``."""
    try:
        with open(_NAMESPACE_FILE) as f:
            return f.read().strip() or default
    except OSError:
        return default


def _host_port(address: str, port: int) -> str:
    # An IPv6 address needs brackets before the port (gRPC targets and ReplicaEndpoint both split on the last ':').
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def endpoints_from_slice(role: str, slice_: Any, port_name: str = DEFAULT_PORT_NAME) -> tuple[ReplicaEndpoint, ...]:
    """The ready endpoints of one EndpointSlice (a ``V1EndpointSlice``) as replicas of ``role``.

    An endpoint counts when its ``ready`` condition is true or unknown (the
    API's advice: consumers should treat unknown as ready); a terminating
    pod is not ready, so it leaves the set as soon as it starts draining.
    The port is the slice's port named ``port_name`` (or its only port);
    a slice without one contributes nothing. The name is the target pod's.
    """
    ports = list(slice_.ports or ())
    named = [p for p in ports if p.name == port_name]
    port = named[0] if named else (ports[0] if len(ports) == 1 else None)
    if port is None or port.port is None:
        return ()
    out = []
    for endpoint in slice_.endpoints or ():
        conditions = endpoint.conditions
        if conditions is not None and conditions.ready is False:
            continue
        ref = endpoint.target_ref
        name = ref.name if ref is not None and ref.kind == "Pod" and ref.name else ""
        for address in endpoint.addresses or ():
            out.append(ReplicaEndpoint(role, _host_port(address, port.port), name))
    return tuple(out)


@dataclass
class _Event:
    """What a role's watch thread hands to the event loop."""

    role: str
    kind: str                         # "reset" (a full list), "upsert" or "delete"
    slices: Sequence[Any] = ()        # V1EndpointSlice objects
    error: BaseException | None = None


class EndpointSliceSource(ReplicaSource):
    """Replicas from the EndpointSlices of one Service per role, followed with list + watch.

    ``services`` maps a role (``prefill``/``decode``) to its Service's name
    in ``namespace``. ``api_client`` defaults to :func:`load_api_client`
    (made on the first :meth:`watch`, so constructing a source needs no
    cluster). The first set is yielded once every role has been listed;
    later sets after each watch event that changes it.
    """

    def __init__(self, namespace: str, services: Mapping[str, str], *, port_name: str = DEFAULT_PORT_NAME,
                 api_client: kube_client.ApiClient | None = None,
                 api_client_factory: Callable[[], kube_client.ApiClient] = load_api_client,
                 watch_timeout_s: int = 300, name: str = "kubernetes") -> None:
        unknown = sorted(set(services) - set(ROLES))
        if unknown or not services:
            raise ValueError(f"EndpointSliceSource roles must be among {ROLES}, got {sorted(services)}")
        self.namespace = namespace
        self.services = dict(services)
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self.name = name
        self._api_client = api_client
        self._api_client_factory = api_client_factory

    def describe(self) -> str:
        """``kubernetes namespace/ns decode=svc-a prefill=svc-b``, for logs and the start line."""
        roles = " ".join(f"{role}={svc}" for role, svc in sorted(self.services.items()))
        return f"kubernetes namespace/{self.namespace} {roles}"

    async def watch(self) -> AsyncIterator[Sequence[ReplicaEndpoint]]:
        if self._api_client is None:
            self._api_client = self._api_client_factory()
        api = kube_client.DiscoveryV1Api(self._api_client)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Event] = asyncio.Queue()
        stop = threading.Event()
        watches: list[kube_watch.Watch] = []

        def deliver(event: _Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        # Own daemon threads, not the loop's executor: a watch blocks in a socket read for
        # minutes, and asyncio.run() waits for its default executor's threads at shutdown.
        threads = [threading.Thread(target=self._follow, args=(api, role, service, deliver, stop, watches),
                                    name=f"zerokl-kube-{role}", daemon=True)
                   for role, service in self.services.items()]
        for t in threads:
            t.start()
        slices: dict[str, dict[str, tuple[ReplicaEndpoint, ...]]] = {}
        last: tuple[ReplicaEndpoint, ...] | None = None
        try:
            while True:
                event = await queue.get()
                if event.error is not None:
                    raise event.error
                per_role = slices.setdefault(event.role, {})
                if event.kind == "reset":
                    per_role.clear()
                for s in event.slices:
                    key = s.metadata.name
                    if event.kind == "delete":
                        per_role.pop(key, None)
                    else:
                        per_role[key] = endpoints_from_slice(event.role, s, self.port_name)
                if set(slices) != set(self.services):
                    continue  # a role not listed yet: an incomplete set would drop its replicas
                current = self._union(slices)
                if current != last:
                    last = current
                    yield current
        finally:
            stop.set()
            for w in watches:
                w.stop()

    def _union(self, slices: Mapping[str, Mapping[str, tuple[ReplicaEndpoint, ...]]]) -> tuple[ReplicaEndpoint, ...]:
        # Roles in ROLES order, slices by name: a stable order keeps the registry's listing stable.
        seen: dict[tuple[str, str], ReplicaEndpoint] = {}
        for role in ROLES:
            for key in sorted(slices.get(role, {})):
                for e in slices[role][key]:
                    seen.setdefault(e.key, e)
        return tuple(seen.values())

    def _follow(self, api: kube_client.DiscoveryV1Api, role: str, service: str,
                deliver: Callable[[_Event], None], stop: threading.Event, watches: list[kube_watch.Watch]) -> None:
        """One role's list + watch loop (runs on its own thread until ``stop``); errors go to the loop."""
        try:
            while not stop.is_set():
                try:
                    self._list_and_watch(api, role, service, deliver, stop, watches)
                except ApiException as err:
                    if err.status != _HTTP_GONE:
                        raise
                    # The server forgot our resource version: only a fresh list is a consistent start.
                    log.info("EndpointSlice watch of %s expired (410 Gone); listing again", service)
        except Exception as err:  # noqa: BLE001 - handed to the event loop, which raises it in watch()
            if not stop.is_set():
                deliver(_Event(role, "error", error=err))

    def _list_and_watch(self, api: kube_client.DiscoveryV1Api, role: str, service: str,
                        deliver: Callable[[_Event], None], stop: threading.Event,
                        watches: list[kube_watch.Watch]) -> None:
        selector = f"{SERVICE_NAME_LABEL}={service}"
        listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
        deliver(_Event(role, "reset", list(listed.items or ())))
        version = listed.metadata.resource_version
        while not stop.is_set():
            w = kube_watch.Watch()
            watches.append(w)
            try:
                for raw in w.stream(api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                                    resource_version=version, timeout_seconds=self.watch_timeout_s,
                                    allow_watch_bookmarks=True):
                    kind = raw["type"]
                    if kind in ("ADDED", "MODIFIED"):
                        deliver(_Event(role, "upsert", [raw["object"]]))
                    elif kind == "DELETED":
                        deliver(_Event(role, "delete", [raw["object"]]))
                    if stop.is_set():
                        return
            finally:
                watches.remove(w)
            # The server ended the watch at its timeout: resume from the last version seen (bookmarks included).
            version = w.resource_version or version
