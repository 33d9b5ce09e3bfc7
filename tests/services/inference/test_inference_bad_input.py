"""Bad input gets a clear status code, and the replica keeps serving everyone else exactly."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import grpc
import grpc.aio
import pytest

from conftest import WEIGHTS, decode_server, offline, prefill_server
from zerokl.services.engine.types import EngineConfig
from zerokl.services.inference import GenerateResult, InferenceClient, InferenceRequest, KVHeader, ServingLimits
from zerokl.services.inference import convert
from zerokl.services.runtime.errors import handoff_peer
from zerokl.services.runtime import ServiceServer, field_violations, status_details
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, chunk_to_proto, make_chunk, split_bytes
from zerokl.v1 import inference_pb2, inference_pb2_grpc
from zerokl.vocab import SamplingOptions

INVALID, FAILED, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.RESOURCE_EXHAUSTED)
DATA_LOSS, EXISTS = grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ALREADY_EXISTS

# A small cache so that a big n x long request cannot fit (max_model_len stays the model's 512).
CACHE = EngineConfig(num_blocks=64, block_size=16)
LIMITS = ServingLimits(max_n=4)
GOOD = InferenceRequest(prompt_ids=tuple(range(3, 40)), request_id="good",
                        options=SamplingOptions(temperature=0.9, seed=11, max_tokens=60, ignore_eos=True))


def _r(ids=(3, 4, 5), text=None, rid="", wv="", fp="", **opts) -> InferenceRequest:
    opts.setdefault("max_tokens", 2)
    return InferenceRequest(prompt_ids=ids, prompt_text=text, options=SamplingOptions(**opts), request_id=rid,
                            weights_version=wv, numerics_fingerprint=fp)


GENERATE_CASES = [
    ("request id in flight", _r(rid="good"), EXISTS, "already in flight"),  # first: GOOD is surely running
    ("out-of-vocabulary id", _r((3, 64)), INVALID, "outside the vocabulary"),
    ("negative id", _r((-1, 3)), INVALID, "outside the vocabulary"),
    ("empty prompt ids", _r(()), INVALID, "prompt is empty"),
    ("empty prompt text", _r(None, text=""), INVALID, "prompt is empty"),
    ("no prompt", _r(None), INVALID, "set prompt_text or prompt_token_ids"),
    ("prompt longer than the context", _r(tuple([5] * 512)), INVALID, "does not fit the context"),
    ("max_tokens 0", _r(max_tokens=0), INVALID, "max_tokens"),
    ("max_tokens negative", _r(max_tokens=-3), INVALID, "max_tokens"),
    ("top_p 0", _r(top_p=0.0), INVALID, "top_p"),
    ("top_p above 1", _r(top_p=1.5), INVALID, "top_p"),
    ("negative temperature", _r(temperature=-0.5), INVALID, "temperature"),
    ("NaN temperature", _r(temperature=float("nan")), INVALID, "temperature"),
    ("negative top_k", _r(top_k=-1), INVALID, "top_k"),
    ("n 0", _r(n=0), INVALID, "n must be"),
    ("n beyond the limit", _r(n=5), INVALID, "exceeds this replica's limit"),
    ("stop id outside the vocabulary", _r(stop_token_ids=(70,)), INVALID, "stop_token_ids"),
    ("unknown pinned weights", _r(wv="v-nope"), FAILED, "v-nope"),
    ("unknown pinned fingerprint", _r(fp="0123456789abcdef"), FAILED, "0123456789abcdef"),
    ("n samples cannot fit the KV cache", _r(tuple(range(3, 60)) * 2, n=4, max_tokens=380), EXHAUSTED, "KV blocks"),
]


async def _code(coro) -> tuple[grpc.StatusCode, str, grpc.aio.AioRpcError]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code(), err.value.details(), err.value


def _solo(r: InferenceRequest, model) -> GenerateResult:
    return offline(model, r.prompt_ids, r.options)


@pytest.mark.parametrize("via", ["decode", "handoff"])
def test_bad_generate_and_score_requests_get_clear_statuses_while_others_are_served(model, via) -> None:
    async def main() -> None:
        async with decode_server(model, CACHE, limits=LIMITS) as (dsrv, dec), \
                prefill_server(model, CACHE) as (psrv, pre), \
                InferenceClient(dsrv.address) as client, InferenceClient(psrv.address) as prefill:
            pre.limits = LIMITS  # the prefill replica applies the same limit before any work

            async def generate_all(r: InferenceRequest) -> GenerateResult:
                if via == "decode":
                    return await client.generate_all(r)
                return GenerateResult.collect([d async for d in client.generate_from_prefill(r, psrv.address)])

            good = asyncio.ensure_future(generate_all(GOOD))
            while not (dec.engine.in_flight("good") or pre.engine.in_flight("good")):
                await asyncio.sleep(0.005)
            for name, req, code, text in GENERATE_CASES:
                got, details, err = await _code(generate_all(req))
                assert (got, text in details) == (code, True), (name, got, details)
            _, details, err = await _code(generate_all(_r(n=5)))
            assert [v.field for v in field_violations(err)] == ["sampling.n"]
            _, details, err = await _code(generate_all(_r(wv="v-nope")))
            assert status_details(err), "pins are refused with PreconditionFailure details"
            for req, text in ((_r(()), "prompt is empty"), (_r((3, 99)), "outside the vocabulary"),
                              (_r(tuple([5] * 513)), "does not fit the context"), (_r(wv="v-nope"), "v-nope")):
                got, details, _ = await _code((prefill if via == "handoff" else client).score(req))
                assert got in (INVALID, FAILED) and text in details, (got, details)
            # The request that ran through all of that is exactly its solo run, and the next one too.
            assert (await good).samples == _solo(GOOD, model)
            nxt = dataclasses.replace(GOOD, request_id="", options=dataclasses.replace(GOOD.options, max_tokens=3))
            assert (await generate_all(nxt)).samples == _solo(nxt, model)
    asyncio.run(main())


def test_a_decode_replica_with_other_weights_refuses_the_prefill_replicas_kv(model) -> None:
    async def main() -> None:
        async with decode_server(model, weights="other-weights") as (dsrv, _), \
                prefill_server(model) as (psrv, _), InferenceClient(dsrv.address) as client:
            async def generate_all(r: InferenceRequest) -> None:
                _ = [d async for d in client.generate_from_prefill(r, psrv.address)]

            got, details, err = await _code(generate_all(_r(tuple(range(3, 30)))))
            assert got is FAILED and "other-weights" in details and WEIGHTS in details
            assert status_details(err), "the decode replica's PreconditionFailure details"
            assert handoff_peer(err) is None, "a refusal of the decode replica's own"
            # Pinned to what decode serves: the prefill replica refuses, and the status names it.
            got, details, err = await _code(generate_all(_r(wv="other-weights")))
            assert got is FAILED and "other-weights" in details and handoff_peer(err) == psrv.address
    asyncio.run(main())


class _Scripted(inference_pb2_grpc.PrefillServicer):
    """A prefill replica gone wrong: its PrefillKV streams whatever the test scripted."""

    def __init__(self) -> None:
        self.messages: list[inference_pb2.PrefillKVResponse] = []

    async def PrefillKV(self, request, context):  # noqa: ANN001, ANN201
        for m in self.messages:
            yield m


def test_malformed_and_corrupted_kv_streams_are_refused_naming_the_prefill_and_decode_keeps_serving(model) -> None:
    request = _r(tuple(range(3, 45)), temperature=0.0, max_tokens=3, rid="kv")

    async def main() -> None:
        scripted = _Scripted()
        fake = ServiceServer("prefill")
        fake.add_servicer(inference_pb2_grpc.add_PrefillServicer_to_server, scripted, "zerokl.v1.Prefill")
        await fake.start()
        try:
            async with decode_server(model) as (dsrv, dec), prefill_server(model) as (psrv, _), \
                    InferenceClient(psrv.address) as pclient, InferenceClient(dsrv.address) as dclient:
                header, blob = await pclient.prefill_kv(request)

                def head(h: KVHeader = header) -> inference_pb2.PrefillKVResponse:
                    return inference_pb2.PrefillKVResponse(header=convert.kv_header_to_proto(h))

                def chunks(data: bytes = blob, size: int = 8192) -> list:
                    return [inference_pb2.PrefillKVResponse(chunk=chunk_to_proto(c))
                            for c in split_bytes(data, chunk_size=size)]

                async def exchange(messages: list, r: InferenceRequest = request) -> tuple[grpc.StatusCode, str | None]:
                    scripted.messages = messages
                    try:
                        deltas = [d async for d in dclient.generate_from_prefill(r, fake.address)]
                    except grpc.aio.AioRpcError as err:
                        return err.code(), handoff_peer(err)
                    assert GenerateResult.collect(deltas).samples == _solo(request, model)
                    return grpc.StatusCode.OK, None

                flipped = bytearray(blob)
                flipped[len(blob) // 2] ^= 1
                lying = chunks()
                data = bytearray(lying[2].chunk.data)
                data[5] ^= 1
                lying[2].chunk.data = bytes(data)  # one bit changed, the chunk's checksum kept
                other_fp = dataclasses.replace(header, numerics_fingerprint="0000000000000000")
                short = dataclasses.replace(header, num_tokens=header.num_tokens - 1)
                huge = dataclasses.replace(header, total_bytes=1 << 40)
                bad_layout = dataclasses.replace(header, tensors=(header.tensors[1], header.tensors[0],
                                                                  header.tensors[2]))
                other_prompt = dataclasses.replace(header, prompt_ids=(3, 4))
                other_request = dataclasses.replace(header, request_id="someone-else")
                no_first = dataclasses.replace(header, first_token_ids=(), first_logprobs=())
                two_first = dataclasses.replace(header, first_token_ids=header.first_token_ids * 2,
                                                first_logprobs=header.first_logprobs * 2)
                unpaired = dataclasses.replace(header, first_logprobs=())
                out_of_vocab = dataclasses.replace(header, first_token_ids=(model.config.vocab_size,))
                negative = dataclasses.replace(header, first_token_ids=(-1,))
                nan_lp = dataclasses.replace(header, first_logprobs=(float("nan"),))
                inf_lp = dataclasses.replace(header, first_logprobs=(float("-inf"),))
                fault = (DATA_LOSS, fake.address)  # the prefill side's fault: not the client's, not retried blindly
                cases = [
                    ("a chunk's bytes do not match its sha256", [head(), *lying], fault),
                    ("the blob does not match the header's sha256", [head(), *chunks(bytes(flipped))], fault),
                    ("chunk before the header", chunks()[:1], fault),
                    ("two headers", [head(), head()], fault),
                    ("chunk at the wrong offset", [head(), chunks()[1]], fault),
                    ("stream ends before the blob", [head(), *chunks()[:2]], (grpc.StatusCode.UNAVAILABLE,
                                                                             fake.address)),
                    ("oversize chunk", [head(), inference_pb2.PrefillKVResponse(chunk=chunk_to_proto(
                        make_chunk(0, b"\0" * (MAX_CHUNK_BYTES + 1))))], fault),
                    ("KV from another fingerprint", [head(other_fp), *chunks()], (FAILED, None)),
                    ("num_tokens not len(prompt)", [head(short), *chunks()], fault),
                    ("no first token", [head(no_first), *chunks()], fault),
                    ("a first token per sample, twice", [head(two_first), *chunks()], fault),
                    ("a first token without its logprob", [head(unpaired), *chunks()], fault),
                    ("a first token outside the vocabulary", [head(out_of_vocab), *chunks()], fault),
                    ("a negative first token", [head(negative), *chunks()], fault),
                    ("a NaN first logprob", [head(nan_lp), *chunks()], fault),
                    ("a -inf first logprob", [head(inf_lp), *chunks()], fault),
                    ("total size beyond the layouts", [head(huge)], fault),
                    ("tensors out of order", [head(bad_layout), *chunks()], fault),
                    ("the KV of another prompt", [head(other_prompt), *chunks()], fault),
                    ("the KV of another request", [head(other_request), *chunks()], fault),
                ]
                for name, messages, want in cases:
                    assert await exchange(messages) == want, name
                    assert dec.engine.num_in_flight == 0, name
                # A malformed first token is named like any other bad header field.
                for bad, words in ((out_of_vocab, ("kv.first_token_ids", "outside the vocabulary")),
                                   (nan_lp, ("first_logprobs", "finite")), (two_first, ("2 first tokens", "1 samples"))):
                    scripted.messages = [head(bad), *chunks()]
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        _ = [d async for d in dclient.generate_from_prefill(request, fake.address)]
                    assert all(w in err.value.details() for w in words), err.value.details()
                # The same stream, well formed, gives the solo run: decode still serves.
                assert await exchange([head(), *chunks()]) == (grpc.StatusCode.OK, None)
                assert await exchange([head(), *chunks(size=5000)]) == (grpc.StatusCode.OK, None)
                assert hashlib.sha256(blob).digest() == header.sha256
        finally:
            await fake.drain(0)
    asyncio.run(main())
