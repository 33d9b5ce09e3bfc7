"""The FP8 GEMM's launch configs never change bits (kernels/zerokl/kernels/triton/fp8.py).

On CUDA, fp8_gemm picks its tile config by M (fp8._CUDA_BUCKETS), as the bf16 GEMM does
(tests/kernels/test_gemm_configs.py). That is only allowed because, on the GPU, an element's
bits do not depend on the tile: each K block's tl.dot chains its MMA steps in ascending K order
into a fresh fp32 accumulator whatever BLOCK_M/N, warps or stages, and the block scaling after
it is elementwise. The gpu tests assert it with exact equality for every config in the table and
every config tools/bench/bench_fp8.py --sweep times, and the production path's invariance at
every M bucket. Under the interpreter the block dot is the exact contraction
(kernels/zerokl/kernels/interpreter.py), so there the tile does not enter the bits either: the
CPU tests run every config's indexing (one weight scale per tile up to 128 columns, a scale per
column for 256, the grouped program order) against the interpreted launch, while production
interpreted launches keep INTERPRETED_CONFIG.
"""
import dataclasses
import importlib.util
import os
import pathlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from zerokl.kernels import ops  # noqa: E402
from zerokl.kernels.triton import fp8 as tfp8  # noqa: E402
from zerokl.kernels.triton._common import tma_aligned  # noqa: E402

GPU = torch.cuda.is_available()
ROOT = pathlib.Path(__file__).resolve().parents[2]
C = tfp8.Fp8GemmConfig


def _sweep_candidates() -> list:
    spec = importlib.util.spec_from_file_location("bench_fp8", ROOT / "tools" / "bench" / "bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.candidates()


def _configs(n: int, k: int) -> list:
    """Every config a compiled launch may use (the table's, the choice at several M) and every config the
    sweep times, the canonical one first, each once."""
    out = [tfp8.CANONICAL_CONFIG]
    out += [cfg for _, table in tfp8._CUDA_BUCKETS for cfg in table.values()]
    out += [tfp8.fp8_launch_config(m, n, k, interpreted=False) for m in (1, 100, 600, 5000)]
    out += _sweep_candidates()
    return list(dict.fromkeys(out))


def _operands(m: int, n: int, k: int, device: str, seed: int):
    """Quantized activations (q, sx) of M rows, a quantized weight (qw, sw) [N, K] and a bias [N]."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3.0).to(device, torch.bfloat16)
    qw, sw = ops.fp8_quantize_weight((torch.randn(n, k, generator=g) * 0.05).to(device))
    return (*tfp8.fp8_quantize(x), qw, sw, torch.randn(n, generator=g).to(device), x)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.skipif(GPU, reason="the interpreter's check; on a GPU the gpu tests below check the compiled configs")
@pytest.mark.parametrize("n,k", [(200, 96), (300, 260)])
def test_interpreted_every_config_gives_the_default_launch_bits(n, k):
    """Each config's indexing under the interpreter: a 256-wide tile over a partial last weight block
    (N = 300), tiles narrower than a weight block, ragged K, 70 rows in 1-5 row tiles with GROUP_M
    bands of 2 and 3 (a short last band): every output element written, with the interpreted
    launch's bits (fp32 with bias: the unrounded accumulator)."""
    q, sx, qw, sw, bias, _ = _operands(70, n, k, "cpu", seed=n + k)
    want = tfp8.fp8_gemm(q, sx, qw, sw, bias, torch.float32)
    assert tfp8.fp8_launch_config(70, n, k, interpreted=True) == tfp8.INTERPRETED_CONFIG
    extra = [C(16, 32, 4, 1, GROUP_M=2), C(16, 256, 4, 1, GROUP_M=3)]
    # TMA loads and persistent grids: test_interpreted_tma_loads_give_the_pointer_loads_bits (a few, not
    # every sweep candidate: the interpreter takes seconds a launch)
    plain = [cfg for cfg in _configs(n, k) if not cfg.TMA and not cfg.PROGRAMS_PER_SM]
    for cfg in plain + extra:
        got = tfp8.fp8_gemm(q, sx, qw, sw, bias, torch.float32, config=cfg)
        assert torch.equal(_bits(got), _bits(want)), cfg
    got = tfp8.fp8_gemm(q, sx, qw, sw, None, torch.bfloat16, config=C(64, 256, 8, 3))
    assert torch.equal(_bits(got), _bits(tfp8.fp8_gemm(q, sx, qw, sw, None, torch.bfloat16))), "bf16"


@pytest.mark.skipif(GPU, reason="the interpreter's check; on a GPU the gpu tests below check the compiled configs")
def test_interpreted_tma_loads_give_the_pointer_loads_bits():
    """TMA configs read their tiles through tensor descriptors, zero-padded past M (20 rows in 16-row
    tiles), N (160 columns in 32- and 256-column tiles: a partial last weight block) and K (320: a half
    last K block); a K whose rows are not 16-byte aligned (260) falls back to pointer loads. A
    persistent grid (4 programs under the interpreter) walks the 10 tiles of 16 x 32. Every case has
    the pointer launch's bits."""
    for k in (320, 260):
        q, sx, qw, sw, bias, _ = _operands(20, 160, k, "cpu", seed=k)
        assert tma_aligned(q) == tma_aligned(qw) == (k == 320)
        for cfg in (C(16, 32, 4, 1), C(16, 256, 8, 3, GROUP_M=3)):
            want = tfp8.fp8_gemm(q, sx, qw, sw, bias, torch.float32, config=cfg)
            for tma, per_sm in ((True, 0), (True, 1), (False, 1)):
                alt = dataclasses.replace(cfg, TMA=tma, PROGRAMS_PER_SM=per_sm)
                got = tfp8.fp8_gemm(q, sx, qw, sw, bias, torch.float32, config=alt)
                assert torch.equal(_bits(got), _bits(want)), (k, alt)


@pytest.mark.skipif(GPU, reason="the interpreter's check; on a GPU test_fp8_grouped_configs_bit_identical_on_gpu")
def test_interpreted_grouped_configs_give_the_default_launch_bits():
    _, _, qw, sw, _, x = _operands(37, 300, 200, "cpu", seed=5)
    weight = torch.stack([qw, qw.flip(0)])
    scale = torch.stack([sw, sw.flip(0)])
    want = tfp8.fp8_grouped_linear(x, weight, scale, [0, 30, 37])
    for cfg in (C(64, 256, 8, 3), C(64, 64, 4, 4), C(16, 32, 4, 1)):
        assert torch.equal(_bits(tfp8.fp8_grouped_linear(x, weight, scale, [0, 30, 37], config=cfg)), _bits(want)), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 7168), (7168, 2048), (200, 96), (384, 1000)])
