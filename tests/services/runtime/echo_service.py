"""A tiny raw-bytes test service ("zerokl.test.Echo") for the runtime tests.

It has no generated code: handlers take and return bytes, which is all the
runtime's server, interceptors and channels care about.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import grpc
import grpc.aio
from zerokl.services.runtime import FieldViolation, InvalidArgument, ServiceServer

ECHO_SERVICE = "zerokl.test.Echo"


def _ident(b: bytes) -> bytes:
    return b


def echo_handler(relay: Callable[[], grpc.aio.Channel] | None = None) -> grpc.GenericRpcHandler:
    """Methods: Echo, Slow (sleeps float(request) s), Fail, OutOfMemory (torch's), Count (streams n items), Relay."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(float(request.decode()))
        return b"done"

    async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise InvalidArgument("bad echo", field_violations=[FieldViolation("payload", "must not be 'x'")])

    async def out_of_memory(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        import torch
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 22.69 GiB. GPU 0 has a total capacity "
                                     "of 79.18 GiB of which 9.82 GiB is free.")

    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(int(request.decode())):
            yield str(i).encode()

    async def relay_call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        assert relay is not None
        channel = relay()
        return await channel.unary_unary(f"/{ECHO_SERVICE}/Echo", _ident, _ident)(request)

    kw = dict(request_deserializer=_ident, response_serializer=_ident)
    return grpc.method_handlers_generic_handler(ECHO_SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, **kw),
        "Slow": grpc.unary_unary_rpc_method_handler(slow, **kw),
        "Fail": grpc.unary_unary_rpc_method_handler(fail, **kw),
        "OutOfMemory": grpc.unary_unary_rpc_method_handler(out_of_memory, **kw),
        "Count": grpc.unary_stream_rpc_method_handler(count, **kw),
        "Relay": grpc.unary_unary_rpc_method_handler(relay_call, **kw),
    })


class EchoClient:
    """Typed-enough calls onto the Echo service over a runtime channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def unary(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(f"/{ECHO_SERVICE}/{method}", _ident, _ident)

    def stream(self, method: str) -> grpc.aio.UnaryStreamMultiCallable:
        return self.channel.unary_stream(f"/{ECHO_SERVICE}/{method}", _ident, _ident)


async def start_echo_server(server: ServiceServer, relay: Callable[[], grpc.aio.Channel] | None = None) -> ServiceServer:
    """Register the Echo service on ``server`` and start it."""
    server.add_generic_handler(echo_handler(relay), ECHO_SERVICE)
    await server.start()
    return server
