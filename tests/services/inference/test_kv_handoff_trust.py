"""KV handed to a decode replica never poisons its prefix cache (issue 16, finding 4), over real gRPC.

Anyone who can reach GenerateFromKV can send KV with a matching SHA-256 (the
sender computes it). Such KV serves its own request only: a later request with
the same prompt gets exactly the bits of a clean run. Only KV from a caller
holding the peer token may be shared through the prefix cache, and with auth on
a client token cannot call GenerateFromKV at all.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import grpc
import grpc.aio
import pytest
import torch
from conftest import decode_server, offline, prefill_server

from zerokl.services.engine.types import SamplingOptions
from zerokl.services.inference import InferenceClient
from zerokl.services.inference.types import GenerateResult, InferenceRequest, KVHeader
from zerokl.services.runtime import AuthConfig, ServerOptions

PROMPT = tuple(range(3, 43))          # 40 tokens: the KV of prompt[:-1] fills two 16-token blocks
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


def _bits(result: GenerateResult) -> tuple[list[int], torch.Tensor]:
    s = result.samples[0]
    return list(s.token_ids), torch.tensor(s.logprobs, dtype=torch.float32)


def _assert_clean(model, result: GenerateResult) -> None:
    ref = offline(model, LATER.prompt_ids, LATER.options)[0]
    toks, lps = _bits(result)
    assert toks == list(ref.token_ids)
    assert torch.equal(lps, torch.tensor(ref.logprobs, dtype=torch.float32))


async def _hand_off(client: InferenceClient, header: KVHeader, blob: bytes) -> GenerateResult:
    return GenerateResult.collect([d async for d in client.generate_from_kv(REQUEST, header, blob, timeout=60)])


def test_forged_kv_from_an_unauthenticated_sender_never_changes_a_later_request(model) -> None:
    async def main() -> None:
        async with decode_server(model) as (dsrv, _), prefill_server(model, None) as (psrv, _), \
                InferenceClient(psrv.address) as pclient, InferenceClient(dsrv.address) as dclient:
            header, blob = await pclient.prefill_kv(REQUEST)
            forged = await _hand_off(dclient, *_forge(header, blob))
            honest = offline(model, REQUEST.prompt_ids, REQUEST.options)[0]
            assert forged.samples[0].logprobs != honest.logprobs   # the forgery did change its own request
            later = await dclient.generate_all(LATER, timeout=60)
            assert later.usage.cached_tokens == 0
            _assert_clean(model, later)
    asyncio.run(main())


def test_only_a_peers_kv_enters_the_prefix_cache(model) -> None:
    async def main() -> None:
        async with decode_server(model, options=ServerOptions(auth=AUTH)) as (dsrv, _), \
                prefill_server(model, None) as (psrv, _), InferenceClient(psrv.address) as pclient, \
                InferenceClient(dsrv.address, token="client-t") as as_client, \
                InferenceClient(dsrv.address, token="operator-t") as as_operator, \
                InferenceClient(dsrv.address, token="peer-t") as as_peer:
            header, blob = await pclient.prefill_kv(REQUEST)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _hand_off(as_client, header, blob)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            # An operator may hand KV over, but it is not a peer's: served, never shared.
            await _hand_off(as_operator, *_forge(header, blob))
            later = await as_client.generate_all(LATER, timeout=60)
            assert later.usage.cached_tokens == 0
            _assert_clean(model, later)
            # A peer's KV is shared: the next request reuses its two full blocks, with the same bits.
            await _hand_off(as_peer, header, blob)
            later = await as_client.generate_all(dataclasses.replace(LATER, request_id="later-2"), timeout=60)
            assert later.usage.cached_tokens == 32
            _assert_clean(model, later)
    asyncio.run(main())
