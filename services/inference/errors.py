"""Status codes the inference services need beyond the runtime's, and relaying a peer's status."""
from __future__ import annotations

import grpc
import grpc.aio
from google.rpc import status_pb2
from grpc_status import rpc_status

from zerokl.services.runtime.errors import ServiceError, rich_status

__all__ = ["ResourceExhausted", "Cancelled", "Internal", "RelayedError"]


class ResourceExhausted(ServiceError):
    """The request is valid but cannot fit this replica (KV cache, sample count)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Cancelled(ServiceError):
    """The request was stopped by an Abort before it produced its result."""

    code = grpc.StatusCode.CANCELLED


class Internal(ServiceError):
    """The engine failed while running the request (a bug, not the caller's fault)."""

    code = grpc.StatusCode.INTERNAL


class RelayedError(ServiceError):
    """A status a peer replica returned, passed on to our caller with the same code and details.

    The prefill replica relays decode's answer: the client must see the
    decode replica's INVALID_ARGUMENT or DATA_LOSS, not a generic failure.
    """

    def __init__(self, err: grpc.aio.AioRpcError, via: str) -> None:
        super().__init__(f"{via}: {err.details()}")
        self.code = err.code()
        try:
            status = rpc_status.from_call(err)  # type: ignore[arg-type]
        except ValueError:  # details trailer inconsistent with the status: keep code and message only
            status = None
        self._details = list(status.details) if status is not None else []

    def to_status(self) -> status_pb2.Status:
        status = rich_status(self.code, self.message)
        status.details.extend(self._details)
        return status
