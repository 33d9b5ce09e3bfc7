"""The scheduler front door over in-process replicas: exact parity, spreading, pins, mixed fleets, abort, bad input."""
from __future__ import annotations

import asyncio
import random

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import TOKENIZER, WEIGHTS, numbers, offline, prompt, replica_server, routed, scheduler_server
from zerokl.kernels import fingerprint
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.runtime.errors import field_violations, status_details
from zerokl.services.runtime.metrics import REGISTRY
from zerokl.services.routing import Pin, SchedulerConfig
from zerokl.vocab import SamplingOptions

FP32 = fingerprint()
SHORT_WAIT = SchedulerConfig(route_wait_s=0.3)


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


def _requests() -> list[InferenceRequest]:
    rng = random.Random(0)
    return [
        InferenceRequest(prompt_ids=prompt(rng, 5, 40), options=SamplingOptions(temperature=0.0, max_tokens=10,
                                                                                ignore_eos=True)),
        InferenceRequest(prompt_ids=prompt(rng, 5, 40), options=SamplingOptions(temperature=0.9, top_p=0.8, seed=7,
                                                                                max_tokens=12, ignore_eos=True)),
        InferenceRequest(prompt_ids=prompt(rng, 20, 60), options=SamplingOptions(n=3, seed=3, max_tokens=6,
                                                                                 prompt_logprobs=True)),
        InferenceRequest(prompt_text="nums 2 5 target 10\n", options=SamplingOptions(temperature=0.0, max_tokens=9,
                                                                                     stop=("=",))),
    ]


def test_generate_and_score_through_the_scheduler_equal_the_replica_exactly(model: Model) -> None:
    async def main() -> None:
        async with replica_server(model) as (decode, _), \
                replica_server(model, "prefill") as (prefill, _), \
                scheduler_server([decode.address]) as (alone, _), \
                scheduler_server([decode.address], [prefill.address]) as (relayed, relay_scheduler):
            async with InferenceClient(decode.address) as direct, InferenceClient(alone.address) as via_decode, \
                    InferenceClient(relayed.address) as via_prefill:
                for r in _requests():
                    want = await direct.generate_all(r)
                    for client in (via_decode, via_prefill):
                        got = await client.generate_all(r)
                        assert numbers(got.samples) == numbers(want.samples)
                        assert (got.weights_version, got.numerics_fingerprint) == (WEIGHTS, FP32)
                        assert got.usage.completion_tokens == want.usage.completion_tokens
                # The relay path really went prefill -> decode.
                assert routed(relay_scheduler) == {decode.address: 4, prefill.address: 4}

                score = InferenceRequest(prompt_ids=tuple(range(3, 40)), options=SamplingOptions(temperature=0.7))
                want_score = await direct.score(score)
                for client in (via_decode, via_prefill):
                    got_score = await client.score(score)
                    assert (got_score.token_ids, got_score.logprobs) == (want_score.token_ids, want_score.logprobs)
                    assert got_score.weights_version == WEIGHTS

                info = await via_prefill.info()
                assert (info.service, info.replica_id) == ("scheduler", "scheduler-test")
                assert (info.weights_version, info.numerics_fingerprint, info.backend) == (WEIGHTS, FP32, "torch")
            assert await _health(relayed.address) == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(main())


def test_two_decode_replicas_share_the_load_and_each_output_is_its_solo_output(model: Model) -> None:
    rng = random.Random(1)
    requests = [InferenceRequest(prompt_ids=prompt(rng, 3, 30), options=SamplingOptions(
        temperature=rng.choice([0.0, 1.0]), top_k=rng.choice([0, 8]), seed=rng.randrange(100),
        max_tokens=rng.randint(3, 8), ignore_eos=True)) for _ in range(8)]

    async def main() -> tuple[list, dict[str, int], list[str]]:
        async with replica_server(model) as (d0, _), replica_server(model) as (d1, _), \
                scheduler_server([d0.address, d1.address]) as (server, scheduler):
            async with InferenceClient(server.address) as client:
                results = await asyncio.gather(*(client.generate_all(r) for r in requests))
            return results, routed(scheduler), [d0.address, d1.address]

    results, counts, addresses = asyncio.run(main())
    assert set(counts) == set(addresses) and all(counts[a] >= 3 for a in addresses), counts
    assert sum(counts.values()) == len(requests)
    for r, got in zip(requests, results, strict=True):
        assert numbers(got.samples) == numbers(offline(model, r.prompt_ids, r.options))
    scrape = _scrape()
    assert all(f'zerokl_scheduler_routed_total{{replica="{a}",role="decode"}}' in scrape for a in addresses)


