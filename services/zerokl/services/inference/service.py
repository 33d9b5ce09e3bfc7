"""The client-facing ``zerokl.v1.Inference`` servicer, one for every service that serves it.

It is a thin gRPC edge: it converts at the boundary (convert.py) and hands
the work to an :class:`InferenceBackend`: a :class:`~.decode.Decoder` on a
decode replica, a :class:`~.prefill.Prefiller` on a prefill replica, the
:class:`~zerokl.services.routing.scheduler.Scheduler` on the scheduler (the
same API over the whole fleet). Errors are raised as :class:`ServiceError` s
and become statuses in the runtime's interceptor; a request that fails ends
only its own call.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Protocol

import grpc.aio

from zerokl.services.inference import convert
from zerokl.services.inference.types import GenerateDelta, InferenceRequest, ScoreResult, SleepState
from zerokl.services.runtime.errors import FailedPrecondition, InvalidArgument
from zerokl.services.runtime.info import ServiceIdentity, identity_to_proto
from zerokl.services.runtime.optrace import require_operator
from zerokl.services.runtime.server import stream_out
from zerokl.services.runtime.tracing import tag_request
from zerokl.services.weightstore.convert import shared_export_from_proto
from zerokl.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from zerokl.vocab import SamplingOptions

if TYPE_CHECKING:    # the trace types hold tensors: the scheduler serves this API without torch
    from zerokl.kernels.trace import Trace

__all__ = ["INFERENCE_SERVICE", "InferenceBackend", "InferenceServicer"]

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class InferenceBackend(Protocol):
    """What the Inference servicer needs from the replica behind it."""

    identity: ServiceIdentity

    def generate(self, r: InferenceRequest) -> AsyncIterator[GenerateDelta]: ...

    async def score(self, r: InferenceRequest) -> ScoreResult: ...

    async def trace(self, ids: tuple[int, ...], options: SamplingOptions, capture: tuple[str, ...]) -> Trace: ...

    def abort(self, request_id: str) -> bool | Awaitable[bool]: ...

    async def sleep(self, level: int) -> SleepState: ...

    async def wake(self) -> SleepState: ...


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves ``zerokl.v1.Inference`` from an :class:`InferenceBackend`."""

    def __init__(self, backend: InferenceBackend,
                 switch_weights: Callable[[str], Awaitable[ServiceIdentity]] | None = None) -> None:
        self._backend = backend
        self._switch_weights = switch_weights

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ServiceInfo:
        return identity_to_proto(self._backend.identity)

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateResponse]:
        tag_request(request.request_id)
        async for msg in stream_out(self._backend.generate(convert.request_from_proto(request)),
                                    convert.delta_to_proto):
            yield msg

    async def Abort(self, request: inference_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> inference_pb2.AbortResponse:
        found = self._backend.abort(request.request_id)
        if inspect.isawaitable(found):   # the scheduler asks the replica the request runs on
            found = await found
        return inference_pb2.AbortResponse(found=found)

    async def Score(self, request: inference_pb2.ScoreRequest,
                    context: grpc.aio.ServicerContext) -> inference_pb2.ScoreResponse:
        capture = convert.score_trace_from_proto(request)
        if capture is not None:
            require_operator("a Score with a trace")
        scored = convert.request_from_proto(request)
        if capture is not None and not hasattr(self._backend, "trace"):
            raise FailedPrecondition("this service does not trace: ask a replica (or the trainer) directly")
        result = await self._backend.score(scored)
        trace = await self._backend.trace(result.token_ids, scored.options, capture) if capture is not None else None
        return convert.score_result_to_proto(result, trace)

    async def Sleep(self, request: inference_pb2.SleepRequest,
                    context: grpc.aio.ServicerContext) -> inference_pb2.SleepResponse:
        level = convert.sleep_level_from_proto(request)
        return convert.sleep_state_to_proto(await self._backend.sleep(level))

    async def Wake(self, request: inference_pb2.WakeRequest,
                   context: grpc.aio.ServicerContext) -> inference_pb2.SleepResponse:
        return convert.sleep_state_to_proto(await self._backend.wake())

    async def SwitchWeights(self, request: inference_pb2.SwitchWeightsRequest,
                            context: grpc.aio.ServicerContext) -> common_pb2.ServiceInfo:
        if self._switch_weights is None:
            raise FailedPrecondition("this replica has no weight store configured (--weight-store)")
        if not request.version:
            raise InvalidArgument.field("version", "name a weight-store version or 'latest'")
        if request.HasField("shared"):
            # The trainer's in-memory copy (issue 37): a replica on its host copies it in place.
            shared = shared_export_from_proto(request.shared)
            return identity_to_proto(await self._switch_weights(request.version, shared))
        return identity_to_proto(await self._switch_weights(request.version))
