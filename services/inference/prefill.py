"""The prefill service: ``zerokl.v1.Inference`` and ``zerokl.v1.Prefill``.

A prefill replica reads prompts. For ``Generate`` it builds the prompt's KV in
its own engine (prefill mode: every prompt position but the last), hands the
exact bytes to a decode replica over ``Decode.GenerateFromKV`` and relays that
stream back; the decode replica checks that the KV was computed with its own
weights, numerics and model config, so the client gets the tokens a decode
replica alone would have produced, bit for bit. ``Score`` and ``PrefillKV``
(the KV itself, for a scheduler that pairs replicas) are served locally.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import AsyncIterator

import grpc
import grpc.aio

from zerokl.kernels.trace import Trace
from zerokl.services.engine.types import SamplingOptions
from zerokl.services.inference import convert
from zerokl.services.inference.async_engine import LatencyTracker
from zerokl.services.inference.client import InferenceClient
from zerokl.services.inference.errors import Cancelled, RelayedError
from zerokl.services.inference.kv import handoff_to_blob
from zerokl.services.inference.replica import Replica
from zerokl.services.inference.service import INFERENCE_SERVICE, InferenceServicer
from zerokl.services.inference.types import GenerateDelta, InferenceRequest, KVHeader, ScoreResult, Usage
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, chunk_to_proto, split_bytes
from zerokl.services.runtime.errors import AlreadyExists, FailedPrecondition
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.runtime.server import ServiceServer
from zerokl.services.runtime.tracing import tag_request
from zerokl.v1 import inference_pb2, inference_pb2_grpc

__all__ = ["PREFILL_SERVICE", "PrefillRelay", "PrefillServicer", "add_prefill_service"]

log = logging.getLogger(__name__)

PREFILL_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillRelay:
    """The prefill replica's Inference backend: prefill here, generate on a decode replica.

    ``decode`` is the client of the decode replica (None: Generate is refused
    with FAILED_PRECONDITION; Score and PrefillKV still work). ``chunk_bytes``
    sizes the KV chunks sent to it.
    """

    def __init__(self, replica: Replica, decode: InferenceClient | None,
                 chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        self.replica = replica
        self.decode = decode
        self.chunk_bytes = chunk_bytes
        self._relays: dict[str, asyncio.Event] = {}   # request id -> set by Abort

    @property
    def identity(self) -> ServiceIdentity:
        return self.replica.identity

    async def prefill(self, r: InferenceRequest, ids: tuple[int, ...] | None = None, *,
                      generating: bool = False) -> tuple[KVHeader, bytes] | None:
        """The KV of ``r``'s prompt (``ids`` when already tokenized) as a header and a blob.

        None when the request was aborted meanwhile. With ``generating`` the
        generate-only rules apply too (n, KV fit, room for a new token), so a
        request the decode replica would refuse fails here before any work.
        """
        replica = self.replica
        replica.check_pins(r)
        if ids is None:
            ids = replica.prompt_ids(r)
        if generating and ids:
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
        """Prefill here, then relay the decode replica's stream for the same request."""
        if self.decode is None:
            raise FailedPrecondition("this prefill replica has no decode replica configured (--decode); "
                                     "Generate needs one")
        rid = r.request_id or self.replica.new_request_id()
        if rid in self._relays or self.replica.engine.in_flight(rid):
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        self.replica.check_pins(r)
        ids = self.replica.prompt_ids(r)
        # The decode replica reads the prompt as ids from the KV header.
        r = dataclasses.replace(r, request_id=rid, prompt_ids=ids, prompt_text=None)
        aborted = self._relays[rid] = asyncio.Event()
        latency = LatencyTracker()
        finished: set[int] = set()
        usage: dict[int, Usage] = {}
        try:
            prefilled = await self.prefill(r, ids, generating=True)
            if prefilled is not None and not aborted.is_set():
                header, blob = prefilled
                stream = self.decode.generate_from_kv(r, header, blob, chunk_bytes=self.chunk_bytes)
                try:
                    async for delta in _until(stream, aborted):
                        latency.tokens(delta.index, len(delta.token_ids))
                        if delta.finish_reason is not None:
                            finished.add(delta.index)
                        usage[delta.index] = delta.usage
                        yield delta
                except grpc.aio.AioRpcError as err:
                    raise RelayedError(err, f"decode replica {self.decode.target}") from None
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
            # Aborted (here, before or during the relay): every unfinished sample ends now.
            for index in range(r.options.n):
                if index not in finished:
                    yield GenerateDelta(rid, index, (), (), finish_reason="abort",
                                        usage=usage.get(index, Usage(len(ids), 0, 0)),
                                        weights_version=self.identity.weights_version,
                                        numerics_fingerprint=self.identity.numerics_fingerprint)
        finally:
            latency.done()
            del self._relays[rid]

    async def score(self, r: InferenceRequest) -> ScoreResult:
        return await self.replica.score(r)

    async def trace(self, ids: tuple[int, ...], options: SamplingOptions, capture: tuple[str, ...]) -> Trace:
        return await self.replica.trace(ids, options, capture)

    def abort(self, request_id: str) -> bool:
        """Abort a relayed request: in this engine while prefilling, by ending the relay after."""
        found = self.replica.abort(request_id)
        event = self._relays.get(request_id)
        if event is not None:
            event.set()
            found = True
        return found


async def _until(stream: AsyncIterator[GenerateDelta], stop: asyncio.Event) -> AsyncIterator[GenerateDelta]:
    """Items of ``stream`` until it ends or ``stop`` is set (checked while waiting for each item)."""
    it = aiter(stream)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                try:
                    await nxt  # let the cancelled read unwind before the caller closes the stream
                except (asyncio.CancelledError, StopAsyncIteration):
                    pass
                return
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopper.cancel()


class PrefillServicer(inference_pb2_grpc.PrefillServicer):
    """Serves ``zerokl.v1.Prefill`` from a :class:`PrefillRelay`."""

    def __init__(self, relay: PrefillRelay) -> None:
        self._relay = relay

    async def PrefillKV(self, request: inference_pb2.PrefillKVRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.PrefillKVResponse]:
        r = convert.request_from_proto(request.request)
        tag_request(r.request_id)
        # The KV is only good for GenerateFromKV: the generate rules (room for a new token,
        # n, KV fit) refuse before any prefill work what the decode replica would refuse after.
        prefilled = await self._relay.prefill(r, generating=True)
        if prefilled is None:
            raise Cancelled(f"request {r.request_id!r} was aborted during prefill")
        header, blob = prefilled
        yield inference_pb2.PrefillKVResponse(header=convert.kv_header_to_proto(header))
        for chunk in split_bytes(blob, chunk_size=self._relay.chunk_bytes):
            yield inference_pb2.PrefillKVResponse(chunk=chunk_to_proto(chunk))


def add_prefill_service(server: ServiceServer, relay: PrefillRelay,
                        switch_weights=None) -> None:  # noqa: ANN001
    """Serve ``zerokl.v1.Inference`` and ``zerokl.v1.Prefill`` from ``relay`` (before the server starts).

    ``switch_weights`` (a :meth:`WeightSwitcher.switch`) serves SwitchWeights. Health is
    NOT_SERVING while the replica's engine cannot serve (:meth:`AsyncEngine.on_fitness`).
    """
    server.add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server,
                        InferenceServicer(relay, switch_weights), INFERENCE_SERVICE)
    server.add_servicer(inference_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(relay), PREFILL_SERVICE)
    relay.replica.engine.on_fitness(lambda reason: server.set_unfit("engine", reason))
