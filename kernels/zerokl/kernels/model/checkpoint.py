"""Checkpoints in the Hugging Face glm_moe_dsa layout: config.json + safetensors shards.

Parameter names are those of transformers' GlmMoeDsaForCausalLM on disk
(model.layers.N.self_attn.q_a_proj.weight, ...indexer.wq_b.weight,
mlp.experts.E.gate_proj.weight, mlp.gate.e_score_correction_bias, lm_head.weight), so
checkpoints move both ways between zerokl and transformers.

Below the model graph (model.py's `Model.from_pretrained` / `save_pretrained` call down to
here): this module reads the config (config.py) and lays out an FP8 model (fp8.py) but never
imports the Model class; `load_pretrained` builds the model through the constructor it is handed.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from zerokl.kernels.dtypes import DTYPES, FP8, MODEL_DTYPES, dtype_name
from zerokl.kernels.fp8_format import fp8_dequantize_weight
from zerokl.kernels.model.config import ModelConfig
from zerokl.kernels.model.fp8 import is_fp8, quantize_fp8

__all__ = ["save_pretrained", "save_state_pretrained", "pretrained_files", "tensor_files", "config_file", "load_pretrained", "save_tensors", "load_tensors", "config_to_hf", "config_from_hf", "transformers_config",
           "CheckpointError", "CONFIG_FILE", "DEFAULT_MAX_SHARD_BYTES", "FP8_QUANTIZATION"]

CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_FUSED_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# config.json's quantization_config of an FP8 model (GLM-5-FP8 / DeepSeek-V3 layout, NUMERICS.md "FP8")
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


class CheckpointError(ValueError):
    """A checkpoint that does not match the config: the message names the tensors."""


# ----------------------------------------------------------------------------- config.json

def config_to_hf(c: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json as transformers writes it for GlmMoeDsaConfig."""
    d = c.to_dict()
    d.pop("rope_theta")
    if dtype == FP8:          # an FP8 model: bf16 activations, e4m3 projections
        d["quantization_config"] = dict(FP8_QUANTIZATION)
        dtype = torch.bfloat16
    d.update(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
        dtype=dtype_name(dtype),
        mlp_layer_types=list(c.mlp_layer_types), indexer_types=list(c.indexer_types),
        layer_types=["indexed_attention"] * c.num_hidden_layers,
        rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
        num_key_value_heads=c.num_attention_heads, head_dim=c.qk_rope_head_dim, qk_head_dim=c.qk_head_dim,
        hidden_act="silu", attention_bias=False, attention_dropout=0.0, mlp_bias=False,
        scoring_func="sigmoid", topk_method="noaux_tc", initializer_range=0.02, use_cache=True,
        num_nextn_predict_layers=0,
    )
    return d


def transformers_config(c: ModelConfig, dtype: torch.dtype):
    """transformers.GlmMoeDsaConfig of `c` (for side-by-side runs with transformers' model).

    transformers releases name this model's attention layer type differently
    ('indexed_attention' in 5.24; others reject that name and know the layer by their
    default): a release that rejects the name gets its own default."""
    import transformers
    fields = config_to_hf(c, dtype)
    try:
        return transformers.GlmMoeDsaConfig(**fields)
    except Exception:  # noqa: BLE001 - huggingface_hub's strict-dataclass validation error
        fields.pop("layer_types", None)
        return transformers.GlmMoeDsaConfig(**fields)


def config_from_hf(d: dict) -> tuple[ModelConfig, torch.dtype]:
    """ModelConfig (and the stored dtype) from a glm_moe_dsa config.json; unknown keys are ignored.
    An FP8 checkpoint (quantization_config fp8, 128 x 128 blocks) reports float8_e4m3fn."""
    if d.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
        raise CheckpointError(f"model_type {d.get('model_type')!r} is not glm_moe_dsa")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default' RoPE)")
    if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias") or d.get("mlp_bias"):
        raise CheckpointError("only silu activations and bias-free projections are supported")
    fields = {f for f in ModelConfig.__dataclass_fields__}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    n = d["num_hidden_layers"]
    if "indexer_types" not in d and ("index_topk_freq" in d or "index_topk_pattern" in d):
        kw["indexer_types"] = _indexer_types_from_pattern(d, n)
    for key in ("mlp_layer_types", "indexer_types"):
        if key in kw and kw[key] is not None:
            kw[key] = tuple(kw[key])
        else:
            kw.pop(key, None)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(kw.get(key), list):
            kw[key] = kw[key][0]        # zerokl keeps one id; a tokenizer may add more stop ids
    stored = str(d.get("dtype", d.get("torch_dtype", "float32")))
    dtype = DTYPES[stored] if stored in MODEL_DTYPES else torch.float32   # an unquantized model's dtype; else fp32
    quant = d.get("quantization_config")
    if quant:
        if quant.get("quant_method") != "fp8" or list(quant.get("weight_block_size", [])) != [128, 128]:
            raise CheckpointError(f"quantization_config {quant} is not supported (only fp8 with 128 x 128 weight blocks)")
        dtype = FP8
    return ModelConfig(**kw), dtype


