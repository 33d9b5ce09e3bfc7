"""The decode service: ``zerokl.v1.Inference`` (standalone generation) and ``zerokl.v1.Decode``.

``GenerateFromPrefill`` is the decode end of the KV plane: the scheduler
names a prefill replica, this replica reads the prompt's KV straight from it
(``Prefill.PrefillKV``, one server stream of checksummed chunks paced by
HTTP/2 flow control), checks the header before buffering a byte (weights,
numerics and model config must be this replica's; the sizes are then fixed by
the model; one first token per sample, in the vocabulary, with a finite
logprob), verifies every chunk and the whole blob, and generates from the
exact tensors: the first token of each sample (drawn by the prefill replica
with the request's sampling key) is emitted at once, the rest computed here.
The scheduler sees only the request and the tokens.

Trust: this replica presents the peer token to the prefill replica, and the
KV may enter its prefix cache only when the caller who named the prefill
replica is itself a peer (the scheduler); anyone else's handoff (an operator,
or any caller with auth off) serves its own request and is never shared.

Failures of the prefill side are reported with an ErrorInfo (reason
``KV_HANDOFF``, metadata ``prefill``) so the scheduler retries with another
prefill replica instead of blaming this one; a read that outlives the handoff
timeout ends as UNAVAILABLE, so nothing waits forever on a stuck prefill.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from types import ModuleType
from typing import TYPE_CHECKING, AsyncIterator

import grpc
import grpc.aio
from opentelemetry import trace

from zerokl.services.inference import convert
from zerokl.services.inference.client import InferenceClient
from zerokl.services.engine.types import KVHandoff
from zerokl.services.inference.replica import Replica
from zerokl.services.inference.service import INFERENCE_SERVICE, InferenceServicer
from zerokl.services.inference.types import GenerateDelta, InferenceRequest, KVHeader, ScoreResult, SleepState, Usage
from zerokl.services.runtime import metrics as runtime_metrics
from zerokl.services.runtime.auth import Role, caller_role
from zerokl.services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    InvalidArgument,
    RelayedError,
    ServiceError,
    handoff_error_info,
)
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.runtime.server import ServiceServer, stream_out
from zerokl.services.runtime.streams import unless_set
from zerokl.services.runtime.tracing import tag_request
from zerokl.v1 import inference_pb2, inference_pb2_grpc
from zerokl.vocab import SamplingOptions

if TYPE_CHECKING:    # both hold tensors (torch): loaded where a trace or a handoff is read (see _kv_wire)
    from zerokl.kernels.trace import Trace
    from zerokl.services.inference.kv import KVReceiver

__all__ = ["DECODE_SERVICE", "DEFAULT_HANDOFF_TIMEOUT_S", "Decoder", "DecodeServicer", "add_decode_service"]

DECODE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
DEFAULT_HANDOFF_TIMEOUT_S = 300.0

# Prefill-side statuses the scheduler should answer by trying another prefill replica.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class _HandoffFailed(ServiceError):
    """The prefill side of a handoff failed here (bad stream, corrupt blob): names the prefill replica."""

    def __init__(self, code: grpc.StatusCode, message: str, prefill: str) -> None:
        super().__init__(f"KV handoff from prefill replica {prefill}: {message}")
        self.code = code
        self.prefill = prefill

    def to_status(self):  # noqa: ANN201 - google.rpc.Status
        status = super().to_status()
        status.details.append(handoff_error_info(self.prefill))
        return status


class Decoder:
    """The decode replica's backend: local generation, and generation from a prefill replica's KV.

    ``token`` and ``credentials`` are what it presents to prefill replicas (the peer token,
    TLS), traced with ``tracer_provider``; ``handoff_timeout_s`` bounds one KV read when the caller names no bound.
    """

    def __init__(self, replica: Replica, *, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 tracer_provider: trace.TracerProvider | None = None,
                 handoff_timeout_s: float = DEFAULT_HANDOFF_TIMEOUT_S) -> None:
        self.replica = replica
        self.handoff_timeout_s = handoff_timeout_s
        self._token = token
        self._credentials = credentials
        self._tracer_provider = tracer_provider
        self._prefills: dict[str, InferenceClient] = {}   # address -> client, reused across handoffs
        self._reading: dict[str, asyncio.Event] = {}      # request id -> set by Abort while its KV is read

    @property
    def identity(self) -> ServiceIdentity:
        return self.replica.identity

    def generate(self, r: InferenceRequest) -> AsyncIterator[GenerateDelta]:
        return self.replica.generate(r)

    async def score(self, r: InferenceRequest) -> ScoreResult:
        return await self.replica.score(r)

    async def trace(self, ids: tuple[int, ...], options: SamplingOptions, capture: tuple[str, ...]) -> Trace:
        return await self.replica.trace(ids, options, capture)

    async def sleep(self, level: int) -> SleepState:
        return await self.replica.sleep(level)

    async def wake(self) -> SleepState:
        return await self.replica.wake()

    def abort(self, request_id: str) -> bool:
        """Abort a request: while its KV is read, or in the engine after."""
        event = self._reading.get(request_id)
        if event is not None:
            event.set()
            return True
        return self.replica.abort(request_id)

    async def close(self) -> None:
        for client in self._prefills.values():
            await client.close()
        self._prefills.clear()

    async def generate_from_prefill(self, r: InferenceRequest, prefill: str,
                                    handoff_timeout_s: float | None = None) -> AsyncIterator[GenerateDelta]:
        """Read ``r``'s prompt KV from the prefill replica at ``prefill``, then generate from it here."""
        replica = self.replica
        if not prefill:
            raise InvalidArgument.field("prefill_address", "name the prefill replica to read the KV from")
        replica.check_pins(r)
        rid = r.request_id or replica.new_request_id()
        if rid in self._reading or replica.engine.in_flight(rid):
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        r = dataclasses.replace(r, request_id=rid)
        tag_request(rid)
        trusted = caller_role() is Role.PEER   # the peer that named the prefill replica vouches for it
        aborted = self._reading[rid] = asyncio.Event()
        try:
            read = await unless_set(self._read_kv(r, prefill, handoff_timeout_s or self.handoff_timeout_s, trusted),
                                    aborted)
        finally:
            del self._reading[rid]
        if read is None:   # aborted while reading: every sample ends now
            n = len(r.prompt_ids or ())
            for index in range(r.options.n):
                yield GenerateDelta(rid, index, (), (), finish_reason="abort", usage=Usage(n, 0, 0),
                                    weights_version=self.identity.weights_version,
                                    numerics_fingerprint=self.identity.numerics_fingerprint)
            return
        header, handoff = read
        r = dataclasses.replace(r, prompt_ids=header.prompt_ids, prompt_text=None)
        deltas = replica.generate_from_handoff(r, header.prompt_ids, handoff,
                                               header.prompt_logprobs, header.num_cached_tokens,
                                               header.weights_version)
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]

    async def _read_kv(self, r: InferenceRequest, prefill: str, timeout_s: float,
                       trusted: bool) -> tuple[KVHeader, KVHandoff]:
        """The checked header and the complete, verified blob of ``r``'s prompt KV from ``prefill``."""
        replica = self.replica
        started = time.perf_counter()
        kv = await asyncio.to_thread(_kv_wire)
        client = self._client(prefill)
        receiver: KVReceiver | None = None
        stream = client.prefill_kv_stream(r, timeout=timeout_s)
        try:
            async for item in stream:
                if receiver is None:
                    assert isinstance(item, KVHeader)
                    header = item
                    if r.prompt_ids is not None and tuple(r.prompt_ids) != header.prompt_ids:
                        raise _HandoffFailed(grpc.StatusCode.DATA_LOSS, "its KV is of another prompt", prefill)
                    if header.request_id != r.request_id:
                        raise _HandoffFailed(grpc.StatusCode.DATA_LOSS,
                                             f"its KV is of request {header.request_id!r}", prefill)
                    # Refused before a byte is buffered: a checked header also bounds the blob's size. Other
                    # weights or numerics are a state (FAILED_PRECONDITION); a malformed header is a fault.
                    try:
                        kv.check_header(header, replica.identity, replica.model_config, replica.dtype,
                                     replica.max_model_len, r.options.n)
                    except InvalidArgument as err:
                        raise _HandoffFailed(grpc.StatusCode.DATA_LOSS, f"a malformed KV header: {err.message}",
                                             prefill) from None
                    replica.check_generate(header.prompt_ids, r.options)
                    receiver = kv.KVReceiver(header, shared=replica.engine.in_process)
                else:
                    try:
                        receiver.add(item)   # offset, size and checksum: the prefill side's fault if bad
                    except (InvalidArgument, DataLoss) as err:
                        raise _HandoffFailed(grpc.StatusCode.DATA_LOSS, err.message, prefill) from None
        except grpc.aio.AioRpcError as err:
            code = grpc.StatusCode.UNAVAILABLE if err.code() in _RETRYABLE else None
            raise RelayedError(err, f"KV handoff from prefill replica {prefill}", code, handoff_from=prefill) from None
        except DataLoss as err:   # a malformed stream (no header, a second header)
            raise _HandoffFailed(grpc.StatusCode.DATA_LOSS, err.message, prefill) from None
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        if receiver is None or not receiver.complete:
            got = 0 if receiver is None else receiver.received
            raise _HandoffFailed(grpc.StatusCode.UNAVAILABLE, f"the stream ended after {got} KV bytes", prefill)
        try:
            handoff = receiver.handoff(trusted)   # the whole blob's sha256, before generating
        except DataLoss as err:
            raise _HandoffFailed(grpc.StatusCode.DATA_LOSS, err.message, prefill) from None
        runtime_metrics.KV_HANDOFF_BYTES.labels("received").inc(receiver.received)
        runtime_metrics.KV_HANDOFF_SECONDS.observe(time.perf_counter() - started)
        return receiver.header, handoff

    def _client(self, address: str) -> InferenceClient:
        client = self._prefills.get(address)
        if client is None:
            client = self._prefills[address] = InferenceClient(address, token=self._token,
                                                               credentials=self._credentials,
                                                               tracer_provider=self._tracer_provider)
        return client


