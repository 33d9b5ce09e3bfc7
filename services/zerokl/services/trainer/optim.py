"""The optimizer step every trainer takes: one skeleton, with hooks for what differs.

    metrics = optimizer_step(trainer, grads, norm, lr, non_finite=..., after_update=..., release=...)

The single-process :class:`~zerokl.services.trainer.trainer.Trainer` and the
:class:`~zerokl.services.trainer.distributed.DistributedTrainer` differ in how the gradient norm
is computed (one device; or each local shard counted once over the world), in what happens
after AdamW (master weights rounded into the model) and in how a non-finite weight is found
(every rank must agree: an all-reduce), never in the step itself. So the step is here once, as
TorchTitan keeps its optimizer in ``components/optimizer.py`` out of the train loop:

1. ``lr`` defaults to the trainer's schedule (``lr_at(step)``); :class:`AdamParams` (one call's
   learning rate, betas, eps, weight decay and clip, as Tinker's ``optim_step`` sends them) set
   them all for this step instead of the trainer's configuration;
2. a snapshot of the trained tensors, the optimizer state and the learning rates;
3. clip: the gradients scaled by ``grad_clip / (norm + 1e-6)`` when ``norm > grad_clip > 0``;
4. AdamW at ``lr`` (an ``lr`` that overflows the parameters' dtype is a :class:`NonFiniteStep`);
5. ``after_update()``; then ``non_finite()`` names what is non-finite (or None);
6. any failure restores the snapshot and re-raises (a non-finite result as :class:`NonFiniteStep`);
7. always: the gradients are dropped (``zero_grad`` then ``release()``);
8. on success the step counter advances.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

__all__ = ["AdamParams", "NonFiniteStep", "optimizer_step"]

#: AdamW's eps when a step gives none (torch's default, what the trainer's optimizer is built with).
DEFAULT_EPS = 1e-8


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's hyperparameters, instead of the trainer's (TrainConfig's lr schedule,
    betas, weight decay, grad_clip and AdamW's default eps). Tinker's ``AdamParams``."""

    learning_rate: float                # this step's learning rate (0: the weights stay as they are)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0           # decoupled (AdamW)
    grad_clip_norm: float = 0.0         # clip the global gradient norm to this (0 = off)


class NonFiniteStep(ArithmeticError):
    """An optimizer step would have left a parameter or optimizer state non-finite; it was undone."""


class _Steppable(Protocol):
    step: int
    optimizer: torch.optim.Optimizer

    @property
    def config(self): ...
    def lr_at(self, step: int) -> float: ...
    def snapshot(self): ...
    def restore(self, snapshot) -> None: ...


def _nothing() -> None:
    return None


def optimizer_step(trainer: _Steppable, grads: Sequence[torch.Tensor], norm: float, lr: float | None, *,
                   non_finite: Callable[[], str | None], after_update: Callable[[], None] = _nothing,
                   release: Callable[[], None] = _nothing, adam: AdamParams | None = None) -> dict:
    """One guarded AdamW step of ``trainer`` over ``grads`` (whose norm is ``norm``); returns
    ``{"grad_norm", "lr", "step"}``. ``non_finite()`` returns what the step made non-finite
    (e.g. "2 tensor(s) non-finite, e.g. ...") or None. ``adam`` (then ``lr`` must be None) sets
    this step's hyperparameters; without it they are the trainer's configuration's."""
    config = trainer.config
    if adam is not None:
        if lr is not None:
            raise ValueError("give lr or adam, not both")
        lr, betas, eps, decay, clip = (adam.learning_rate, (adam.beta1, adam.beta2), adam.eps, adam.weight_decay,
                                       adam.grad_clip_norm)
    else:
        lr, betas, eps, decay, clip = (lr or trainer.lr_at(trainer.step), config.betas, DEFAULT_EPS,
                                       config.weight_decay, config.grad_clip)
    before = trainer.snapshot()
    try:
        if clip > 0 and norm > clip:
            scale = clip / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        for group in trainer.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=decay)
        try:
            trainer.optimizer.step()
        except RuntimeError as err:
            # AdamW casts lr / bias_correction to the parameters' dtype: an lr that overflows it fails mid-loop.
            if "overflow" not in str(err):
                raise
            raise NonFiniteStep(f"the optimizer step at lr={lr:g} overflows: {err}") from None
        after_update()
        bad = non_finite()
        if bad:
            raise NonFiniteStep(f"the optimizer step at lr={lr:g} (gradient norm {norm:g}) made {bad}")
    except BaseException:
        trainer.restore(before)
        raise
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        release()
    trainer.step += 1
    return {"grad_norm": norm, "lr": lr, "step": trainer.step}
