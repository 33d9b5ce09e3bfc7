"""Training on the FP8 forward (TrainConfig.dtype "fp8"): the trainer's logprobs are the FP8 engine's
bit for bit at every step (KL exactly 0), its e4m3 values are re-quantized from the fp32 masters
after each step, what it publishes is what an FP8 replica loads (the same bytes), and a run resumed
from a published version continues bit for bit."""
import random

import pytest
import torch

from zerokl.kernels import ops
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.fp8 import has_fp8_masters, is_fp8, numerics_dtype, quantize_fp8
from zerokl.services.trainer.checkpointing import read_checkpoint, write_checkpoint
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion, Rollout, SamplingOptions

from conftest import below_16, engine_rollouts

TINY = ModelConfig.preset("tiny")
pytestmark = pytest.mark.usefixtures("cpu_backend")


def _prompts(k: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 24))) for _ in range(k)]


def _fp8_trainer(**kw) -> Trainer:
    return Trainer(Model(TINY, seed=1), TrainConfig(dtype="fp8", lr=kw.pop("lr", 1e-3), **kw))


def _bytes(state: dict) -> dict:
    return {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in state.items()}


def _equal_states(a: dict, b: dict) -> bool:
    a, b = _bytes(a), _bytes(b)
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_fp8_trainer_logprobs_are_the_fp8_engines_at_every_step():
    trainer = _fp8_trainer()
    assert has_fp8_masters(trainer.model) and numerics_dtype(trainer.model) == torch.float8_e4m3fn
    assert trainer.masters is not None and all(m.dtype == torch.float32 for m in trainer.masters)
    # Step 0: the e4m3 bytes are those a replica gets quantizing the same (bf16-rounded) seeded weights.
    replica = quantize_fp8(Model(TINY, seed=1, dtype=torch.bfloat16))
    assert _equal_states(trainer.serving_state_dict(), replica.state_dict())
    for step in range(3):
        served = trainer.serving_model()
        assert is_fp8(served) and not has_fp8_masters(served)
        rollouts = engine_rollouts(served, _prompts(3, step), below_16, n=2, seed=step)
        recomputed = trainer.forward_logprobs([r.sequence for r in rollouts])
        for r, lp in zip(rollouts, recomputed):
            assert torch.equal(lp, torch.tensor(r.logprobs, dtype=torch.float32))
        before = trainer.model.layers[0].self_attn.q_a_proj.weight_fp8.clone()
        m = trainer.grpo_step(rollouts, group_size=2)
        assert m["kl"] == 0.0 and m["mismatched_tokens"] == 0 and m["clip_fraction"] == 0.0
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
        after = trainer.model.layers[0].self_attn.q_a_proj
        assert not torch.equal(after.weight_fp8.view(torch.uint8), before.view(torch.uint8))
        # One rounding fp32 master -> e4m3 (not of its bf16 rounding); the bf16 weight is the master's rounding.
        master = trainer.masters[[id(p) for p in trainer.params].index(id(after.weight))]
        q, s = ops.fp8_quantize_weight(master)
        assert torch.equal(after.weight_fp8.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(after.weight_scale_inv, s) and torch.equal(after.weight.detach(), master.to(torch.bfloat16))


def test_published_fp8_weights_are_what_a_replica_serves_and_resume_bit_for_bit(tmp_path):
    data = [Completion(p, (7, 8, 9, 10)) for p in _prompts(4, 1)]
    trainer = _fp8_trainer()
    trainer.sft_step(data)
    write_checkpoint(trainer, tmp_path, run="r", lineage=[])
    replica = Model.from_pretrained(tmp_path)                # what an FP8 replica loads from the store
    assert is_fp8(replica) and not has_fp8_masters(replica)
    assert _equal_states(replica.state_dict(), trainer.serving_state_dict())
    prompt = torch.tensor([_prompts(1, 5)[0]])
    with torch.no_grad():
        assert torch.equal(replica(prompt), trainer.model(prompt))
    resumed = read_checkpoint(tmp_path, restore_state=True, config=TrainConfig(), run="r").trainer
    assert resumed.fp8 and resumed.config.dtype == "fp8"
    for t in (trainer, resumed):
        t.sft_step(data)
    assert _equal_states(resumed.serving_state_dict(), trainer.serving_state_dict())
    assert all(torch.equal(a, b) for a, b in zip(resumed.masters, trainer.masters, strict=True))


def test_a_trainer_started_from_served_fp8_bytes_keeps_them(tmp_path):
    """From a published FP8 version (no trainer state): until its first step the trainer computes
    exactly what the replicas serving that version compute (its bytes, not a re-quantization)."""
    quantize_fp8(Model(TINY, seed=2, dtype=torch.bfloat16)).save_pretrained(tmp_path)
    served = Model.from_pretrained(tmp_path)
    trainer = Trainer(Model.from_pretrained(tmp_path), TrainConfig())        # an FP8 model: its FP8 forward
    assert trainer.fp8 and has_fp8_masters(trainer.model)
    assert _equal_states(trainer.serving_state_dict(), served.state_dict())
    rollouts = engine_rollouts(served, _prompts(2, 3), below_16, n=2, seed=1)
    assert trainer.grpo_step(rollouts, group_size=2)["kl"] == 0.0


def test_fp8_training_refuses_what_it_cannot_hold_by_name():
    with pytest.raises(ValueError, match="LoRA"):
        _fp8_trainer(lora_rank=4)
    with pytest.raises(ValueError, match="master weights"):
        _fp8_trainer(master_weights=False)
    with pytest.raises(ValueError, match="dtype 'float16'"):
        Trainer(Model(TINY, seed=1), TrainConfig(dtype="float16"))
    fp8 = quantize_fp8(Model(TINY, seed=1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="on an FP8 model"):
        Trainer(fp8, TrainConfig(dtype="bfloat16"))
    assert Trainer(Model(TINY, seed=1), TrainConfig(dtype="bfloat16")).model.dtype == torch.bfloat16


def test_the_fp8_trainer_service_matches_fp8_replicas_and_publishes_their_bytes(tmp_path):
    """`zerokl serve trainer --dtype fp8` from the preset the FP8 replicas serve: it advertises the
    FP8 fingerprint, its GRPO step on FP8 engine rollouts has KL exactly 0, and the version it
    publishes (e4m3 + scales, quantization_config) is what an FP8 replica loads, bit for bit."""
    import asyncio

    from zerokl.kernels import fingerprint
    from zerokl.services.runtime import ServiceServer
    from zerokl.services.trainer.client import TrainerClient
    from zerokl.services.trainer.checkpointing import open_repo
    from zerokl.services.trainer.server import build_parser, start_trainer
    from zerokl.services.trainer.service import add_trainer_service

    fp8 = fingerprint(dtype=torch.float8_e4m3fn)
    replica = quantize_fp8(Model(TINY, seed=0, dtype=torch.bfloat16))     # `serve decode --preset tiny --dtype fp8`

    async def main() -> None:
        args = build_parser().parse_args(["--weights-dir", str(tmp_path / "w"), "--port", "0", "--dtype", "fp8",
                                          "--lr", "1e-3"])
        service = (await start_trainer(args, await open_repo(args))).service
        server = ServiceServer("trainer")
        add_trainer_service(server, service)
        await server.start()
        try:
            async with TrainerClient(server.address) as client:
                info = await client.info()
                assert (info.weights_version, info.numerics_fingerprint, info.dtype) == \
                    ("preset-tiny-seed0", fp8, "float8_e4m3fn")
                served = replica
                for step in range(2):
                    rollouts = engine_rollouts(served, _prompts(2, step), below_16, n=4, seed=step,
                                               version=info.weights_version)
                    fb, _ = await client.grpo_step(rollouts, group_size=4)
                    assert (fb.ppo.kl, fb.ppo.mismatched_tokens, fb.ppo.clip_fraction) == (0.0, 0, 0.0)
                    manifest, _ = await client.save_weights()
                    assert manifest.spec.numerics_fingerprint == fp8
                    assert manifest.spec.model_config["quantization_config"]["weight_block_size"] == [128, 128]
                    served = Model.from_pretrained(tmp_path / "w" / "versions" / manifest.version)
                    assert is_fp8(served)
                    assert _equal_states(served.state_dict(), service.trainer.serving_state_dict())
                    info = await client.info()
        finally:
            await server.drain(0)
            await service.close()
    asyncio.run(main())


@pytest.mark.gpu
def test_on_cuda_the_fp8_trainer_is_the_fp8_engine_bit_for_bit(monkeypatch):
    """GPU tier: the Triton FP8 kernels (tensor-core e4m3 MMA) in the engine, CUDA graphs on, and in
    the trainer's forward: KL exactly 0 at every step on the device too."""
    from zerokl.kernels import use_backend
    monkeypatch.setenv("ZEROKL_BACKEND", "triton")
    with use_backend("triton"):
        trainer = Trainer(Model(TINY, seed=1).to("cuda"), TrainConfig(dtype="fp8", lr=1e-3))
        for step in range(2):
            rollouts = engine_rollouts(trainer.serving_model(), _prompts(4, step), below_16, n=2, seed=step,
                                       max_num_batched_tokens=24)
            recomputed = trainer.forward_logprobs([r.sequence for r in rollouts])
            assert all(torch.equal(lp, torch.tensor(r.logprobs, dtype=torch.float32))
                       for r, lp in zip(rollouts, recomputed))
            m = trainer.grpo_step(rollouts, group_size=2)
            assert (m["kl"], m["mismatched_tokens"], m["clip_fraction"]) == (0.0, 0, 0.0)


@pytest.mark.gpu
def test_on_cuda_the_fp8_step_from_a_cuda_graph_is_the_eager_step_bit_for_bit(monkeypatch):
    """GPU tier: the FP8 trainer's SFT step replayed from a CUDA graph (the same batch shape every step, so
    steps 2 and 3 replay what step 1 captured, over e4m3 values re-quantized in place after each optimizer
    step) gives the eager FP8 trainer's losses, weights and e4m3 bytes, bit for bit."""
    from zerokl.kernels import use_backend
    monkeypatch.setenv("ZEROKL_BACKEND", "triton")
    data = [Completion(tuple(range(3, 3 + 5 + i)), tuple(range(20, 26))) for i in range(4)]
    with use_backend("triton"):
        graphed, eager = (Trainer(Model(TINY, seed=1).to("cuda"), TrainConfig(dtype="fp8", lr=1e-3, cuda_graphs=g))
                          for g in (None, False))
        assert graphed._graphs is not None and eager._graphs is None
        for _ in range(3):
            assert graphed.sft_step(data)["loss"] == eager.sft_step(data)["loss"]
        # Steps 2 (captured) and 3 replayed the graph: a step that fell back to eager would compare eager to eager.
        assert graphed._graphs.replays == 2 and not graphed._graphs._eager
        assert _equal_states(graphed.serving_state_dict(), eager.serving_state_dict())
        assert all(torch.equal(a, b) for a, b in zip(graphed.masters, eager.masters, strict=True))


def test_an_fp8_trainer_with_a_kl_reference_resumes_and_the_local_ports_serve_its_versions(tmp_path):
    """The KL penalty's reference is an FP8 forward too and resumes from a checkpoint; the RL loop's
    in-process ports (services.rl.ports) serve an FP8 trainer's versions with KL exactly 0."""
    from zerokl.services.rl.ports import LocalEnginePort, LocalTrainerPort
    from zerokl.tokenizer import CountdownTokenizer
    trainer = _fp8_trainer(kl_coef=0.05)
    port = LocalTrainerPort(trainer)
    engine = LocalEnginePort(port, CountdownTokenizer())
    for step in range(2):
        options = SamplingOptions(temperature=1.0, top_p=1.0, max_tokens=6, n=2, seed=step)
        groups = engine.generate(_prompts(2, step), options, weights_version=port.weights_version)
        rollouts = [Rollout(Completion(s.prompt_ids, s.completion_ids), s.logprobs, below_16(s.completion_ids))
                    for g in groups for s in g]
        m = port.grpo_step(rollouts, 2)
        assert m["kl"] == 0.0 and m["mismatched_tokens"] == 0
        port.publish()
    write_checkpoint(trainer, tmp_path, run="r", lineage=[])
    resumed = read_checkpoint(tmp_path, restore_state=True, config=TrainConfig(), run="r").trainer
    assert has_fp8_masters(resumed.reference)
    assert _equal_states(resumed.reference.state_dict(), trainer.reference.state_dict())
