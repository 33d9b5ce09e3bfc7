"""The optimizer step every trainer takes: one skeleton, with hooks for what differs.

    metrics = optimizer_step(trainer, grads, norm, lr, non_finite=..., after_update=..., release=...)

The single-process :class:`~zerokl.services.trainer.trainer.Trainer` and the
:class:`~zerokl.services.trainer.distributed.DistributedTrainer` differ in how the gradient norm
is computed (one device; or each local shard counted once over the world), in what happens
after AdamW (master weights rounded into the model) and in how a non-finite weight is found
(every rank must agree: an all-reduce), never in the step itself. So the step is here once, as
TorchTitan keeps its optimizer in ``components/optimizer.py`` out of the train loop:

1. ``lr`` defaults to the trainer's schedule (``lr_at(step)``);
   :class:`~zerokl.services.trainer.types.AdamParams` (one call's learning rate, betas, eps, weight
   decay and clip, as Tinker's ``optim_step`` sends them) set them all for this step instead of the
   trainer's configuration;
2. a snapshot of the trained tensors, the optimizer state and the learning rates;
3. clip: the gradients scaled by ``grad_clip / (norm + 1e-6)`` when ``norm > grad_clip > 0``;
4. AdamW at ``lr`` (an ``lr`` that overflows the parameters' dtype is a :class:`NonFiniteStep`);
5. ``after_update()``; then ``non_finite()`` names what is non-finite (or None);
6. any failure restores the snapshot and re-raises (a non-finite result as :class:`NonFiniteStep`);
7. always: the gradients are dropped (``zero_grad`` then ``release()``);
8. on success the step counter advances.

On a CPU the step's arithmetic is the same on every machine, as the torch backend's forward is
(NUMERICS.md, "The trainer's update on a CPU"): :func:`grad_norm` sums the squares exactly
(``portable.row_sum``) and takes the correctly rounded square root (``portable.sqrt32``), and
:class:`PortableAdamW` is AdamW from IEEE basic operations and ``portable.sqrt32`` (torch's AdamW
takes ``torch.sqrt``, MKL's vector math on a CPU, and fused ``lerp``/``addcmul``/``addcdiv``
kernels, whose rounding follows ATen's code path). On CUDA both are torch's own.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Protocol, Sequence

import torch

from zerokl.kernels import portable
from zerokl.services.trainer.types import AdamParams

__all__ = ["NonFiniteStep", "PortableAdamW", "adamw", "grad_norm", "optimizer_step"]

#: AdamW's eps when a step gives none (torch's default, what the trainer's optimizer is built with).
DEFAULT_EPS = 1e-8


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


def grad_norm(grads: Sequence[torch.Tensor]) -> float:
    """The global L2 norm of ``grads``: each tensor's sum of fp32 squares, those sums added in order in
    fp32, the square root of the total.

    On a CPU the same bits on every machine: each tensor's squares are summed exactly
    (``portable.row_sum``: one rounding, any order) and the root is ``portable.sqrt32`` (correctly
    rounded; ``torch.sqrt`` of a CPU tensor is MKL's vector math, whose last bit follows the CPU)."""
    if not grads:
        return 0.0
    if grads[0].device.type != "cpu":
        return float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads)))
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        square = g.detach().float() ** 2
        total = total + portable.row_sum(square.reshape(1, -1))[0]
    return float(portable.sqrt32(total))


