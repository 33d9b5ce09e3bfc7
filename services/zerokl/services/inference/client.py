"""Async client of the inference services (Inference, Prefill, Decode).

RPC failures surface as ``grpc.aio.AioRpcError`` with the server's status
code. The KV handoff has two ends: :meth:`InferenceClient.generate_from_prefill`
(what the scheduler calls on a decode replica, naming a prefill replica) and
:meth:`InferenceClient.prefill_kv_stream` (what the decode replica then reads
from the prefill replica).
"""
from __future__ import annotations

import hashlib
from typing import Any, AsyncIterator, Callable, TypeVar

import grpc
import grpc.aio

from zerokl.services.inference import convert
from zerokl.services.inference.types import GenerateDelta, GenerateResult, InferenceRequest, KVHeader, ScoreResult, \
    SleepState
from zerokl.services.runtime.chunks import Chunk, ChunkAssembler, chunk_from_proto
from zerokl.services.runtime.errors import DataLoss
from zerokl.services.runtime.info import ServiceIdentity, identity_from_proto
from zerokl.services.runtime.client import ServiceClient
from zerokl.services.weightstore.convert import shared_export_to_proto
from zerokl.services.weightstore.shared import SharedExport
from zerokl.v1 import common_pb2, inference_pb2, inference_pb2_grpc

__all__ = ["InferenceClient"]

M = TypeVar("M")


class InferenceClient(ServiceClient):
    """Generate, score, abort and hand KV over, against one replica.

    Pass a ``target`` (``host:port``) and optionally a bearer ``token``, TLS
    ``credentials`` and a tracer provider, or an existing ``channel``.
    ``on_received`` is called with the serialized size of every response
    message (the scheduler counts what it receives from replicas with it).
    """

    def __init__(self, *args: Any, on_received: Callable[[int], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_received = on_received
        self._inference = inference_pb2_grpc.InferenceStub(self._channel)
        self._prefill = inference_pb2_grpc.PrefillStub(self._channel)
        self._decode = inference_pb2_grpc.DecodeStub(self._channel)

    def _got(self, msg: M) -> M:
        if self._on_received is not None:
            self._on_received(msg.ByteSize())  # type: ignore[attr-defined]
        return msg

    # ---- Inference ------------------------------------------------------------

    async def info(self) -> ServiceIdentity:
        """What the replica computes with."""
        return identity_from_proto(self._got(await self._inference.Info(common_pb2.InfoRequest())))

    async def switch_weights(self, version: str, *, shared: SharedExport | None = None,
                             timeout: float | None = None) -> ServiceIdentity:
        """Make the replica (or, on the scheduler, the whole fleet) serve weight-store ``version``;
        ``shared``: the trainer's in-memory copy of it (copied in place on the trainer's host)."""
        request = inference_pb2.SwitchWeightsRequest(version=version)
        if shared is not None:
            request.shared.CopyFrom(shared_export_to_proto(shared))
        return identity_from_proto(self._got(await self._inference.SwitchWeights(request, timeout=timeout)))

    async def sleep(self, level: int, *, timeout: float | None = None) -> SleepState:
        """Release the replica's KV cache (``level`` 1) or its weights too (2) for a co-located trainer (on the
        scheduler: every replica of the fleet); requests wait until Wake or a SwitchWeights wakes it."""
        return convert.sleep_state_from_proto(
            self._got(await self._inference.Sleep(inference_pb2.SleepRequest(level=level), timeout=timeout)))

    async def wake(self, *, timeout: float | None = None) -> SleepState:
        """Serve again (a replica whose weights were released wakes by SwitchWeights instead)."""
        return convert.sleep_state_from_proto(
            self._got(await self._inference.Wake(inference_pb2.WakeRequest(), timeout=timeout)))

    async def generate(self, request: InferenceRequest, *,
                       timeout: float | None = None) -> AsyncIterator[GenerateDelta]:
        """Stream the deltas of one request (closing the iterator early cancels the call)."""
        call = self._inference.Generate(convert.request_to_proto(request), timeout=timeout)
        try:
            async for msg in call:
                yield convert.delta_from_proto(self._got(msg))
        finally:
            call.cancel()  # no-op once finished

    async def generate_all(self, request: InferenceRequest, *, timeout: float | None = None) -> GenerateResult:
        """The whole stream, folded into per-sample results."""
        return GenerateResult.collect([d async for d in self.generate(request, timeout=timeout)])

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight on this replica; False if it was not."""
        return self._got(await self._inference.Abort(inference_pb2.AbortRequest(request_id=request_id))).found

    async def score(self, request: InferenceRequest, *, timeout: float | None = None) -> ScoreResult:
        """Per-token logprobs of the prompt."""
        return convert.score_result_from_proto(
            self._got(await self._inference.Score(convert.score_request_to_proto(request), timeout=timeout)))

    # ---- Prefill / Decode (the KV handoff) ------------------------------------

    async def prefill_kv_stream(self, request: InferenceRequest, *,
                                timeout: float | None = None) -> AsyncIterator[KVHeader | Chunk]:
        """A prefill replica's KV of the prompt as it streams: the header, then the (unverified) chunks.

        The caller verifies them (:class:`~zerokl.services.inference.kv.KVReceiver`). Closing the
        iterator early cancels the call, which aborts the prefill.
        """
        call = self._prefill.PrefillKV(inference_pb2.PrefillKVRequest(request=convert.request_to_proto(request)),
                                       timeout=timeout)
        header = False
        try:
            async for msg in call:
                self._got(msg)
                if msg.WhichOneof("msg") == "header":
                    if header:
                        raise DataLoss("PrefillKV sent a second header")
                    header = True
                    yield convert.kv_header_from_proto(msg.header)
                elif not header:
                    raise DataLoss("PrefillKV sent a chunk before its header")
                else:
                    yield chunk_from_proto(msg.chunk)
        finally:
            call.cancel()  # no-op once finished
        if not header:
            raise DataLoss("PrefillKV ended without a header")

    async def prefill_kv(self, request: InferenceRequest, *, timeout: float | None = None) -> tuple[KVHeader, bytes]:
        """A prefill replica's KV of the prompt, whole: its header and the verified blob."""
        header: KVHeader | None = None
        assembler: ChunkAssembler | None = None
        async for item in self.prefill_kv_stream(request, timeout=timeout):
            if isinstance(item, KVHeader):
                header, assembler = item, ChunkAssembler(total_size=item.total_bytes)
            else:
                assert assembler is not None
                assembler.add(item)
        assert header is not None and assembler is not None
        blob = assembler.value()
        if hashlib.sha256(blob).digest() != header.sha256:
            raise DataLoss("the KV blob does not match its header's sha256")
        return header, blob

    async def generate_from_prefill(self, request: InferenceRequest, prefill_address: str, *,
                                    handoff_timeout: float | None = None,
                                    timeout: float | None = None) -> AsyncIterator[GenerateDelta]:
        """Generate on this decode replica from the KV it reads from the prefill replica at ``prefill_address``.

        The KV goes prefill -> decode directly; this call carries the request and the deltas only.
        ``handoff_timeout`` bounds the decode replica's read of the KV (None: its default).
        """
        msg = inference_pb2.GenerateFromPrefillRequest(
            request=convert.request_to_proto(request), prefill_address=prefill_address,
            handoff_timeout_ms=round(handoff_timeout * 1000) if handoff_timeout else 0)
        call = self._decode.GenerateFromPrefill(msg, timeout=timeout)
        try:
            async for response in call:
                yield convert.delta_from_proto(self._got(response))
        finally:
            call.cancel()  # no-op once finished
