"""The GEMM's launch configs never change bits, and the fused split_partial is the composite's.

On CUDA, `linear` picks its tile config by M (kernels/triton/gemm.py: _CUDA_BUCKETS, and the
persistent TMA kernel for large M). That is only allowed because, on the GPU, an element's
bits do not depend on the tile: tl.dot chains its k16 MMA steps into one fp32 accumulator in
ascending K order whatever BLOCK_M/N/K, warps, stages or MMA flavour (NUMERICS.md). The gpu
tests below assert it with exact equality for every config in use and a few more; they skip
on CPU machines, where the interpreter's numpy block matmul does depend on the tile (so
interpreted launches always use the canonical config).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from zerokl.kernels import ops, use_backend  # noqa: E402
from zerokl.kernels.triton import gemm  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _configs(n: int, k: int, dtype: torch.dtype) -> list:
    C = gemm.GemmConfig
    out = [gemm.gemm_config(n, k, dtype)]
    out += [table.get(None) for _, table in gemm._CUDA_BUCKETS]
    out += [gemm.launch_config(m, n, k, dtype, torch.device("cuda")) for m in (1, 100, 600, 5000)]
    out += [C(16, 16, 64, 4, 3), C(64, 32, 256, 4, 3), C(128, 256, 64, 8, 3), C(256, 128, 64, 8, 3),
            C(128, 128, 32, 8, 4), C(128, 256, 64, 8, 3, TMA=True), C(128, 128, 64, 8, 4, TMA=True, FLATTEN=True)]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 7168), (7168, 2048), (200, 96), (384, 1000)])
def test_gemm_configs_bit_identical_on_gpu(n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(700, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    b = torch.randn(n, device="cuda", generator=g)
    want = gemm.linear(x, w, config=gemm.gemm_config(n, k, torch.bfloat16))
    want32 = gemm.linear(x, w, out_dtype=torch.float32, config=gemm.gemm_config(n, k, torch.bfloat16))
    wantb = gemm.linear(x, w, b, config=gemm.gemm_config(n, k, torch.bfloat16))
    for cfg in _configs(n, k, torch.bfloat16):
        got = gemm.linear(x, w, config=cfg)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg
        assert torch.equal(gemm.linear(x, w, out_dtype=torch.float32, config=cfg).view(torch.int32),
                           want32.view(torch.int32)), cfg
        assert torch.equal(gemm.linear(x, w, b, config=cfg).view(torch.int16), wantb.view(torch.int16)), cfg
    # the production path at every M bucket: a row alone == the same row in any batch
    for m in (1, 7, 64, 65, 300, 700):
        assert torch.equal(gemm.linear(x[:m], w).view(torch.int16), want[:m].view(torch.int16)), m
    assert torch.equal(gemm.linear(x[5:6], w).view(torch.int16), want[5:6].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_grouped_linear_configs_bit_identical_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    offs = [0, 1, 101, 101, 300]
    want = gemm.grouped_linear(x, w, offs, config=gemm.gemm_config(256, 512, torch.bfloat16))
    for cfg in _configs(256, 512, torch.bfloat16):
        if cfg.TMA:
            continue
        assert torch.equal(gemm.grouped_linear(x, w, offs, config=cfg).view(torch.int16), want.view(torch.int16)), cfg
    assert torch.equal(gemm.grouped_linear(x, w, offs).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_split_partial_triton_is_the_composite(dtype):
    """The Triton backend's two-launch split_partial/split_linear (one GEMM launch over all K
    segments, one tree launch) gives the per-segment composite's bits (linear per segment in
    fp32, tree_sum, torch's rounding)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 256, generator=g).to(DEV, dtype)
    w = (torch.randn(72, 256, generator=g) * 0.1).to(DEV, dtype)
    with use_backend("triton"):
        for splits in (1, 2, 4):
            seg = 256 // splits
            composite = ops.tree_sum([ops.linear(x[:, i:i + seg].contiguous(), w[:, i:i + seg].contiguous(),
                                                 out_dtype=torch.float32) for i in range(0, 256, seg)])
            assert torch.equal(ops.split_partial(x, w, splits), composite), splits
            assert torch.equal(gemm.split_partial(x, w, splits, dtype), composite.to(dtype)), splits
        assert torch.equal(ops.split_linear(x, w), ops.split_partial(x, w, 4).to(dtype))
        # with a gradient the composite runs (and agrees)
        xg = x.clone().requires_grad_(True)
        assert torch.equal(ops.split_linear(xg, w).detach(), ops.split_linear(x, w))
