"""Property-based batch invariance: a row alone == the same row inside any batch (torch.equal)."""
import pytest
import torch
from hypothesis import given, strategies as st

from zerokl.kernels.verify import OP_CASES, check_op

BACKENDS = ["torch", "triton"]

# Odd sizes on purpose: K not a multiple of any block, M = 1 and M past a tile boundary.
DIMS = {
    "linear": st.fixed_dictionaries({"k": st.integers(1, 300), "n": st.integers(1, 70),
                                     "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "split_linear": st.fixed_dictionaries({"k": st.integers(1, 80).map(lambda q: 4 * q), "n": st.integers(1, 70),
                                           "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "grouped_linear": st.fixed_dictionaries({"k": st.integers(1, 90), "n": st.integers(1, 40), "groups": st.integers(1, 5),
                                             "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "rms_norm": st.fixed_dictionaries({"k": st.integers(1, 700), "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "layer_norm": st.fixed_dictionaries({"k": st.integers(2, 400), "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "log_softmax": st.fixed_dictionaries({"vocab": st.integers(1, 3000), "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "silu_sigmoid": st.fixed_dictionaries({"k": st.integers(1, 200)}),
    "rope": st.fixed_dictionaries({"heads": st.integers(1, 5), "dim": st.sampled_from([2, 8, 16, 64])}),
    "mla_attention": st.fixed_dictionaries({"heads": st.integers(1, 6), "rank": st.integers(4, 48), "rope": st.sampled_from([2, 8]),
                                            "slots": st.integers(60, 120), "max_keys": st.integers(1, 60),
                                            "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "indexer": st.fixed_dictionaries({"heads": st.integers(1, 6), "dim": st.integers(2, 24),
                                      "slots": st.integers(50, 90), "max_keys": st.integers(1, 50)}),
    "moe_route": st.just({}),
    "moe_experts": st.fixed_dictionaries({"experts": st.integers(2, 8), "hidden": st.integers(1, 40), "inter": st.integers(1, 30),
                                          "dtype": st.sampled_from([torch.float32, torch.bfloat16])}),
    "sampling": st.fixed_dictionaries({"vocab": st.integers(2, 500)}),
}


def _fix(name: str, dims: dict) -> dict:
    if name == "moe_experts":
        dims = {**dims, "top_k": min(2, dims["experts"])}
    return dims


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OP_CASES))
def test_row_alone_equals_row_in_any_batch(op, backend):
    @given(dims=DIMS[op], seed=st.integers(0, 2**31 - 1))
    def check(dims, seed):
        batches = (1, 2, 9, 20) if backend == "torch" else (1, 5)
        result = check_op(OP_CASES[op], backend, seed, batches=batches, dims=_fix(op, dims), probes=2)
        assert result.mismatches == 0, f"{op}/{backend}: {result.mismatches} of {result.cases} rows changed bits"
    check()


def test_every_public_op_has_an_invariance_case():
    import zerokl.kernels as k
    covered = {"linear", "split_linear", "grouped_linear", "rms_norm", "layer_norm", "log_softmax", "softmax", "silu", "sigmoid", "rope",
               "rope_inv_freq", "mla_attention", "indexer_scores", "topk_positions", "moe_route", "moe_experts",
               "swiglu_mlp", "SamplingParams", "filtered_logprobs", "sampling_logprobs", "sample"}
    ops = {n for n in k.__all__ if callable(getattr(k, n)) and n not in
           {"default_backend", "device_name", "get_backend", "use_backend", "fingerprint", "fingerprint_key"}}
    assert ops <= covered, f"ops without an invariance case: {sorted(ops - covered)}"
