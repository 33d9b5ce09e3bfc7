"""tools/bench/flops.py: the one count of parameters, FLOPs and decode bytes behind every bench's MFU and HBM bound."""
import pathlib
import sys

from zerokl.kernels.model import ModelConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench"))
import flops  # noqa: E402

SLICE = ModelConfig.preset("glm5").replace(num_hidden_layers=2, first_k_dense_replace=1)


def test_the_glm5_slices_parameters_by_role() -> None:
    """Issue 22's slice: 12.2B parameters; a training token multiplies by 1.87B of them (8 of 256 routed experts,
    the lm_head; not the 0.95B embedding table, a lookup: 2.82B with it, as counted before 2026-12-06)."""
    pc = flops.param_counts(SLICE)
    assert round(pc.total / 1e9, 1) == 12.2 and pc.embedding == pc.lm_head == 154_880 * 6_144
    assert round(flops.active_params(SLICE) / 1e9, 2) == 1.87
    assert flops.active_params(SLICE) == pc.rest + pc.lm_head + pc.routed * 8 // 256


def test_prefill_counts_the_lm_head_once_a_prompt_and_never_the_embedding() -> None:
    small = ModelConfig.preset("small")
    wider = small.replace(vocab_size=2 * small.vocab_size)
    prompts, length = 3, 100
    added = flops.prefill_flops(wider, prompts, length) - flops.prefill_flops(small, prompts, length)
    assert added == 2 * small.hidden_size * small.vocab_size * prompts      # the lm_head's new rows, once a prompt
    # Past index_topk the indexer scores every earlier key on its full layers: the count grows faster than linearly.
    c = SLICE
    per_token = [flops.prefill_flops(c, 1, n) / n for n in (c.index_topk, 4 * c.index_topk)]
    assert per_token[1] > per_token[0]


def test_decode_reads_the_experts_a_batch_touches() -> None:
    pc = flops.param_counts(SLICE)
    one = flops.decode_weight_bytes(SLICE, 1)
    assert one == 2 * (pc.rest + pc.lm_head + pc.routed * 8 / 256)
    assert one < flops.decode_weight_bytes(SLICE, 64) < 2 * (pc.rest + pc.lm_head + pc.routed)


def test_the_hbm_bound_takes_the_named_gpus_bandwidth() -> None:
    """The decode benches' HBM bound divides by the GPU's own bandwidth: an H100's figure against the H200's
    bandwidth read 0.26 where it was 0.37 (the fifteenth stop's FP8 slice decode)."""
    from flops import hbm_bytes_per_s

    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("") == 4.8e12        # no CUDA device: the CPU smoke runs' placeholder
