"""Shared setup of the trainer tests: rollouts sampled by the inference engine (real behaviour logprobs).

Test modules here import these helpers with ``from conftest import ...`` (pytest puts this
folder on sys.path; test_distributed.py's spawned ranks run with it as their script folder).
"""
from __future__ import annotations

from typing import Callable, Sequence

from zerokl.kernels.model import Model
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import Completion, Rollout, SamplingOptions

__all__ = ["below_16", "engine_rollouts"]


def below_16(completion_ids: tuple[int, ...]) -> float:
    """A toy reward: the fraction of ids below 16 (a quarter of the tiny vocabulary), so rewards
    differ within a group and GRPO's advantages are not all zero."""
    return sum(t < 16 for t in completion_ids) / len(completion_ids)


def engine_rollouts(model: Model, prompts: Sequence[tuple[int, ...]],
                    reward: Callable[[tuple[int, ...]], float], *, n: int = 4, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, max_tokens: int = 6, seed: int = 0, version: str = "",
                    max_num_batched_tokens: int = 64) -> list[Rollout]:
    """Sample ``n`` completions of each prompt with the inference engine on ``model`` (usually a
    trainer's ``serving_model()``), ``max_tokens`` each (eos ignored).

    Returns one Rollout per sample, prompt by prompt and in sample-index order: the completion
    with the sampling distribution it was drawn from, the engine's behaviour logprobs,
    ``reward(completion_ids)`` and the weights ``version`` it was sampled from.
    """
    engine = Engine(model, EngineConfig(max_num_batched_tokens=max_num_batched_tokens))
    opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, n=n,
                           seed=seed, ignore_eos=True)
    requests = [GenerateRequest(f"p{i}", p, opts) for i, p in enumerate(prompts)]
    outs = run_to_completion(engine, requests)
    rollouts = []
    for r in requests:
        for index in range(n):
            deltas = [d for d in outs[r.request_id] if d.index == index]
            toks = tuple(t for d in deltas for t in d.token_ids)
            lps = tuple(lp for d in deltas for lp in d.logprobs)
            sequence = Completion(r.prompt_ids, toks, temperature, top_k, top_p)
            rollouts.append(Rollout(sequence, lps, reward(toks), version))
    return rollouts
