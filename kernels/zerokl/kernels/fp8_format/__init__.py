"""The block-scaled FP8 format's constants and its meaning (q * s), defined once (NUMERICS.md, "FP8").

A leaf package (imports nothing of the library; a package of its own so that the Triton backend
reads it without importing zerokl.kernels, which imports the backend) so that the public ops
(`ops`), the torch backend (`torch_ops`) and the Triton kernels (`triton/fp8.py`) read the same
numbers. Both are
part of the numerical definition: changing either changes bits (a numerics version bump).
`fp8_dequantize_weight` is the format's meaning, plain arithmetic on any device: here, below
every module that reads it (`ops` re-exports it; the `stock` backend and the checkpoint reader
dequantize with it, and a backend never imports `ops`, which dispatches to it).
"""
from __future__ import annotations

import torch

__all__ = ["FP8_BLOCK", "FP8_MAX", "FP8_DTYPE", "fp8_dequantize_weight"]

#: Channels per activation scale (a row of x [M, K] has ceil(K / 128) scales); a weight [N, K]
#: carries one fp32 scale per FP8_BLOCK x FP8_BLOCK block (GLM-5-FP8 / DeepSeek-V3's
#: `weight_block_size` [128, 128]). Also the FP8 GEMM's K tile: one scale product per K block.
FP8_BLOCK = 128
#: The largest finite float8_e4m3fn value: a block's scale is amax / FP8_MAX, so its largest
#: magnitude lands on the top of the e4m3 grid.
FP8_MAX = 448.0
#: The storage dtype of FP8 weights and quantized activations (e4m3, no infinities).
FP8_DTYPE = torch.float8_e4m3fn


def fp8_dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] float8_e4m3fn and its block scales -> q * s in `dtype` (exact in fp32)."""
    n, k = weight.shape
    s = scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return (weight.float() * s).to(dtype)