def _scrape() -> str:
    from prometheus_client import generate_latest
    return generate_latest(REGISTRY).decode()


def test_replicas_of_another_weights_version_or_fingerprint_are_never_routed_to(model: Model,
                                                                               model_seed1: Model) -> None:
    bf16 = Model(model.config, seed=0, dtype=torch.bfloat16)
    ids = tuple(range(5, 30))
    options = SamplingOptions(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)
    want = numbers(offline(model, ids, options))

    async def main() -> None:
        async with replica_server(model) as (good, _), replica_server(model_seed1, weights="other") as (other, _), \
                replica_server(bf16) as (half, _):
            fp_half = fingerprint(dtype=torch.bfloat16)
            assert fp_half != FP32
            fleet = [other.address, half.address, good.address]  # the good one last: routing must skip the others
            pinned = SchedulerConfig(pin=Pin(WEIGHTS, FP32), route_wait_s=0.3)
            async with scheduler_server(fleet, config=pinned) as (server, scheduler):
                async with InferenceClient(server.address) as client:
                    results = await asyncio.gather(*(client.generate_all(InferenceRequest(ids, options=options))
                                                     for _ in range(6)))
                    assert all(numbers(r.samples) == want for r in results)
                    assert routed(scheduler) == {other.address: 0, half.address: 0, good.address: 6}
                    # A request may pin another version than the scheduler's: it goes where that one is served.
                    got = await client.generate_all(InferenceRequest(ids, options=options, weights_version="other"))
                    assert numbers(got.samples) == numbers(offline(model_seed1, ids, options))
                    assert routed(scheduler)[other.address] == 1 and routed(scheduler)[half.address] == 0
                    # A pin nobody serves is refused, naming what the fleet serves.
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate_all(InferenceRequest(ids, options=options, weights_version="v9"))
                    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                    assert "'v9'" in err.value.details() and good.address in err.value.details()

            # Unpinned over a mixed fleet: refused with the replicas on each side named, health NOT_SERVING.
            async with scheduler_server([good.address, half.address], config=SHORT_WAIT) as (server, scheduler):
                assert await _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
                async with InferenceClient(server.address) as client:
                    for call in (client.generate_all, client.score):
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await call(InferenceRequest(ids, options=options))
                        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                        details = err.value.details()
                        assert "mixed fleet" in details and "fingerprint" in details
                        assert good.address in details and half.address in details
                        assert FP32 in details and fp_half in details
                        assert any(type(d).__name__ == "PreconditionFailure" for d in status_details(err.value))
                    # Pinning the fingerprint in the request picks one side, and only that side.
                    got = await client.generate_all(InferenceRequest(ids, options=options, numerics_fingerprint=FP32))
                    assert numbers(got.samples) == want and got.numerics_fingerprint == FP32
                    assert routed(scheduler) == {good.address: 1, half.address: 0}
                    assert (await client.info()).numerics_fingerprint == ""  # nothing agreed on

    asyncio.run(main())


