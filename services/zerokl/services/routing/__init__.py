"""zerokl.services.routing: the scheduler, the client front door over the prefill/decode fleet.

- :mod:`.registry`: :class:`Registry`, replicas from pluggable
  :class:`ReplicaSource` s (:class:`StaticSource` on one machine,
  :mod:`.kube`'s EndpointSlices in a cluster), polled for health and Info.
- :mod:`.router`: :class:`Pin` resolution (a mixed fleet is refused) and the
  least-loaded / round-robin :class:`Router`.
- :mod:`.replay`: :class:`StreamLedger`, exact replay checks when a stream
  is retried on another replica.
- :mod:`.scheduler`: :class:`Scheduler`: pins, (prefill, decode) pairs,
  retries, the fleet brought to its target weights version; served by the
  shared ``zerokl.v1.Inference`` servicer.
- :mod:`.fleet`: the fleet's target weights version, kept in ``fleet.json``.
- :mod:`.server`: ``zerokl serve scheduler`` (routing, and the Jobs API of
  :mod:`zerokl.services.jobs`).
"""
from __future__ import annotations

import importlib
from typing import Any

# Where each public name lives. Imported on first use: importing one submodule (the kube
# source, the registry) should not pay for the whole routing stack (gRPC stubs, torch).
_EXPORTS = {
    "ReplicaEndpoint": "registry", "ReplicaSource": "registry", "ReplicaView": "registry", "Registry": "registry",
    "StaticSource": "registry", "load_static_config": "registry",
    "StreamLedger": "replay",
    "MixedFleet": "router", "NoReplica": "router", "Pin": "router", "Policy": "router", "Router": "router",
    "resolve_pin": "router",
    "Scheduler": "scheduler", "SchedulerConfig": "scheduler",
    "add_scheduler_service": "scheduler",
}

__all__ = [
    "MixedFleet",
    "NoReplica",
    "Pin",
    "Policy",
    "Registry",
    "ReplicaEndpoint",
    "ReplicaSource",
    "ReplicaView",
    "Router",
    "Scheduler",
    "SchedulerConfig",
    "StaticSource",
    "StreamLedger",
    "add_scheduler_service",
    "load_static_config",
    "resolve_pin",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
