"""The on-policy loop on countdown, in process: KL is exactly 0 at every step (and not with stock kernels)."""
import dataclasses

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.tokenizer import CountdownTokenizer
from zerokl.services.rl.loop import RLConfig, StaleRolloutError, Task, run_rl
from zerokl.services.rl.ports import LocalEnginePort, LocalTrainerPort, Sampled
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.weightstore.versions import WeightsVersion
from zerokl.tasks.countdown import format_prompt, generate_problems, reward

TOK = CountdownTokenizer()


def _task():
    return Task(train=generate_problems(40, seed=0), test=generate_problems(8, seed=1, split="test"),
                encode_prompt=lambda p: tuple([TOK.bos_id] + TOK.encode(format_prompt(p))), reward=reward)


def _ports(backend=None, lora=0):
    cfg = ModelConfig.preset("tiny").replace(vocab_size=TOK.vocab_size, bos_token_id=TOK.bos_id,
                                             eos_token_id=TOK.eos_id, pad_token_id=TOK.pad_id)
    trainer = LocalTrainerPort(Trainer(Model(cfg, seed=0), TrainConfig(lr=3e-3, lora_rank=lora)))
    return LocalEnginePort(trainer, TOK, backend=backend), trainer


def test_every_step_has_exactly_zero_kl_and_moves_the_weights():
    engine, trainer = _ports()
    records = run_rl(_task(), engine, trainer, RLConfig(steps=3, prompts_per_step=2, group_size=4, max_tokens=12,
                                                        eval_every=3, eval_prompts=4))
    assert [r.kl for r in records] == [0.0, 0.0, 0.0]
    assert all(r.mismatched_tokens == 0 and r.clip_fraction == 0.0 and r.ratio_max == 1.0 for r in records)
    assert [r.weights_version for r in records] == ["run-00001", "run-00002", "run-00003"]
    assert records[-1].test_accuracy is not None
    # The in-process port publishes in publish(): that is the step's sync, apart from train_s.
    assert all(r.sync_s is not None and r.tokens_per_s == r.tokens / r.train_s for r in records)
    assert not torch.equal(trainer.versions["run-00000"]["lm_head.weight"], trainer.versions["run-00003"]["lm_head.weight"])


def test_lora_run_also_has_zero_kl():
    engine, trainer = _ports(lora=4)
    records = run_rl(_task(), engine, trainer, RLConfig(steps=2, prompts_per_step=2, group_size=4, max_tokens=10, eval_every=0))
    assert [r.kl for r in records] == [0.0, 0.0] and all(r.mismatched_tokens == 0 for r in records)


def test_stock_inference_kernels_show_the_mismatch():
    engine, trainer = _ports(backend="stock")
    records = run_rl(_task(), engine, trainer, RLConfig(steps=1, prompts_per_step=2, group_size=4, max_tokens=16, eval_every=0))
    assert records[0].mismatched_tokens > 0 and records[0].kl != 0.0


class _StampedRollouts:
    """A rollout port whose samples were computed by ``served`` (an older version than the trainer's)."""

    def __init__(self, served: str):
        self.served = served

    def generate(self, prompts, options, weights_version):
        return [[Sampled(tuple(p), (5, 6), (-1.0, -1.0), "1+2", self.served) for _ in range(options.n)]
                for p in prompts]


class _TrainerAt:
    """A trainer port at ``version`` that records the updates it is asked for."""

    def __init__(self, version: str):
        self.weights_version, self.updates = version, 0

    def grpo_step(self, rollouts, group_size):
        self.updates += 1
        return dict(reward=0.0, kl=0.0, mismatched_tokens=0, clip_fraction=0.0, ratio_min=1.0, ratio_max=1.0,
                    loss=0.0, grad_norm=0.0, lr=0.0, tokens=len(rollouts))

    def publish(self):
        return self.weights_version


def test_staleness_is_counted_in_the_trainers_version_names():
    """Versions are named `<run>-step000003` (SaveWeights): a rollout two versions old is refused under
    max_staleness 1 and accepted (counted stale) under 2; a name without a step is never accepted."""
    config = RLConfig(steps=1, prompts_per_step=2, group_size=2, max_tokens=2, eval_every=0, max_staleness=1)
    trainer = _TrainerAt(str(WeightsVersion("run", 3)))
    with pytest.raises(StaleRolloutError, match="run-step000001"):
        run_rl(_task(), _StampedRollouts(str(WeightsVersion("run", 1))), trainer, config)
    assert trainer.updates == 0
    records = run_rl(_task(), _StampedRollouts(str(WeightsVersion("run", 1))), trainer,
                     dataclasses.replace(config, max_staleness=2))
    assert trainer.updates == 1 and records[0].stale_rollouts == 4
    with pytest.raises(StaleRolloutError):
        run_rl(_task(), _StampedRollouts("hand-named"), trainer, dataclasses.replace(config, max_staleness=5))
