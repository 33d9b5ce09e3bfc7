"""A decode replica whose device fails mid-stream: it goes NOT_SERVING, the request ends there with
UNAVAILABLE, and the scheduler finishes it on another replica with identical bits."""
from __future__ import annotations

import asyncio

import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import CONFIG, numbers, offline, replica_server, scheduler_server
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient, InferenceRequest, Replica
from zerokl.services.inference.types import GenerateResult
from zerokl.services.routing import Policy, SchedulerConfig
from zerokl.vocab import SamplingOptions

IN_TURN = SchedulerConfig(policy=Policy.ROUND_ROBIN, route_wait_s=2.0)


def _lose_the_device(replica: Replica) -> None:
    """From now on every forward and every probe of this replica fails as on a lost CUDA context."""
    def lost(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    engine = replica.engine.engine
    engine.model.forward_tokens = engine.probe = lost


def test_a_replica_whose_device_fails_is_not_serving_and_its_request_finishes_elsewhere_exactly(model) -> None:
    victim_model = Model(CONFIG, seed=0)          # the same weights; its own object, to break
    request = InferenceRequest(tuple(range(3, 30)), request_id="survives", options=SamplingOptions(
        temperature=0.9, seed=5, n=2, max_tokens=30, ignore_eos=True))

    async def main() -> GenerateResult:
        async with replica_server(victim_model) as (victim, replica), replica_server(model) as (survivor, _), \
                scheduler_server([victim.address, survivor.address], (), IN_TURN) as (server, sched), \
                InferenceClient(server.address) as client, InferenceClient(victim.address) as direct:
            stream = client.generate(request, timeout=60)
            deltas = [await anext(stream)]
            assert sched.flight_replica("survives").address == victim.address
            _lose_the_device(replica)
            deltas += [d async for d in stream]
            health = await health_pb2_grpc.HealthStub(direct.channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # The fleet routes around it: the next request is served by the survivor alone.
            again = await client.generate_all(InferenceRequest(request.prompt_ids, options=request.options))
            assert numbers(again.samples) == numbers(offline(model, request.prompt_ids, request.options))
            assert not [v for v in sched.replicas() if v.address == victim.address and v.healthy]
            return GenerateResult.collect(deltas)

    result = asyncio.run(main())
    assert numbers(result.samples) == numbers(offline(model, request.prompt_ids, request.options))
