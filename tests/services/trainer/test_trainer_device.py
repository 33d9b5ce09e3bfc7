"""The trainer on its model's device: every tensor it builds lives there (issue 23: CUDA failed with
"index is on cpu"), through the low-level API, SFT, DPO, the GRPO step, LoRA, the KL reference
and checkpoints; and the trainer service's --device flag.

Parametrized over devices: "cpu" always, "cuda" (gpu tier) where there is one.
"""
from __future__ import annotations

import asyncio
import pathlib
import random

import pytest
import torch

from zerokl.kernels import device_name, use_backend
from zerokl.kernels.backend import default_backend
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.checkpointing import read_checkpoint, write_checkpoint
from zerokl.services.trainer.checkpointing import open_repo
from zerokl.services.trainer.server import build_parser, start_trainer
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion

from conftest import engine_rollouts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TINY = ModelConfig.preset("tiny")


def _prompts(k: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 30))) for _ in range(k)]


def _on(device: str, trainer: Trainer) -> None:
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    if trainer.reference is not None:
        tensors += [*trainer.reference.parameters()]
    tensors += [t for state in trainer.optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0]
    assert {t.device.type for t in tensors} == {device}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lora,kl_coef", [(0, 0.0), (4, 0.05)])
def test_every_trainer_call_runs_on_the_models_device(device, lora, kl_coef, tmp_path: pathlib.Path):
    with use_backend(default_backend()):
        trainer = Trainer(Model(TINY, seed=0).to(device), TrainConfig(lr=3e-3, lora_rank=lora, kl_coef=kl_coef))
        assert trainer.device.type == device
        sft = [Completion(p, (7, 8, 9, 10)) for p in _prompts(3, 1)]
        pairs = [(Completion(p, (5, 6, 7)), Completion(p, (9, 9, 9))) for p in _prompts(2, 2)]
        got = trainer.forward_logprobs(sft)
        assert [(lp.device.type, lp.dtype, lp.shape) for lp in got] == [("cpu", torch.float32, (4,))] * 3
        metrics = trainer.forward_backward("sft", sft)
        assert metrics["tokens"] == 12 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert trainer.optim_step()["step"] == 1
        assert trainer.dpo_step(pairs)["tokens"] == 12
        rollouts = engine_rollouts(trainer.serving_model(), _prompts(2, 4), lambda toks: float(sum(toks) % 3), n=2,
                                   top_k=20, top_p=0.9, seed=3, max_num_batched_tokens=24)
        step = trainer.grpo_step(rollouts, group_size=2)
        assert (step["kl"], step["mismatched_tokens"], step["clip_fraction"]) == (0.0, 0, 0.0)
        _on(device, trainer)
        write_checkpoint(trainer, tmp_path / "ckpt", run="r", lineage=[])
        restored = read_checkpoint(tmp_path / "ckpt", restore_state=True, config=TrainConfig(), device=device).trainer
        _on(device, restored)
        assert restored.step == trainer.step == 3
        for name, tensor in trainer.model.state_dict().items():
            assert torch.equal(restored.model.state_dict()[name], tensor), name
        probe = [r.sequence for r in rollouts]
        for a, b in zip(restored.forward_logprobs(probe), trainer.forward_logprobs(probe)):
            assert torch.equal(a, b)
        fresh = read_checkpoint(tmp_path / "ckpt", restore_state=False, config=TrainConfig(), device=device).trainer
        _on(device, fresh)


@pytest.mark.parametrize("lora", [0, 4])
def test_adapters_and_batches_are_built_on_the_models_device_not_the_cpu(lora):
    """The meta device stands in for CUDA on a CPU-only machine: any tensor built on the CPU and
    mixed with the model's (LoRA's adapters, _batch's index tensors) raises, as on CUDA."""
    trainer = Trainer(Model(TINY, seed=0).to("meta"), TrainConfig(lora_rank=lora, kl_coef=0.1))
    assert {p.device.type for p in [*trainer.model.parameters(), *trainer.reference.parameters()]} == {"meta"}
    batch = trainer.batch_of([Completion((1, 2, 3), (4, 5)), Completion((1, 2), (4, 5, 6), 0.5, 3, 0.9)])
    tensors = [*batch.tensors(), batch.layout().write_slots]
    assert {t.device.type for t in tensors} == {"meta"}


def test_device_flag_is_exact_and_checked_before_loading(tmp_path: pathlib.Path):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--dev", "cpu"])                  # no abbreviations
    args = parser.parse_args(["--weights-dir", str(tmp_path / "w"), "--device", "bogus"])

    async def bad() -> None:
        repo = await open_repo(args)
        try:
            await start_trainer(args, repo)
        finally:
            await repo.close()
    with pytest.raises(SystemExit, match="--device bogus"):
        asyncio.run(bad())


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_service_serves_on_the_device_flag(device, tmp_path: pathlib.Path):
    args = build_parser().parse_args(["--weights-dir", str(tmp_path / "w"), "--device", device])

    async def main() -> None:
        repo = await open_repo(args)
        service = (await start_trainer(args, repo)).service
        try:
            assert service.trainer.device.type == device
            assert service.identity.device == device_name(device)
            [lp] = await service.forward_logprobs([Completion((1, 5, 9, 12), (7, 8))])
            assert lp.device.type == "cpu" and lp.shape == (2,)
        finally:
            await service.close()
    asyncio.run(main())
