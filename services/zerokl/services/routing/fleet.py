"""The fleet's weights versions, recorded durably in the scheduler's state directory (``fleet.json``).

The record holds the fleet's *target* version and the versions the whole fleet
served before it (each passed its canary, or was the version ``zerokl up`` started
with), the most recently served last. The scheduler rewrites it at each whole-fleet
switch; ``zerokl up`` writes it at start for the version it serves. A replica that
restarts is brought back at the target (by ``zerokl up``'s supervisor, and by the
scheduler itself for one that came back at another), and a restarted ``zerokl up``
serves it.

A target whose bytes in the weight store turn out corrupt (DATA_LOSS: no replica
can load it again) is given up for the newest good version still in the store:
:meth:`FleetRecord.fell_back` drops it from the good versions and says why in ``note``,
which ``zerokl status`` shows. Kept in its own module so ``zerokl up`` reads it
without importing the routing stack.
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

__all__ = ["FLEET_FILE", "KEEP_GOOD", "FleetRecord", "read_fleet", "write_fleet"]

FLEET_FILE = "fleet.json"
# Good versions remembered (an RL job adds one a step): a fallback reaches this far back.
KEEP_GOOD = 64


@dataclass(frozen=True)
class FleetRecord:
    """What ``fleet.json`` says."""

    weights_version: str = ""         # the fleet's target: every replica serves it ("" before any record)
    good: tuple[str, ...] = ()        # versions the whole fleet served, the most recently served last
    note: str = ""                    # why the target is a fallback ("" when it was switched to as such)

    def fallbacks(self, exclude: str) -> list[str]:
        """The good versions other than ``exclude``, the most recently served first: where to fall back."""
        return [v for v in reversed(self.good) if v != exclude]

    def served(self, version: str) -> "FleetRecord":
        """The record once the whole fleet serves ``version`` (its target and most recently served good one)."""
        good = tuple(v for v in self.good if v != version) + (version,)
        return FleetRecord(version, good[-KEEP_GOOD:])

    def fell_back(self, corrupt: str, version: str, reason: str) -> "FleetRecord":
        """The record once ``corrupt`` was found unservable (``reason``) and the fleet fell back to ``version``."""
        good = tuple(v for v in self.good if v not in (corrupt, version)) + (version,)
        return FleetRecord(version, good[-KEEP_GOOD:], f"weights version {corrupt} is corrupt in the weight store "
                                                       f"({reason}); the fleet fell back to {version}")


def read_fleet(state_dir: str | os.PathLike[str]) -> FleetRecord:
    """The record in ``state_dir`` (an empty one when there is none, or it is unreadable)."""
    try:
        d = json.loads((pathlib.Path(state_dir) / FLEET_FILE).read_text())
        version = d["weights_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return FleetRecord()
    if not isinstance(version, str):
        return FleetRecord()
    good = d.get("good", [version] if version else [])      # a record written before the list: its target
    good = tuple(v for v in good if isinstance(v, str)) if isinstance(good, list) else (version,)
    note = d.get("note", "")
    return FleetRecord(version, good, note if isinstance(note, str) else "")


def write_fleet(state_dir: str | os.PathLike[str], record: FleetRecord) -> FleetRecord:
    """Write ``record`` into ``state_dir`` atomically (a crash leaves the old or the new one); returns it."""
    folder = pathlib.Path(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (FLEET_FILE + ".tmp")
    tmp.write_text(json.dumps({"weights_version": record.weights_version, "good": list(record.good),
                               "note": record.note}) + "\n")
    tmp.replace(folder / FLEET_FILE)
    return record
