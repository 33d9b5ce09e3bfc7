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

`quantize_fp8(model, masters=True)` is the trainer's FP8 model: each quantized weight stays a
trainable parameter (the master), its e4m3 values sit in `<name>_fp8`, the forward is the same
FP8 product the replicas compute (so trainer and replica logprobs are equal bit for bit) and
the backward is the model-dtype op's on the master (straight-through, ops.Fp8Weight).
`refresh_fp8` re-quantizes after each optimizer step (from the trainer's fp32 masters when it
passes them: one rounding, fp32 -> e4m3); `serving_state_dict` is what a replica loads (the e4m3
values under the weights' own names). `trainable_fp8` turns any model (fp32, bf16, or a served FP8
one read from a checkpoint) into the trainer's form; a served FP8 model keeps its very bytes, so a
trainer started from the version the replicas serve computes their bits at step 0.

What an FP8 fleet moves between trainer and replicas is the served form: e4m3 values (1 byte per
weight) and fp32 scales (4 bytes per 128 x 128 block), never the masters. Half the bytes of bf16
weights, and no quantization on the replica: its bits are the trainer's by construction.

Below the model graph (the checkpoint reader, itself below model.py, lays out an FP8 model with
it): the model's modules name their quantized weights (`FP8_PROJECTIONS`: Linear submodules,
`FP8_STACKED`: the MoE's stacked experts), so this module never imports their classes.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from zerokl.kernels import ops

__all__ = ["FP8_ACTIVATIONS", "is_fp8", "has_fp8_masters", "numerics_dtype", "quantize_fp8",
           "refresh_fp8", "serving_state_dict", "serving_fp8_model", "serving_fp8_state", "trainable_fp8"]

#: The dtype of everything an FP8 model keeps unquantized (activations, embeddings, norms, lm_head,
#: kv_b_proj, the indexer): bf16, as GLM-5-FP8 / DeepSeek-V3 serve; the fingerprint key
#: `.../float8_e4m3fn` means e4m3 projections with bf16 activations.
FP8_ACTIVATIONS = torch.bfloat16


def is_fp8(model: nn.Module) -> bool:
    """True when the model's projections compute in e4m3 (served or trained)."""
    return any(name.endswith("_scale_inv") for name, _ in model.named_buffers())


def has_fp8_masters(model: nn.Module) -> bool:
    """True for the trainer's FP8 form (quantize_fp8(masters=True)): masters beside `<name>_fp8` values."""
    return any(name.endswith("_fp8") for name, _ in model.named_buffers())


def numerics_dtype(model: nn.Module) -> torch.dtype:
    """The dtype that keys the model's fingerprint: float8_e4m3fn for an FP8 model, else its own."""
    return torch.float8_e4m3fn if is_fp8(model) else next(model.parameters()).dtype


def _quantized(model: nn.Module):
    """(module, attribute name) of every weight an FP8 model quantizes: the weights the model's
    modules name (model.py: FP8_PROJECTIONS, FP8_STACKED), in module order."""
    for module in model.modules():
        yield from ((getattr(module, name), "weight") for name in getattr(module, "FP8_PROJECTIONS", ()))
        yield from ((module, name) for name in getattr(module, "FP8_STACKED", ()))


@torch.no_grad()
def quantize_fp8(model: nn.Module, masters: bool = False) -> nn.Module:
    """Quantize the model's projections to block-scaled e4m3 in place (see the module docstring);
    returns the model. masters=True keeps each weight trainable beside its e4m3 values (the
    trainer's FP8 model). Deterministic: the same weights give the same bytes on any device."""
    if is_fp8(model):
        raise ValueError("quantize_fp8: the model is FP8 already")
    for module, name in _quantized(model):
        q, scale = ops.fp8_quantize_weight(getattr(module, name))
        if masters:
            module.register_buffer(name + "_fp8", q)
        else:
            setattr(module, name, nn.Parameter(q, requires_grad=False))
        module.register_buffer(name + "_scale_inv", scale)
    return model