def _power(base: float, n: int) -> float:
    """base ** n for an integer n >= 0 by repeated squaring: IEEE multiplications only (Python's
    ``**`` calls the C library's pow, whose last bit may follow the CPU's FMA support)."""
    result = 1.0
    while n:
        if n & 1:
            result *= base
        base *= base
        n >>= 1
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the distributed trainer's parameters); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class PortableAdamW(torch.optim.Optimizer):
    """AdamW as ``torch.optim.AdamW`` defines it (decoupled weight decay, bias-corrected moments,
    ``eps`` outside the root), with its state keys (``step``, ``exp_avg``, ``exp_avg_sq``) and
    param-group keys, so state dicts load either way; its bits are the same on every CPU.

    Every operation is one IEEE basic operation on a tensor (each correctly rounded in the tensor's
    dtype), the square root is ``portable.sqrt32`` and the bias corrections' powers are Python
    multiplications, in this order, for each parameter p with gradient g at step t::

        p = p * (1 - lr * weight_decay)
        m = m * beta1 + g * (1 - beta1)
        v = v * beta2 + (g * g) * (1 - beta2)
        p = p + (m / (sqrt(v) / sqrt(1 - beta2^t) + eps)) * -(lr / (1 - beta1^t))

    torch's AdamW computes the same formula with fused ``lerp``, ``addcmul`` and ``addcdiv`` kernels
    (vectorized with or without FMA by ATen's code path) and ``torch.sqrt`` (MKL's vector math): its
    bits follow the machine. A step size that overflows the parameters' dtype raises (RuntimeError,
    "overflows") before that parameter changes, as torch's does (:func:`optimizer_step` undoes the
    parameters stepped before it).
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": False,
                    "maximize": False, "foreach": False, "capturable": False, "differentiable": False,
                    "fused": None}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                t = int(state["step"]) + 1
                step_size = lr / (1.0 - _power(beta1, t))
                limit = torch.finfo(p.dtype).max
                if not (abs(step_size) <= limit and abs(lr * wd) <= limit):
                    raise RuntimeError(f"AdamW's step size {step_size:g} overflows {p.dtype}")
                root_bc2 = math.sqrt(1.0 - _power(beta2, t))     # correctly rounded (the sqrtsd instruction)
                state["step"].add_(1.0)
                w, g = _local(p), _local(p.grad)
                m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                if wd != 0.0:
                    w.mul_(1.0 - lr * wd)
                m.mul_(beta1).add_(g * (1.0 - beta1))
                v.mul_(beta2).add_((g * g) * (1.0 - beta2))
                denom = (portable.sqrt32(v).to(v.dtype) / root_bc2) + eps
                w.add_((m / denom) * -step_size)


def adamw(params: Sequence[torch.Tensor], lr: float, betas: tuple[float, float], weight_decay: float,
          device: torch.device) -> torch.optim.Optimizer:
    """The trainer's AdamW over ``params`` on ``device``: :class:`PortableAdamW` on a CPU (the same bits
    on every CPU), torch's single-tensor AdamW elsewhere (``foreach=False``: one fixed loop over the
    parameters; the device's own IEEE square root)."""
    if device.type == "cpu":
        return PortableAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)


def _nothing() -> None:
    return None


def optimizer_step(trainer: _Steppable, grads: Sequence[torch.Tensor], norm: float, lr: float | None, *,
                   non_finite: Callable[[], str | None], after_update: Callable[[], None] = _nothing,
                   release: Callable[[], None] = _nothing, adam: AdamParams | None = None,
                   run: Callable[[float | None], None] | None = None) -> dict:
    """One guarded AdamW step of ``trainer`` over ``grads`` (whose norm is ``norm``); returns
    ``{"grad_norm", "lr", "step"}``. ``non_finite()`` returns what the step made non-finite
    (e.g. "2 tensor(s) non-finite, e.g. ...") or None. ``adam`` (then ``lr`` must be None) sets
    this step's hyperparameters; without it they are the trainer's configuration's. ``run(scale)``
    clips and steps instead of the default (``grads`` times ``scale``, None: no clip; then
    ``trainer.optimizer.step()``): the offloaded trainer makes each fp32 gradient, clips and steps it
    one parameter at a time (the same operations, so the same bits)."""
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
        scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else None
        for group in trainer.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=decay)
        try:
            if run is not None:
                run(scale)
            else:
                if scale is not None:
                    for g in grads:
                        g.mul_(scale)
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
