"""Prometheus metrics: one registry, the standard zerokl_ metrics, an HTTP endpoint.

Names follow what inference servers expose (vLLM/SGLang: TTFT, inter-token
latency, end-to-end latency, running/waiting, KV usage, token totals) with a
``zerokl_`` prefix. They are defined once here and services import them, so
the same quantity never gets two names. Every process serves one zerokl
service, so the metrics carry no ``service`` label; Prometheus adds the
scrape target's labels.
"""
from __future__ import annotations

import bisect
import itertools
import threading
import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from zerokl.services.runtime.info import ServiceIdentity

__all__ = [
    "REGISTRY",
    "TIME_TO_FIRST_TOKEN",
    "INTER_TOKEN_LATENCY",
    "E2E_REQUEST_LATENCY",
    "REQUESTS_RUNNING",
    "REQUESTS_WAITING",
    "KV_CACHE_USAGE",
    "ENGINE_SLEEP_LEVEL",
    "ENGINE_SLEEPS",
    "ENGINE_WAKES",
    "PROMPT_TOKENS",
    "GENERATION_TOKENS",
    "KV_HANDOFF_BYTES",
    "KV_HANDOFF_SECONDS",
    "WEIGHTSTORE_DELTA_LAYERS",
    "WEIGHTSTORE_DECODED_CACHE",
    "SERVING_INFO",
    "CountedHistogram",
    "set_serving_info",
    "MetricsServer",
    "start_metrics_server",
]

# A registry of our own rather than prometheus_client's global one: only what
# zerokl defines (plus process stats) is exported, and importing a library
# that registers its own metrics cannot collide with ours.
REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)