def _kv_wire() -> ModuleType:
    """:mod:`zerokl.services.inference.kv`, which makes the KV's tensors (torch, the numerics library).

    A decode replica whose engine runs in a child process loads torch only here, at its first handoff
    (called off the event loop: the import takes seconds, and the streams it serves go on meanwhile);
    local generation needs none.
    """
    from zerokl.services.inference import kv
    return kv


class DecodeServicer(inference_pb2_grpc.DecodeServicer):
    """Serves ``zerokl.v1.Decode`` from a :class:`Decoder`."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder

    async def GenerateFromPrefill(self, request: inference_pb2.GenerateFromPrefillRequest,
                                  context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateResponse]:
        deltas = self._decoder.generate_from_prefill(convert.request_from_proto(request.request),
                                                     request.prefill_address,
                                                     request.handoff_timeout_ms / 1000 or None)
        async for msg in stream_out(deltas, convert.delta_to_proto):
            yield msg


def add_decode_service(server: ServiceServer, decoder: Decoder, switch_weights=None) -> None:  # noqa: ANN001
    """Serve ``zerokl.v1.Inference`` and ``zerokl.v1.Decode`` from ``decoder`` (before the server starts).

    ``switch_weights`` (a :meth:`WeightSwitcher.switch`) serves SwitchWeights. Health is
    NOT_SERVING while the replica's engine cannot serve (:meth:`AsyncEngine.on_fitness`).
    """
    server.add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server,
                        InferenceServicer(decoder, switch_weights), INFERENCE_SERVICE)
    server.add_servicer(inference_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(decoder), DECODE_SERVICE)
    decoder.replica.engine.on_fitness(lambda reason: server.set_unfit("engine", reason))
