"""zerokl.kernels.model: the GLM-5-family model every compute service runs (part of the numerics library).

Inside, from the bottom up: config.py (ModelConfig), indexer_loss.py and fp8.py (which name no
model class), checkpoint.py (the files), model.py (the graph), then what is applied from outside
(parallel.py, lora.py, recompute.py, paging.py, verify.py). The fingerprint's model case is
zerokl.kernels.fingerprint's, above this package.
"""
from zerokl.kernels.model.model import AttentionBatch, KVCache, Model, ModelConfig

__all__ = ["Model", "ModelConfig", "AttentionBatch", "KVCache"]
