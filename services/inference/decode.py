"""The decode service: ``zerokl.v1.Inference`` (standalone generation) and ``zerokl.v1.Decode``.

``GenerateFromKV`` receives a prefill replica's KV as checksummed chunks,
acknowledging each one (a bidi stream, so an error such as DATA_LOSS reaches
the sender as a clean status while it waits for its acknowledgement, not as a
broken pipe in the middle of a send), rebuilds the exact tensors and
generates from them. Only KV from a caller authenticated with the peer token
may enter this replica's prefix cache: anyone else's (forged, or merely
unauthenticated) serves its own request and is never shared.
"""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator

import grpc.aio

from zerokl.services.inference import convert
from zerokl.services.inference.kv import KVReceiver, check_header
from zerokl.services.inference.replica import Replica
from zerokl.services.inference.service import INFERENCE_SERVICE, InferenceServicer
from zerokl.services.runtime.auth import Role, caller_role
from zerokl.services.runtime.chunks import chunk_from_proto
from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.runtime.server import ServiceServer
from zerokl.services.runtime.tracing import tag_request
from zerokl.v1 import inference_pb2, inference_pb2_grpc

__all__ = ["DECODE_SERVICE", "DecodeServicer", "add_decode_service"]

DECODE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def _ack(received: int) -> inference_pb2.GenerateFromKVResponse:
    return inference_pb2.GenerateFromKVResponse(ack=inference_pb2.KVAck(received=received))


class DecodeServicer(inference_pb2_grpc.DecodeServicer):
    """Serves ``zerokl.v1.Decode`` from a :class:`Replica`."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica

    async def GenerateFromKV(self, request_iterator: AsyncIterator[inference_pb2.GenerateFromKVRequest],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateFromKVResponse]:
        replica = self._replica
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("msg") != "header":
            raise InvalidArgument.field("header", "the first GenerateFromKV message must be a GenerateFromKVHeader")
        r = convert.request_from_proto(first.header.request)
        header = convert.kv_header_from_proto(first.header.kv)
        replica.check_pins(r)
        if r.prompt_text is not None or (r.prompt_ids is not None and r.prompt_ids != header.prompt_ids):
            raise InvalidArgument.field("request.prompt", "must be unset or equal to kv.prompt_token_ids")
        if r.request_id and header.request_id and r.request_id != header.request_id:
            raise InvalidArgument.field("kv.request_id", f"{header.request_id!r} differs from the request's "
                                                         f"{r.request_id!r}")
        # Refused before a byte is buffered: a checked header also bounds the blob's size.
        check_header(header, replica.identity, replica.model_config, replica.dtype, replica.max_model_len)
        replica.check_generate(header.prompt_ids, r.options)
        r = dataclasses.replace(r, request_id=r.request_id or header.request_id)
        tag_request(r.request_id)
        receiver = KVReceiver(header)
        trusted = caller_role() is Role.PEER
        yield _ack(0)
        handoff = None
        while handoff is None:
            msg = await anext(requests, None)
            if msg is None:
                raise InvalidArgument.field("chunk", f"the stream ended after {receiver.received} of "
                                                     f"{header.total_bytes} KV bytes")
            if msg.WhichOneof("msg") != "chunk":
                raise InvalidArgument.field("chunk", "only the first GenerateFromKV message may be a header")
            receiver.add(chunk_from_proto(msg.chunk))
            if receiver.complete:
                handoff = receiver.handoff(trusted)  # DATA_LOSS before the last ack if the blob's sha256 differs
            yield _ack(receiver.received)
        deltas = replica.generate_from_handoff(r, header.prompt_ids, handoff, header.prompt_logprobs,
                                               header.num_cached_tokens, header.weights_version)
        try:
            async for delta in deltas:
                yield inference_pb2.GenerateFromKVResponse(response=convert.delta_to_proto(delta))
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]


def add_decode_service(server: ServiceServer, replica: Replica, switch_weights=None) -> None:  # noqa: ANN001
    """Serve ``zerokl.v1.Inference`` and ``zerokl.v1.Decode`` from ``replica`` (before the server starts).

    ``switch_weights`` (a :meth:`WeightSwitcher.switch`) serves SwitchWeights. Health is
    NOT_SERVING while the replica's engine cannot serve (:meth:`AsyncEngine.on_fitness`).
    """
    server.add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server,
                        InferenceServicer(replica, switch_weights), INFERENCE_SERVICE)
    server.add_servicer(inference_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(replica), DECODE_SERVICE)
    replica.engine.on_fitness(lambda reason: server.set_unfit("engine", reason))
