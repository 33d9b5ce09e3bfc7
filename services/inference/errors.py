"""Status codes the inference services need beyond the runtime's, and relaying a peer's status."""
from __future__ import annotations

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from zerokl.services.runtime.errors import ServiceError, rich_status

__all__ = ["ResourceExhausted", "Cancelled", "Internal", "RelayedError", "KV_HANDOFF", "handoff_error_info",
           "handoff_peer"]

#: ErrorInfo reason of a status caused by the prefill side of a KV handoff (metadata ``prefill``: its address).
KV_HANDOFF = "KV_HANDOFF"
_DOMAIN = "zerokl"


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

    def __init__(self, err: grpc.aio.AioRpcError, via: str, code: grpc.StatusCode | None = None,
                 handoff_from: str | None = None, details: str | None = None) -> None:
        # ``details``: the peer's text as passed on (default: as it was), e.g. with internal addresses named.
        super().__init__(f"{via}: {err.details() if details is None else details}")
        self.code = code or err.code()
        try:
            status = rpc_status.from_call(err)  # type: ignore[arg-type]
        except ValueError:  # details trailer inconsistent with the status: keep code and message only
            status = None
        self._details = list(status.details) if status is not None else []
        if handoff_from is not None:
            self._details.append(handoff_error_info(handoff_from))

    def to_status(self) -> status_pb2.Status:
        status = rich_status(self.code, self.message)
        status.details.extend(self._details)
        return status


def handoff_error_info(prefill: str) -> any_pb2.Any:
    """The status detail saying the failure came from the prefill replica at ``prefill`` (a KV handoff)."""
    packed = any_pb2.Any()
    packed.Pack(error_details_pb2.ErrorInfo(reason=KV_HANDOFF, domain=_DOMAIN, metadata={"prefill": prefill}))
    return packed


def handoff_peer(err: grpc.aio.AioRpcError) -> str | None:
    """The prefill address a failed GenerateFromPrefill blames (its KV_HANDOFF ErrorInfo), else None."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except ValueError:
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.reason == KV_HANDOFF \
                and info.domain == _DOMAIN:
            return info.metadata.get("prefill", "")
    return None
