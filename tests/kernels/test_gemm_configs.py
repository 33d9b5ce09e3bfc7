"""The GEMM's launch configs never change bits, and the fused split_partial is the composite's.

On CUDA, `linear` picks its tile config by M (kernels/zerokl/kernels/triton/gemm.py: _CUDA_BUCKETS, and the
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
    offs_t = torch.tensor(offs, device="cuda")                       # device offsets: the on-device tile search
    assert torch.equal(gemm.grouped_linear(x, w, offs_t).view(torch.int16), want.view(torch.int16))


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


@pytest.mark.parametrize("s", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_combine_planes_reads_planes_by_address(s, dtype):
    """The tensor-parallel p2p join's kernel: S fp32 planes found through a table of addresses
    (separate allocations, as peers' buffers are) give split_combine's bits, as the contiguous
    tree_combine does; and the table's order is the tree's order (swapping planes changes bits)."""
    g = torch.Generator().manual_seed(s)
    # magnitudes spread over 1e-3..1e3 so the tree's order shows in the rounding
    planes = [(torch.randn(5, 33, generator=g) * 10.0 ** torch.randint(-3, 4, (5, 33), generator=g)).to(DEV)
              for _ in range(s)]
    want = ops.split_combine(planes, None, dtype)
    table = torch.tensor([p.data_ptr() for p in planes], dtype=torch.int64, device=DEV)
    got = gemm.tree_combine_planes(table, (5, 33), dtype)
    assert got.dtype == dtype and got.shape == (5, 33)
    assert torch.equal(got, want)
    assert torch.equal(gemm.tree_combine(torch.stack(planes), dtype), want)
    if s >= 4:
        swapped = torch.tensor([planes[i].data_ptr() for i in (0, 2, 1, *range(3, s))], dtype=torch.int64, device=DEV)
        assert not torch.equal(gemm.tree_combine_planes(swapped, (5, 33), torch.float32),
                               ops.split_combine(planes, None, torch.float32))


def test_wave_split_fills_whole_waves():
    """The persistent kernel's column split (a plan, no GPU needed): where the last wave of wide
    tiles would run mostly empty, the wide part becomes whole waves and the rest narrow tiles;
    where the waves are already full, nothing is split."""
    wide, narrow, sms = gemm._CUDA_BUCKETS[-1][1][None], gemm._TMA_128, 132
    # 7168 x 2048 at M = 2048: 16 x 28 = 448 wide tiles = 3.4 waves -> 16 x 24 = 384 (3 waves)
    # plus 16 x 8 = 128 narrow tiles (one wave)
    assert gemm.wave_split(2048, 7168, wide, sms, narrow) == 24 * 256
    for m, n in [(2048, 4096), (2048, 2048), (8192, 7168), (8192, 4096), (100, 7168)]:
        assert gemm.wave_split(m, n, wide, sms, narrow) == n, (m, n)
    for m in range(1025, 20000, 997):
        for n in (1536, 2048, 4096, 6144, 7168):
            n0 = gemm.wave_split(m, n, wide, sms, narrow)
            assert n0 == n or (0 < n0 < n and n0 % wide.BLOCK_N == 0), (m, n, n0)
    # only a narrow tile of the same height and half the width qualifies
    assert gemm.wave_split(2048, 7168, wide, sms, gemm.GemmConfig(64, 128, 64, 4, 4, TMA=True)) == 7168


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_wave_split_launches_keep_the_bits_on_gpu():
    """linear at a shape that takes the two-launch wave split equals the canonical config, row by
    row, alone and in the batch."""
    n, k, m = 7168, 2048, 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    b = torch.randn(n, device="cuda", generator=g)
    assert gemm.wave_split(m, n, gemm.launch_config(m, n, k, torch.bfloat16, x.device), 132, gemm._TMA_128) < n
    canonical = gemm.gemm_config(n, k, torch.bfloat16)
    assert torch.equal(gemm.linear(x, w).view(torch.int16), gemm.linear(x, w, config=canonical).view(torch.int16))
    assert torch.equal(gemm.linear(x, w, b).view(torch.int16), gemm.linear(x, w, b, config=canonical).view(torch.int16))
    assert torch.equal(gemm.linear(x[77:78], w).view(torch.int16), gemm.linear(x, w)[77:78].view(torch.int16))
