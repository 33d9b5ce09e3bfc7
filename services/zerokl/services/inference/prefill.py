"""The prefill service: ``zerokl.v1.Inference`` (Score, Info) and ``zerokl.v1.Prefill``.

A prefill replica reads prompts. ``PrefillKV`` builds a prompt's KV in its
own engine (prefill mode: every prompt position, the local path's one step),
draws each sample's first token there with the request's sampling key (seed,
sample index, position), and streams the tokens (in the header) and the exact
KV bytes to whoever asked: a decode replica the scheduler paired it with
(``Decode.GenerateFromPrefill``), which checks that the KV was computed with
its own weights, numerics and model config, emits the first tokens at once and
generates from the second, so the client gets the tokens a decode replica alone
would have produced, bit for bit. The stream is one
server stream of checksummed chunks, paced by HTTP/2 flow control. ``Score``
is served locally; ``Generate`` is refused (it goes to the scheduler, or a
decode replica).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import AsyncIterator

import grpc
import grpc.aio

from zerokl.kernels.trace import Trace
from zerokl.services.inference import convert
from zerokl.services.inference.kv import handoff_to_blob
from zerokl.services.inference.replica import Replica
from zerokl.services.inference.service import INFERENCE_SERVICE, InferenceServicer
from zerokl.services.inference.types import GenerateDelta, InferenceRequest, KVHeader, ScoreResult, SleepState
from zerokl.services.runtime import metrics as runtime_metrics
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, chunk_to_proto, split_bytes
from zerokl.services.runtime.errors import Cancelled, FailedPrecondition
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.runtime.server import ServiceServer
from zerokl.services.runtime.tracing import tag_request
from zerokl.v1 import inference_pb2, inference_pb2_grpc
from zerokl.vocab import SamplingOptions

__all__ = ["PREFILL_SERVICE", "Prefiller", "PrefillServicer", "add_prefill_service"]

log = logging.getLogger(__name__)

PREFILL_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class Prefiller:
    """The prefill replica's backend: KV of prompts (for a decode replica), Score, Abort.

    ``chunk_bytes`` sizes the KV chunks streamed by PrefillKV.
    """

    def __init__(self, replica: Replica, chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}")
        self.replica = replica
        self.chunk_bytes = chunk_bytes

    @property
    def identity(self) -> ServiceIdentity:
        return self.replica.identity

    async def prefill(self, r: InferenceRequest) -> tuple[KVHeader, memoryview] | None:
        """The KV of ``r``'s prompt as a header and a blob; None when the request was aborted meanwhile.

        The KV is only good for generating, so the generate rules (room for a
        new token, n, KV fit) refuse here, before any prefill work, what the
        decode replica would refuse after.
        """
        replica = self.replica
        replica.check_pins(r)
        ids = replica.prompt_ids(r)
        if ids:
            replica.check_fits_context(ids)
            replica.check_generate(ids, r.options)
        rid = r.request_id or replica.new_request_id()
        prefilled = await replica.prefill(rid, ids, r.options, r.weights_version)
        if prefilled is None:
            return None
        out, version = prefilled
        assert out.handoff is not None
        identity = dataclasses.replace(replica.identity, weights_version=version)
        return handoff_to_blob(out.handoff, request_id=rid, identity=identity, prompt_ids=ids,
                               num_cached_tokens=out.num_cached_tokens,
                               prompt_logprobs=out.prompt_logprobs if r.options.prompt_logprobs else None)

    async def generate(self, r: InferenceRequest) -> AsyncIterator[GenerateDelta]:
        """Refused: a prefill replica hands KV to a decode replica the scheduler pairs it with."""
        raise FailedPrecondition("a prefill replica does not generate: send Generate to the scheduler (which pairs "
                                 "this replica with a decode replica) or to a decode replica")
        yield  # pragma: no cover - makes this an async generator like the other backends'

    async def score(self, r: InferenceRequest) -> ScoreResult:
        return await self.replica.score(r)

    async def trace(self, ids: tuple[int, ...], options: SamplingOptions, capture: tuple[str, ...]) -> Trace:
        return await self.replica.trace(ids, options, capture)

    async def sleep(self, level: int) -> SleepState:
        return await self.replica.sleep(level)

    async def wake(self) -> SleepState:
        return await self.replica.wake()

    def abort(self, request_id: str) -> bool:
        """Abort a prefill running in this replica's engine."""
        return self.replica.abort(request_id)


class PrefillServicer(inference_pb2_grpc.PrefillServicer):
    """Serves ``zerokl.v1.Prefill`` from a :class:`Prefiller`."""

    def __init__(self, prefiller: Prefiller) -> None:
        self._prefiller = prefiller

    async def PrefillKV(self, request: inference_pb2.PrefillKVRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.PrefillKVResponse]:
        r = convert.request_from_proto(request.request)
        tag_request(r.request_id)
        prefilled = await self._prefiller.prefill(r)
        if prefilled is None:
            raise Cancelled(f"request {r.request_id!r} was aborted during prefill")
        header, blob = prefilled
        yield inference_pb2.PrefillKVResponse(header=convert.kv_header_to_proto(header))
        # Each yield waits while the HTTP/2 window is full: the receiver paces the stream.
        for chunk in split_bytes(blob, chunk_size=self._prefiller.chunk_bytes):
            yield inference_pb2.PrefillKVResponse(chunk=chunk_to_proto(chunk))
            runtime_metrics.KV_HANDOFF_BYTES.labels("sent").inc(len(chunk.data))


def add_prefill_service(server: ServiceServer, prefiller: Prefiller,
                        switch_weights=None) -> None:  # noqa: ANN001
    """Serve ``zerokl.v1.Inference`` and ``zerokl.v1.Prefill`` from ``prefiller`` (before the server starts).

    ``switch_weights`` (a :meth:`WeightSwitcher.switch`) serves SwitchWeights. Health is
    NOT_SERVING while the replica's engine cannot serve (:meth:`AsyncEngine.on_fitness`).
    """
    server.add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server,
                        InferenceServicer(prefiller, switch_weights), INFERENCE_SERVICE)
    server.add_servicer(inference_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(prefiller),
                        PREFILL_SERVICE)
    prefiller.replica.engine.on_fitness(lambda reason: server.set_unfit("engine", reason))
