"""Activation checkpointing per block, applied from outside the model.

`checkpoint_blocks(model)` makes each decoder block keep only its inputs during a
training forward and recompute its activations in the backward
(torch.utils.checkpoint, non-reentrant). The model's code and parameters are untouched:
each block's `forward` is shadowed by a bound method for the duration of the `with`.

Bits: the recomputed forward runs the same ops on the same inputs under the same
zerokl backend (captured at the forward: the backward may run on autograd's device
thread, where the backend context variable is not set), and every op is deterministic,
so activations, loss and gradients are bitwise those without checkpointing.
"""
from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from zerokl.kernels.backend import get_backend, use_backend
from zerokl.kernels.model.model import Model

__all__ = ["checkpoint_blocks"]


def _checkpointed_forward(block: torch.nn.Module, *args):
    """Block.forward through torch.utils.checkpoint when a gradient is being recorded."""
    forward = type(block).forward.__get__(block)
    if not torch.is_grad_enabled():
        return forward(*args)
    backend = get_backend()

    def run(*inputs):
        with use_backend(backend):
            return forward(*inputs)

    # No RNG in the model's forward (no dropout): its state need not be saved and restored.
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)


@contextlib.contextmanager
def checkpoint_blocks(model: Model, enabled: bool = True) -> Iterator[Model]:
    """Within the `with`, every block of `model` recomputes its activations in the backward.

    enabled=False is a no-op (so callers can pass a config flag). The backward may run
    after the `with` has ended: the recompute calls the block's own forward.
    """
    if not enabled:
        yield model
        return
    blocks = list(model.layers)
    for block in blocks:
        # A bound method (not a closure over the block): deepcopy re-binds it to the copy.
        block.forward = types.MethodType(_checkpointed_forward, block)
    try:
        yield model
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)
