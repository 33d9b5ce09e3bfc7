"""The base of every zerokl gRPC client: one way to open, share and close a channel."""
from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
from opentelemetry import trace

from zerokl.services.runtime.server import create_channel

__all__ = ["ServiceClient"]


class ServiceClient:
    """Owns (or borrows) a grpc.aio channel; subclasses build their stubs on `self.channel`.

    Pass a ``target`` (``host:port``) and optionally a bearer ``token``, TLS
    ``credentials`` and a tracer provider, or an existing ``channel`` (then the caller
    closes it). Use as ``async with Client(target) as c: ...``.
    """

    def __init__(self, target: str | None = None, *, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 tracer_provider: trace.TracerProvider | None = None,
                 channel: grpc.aio.Channel | None = None) -> None:
        if (target is None) == (channel is None):
            raise ValueError("pass exactly one of target and channel")
        self.target = target
        self._owns_channel = channel is None
        self._channel = channel or create_channel(target, token=token, credentials=credentials,  # type: ignore[arg-type]
                                                  tracer_provider=tracer_provider)

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    async def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
