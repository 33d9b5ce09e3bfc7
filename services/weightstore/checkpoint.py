"""Hugging Face style checkpoint directories: the files inside a weight version.

A directory holds ``config.json``, ``model-0000K-of-0000N.safetensors`` and
``model.safetensors.index.json`` (``weight_map``: parameter name -> file), as
``transformers`` writes sharded checkpoints. The weight store itself treats
these as opaque files; this module only turns a state dict into such a
directory and back.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

__all__ = ["CONFIG_FILE", "INDEX_FILE", "DEFAULT_MAX_SHARD_BYTES", "save_state_dict", "load_state_dict"]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_state_dict(state_dict: Mapping[str, torch.Tensor], dest: str | os.PathLike[str], *,
                    config: Mapping[str, Any] | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[pathlib.Path]:
    """Write ``state_dict`` (and ``config`` as config.json) as a sharded safetensors checkpoint.

    Tensors go to shards in state-dict order, a new shard starting when the
    next tensor would push the current one past ``max_shard_bytes`` (a single
    larger tensor gets a shard of its own). Returns the files written.
    """
    # torch is imported on use: the weight-store server never needs it, and
    # importing it would add about a second to every server start.
    from safetensors.torch import save_file

    if not state_dict:
        raise ValueError("empty state dict")
    out = pathlib.Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen_storage: set[int] = set()
    for name, tensor in state_dict.items():
        t = tensor.detach().contiguous()
        # safetensors refuses tensors sharing storage (tied embeddings): copy the later ones.
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage and t.numel():
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        if groups[-1] and size + _nbytes(t) > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += _nbytes(t)
    n = len(groups)
    written: list[pathlib.Path] = []
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_file(group, out / fname, metadata={"format": "pt"})
        written.append(out / fname)
        weight_map.update({name: fname for name in group})
    index = {"metadata": {"total_size": sum(_nbytes(t) for g in groups for t in g.values())},
             "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    written.append(out / INDEX_FILE)
    if config is not None:
        (out / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True))
        written.append(out / CONFIG_FILE)
    return written


def load_state_dict(src: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint directory (sharded with an index, or one model.safetensors)."""
    from safetensors.torch import load_file

    root = pathlib.Path(src)
    index = root / INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for fname in files:
        state.update(load_file(root / fname))
    return state
