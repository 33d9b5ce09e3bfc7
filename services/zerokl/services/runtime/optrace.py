"""Per-op traces (kernels/zerokl/kernels/trace.py) to and from ``zerokl.v1.Trace``, and who may ask for one.

Both Score (replicas) and ForwardLogprobs (trainer) return a trace when asked
(``zerokl diff``); the conversion and the operator check live here once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from zerokl.services.runtime.auth import Role, caller_role
from zerokl.services.runtime.errors import ServiceError
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.v1 import common_pb2

if TYPE_CHECKING:    # the trace types hold tensors: torch only where a trace is made or read
    from zerokl.kernels.trace import Trace

__all__ = ["PermissionDenied", "require_operator", "identity_meta", "trace_options_to_proto", "trace_options_from_proto",
           "trace_to_proto", "trace_from_proto"]


class PermissionDenied(ServiceError):
    """The caller's credential may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


def require_operator(what: str) -> None:
    """PERMISSION_DENIED unless auth is off or the caller presented the operator credential.

    A trace shows intermediate activations of the served weights: an operator's
    debugging tool, not a client's (a peer service never needs one either).
    """
    role = caller_role()
    if role is not None and role is not Role.OPERATOR:
        raise PermissionDenied(f"{what} needs the operator credential (this call presented the {role.value} one)")


def identity_meta(identity: ServiceIdentity) -> dict[str, str]:
    """What a trace says about the side that computed it."""
    return {"service": identity.service, "replica_id": identity.replica_id, "backend": identity.backend,
            "device": identity.device, "dtype": identity.dtype, "weights_version": identity.weights_version,
            "numerics_fingerprint": identity.numerics_fingerprint}


def trace_options_to_proto(capture: tuple[str, ...] | list[str] = ()) -> common_pb2.TraceOptions:
    """A request for a trace, with the full rows of the ``capture`` keys ("layer:op", "*")."""
    return common_pb2.TraceOptions(enabled=True, capture=list(capture))


def trace_options_from_proto(msg: common_pb2.TraceOptions) -> tuple[str, ...] | None:
    """The capture keys of an enabled trace request; None when no trace was asked for."""
    return tuple(msg.capture) if msg.enabled else None


def trace_to_proto(t: Trace) -> common_pb2.Trace:
    """Trace -> ``zerokl.v1.Trace``."""
    msg = common_pb2.Trace(token_ids=list(t.token_ids), meta=dict(t.meta))
    for o in t.ops:
        op = msg.ops.add(layer=o.layer, op=o.op, dtype=o.dtype, shape=list(o.shape), digests=list(o.digests))
        if o.values is not None:
            op.values = o.values
    return msg


def trace_from_proto(msg: common_pb2.Trace) -> Trace:
    """``zerokl.v1.Trace`` -> Trace."""
    from zerokl.kernels.trace import OpTrace, Trace
    ops = [OpTrace(o.layer, o.op, o.dtype, tuple(o.shape), list(o.digests),
                   o.values if o.HasField("values") else None) for o in msg.ops]
    return Trace(list(msg.token_ids), ops, dict(msg.meta))
