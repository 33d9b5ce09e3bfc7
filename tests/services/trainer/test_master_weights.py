"""fp32 master weights for a bf16 model: small updates accumulate, the forward bits stay the engine's,
checkpoints resume bit for bit, fp32 models are untouched."""
import random

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.checkpointing import read_checkpoint, write_checkpoint
from zerokl.services.trainer.distributed import DistributedTrainer
from zerokl.services.trainer.optim import NonFiniteStep, adamw, grad_norm
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion

from conftest import engine_rollouts

TINY = ModelConfig.preset("tiny")


def _prompts(k: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 24))) for _ in range(k)]


def _sft_data() -> list[Completion]:
    return [Completion(p, (7, 8, 9, 10)) for p in _prompts(4, 1)]


def _bf16_trainer(**kw) -> Trainer:
    return Trainer(Model(TINY, seed=1, dtype=torch.bfloat16), TrainConfig(**kw))


def test_master_weights_default_on_for_bf16_off_for_fp32():
    assert _bf16_trainer().masters is not None
    assert _bf16_trainer(master_weights=False).masters is None
    fp32 = Trainer(Model(TINY, seed=1), TrainConfig())
    assert fp32.masters is None and fp32.master_weights is False
    assert all(m.dtype == torch.float32 for m in _bf16_trainer().masters)
    # LoRA trains fp32 adapters (zerokl.kernels.model.lora) on the bf16 base: nothing to keep.
    assert _bf16_trainer(lora_rank=4).masters is None


def test_small_lr_moves_bf16_weights_only_with_masters():
    """At lr 1e-5 a bf16 AdamW step (about lr per weight) is below half an ulp of most weights
    and is lost; the fp32 masters accumulate the steps until the rounded weights move."""
    data, steps = _sft_data(), 8
    counts = {}
    for masters in (False, True):
        trainer = _bf16_trainer(lr=1e-5, master_weights=masters)
        before = [p.detach().clone() for p in trainer.params]
        for _ in range(steps):
            trainer.sft_step(data)
        changed = sum(int((p != b).sum()) for p, b in zip(trainer.params, before))
        counts[masters] = changed
        if masters:
            # The model's weights are the masters rounded to bf16, in place (the same Parameter objects).
            assert all(torch.equal(p.detach(), m.to(p.dtype)) for p, m in zip(trainer.params, trainer.masters))
            assert all(p is q for p, q in zip(trainer.params, trainer.model.parameters()))
            moved = sum(int((m != b.float()).sum()) for m, b in zip(trainer.masters, before))
            total = sum(b.numel() for b in before)
            assert moved > 0.9 * total, (moved, total)
    # Measured over the 2.2M trained elements: 21% moved without masters (the weights smallest in
    # magnitude, whose ulp is below lr), 81% with them.
    total = sum(p.numel() for p in _bf16_trainer().params)
    assert counts[False] < 0.35 * total, counts
    assert counts[True] > 0.65 * total, counts


@pytest.mark.parametrize("lora,master_weights", [(0, None), (4, True)])
def test_logprobs_after_master_steps_are_the_engines(lora, master_weights):
    """The forward runs on the rounded bf16 weights: trainer == engine bitwise, KL exactly 0, every step.
    (LoRA adapters are fp32 already, so their masters are asked for explicitly: the same path.)"""
    trainer = _bf16_trainer(lr=1e-3, lora_rank=lora, master_weights=master_weights)
    assert trainer.masters is not None
    start = {k: v.clone() for k, v in trainer.serving_state_dict().items()}
    for step in range(2):                     # the second step samples from the updated weights
        # Engine samples on the trainer's serving (bf16) weights, with the engine's logprobs.
        rollouts = engine_rollouts(trainer.serving_model(), _prompts(2, step),
                                   lambda toks: float(sum(t < 16 for t in toks)), n=2, seed=step)
        recomputed = trainer.forward_logprobs([r.sequence for r in rollouts])
        for r, lp in zip(rollouts, recomputed):
            assert torch.equal(lp, torch.tensor(r.logprobs, dtype=torch.float32))
        m = trainer.grpo_step(rollouts, group_size=2)
        assert m["kl"] == 0.0 and m["mismatched_tokens"] == 0 and m["clip_fraction"] == 0.0
    assert trainer.serving_model().dtype == torch.bfloat16
    assert any(not torch.equal(v, start[k]) for k, v in trainer.serving_state_dict().items())
    if lora:
        assert len(trainer.masters) == len(trainer.params) and all("lora_" in n for n, p in
                                                                  trainer.model.named_parameters()
                                                                  if any(p is q for q in trainer.params))


def _same_trainer_state(a: Trainer, b: Trainer) -> None:
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert all(torch.equal(x, y) for x, y in zip(a.masters, b.masters, strict=True))
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert all(torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])) for k in sa[i]), i
    assert a.step == b.step


