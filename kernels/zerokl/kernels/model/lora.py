"""LoRA adapters applied from outside the model (torch parametrizations on projection weights).

Numerics: an adapted projection computes with the merged weight
`W' = (W.float() + scale * (B @ A)).to(W.dtype)`, formed once per forward from weights only.
Serving the merged checkpoint therefore gives the same bits as the adapted model, and
`merge_lora` / `unmerge_lora` are exact (NUMERICS.md, "LoRA").
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from zerokl.kernels import ops
from zerokl.kernels.portable import standard_normal
from zerokl.kernels.model.model import Linear, Model

__all__ = ["LoRA", "DEFAULT_TARGETS", "apply_lora", "merge_lora", "unmerge_lora", "lora_parameters",
           "merged_state_dict"]

DEFAULT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRA(nn.Module):
    """W -> W + (alpha / rank) * B @ A, with A [rank, in] random and B [out, rank] zero at start."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.scale = alpha / rank
        # Integer draws (portable.standard_normal): torch.randn's vector code follows the CPU's ISA, so the
        # same seed gave other adapters, and so another training run, on another CPU code path.
        self.lora_A = nn.Parameter(standard_normal((rank, in_features), generator) * in_features ** -0.5)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        delta = ops.linear(self.lora_B.float(), self.lora_A.float().t()) * self.scale   # [out, in]
        return (weight.float() + delta).to(weight.dtype)


def apply_lora(model: Model, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = DEFAULT_TARGETS,
               seed: int = 0) -> list[str]:
    """Add LoRA to every Linear whose attribute name is in `targets`; freeze everything else.

    Returns the adapted module names. Routed experts (stacked 3D weights) and the router
    are not adapted.
    """
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in targets:
            out_f, in_f = module.weight.shape
            # Drawn on the CPU (the same adapters on every device), placed beside the weight.
            adapter = LoRA(out_f, in_f, rank, alpha, g).to(module.weight.device)
            parametrize.register_parametrization(module, "weight", adapter)
            adapted.append(name)
    return adapted


def lora_parameters(model: Model) -> list[nn.Parameter]:
    """The trainable adapter parameters."""
    return [p for n, p in model.named_parameters() if "lora_" in n]


def merge_lora(model: Model) -> None:
    """Bake every adapter into its weight (bitwise the weight the adapted forward used)."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def unmerge_lora(model: Model) -> None:
    """Drop every adapter and restore the original base weights exactly."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


@torch.no_grad()
def merged_state_dict(model: Model, copy: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter baked in, without touching the model.

    Each adapted weight is read through its parametrization, i.e. the exact tensor the
    adapted forward uses. (Deep-copying a parametrized model and merging the copy is not
    safe: the copies share the generated module class, and removing the parametrization
    from one removes it from both.) ``copy`` False: every other tensor is the model's own
    (detached, not cloned), for a caller that copies them before the model changes: a second
    copy of a large model may not fit beside it.
    """
    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if copy else t.detach()

    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        parametrized = parametrize.is_parametrized(module, "weight")
        if parametrized:
            out[prefix + "weight"] = own(module.weight)
        for pname, p in module.named_parameters(recurse=False):
            out[prefix + pname] = own(p)
        for bname, b in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                out[prefix + bname] = own(b)
    return {k: v for k, v in out.items() if ".parametrizations." not in k and "lora_" not in k}
