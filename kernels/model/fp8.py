"""An FP8 model: the block-scaled e4m3 weights of GLM-5-FP8 / DeepSeek-V3 checkpoints, applied
from outside the model (as parallelism and LoRA are).

`quantize_fp8(model)` replaces, in place, every quantized projection's weight by its e4m3
values (`ops.fp8_quantize_weight`: one fp32 scale per 128 x 128 block, stored beside it as
`<name>_scale_inv`, the checkpoints' name) so the model's GEMMs run `ops.fp8_linear`
(`model.gemm_weight`). Quantized, as in those checkpoints: the attention's q_a/q_b/kv_a/o
projections, the dense and shared MLPs and the routed experts. Kept in the model dtype:
embeddings, lm_head, norms, the router (fp32), the indexer, and kv_b_proj, which the absorbed
attention folds into the queries and values (DeepSeek's inference dequantizes it too).
Activations between the GEMMs stay in the model dtype (bf16 for an FP8 fleet).
"""
from __future__ import annotations

import torch
from torch import nn

from zerokl.kernels import ops
from zerokl.kernels.model.model import MLP, MLAttention, Model, MoE

__all__ = ["QUANTIZED_PROJECTIONS", "is_fp8", "quantize_fp8"]

# (module type, attribute names) whose weights an FP8 model holds in e4m3.
QUANTIZED_PROJECTIONS: tuple[tuple[type, tuple[str, ...]], ...] = (
    (MLAttention, ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")),
    (MLP, ("gate_proj", "up_proj", "down_proj")),
)
_EXPERTS = ("gate_proj", "up_proj", "down_proj")    # MoE's stacked [E, out, in] expert weights


def is_fp8(model: nn.Module) -> bool:
    """True when the model's projections hold e4m3 weights."""
    return any(p.dtype == torch.float8_e4m3fn for p in model.parameters())


@torch.no_grad()
def quantize_fp8(model: Model) -> Model:
    """Quantize the model's projections to block-scaled e4m3 in place (see the module docstring);
    returns the model. Deterministic: the same weights give the same bytes on any device."""
    if is_fp8(model):
        raise ValueError("quantize_fp8: the model is FP8 already")
    for module in model.modules():
        for kind, names in QUANTIZED_PROJECTIONS:
            if isinstance(module, kind):
                for name in names:
                    _quantize(getattr(module, name), "weight")
        if isinstance(module, MoE):
            for name in _EXPERTS:
                _quantize(module, name)
    return model


def _quantize(module: nn.Module, name: str) -> None:
    w = getattr(module, name)
    stacked = w.dim() == 3
    parts = [ops.fp8_quantize_weight(e) for e in (w if stacked else [w])]
    q = torch.stack([p[0] for p in parts]) if stacked else parts[0][0]
    scale = torch.stack([p[1] for p in parts]) if stacked else parts[0][1]
    setattr(module, name, nn.Parameter(q, requires_grad=False))
    module.register_buffer(name + "_scale_inv", scale)
