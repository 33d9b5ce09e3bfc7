"""The trainer's forward + backward replayed as CUDA graphs, per batch shape (TrainConfig.cuda_graphs).

A training step of a small model is thousands of kernel launches, each a few microseconds of
work: on an H200 `small`'s 8 x 512 SFT step kept the GPU busy 22% of its wall time (4,399
kernels, 60 ms of kernel time in a 132 ms step; docs/perf.md, issue 34). A graph replays the
same kernels with the same arguments in one launch, so its results are bitwise the eager
step's: the graph changes when kernels start, never what they compute.

Per key (the objective, its batch's shapes, the host-known sampling filters): the first step
runs eagerly (kernels compile), the second runs once more under CUDA's sync-debug "error"
mode on a side stream, proving nothing in it reads the device back, then is captured and
replayed; later steps copy their inputs into the graph's buffers and replay. A step that
reads the device (or fails to capture) runs eagerly from then on for that key. Gradients
come out in the graph's own tensors and are handed to the parameters' ``.grad``; a step
entered with gradients already accumulated runs eagerly (it adds to them).
"""
from __future__ import annotations

import collections
import logging
import traceback
from typing import Callable, Hashable, Sequence

import torch

from zerokl.kernels.cuda_graphs import no_cyclic_gc, sync_checked

__all__ = ["StepGraphs"]

log = logging.getLogger(__name__)

Step = Callable[[Sequence[torch.Tensor]], dict[str, torch.Tensor]]


def _where(err: BaseException) -> str:
    """file:line of the innermost zerokl frame that raised (where a step read the device back)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "zerokl" in f.filename or "/kernels/" in f.filename
              or "/services/" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "?"


class _Captured:
    def __init__(self, graph: "torch.cuda.CUDAGraph", inputs: list[torch.Tensor], outputs: dict[str, torch.Tensor],
                 grads: list[torch.Tensor | None]):
        self.graph, self.inputs, self.outputs, self.grads = graph, inputs, outputs, grads


class StepGraphs:
    """Captured forward + backward steps of one trainer's parameters, at most ``max_graphs`` kept
    (least recently used dropped first: each holds its activations' memory)."""

    def __init__(self, params: Sequence[torch.Tensor], max_graphs: int = 8):
        self.params = list(params)
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[Hashable, _Captured] = collections.OrderedDict()
        self._seen: set[Hashable] = set()
        self._eager: set[Hashable] = set()         # keys whose step cannot be captured
        self._pool = None
        self.replays = 0

    def run(self, key: Hashable, inputs: Sequence[torch.Tensor], step: Step) -> dict[str, torch.Tensor]:
        """``step(inputs)`` (forward, backward, returns 0-dim metric tensors), replayed from a graph
        when ``key`` has one. ``step`` must read only ``inputs`` and the parameters, and must not
        read the device back (the sync check finds a step that does: it then stays eager)."""
        if key in self._eager or any(p.grad is not None for p in self.params):
            return step(inputs)
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._seen:
                self._seen.add(key)
                return step(inputs)                 # the first step of a shape: kernels compile
            captured = self._capture(key, inputs, step)
            if captured is None:
                return step(inputs)
        self._graphs.move_to_end(key)
        for static, new in zip(captured.inputs, inputs, strict=True):
            static.copy_(new)
        captured.graph.replay()
        self.replays += 1
        for p, g in zip(self.params, captured.grads, strict=True):
            p.grad = g
        return captured.outputs

    def _capture(self, key: Hashable, inputs: Sequence[torch.Tensor], step: Step) -> _Captured | None:
        device = inputs[0].device
        static = [t.clone() for t in inputs]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream), sync_checked():
                step(static)                        # proves the step reads nothing back
            torch.cuda.current_stream(device).wait_stream(stream)
            self._drop_grads()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with no_cyclic_gc(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = step(static)
        except Exception as err:  # noqa: BLE001 - a step that synchronizes (or any capture failure): eager
            if "CUDA error" in str(err):
                raise                               # the device failed: no fallback hides it
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.current_stream(device).synchronize()
            self._drop_grads()
            self._eager.add(key)
            log.warning("training steps of this shape run without CUDA graphs: capture failed (%s: %s, at %s)",
                        type(err).__name__, err, _where(err))
            return None
        grads = [p.grad for p in self.params]
        self._drop_grads()
        captured = self._graphs[key] = _Captured(graph, static, outputs, grads)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return captured

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def clear(self) -> None:
        """Forget every graph (their memory returns once nothing else holds the pool)."""
        self._graphs.clear()
        self._seen.clear()
        self._eager.clear()
        self._pool = None
