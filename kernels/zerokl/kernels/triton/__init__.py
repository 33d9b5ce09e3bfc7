"""Triton backend of zerokl.kernels: batch-invariant kernels for GPUs (and CPU under TRITON_INTERPRET=1).

Same signatures and semantics as kernels/zerokl/kernels/torch_ops.py (the reference), plus `topk_positions` and
sampling's `row_cumsum` (dispatched by kernels/zerokl/kernels/sampling.py).
Bits are promised per backend and device type: a row's result is identical alone or inside
any batch, at any position, with any neighbours. Each module's docstring says how.

On CPU these kernels run only under the Triton interpreter: set TRITON_INTERPRET=1 before this
package is imported (triton.jit reads it when the kernels are decorated).
"""
from __future__ import annotations

# Under TRITON_INTERPRET=1 (CPU) tl.dot is made exact, whatever BLAS numpy has, by the library
# above this package (kernels/zerokl/kernels/interpreter.py, installed from kernels/zerokl/kernels/backend.py before this
# package can be imported): a backend never imports the library that dispatches to it.
from .attention import KV_BLOCK, mla_attention, mla_attention_sequences
from .combine import moe_combine_backward, pair_rows_backward
from .elementwise import sigmoid, silu, swiglu_backward
from .fp8 import fp8_gemm, fp8_grouped_linear, fp8_linear, fp8_quantize, fp8_quantize_weight
from .gemm import gemm_config, grouped_linear, grouped_linear_wgrad, linear, split_partial, tree_combine, tree_combine_planes
from .indexer import indexer_scores
from .norms import layer_norm, rms_norm, rms_norm_backward
from .reductions import log_softmax, logprob_backward, row_sum, softmax
from .rotary import rope
from .sampling import row_cumsum
from .topk import topk_positions

__all__ = [
    "KV_BLOCK",
    "fp8_gemm",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_quantize",
    "fp8_quantize_weight",
    "gemm_config",
    "grouped_linear",
    "grouped_linear_wgrad",
    "indexer_scores",
    "layer_norm",
    "linear",
    "log_softmax",
    "logprob_backward",
    "mla_attention",
    "mla_attention_sequences",
    "moe_combine_backward",
    "pair_rows_backward",
    "rms_norm",
    "rms_norm_backward",
    "rope",
    "row_cumsum",
    "row_sum",
    "sigmoid",
    "silu",
    "softmax",
    "split_partial",
    "swiglu_backward",
    "topk_positions",
    "tree_combine",
    "tree_combine_planes",
]
