"""zerokl.services.scheduler: the client front door over the prefill/decode fleet (and the RL loop).

- :mod:`.registry`: :class:`Registry`, replicas from pluggable
  :class:`ReplicaSource` s (:class:`StaticSource` on one machine; Kubernetes
  EndpointSlices later), polled for health and Info.
- :mod:`.router`: :class:`Pin` resolution (a mixed fleet is refused) and the
  least-loaded / round-robin :class:`Router`.
- :mod:`.replay`: :class:`StreamLedger`, exact replay checks when a stream
  is retried on another replica.
- :mod:`.service`: :class:`Scheduler` and its ``zerokl.v1.Inference``
  servicer; :mod:`.server`: ``zerokl serve scheduler``.
- :mod:`.up`: ``zerokl up``, every service on loopback as child processes.
- :mod:`.rl_loop`: the on-policy RL loop.
"""
from zerokl.services.scheduler.registry import (
    ReplicaEndpoint,
    ReplicaSource,
    ReplicaView,
    Registry,
    StaticSource,
    load_static_config,
)
from zerokl.services.scheduler.replay import StreamLedger
from zerokl.services.scheduler.router import MixedFleet, NoReplica, Pin, Policy, Router, UnservedPin, resolve_pin
from zerokl.services.scheduler.service import Scheduler, SchedulerConfig, SchedulerServicer, add_scheduler_service

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
    "SchedulerServicer",
    "StaticSource",
    "StreamLedger",
    "UnservedPin",
    "add_scheduler_service",
    "load_static_config",
    "resolve_pin",
]
