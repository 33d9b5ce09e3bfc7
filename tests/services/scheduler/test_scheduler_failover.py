"""A decode replica killed mid-stream: the request finishes elsewhere with identical bits, never spliced."""
from __future__ import annotations

import asyncio
import signal
from typing import Iterator

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import (
    WEIGHTS,
    numbers,
    offline,
    replica_server,
    routed,
    scheduler_server,
    serve_decode,
    stop,
    wait_listening,
)
from zerokl.model import Model
from zerokl.services.engine.types import SamplingOptions
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.inference.types import GenerateResult
from zerokl.services.scheduler import Policy, SchedulerConfig

# Round-robin over the registry order: the first request goes to the first decode replica listed (the victim).
IN_TURN = SchedulerConfig(policy=Policy.ROUND_ROBIN, route_wait_s=2.0)


@pytest.fixture(scope="module")
def victims() -> Iterator[list]:
    """Two `zerokl serve decode --preset tiny --seed 0` processes, started side by side, each killed by one test."""
    procs = [serve_decode(), serve_decode()]
    try:
        yield [(proc, wait_listening(proc)) for proc in procs]
    finally:
        for proc in procs:
            stop(proc)


def test_killing_the_decode_replica_mid_stream_finishes_the_request_on_another_with_identical_output(
        model: Model, victims: list) -> None:
    victim, victim_address = victims[0]
    ids = tuple(range(3, 28))
    options = SamplingOptions(temperature=0.9, top_p=0.95, seed=21, n=2, max_tokens=20, ignore_eos=True,
                              prompt_logprobs=True)
    request = InferenceRequest(ids, options=options, request_id="survives")

    async def main() -> tuple[GenerateResult, dict[str, int], int]:
        async with replica_server(model) as (survivor, _), \
                replica_server(model, "prefill") as (prefill, _), \
                scheduler_server([victim_address, survivor.address], [prefill.address], IN_TURN) as (server, sched):
            async with InferenceClient(server.address) as client:
                stream = client.generate(request, timeout=60)
                deltas = [await anext(stream) for _ in range(5)]
                assert sched.flight_replica("survives").address == victim_address
                before = sum(len(d.token_ids) for d in deltas)
                victim.send_signal(signal.SIGKILL)
                deltas += [d async for d in stream]
                result = GenerateResult.collect(deltas)
                counts = routed(sched)
                # The dead replica is out of rotation: the next request goes to the survivor at once.
                after = await client.generate_all(InferenceRequest(ids, options=SamplingOptions(max_tokens=2)),
                                                  timeout=30)
                assert after.samples[0].finish_reason is not None
                victim_view = next(v for v in sched.replicas() if v.address == victim_address)
                assert not victim_view.healthy
            return result, counts, before

    result, counts, before = asyncio.run(main())
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert 0 < before < 2 * options.max_tokens, "the kill must land mid-stream"
    assert numbers(result.samples) == numbers(offline(model, ids, options))
    assert all(s.finish_reason == "length" for s in result.samples)
    assert (result.weights_version, result.request_id) == (WEIGHTS, "survives")
    # The KV came from the prefill replica once; the decode attempt moved from the victim to the survivor.
    assert sorted(counts.values()) == [1, 1, 1] and counts[victim_address] == 1


def test_a_retry_whose_replay_differs_fails_with_data_loss_instead_of_splicing(model: Model, model_seed1: Model,
                                                                               victims: list) -> None:
    victim, victim_address = victims[1]
    ids = tuple(range(3, 20))
    options = SamplingOptions(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def main() -> tuple[list[int], grpc.aio.AioRpcError]:
        # A replica that claims the victim's weights version but holds other weights: the replay must catch it.
        async with replica_server(model_seed1, weights=WEIGHTS) as (impostor, _), \
                scheduler_server([victim_address, impostor.address], config=IN_TURN) as (server, sched):
            async with InferenceClient(server.address) as client:
                stream = client.generate(InferenceRequest(ids, options=options, request_id="spliced"), timeout=60)
                tokens = [t for _ in range(3) for t in (await anext(stream)).token_ids]
                assert sched.flight_replica("spliced").address == victim_address
                victim.send_signal(signal.SIGKILL)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for d in stream:
                        tokens += d.token_ids
            # With the victim dead and no other decode replica: a clean UNAVAILABLE, no hang.
            async with scheduler_server([victim_address], config=SchedulerConfig(route_wait_s=0.3)) as (server, _):
                async with grpc.aio.insecure_channel(server.address) as channel:
                    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                async with InferenceClient(server.address) as client:
                    with pytest.raises(grpc.aio.AioRpcError) as gone:
                        await client.generate_all(InferenceRequest(ids, options=options), timeout=30)
                    assert gone.value.code() is grpc.StatusCode.UNAVAILABLE
                    assert victim_address in gone.value.details()
            return tokens, err.value

    tokens, err = asyncio.run(main())
    assert err.code() is grpc.StatusCode.DATA_LOSS, err.details()
    assert "replay" in err.details() and "differs" in err.details()
    want = offline(model, ids, options)[0].token_ids
    assert tokens == want[:len(tokens)], "what was streamed before the failure is the victim's own output"
