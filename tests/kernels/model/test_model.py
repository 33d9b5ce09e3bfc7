"""Model behaviour: HF reference logits, checkpoints, deterministic backward, LoRA."""
import json

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.checkpoint import CheckpointError, transformers_config
from zerokl.kernels.model.lora import apply_lora, lora_parameters, merge_lora, unmerge_lora

TINY = ModelConfig.preset("tiny")


def _ids(b, s, seed=0):
    return torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def _model(seed=0, config=TINY):
    m = Model(config, seed=seed)
    with torch.no_grad():    # a non-zero correction bias so selection-only bias is exercised
        for layer in m.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(
                    torch.randn(config.n_routed_experts, generator=torch.Generator().manual_seed(seed)) * 0.01)
    return m


def test_presets_and_sizes():
    tiny, small = Model(TINY), ModelConfig.preset("small")
    n = sum(p.numel() for p in tiny.parameters())
    assert 1_000_000 < n < 5_000_000
    assert small.index_topk < small.max_position_embeddings
    glm5 = ModelConfig.preset("glm5")
    assert (glm5.hidden_size, glm5.num_hidden_layers, glm5.n_routed_experts, glm5.softmax_scale) == (6144, 78, 256, 1 / 16)
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("huge")


@pytest.mark.usefixtures("cpu_backend")
def test_forward_shape_and_batch_rows_independent():
    m = _model()
    ids = _ids(3, 70)
    logits = m(ids)
    assert logits.shape == (3, 70, TINY.vocab_size)
    assert torch.equal(m(ids[1:2])[0], logits[1])


@pytest.mark.usefixtures("cpu_backend")
@pytest.mark.parametrize("seq_len", [TINY.index_topk, 3 * TINY.index_topk])
def test_matches_transformers_reference(tmp_path, seq_len):
    """Dense (seq <= index_topk) and sparse: a zerokl checkpoint in transformers' GlmMoeDsaForCausalLM."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no GlmMoeDsaForCausalLM (needs >= 5.13)")
    # 16 index heads: exact score ties at the top-k boundary (whose order transformers leaves
    # undefined) become vanishingly rare, so the comparison is about the math.
    config = TINY.replace(index_n_heads=16)
    m = _model(1, config)
    m.save_pretrained(tmp_path)
    # The config through transformers_config: releases name the attention layer type differently.
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        tmp_path, config=transformers_config(config, torch.float32), dtype=torch.float32).eval()
    ids = _ids(2, seq_len, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits, rtol=1e-5, atol=2e-5)
    hf.save_pretrained(tmp_path / "from_hf")
    assert torch.equal(Model.from_pretrained(tmp_path / "from_hf")(ids), m(ids))


@pytest.mark.usefixtures("cpu_backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_empty_model_is_the_seeded_model_without_the_draw(dtype):
    """Model.empty (for loaders that set every tensor) builds what Model(config, seed) builds: the same
    state dict names, shapes and dtypes (router weights and correction biases fp32 in bf16 too) and
    the same rope frequencies; loading the seeded weights into it gives the seeded model's forward."""
    seeded, empty = Model(TINY, seed=0, dtype=dtype), Model.empty(TINY, dtype)
    want, got = seeded.state_dict(), empty.state_dict()
    assert [(k, v.shape, v.dtype) for k, v in got.items()] == [(k, v.shape, v.dtype) for k, v in want.items()]
    assert torch.equal(empty.inv_freq, seeded.inv_freq)
    empty.load_state_dict(want)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    assert torch.equal(empty(ids), seeded(ids))


