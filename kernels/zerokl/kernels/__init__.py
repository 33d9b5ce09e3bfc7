"""zerokl.kernels: the one versioned numerical definition shared by prefill, decode and the trainer.

Every function here computes each row's result with bits that depend only on that
row (never on batch size, neighbours or position in the batch); NUMERICS.md states
the contract op by op. Pick the backend with `use_backend("torch" | "triton")` or
ZEROKL_BACKEND; the default is triton on CUDA and torch elsewhere.
"""
from zerokl.kernels.backend import BACKENDS, INVARIANT_BACKENDS, default_backend, device_name, get_backend, use_backend
from zerokl.kernels.fingerprint import fingerprint, fingerprint_key
from zerokl.kernels.ops import (
    REDUCTION_SPLITS,
    grouped_linear,
    indexer_scores,
    layer_norm,
    linear,
    log_softmax,
    mla_attention,
    moe_experts,
    moe_route,
    rms_norm,
    rope,
    rope_inv_freq,
    sigmoid,
    silu,
    softmax,
    split_linear,
    swiglu_mlp,
    topk_positions,
)
from zerokl.kernels.sampling import SamplingParams, filtered_logprobs, sample, sampling_logprobs
from zerokl.kernels.version import __version__

__all__ = [
    "__version__",
    "BACKENDS",
    "INVARIANT_BACKENDS",
    "default_backend",
    "device_name",
    "get_backend",
    "use_backend",
    "fingerprint",
    "fingerprint_key",
    "REDUCTION_SPLITS",
    "linear",
    "split_linear",
    "grouped_linear",
    "rms_norm",
    "layer_norm",
    "softmax",
    "log_softmax",
    "sigmoid",
    "silu",
    "rope",
    "rope_inv_freq",
    "mla_attention",
    "indexer_scores",
    "topk_positions",
    "moe_route",
    "moe_experts",
    "swiglu_mlp",
    "SamplingParams",
    "filtered_logprobs",
    "sampling_logprobs",
    "sample",
]
