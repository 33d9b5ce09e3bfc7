"""The prefill and decode services over real loopback gRPC, against the engine run offline.

Exact equality throughout: token ids, fp32 logprob floats, text and finish
reasons of every sample, whatever else the server is doing.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import socket

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import (
    TOKENIZER,
    WEIGHTS,
    decode_server,
    offline,
    offline_score,
    prefill_server,
    prompt,
)
from zerokl.kernels import fingerprint, log_softmax
from zerokl.services.engine.types import EngineConfig
from zerokl.services.inference import GenerateResult, InferenceClient, InferenceRequest
from zerokl.services.runtime.errors import handoff_peer
from zerokl.services.runtime import metrics
from zerokl.services.runtime.info import model_config_hash
from zerokl.vocab import SamplingOptions

FP = fingerprint()


def _req(ids=None, text=None, **opts) -> InferenceRequest:
    opts.setdefault("ignore_eos", True)
    return InferenceRequest(prompt_ids=ids, prompt_text=text, options=SamplingOptions(**opts))


def _assert_same(got: GenerateResult, ids: tuple[int, ...], options: SamplingOptions, model) -> None:
    want = offline(model, ids, options)
    assert got.samples == want
    assert (got.weights_version, got.numerics_fingerprint) == (WEIGHTS, FP)
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == sum(len(s.token_ids) for s in want)


def _metric(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_generate_stream_equals_the_engine_run_offline(model) -> None:
    rng = random.Random(0)
    greedy = _req(prompt(rng, 30, 40), temperature=0.0, max_tokens=8, prompt_logprobs=True)
    seeded = _req(prompt(rng, 20, 30), temperature=0.8, top_p=0.9, top_k=10, seed=7, n=3, max_tokens=6)
    text = _req(text="nums 3 4 7 target 28\n", temperature=1.0, seed=3, max_tokens=10)

    async def main() -> None:
        ttft, tokens = _metric("zerokl_time_to_first_token_seconds_count"), _metric("zerokl_generation_tokens_total")
        async with decode_server(model) as (server, replica), InferenceClient(server.address) as client:
            for r in (greedy, seeded):
                deltas = [d async for d in client.generate(r)]
                # Every response names what computed it; usage counts each sample's tokens so far.
                assert all((d.weights_version, d.numerics_fingerprint) == (WEIGHTS, FP) for d in deltas)
                seen: dict[int, int] = {}
                for d in deltas:
                    seen[d.index] = seen.get(d.index, 0) + len(d.token_ids)
                    assert d.usage.completion_tokens == seen[d.index]
                assert [d.prompt_logprobs is not None for d in deltas] == \
                    [i == 0 and r.options.prompt_logprobs for i in range(len(deltas))]
                _assert_same(GenerateResult.collect(deltas), r.prompt_ids, r.options, model)
            got = await client.generate_all(text)
            ids = tuple(TOKENIZER.encode(text.prompt_text))
            _assert_same(got, ids, text.options, model)
            # Ids past the tokenizer's 34 (the tiny model has 64) carry no text.
            assert got.samples[0].text == TOKENIZER.decode([t for t in got.samples[0].token_ids if t < 34])
            # A stop string cuts the text and ends the sample with "stop", as offline.
            full = got.samples[0].text
            if len(full) >= 4:
                stop = full[2:4]
                r = dataclasses.replace(text, options=dataclasses.replace(text.options, stop=(stop,)))
                stopped = await client.generate_all(r)
                _assert_same(stopped, ids, r.options, model)
                assert stopped.samples[0].finish_reason == "stop" and stop not in stopped.samples[0].text
            assert replica.engine.num_in_flight == 0
        # The zerokl_ serving metrics moved with the work (one TTFT per request).
        assert _metric("zerokl_time_to_first_token_seconds_count") >= ttft + 3
        assert _metric("zerokl_generation_tokens_total") >= tokens + 8 + 18 + 10
        assert _metric("zerokl_num_requests_running") == 0.0
    asyncio.run(main())


def test_concurrent_clients_with_random_neighbours_get_their_solo_output(model) -> None:
    rng = random.Random(1)
    shared = prompt(rng, 40, 40)  # neighbours share a prefix with the target: prefix-cache hits
    target = _req(shared + prompt(rng, 5, 10), temperature=1.0, top_p=0.95, seed=1234, max_tokens=8)
    neighbours = []
    for i in range(10):
        ids = shared[: rng.randint(16, 40)] + prompt(rng, 1, 20) if i % 2 else prompt(rng, 3, 60)
        neighbours.append(_req(ids, temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                               top_k=rng.choice([0, 5]), seed=rng.randrange(1000), max_tokens=rng.randint(1, 8),
                               n=rng.choice([1, 1, 2])))
    requests = [target, *neighbours]
    delays = [rng.uniform(0, 0.3) for _ in requests]
    # A small step budget and small blocks: chunked prefill, many mixed batches.
    busy = EngineConfig(max_num_batched_tokens=24, block_size=8, num_blocks=256)

    async def main() -> None:
        async with decode_server(model, busy) as (server, _), InferenceClient(server.address) as client:
            async def one(r: InferenceRequest, delay: float) -> GenerateResult:
                await asyncio.sleep(delay)
                return await client.generate_all(r)
            results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays, strict=True)))
        for r, got in zip(requests, results, strict=True):
            _assert_same(got, r.prompt_ids, r.options, model)
        assert any(got.usage.cached_tokens > 0 for got in results), "no request hit the prefix cache"
    asyncio.run(main())


def test_prefill_to_decode_handoff_equals_decode_alone(model) -> None:
    rng = random.Random(2)
    seeded = _req(prompt(rng, 40, 60), temperature=0.9, top_k=20, seed=99, n=2, max_tokens=6, prompt_logprobs=True)
    text = _req(text="nums 1 2 3 target 6\n", temperature=0.0, max_tokens=6)
    one_token = _req((7,), temperature=0.0, max_tokens=4)   # one position of KV, and the first token
    c = model.config

    async def main() -> None:
        async with decode_server(model, EngineConfig(block_size=8)) as (dsrv, _), \
                prefill_server(model, EngineConfig(max_num_batched_tokens=16), chunk_bytes=1000) as (psrv, _), \
                InferenceClient(psrv.address) as prefill, InferenceClient(dsrv.address) as decode:
            for r in (seeded, text, one_token):
                ids = r.prompt_ids or tuple(TOKENIZER.encode(r.prompt_text))
                received = _metric('zerokl_kv_handoff_bytes_total', direction="received")
                got = GenerateResult.collect([d async for d in decode.generate_from_prefill(r, psrv.address)])
                _assert_same(got, ids, r.options, model)
                # The decode replica read the KV of the whole prompt from the prefill replica: exactly its bytes.
                assert _metric('zerokl_kv_handoff_bytes_total', direction="received") - received == \
                    len(ids) * c.num_hidden_layers * 4 * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim)
            # What PrefillKV streams: a header and the exact bytes, in 1000-byte chunks.
            header, blob = await prefill.prefill_kv(dataclasses.replace(seeded, request_id="by-hand"))
            assert header.num_tokens == len(seeded.prompt_ids) and header.request_id == "by-hand"
            # ... and each sample's first token, with its logprob: the ones the local run draws.
            want = offline(model, seeded.prompt_ids, seeded.options)
            assert header.first_token_ids == tuple(w.token_ids[0] for w in want)
            assert header.first_logprobs == tuple(w.logprobs[0] for w in want)
            assert len(blob) == header.total_bytes == header.num_tokens * c.num_hidden_layers * 4 * (
                c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim)
            # Score on the prefill replica is the engine's score.
            ids = prompt(rng, 20, 50)
            scored = await prefill.score(InferenceRequest(prompt_ids=ids))
            assert list(scored.logprobs) == offline_score(model, ids) and scored.token_ids == ids
    asyncio.run(main())


def test_handoff_first_tokens_are_the_local_draws_bit_for_bit(model) -> None:
    """The prefill replica draws every sample's first token; the decode replica emits it and goes on.

    Tokens and fp32 logprobs of every sample equal a local run's (torch.equal on the logprobs), for
    n > 1, temperature, top-k / top-p, max_tokens 1, a first token that is a stop id, prompts of 15,
    16 and 17 tokens (the 16-token block boundary of both replicas) and a prompt whose first two
    blocks the prefill replica takes from its prefix cache.
    """
    rng = random.Random(11)
    shared = prompt(rng, 40, 40)
    requests = []
    for length in (15, 16, 17):
        ids = prompt(rng, length, length)
        requests.append(_req(ids, temperature=1.0, top_p=0.9, seed=5, n=3, max_tokens=4))
        requests.append(_req(ids, temperature=0.8, top_k=7, seed=6, n=2, max_tokens=1))
    requests.append(_req(shared + (5, 6), temperature=0.9, top_p=0.85, seed=8, n=2, max_tokens=3))
    probe = offline(model, requests[0].prompt_ids, requests[0].options)
    stop = dataclasses.replace(requests[0].options, stop_token_ids=(probe[1].token_ids[0],), max_tokens=5)
    requests.append(_req(requests[0].prompt_ids, **dataclasses.asdict(stop)))

    async def main() -> None:
        async with decode_server(model) as (dsrv, _), prefill_server(model) as (psrv, _), \
                InferenceClient(dsrv.address) as decode, InferenceClient(psrv.address) as prefill:
            await prefill.prefill_kv(_req(shared + (9,), temperature=0.0))      # fills the prefix cache
            results = []
            for r in requests:
                got = GenerateResult.collect([d async for d in decode.generate_from_prefill(r, psrv.address)])
                want = offline(model, r.prompt_ids, r.options)
                assert [s.token_ids for s in got.samples] == [w.token_ids for w in want]
                for s, w in zip(got.samples, want, strict=True):
                    assert torch.equal(torch.tensor(s.logprobs), torch.tensor(w.logprobs))
                    assert s.finish_reason == w.finish_reason
                _assert_same(got, r.prompt_ids, r.options, model)
                results.append((got, want))
            assert results[-2][0].usage.cached_tokens == 32                     # the prefix-cache hit
            assert [len(s.token_ids) for s in results[1][0].samples] == [1, 1]  # max_tokens 1
            stopped = results[-1][1][1]                                         # sample 1 stops on its first token
            assert stopped.finish_reason == "stop" and stopped.token_ids == [probe[1].token_ids[0]]
    asyncio.run(main())


def test_score_equals_the_engine_and_the_training_forward(model) -> None:
    rng = random.Random(3)
    ids = prompt(rng, 30, 50)
    spec = SamplingOptions(temperature=0.7, top_k=10, top_p=0.9)

    async def main() -> None:
        async with decode_server(model) as (server, _), InferenceClient(server.address) as client:
            plain = await client.score(InferenceRequest(prompt_ids=ids))
            filtered = await client.score(InferenceRequest(prompt_ids=ids, options=spec))
            text = await client.score(InferenceRequest(prompt_text="nums 5 6 target 11"))
        assert list(plain.logprobs) == offline_score(model, ids)
        assert list(filtered.logprobs) == offline_score(model, ids, spec)
        assert plain.logprobs != filtered.logprobs
        # Zero KL at the model level: the trainer's full-sequence forward gives the same floats.
        with torch.no_grad():
            full = log_softmax(model(torch.tensor([ids]))[0, :-1]).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.equal(torch.tensor(plain.logprobs), full)
        assert text.token_ids == tuple(TOKENIZER.encode("nums 5 6 target 11"))
        assert (plain.weights_version, plain.numerics_fingerprint) == (WEIGHTS, FP)
    asyncio.run(main())


def test_abort_and_cancel_mid_stream_free_the_request(model) -> None:
    long = _req(tuple(range(3, 30)), temperature=1.0, seed=5, max_tokens=300, n=2)
    short = _req(tuple(range(5, 25)), temperature=0.0, max_tokens=4)

    async def main() -> None:
        async with decode_server(model) as (dsrv, dec), prefill_server(model) as (psrv, _), \
                InferenceClient(dsrv.address) as client:
            for rid, generate in (("abort-direct", client.generate),
                                  ("abort-handoff", lambda r: client.generate_from_prefill(r, psrv.address))):
                deltas = []
                async for d in generate(dataclasses.replace(long, request_id=rid)):
                    deltas.append(d)
                    if len(deltas) == 3:
                        assert await client.abort(rid)
                got = GenerateResult.collect(deltas)
                assert [s.finish_reason for s in got.samples] == ["abort", "abort"]
                assert 0 < got.usage.completion_tokens < 2 * 300
                # Sampling is keyed by (seed, sample, position): what came before the abort is
                # exactly the start of the solo run.
                k = max(len(s.token_ids) for s in got.samples)
                want = offline(model, long.prompt_ids, dataclasses.replace(long.options, max_tokens=k))
                for s, w in zip(got.samples, want, strict=True):
                    assert (s.token_ids, s.logprobs) == (w.token_ids[:len(s.token_ids)], w.logprobs[:len(s.token_ids)])
                assert not await client.abort(rid)
            # A client that goes away cancels its request in the engine.
            stream = client.generate(dataclasses.replace(long, request_id="walks-away"))
            await anext(stream)
            await stream.aclose()
            for _ in range(200):
                if not dec.engine.in_flight("walks-away"):
                    break
                await asyncio.sleep(0.01)
            assert not dec.engine.in_flight("walks-away")
            # Still serving, with the same numbers.
            _assert_same(await client.generate_all(short), short.prompt_ids, short.options, model)
            assert dec.engine.num_in_flight == 0
    asyncio.run(main())


def test_info_health_and_reflection(model) -> None:
    async def main() -> None:
        async with decode_server(model) as (dsrv, _), prefill_server(model) as (psrv, _):
            for srv, service, extra in ((dsrv, "decode", "zerokl.v1.Decode"), (psrv, "prefill", "zerokl.v1.Prefill")):
                async with InferenceClient(srv.address) as client:
                    info = await client.info()
                    assert (info.service, info.weights_version, info.numerics_fingerprint) == (service, WEIGHTS, FP)
                    assert info.model_config_hash == model_config_hash(model.config.to_dict())
                    assert info.numerics_version and info.backend and info.device and info.dtype == "float32"
                    health = health_pb2_grpc.HealthStub(client.channel)
                    for name in ("", "zerokl.v1.Inference", extra):
                        resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
                        assert resp.status == health_pb2.HealthCheckResponse.SERVING
                    call = reflection_pb2_grpc.ServerReflectionStub(client.channel).ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                    names = {s.name async for r in call for s in r.list_services_response.service}
                    assert {"zerokl.v1.Inference", extra, "grpc.health.v1.Health"} <= names
    asyncio.run(main())


def test_a_prefill_replica_does_not_generate_and_a_dead_or_stuck_prefill_fails_the_handoff_naming_it(model) -> None:
    async def main() -> None:
        async with prefill_server(model) as (psrv, _), InferenceClient(psrv.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate_all(_req((3, 4, 5), max_tokens=2))
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "scheduler" in err.value.details()
            assert list((await client.score(InferenceRequest(prompt_ids=(3, 4, 5)))).logprobs) == \
                offline_score(model, (3, 4, 5))
        # A prefill replica that is down (a port bound by nobody listening: connections are refused, and no
        # other server can take it meanwhile), and one that accepts connections but never answers: UNAVAILABLE
        # within the handoff timeout, naming the prefill replica (so a scheduler retries with another one).
        with socket.socket() as closed, socket.socket() as stuck:
            closed.bind(("127.0.0.1", 0))
            stuck.bind(("127.0.0.1", 0))
            stuck.listen()
            async with decode_server(model) as (dsrv, dec), InferenceClient(dsrv.address) as client:
                for sock in (closed, stuck):
                    peer = f"127.0.0.1:{sock.getsockname()[1]}"
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        _ = [d async for d in client.generate_from_prefill(_req((3, 4, 5), max_tokens=2), peer,
                                                                           handoff_timeout=1.0, timeout=30)]
                    assert err.value.code() is grpc.StatusCode.UNAVAILABLE and peer in err.value.details()
                    assert handoff_peer(err.value) == peer
                    assert dec.engine.num_in_flight == 0
                # Without a prefill address the request is malformed.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [d async for d in client.generate_from_prefill(_req((3, 4, 5), max_tokens=2), "")]
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and handoff_peer(err.value) is None
    asyncio.run(main())


def test_one_trace_spans_the_client_the_decode_replica_and_its_kv_read_from_prefill(model) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from zerokl.services.runtime import ServerOptions

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    opts = ServerOptions(tracer_provider=provider)

    async def main() -> None:
        async with decode_server(model, options=opts) as (dsrv, _), \
                prefill_server(model, options=opts) as (psrv, _), \
                InferenceClient(dsrv.address, tracer_provider=provider) as client:
            with provider.get_tracer("test").start_as_current_span("user-request") as root:
                _ = [d async for d in client.generate_from_prefill(_req((3, 4, 5, 6), temperature=0.0, max_tokens=2),
                                                                   psrv.address)]
            for _ in range(200):  # client spans end in a callback just after their call
                if {("zerokl.v1.Decode/GenerateFromPrefill", SpanKind.CLIENT), ("zerokl.v1.Prefill/PrefillKV",
                     SpanKind.CLIENT)} <= {(s.name, s.kind) for s in exporter.get_finished_spans()}:
                    break
                await asyncio.sleep(0.01)
        spans = {(s.name, s.kind): s for s in exporter.get_finished_spans()}
        call_out = spans[("zerokl.v1.Decode/GenerateFromPrefill", SpanKind.CLIENT)]
        call_in = spans[("zerokl.v1.Decode/GenerateFromPrefill", SpanKind.SERVER)]
        kv_out = spans[("zerokl.v1.Prefill/PrefillKV", SpanKind.CLIENT)]
        kv_in = spans[("zerokl.v1.Prefill/PrefillKV", SpanKind.SERVER)]
        trace_id = root.get_span_context().trace_id
        assert {s.context.trace_id for s in (call_out, call_in, kv_out, kv_in)} == {trace_id}
        assert call_in.parent.span_id == call_out.context.span_id
        assert kv_out.parent.span_id == call_in.context.span_id
        assert kv_in.parent.span_id == kv_out.context.span_id
    asyncio.run(main())
