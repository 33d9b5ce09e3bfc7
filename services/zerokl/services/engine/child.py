"""Spawn the engine process; for a replica, first thing, so its imports overlap the server's start.

This module imports nothing heavy (no torch, nothing of the engine at import time): `zerokl serve
prefill|decode` calls :func:`prestart` first thing, so the spawned child imports torch and the library
while the server process imports its own (gRPC, the service runtime; a decode server no torch: see
:mod:`zerokl.services.inference.server`); the server then hands the child its engine factory
(:meth:`zerokl.services.inference.AsyncEngine.spawn` with :func:`take`'s process). On an H200 host torch's
import is ~2 s of a replica's start-up; a child nobody takes is stopped at exit (a daemon process) or by
:func:`discard`. The child runs :func:`zerokl.services.engine.core.serve`.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any

__all__ = ["prestart", "take", "discard", "start"]

_started: tuple[Any, Any] | None = None   # (process, parent end of its pipe)


def start(name: str = "zerokl-engine", threads: int | None = None) -> tuple[Any, Any]:
    """Spawn an engine process now; returns (process, parent end of its duplex pipe).

    Call from a thread that lives as long as the engine (the main thread): the child is armed to die
    with the thread that spawns it. ``threads``: the child's torch threads (None: torch's default).
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_main, args=(child, os.getpid(), threads), name=name, daemon=True)
    process.start()
    child.close()
    return process, parent


def prestart() -> None:
    """Spawn the engine process now, for :func:`take` (from the main thread: see :func:`start`)."""
    global _started
    if _started is not None:
        return
    _started = start()


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


def _main(conn: Any, parent_pid: int, threads: int | None) -> None:
    # Imported here, in the child: importing this module must not import torch (see the module docstring).
    from zerokl.services.engine.core import serve
    serve(conn, parent_pid, threads)