def test_checkpoint_round_trip_is_bitwise_and_sharded(tmp_path):
    m = _model(2)
    m.save_pretrained(tmp_path, max_shard_bytes=1_500_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.1.mlp.experts.15.gate_proj.weight" in index["weight_map"]
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in index["weight_map"]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index["weight_map"]
    loaded = Model.from_pretrained(tmp_path)
    for (name, a), b in zip(m.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["rope_parameters"]["rope_theta"] == TINY.rope_theta


def _rewrite(tmp_path, edit):
    from safetensors.torch import load_file, save_file
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f))


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
    _model().save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.2.self_attn.indexer.wk.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.2\.self_attn\.indexer\.wk\.weight"):
        Model.from_pretrained(tmp_path)
    _model().save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.bogus\.weight"):
        Model.from_pretrained(tmp_path)
    _model().save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \(3, 3\)"):
        Model.from_pretrained(tmp_path)
    _model().save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.3.mlp.experts.7.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.experts\.7\.up_proj\.weight"):
        Model.from_pretrained(tmp_path)


@pytest.mark.usefixtures("cpu_backend")
def test_shared_indexer_layers_have_no_indexer_weights(tmp_path):
    config = TINY.replace(indexer_types=("full", "shared", "shared", "full"))
    m = _model(config=config)
    m.save_pretrained(tmp_path)
    names = json.loads((tmp_path / "config.json").read_text())["indexer_types"]
    assert names == ["full", "shared", "shared", "full"]
    assert all("layers.1.self_attn.indexer" not in k for k in m.state_dict())
    assert torch.equal(Model.from_pretrained(tmp_path)(_ids(1, 80)), m(_ids(1, 80)))
    with pytest.raises(ValueError, match="no earlier layer has an indexer"):
        TINY.replace(indexer_types=("shared", "full", "full", "full"))


def _grads(seed, device="cpu"):
    m = _model(seed).to(device)
    ids = _ids(2, 60, seed=1).to(device)
    loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_is_deterministic(backend):
    from zerokl.kernels import use_backend
    if backend == "triton" and not torch.cuda.is_available():
        pytest.skip("a whole model's interpreted Triton backward takes many minutes on a CPU: the fused kernels' "
                    "determinism is tested under the interpreter in tests/kernels/test_attention_backward.py and "
                    "test_moe.py, and this test runs on CUDA in the GPU tier")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    with use_backend(backend):
        a, b = _grads(4, device), _grads(4, device)
    assert a.keys() == b.keys() and len(a) > 20
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.usefixtures("cpu_backend")
def test_lora_trains_adapters_only_and_merge_is_exact():
    m = _model(5)
    base = {n: p.detach().clone() for n, p in m.named_parameters()}
    adapted = apply_lora(m, rank=4, alpha=8.0)
    assert "layers.0.self_attn.q_a_proj" in adapted
    params = lora_parameters(m)
    opt = torch.optim.SGD(params, lr=0.5)
    ids = _ids(2, 50, seed=2)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        opt.step()
    with torch.no_grad():
        adapted_logits = m(ids)
        merge_lora(m)
        assert torch.equal(m(ids), adapted_logits)            # merged weights == adapted forward, bitwise
    m2 = _model(5)
    apply_lora(m2, rank=4, alpha=8.0)
    unmerge_lora(m2)
    for n, p in m2.named_parameters():
        assert torch.equal(p, base[n]), n


def test_moving_to_bf16_keeps_the_router_exact_as_loading_does():
    """Model.to(bf16) keeps each router's fp32 weight and correction bias byte for byte, as loading
    the same fp32 state dict into a bf16 model does: the two documented ways to a bf16 model (and
    a trainer resumed from an fp32 checkpoint) compute the same bits."""
    fp32 = Model(TINY, seed=0)
    state = {k: v.clone() for k, v in fp32.state_dict().items()}
    moved = fp32.to(torch.bfloat16)
    loaded = Model.empty(TINY, torch.bfloat16)
    loaded.load_state_dict(state)
    routers = [k for k in state if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))]
    assert routers
    for k, v in moved.state_dict().items():
        assert v.dtype == loaded.state_dict()[k].dtype and torch.equal(v, loaded.state_dict()[k]), k
    for k in routers:
        assert moved.state_dict()[k].dtype == torch.float32 and torch.equal(moved.state_dict()[k], state[k]), k
    prompt = torch.arange(3, 40).remainder(TINY.vocab_size).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(moved(prompt), loaded(prompt))