def test_abort_through_the_scheduler_reaches_the_replica_holding_the_request(model: Model) -> None:
    ids = tuple(range(3, 20))
    options = SamplingOptions(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main() -> None:
        async with replica_server(model) as (decode, replica), \
                replica_server(model, "prefill") as (prefill, _), \
                scheduler_server([decode.address], [prefill.address]) as (server, scheduler):
            async with InferenceClient(server.address) as client:
                stream = client.generate(InferenceRequest(ids, options=options, request_id="long-one"))
                deltas = [await anext(stream)]
                assert scheduler.flight_replica("long-one").address == decode.address
                assert await client.abort("long-one") is True
                deltas += [d async for d in stream]
                assert deltas[-1].finish_reason == "abort"
                tokens = [t for d in deltas for t in d.token_ids]
                assert 0 < len(tokens) < 400
                solo = offline(model, ids, SamplingOptions(temperature=0.0, max_tokens=len(tokens), ignore_eos=True))
                assert tokens == solo[0].token_ids
                assert not replica.engine.in_flight("long-one")
                assert await client.abort("long-one") is False
                assert await client.abort("never-seen") is False

    asyncio.run(main())


def test_bad_input_gets_the_replicas_status_and_the_scheduler_keeps_serving(model: Model) -> None:
    good = InferenceRequest(prompt_ids=tuple(range(3, 30)), options=SamplingOptions(temperature=0.0, max_tokens=12,
                                                                                    ignore_eos=True))
    bad = [
        (InferenceRequest(prompt_ids=(3, CONFIG_VOCAB)), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (InferenceRequest(prompt_ids=()), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (InferenceRequest(prompt_ids=(3, 4), options=SamplingOptions(max_tokens=0)),
         grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (InferenceRequest(prompt_ids=(3, 4), options=SamplingOptions(temperature=-1.0)),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (InferenceRequest(prompt_ids=(3, 4), options=SamplingOptions(top_p=1.5)),
         grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (InferenceRequest(prompt_ids=(3, 4), options=SamplingOptions(n=1000)), grpc.StatusCode.INVALID_ARGUMENT, "n="),
    ]

    async def main() -> None:
        async with replica_server(model) as (decode, _), \
                replica_server(model, "prefill") as (prefill, _), \
                scheduler_server([decode.address]) as (alone, _), \
                scheduler_server([decode.address], [prefill.address]) as (relayed, _):
            for server in (alone, relayed):
                async with InferenceClient(server.address) as client:
                    running = asyncio.ensure_future(client.generate_all(good))
                    for request, code, words in bad:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await client.generate_all(request)
                        assert err.value.code() is code, (request, err.value.details())
                        assert words in err.value.details(), err.value.details()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate_all(bad[-1][0])
                    assert [v.field for v in field_violations(err.value)] == ["sampling.n"], \
                        "the replica's BadRequest details pass through"
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.score(InferenceRequest(prompt_ids=(3, CONFIG_VOCAB)))
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                    # A request id already in flight through the scheduler.
                    long = InferenceRequest(prompt_ids=(3, 4, 5), options=SamplingOptions(max_tokens=300,
                                                                                          ignore_eos=True),
                                            request_id="dup")
                    first = client.generate(long)
                    await anext(first)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate_all(long)
                    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
                    await client.abort("dup")
                    assert [d async for d in first][-1].finish_reason == "abort"
                    result = await running
                    assert numbers(result.samples) == numbers(offline(model, good.prompt_ids, good.options))

    asyncio.run(main())


CONFIG_VOCAB = TOKENIZER.vocab_size + 1000  # outside the tiny model's vocabulary too


def test_one_trace_spans_the_client_the_scheduler_and_the_prefill_to_decode_handoff(model: Model) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from zerokl.services.runtime import ServerOptions

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    opts = ServerOptions(tracer_provider=provider)

    async def main() -> int:
        async with replica_server(model, options=opts) as (decode, _), \
                replica_server(model, "prefill", options=opts) as (prefill, _), \
                scheduler_server([decode.address], [prefill.address], options=opts) as (server, _), \
                InferenceClient(server.address, tracer_provider=provider) as client:
            with provider.get_tracer("test").start_as_current_span("user-request") as root:
                await client.generate_all(InferenceRequest((3, 4, 5, 6), options=SamplingOptions(max_tokens=2)))
            for _ in range(200):  # client spans end in a callback just after their call
                names = {(s.name, s.kind) for s in exporter.get_finished_spans()}
                if ("zerokl.v1.Inference/Generate", SpanKind.CLIENT) in names:
                    break
                await asyncio.sleep(0.01)
        return root.get_span_context().trace_id

    trace_id = asyncio.run(main())
    spans = {(s.name, s.kind): s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id}
    front = spans[("zerokl.v1.Inference/Generate", SpanKind.SERVER)]
    assert front.parent.span_id == spans[("zerokl.v1.Inference/Generate", SpanKind.CLIENT)].context.span_id
    # scheduler -> decode (GenerateFromPrefill) -> prefill (PrefillKV): the KV hop hangs off the decode replica.
    parent = front
    for hop in ("zerokl.v1.Decode/GenerateFromPrefill", "zerokl.v1.Prefill/PrefillKV"):
        out, into = spans[(hop, SpanKind.CLIENT)], spans[(hop, SpanKind.SERVER)]
        assert out.parent.span_id == parent.context.span_id and into.parent.span_id == out.context.span_id
        parent = into
    assert [e.attributes["role"] for e in front.events if e.name == "zerokl.scheduler.route"] == ["decode", "prefill"]
    # one request id, assigned by the scheduler, tags its span and every replica's
    rid = front.attributes["zerokl.request_id"]
    assert len(rid) == 32
    for hop in ("zerokl.v1.Prefill/PrefillKV", "zerokl.v1.Decode/GenerateFromPrefill"):
        assert spans[(hop, SpanKind.SERVER)].attributes["zerokl.request_id"] == rid
