"""TrainConfig.cuda_graphs: SFT / PPO steps replayed from CUDA graphs (services/zerokl/services/trainer/step_graphs.py).

CPU tier: the shape buckets the graphs need leave every logprob's bits as they were (padding
positions and rows are computed alone, nothing real reads them). GPU tier: a replayed step is
the eager step bit for bit (loss, metrics, every gradient), across shapes, new inputs into the
graph's buffers, optimizer steps between replays, PPO with the KL reference, and a step that
cannot be captured (the sparse-attention path reads the device) stays eager and exact.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch

from zerokl.kernels import use_backend
from zerokl.kernels.backend import default_backend
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import ROW_BUCKET, TOKEN_BUCKET, Trainer, bucket
from zerokl.vocab import Completion, Rollout

TINY = ModelConfig.preset("tiny")


def _completions(n: int, seed: int, longest: int = 24, top_k: int = 0) -> list[Completion]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(2, 8)
        c = rng.randint(1, longest - p)
        out.append(Completion(tuple(rng.randrange(3, 64) for _ in range(p)), tuple(rng.randrange(3, 64) for _ in range(c)),
                              top_k=top_k))
    return out


def test_bucketed_batches_keep_every_logprobs_bits(cpu_backend):
    trainer = Trainer(Model(TINY, seed=0), TrainConfig())
    for seqs in (_completions(5, 1), _completions(3, 2, top_k=7), _completions(4, 3, longest=60)):
        plain, bucketed = trainer.batch_of(seqs, bucketed=False), trainer.batch_of(seqs, bucketed=True)
        assert bucketed.token_targets.shape[0] == bucket(plain.tokens, ROW_BUCKET) and bucketed.tokens == plain.tokens
        assert bucketed.input_ids.shape[0] == bucket(plain.input_ids.shape[0], TOKEN_BUCKET)
        with torch.no_grad():
            a = trainer.token_logprobs(trainer.model, plain)
            b = trainer.token_logprobs(trainer.model, bucketed)
        assert torch.equal(a, b[:, : a.shape[1]]) and not b[:, a.shape[1]:].any()   # completion width bucketed


def _grads(trainer: Trainer) -> list[torch.Tensor | None]:
    """Every trained parameter's gradient (None: unused by the step, e.g. the indexer on a dense batch)."""
    return [None if p.grad is None else p.grad.clone() for p in trainer.params]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


def _pair(device: str, **config) -> tuple[Trainer, Trainer]:
    """A graph trainer and an eager one on the same bucketed batches (same weights)."""
    graphed = Trainer(Model(TINY, seed=0).to(device), TrainConfig(cuda_graphs=True, **config))
    eager = Trainer(Model(TINY, seed=0).to(device), TrainConfig(cuda_graphs=False, **config))
    eager.batch_of = functools.partial(Trainer.batch_of, eager, bucketed=True)
    assert graphed._graphs is not None and eager._graphs is None
    return graphed, eager


@pytest.mark.gpu
def test_replayed_sft_steps_are_the_eager_steps_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with use_backend(default_backend()):
        graphed, eager = _pair("cuda", lr=1e-3)
        batches = [_completions(6, s) for s in (1, 2, 3, 4)] + [_completions(3, 5, longest=30)]
        for i, seqs in enumerate(batches * 2):               # each shape: eager, capture + replay, replays
            got, want = graphed.forward_backward("sft", seqs), eager.forward_backward("sft", seqs)
            assert got["loss"] == want["loss"] and got["tokens"] == want["tokens"], i
            assert _same(_grads(graphed), _grads(eager)), i
            graphed.optim_step()
            eager.optim_step()
        assert graphed._graphs.replays >= len(batches)          # every second pass replays
        for a, b in zip(graphed.params, eager.params, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_replayed_ppo_steps_with_a_kl_reference_are_the_eager_steps():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with use_backend(default_backend()):
        graphed, eager = _pair("cuda", lr=1e-3, kl_coef=0.05)
        seqs = _completions(8, 7, top_k=9)
        rollouts = [Rollout(s, tuple(-1.0 - 0.01 * j for j in range(len(s.completion_ids))), float(i % 3))
                    for i, s in enumerate(seqs)]
        adv = torch.linspace(-1, 1, len(rollouts))
        for step in range(4):
            got = graphed.forward_backward("ppo", rollouts, advantages=adv)
            want = eager.forward_backward("ppo", rollouts, advantages=adv)
            assert {k: v for k, v in got.items() if k != "tokens_per_s"} == \
                {k: v for k, v in want.items() if k != "tokens_per_s"}, step
            assert _same(_grads(graphed), _grads(eager)), step
            graphed.optim_step()
            eager.optim_step()
        assert graphed._graphs.replays == 3                     # steps 2 (captured), 3 and 4


@pytest.mark.gpu
def test_a_step_that_reads_the_device_stays_eager_and_exact():
    """Rows past the indexer's top-k take the sparse path, whose selection reads a count back: the
    sync check refuses the capture, the step runs eagerly, with the eager bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with use_backend(default_backend()):
        graphed, eager = _pair("cuda")
        seqs = [Completion(tuple(range(3, 43)), tuple(range(5, 25)))] * 2       # 60 tokens > index_topk 32
        for _ in range(3):
            got, want = graphed.forward_backward("sft", seqs), eager.forward_backward("sft", seqs)
            assert got["loss"] == want["loss"]
            assert _same(_grads(graphed), _grads(eager))
            graphed.optimizer.zero_grad(set_to_none=True)
            eager.optimizer.zero_grad(set_to_none=True)
        assert graphed._graphs.replays == 0 and len(graphed._graphs._eager) == 1
