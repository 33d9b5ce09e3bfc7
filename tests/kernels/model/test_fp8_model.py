"""The FP8 model (zerokl.kernels.model.fp8): which weights are e4m3, accuracy against the bf16
model, checkpoints in the GLM-5-FP8 layout both ways, and dtype moves that keep the bytes."""
import json

import pytest
import torch

from zerokl.kernels import ops
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.checkpoint import load_tensors, save_tensors
from zerokl.kernels.model.fp8 import is_fp8, quantize_fp8

PROMPT = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
pytestmark = pytest.mark.usefixtures("cpu_backend")   # CPU models (the parity tests cover Triton on the GPU)


@pytest.fixture(scope="module")
def models():
    with torch.no_grad():
        bf16 = Model(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16)
        fp8 = quantize_fp8(Model(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16))
    return bf16, fp8


def test_the_projections_are_e4m3_and_the_rest_keeps_its_dtype(models):
    _, fp8 = models
    e4m3 = {n for n, p in fp8.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert "layers.0.self_attn.q_a_proj.weight" in e4m3 and "layers.1.mlp.gate_proj" in e4m3
    assert "layers.1.mlp.shared_experts.down_proj.weight" in e4m3 and "layers.0.self_attn.o_proj.weight" in e4m3
    for kept in ("embed_tokens.weight", "lm_head.weight", "layers.0.self_attn.kv_b_proj.weight",
                 "layers.1.mlp.gate.weight", "layers.0.self_attn.indexer.wk.weight"):
        assert kept not in e4m3
    assert fp8.layers[1].mlp.gate_proj_scale_inv.shape == (16, 1, 1)          # [E, ceil(I/128), ceil(D/128)]
    assert fp8.layers[1].mlp.gate.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="FP8 already"):
        quantize_fp8(fp8)


def test_fp8_logits_are_close_to_bf16(models):
    bf16, fp8 = models
    with torch.no_grad():
        a, b = bf16(PROMPT).float(), fp8(PROMPT).float()
    assert (a - b).abs().max() < 0.25 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.7


def test_checkpoint_round_trip_in_the_fp8_layout(models, tmp_path):
    _, fp8 = models
    fp8.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["dtype"] == "bfloat16"
    names = load_tensors(tmp_path)
    assert names["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert names["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"].dtype == torch.float32
    back = Model.from_pretrained(tmp_path)
    assert is_fp8(back)
    with torch.no_grad():
        assert torch.equal(back(PROMPT), fp8(PROMPT))


def test_a_checkpoint_that_quantizes_kv_b_proj_loads_it_dequantized(models, tmp_path):
    """GLM-5-FP8 ships kv_b_proj in e4m3; the absorbed attention keeps it in the model dtype."""
    _, fp8 = models
    fp8.save_pretrained(tmp_path)
    tensors = load_tensors(tmp_path)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    q, s = ops.fp8_quantize_weight(tensors[name].float())
    tensors[name], tensors[name + "_scale_inv"] = q, s
    save_tensors(tensors, tmp_path)
    back = Model.from_pretrained(tmp_path)
    got = back.layers[0].self_attn.kv_b_proj.weight
    assert got.dtype == torch.bfloat16 and torch.equal(got, ops.fp8_dequantize_weight(q, s, torch.bfloat16))


def test_a_bf16_checkpoint_loads_quantized_when_fp8_is_asked_for(models, tmp_path):
    from zerokl.kernels.model.fp8 import numerics_dtype
    bf16, fp8 = models
    bf16.save_pretrained(tmp_path)
    back = Model.from_pretrained(tmp_path, dtype=torch.float8_e4m3fn)
    assert numerics_dtype(back) == torch.float8_e4m3fn and numerics_dtype(bf16) == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(back(PROMPT), fp8(PROMPT))       # the same bytes as quantizing in memory


def test_moving_an_fp8_model_keeps_its_bytes(models):
    _, fp8 = models
    before = fp8.layers[0].self_attn.q_a_proj.weight.view(torch.uint8).clone()
    scale = fp8.layers[0].self_attn.q_a_proj.weight_scale_inv.clone()
    fp8.to(torch.bfloat16)
    assert torch.equal(fp8.layers[0].self_attn.q_a_proj.weight.view(torch.uint8), before)
    assert torch.equal(fp8.layers[0].self_attn.q_a_proj.weight_scale_inv, scale)
    assert fp8.layers[0].self_attn.q_a_proj.weight_scale_inv.dtype == torch.float32


def test_an_fp8_forward_under_autograd_is_refused_by_name(models):
    _, fp8 = models
    x = fp8.embed_tokens(PROMPT[0]).detach().requires_grad_(True)
    with pytest.raises(ValueError, match="no gradient"):
        fp8.layers[0].self_attn.q_a_proj(x)


def test_the_trainers_fp8_forward_is_the_replicas_and_trains_its_masters():
    """quantize_fp8(masters=True): logits equal to the served FP8 model's bit for bit (KL 0), a
    loss reaches every master through the straight-through backward, and after an optimizer
    step and refresh_fp8 the replica loading serving_state_dict computes the trainer's bits again."""
    from zerokl.kernels.model.fp8 import refresh_fp8, serving_state_dict
    trainer = quantize_fp8(Model(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16), masters=True)
    replica = quantize_fp8(Model(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16))
    logits = trainer(PROMPT)
    with torch.no_grad():
        assert torch.equal(logits, replica(PROMPT))
    torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 64), PROMPT[:, 1:].reshape(-1)).backward()
    masters = [trainer.layers[0].self_attn.q_a_proj.weight, trainer.layers[1].mlp.up_proj,
               trainer.layers[0].self_attn.o_proj.weight, trainer.layers[0].mlp.down_proj.weight]
    assert all(m.grad is not None and m.grad.abs().sum() > 0 and torch.isfinite(m.grad).all() for m in masters)
    with torch.no_grad():
        for p in trainer.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    refresh_fp8(trainer)
    replica.load_state_dict(serving_state_dict(trainer))
    with torch.no_grad():
        after = trainer(PROMPT)
        assert not torch.equal(after, logits) and torch.equal(after, replica(PROMPT))


