"""zerokl.kernels.model: the GLM-5-family model every compute service runs (part of the numerics library)."""
from zerokl.kernels.model.model import AttentionBatch, KVCache, Model, ModelConfig

__all__ = ["Model", "ModelConfig", "AttentionBatch", "KVCache"]
