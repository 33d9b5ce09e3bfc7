"""Countdown: reach a target from a few numbers with + - * / (the TinyZero task).

A problem is 3-4 numbers and a target. An answer is an arithmetic expression that
uses every number exactly once, any of + - * / and parentheses, and equals the
target under exact rational arithmetic (so 7/2*2 = 7 is fine, nothing rounds).

Sizes are chosen so a tiny model (context ~256 tokens) can learn the task:
numbers are drawn from 1..25 and targets from 1..100 by default.

Text format (kept short because the tokenizer is character-level):

    prompt         "nums 3 5 2 target 16\\n"
    demonstration  "<answer>(3+5)*2</answer>"

Reward follows TinyZero: the last <answer>...</answer> in the completion is the
answer; 1.0 if it is a valid expression over exactly the given numbers that equals
the target, FORMAT_SCORE (0.1) if an answer tag pair is present but the answer is
wrong in any way (wrong value, numbers reused or missing, division by zero,
unparsable, longer than MAX_EXPR_CHARS), and 0.0 if there is no answer tag pair.
Answers are parsed by a small recursive-descent parser, never eval().
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import gcd

__all__ = [
    "DEMO_PROBLEMS",
    "FORMAT_SCORE",
    "MAX_EXPR_CHARS",
    "TEST_PERCENT",
    "Problem",
    "extract_answer",
    "format_demonstration",
    "format_prompt",
    "generate_problems",
    "parse_expression",
    "reward",
    "solve",
    "split_of",
]

FORMAT_SCORE = 0.1  # TinyZero's score for a present-but-wrong answer
# A real answer is ~20 chars; the cap bounds parse time, recursion depth and value size.
MAX_EXPR_CHARS = 128
TEST_PERCENT = 10  # share of the problem space (by hash bucket) held out as the test split
# The distribution `zerokl demo`, `zerokl experiment countdown` and the shipped SFT checkpoint
# use: three numbers keep answers short enough for a 2M-parameter model to learn on a CPU.
DEMO_PROBLEMS = {"num_range": (1, 25), "target_range": (1, 100), "n_numbers": (3, 3)}


@dataclass(frozen=True)
class Problem:
    """One countdown problem: `numbers` in presentation order, `target`, and one
    `solution` expression found by the exhaustive solver."""

    numbers: tuple[int, ...]
    target: int
    solution: str


# ---------------------------------------------------------------------------
# Solver

_ATOM, _MUL, _ADD = 3, 2, 1  # precedence levels, used to print minimal parentheses
_OPS = (("+", _ADD), ("-", _ADD), ("*", _MUL), ("/", _MUL))

# The solver's values are exact rationals as reduced (numerator, denominator > 0) int pairs, and each
# value keeps the length of its shortest expression and how it was made, its text built only for the
# value asked for: Fraction's arithmetic and hashing and a string per candidate made generating a
# job's 20,000 problems take ~30 s. Same values, same candidates in the same order, same shortest
# expression (the first found among equal lengths), so the same problems as before.
_Value = tuple[int, int]
# length, precedence, then how it was made: (op, left mask, left value, right mask, right value), or None
_Entry = tuple[int, int, "tuple[str, int, _Value, int, _Value] | None"]


def _join(op: str, prec: int, left: tuple[str, int], right: tuple[str, int]) -> str:
    # Parenthesize a side only when precedence demands it; the right side of - and /
    # also needs them at equal precedence because those ops are not associative.
    ltext, lprec = left
    rtext, rprec = right
    if lprec < prec:
        ltext = f"({ltext})"
    if rprec < prec or (rprec == prec and op in "-/"):
        rtext = f"({rtext})"
    return f"{ltext}{op}{rtext}"


def _solve_all(numbers: Sequence[int]) -> list[dict[_Value, _Entry]]:
    """For every subset of `numbers` (as a bitmask), every value an expression using
    all of that subset exactly once can take, with its shortest expression's length.

    Dynamic programming over subsets: a subset's values are every op applied to a
    value of one part and a value of the complementary part. A submask is always
    smaller than its mask, so ascending order fills parts first.
    """
    k = len(numbers)
    table: list[dict[_Value, _Entry]] = [{} for _ in range(1 << k)]
    for i, x in enumerate(numbers):
        table[1 << i] = {(x, 1): (len(str(x)), _ATOM, None)}
    for mask in range(1, 1 << k):
        if mask & (mask - 1) == 0:  # single number, seeded above
            continue
        best = table[mask]
        sub = (mask - 1) & mask
        while sub:
            other = mask ^ sub
            for op, prec in _OPS:
                if op in "+*" and sub > other:  # commutative: each unordered split once
                    continue
                right_paren_at = prec + 1 if op in "-/" else prec   # right side parenthesized below this
                for a, (la, pa, _) in table[sub].items():
                    la += 2 if pa < prec else 0
                    an, ad = a
                    for b, (lb, pb, _) in table[other].items():
                        bn, bd = b                 # a op b, exact, inlined (a call per pair: +15% time)
                        if op == "+":
                            n, d = an * bd + bn * ad, ad * bd
                        elif op == "-":
                            n, d = an * bd - bn * ad, ad * bd
                        elif op == "*":
                            n, d = an * bn, ad * bd
                        elif bn == 0:
                            continue
                        else:
                            n, d = (an * bd, ad * bn) if bn > 0 else (-an * bd, -ad * bn)
                        g = gcd(n, d)
                        value = (n // g, d // g)
                        length = la + 1 + lb + (2 if pb < right_paren_at else 0)
                        held = best.get(value)
                        if held is None or length < held[0]:
                            best[value] = (length, prec, (op, sub, a, other, b))
            sub = (sub - 1) & mask
    return table


def _text(table: list[dict[_Value, _Entry]], mask: int, value: _Value) -> str:
    """The shortest expression of `value` over the subset `mask`."""
    _, _, made = table[mask][value]
    if made is None:
        return str(value[0])
    op, sub, a, other, b = made
    return _join(op, table[mask][value][1], (_text(table, sub, a), table[sub][a][1]),
                 (_text(table, other, b), table[other][b][1]))


def solve(numbers: Sequence[int], target: int) -> str | None:
    """Return an expression using each of `numbers` exactly once that equals
    `target` (the shortest one found), or None if there is none."""
    if not numbers:
        return None
    table = _solve_all(numbers)
    return _text(table, len(table) - 1, (target, 1)) if (target, 1) in table[-1] else None


# ---------------------------------------------------------------------------
# Problem generation


def split_of(numbers: Sequence[int], target: int) -> str:
    """The split ("train" or "test") a problem belongs to.

    A stable hash of the sorted numbers and the target, so the same multiset and
    target always land in the same split whatever the order or seed: train and
    test can never share a problem.
    """
    key = f"{sorted(numbers)}:{target}".encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 100
    return "test" if bucket < TEST_PERCENT else "train"


def generate_problems(
    n: int,
    seed: int = 0,
    *,
    num_range: tuple[int, int] = (1, 25),
    target_range: tuple[int, int] = (1, 100),
    n_numbers: tuple[int, int] = (3, 4),
    split: str = "train",
) -> list[Problem]:
    """Draw `n` distinct solvable problems of one split, deterministically from `seed`.

    Each problem draws a count in `n_numbers` (inclusive) and that many numbers in
    `num_range` (inclusive, repeats allowed), then a target uniformly among the
    integers in `target_range` that the numbers can reach and that put the problem
    in `split` (see split_of). Numbers with no such target, and repeats of an
    earlier problem, are redrawn.
    Raises ValueError if `n` distinct problems cannot be found in a bounded number
    of draws (the ranges are too small for `n`).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"countdown:{seed}")  # str seeds are hashed stably across runs
    lo, hi = target_range
    problems: list[Problem] = []
    seen: set[tuple[tuple[int, ...], int]] = set()
    for _ in range(100 * n + 1000):
        if len(problems) == n:
            break
        numbers = tuple(rng.randint(*num_range) for _ in range(rng.randint(*n_numbers)))
        table = _solve_all(numbers)
        targets = sorted(n for n, d in table[-1] if d == 1 and lo <= n <= hi and split_of(numbers, n) == split)
        if not targets:
            continue
        target = rng.choice(targets)
        key = (tuple(sorted(numbers)), target)
        if key in seen:
            continue
        seen.add(key)
        problems.append(Problem(numbers, target, _text(table, len(table) - 1, (target, 1))))
    if len(problems) < n:
        raise ValueError(f"found only {len(problems)} of {n} distinct {split} problems")
    return problems


