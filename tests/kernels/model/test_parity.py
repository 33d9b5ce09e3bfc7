"""Three-path parity, exact: full forward == chunked prefill == prefix-cache hit == decode.

Random prompts below and above index_topk, random chunk sizes, random neighbour
sequences (prefilling or decoding) at random batch positions, shuffled KV pages.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from zerokl.kernels.model import ModelConfig
from zerokl.kernels.model.verify import three_path_parity


def test_three_paths_give_identical_logits():
    @settings(max_examples=4)
    @given(seed=st.integers(0, 10_000))
    def check(seed):
        cases, mismatches = three_path_parity("torch", seed, prompts=2)
        assert cases == 6 and mismatches == 0
    check()


def test_three_paths_give_identical_logits_triton():
    # On CPU this uses the interpreter-sized config (zerokl.kernels.model.verify.INTERPRETER_CONFIG).
    cases, mismatches = three_path_parity("triton", 11, prompts=2)
    assert cases == 6 and mismatches == 0


def test_three_paths_bf16():
    cases, mismatches = three_path_parity("torch", 7, prompts=2, dtype=torch.bfloat16)
    assert cases == 6 and mismatches == 0


def test_three_paths_fp8():
    """The FP8 model (bf16 with block-scaled e4m3 projections): the same three-path parity."""
    cases, mismatches = three_path_parity("torch", 5, prompts=2, dtype=torch.float8_e4m3fn)
    assert cases == 6 and mismatches == 0


@pytest.mark.gpu   # interpreted, minutes on a CPU: the FP8 kernels' CPU checks are tests/kernels/test_fp8.py
def test_three_paths_fp8_triton():
    cases, mismatches = three_path_parity("triton", 13, prompts=2, dtype=torch.float8_e4m3fn)
    assert cases == 6 and mismatches == 0


def test_three_paths_with_shared_indexer_layers():
    config = ModelConfig.preset("tiny").replace(indexer_types=("full", "shared", "full", "shared"))
    cases, mismatches = three_path_parity("torch", 3, prompts=2, config=config)
    assert cases == 6 and mismatches == 0


def test_parity_check_detects_a_non_invariant_gemm(shape_dependent_contract):
    shape_dependent_contract(lambda a, b: a.shape[-2] % 2 == 1)      # K order follows the row count
    _, mismatches = three_path_parity("torch", 0, prompts=2)
    assert mismatches > 0
