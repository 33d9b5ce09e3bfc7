"""Countdown as the demo, the experiment, the scheduler's jobs and the SFT recipe set it up.

The `tiny` model with the countdown vocabulary, the demo's problem distribution
(:data:`~zerokl.tasks.countdown.DEMO_PROBLEMS`), prompt encoding, SFT
demonstrations and greedy test accuracy, in one place.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Callable

from zerokl.tasks import countdown_trace
from zerokl.tasks.countdown import DEMO_PROBLEMS, format_demonstration

__all__ = ["ANSWERS", "Answers", "DIFFICULTIES", "MAX_TOKENS", "SFT_CHECKPOINT", "countdown_config", "countdown_data",
           "demonstration_batch", "encode_prompt", "greedy_accuracy"]

#: The warm start the demo and `zerokl up` serve (tools/train_countdown_sft.py writes it).
SFT_CHECKPOINT = pathlib.Path(__file__).resolve().parent.parent / "assets" / "countdown-sft"

# Sampled tokens per completion. "<answer>" and "</answer>" are one token each, so even a
# 4-number expression with parentheses ("(25-13)*(24-22)", 15 tokens) and eos fit.
MAX_TOKENS = 24

#: Problem distributions by name (generate_problems keyword arguments). "demo" is what the demo,
#: the shipped SFT checkpoint and the CPU experiment use; the others are for the sweep that picks
#: the difficulty at which a model of a given size learns.
DIFFICULTIES = {
    "easy": {"num_range": (1, 15), "target_range": (1, 50), "n_numbers": (3, 3)},  # 5,848 train problems in all
    "demo": DEMO_PROBLEMS,
    "hard": {"num_range": (1, 25), "target_range": (1, 100), "n_numbers": (4, 4)},
}


@dataclass(frozen=True)
class Answers:
    """How completions answer: the SFT demonstration of a problem, and the sampled-token limit."""

    demonstration: Callable            # Problem -> the completion's text
    max_tokens: int


#: Answer formats by name (`zerokl experiment --answers`): the TinyZero answer alone, or a depth-first
#: search trace before it (512+ tokens; zerokl.tasks.countdown_trace: its problems are those of the
#: difficulty whose trace is TRACE_TOKENS long).
ANSWERS = {"short": Answers(format_demonstration, MAX_TOKENS),
           "trace": Answers(countdown_trace.format_trace_demonstration, countdown_trace.MAX_TOKENS)}


def _difficulty(name: str) -> dict:
    if name not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {name!r}: expected one of {sorted(DIFFICULTIES)}")
    return DIFFICULTIES[name]


def countdown_config(tok, preset: str = "tiny"):  # noqa: ANN001, ANN201 - a CountdownTokenizer -> ModelConfig
    """The model `preset` ("tiny", "small", ...) with the countdown vocabulary."""
    from zerokl.kernels.model import ModelConfig
    return ModelConfig.preset(preset).replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                              eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)


def countdown_data(seed: int = 0, n_train: int = 20000, n_test: int = 200, difficulty: str = "demo",  # noqa: ANN201
                   answers: str = "short"):
    """(train problems, test problems, tokenizer) of a countdown distribution (default: the demo's);
    with ``answers="trace"`` the distribution's problems whose search trace is TRACE_TOKENS long."""
    from zerokl.tokenizer import CountdownTokenizer
    from zerokl.tasks.countdown import generate_problems
    kw = _difficulty(difficulty)
    if answers not in ANSWERS:
        raise ValueError(f"unknown answers {answers!r}: expected one of {sorted(ANSWERS)}")
    draw = countdown_trace.trace_problems if answers == "trace" else generate_problems
    train = draw(n_train, seed=seed, **kw)
    test = draw(n_test, seed=seed + 1, split="test", **kw)
    return train, test, CountdownTokenizer()


def encode_prompt(problem, tok) -> tuple[int, ...]:  # noqa: ANN001
    from zerokl.tasks.countdown import format_prompt
    return tuple([tok.bos_id] + tok.encode(format_prompt(problem)))


def demonstration_batch(problems, tok, answers: str = "short") -> list:  # noqa: ANN001
    """SFT completions: the solver's answer (or, with answers="trace", its search trace and answer), then eos."""
    from zerokl.vocab import Completion
    demo = ANSWERS[answers].demonstration
    return [Completion(encode_prompt(p, tok), tuple(tok.encode(demo(p)) + [tok.eos_id])) for p in problems]


def greedy_accuracy(model, problems, tok, max_tokens: int = MAX_TOKENS) -> float:  # noqa: ANN001
    """Share of `problems` whose greedy completion (at most `max_tokens`) earns reward 1.0 (offline engine)."""
    from zerokl.services.engine.engine import Engine, run_to_completion
    from zerokl.services.engine.types import EngineConfig, GenerateRequest
    from zerokl.vocab import SamplingOptions
    from zerokl.tasks.countdown import reward
    opts = SamplingOptions(temperature=0.0, max_tokens=max_tokens)
    reqs = [GenerateRequest(str(i), encode_prompt(p, tok), opts) for i, p in enumerate(problems)]
    outs = run_to_completion(Engine(model.eval(), EngineConfig(max_num_batched_tokens=1024, num_blocks=1024),
                                    tokenizer=tok), reqs)
    texts = ["".join(o.text for o in outs[r.request_id]) for r in reqs]
    return sum(reward(t, p) == 1.0 for t, p in zip(texts, problems)) / max(1, len(problems))
