"""A request the engine fails on fails alone; a replica that cannot serve says so in its health.

Over real loopback gRPC: poisonous requests that get past validation (the engine's
check bypassed for them, or the protobuf edge bypassed by submitting in process) fail
with INTERNAL while many concurrent bystanders complete with exactly their solo bits.
Health (grpc.health.v1) goes NOT_SERVING when the engine thread dies, when the device
fails, and when weights fail to load midway, and back to SERVING when it can serve again.
"""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import CONFIG, WEIGHTS, decode_server, offline, prompt
from zerokl.kernels.model import Model
from zerokl.services.engine.types import GenerateRequest
from zerokl.services.inference import GenerateResult, InferenceClient, InferenceRequest
from zerokl.services.inference.replica import Replica
from zerokl.vocab import SamplingOptions

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
INTERNAL, UNAVAILABLE = grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE

pytestmark = pytest.mark.timeout(300)


def _let_poison_through(replica: Replica) -> None:
    """The engine skips its own validation for request ids starting with "poison": what a gap
    in validation would let reach a step (the protobuf edge does not know the vocabulary)."""
    engine = replica.engine.engine
    validate = engine.validate
    engine.validate = lambda r: None if r.request_id.startswith("poison") else validate(r)


def _assert_solo_bits(got: GenerateResult, r: InferenceRequest, model: Model) -> None:
    want = offline(model, r.prompt_ids, r.options)
    assert [(s.index, s.token_ids, s.finish_reason) for s in got.samples] == \
        [(s.index, s.token_ids, s.finish_reason) for s in want]
    for g, w in zip(got.samples, want):
        assert torch.equal(torch.tensor(g.logprobs), torch.tensor(w.logprobs))


async def _health(client: InferenceClient) -> int:
    return (await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest())).status


async def _wait_health(client: InferenceClient, want: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := await _health(client)) != want:
        assert time.monotonic() < deadline, f"health stayed {got}, want {want}"
        await asyncio.sleep(0.02)


async def _code(coro) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code(), err.value.details()


def test_poisonous_requests_fail_alone_and_every_bystander_keeps_its_solo_bits(model) -> None:
    rng = random.Random(16)
    bystanders = [InferenceRequest(prompt_ids=prompt(rng, 3, 40), request_id=f"bystander-{i}", options=SamplingOptions(
        temperature=rng.choice([0.0, 0.8, 1.0]), top_k=rng.choice([0, 5]), seed=i, n=rng.choice([1, 1, 2]),
        max_tokens=rng.randint(4, 12), ignore_eos=True)) for i in range(24)]
    # An id outside the embedding fails the batched forward (found by bisecting the batch).
    poison_ids = [InferenceRequest(prompt_ids=(5, 6, 10**6, 7), request_id=f"poison-{i}",
                                   options=SamplingOptions(max_tokens=4)) for i in range(3)]

    async def main() -> None:
        async with decode_server(model) as (srv, replica), InferenceClient(srv.address) as client:
            _let_poison_through(replica)
            running = [asyncio.ensure_future(client.generate_all(r)) for r in bystanders]
            while sum(replica.engine.in_flight(r.request_id) for r in bystanders) < 8:
                await asyncio.sleep(0.002)
            # A temperature float32 cannot hold, submitted past the protobuf edge (which refuses it).
            temperature = await replica.engine.submit(GenerateRequest(
                "poison-temperature", (5, 6, 7), SamplingOptions(temperature=1e300, max_tokens=4)))
            results = await asyncio.gather(*(_code(client.generate_all(r)) for r in poison_ids))
            for code, details in results:
                assert code is INTERNAL and "poison-" in details, details
            with pytest.raises(Exception) as err:
                async with temperature:
                    [o async for o in temperature]
            assert err.value.code is INTERNAL and "overflow" in err.value.message
            for r, got in zip(bystanders, await asyncio.gather(*running)):
                _assert_solo_bits(got, r, model)
            assert await _health(client) == SERVING
            assert replica.engine.engine.kv_usage() == 0
    asyncio.run(main())


def test_health_is_not_serving_while_weights_failed_to_load_and_serving_once_a_load_succeeds() -> None:
    model = Model(CONFIG, seed=0)        # its own weights: this test breaks them on purpose
    good = {k: t.clone() for k, t in model.state_dict().items()}
    broken = dict(good)
    last = list(broken)[-1]
    broken[last] = torch.empty(broken[last].shape, device="meta")    # right shape, no data: the copy fails
    request = InferenceRequest(prompt_ids=(3, 4, 5, 6), options=SamplingOptions(max_tokens=5, seed=2))

    async def main() -> None:
        async with decode_server(model) as (srv, replica), InferenceClient(srv.address) as client:
            assert await _health(client) == SERVING
            with pytest.raises(Exception) as err:
                await replica.load_weights(broken, "broken")
            assert err.value.code is UNAVAILABLE and "serves nothing until a load succeeds" in err.value.message
            await _wait_health(client, NOT_SERVING)
            code, details = await _code(client.generate_all(request))
            assert code is UNAVAILABLE and "failed midway" in details, details
            await replica.load_weights(good, WEIGHTS)
            await _wait_health(client, SERVING)
            _assert_solo_bits(await client.generate_all(request), request, Model(CONFIG, seed=0))
    asyncio.run(main())


def test_health_is_not_serving_after_the_device_fails_and_serving_once_it_computes_again() -> None:
    model = Model(CONFIG, seed=0)
    request = InferenceRequest(prompt_ids=(3, 4, 5, 6), options=SamplingOptions(max_tokens=40, seed=2,
                                                                                ignore_eos=True))

    async def main() -> None:
        async with decode_server(model) as (srv, replica), InferenceClient(srv.address) as client:
            engine = replica.engine.engine
            lost = {"context": False}
            forward = engine.model.forward_tokens
            probe = engine.probe

            def failing_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                if lost["context"]:
                    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
                return forward(*args, **kwargs)

            def failing_probe() -> None:
                if lost["context"]:
                    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
                probe()

            engine.model.forward_tokens, engine.probe = failing_forward, failing_probe
            stream = client.generate(request)
            await anext(stream)
            lost["context"] = True          # the context is lost mid-request
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
            assert err.value.code() is UNAVAILABLE and "device failed" in err.value.details()
            await _wait_health(client, NOT_SERVING)
            code, details = await _code(client.generate_all(request))
            assert code is UNAVAILABLE and "device failed" in details
            lost["context"] = False         # e.g. the driver recovered: the probe computes again
            await _wait_health(client, SERVING)
            _assert_solo_bits(await client.generate_all(request), request, model)
    asyncio.run(main())


def test_health_is_not_serving_when_the_engine_thread_dies(model) -> None:
    async def main() -> None:
        async with decode_server(model) as (srv, replica), InferenceClient(srv.address) as client:
            assert await _health(client) == SERVING

            def broken_loop() -> bool:
                raise RuntimeError("a bug in the engine loop")

            replica.engine.engine.has_work = broken_loop
            code, details = await _code(client.generate_all(InferenceRequest(prompt_ids=(3, 4, 5))))
            assert code is UNAVAILABLE and "engine thread died" in details, details
            await _wait_health(client, NOT_SERVING)
            code, details = await _code(client.generate_all(InferenceRequest(prompt_ids=(3, 4, 5))))
            assert code is UNAVAILABLE and "a bug in the engine loop" in details
            del replica.engine.engine.has_work
    asyncio.run(main())
