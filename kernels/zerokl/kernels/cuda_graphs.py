"""What every CUDA-graph capture needs (the engine's decode steps, the trainer's steps): no collector mid-capture, a check that nothing reads the device back."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

__all__ = ["no_cyclic_gc", "sync_checked"]


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """The cycle collector off for a capture: collecting an unreachable CUDA graph (of an engine dropped
    earlier, held in a reference cycle) destroys it mid-capture, which invalidates the capture
    (cudaErrorStreamCaptureInvalidated; seen on the H200 when a test built engine after engine)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def sync_checked() -> Iterator[None]:
    """Within the `with`, an operation that reads a device value back on the host raises (CUDA's
    sync-debug mode "error"): a run that passes can be captured as a graph."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