# ---------------------------------------------------------------------------
# Text format


def format_prompt(problem: Problem) -> str:
    """The prompt shown to the model, e.g. "nums 3 5 2 target 16\\n"."""
    return f"nums {' '.join(map(str, problem.numbers))} target {problem.target}\n"


def format_demonstration(problem: Problem) -> str:
    """The SFT completion for `problem`, e.g. "<answer>(3+5)*2</answer>"."""
    return f"<answer>{problem.solution}</answer>"


# ---------------------------------------------------------------------------
# Answer parsing and reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOKEN = re.compile(r"[0-9]+|\S")  # integer literals, else single non-space chars


class _ParseError(Exception):
    pass


class _Parser:
    """Recursive descent over the grammar

        expr   := term (("+" | "-") term)*
        term   := factor (("*" | "/") factor)*
        factor := INTEGER | "(" expr ")"

    evaluating as it goes with Fractions and recording the integer literals.
    No unary minus: countdown numbers are used as given.
    """

    def __init__(self, text: str):
        self.tokens = _TOKEN.findall(text)
        self.pos = 0
        self.literals: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _ParseError("unexpected end")
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor()
            if op == "/" and rhs == 0:
                raise _ParseError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise _ParseError("expected )")
            return value
        if not (token.isascii() and token.isdigit()):  # "²".isdigit() is True
            raise _ParseError(f"unexpected {token!r}")
        self.literals.append(int(token))
        return Fraction(int(token))


def parse_expression(text: str) -> tuple[Fraction, tuple[int, ...]] | None:
    """Evaluate an arithmetic expression exactly.

    Returns (value, integer literals in order of appearance), or None if `text` is
    longer than MAX_EXPR_CHARS, is not a complete expression of non-negative
    integers, + - * / and parentheses, or divides by zero. Never raises.
    """
    if len(text) > MAX_EXPR_CHARS:
        return None
    parser = _Parser(text)
    try:
        value = parser.expr()
    except _ParseError:
        return None
    if parser.peek() is not None:  # trailing tokens, e.g. "3+5)" or "3 5"
        return None
    return value, tuple(parser.literals)


def extract_answer(completion: str) -> str | None:
    """The stripped contents of the last <answer>...</answer> pair, or None."""
    answers = _ANSWER.findall(completion)
    return answers[-1].strip() if answers else None


def reward(completion: str, problem: Problem) -> float:
    """TinyZero countdown reward: 1.0 correct, FORMAT_SCORE for an answer tag pair
    holding a wrong answer, 0.0 without an answer tag pair. Never raises."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    parsed = parse_expression(answer)
    if parsed is None:
        return FORMAT_SCORE
    value, literals = parsed
    if sorted(literals) != sorted(problem.numbers) or value != problem.target:
        return FORMAT_SCORE
    return 1.0