@pytest.mark.parametrize("via", ["state_dict", "checkpoint"])
def test_save_load_continue_equals_continuing(via, tmp_path):
    """A resumed bf16 run continues bitwise the uninterrupted one: the masters are saved and loaded
    (the bf16 serving weights alone would not do: they are only the masters' rounding)."""
    data, config = _sft_data(), dict(lr=3e-4, warmup_steps=1, total_steps=5)
    straight = _bf16_trainer(**config)
    for _ in range(4):
        straight.sft_step(data)
    first = _bf16_trainer(**config)
    for _ in range(2):
        first.sft_step(data)
    if via == "state_dict":
        resumed = Trainer(Model(TINY, seed=99, dtype=torch.bfloat16), TrainConfig(**config))
        resumed.load_state_dict(first.state_dict())
    else:
        write_checkpoint(first, tmp_path / "ckpt", run="r", lineage=[])
        resumed = read_checkpoint(tmp_path / "ckpt", restore_state=True, config=TrainConfig()).trainer
        assert resumed.model.dtype == torch.bfloat16 and resumed.masters is not None
    _same_trainer_state(first, resumed)
    for _ in range(2):
        resumed.sft_step(data)
    _same_trainer_state(straight, resumed)
    # Without the masters (weights only) the continuation differs: the check can fail.
    lossy = Trainer(Model(TINY, seed=99, dtype=torch.bfloat16), TrainConfig(**config))
    lossy.load_state_dict({k: v for k, v in first.state_dict().items() if k != "masters"})
    for _ in range(2):
        lossy.sft_step(data)
    assert any(not torch.equal(x, y) for x, y in zip(lossy.masters, straight.masters))


def test_a_non_finite_step_restores_masters_too():
    trainer = _bf16_trainer(lr=3e-3)
    data = _sft_data()[:2]
    trainer.sft_step(data)
    weights = [p.detach().clone() for p in trainer.params]
    masters = [m.clone() for m in trainer.masters]
    moments = [v.clone() for s in trainer.optimizer.state.values() for v in s.values()]
    trainer.forward_backward("sft", data)
    trainer.params[0].grad[0] = float("inf")
    with pytest.raises(NonFiniteStep, match="non-finite"):
        trainer.optim_step()
    assert trainer.step == 1
    assert all(p.grad is None for p in trainer.params) and all(m.grad is None for m in trainer.masters)
    assert all(torch.equal(p, w) for p, w in zip(trainer.params, weights, strict=True))
    assert all(torch.equal(m, w) for m, w in zip(trainer.masters, masters, strict=True))
    assert all(torch.equal(a, b) for a, b in
               zip([v for s in trainer.optimizer.state.values() for v in s.values()], moments, strict=True))
    trainer.sft_step(data)                    # and training goes on from there
    assert trainer.step == 2


def test_clipping_runs_on_the_fp32_gradients():
    """The masters take exactly AdamW's step on the fp32 gradients scaled to the clip norm."""
    trainer = _bf16_trainer(lr=1e-3, grad_clip=1e-3)
    trainer.forward_backward("sft", _sft_data())
    grads = [None if p.grad is None else p.grad.float() for p in trainer.params]   # None: not in this loss
    norm = grad_norm([g for g in grads if g is not None])
    expect = [m.clone() for m in trainer.masters]
    scale = 1e-3 / (norm + 1e-6)
    for e, g in zip(expect, grads):
        e.grad = None if g is None else g * scale
    adamw(expect, 1e-3, trainer.config.betas, 0.0, trainer.device).step()
    metrics = trainer.optim_step()
    assert metrics["grad_norm"] == norm > 1e-3
    assert all(torch.equal(m, e) for m, e in zip(trainer.masters, expect, strict=True))


def test_fp32_models_are_unchanged_by_master_weights():
    """fp32: off by default; forcing masters on gives the same bits (AdamW on an fp32 copy of an fp32 weight)."""
    data = _sft_data()
    runs = []
    for masters in (None, True):
        trainer = Trainer(Model(TINY, seed=2), TrainConfig(lr=3e-3, master_weights=masters))
        assert (trainer.masters is None) == (masters is None)
        losses = [trainer.sft_step(data)["loss"] for _ in range(3)]
        runs.append((losses, trainer.model.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())


def test_distributed_trainer_refuses_master_weights():
    with pytest.raises(ValueError, match="master weights"):
        DistributedTrainer(_bf16_trainer(master_weights=True), group=None)


def test_distributed_trainer_turns_default_masters_off_and_keeps_their_state():
    """A bf16 trainer with masters by default enters the distributed trainer without them: its config
    says so, and its AdamW state (kept on the masters) is found under the parameters' names."""
    from zerokl.services.trainer.distributed import _named_optimizer_state, _without_masters

    trainer = _bf16_trainer(lr=1e-3)
    trainer.sft_step(_sft_data())
    assert trainer.config.master_weights is None and _without_masters(trainer).master_weights is False
    named = _named_optimizer_state(trainer)
    by_name = dict(trainer.model.named_parameters())
    assert len(named) == len(trainer.optimizer.state) > 0
    for name, state in named.items():
        master = trainer.masters[next(i for i, p in enumerate(trainer.params) if p is by_name[name])]
        assert state is trainer.optimizer.state[master] and state["exp_avg"].dtype == torch.float32
    fp32 = Trainer(Model(TINY, seed=1), TrainConfig())
    assert _without_masters(fp32) is fp32.config
