"""Routing decisions: which numbers a request is pinned to, and which replica computes them.

Pure functions of :class:`~.registry.ReplicaView` snapshots, no I/O. Two
replicas may serve parts of one request (a retry, a prefill -> decode
handoff) only when they compute the same bits, so every request is first
resolved to a complete :class:`Pin` (numerics fingerprint *and* weights
version): what the request names, else the scheduler's configured pin, else
the one value every healthy replica agrees on. When healthy replicas
disagree and nothing pins the difference, the request is refused with
FAILED_PRECONDITION naming the replicas on each side: a mixed fleet is never
averaged over. Only replicas whose polled identity equals the pin are routed
to.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from zerokl.services.runtime.errors import FailedPrecondition, PreconditionViolation, Unavailable, UnservedPin
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.routing.registry import ReplicaView

__all__ = ["Pin", "Policy", "resolve_pin", "Router", "NoReplica", "MixedFleet"]


@dataclass(frozen=True)
class Pin:
    """What a request must be computed with; an empty field admits any value."""

    weights_version: str = ""
    numerics_fingerprint: str = ""

    def over(self, fallback: "Pin") -> "Pin":
        """Each field from ``self`` when set, else from ``fallback``."""
        return Pin(self.weights_version or fallback.weights_version,
                   self.numerics_fingerprint or fallback.numerics_fingerprint)

    @property
    def complete(self) -> bool:
        return bool(self.weights_version and self.numerics_fingerprint)

    def admits(self, identity: ServiceIdentity | None) -> bool:
        """Whether a replica with ``identity`` computes what this pin asks for."""
        return identity is not None and all(
            not want or want == getattr(identity, field) for field, want in self._fields())

    def describe(self) -> str:
        parts = [f"{field} {want!r}" for field, want in self._fields() if want]
        return ", ".join(parts) or "no pin"

    def _fields(self) -> tuple[tuple[str, str], ...]:
        return (("numerics_fingerprint", self.numerics_fingerprint), ("weights_version", self.weights_version))


class Policy(str, enum.Enum):
    """How the router picks among equally good replicas."""

    LEAST_LOADED = "least-loaded"   # fewest requests in flight from this scheduler; ties in turn
    ROUND_ROBIN = "round-robin"     # strictly in turn


class NoReplica(Unavailable):
    """No healthy replica admits the pin right now (one that would is unhealthy, or none is registered)."""


class MixedFleet(FailedPrecondition):
    """Healthy replicas disagree on what they compute and nothing pins which one the request wants."""


# Identity fields that must agree among the replicas serving one pin, with the flag that pins each.
_AGREE: tuple[tuple[str, str], ...] = (
    ("numerics_fingerprint", "the request's numerics_fingerprint or the scheduler's --pin-fingerprint"),
    ("weights_version", "the request's weights_version or the scheduler's --pin-weights-version"),
    ("model_config_hash", "a consistent model config for that weights version"),
)


def _groups(views: Iterable[ReplicaView], field: str) -> dict[str, list[ReplicaView]]:
    out: dict[str, list[ReplicaView]] = defaultdict(list)
    for v in views:
        assert v.identity is not None
        out[getattr(v.identity, field)].append(v)
    return dict(sorted(out.items()))


def _mixed(field: str, how: str, groups: dict[str, list[ReplicaView]], pin: Pin) -> MixedFleet:
    label = field.replace("_", " ")
    sides = "; ".join(f"{value or '(none)'!r} on {', '.join(v.describe() for v in views)}"
                      for value, views in groups.items())
    scope = f" among replicas matching {pin.describe()}" if pin.describe() != "no pin" else ""
    return MixedFleet(
        f"mixed fleet: healthy replicas disagree on {label}{scope}: {sides}. The scheduler never mixes them in "
        f"one request; pin one with {how}",
        precondition_violations=[PreconditionViolation("MIXED_FLEET", f"{field}={value}",
                                                       "served by " + ", ".join(v.describe() for v in views))
                                 for value, views in groups.items()])


def resolve_pin(views: Sequence[ReplicaView], requested: Pin, configured: Pin = Pin(),
                roles: Sequence[str] = ("prefill", "decode")) -> Pin:
    """The complete pin a request runs under.

    Each field comes from ``requested``, else ``configured``, else the single
    value the healthy replicas of ``roles`` admitted so far agree on (the
    fingerprint is settled first: weights versions are only compared among
    replicas that compute alike). Raises FAILED_PRECONDITION for a mixed
    fleet or a pin no known replica has ever served, :class:`NoReplica`
    (UNAVAILABLE) when replicas that would match exist but none is healthy.
    """
    pin = requested.over(configured)
    known = [v for v in views if v.role in roles and v.identity is not None]
    healthy = [v for v in known if v.healthy]
    for field, how in _AGREE:
        admitted = [v for v in healthy if pin.admits(v.identity)]
        groups = _groups(admitted, field)
        if len(groups) > 1:
            raise _mixed(field, how, groups, pin)
        if not groups:
            break
        if field != "model_config_hash" and not getattr(pin, field):
            pin = dataclasses.replace(pin, **{field: next(iter(groups))})
    if any(v.healthy and pin.admits(v.identity) for v in known) and pin.complete:
        return pin
    if any(pin.admits(v.identity) for v in known):
        raise NoReplica(f"no healthy replica serves {pin.describe()} right now: "
                        + "; ".join(f"{v.describe()}: {v.reason}" for v in known if pin.admits(v.identity)))
    if not healthy:
        raise NoReplica("no healthy replica: " + ("; ".join(f"{v.describe()}: {v.reason}" for v in views)
                                                  or "none registered"))
    served = _groups(healthy, "numerics_fingerprint")
    fleet = "; ".join(
        f"{v.describe()} serves fingerprint {v.identity.numerics_fingerprint!r} weights "  # type: ignore[union-attr]
        f"{v.identity.weights_version!r}" for vs in served.values() for v in vs)  # type: ignore[union-attr]
    violations = [PreconditionViolation(field.upper(), want, f"no replica serves {field} {want!r}")
                  for field, want in pin._fields() if want]
    raise UnservedPin(f"no replica serves {pin.describe()}; the fleet: {fleet}",
                             precondition_violations=violations)


class Router:
    """Picks a replica of a role among those whose identity equals a (complete) pin."""

    def __init__(self, policy: Policy = Policy.LEAST_LOADED) -> None:
        self.policy = Policy(policy)
        self._turn: dict[str, itertools.count[int]] = defaultdict(itertools.count)

    def candidates(self, views: Sequence[ReplicaView], role: str, pin: Pin) -> list[ReplicaView]:
        """Healthy replicas of ``role`` that compute exactly ``pin``, in registry order."""
        return [v for v in views if v.role == role and v.healthy and pin.admits(v.identity)]

    def choose(self, views: Sequence[ReplicaView], role: str, pin: Pin,
               avoid: Callable[[ReplicaView], bool] = lambda v: False) -> ReplicaView | None:
        """The next replica for a request, or None when no candidate exists.

        Candidates for which ``avoid`` is true (replicas this request already
        failed on) are taken only when nothing else is left.
        """
        found = self.candidates(views, role, pin)
        preferred = [v for v in found if not avoid(v)] or found
        if not preferred:
            return None
        start = next(self._turn[role]) % len(preferred)
        rotated = preferred[start:] + preferred[:start]
        if self.policy is Policy.ROUND_ROBIN:
            return rotated[0]
        return min(rotated, key=lambda v: v.in_flight)  # min keeps the first of equals: ties go in turn
