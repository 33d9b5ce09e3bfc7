"""``zerokl doctor --kube``: does every replica of a release compute the same numbers?

    zerokl doctor --kube [--namespace N] [--release R] [--kubeconfig FILE] [--context C] [--json]

Lists the release's pods through the Kubernetes API (the operator's
kubeconfig, or the in-cluster service account), asks each zerokl pod for its
Info over gRPC at ``podIP:<its container port named grpc>``, and prints a
table: pod, component, address, numerics version, fingerprint, weights
version, verdict. The numbers must agree where the scheduler would pair
replicas:

- numerics fingerprint: among prefill, decode and trainer pods (the trainer's
  logprobs must equal the replicas'); a pod differing from the majority is
  named;
- weights version: among prefill and decode pods (the trainer is ahead of
  them by design while it trains);
- numerics version: also against the release's ConfigMap
  (``ZEROKL_NUMERICS_VERSION``), when it can be read.

Exit status: 0 when every compute pod answered and agrees; 1 when a pod
differs, has no majority to agree with, is not running or does not answer
(each is named); 2 when the release has no pods or the API cannot be read.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zerokl.table import aligned

__all__ = [
    "COMPONENTS",
    "PodReport",
    "PodTarget",
    "add_arguments",
    "format_table",
    "judge",
    "list_release",
    "main",
    "query",
    "run",
]

#: zerokl components doctor asks, and the gRPC service whose Info each answers.
COMPONENTS = {"scheduler": "zerokl.v1.Inference", "prefill": "zerokl.v1.Inference",
              "decode": "zerokl.v1.Inference", "trainer": "zerokl.v1.Trainer",
              "weight-store": "zerokl.v1.WeightStore"}
_FINGERPRINT_ROLES = ("prefill", "decode", "trainer")
_WEIGHTS_ROLES = ("prefill", "decode")


@dataclass
class PodTarget:
    """One pod of the release and where its gRPC port is (empty address: not running)."""

    name: str
    component: str
    address: str
    phase: str


@dataclass
class PodReport:
    """A pod, what its Info said, and what doctor thinks of it."""

    target: PodTarget
    numerics_version: str = ""
    numerics_fingerprint: str = ""
    weights_version: str = ""
    error: str = ""                       # why there is no Info
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error and not self.problems

    def verdict(self) -> str:
        if self.error:
            return self.error
        return "; ".join(self.problems) or "ok"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``zerokl doctor``."""
    p.add_argument("--kube", action="store_true", help="check a Kubernetes release (the only mode today; "
                                                       "for `zerokl up` use `zerokl status`)")
    p.add_argument("--namespace", "-n", default=None,
                   help="the release's namespace (default: the kubeconfig context's, else the pod's, else default)")
    p.add_argument("--release", default="zerokl", help="Helm release name (default %(default)s)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default $KUBECONFIG or ~/.kube/config; "
                                                      "in a pod: the service account)")
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each pod's Info (default %(default)s)")
    p.add_argument("--auth-token-file", default=None,
                   help="bearer token file the services require (default $ZEROKL_AUTH_TOKEN_FILE or $ZEROKL_AUTH_TOKEN)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def _namespace(args: argparse.Namespace) -> str:
    if args.namespace:
        return str(args.namespace)
    from kubernetes import config as kube_config

    from zerokl.services.routing.kube import in_cluster_namespace
    try:
        _, active = kube_config.list_kube_config_contexts(config_file=args.kubeconfig)
        if args.context:
            contexts, _ = kube_config.list_kube_config_contexts(config_file=args.kubeconfig)
            active = next(c for c in contexts if c["name"] == args.context)
        namespace = (active or {}).get("context", {}).get("namespace")
        if namespace:
            return str(namespace)
    except (kube_config.ConfigException, OSError, StopIteration):
        pass
    return in_cluster_namespace()


def _grpc_port(pod: Any) -> int | None:
    for container in pod.spec.containers or ():
        for port in container.ports or ():
            if port.name == "grpc":
                return int(port.container_port)
    return None


def list_release(core: Any, namespace: str, release: str) -> tuple[list[PodTarget], str]:
    """The release's zerokl pods (``CoreV1Api``) and the ConfigMap's numerics version ("" if unreadable)."""
    selector = f"app.kubernetes.io/name=zerokl,app.kubernetes.io/instance={release}"
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items or []
    targets = []
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        component = (pod.metadata.labels or {}).get("app.kubernetes.io/component", "")
        if component not in COMPONENTS:
            continue  # MinIO, Jaeger, the helm test pod: nothing to compare
        port = _grpc_port(pod)
        ip = pod.status.pod_ip if pod.status else None
        phase = (pod.status.phase if pod.status else None) or "Unknown"
        running = phase == "Running" and ip and port
        address = (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}") if running else ""
        targets.append(PodTarget(pod.metadata.name, component, address, phase))
    expected = ""
    from kubernetes.client.rest import ApiException
    try:
        maps = core.list_namespaced_config_map(
            namespace, label_selector=f"{selector},app.kubernetes.io/component=config").items or []
        expected = next((m.data or {}).get("ZEROKL_NUMERICS_VERSION", "") for m in maps) if maps else ""
    except ApiException:
        pass  # no right to read ConfigMaps: compare among pods only
    return targets, expected


async def query(targets: Sequence[PodTarget], timeout_s: float, token: str | None = None) -> list[PodReport]:
    """Every target's Info, concurrently (a pod that is not running or does not answer gets an error)."""
    import grpc
    import grpc.aio
    from opentelemetry import trace

    from zerokl.services.runtime.info import identity_from_proto
    from zerokl.services.runtime.server import create_channel
    from zerokl.v1 import common_pb2

    async def one(target: PodTarget) -> PodReport:
        report = PodReport(target)
        if not target.address:
            report.error = f"not running ({target.phase})"
            return report
        channel = create_channel(target.address, token=token, tracer_provider=trace.NoOpTracerProvider())
        try:
            info = channel.unary_unary(f"/{COMPONENTS[target.component]}/Info",
                                       request_serializer=common_pb2.InfoRequest.SerializeToString,
                                       response_deserializer=common_pb2.ServiceInfo.FromString)
            identity = identity_from_proto(await info(common_pb2.InfoRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as err:
            report.error = f"no Info: {err.code().name}: {err.details()}"
            return report
        except ValueError as err:  # an Info naming no known service
            report.error = f"bad Info: {err}"
            return report
        finally:
            await channel.close()
        report.numerics_version = identity.numerics_version
        report.numerics_fingerprint = identity.numerics_fingerprint
        report.weights_version = identity.weights_version
        if identity.service != target.component:
            report.problems.append(f"labelled {target.component} but its Info says {identity.service}")
        return report

    return list(await asyncio.gather(*(one(t) for t in targets)))


def _majority(reports: Sequence[PodReport], attr: str, roles: Sequence[str], label: str) -> None:
    """Name every answering pod of ``roles`` whose ``attr`` differs from the strict majority."""
    group = [r for r in reports if r.target.component in roles and not r.error]
    counts = Counter(getattr(r, attr) for r in group)
    if len(counts) <= 1:
        return
    (top, n), (_, runner_up) = counts.most_common(2)
    for r in group:
        value = getattr(r, attr)
        if n == runner_up:
            r.problems.append(f"no majority {label}: " + ", ".join(f"{v or '-'} x{c}" for v, c in sorted(counts.items())))
        elif value != top:
            r.problems.append(f"{label} {value or '-'} differs from the majority's {top}")


def judge(reports: list[PodReport], expected_numerics_version: str = "") -> list[PodReport]:
    """Mark the pods that differ (in place; returns ``reports``)."""
    _majority(reports, "numerics_fingerprint", _FINGERPRINT_ROLES, "fingerprint")
    _majority(reports, "weights_version", _WEIGHTS_ROLES, "weights")
    if expected_numerics_version:
        for r in reports:
            if r.target.component in _FINGERPRINT_ROLES and not r.error and \
                    r.numerics_version != expected_numerics_version:
                r.problems.append(f"numerics {r.numerics_version or '-'}, the release says "
                                  f"{expected_numerics_version}")
    return reports


def format_table(reports: Sequence[PodReport]) -> str:
    """The human table, one row per pod."""
    rows = [("POD", "COMPONENT", "ADDRESS", "NUMERICS", "FINGERPRINT", "WEIGHTS", "STATUS")]
    for r in reports:
        rows.append((r.target.name, r.target.component, r.target.address or "-", r.numerics_version or "-",
                     r.numerics_fingerprint or "-", r.weights_version or "-", r.verdict()))
    return aligned(rows)


def run(args: argparse.Namespace) -> int:
    """``zerokl doctor``: the table (or JSON) and the exit status described in the module docstring."""
    if not args.kube:
        print("zerokl doctor: only --kube is supported (for `zerokl up`'s services use `zerokl status`)",
              file=sys.stderr)
        return 2
    from kubernetes import client as kube_client
    from kubernetes.client.rest import ApiException
    from urllib3.exceptions import HTTPError

    from zerokl.services.runtime.auth import load_auth_token
    from zerokl.services.routing.kube import load_api_client

    namespace = _namespace(args)
    try:
        api = load_api_client(args.kubeconfig, args.context)
    except Exception as err:  # noqa: BLE001 - kubeconfig problems come in many types; all mean "cannot start"
        print(f"zerokl doctor: no Kubernetes credentials: {err}", file=sys.stderr)
        return 2
    try:
        with api:
            targets, expected = list_release(kube_client.CoreV1Api(api), namespace, args.release)
    except (ApiException, HTTPError) as err:
        print(f"zerokl doctor: cannot list pods in namespace {namespace}: {err}", file=sys.stderr)
        return 2
    if not targets:
        print(f"zerokl doctor: release {args.release!r} has no zerokl pods in namespace {namespace}",
              file=sys.stderr)
        return 2
    reports = judge(asyncio.run(query(targets, args.timeout, load_auth_token(args.auth_token_file))), expected)
    bad = [r for r in reports if not r.ok]
    if args.json:
        print(json.dumps({"namespace": namespace, "release": args.release, "numerics_version": expected,
                          "ok": not bad, "pods": [
                              {"name": r.target.name, "component": r.target.component,
                               "address": r.target.address, "phase": r.target.phase,
                               "numerics_version": r.numerics_version,
                               "numerics_fingerprint": r.numerics_fingerprint,
                               "weights_version": r.weights_version, "status": r.verdict(), "ok": r.ok}
                              for r in reports]}))
    else:
        print(f"release {args.release} in namespace {namespace}"
              + (f" (numerics {expected} per its ConfigMap)" if expected else ""))
        print(format_table(reports))
        if bad:
            print("FAIL: " + "; ".join(f"{r.target.name}: {r.verdict()}" for r in bad))
        else:
            print(f"OK: {len(reports)} pods agree")
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zerokl.doctor``: the same as ``zerokl doctor``."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="zerokl doctor", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