@torch.no_grad()
def refresh_fp8(model: nn.Module, masters: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Re-quantize a trainer's FP8 model from its masters (after an optimizer step).

    masters: the tensor to quantize for a weight, keyed by the weight Parameter itself (identity,
    as optimizer state is): the trainer's fp32 masters, so each e4m3 value is one rounding of the
    fp32 weight (not of its bf16 rounding). A weight absent from it is quantized as it is."""
    for module, name in _quantized(model):
        w = getattr(module, name)
        q, scale = ops.fp8_quantize_weight(masters.get(w, w) if masters is not None else w)
        getattr(module, name + "_fp8").copy_(q)
        getattr(module, name + "_scale_inv").copy_(scale)


@torch.no_grad()
def trainable_fp8(model: nn.Module) -> nn.Module:
    """The trainer's FP8 form of `model`, in place; returns it.

    - An fp32 or bf16 model: rounded to bf16 (FP8_ACTIVATIONS) and quantized with masters
      (quantize_fp8(masters=True)): the bytes a replica gets quantizing the same bf16 weights.
    - A served FP8 model (e4m3 weights, e.g. read from a published version): each master is the
      dequantized weight in bf16 and the e4m3 values and scales are kept as they are, so until
      the first optimizer step the trainer computes exactly what the replicas serving that
      version compute (re-quantizing a dequantized block need not give its bytes back).
    - A trainer's FP8 model: unchanged.
    """
    if has_fp8_masters(model):
        return model
    if not is_fp8(model):
        return quantize_fp8(model.to(FP8_ACTIVATIONS), masters=True)
    model.to(FP8_ACTIVATIONS)                     # the rest of the model; e4m3 values and scales keep their bytes
    for module, name in _quantized(model):
        q = getattr(module, name).data
        scale = getattr(module, name + "_scale_inv")
        master = (ops.fp8_dequantize_weight(q, scale, FP8_ACTIVATIONS) if q.dim() == 2 else
                  torch.stack([ops.fp8_dequantize_weight(e, s, FP8_ACTIVATIONS) for e, s in zip(q, scale)]))
        setattr(module, name, nn.Parameter(master))
        module.register_buffer(name + "_fp8", q)
    return model


@torch.no_grad()
def serving_fp8_model(model: nn.Module) -> nn.Module:
    """A separate served FP8 model (e4m3 weights, no masters) with `model`'s serving bytes
    (:func:`serving_fp8_state`)."""
    device = model.embed_tokens.weight.device
    empty = type(model).empty                     # the model's own constructor of unset weights (Model.empty)
    served = quantize_fp8(empty(model.config, FP8_ACTIVATIONS).to(device))   # the layout; every value is set below
    served.load_state_dict(serving_fp8_state(model))
    return served.eval().requires_grad_(False)


@torch.no_grad()
def serving_fp8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a replica serving `model` in FP8 loads, without building a model: the trainer's FP8
    model's `serving_state_dict`, or a plain model's weights with each quantized one replaced by
    quantize_fp8's e4m3 values of its FP8_ACTIVATIONS rounding (and its scales beside it); copies
    either way (a kept version must not move with the trainer's next step). The same bytes as quantizing a bf16 copy of the model, for a fraction of the
    time (no model is allocated, nothing is loaded twice): an RL loop quantizing every step's
    weights for FP8 rollouts spent seconds a step building two models (`small`, on an H100)."""
    if is_fp8(model):
        return {k: v.detach().clone() for k, v in serving_state_dict(model).items()}
    names = {id(module): name for name, module in model.named_modules()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for module, attr in _quantized(model):
        key = f"{names[id(module)]}.{attr}".removeprefix(".")
        state[key], state[key + "_scale_inv"] = ops.fp8_quantize_weight(state[key].to(FP8_ACTIVATIONS))
    return state


def serving_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A trainer's FP8 model as a replica holds it: each quantized weight's e4m3 values under the
    weight's own name, its scales beside it (the checkpoint layout of save_pretrained)."""
    state = model.state_dict()
    for name in [n for n in state if n.endswith("_fp8")]:
        state[name.removesuffix("_fp8")] = state.pop(name)
    return state
