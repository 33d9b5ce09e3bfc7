"""Async client of the inference services (Inference, Prefill, Decode).

RPC failures surface as ``grpc.aio.AioRpcError`` with the server's status
code. The KV a prefill replica streams is verified here chunk by chunk and as
a whole (:class:`~zerokl.services.runtime.errors.DataLoss` on a mismatch).
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import Any, AsyncIterator, NoReturn

import grpc
import grpc.aio

from zerokl.services.inference import convert
from zerokl.services.inference.types import GenerateDelta, GenerateResult, InferenceRequest, KVHeader, ScoreResult
from zerokl.services.runtime.chunks import (
    MAX_CHUNK_BYTES,
    ChunkAssembler,
    chunk_from_proto,
    chunk_to_proto,
    split_bytes,
)
from zerokl.services.runtime.errors import DataLoss
from zerokl.services.runtime.info import ServiceIdentity, identity_from_proto
from zerokl.services.runtime.client import ServiceClient
from zerokl.v1 import common_pb2, inference_pb2, inference_pb2_grpc

__all__ = ["InferenceClient"]


class InferenceClient(ServiceClient):
    """Generate, score, abort and hand KV over, against one replica.

    Pass a ``target`` (``host:port``) and optionally a bearer ``token``, TLS
    ``credentials`` and a tracer provider, or an existing ``channel``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inference = inference_pb2_grpc.InferenceStub(self._channel)
        self._prefill = inference_pb2_grpc.PrefillStub(self._channel)
        self._decode = inference_pb2_grpc.DecodeStub(self._channel)

    # ---- Inference ------------------------------------------------------------

    async def info(self) -> ServiceIdentity:
        """What the replica computes with."""
        return identity_from_proto(await self._inference.Info(common_pb2.InfoRequest()))

    async def switch_weights(self, version: str, *, timeout: float | None = None) -> ServiceIdentity:
        """Make the replica (or, on the scheduler, the whole fleet) serve weight-store ``version``."""
        return identity_from_proto(await self._inference.SwitchWeights(
            inference_pb2.SwitchWeightsRequest(version=version), timeout=timeout))

    async def generate(self, request: InferenceRequest, *,
                       timeout: float | None = None) -> AsyncIterator[GenerateDelta]:
        """Stream the deltas of one request (closing the iterator early cancels the call)."""
        call = self._inference.Generate(convert.request_to_proto(request), timeout=timeout)
        try:
            async for msg in call:
                yield convert.delta_from_proto(msg)
        finally:
            call.cancel()  # no-op once finished

    async def generate_all(self, request: InferenceRequest, *, timeout: float | None = None) -> GenerateResult:
        """The whole stream, folded into per-sample results."""
        return GenerateResult.collect([d async for d in self.generate(request, timeout=timeout)])

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight on this replica; False if it was not."""
        return (await self._inference.Abort(inference_pb2.AbortRequest(request_id=request_id))).found

    async def score(self, request: InferenceRequest, *, timeout: float | None = None) -> ScoreResult:
        """Per-token logprobs of the prompt."""
        return convert.score_result_from_proto(
            await self._inference.Score(convert.score_request_to_proto(request), timeout=timeout))

    # ---- Prefill / Decode (the KV handoff) ------------------------------------

    async def prefill_kv(self, request: InferenceRequest, *, timeout: float | None = None) -> tuple[KVHeader, bytes]:
        """A prefill replica's KV of the prompt: its header and the verified blob."""
        call = self._prefill.PrefillKV(inference_pb2.PrefillKVRequest(request=convert.request_to_proto(request)),
                                       timeout=timeout)
        header: KVHeader | None = None
        assembler: ChunkAssembler | None = None
        try:
            async for msg in call:
                if msg.WhichOneof("msg") == "header":
                    if header is not None:
                        raise DataLoss("PrefillKV sent a second header")
                    header = convert.kv_header_from_proto(msg.header)
                    assembler = ChunkAssembler(total_size=header.total_bytes)
                elif assembler is None:
                    raise DataLoss("PrefillKV sent a chunk before its header")
                else:
                    assembler.add(chunk_from_proto(msg.chunk))
        finally:
            call.cancel()
        if header is None or assembler is None:
            raise DataLoss("PrefillKV ended without a header")
        blob = assembler.value()
        if hashlib.sha256(blob).digest() != header.sha256:
            raise DataLoss("the KV blob does not match its header's sha256")
        return header, blob

    async def generate_from_kv(self, request: InferenceRequest, header: KVHeader, blob: bytes, *,
                               chunk_bytes: int = MAX_CHUNK_BYTES,
                               timeout: float | None = None) -> AsyncIterator[GenerateDelta]:
        """Hand ``blob`` to a decode replica and stream the generation it runs from it.

        One chunk in flight at a time: each is sent after the previous one was
        acknowledged, so an error status (DATA_LOSS, INVALID_ARGUMENT) arrives
        cleanly instead of racing a pending send.
        """
        call = self._decode.GenerateFromKV(timeout=timeout)
        try:
            await self._send(call, inference_pb2.GenerateFromKVRequest(header=inference_pb2.GenerateFromKVHeader(
                request=convert.request_to_proto(request), kv=convert.kv_header_to_proto(header))))
            await self._ack(call)
            for chunk in split_bytes(blob, chunk_size=chunk_bytes):
                await self._send(call, inference_pb2.GenerateFromKVRequest(chunk=chunk_to_proto(chunk)))
                await self._ack(call)
            await call.done_writing()
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                if msg.WhichOneof("msg") != "response":
                    raise DataLoss("GenerateFromKV sent an acknowledgement after the blob was complete")
                yield convert.delta_from_proto(msg.response)
        finally:
            call.cancel()

    @staticmethod
    async def _raise_status(call: Any) -> NoReturn:
        """Raise the status that ended ``call`` (a stream-stream call cannot be awaited for it)."""
        code = await call.code()
        if code is not grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(),
                                       await call.details())
        raise DataLoss("GenerateFromKV ended before the KV blob was acknowledged")

    @classmethod
    async def _send(cls, call: Any, msg: inference_pb2.GenerateFromKVRequest) -> None:
        try:
            await call.write(msg)
        except asyncio.InvalidStateError:  # the call already ended (e.g. the replica is unreachable)
            await cls._raise_status(call)

    @classmethod
    async def _ack(cls, call: Any) -> int:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            await cls._raise_status(call)
        if msg.WhichOneof("msg") != "ack":
            raise DataLoss("GenerateFromKV answered before the KV blob was complete")
        return msg.ack.received
