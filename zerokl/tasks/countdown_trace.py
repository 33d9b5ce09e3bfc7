"""Countdown with a search trace: answers that run to 512+ tokens (issue 53).

The same problems, prompt and reward as :mod:`zerokl.tasks.countdown`; the demonstration is a
depth-first search written out step by step before the answer, as in Stream of Search (Gandhi
et al. 2024, countdown search traces). Each line combines two of the numbers left:

    "25-13=12 rest 12 7\\n"      (a - b = c, and the numbers left after it)
    "12*7=84\\n"                 (the last combination: one number left)

The search tries pairs in order, then + * - / (a difference or quotient only when it is a
positive integer, larger over smaller), backtracking from every dead end, and stops at the
first path that reaches the target; then ``<answer>EXPR</answer>``. A problem whose only
solutions need fractions gets the whole failed search, then the solver's answer. The reward
reads the last answer, so the trace itself earns nothing; an answer cut off at the token limit
earns 0.

Length: the countdown tokenizer is character-level. On the demo's problems (3 numbers) a trace
is short (median 145 tokens, 0.7% reach 512); on 4 numbers ("hard") it is 62 to 11,000 tokens
(median 1,353). :func:`trace_problems` keeps the problems whose demonstration is
TRACE_TOKENS long (8% of the hard draws): answers of 512+ tokens that fit MAX_TOKENS.
"""
from __future__ import annotations

from zerokl.tasks.countdown import Problem, generate_problems

__all__ = ["MAX_TOKENS", "TRACE_TOKENS", "search_trace", "format_trace_demonstration", "trace_tokens",
           "trace_problems"]

#: Sampled tokens per completion of the trace task: a demonstration's length and some room past it.
MAX_TOKENS = 1024
#: The demonstration lengths (tokens, inclusive) of the trace task's problems.
TRACE_TOKENS = (512, 960)

_Item = tuple[int, str]                 # (value, its expression over the numbers used)


def _combine(a: _Item, b: _Item) -> list[tuple[str, _Item]]:
    """Each positive-integer combination of a and b: (the line's "x op y=z", the new item)."""
    (x, ex), (y, ey) = (a, b) if a[0] >= b[0] else (b, a)
    out = [(f"{x}+{y}={x + y}", (x + y, f"({ex}+{ey})")), (f"{x}*{y}={x * y}", (x * y, f"{ex}*{ey}"))]
    if x > y:
        out.append((f"{x}-{y}={x - y}", (x - y, f"({ex}-{ey})")))
    if y > 0 and x % y == 0 and y > 1:
        out.append((f"{x}/{y}={x // y}", (x // y, f"{ex}/({ey})")))
    return out


def search_trace(problem: Problem) -> tuple[list[str], str | None]:
    """(the depth-first search's lines, the expression it found or None)."""
    lines: list[str] = []

    def dfs(items: list[_Item]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == problem.target else None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                rest = [it for k, it in enumerate(items) if k not in (i, j)]
                for text, item in _combine(items[i], items[j]):
                    left = [*rest, item]
                    lines.append(text + (" rest " + " ".join(str(v) for v, _ in left) if len(left) > 1 else ""))
                    found = dfs(left)
                    if found is not None:
                        return found
        return None

    return lines, dfs([(n, str(n)) for n in problem.numbers])


def format_trace_demonstration(problem: Problem) -> str:
    """The SFT completion: the search trace, one combination per line, then the answer."""
    lines, found = search_trace(problem)
    answer = found if found is not None else problem.solution
    return "".join(line + "\n" for line in lines) + f"<answer>{answer}</answer>"


def trace_tokens(problem: Problem) -> int:
    """Tokens of the demonstration (the countdown tokenizer: one per character, one per answer tag)."""
    text = format_trace_demonstration(problem)
    return len(text) - 2 * len("<answer>") + 1


def trace_problems(n: int, seed: int = 0, split: str = "train", **distribution) -> list[Problem]:
    """The first `n` problems of generate_problems(seed, split, **distribution) whose demonstration
    is TRACE_TOKENS long (deterministic: generate_problems' draws are a prefix-stable sequence).
    Raises ValueError when the distribution holds too few."""
    lo, hi = TRACE_TOKENS
    draws = 16 * n + 200                # about 8% of 4-number draws qualify: one pass, as a rule
    while True:
        drawn = generate_problems(draws, seed, split=split, **distribution)
        kept = [p for p in drawn if lo <= trace_tokens(p) <= hi]
        if len(kept) >= n:
            return kept[:n]
        draws *= 2
