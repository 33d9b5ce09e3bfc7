"""A small real Kubernetes API server on loopback, for the discovery and doctor tests.

It speaks the wire protocol the real ``kubernetes`` Python client uses, for
what zerokl reads: list and watch EndpointSlices (discovery.k8s.io/v1) and
list pods (v1), in a namespace, filtered by an equality label selector.
Objects are plain JSON dicts as the API server would return them; every
write bumps a global resourceVersion and appends an event that open watches
stream as chunked JSON lines (``{"type": "ADDED", "object": {...}}``), as
the real server does. :meth:`FakeKubeAPI.compact` forgets old events, so a
watch from before it gets the ``410 Gone`` ERROR event a real server sends.

Every request is recorded (method, path, query) so a test can check which
verbs a component needed (the chart's RBAC grants only those).
"""
from __future__ import annotations

import json
import pathlib
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml

__all__ = ["FakeKubeAPI", "config_map", "endpoint_slice", "pod"]

_SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
_PODS = "/api/v1/namespaces/{ns}/pods"
_KINDS = {"endpointslices": ("EndpointSliceList", "discovery.k8s.io/v1"), "pods": ("PodList", "v1"),
          "configmaps": ("ConfigMapList", "v1")}


def endpoint_slice(name: str, service: str, endpoints: list[tuple[str, str, bool]], port: int,
                   port_name: str = "grpc", namespace: str = "zerokl") -> dict[str, Any]:
    """An EndpointSlice of ``service`` with ``(address, pod name, ready)`` endpoints on one named port."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "endpoints": [{"addresses": [addr], "conditions": {"ready": ready, "serving": ready, "terminating": False},
                       "targetRef": {"kind": "Pod", "name": pod_name, "namespace": namespace}}
                      for addr, pod_name, ready in endpoints],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def pod(name: str, labels: dict[str, str], ip: str, grpc_port: int, phase: str = "Running",
        namespace: str = "zerokl") -> dict[str, Any]:
    """A pod with one container whose port ``grpc`` is ``grpc_port``, at ``ip`` (empty: not scheduled yet)."""
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "zerokl", "image": "zerokl:test",
                                     "ports": [{"name": "grpc", "containerPort": grpc_port}]}]},
            "status": status}


def config_map(name: str, labels: dict[str, str], data: dict[str, str], namespace: str = "zerokl") -> dict[str, Any]:
    """A ConfigMap with string data."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": labels}, "data": data}


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


class FakeKubeAPI:
    """The fake API server; ``url`` is its base address. Use as a context manager."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}   # (resource, ns, name) -> object
        self._events: list[tuple[int, str, str, str, dict[str, Any]]] = []  # (rv, type, resource, ns, obj)
        self._version = 100
        self._compacted = 0
        self._closed = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked watch streams need it

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                api.requests.append(("GET", url.path, query))
                parts = url.path.strip("/").split("/")
                # /api/v1/namespaces/NS/pods or /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices
                if len(parts) >= 4 and parts[-3] == "namespaces" and parts[-1] in _KINDS:
                    resource, ns = parts[-1], parts[-2]
                    if query.get("watch") in ("true", "1"):
                        return self._watch(resource, ns, query)
                    return self._list(resource, ns, query)
                self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                 "reason": "NotFound", "message": f"fake API: no route {url.path}"})

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _list(self, resource: str, ns: str, query: dict[str, str]) -> None:
                kind, api_version = _KINDS[resource]
                with api._lock:
                    items = [o for (r, n, _), o in sorted(api._objects.items())
                             if r == resource and n == ns and _matches(o["metadata"].get("labels", {}),
                                                                       query.get("labelSelector", ""))]
                    version = api._version
                self._json(200, {"kind": kind, "apiVersion": api_version,
                                 "metadata": {"resourceVersion": str(version)}, "items": items})

            def _chunk(self, payload: bytes) -> None:
                self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
                self.wfile.flush()

            def _watch(self, resource: str, ns: str, query: dict[str, str]) -> None:
                selector = query.get("labelSelector", "")
                since = int(query.get("resourceVersion") or api._version)
                deadline = time.monotonic() + float(query.get("timeoutSeconds") or 300)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    with api._lock:
                        if since < api._compacted:
                            gone = {"type": "ERROR", "object": {
                                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                "reason": "Expired", "message": f"too old resource version: {since}"}}
                            self._chunk(json.dumps(gone).encode() + b"\n")
                            self._chunk(b"")
                            return
                    while True:
                        with api._lock:
                            pending = [(rv, t, o) for rv, t, r, n, o in api._events
                                       if rv > since and r == resource and n == ns
                                       and _matches(o["metadata"].get("labels", {}), selector)]
                            if not pending and not api._closed and time.monotonic() < deadline:
                                api._lock.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                                continue
                        for rv, kind, obj in pending:
                            self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                            since = rv
                        if api._closed or time.monotonic() >= deadline:
                            self._chunk(b"")  # the end of the chunked body: the watch is over
                            return
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client stopped watching

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kube-api", daemon=True)

    def __enter__(self) -> FakeKubeAPI:  # noqa: PYI034 - Self needs 3.11; the project supports 3.10
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ writes (as controllers would make them)

    def apply(self, resource: str, obj: dict[str, Any]) -> None:
        """Create or replace ``obj`` (ADDED or MODIFIED event)."""
        meta = obj["metadata"]
        key = (resource, meta["namespace"], meta["name"])
        with self._lock:
            self._version += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self._version)
            kind = "MODIFIED" if key in self._objects else "ADDED"
            self._objects[key] = obj
            self._events.append((self._version, kind, resource, key[1], obj))
            self._lock.notify_all()

    def delete(self, resource: str, namespace: str, name: str) -> None:
        """Remove an object (DELETED event)."""
        with self._lock:
            obj = self._objects.pop((resource, namespace, name))
            self._version += 1
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._version)}}
            self._events.append((self._version, "DELETED", resource, namespace, obj))
            self._lock.notify_all()

    def compact(self) -> None:
        """Forget every event so far: a watch resuming from an older version gets 410 Gone."""
        with self._lock:
            self._compacted = self._version
            self._events.clear()

    def kubeconfig(self, path: pathlib.Path, namespace: str = "zerokl") -> pathlib.Path:
        """Write a kubeconfig pointing at this server (plain HTTP, a bearer token) and return its path."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "operator", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "operator",
                                                      "namespace": namespace}}],
        }))
        return path
