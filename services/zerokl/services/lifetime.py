"""A helper process's life tied to its parent's: the engine process of a replica, the trainer's record process.

A leaf (the standard library only), so the engine, which imports nothing of the service runtime, and the
trainer read the one definition. (`zerokl up` arms its services the same way, in the exec wrapper it runs
before each one: zerokl/up.py.)
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Linux: ask the kernel for ``sig`` when this process's parent dies (``PR_SET_PDEATHSIG``: no orphan holding
    a device or an upload). False when the parent ``parent_pid`` died before that was armed: the caller exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)   # PR_SET_PDEATHSIG = 1
    return os.getppid() == parent_pid
