"""Replicas failing mid-request: the request finishes elsewhere with identical bits, never spliced, never hung.

A decode replica killed mid-stream or mid-handoff (while it reads the KV), a
prefill replica dying or stuck in the middle of its KV stream: each attempt is
retried on another replica of the same pin, with the replay check.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import AsyncIterator, Iterator

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import (
    TOKENIZER,
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
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.inference.types import GenerateResult
from zerokl.services.engine.engine import Engine
from zerokl.services.engine.types import EngineConfig
from zerokl.services.inference import AsyncEngine, Replica
from zerokl.services.inference.prefill import PREFILL_SERVICE, PrefillServicer, Prefiller
from zerokl.services.inference.service import INFERENCE_SERVICE, InferenceServicer
from zerokl.services.inference.server import make_identity
from zerokl.services.runtime import ServiceServer
from zerokl.services.routing import Policy, SchedulerConfig
from zerokl.v1 import inference_pb2_grpc
from zerokl.vocab import SamplingOptions

# Round-robin over the registry order: the first request goes to the first decode replica listed (the victim).
IN_TURN = SchedulerConfig(policy=Policy.ROUND_ROBIN, route_wait_s=2.0)


@pytest.fixture(scope="module")
def victims() -> Iterator[list]:
    """Three `zerokl serve decode --preset tiny --seed 0` processes, started side by side, each killed by one test."""
    procs = [serve_decode(), serve_decode(), serve_decode()]
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
    # The decode attempt moved from the victim to the survivor; each attempt read the KV from the prefill replica.
    assert sorted(counts.values()) == [1, 1, 2] and counts[victim_address] == 1


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


class _Faulty(PrefillServicer):
    """A real prefill replica's PrefillKV that goes wrong mid-stream: it dies after a chunk, or it hangs."""

    def __init__(self, prefiller: Prefiller, fault: str) -> None:
        super().__init__(prefiller)
        self.fault = fault
        self.called = asyncio.Event()

    async def PrefillKV(self, request, context):  # noqa: ANN001, ANN201
        self.called.set()
        sent = 0
        async for msg in super().PrefillKV(request, context):
            yield msg
            sent += msg.WhichOneof("msg") == "chunk"
            if sent == 1 and self.fault == "dies":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill replica is going away")
            if self.fault == "hangs":
                await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def _faulty_prefill(model: Model, fault: str) -> AsyncIterator[tuple[ServiceServer, _Faulty]]:
    """A prefill replica (real Info, health, Score) whose PrefillKV has ``fault``."""
    replica = Replica(AsyncEngine(Engine(model, EngineConfig(), TOKENIZER)),
                      make_identity("prefill", model, WEIGHTS, f"prefill-{fault}"), TOKENIZER)
    replica.engine.start()
    server = ServiceServer("prefill")
    prefiller = Prefiller(replica, 4096)
    faulty = _Faulty(prefiller, fault)
    server.add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server, InferenceServicer(prefiller),
                        INFERENCE_SERVICE)
    server.add_servicer(inference_pb2_grpc.add_PrefillServicer_to_server, faulty, PREFILL_SERVICE)
    await server.start()
    try:
        yield server, faulty
    finally:
        await server.drain(0)
        await replica.engine.close()


def test_a_prefill_replica_dying_or_stuck_mid_handoff_is_retried_with_another(model: Model) -> None:
    ids = tuple(range(3, 60))
    options = SamplingOptions(temperature=0.9, seed=8, n=2, max_tokens=6, ignore_eos=True, prompt_logprobs=True)
    # Prefill replicas in turn (round robin over those not failed yet): the dying one, the stuck one (past the
    # 1 s handoff timeout), then the sound one.
    config = SchedulerConfig(policy=Policy.ROUND_ROBIN, route_wait_s=2.0, handoff_timeout_s=1.0)

    async def main() -> tuple[GenerateResult, dict[str, int]]:
        async with replica_server(model) as (decode, _), _faulty_prefill(model, "dies") as (dying, _), \
                _faulty_prefill(model, "hangs") as (stuck, hanging), replica_server(model, "prefill") as (sound, _), \
                scheduler_server([decode.address], [dying.address, sound.address, stuck.address], config) \
                as (server, sched):
            async with InferenceClient(server.address) as client:
                result = await client.generate_all(InferenceRequest(ids, options=options), timeout=60)
            assert hanging.called.is_set()
            return result, routed(sched)

    result, counts = asyncio.run(main())
    assert numbers(result.samples) == numbers(offline(model, ids, options))
    # Three attempts on the one decode replica (never blamed), one per prefill replica.
    assert sorted(counts.values()) == [1, 1, 1, 3]


def test_killing_the_decode_replica_mid_handoff_retries_on_another(model: Model, victims: list) -> None:
    victim, victim_address = victims[2]
    ids = tuple(range(3, 40))
    options = SamplingOptions(temperature=0.0, max_tokens=5, ignore_eos=True)

    async def main() -> tuple[GenerateResult, dict[str, int]]:
        # The first attempt reads from the stuck prefill replica: the victim is killed while it waits for the KV.
        async with replica_server(model) as (survivor, _), _faulty_prefill(model, "hangs") as (stuck, hanging), \
                replica_server(model, "prefill") as (sound, _), \
                scheduler_server([victim_address, survivor.address], [stuck.address, sound.address], IN_TURN) \
                as (server, sched):
            async with InferenceClient(server.address) as client:
                call = asyncio.ensure_future(client.generate_all(InferenceRequest(ids, options=options,
                                                                                  request_id="mid-handoff"),
                                                                 timeout=60))
                await asyncio.wait_for(hanging.called.wait(), 30)
                assert sched.flight_replica("mid-handoff").address == victim_address
                victim.send_signal(signal.SIGKILL)
                return await call, routed(sched)

    result, counts = asyncio.run(main())
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert numbers(result.samples) == numbers(offline(model, ids, options))
    assert counts[victim_address] == 1 and sorted(counts.values()) == [1, 1, 1, 1]