def test_fp8_configs_bit_identical_on_gpu(n, k):
    q, sx, qw, sw, bias, _ = _operands(700, n, k, "cuda", seed=n + k)
    canonical = tfp8.CANONICAL_CONFIG
    want = tfp8.fp8_gemm(q, sx, qw, sw, None, torch.bfloat16, config=canonical)
    want32 = tfp8.fp8_gemm(q, sx, qw, sw, None, torch.float32, config=canonical)
    wantb = tfp8.fp8_gemm(q, sx, qw, sw, bias, torch.bfloat16, config=canonical)
    for cfg in _configs(n, k):
        assert torch.equal(_bits(tfp8.fp8_gemm(q, sx, qw, sw, None, torch.bfloat16, config=cfg)), _bits(want)), cfg
        assert torch.equal(_bits(tfp8.fp8_gemm(q, sx, qw, sw, None, torch.float32, config=cfg)), _bits(want32)), cfg
        assert torch.equal(_bits(tfp8.fp8_gemm(q, sx, qw, sw, bias, torch.bfloat16, config=cfg)), _bits(wantb)), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(4096, 4096), (384, 1000)])
def test_fp8_linear_row_alone_equals_row_in_any_batch_at_every_bucket_on_gpu(n, k):
    """The production path (the table's config by M, activation quantization included): the first M
    rows at every M bucket are the 5000-row batch's rows and the canonical config's; a row alone is
    the same row in the batch."""
    _, _, qw, sw, bias, x = _operands(5000, n, k, "cuda", seed=n)
    full = tfp8.fp8_linear(x, qw, sw, bias)
    q, sx = tfp8.fp8_quantize(x)
    assert torch.equal(_bits(full), _bits(tfp8.fp8_gemm(q, sx, qw, sw, bias, torch.bfloat16,
                                                        config=tfp8.CANONICAL_CONFIG)))
    for m in (1, 7, 64, 65, 300, 2048, 5000):
        assert torch.equal(_bits(tfp8.fp8_linear(x[:m], qw, sw, bias)), _bits(full[:m])), m
    for row in (5, 4999):
        assert torch.equal(_bits(tfp8.fp8_linear(x[row:row + 1], qw, sw, bias)), _bits(full[row:row + 1])), row


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_fp8_grouped_configs_bit_identical_on_gpu():
    """The experts' launch at its own config and at others, host and device offsets: each group's rows
    are the canonical fp8_gemm of those rows with the group's weight."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300, 512, generator=g) * 3.0).to("cuda", torch.bfloat16)
    weight, scale = ops.fp8_quantize_weight((torch.randn(4, 384, 512, generator=g) * 0.05).to("cuda"))
    offs = [0, 1, 101, 101, 300]
    q, sx = tfp8.fp8_quantize(x)
    want = torch.cat([tfp8.fp8_gemm(q[a:b], sx[a:b], weight[e], scale[e], None, torch.bfloat16,
                                    config=tfp8.CANONICAL_CONFIG) for e, (a, b) in enumerate(zip(offs, offs[1:]))])
    for cfg in [None] + _configs(384, 512):
        assert torch.equal(_bits(tfp8.fp8_grouped_linear(x, weight, scale, offs, config=cfg)), _bits(want)), cfg
    offs_t = torch.tensor(offs, device="cuda")                       # device offsets: the on-device tile search
    assert torch.equal(_bits(tfp8.fp8_grouped_linear(x, weight, scale, offs_t)), _bits(want))