def _indexer_types_from_pattern(d: dict, n: int) -> tuple[str, ...]:
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[ch] for ch in pattern) if isinstance(pattern, str) else tuple(pattern)
    freq, offset = max(d.get("index_topk_freq", 1), 1), d.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))


# ----------------------------------------------------------------------------- names

def _to_hf(state: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """zerokl module names -> HF names (stacked experts split per expert)."""
    out = {}
    for name, t in state.items():
        m = re.match(r"^layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)(_scale_inv)?$", name)
        if m and c.mlp_layer_types[int(m.group(1))] == "sparse":
            for e in range(t.shape[0]):
                out[f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}.weight{m.group(3) or ''}"] = t[e].contiguous()
        elif name == "lm_head.weight":
            out[name] = t
        else:
            out["model." + name] = t
    return out


def _from_hf(tensors: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (per-expert or fused experts) -> zerokl names; MTP layers beyond the model are dropped."""
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= c.num_hidden_layers:
            continue    # multi-token-prediction layers (num_nextn_predict_layers): not part of this model
        if (em := _EXPERT_KEY.match(name)):
            layer, e, proj = int(em.group(1)), int(em.group(2)), em.group(3) + (em.group(4) or "")
            experts.setdefault((layer, proj), {})[e] = t
        elif (fm := _FUSED_KEY.match(name)):
            layer, proj = int(fm.group(1)), fm.group(2)
            if proj == "gate_up_proj":
                i = t.shape[1] // 2
                out[f"layers.{layer}.mlp.gate_proj"], out[f"layers.{layer}.mlp.up_proj"] = t[:, :i], t[:, i:]
            else:
                out[f"layers.{layer}.mlp.down_proj"] = t
        else:
            out[name.removeprefix("model.")] = t
    for (layer, proj), per in experts.items():
        missing = [e for e in range(c.n_routed_experts) if e not in per]
        if missing:
            raise CheckpointError(f"missing tensors: model.layers.{layer}.mlp.experts.{missing[0]}.{_hf_leaf(proj)}"
                                  + (f" (and {len(missing) - 1} more experts)" if len(missing) > 1 else ""))
        extra = sorted(set(per) - set(range(c.n_routed_experts)))
        if extra:
            raise CheckpointError(f"unexpected tensors: model.layers.{layer}.mlp.experts.{extra[0]}.{_hf_leaf(proj)}")
        out[f"layers.{layer}.mlp.{proj}"] = torch.stack([per[e] for e in range(c.n_routed_experts)])
    return out


def _hf_leaf(proj: str) -> str:
    """gate_proj -> gate_proj.weight, gate_proj_scale_inv -> gate_proj.weight_scale_inv."""
    base, scale = proj.removesuffix("_scale_inv"), proj.endswith("_scale_inv")
    return f"{base}.weight" + ("_scale_inv" if scale else "")


def _dequantize_unwanted(state: dict[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """An FP8 checkpoint's weights that this model keeps unquantized (kv_b_proj, which the absorbed
    attention folds in; anything else the model holds in its dtype): value times block scale."""
    for name in [n for n in state if n.endswith("_scale_inv") and n not in want]:
        base = name.removesuffix("_scale_inv")
        scale, weight = state.pop(name), state[base]
        state[base] = (torch.stack([fp8_dequantize_weight(w, s) for w, s in zip(weight, scale)]) if weight.dim() == 3
                       else fp8_dequantize_weight(weight, scale))


# ----------------------------------------------------------------------------- save / load

def tensor_files(tensors: Mapping[str, torch.Tensor],
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[tuple[str, dict[str, torch.Tensor] | bytes]]:
    """The files :func:`save_tensors` writes, by name, in the order written: each safetensors file's tensors
    (contiguous host tensors, to be saved with metadata ``{"format": "pt"}``), and the index's bytes when
    sharded. The one layout of a checkpoint's weight files, for a writer to disk or to memory."""
    if not tensors:
        raise CheckpointError("no tensors to save")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, spans = 0, {}
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        # Views of one storage that do not overlap (an expert of a stacked tensor, a tensor of a packed
        # buffer) are written as they are; bytes another tensor covers too (tied weights) are copied.
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        seen = spans.setdefault(t.untyped_storage().data_ptr(), [])
        if t.numel() and any(start < e and s < end for s, e in seen):
            t = t.clone()
        else:
            seen.append((start, end))
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        return [(SINGLE_FILE, shards[0])]
    files: list[tuple[str, dict[str, torch.Tensor] | bytes]] = []
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        files.append((fname, shard))
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    return files + [(INDEX_FILE, index.encode())]


def save_tensors(tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write tensors as Hugging Face writes them: one model.safetensors, or
    model-0000K-of-0000N.safetensors shards plus model.safetensors.index.json when they
    exceed max_shard_bytes (a single larger tensor gets a shard of its own). Tensors that
    share storage (tied weights) are copied, since safetensors refuses aliases.
    Returns the files written."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in tensor_files(tensors, max_shard_bytes):
        if isinstance(content, bytes):
            (path / name).write_bytes(content)
        else:
            save_file(content, str(path / name), metadata={"format": "pt"})
        written.append(path / name)
    return written


def load_tensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (sharded with an index, or one model.safetensors)."""
    path = Path(directory)
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        out = {}
        for fname in sorted(set(weight_map.values())):
            out.update(load_file(str(path / fname)))
        return out
    if (path / SINGLE_FILE).exists():
        return load_file(str(path / SINGLE_FILE))
    raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def save_pretrained(model: nn.Module, directory: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write config.json and the weights of a Model under HF names (sharded with an index when large)."""
    dtype = FP8 if is_fp8(model) else model.dtype
    save_state_pretrained(model.state_dict(), model.config, dtype, directory, max_shard_bytes)


def save_state_pretrained(state: Mapping[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype,
                          directory: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """save_pretrained's files from a state dict under the model's names (the same bytes as saving a
    model holding it): for a copy of the weights held apart from any model, e.g. a trainer's snapshot."""
    save_tensors(_to_hf(state, config), directory, max_shard_bytes)
    (Path(directory) / CONFIG_FILE).write_bytes(config_file(config, dtype))


def pretrained_files(state: Mapping[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[tuple[str, dict[str, torch.Tensor] | bytes]]:
    """:func:`save_state_pretrained`'s files, by name, unwritten (:func:`tensor_files`, then config.json's bytes):
    for a writer that builds them in memory, the same bytes as those written to disk."""
    return [*tensor_files(_to_hf(state, config), max_shard_bytes), (CONFIG_FILE, config_file(config, dtype))]


def config_file(config: ModelConfig, dtype: torch.dtype) -> bytes:
    """config.json's bytes, as written."""
    return (json.dumps(config_to_hf(config, dtype), indent=2) + "\n").encode()


def load_pretrained(directory: str | os.PathLike, dtype: torch.dtype | None = None, *,
                    empty: Callable[[ModelConfig, torch.dtype], nn.Module]) -> nn.Module:
    """A model from a glm_moe_dsa checkpoint directory; every tensor must match by name and shape.
    `Model.from_pretrained(directory, dtype)` is the entry point: it passes `empty=Model.empty`
    (a model of the config with unset weights), since this module sits below the Model class.

    dtype float8_e4m3fn asks for an FP8 model (bf16 activations): an FP8 checkpoint is read as it
    is, any other is quantized on load (zerokl.kernels.model.fp8, deterministic)."""
    path = Path(directory)
    if not (path / CONFIG_FILE).exists():
        raise CheckpointError(f"{path}: no {CONFIG_FILE}")
    config, stored_dtype = config_from_hf(json.loads((path / CONFIG_FILE).read_text()))
    fp8 = stored_dtype == FP8            # an FP8 checkpoint: e4m3 values and their scales
    to_fp8 = dtype == FP8 and not fp8     # a checkpoint quantized on load
    act = torch.bfloat16 if dtype in (None, FP8) and (fp8 or to_fp8) else (dtype or stored_dtype)
    model = empty(config, act)
    if fp8:
        quantize_fp8(model)                     # the layout (of unset values): every value is then read from the checkpoint
    state = _from_hf(load_tensors(path), config)
    want = model.state_dict()
    if fp8:
        _dequantize_unwanted(state, want)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        hf = lambda names: sorted(_to_hf({n: want.get(n, state.get(n)) for n in names}, config))  # noqa: E731
        raise CheckpointError("checkpoint does not match config:"
                              + (f" missing tensors: {', '.join(hf(missing)[:8])}" if missing else "")
                              + (f" unexpected tensors: {', '.join(hf(extra)[:8])}" if extra else ""))
    for name, t in state.items():
        if t.shape != want[name].shape:
            raise CheckpointError(f"tensor {sorted(_to_hf({name: t}, config))[0]} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(want[name].shape)}")
    with torch.no_grad():
        for name, target in want.items():
            target.copy_(state[name].to(target.dtype))
    return quantize_fp8(model) if to_fp8 else model
