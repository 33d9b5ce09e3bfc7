"""Weights version names, once: what a name may be, how a step's version is named, and reading it back.

A version is a weight store name (:func:`validate_name`; ``latest`` is reserved for reads). The ones
a trainer publishes without being given a name say the optimizer step they were taken at:
``<segment>-step000012``, where the segment is the run (the job's name) or, after the run's ``k``-th
fresh start, ``<run>.k`` (:func:`run_segment`), so a restarted run's steps never take a name the run
used for other bytes. The in-process ports of tests and the experiment name theirs
``<run>-00012`` (:meth:`WeightsVersion.in_process`). The RL loop reads the step back from either
form (:meth:`WeightsVersion.parse`) to tell how many updates a rollout's version is behind.

Names travel as strings (the wire, manifests, metrics): :class:`WeightsVersion` is how code builds
and reads them, and ``str()`` of a parsed name is that name byte for byte.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from zerokl.services.runtime.errors import InvalidArgument

__all__ = ["LATEST", "WeightsVersion", "validate_name", "run_segment", "segment_index"]

LATEST = "latest"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# A name that says its step: anything, "-", an optional "step", the digits last. The shortest head
# is taken, so "a-12-34" is step 34 of segment "a-12" (the digits run to the end).
_STEP_NAME = re.compile(r"(.*?)-(step)?(\d+)", re.DOTALL)


def validate_name(value: str, what: str) -> str:
    """A version id, shard name or pin owner: 1-128 of ``[A-Za-z0-9._-]``, starting alphanumeric."""
    if not _NAME.fullmatch(value or ""):
        raise InvalidArgument.field(what, f"{value!r} is not 1-128 characters of [A-Za-z0-9._-] starting "
                                          "with a letter or digit")
    return value


@dataclass(frozen=True)
class WeightsVersion:
    """A version name that says the optimizer step it was published at: ``<segment>-<marker><step>``,
    the step zero-padded to ``width`` digits. The defaults are the trainer's form (``run-step000012``)."""

    segment: str            # the run, or its segment after a fresh start (run_segment)
    step: int               # optimizer steps taken when the weights were published
    marker: str = "step"    # "" in the in-process ports' form
    width: int = 6          # digits at least (a larger step takes more)

    @classmethod
    def in_process(cls, run: str, step: int) -> WeightsVersion:
        """The in-process ports' form, ``<run>-00012``: experiment state folders and results hold these
        names, so it stays as they were written."""
        return cls(run, step, marker="", width=5)

    @classmethod
    def parse(cls, name: str) -> WeightsVersion | None:
        """``name`` read back (``str()`` of the result is ``name``); None: it does not end in a step."""
        m = _STEP_NAME.fullmatch(name)
        if m is None:
            return None
        segment, marker, digits = m.groups()
        return cls(segment, int(digits), marker or "", len(digits))

    @staticmethod
    def validate(name: str, what: str = "version") -> str:
        """``name`` if it may name a version (any store name but ``latest``, which names the newest in
        reads); else :class:`InvalidArgument` on field ``what``."""
        validate_name(name, what)
        if name == LATEST:
            raise InvalidArgument.field(what, f"{LATEST!r} is reserved")
        return name

    def __str__(self) -> str:
        return f"{self.segment}-{self.marker}{self.step:0{self.width}d}"


def run_segment(run: str, index: int) -> str:
    """The segment a run publishes under after its ``index``-th fresh start (a trainer reset to step 0 by
    LoadWeights without its state, e.g. a job with its own hyperparameters): ``run`` for the first,
    then ``run.2``, ``run.3``... so the new steps' versions never take names the run already used."""
    return run if index <= 1 else f"{run}.{index}"


def segment_index(run: str, name: str) -> int | None:
    """``name``'s index among ``run``'s segments (1 for ``run`` itself); None: not one of them."""
    if name == run:
        return 1
    head, _, tail = name.rpartition(".")
    return int(tail) if head == run and tail.isdigit() and not tail.startswith("0") and int(tail) >= 2 else None
