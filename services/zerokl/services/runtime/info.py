"""What a service computes with, and its ``zerokl.v1.ServiceInfo`` form.

Every service answers an Info RPC with a ServiceInfo; the scheduler pairs
replicas only when numerics fingerprint and weights version agree.
:func:`identity_to_proto` and :func:`identity_from_proto` are the only
converters.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Mapping

from zerokl.v1 import common_pb2

__all__ = [
    "CLUSTER_ID_ENV",
    "SERVICES",
    "ServiceIdentity",
    "default_replica_id",
    "model_config_hash",
    "identity_to_proto",
    "identity_from_proto",
]

SERVICES = ("prefill", "decode", "trainer", "weight-store", "scheduler", "tinker")
# The cluster a service belongs to (`zerokl up` sets it for its children; a Helm release may too).
CLUSTER_ID_ENV = "ZEROKL_CLUSTER_ID"


@functools.cache
def _package_version() -> str:
    # Read once per process: importlib.metadata parses the installed package's metadata from disk (~2 ms on
    # the CI box), and the scheduler builds an identity at every fleet change (each request's start and end).
    try:
        return metadata.version("zerokl")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _cluster_id() -> str:
    return os.environ.get(CLUSTER_ID_ENV, "")


def default_replica_id(service: str) -> str:
    """``ZEROKL_REPLICA_ID``, else the pod name Kubernetes sets as HOSTNAME, else host-pid."""
    explicit = os.environ.get("ZEROKL_REPLICA_ID")
    if explicit:
        return explicit
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("HOSTNAME"):
        return os.environ["HOSTNAME"]
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


def model_config_hash(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of a model config."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ServiceIdentity:
    """The fields of ``zerokl.v1.ServiceInfo``; empty strings mean "not applicable"."""

    service: str
    replica_id: str
    numerics_version: str = ""
    numerics_fingerprint: str = ""
    backend: str = ""
    device: str = ""
    dtype: str = ""
    weights_version: str = ""
    model_config_hash: str = ""
    zerokl_version: str = dataclasses.field(default_factory=_package_version)
    cluster_id: str = dataclasses.field(default_factory=_cluster_id)   # $ZEROKL_CLUSTER_ID of the process

    def __post_init__(self) -> None:
        if self.service not in SERVICES:
            raise ValueError(f"unknown service {self.service!r}; expected one of {SERVICES}")

    def with_weights(self, weights_version: str, model_config: Mapping[str, Any] | None = None,
                     numerics_version: str | None = None, numerics_fingerprint: str | None = None) -> "ServiceIdentity":
        """A copy after loading ``weights_version`` (and, if given, its config and numerics)."""
        changes: dict[str, str] = {"weights_version": weights_version}
        if model_config is not None:
            changes["model_config_hash"] = model_config_hash(model_config)
        if numerics_version is not None:
            changes["numerics_version"] = numerics_version
        if numerics_fingerprint is not None:
            changes["numerics_fingerprint"] = numerics_fingerprint
        return dataclasses.replace(self, **changes)


def identity_to_proto(identity: ServiceIdentity) -> common_pb2.ServiceInfo:
    """ServiceIdentity -> ``zerokl.v1.ServiceInfo`` (the Info RPC's answer)."""
    return common_pb2.ServiceInfo(**dataclasses.asdict(identity))


def identity_from_proto(msg: common_pb2.ServiceInfo) -> ServiceIdentity:
    """``zerokl.v1.ServiceInfo`` -> ServiceIdentity."""
    return ServiceIdentity(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(ServiceIdentity)})