def test_the_two_fp8_entry_points_agree_from_one_fp32_model():
    """serving_fp8_model (a replica's FP8 model) and trainable_fp8 (the trainer's) built from the
    same fp32 model hold the same serving bytes and compute the same logits: the router stays
    exact fp32 on both ways to bf16."""
    from zerokl.kernels.model.fp8 import serving_fp8_model, serving_state_dict, trainable_fp8
    base = Model(ModelConfig.preset("tiny"), seed=0)
    served = serving_fp8_model(Model(ModelConfig.preset("tiny"), seed=0))
    trainer = trainable_fp8(base)
    ours, theirs = serving_state_dict(trainer), served.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    with torch.no_grad():
        assert torch.equal(trainer(PROMPT), served(PROMPT))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_served_fp8_state_is_the_served_fp8_models_without_building_one(dtype: torch.dtype):
    """serving_fp8_state (an RL loop's FP8 rollouts of a bf16 trainer, every step) holds the bytes of
    serving_fp8_model(...).state_dict(), key for key, and shares no storage with the trainer's weights."""
    from zerokl.kernels.model.fp8 import serving_fp8_model, serving_fp8_state
    model = Model(ModelConfig.preset("tiny"), seed=0).to(dtype)
    ours, theirs = serving_fp8_state(model), serving_fp8_model(model).state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        a, b = ours[k], theirs[k]
        if b.dtype == torch.float8_e4m3fn:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k
        else:                       # the model's dtype: a replica's load rounds it to the served one
            assert torch.equal(a.to(b.dtype), b), k
    weights = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert not weights & {t.untyped_storage().data_ptr() for t in ours.values()}
    # A trainer's FP8 model: its own serving bytes, copied too.
    from zerokl.kernels.model.fp8 import serving_state_dict, trainable_fp8
    trainer = trainable_fp8(model)
    served = serving_fp8_state(trainer)
    assert all(torch.equal(served[k].view(torch.uint8) if served[k].dtype == torch.float8_e4m3fn else served[k],
                           v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
               for k, v in serving_state_dict(trainer).items())
    weights = {t.untyped_storage().data_ptr() for t in trainer.state_dict().values()}
    assert not weights & {t.untyped_storage().data_ptr() for t in served.values()}
