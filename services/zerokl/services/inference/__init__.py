"""zerokl.services.inference: the prefill and decode services, batch-invariant serving over gRPC.

- :mod:`.async_engine`: :class:`AsyncEngine`, the asyncio front of an engine core
  (:mod:`zerokl.services.engine`: its own process for a served replica, or a thread):
  per-request streams, the core's errors as statuses, the ``zerokl_`` metrics.
- :mod:`.replica`: :class:`Replica`, request rules (pins, tokenizing, limits)
  and engine outputs as client deltas.
- :mod:`.service`, :mod:`.decode`, :mod:`.prefill`: the ``zerokl.v1``
  Inference, Decode and Prefill servicers; :mod:`.server` their command line.
- :mod:`.kv`: the KV handoff as exact bytes; :mod:`.convert`: the only proto
  converters; :mod:`.types`: the dataclasses they convert.
- :mod:`.client`: :class:`InferenceClient`, the async gRPC client.
"""
from zerokl.services.inference.async_engine import AsyncEngine, RequestStream
from zerokl.services.inference.client import InferenceClient
from zerokl.services.inference.replica import Replica, ServingLimits
from zerokl.services.inference.types import (
    GenerateDelta,
    GenerateResult,
    InferenceRequest,
    KVHeader,
    SampleResult,
    ScoreResult,
    TensorLayout,
    Usage,
)

__all__ = [
    "AsyncEngine",
    "GenerateDelta",
    "GenerateResult",
    "InferenceClient",
    "InferenceRequest",
    "KVHeader",
    "Replica",
    "RequestStream",
    "SampleResult",
    "ScoreResult",
    "ServingLimits",
    "TensorLayout",
    "Usage",
]
