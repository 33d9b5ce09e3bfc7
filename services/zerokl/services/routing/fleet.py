"""The fleet's target weights version, recorded durably in the scheduler's state directory.

The scheduler writes ``fleet.json`` each time it switches the whole fleet to a
version (after its canary); ``zerokl up`` writes it once at start for the version it
serves. A replica that restarts is brought back at this version (by ``zerokl up``'s
supervisor, and by the scheduler itself for one that came back at another), and a
restarted ``zerokl up`` serves it: it is the newest version that passed a canary and
that the whole fleet served. Kept in its own module so ``zerokl up`` reads it without
importing the routing stack.
"""
from __future__ import annotations

import json
import os
import pathlib

__all__ = ["FLEET_FILE", "read_fleet_version", "write_fleet_version"]

FLEET_FILE = "fleet.json"


def read_fleet_version(state_dir: str | os.PathLike[str]) -> str:
    """The version recorded in ``state_dir`` ("" when none is, or the file is unreadable)."""
    try:
        version = json.loads((pathlib.Path(state_dir) / FLEET_FILE).read_text())["weights_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return version if isinstance(version, str) else ""


def write_fleet_version(state_dir: str | os.PathLike[str], version: str) -> None:
    """Record ``version`` as the fleet's target (atomically: a crash leaves the old or the new record)."""
    folder = pathlib.Path(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (FLEET_FILE + ".tmp")
    tmp.write_text(json.dumps({"weights_version": version}) + "\n")
    tmp.replace(folder / FLEET_FILE)
