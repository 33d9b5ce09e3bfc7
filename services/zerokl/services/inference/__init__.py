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
from __future__ import annotations

import importlib
from typing import Any

# Where each public name lives. Imported on first use: a client (`zerokl generate`, the scheduler's stubs) should
# not pay for the engine (torch) that only a served replica runs.
_EXPORTS = {
    "AsyncEngine": "async_engine", "RequestStream": "async_engine",
    "InferenceClient": "client",
    "Replica": "replica", "ServingLimits": "replica",
    "GenerateDelta": "types", "GenerateResult": "types", "InferenceRequest": "types", "KVHeader": "types",
    "SampleResult": "types", "ScoreResult": "types", "TensorLayout": "types", "Usage": "types",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
