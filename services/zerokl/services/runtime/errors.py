"""Errors that become rich gRPC statuses.

Service logic raises a :class:`ServiceError` subclass (plain Python, no gRPC
context needed, so the same code runs behind gRPC and as a library); the
server's error interceptor turns it into a status code, a message and
``google.rpc.Status`` details (``BadRequest`` field violations,
``PreconditionFailure`` violations) in the ``grpc-status-details-bin``
trailer. Clients read the details back with :func:`status_details`.

This is the one error taxonomy of every service (inference, routing, jobs, trainer,
weight store): the status-code classes, a peer's status relayed (:class:`RelayedError`,
the ``KV_HANDOFF`` ErrorInfo), and the named failures one layer raises and another
catches (:class:`CanaryFailed`, :class:`UnservedPin`), so no layer imports another's
implementation for an exception.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc
import grpc.aio
from google.protobuf import any_pb2, message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = [
    "FieldViolation",
    "PreconditionViolation",
    "ServiceError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "DataLoss",
    "Unavailable",
    "ResourceExhausted",
    "Cancelled",
    "Internal",
    "CanaryFailed",
    "UnservedPin",
    "RelayedError",
    "KV_HANDOFF",
    "handoff_error_info",
    "handoff_peer",
    "rich_status",
    "clip",
    "abort",
    "status_details",
    "field_violations",
]


# gRPC sends a status's message and details as trailing metadata, which receivers cap (8 KiB
# soft, 16 KiB hard by default: a longer status reaches the client as RESOURCE_EXHAUSTED
# "metadata size exceeds hard limit" instead of itself). Statuses echo what a client sent (a
# version name, a request id), so what a status carries is clipped to these many UTF-8 bytes.
MAX_MESSAGE_BYTES = 1024
MAX_DETAIL_BYTES = 256


def clip(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, saying how long it was when cut."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    tail = f"... [{len(raw)} bytes, clipped]"
    return raw[: max(0, limit - len(tail))].decode(errors="ignore") + tail


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field: ``field`` is a dotted path such as ``chunk.offset``."""

    field: str
    description: str


@dataclass(frozen=True)
class PreconditionViolation:
    """One unmet precondition, e.g. type ``PINNED``, subject ``v3``."""

    type: str
    subject: str
    description: str


class ServiceError(Exception):
    """Base of the errors a service reports to its caller as a gRPC status.

    Subclasses fix the status code. ``field_violations`` becomes a
    ``google.rpc.BadRequest`` detail and ``precondition_violations`` a
    ``google.rpc.PreconditionFailure`` detail.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        field_violations: Sequence[FieldViolation] = (),
        precondition_violations: Sequence[PreconditionViolation] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field_violations = tuple(field_violations)
        self.precondition_violations = tuple(precondition_violations)

    def to_status(self) -> status_pb2.Status:
        """The ``google.rpc.Status`` this error is reported as."""
        details: list[message.Message] = []
        if self.field_violations:
            details.append(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=clip(v.field, MAX_DETAIL_BYTES),
                                                            description=clip(v.description, MAX_DETAIL_BYTES))
                for v in self.field_violations[:4]
            ]))
        if self.precondition_violations:
            details.append(error_details_pb2.PreconditionFailure(violations=[
                error_details_pb2.PreconditionFailure.Violation(
                    type=clip(v.type, MAX_DETAIL_BYTES), subject=clip(v.subject, MAX_DETAIL_BYTES),
                    description=clip(v.description, MAX_DETAIL_BYTES))
                for v in self.precondition_violations[:4]
            ]))
        return rich_status(self.code, self.message, details)


class InvalidArgument(ServiceError):
    """The request is malformed (bad id, offset, size, checksum format)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    @classmethod
    def field(cls, field: str, description: str) -> "InvalidArgument":
        """One bad field; the message repeats the description for plain clients."""
        return cls(f"{field}: {description}", field_violations=[FieldViolation(field, description)])


class NotFound(ServiceError):
    """The named entity does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    """The entity the request would create exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    """The system is not in a state the request needs (e.g. the version is pinned)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(ServiceError):
    """Stored or transferred bytes do not match their checksum."""

    code = grpc.StatusCode.DATA_LOSS


class Unavailable(ServiceError):
    """The server cannot serve this now (shutting down); retrying elsewhere is safe."""

    code = grpc.StatusCode.UNAVAILABLE


class CanaryFailed(FailedPrecondition):
    """New weights failed their canary on one replica; no other replica switched to them."""


class UnservedPin(FailedPrecondition):
    """No known replica serves the pinned weights version / fingerprint (it may be loading)."""


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


def rich_status(code: grpc.StatusCode, msg: str, details: Sequence[message.Message] = ()) -> status_pb2.Status:
    """Build a ``google.rpc.Status`` with each detail packed into an ``Any`` (the message clipped)."""
    packed = []
    for d in details:
        any_msg = any_pb2.Any()
        any_msg.Pack(d)
        packed.append(any_msg)
    return status_pb2.Status(code=code.value[0], message=clip(msg), details=packed)


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    """End the RPC with ``error``'s code, message and details (always raises)."""
    await context.abort_with_status(rpc_status.to_status(error.to_status()))


def status_details(err: grpc.aio.AioRpcError | grpc.RpcError) -> list[message.Message]:
    """Unpack the rich-status details a failed call carried (empty when none)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return []
    out: list[message.Message] = []
    for any_msg in status.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.PreconditionFailure):
            if any_msg.Is(cls.DESCRIPTOR):
                msg = cls()
                any_msg.Unpack(msg)
                out.append(msg)
    return out


def field_violations(err: grpc.aio.AioRpcError | grpc.RpcError) -> list[FieldViolation]:
    """The ``BadRequest`` field violations of a failed call, as dataclasses."""
    return [FieldViolation(v.field, v.description)
            for d in status_details(err) if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations]


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
