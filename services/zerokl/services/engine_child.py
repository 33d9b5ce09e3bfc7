"""Start a replica's engine process before the server imports torch, so the two imports overlap.

(Here, not in zerokl.services.inference: that package imports torch.)

`zerokl serve prefill|decode` calls :func:`prestart` first thing (this module imports nothing heavy):
the spawned child imports torch and the library while the server process does the same; the server
then hands the child its engine factory (:meth:`AsyncEngine.spawn` with :func:`take`'s process). On
an H200 host each import is ~2 s of a replica's start-up; a child nobody takes is stopped at exit
(a daemon process) or by :func:`discard`.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any

__all__ = ["prestart", "take", "discard"]

_started: tuple[Any, Any] | None = None   # (process, parent end of its pipe)


def prestart() -> None:
    """Spawn the engine process now (from the main thread: it is armed to die with the thread that spawns it)."""
    global _started
    if _started is not None:
        return
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_main, args=(child, os.getpid()), name="zerokl-engine", daemon=True)
    process.start()
    child.close()
    _started = (process, parent)


def take() -> tuple[Any, Any] | None:
    """The prestarted (process, pipe), once; None when none was started."""
    global _started
    started, _started = _started, None
    return started


def discard() -> None:
    """Stop a prestarted engine process nobody will use (e.g. --tp > 1 runs the engine on a thread)."""
    started = take()
    if started is not None:
        process, conn = started
        conn.close()       # the child reads the end of the pipe and exits
        process.join(10)
        if process.is_alive():
            process.kill()


# The child's entry point, named rather than imported: this module stays free of the inference
# package (which imports torch, and imports this module), as the CLI names each service's main.
_CHILD_MAIN = "zerokl.services.inference.async_engine:_child_main"


def _main(conn: Any, parent_pid: int) -> None:
    import importlib
    module, func = _CHILD_MAIN.split(":")
    getattr(importlib.import_module(module), func)(conn, parent_pid, None)