class CountedHistogram:
    """A histogram (no labels) whose :meth:`observe` takes a count: ``observe(x, n)`` records n
    observations of x in one call, so a message of n tokens costs one call, not n.

    Exported like a prometheus_client Histogram of the same name (``_bucket``, ``_count``, ``_sum``).
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = [*buckets, float("inf")]
        self._counts = [0] * len(self._bounds)   # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, amount: float, count: int = 1) -> None:
        """Record ``count`` observations of ``amount``."""
        i = bisect.bisect_left(self._bounds, amount)   # the first bucket whose upper bound is >= amount
        with self._lock:
            self._counts[i] += count
            self._sum += amount * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        yield HistogramMetricFamily(
            self._name, self._documentation,
            buckets=[(floatToGoString(b), c) for b, c in zip(self._bounds, itertools.accumulate(counts))],
            sum_value=total)


# Buckets span sub-millisecond CPU decode steps to minute-long CPU prefills.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                          0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

TIME_TO_FIRST_TOKEN = Histogram(
    "zerokl_time_to_first_token_seconds", "Time from request arrival to its first generated token.",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY)

INTER_TOKEN_LATENCY = CountedHistogram(
    "zerokl_inter_token_latency_seconds", "Time between consecutive generated tokens of one request.",
    buckets=_TOKEN_LATENCY_BUCKETS, registry=REGISTRY)
E2E_REQUEST_LATENCY = Histogram(
    "zerokl_e2e_request_latency_seconds", "Time from request arrival to its last token.",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY)
REQUESTS_RUNNING = Gauge(
    "zerokl_num_requests_running", "Requests in the running batch.", registry=REGISTRY)
REQUESTS_WAITING = Gauge(
    "zerokl_num_requests_waiting", "Requests queued, waiting for a batch slot.", registry=REGISTRY)
KV_CACHE_USAGE = Gauge(
    "zerokl_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", registry=REGISTRY)
ENGINE_SLEEP_LEVEL = Gauge(
    "zerokl_engine_sleep_level", "The engine's sleep level (co-location): 0 awake, 1 KV cache released, "
    "2 weights released too.", registry=REGISTRY)
ENGINE_SLEEPS = Counter(
    "zerokl_engine_sleeps", "Times the engine went to sleep (released its KV cache, and at level 2 its weights, "
    "for a co-located trainer).", registry=REGISTRY)
ENGINE_WAKES = Counter(
    "zerokl_engine_wakes", "Times the engine woke (by Wake or a weight switch).", registry=REGISTRY)
PROMPT_TOKENS = Counter(
    "zerokl_prompt_tokens", "Prompt tokens processed.", registry=REGISTRY)
GENERATION_TOKENS = Counter(
    "zerokl_generation_tokens", "Tokens generated.", registry=REGISTRY)
# The prefill -> decode KV plane: bytes a prefill replica sent / a decode replica received and verified,
# and the decode side's time from asking for the KV to holding all of it (prefill compute included).
KV_HANDOFF_BYTES = Counter(
    "zerokl_kv_handoff_bytes", "KV-cache bytes of prefill -> decode handoffs, by direction (sent, received).",
    ["direction"], registry=REGISTRY)
KV_HANDOFF_SECONDS = Histogram(
    "zerokl_kv_handoff_seconds", "Decode side: from requesting a prompt's KV to holding all of it, verified.",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY)
# The weight store's delta shards: layers decoded (a delta object read over its base) to accept a delta or to
# serve a read, and lookups of its cache of decoded shards (hit, miss, rejected: an entry whose bytes were wrong).
WEIGHTSTORE_DELTA_LAYERS = Counter(
    "zerokl_weightstore_delta_layers", "Delta layers the weight store decoded, by purpose (accept, read).",
    ["purpose"], registry=REGISTRY)
WEIGHTSTORE_DECODED_CACHE = Counter(
    "zerokl_weightstore_decoded_cache", "Lookups of the weight store's decoded-shard cache, by result "
    "(hit, miss, rejected).", ["result"], registry=REGISTRY)
# Info-style: a constant 1 whose labels say what this process computes with,
# so dashboards can group by fingerprint / weights version and alert when
# replicas disagree.
SERVING_INFO = Info(
    "zerokl_serving", "What this process serves: service, numerics version and fingerprint, weights version.",
    registry=REGISTRY)


class LatencyTracker:
    """Observes one request's TTFT, inter-token latencies and end-to-end latency.

    Used by a replica's request streams (as their consumer takes the outputs: what its client is
    sent) and by the scheduler's relay (what its client sees); times are ``time.monotonic()`` seconds.
    """

    def __init__(self, arrival: float | None = None) -> None:
        self.arrival = time.monotonic() if arrival is None else arrival
        self._first: float | None = None
        self._last: dict[int, float] = {}

    def tokens(self, index: int, count: int, now: float | None = None) -> None:
        """Sample ``index`` produced ``count`` tokens now."""
        if count <= 0:
            return
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = now
            TIME_TO_FIRST_TOKEN.observe(now - self.arrival)
        last = self._last.get(index)
        if last is not None:
            # A message of several tokens spreads its wait evenly over them.
            INTER_TOKEN_LATENCY.observe((now - last) / count, count)
        self._last[index] = now

    def done(self, now: float | None = None) -> None:
        """The request finished (any reason)."""
        now = time.monotonic() if now is None else now
        E2E_REQUEST_LATENCY.observe(now - self.arrival)


def set_serving_info(identity: "ServiceIdentity") -> None:
    """Publish ``identity`` as the labels of ``zerokl_serving_info`` (call again after a weight swap)."""
    SERVING_INFO.info({
        "service": identity.service,
        "replica_id": identity.replica_id,
        "numerics_version": identity.numerics_version,
        "numerics_fingerprint": identity.numerics_fingerprint,
        "backend": identity.backend,
        "device": identity.device,
        "dtype": identity.dtype,
        "weights_version": identity.weights_version,
        "zerokl_version": identity.zerokl_version,
    })


class MetricsServer:
    """A running ``/metrics`` HTTP endpoint; :meth:`close` stops it."""

    def __init__(self, server: "WSGIServer", thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        """The bound port (useful when started on port 0)."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop serving and join the server thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def start_metrics_server(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve :data:`REGISTRY` over HTTP on ``host:port`` (0 picks a free port) in a daemon thread."""
    server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    return MetricsServer(server, thread)
