"""KV handed to a decode replica never poisons its prefix cache (issue 16, finding 4), over real gRPC.

A decode replica reads KV from whatever prefill replica its caller names, and
whoever serves that KV computes its SHA-256: a forged stream checks out. Such
KV serves its own request only: a later request with the same prompt gets
exactly the bits of a clean run. Only when the caller who named the prefill
replica holds the peer token (the scheduler) may the KV be shared through the
prefix cache; with auth on, a client token cannot call GenerateFromPrefill at
all, and the decode replica reads the KV presenting its own peer token.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from typing import AsyncIterator

import grpc
import grpc.aio
import pytest
import torch
from conftest import decode_server, offline, prefill_server

from zerokl.services.inference import InferenceClient, convert
from zerokl.services.inference.types import GenerateResult, InferenceRequest, KVHeader
from zerokl.services.runtime import AuthConfig, ServerOptions, ServiceServer
from zerokl.services.runtime.chunks import chunk_to_proto, split_bytes
from zerokl.v1 import inference_pb2, inference_pb2_grpc
from zerokl.vocab import SamplingOptions

PROMPT = tuple(range(3, 43))          # 40 tokens: the KV of the prompt fills two 16-token blocks (and 8 rows)
REQUEST = InferenceRequest(prompt_ids=PROMPT, options=SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True),
                           request_id="handoff")
LATER = InferenceRequest(prompt_ids=PROMPT, options=SamplingOptions(temperature=1.0, seed=5, max_tokens=4,
                                                                    ignore_eos=True), request_id="later")
AUTH = AuthConfig(client_token="client-t", peer_token="peer-t", operator_token="operator-t")


def _forge(header: KVHeader, blob: bytes) -> tuple[KVHeader, bytes]:
    """The same KV with every latent row shifted, under a freshly computed (so matching) SHA-256."""
    latent = next(t for t in header.tensors if t.name == "latent")
    assert latent.dtype == "float32"
    rows = torch.frombuffer(bytearray(blob[latent.offset:latent.offset + latent.nbytes]), dtype=torch.float32)
    forged = blob[:latent.offset] + (rows + 0.5).numpy().tobytes() + blob[latent.offset + latent.nbytes:]
    assert forged != blob
    return dataclasses.replace(header, sha256=hashlib.sha256(forged).digest()), forged


class _Forger(inference_pb2_grpc.PrefillServicer):
    """A 'prefill replica' serving forged KV, well formed, under a matching checksum; it checks no token."""

    def __init__(self, header: KVHeader, blob: bytes) -> None:
        self.header, self.blob = header, blob

    async def PrefillKV(self, request, context):  # noqa: ANN001, ANN201
        yield inference_pb2.PrefillKVResponse(header=convert.kv_header_to_proto(
            dataclasses.replace(self.header, request_id=request.request.request_id)))
        for chunk in split_bytes(self.blob, chunk_size=4096):
            yield inference_pb2.PrefillKVResponse(chunk=chunk_to_proto(chunk))


@contextlib.asynccontextmanager
async def _forger(header: KVHeader, blob: bytes) -> AsyncIterator[ServiceServer]:
    server = ServiceServer("prefill")
    server.add_servicer(inference_pb2_grpc.add_PrefillServicer_to_server, _Forger(*_forge(header, blob)),
                        "zerokl.v1.Prefill")
    await server.start()
    try:
        yield server
    finally:
        await server.drain(0)


def _bits(result: GenerateResult) -> tuple[list[int], torch.Tensor]:
    s = result.samples[0]
    return list(s.token_ids), torch.tensor(s.logprobs, dtype=torch.float32)


def _assert_clean(model, result: GenerateResult) -> None:
    ref = offline(model, LATER.prompt_ids, LATER.options)[0]
    toks, lps = _bits(result)
    assert toks == list(ref.token_ids)
    assert torch.equal(lps, torch.tensor(ref.logprobs, dtype=torch.float32))


async def _hand_off(client: InferenceClient, prefill: str, request: InferenceRequest = REQUEST) -> GenerateResult:
    return GenerateResult.collect([d async for d in client.generate_from_prefill(request, prefill, timeout=60)])


def test_forged_kv_named_by_an_unauthenticated_caller_never_changes_a_later_request(model) -> None:
    async def main() -> None:
        async with decode_server(model) as (dsrv, _), prefill_server(model) as (psrv, _), \
                InferenceClient(psrv.address) as pclient, InferenceClient(dsrv.address) as dclient:
            header, blob = await pclient.prefill_kv(REQUEST)
            async with _forger(header, blob) as forger:
                forged = await _hand_off(dclient, forger.address)
            honest = offline(model, REQUEST.prompt_ids, REQUEST.options)[0]
            assert forged.samples[0].logprobs != honest.logprobs   # the forgery did change its own request
            later = await dclient.generate_all(LATER, timeout=60)
            assert later.usage.cached_tokens == 0
            _assert_clean(model, later)
    asyncio.run(main())


def test_only_kv_a_peer_asked_for_enters_the_prefix_cache(model) -> None:
    async def main() -> None:
        peers = ServerOptions(auth=AUTH)
        async with decode_server(model, options=peers) as (dsrv, _), \
                prefill_server(model, options=peers) as (psrv, _), InferenceClient(psrv.address, token="peer-t") as \
                pclient, InferenceClient(dsrv.address, token="client-t") as as_client, \
                InferenceClient(dsrv.address, token="operator-t") as as_operator, \
                InferenceClient(dsrv.address, token="peer-t") as as_peer, \
                InferenceClient(psrv.address, token="client-t") as prefill_as_client:
            header, blob = await pclient.prefill_kv(REQUEST)
            # Internal RPCs: a client token reaches neither end of the handoff.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _hand_off(as_client, psrv.address)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await prefill_as_client.prefill_kv(REQUEST)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            # An operator may have a handoff run, but the KV is not a peer's: served, never shared.
            async with _forger(header, blob) as forger:
                await _hand_off(as_operator, forger.address)
            later = await as_client.generate_all(LATER, timeout=60)
            assert later.usage.cached_tokens == 0
            _assert_clean(model, later)
            # A peer's handoff (the decode replica authenticates to the real prefill replica with its own peer
            # token) is shared: the next request reuses its two full blocks, with the same bits.
            await _hand_off(as_peer, psrv.address, dataclasses.replace(REQUEST, request_id="handoff-2"))
            later = await as_client.generate_all(dataclasses.replace(LATER, request_id="later-2"), timeout=60)
            assert later.usage.cached_tokens == 32
            _assert_clean(model, later)
    asyncio.run(main())
