"""How the trainer marks what it keeps in the weight store: the metadata keys of the versions it records and the
owner name of the pin on its run's resume point.

Read by whoever picks among the trainer's versions without running it (the jobs manager in the scheduler), so
this module imports nothing: no torch, no checkpoint format.
"""
from __future__ import annotations

__all__ = ["META_RUN", "META_STATE", "pin_owner"]

META_RUN = "zerokl.run"
META_STATE = "zerokl.trainer_state"     # "full": a resume point; "none": serving weights only


def pin_owner(run: str) -> str:
    """Who pins the run's latest resume point in the weight store (so retention never deletes it)."""
    return f"trainer.{run}"
