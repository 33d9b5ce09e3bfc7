"""ServiceServer over real loopback gRPC: health, reflection, drain, signals, limits, rich errors."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import grpc.aio
import pytest
from echo_service import ECHO_SERVICE, EchoClient, start_echo_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from zerokl.services.runtime import (
    FieldViolation,
    ServerOptions,
    ServiceIdentity,
    ServiceServer,
    create_channel,
    field_violations,
    identity_from_proto,
    identity_to_proto,
    model_config_hash,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health_of(channel: grpc.aio.Channel, service: str = "") -> int:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return resp.status


def test_health_follows_swaps_and_reflection_lists_services() -> None:
    async def main() -> None:
        server = await start_echo_server(ServiceServer("decode"))
        async with create_channel(server.address) as ch:
            assert await health_of(ch) == SERVING
            assert await health_of(ch, ECHO_SERVICE) == SERVING
            async with server.not_serving():
                async with server.not_serving():  # overlapping swaps
                    assert await health_of(ch, ECHO_SERVICE) == NOT_SERVING
                assert await health_of(ch) == NOT_SERVING
            assert await health_of(ch) == SERVING

            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name async for r in call for s in r.list_services_response.service}
            assert {ECHO_SERVICE, "grpc.health.v1.Health"} <= names
        await server.drain(0)
    asyncio.run(main())


def test_drain_reports_not_serving_finishes_in_flight_and_refuses_new_calls() -> None:
    async def main() -> None:
        server = await start_echo_server(ServiceServer("prefill", ServerOptions(drain_delay_s=0.3)))
        async with create_channel(server.address) as ch:
            client = EchoClient(ch)
            in_flight = asyncio.ensure_future(client.unary("Slow")(b"0.6", timeout=10))
            await asyncio.sleep(0.1)
            drain = asyncio.ensure_future(server.drain(grace_s=5))
            await asyncio.sleep(0.1)
            assert await health_of(ch) == NOT_SERVING  # during the drain delay, still answering
            assert await in_flight == b"done"
            await drain
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.unary("Echo")(b"hi", timeout=2)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    asyncio.run(main())


def test_drain_cuts_calls_that_outlive_the_grace() -> None:
    async def main() -> None:
        server = await start_echo_server(ServiceServer("decode"))
        async with create_channel(server.address) as ch:
            call = EchoClient(ch).unary("Slow")(b"30", timeout=30)
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await server.drain(grace_s=0.2)
            assert time.monotonic() - t0 < 3
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    asyncio.run(main())


def test_sigterm_drains_and_returns() -> None:
    async def main() -> None:
        server = await start_echo_server(ServiceServer("scheduler"))
        async with create_channel(server.address) as ch:
            in_flight = asyncio.ensure_future(EchoClient(ch).unary("Slow")(b"0.4", timeout=10))
            serving = asyncio.ensure_future(server.serve_until_signal())
            await asyncio.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(serving, 10)
            assert await in_flight == b"done"
        # The handlers are gone again: SIGTERM's default disposition is restored.
        assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
    asyncio.run(main())


def test_service_errors_become_rich_statuses() -> None:
    async def main() -> None:
        server = await start_echo_server(ServiceServer("trainer"))
        async with create_channel(server.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await EchoClient(ch).unary("Fail")(b"x", timeout=5)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "bad echo"
            assert field_violations(err.value) == [FieldViolation("payload", "must not be 'x'")]
            assert await EchoClient(ch).unary("Echo")(b"still serving", timeout=5) == b"still serving"
        await server.drain(0)
    asyncio.run(main())


def test_a_device_out_of_memory_is_resource_exhausted_saying_so_and_the_server_keeps_serving() -> None:
    """Before: UNKNOWN "Unexpected <class 'torch.OutOfMemoryError'>: ..." (what a co-located GLM-5 slice job's
    start got from the trainer and the replica on an H100)."""
    async def main() -> None:
        server = await start_echo_server(ServiceServer("trainer"))
        async with create_channel(server.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await EchoClient(ch).unary("OutOfMemory")(b"", timeout=5)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details().startswith("out of device memory: CUDA out of memory. Tried to allocate "
                                                  "22.69 GiB."), err.value.details()
            assert await EchoClient(ch).unary("Echo")(b"still serving", timeout=5) == b"still serving"
        await server.drain(0)
    asyncio.run(main())


def test_message_size_limit() -> None:
    async def main() -> None:
        server = await start_echo_server(ServiceServer("prefill", ServerOptions(max_message_bytes=1 << 20)))
        async with create_channel(server.address, max_message_bytes=8 << 20) as ch:
            echo = EchoClient(ch).unary("Echo")
            assert len(await echo(b"a" * 1000_000, timeout=5)) == 1000_000
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await echo(b"a" * (2 << 20), timeout=5)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        await server.drain(0)
    asyncio.run(main())


def test_a_busy_port_is_refused() -> None:
    async def main() -> None:
        first = await start_echo_server(ServiceServer("decode"))
        second = ServiceServer("decode", ServerOptions(port=first.port))
        with pytest.raises((OSError, RuntimeError)):
            await second.start()
        await first.drain(0)
    asyncio.run(main())


def test_identity_round_trips_through_service_info() -> None:
    ident = ServiceIdentity("decode", "decode-0", numerics_version="0.1.0", numerics_fingerprint="ab12",
                            backend="torch", device="cpu", dtype="float32")
    loaded = ident.with_weights("v7", {"b": 1, "a": [1, 2]})
    assert loaded.weights_version == "v7"
    assert loaded.model_config_hash == model_config_hash({"a": [1, 2], "b": 1})
    assert identity_from_proto(identity_to_proto(loaded)) == loaded
    with pytest.raises(ValueError):
        ServiceIdentity("router", "r0")
