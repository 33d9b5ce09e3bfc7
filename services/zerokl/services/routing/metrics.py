"""The scheduler's own ``zerokl_scheduler_`` metrics, in the runtime's registry.

The client-facing latency histograms (TTFT, inter-token, end-to-end) and the
running-requests gauge are the runtime's shared ones: in the scheduler
process they measure what clients see through the front door, retries
included. These add what only a router knows.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge

from zerokl.services.runtime.metrics import REGISTRY

__all__ = ["REQUESTS", "RETRIES", "ROUTED", "REPLICAS", "REPLAY_MISMATCHES", "REPLICA_BYTES"]

REQUESTS = Counter(
    "zerokl_scheduler_requests", "Client requests the scheduler finished, by method and status code.",
    ["method", "code"], registry=REGISTRY)
RETRIES = Counter(
    "zerokl_scheduler_retries", "Attempts re-run on another replica after one failed, by role.",
    ["role"], registry=REGISTRY)
ROUTED = Counter(
    "zerokl_scheduler_routed", "Attempts sent to each replica.", ["role", "replica"], registry=REGISTRY)
REPLICAS = Gauge(
    "zerokl_scheduler_replicas",
    "Registered replicas by role and state: healthy and matching the current pin, healthy but another pin "
    "(never routed to by default), or unhealthy.", ["role", "state"], registry=REGISTRY)
REPLAY_MISMATCHES = Counter(
    "zerokl_scheduler_replay_mismatches", "Retries whose replayed prefix differed from what was sent (DATA_LOSS).",
    registry=REGISTRY)
REPLICA_BYTES = Counter(
    "zerokl_scheduler_replica_bytes",
    "Bytes of the messages the scheduler received from replicas on request calls (serialized size), by role. "
    "No KV passes through the scheduler: per request this is the tokens' deltas, not the prompt's KV.",
    ["role"], registry=REGISTRY)
