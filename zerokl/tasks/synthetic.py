"""Synthetic RL rewards for measuring the loop at the shapes a reasoning model samples (issue 49).

A random or barely trained model never earns the countdown reward, so every advantage is zero and an
RL step changes no weight: the loop's cost at long answers is then not what a real run pays (the
optimizer moves nothing, and the weight store records identical versions). :func:`vowel_share` gives
every answer a reward that varies from sample to sample and that the policy can climb from any
weights: the share of the answer's letters that are vowels. With ``ignore_eos`` (RLJobSpec) every
answer is exactly ``max_tokens`` long, so a step's answers have the length asked for.
"""
from __future__ import annotations

from typing import Any

__all__ = ["REWARDS", "vowel_share"]


def vowel_share(completion: str, problem: Any = None) -> float:
    """Share of the letters of ``completion`` that are vowels (0.0 with no letter). Never raises."""
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


REWARDS = ("countdown", "vowel_share")      # RLJobSpec.reward: the TinyZero countdown reward, or vowel_share
