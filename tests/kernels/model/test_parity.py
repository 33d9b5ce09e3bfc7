"""Three-path parity, exact: full forward == chunked prefill == prefix-cache hit == decode.

Random prompts below and above index_topk, random chunk sizes, random neighbour
sequences (prefilling or decoding) at random batch positions, shuffled KV pages.
"""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zerokl.kernels import use_backend
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.verify import INTERPRETER_CONFIG, run_paths, three_path_parity


def test_three_paths_give_identical_logits():
    # two random seeds here; bf16, FP8 and shared-indexer layers below, Triton above: each a seed of its own
    @settings(max_examples=2)
    @given(seed=st.integers(0, 10_000))
    def check(seed):
        cases, mismatches = three_path_parity("torch", seed, prompts=2)
        assert cases == 6 and mismatches == 0
    check()


def test_three_paths_give_identical_logits_triton():
    if torch.cuda.is_available():
        cases, mismatches = three_path_parity("triton", 11, prompts=2)
        assert cases == 6 and mismatches == 0
        return
    # Interpreted on CPU (every program instance in Python): the interpreter-sized model and one
    # prompt past index_topk, whose early rows take the dense path and the later ones the sparse.
    config = INTERPRETER_CONFIG
    with use_backend("triton"), torch.no_grad():
        model = Model(config, seed=11).eval()
        prompt = torch.randint(0, config.vocab_size, (config.index_topk + 4,), generator=torch.Generator().manual_seed(11))
        paths = run_paths(model, prompt, random.Random(11), neighbours=1)
    assert len(paths) == 4 and all(torch.equal(logits, paths["full"]) for logits in paths.values())


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
