"""The on-policy loop on countdown, in process: KL is exactly 0 at every step (and not with stock kernels)."""
import torch

from zerokl.model import Model, ModelConfig
from zerokl.model.tokenizer import CountdownTokenizer
from zerokl.services.scheduler.rl_loop import LocalEnginePort, LocalTrainerPort, RLConfig, Task, run_rl
from zerokl.services.trainer.trainer import TrainConfig, Trainer
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
    assert not torch.equal(trainer.versions["run-00000"]["lm_head.weight"], trainer.versions["run-00003"]["lm_head.weight"])


def test_lora_run_also_has_zero_kl():
    engine, trainer = _ports(lora=4)
    records = run_rl(_task(), engine, trainer, RLConfig(steps=2, prompts_per_step=2, group_size=4, max_tokens=10, eval_every=0))
    assert [r.kl for r in records] == [0.0, 0.0] and all(r.mismatched_tokens == 0 for r in records)


def test_stock_inference_kernels_show_the_mismatch():
    engine, trainer = _ports(backend="stock")
    records = run_rl(_task(), engine, trainer, RLConfig(steps=1, prompts_per_step=2, group_size=4, max_tokens=16, eval_every=0))
    assert records[0].mismatched_tokens > 0 and records[0].kl != 0.0
