"""Countdown task: solver, generator, splits, parser and TinyZero reward."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokl.tasks.countdown import (
    FORMAT_SCORE,
    MAX_EXPR_CHARS,
    Problem,
    extract_answer,
    format_demonstration,
    format_prompt,
    generate_problems,
    parse_expression,
    reward,
    solve,
    split_of,
)

PROBLEM = Problem(numbers=(3, 5, 2), target=16, solution="(3+5)*2")


def _check_solution(expr: str, numbers, target: int) -> None:
    value, literals = parse_expression(expr)
    assert value == target
    assert sorted(literals) == sorted(numbers)


@pytest.mark.parametrize(
    "numbers, target",
    [
        ((3, 5, 2), 16),
        ((1, 2, 3, 4), 24),
        ((4, 4, 10, 10), 24),  # needs (10*10-4)/4
        ((1, 5, 5, 5), 24),  # needs a fraction: (5-1/5)*5
        ((3, 3, 8, 8), 24),  # needs 8/(3-8/3)
        ((7, 7), 1),
        ((9,), 9),
    ],
)
def test_solve_known(numbers, target):
    _check_solution(solve(numbers, target), numbers, target)


@pytest.mark.parametrize("numbers, target", [((1, 1, 1), 100), ((2, 2), 7), ((9,), 8), ((), 0)])
def test_solve_unsolvable(numbers, target):
    assert solve(numbers, target) is None


def test_generated_problems_are_solved():
    for split in ("train", "test"):
        problems = generate_problems(150, seed=1, split=split)
        assert len(problems) == len({(tuple(sorted(p.numbers)), p.target) for p in problems})
        for p in problems:
            assert 3 <= len(p.numbers) <= 4
            assert all(1 <= x <= 25 for x in p.numbers)
            assert 1 <= p.target <= 100
            assert split_of(p.numbers, p.target) == split
            _check_solution(p.solution, p.numbers, p.target)
            assert reward(format_demonstration(p), p) == 1.0


def test_generate_deterministic_by_seed():
    assert generate_problems(40, seed=7) == generate_problems(40, seed=7)
    assert generate_problems(40, seed=7) != generate_problems(40, seed=8)


def test_splits_disjoint():
    def keys(split: str) -> set:
        return {(tuple(sorted(p.numbers)), p.target) for p in generate_problems(300, seed=0, split=split)}

    train, test = keys("train"), keys("test")
    assert train and test and not train & test


def test_split_ignores_number_order():
    assert split_of((3, 5, 2), 16) == split_of((2, 3, 5), 16)


def test_generate_options():
    problems = generate_problems(
        20, seed=3, num_range=(1, 9), target_range=(10, 20), n_numbers=(3, 3)
    )
    for p in problems:
        assert len(p.numbers) == 3 and max(p.numbers) <= 9 and 10 <= p.target <= 20
    with pytest.raises(ValueError):
        generate_problems(1, split="val")
    with pytest.raises(ValueError):  # only 1 multiset exists, so not 5 distinct problems
        generate_problems(5, num_range=(1, 1), n_numbers=(3, 3))


def test_text_format():
    assert format_prompt(PROBLEM) == "nums 3 5 2 target 16\n"
    assert format_demonstration(PROBLEM) == "<answer>(3+5)*2</answer>"


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>(3+5)*2</answer>", 1.0),
        ("<answer>2*(5+3)</answer>", 1.0),
        ("<answer> ( 3 + 5 ) * 2 </answer>", 1.0),  # whitespace anywhere
        ("<answer>\n(3+5)*2\n</answer>", 1.0),
        ("think first <answer>(3+5)*2</answer> done", 1.0),
        ("<answer>3+5+2</answer>", FORMAT_SCORE),  # wrong value
        ("<answer>(3+5)*2*1</answer>", FORMAT_SCORE),  # extra number
        ("<answer>(3+5)*2+2-2</answer>", FORMAT_SCORE),  # reused number
        ("<answer>(5+5)+6</answer>", FORMAT_SCORE),  # numbers not the given ones
        ("<answer>8*2</answer>", FORMAT_SCORE),  # missing numbers
        ("<answer>3/(5-5)*2</answer>", FORMAT_SCORE),  # division by zero
        ("<answer>(3+5*2</answer>", FORMAT_SCORE),  # unbalanced
        ("<answer>(3+5)*2 = 16</answer>", FORMAT_SCORE),  # '=' is not part of an answer
        ("<answer>-3+5</answer>", FORMAT_SCORE),  # no unary minus
        ("<answer></answer>", FORMAT_SCORE),
        ("<answer>(3+5)*2</answer><answer>3+5+2</answer>", FORMAT_SCORE),  # last tag counts
        ("<answer>3+5+2</answer><answer>(3+5)*2</answer>", 1.0),
        ("(3+5)*2", 0.0),  # no tag
        ("<answer>(3+5)*2", 0.0),  # unclosed tag
        ("answer>(3+5)*2</answer>", 0.0),
        ("", 0.0),
    ],
)
def test_reward(completion, expected):
    assert reward(completion, PROBLEM) == expected


def test_reward_fraction_intermediate():
    problem = Problem(numbers=(1, 5, 5, 5), target=24, solution="(5-1/5)*5")
    assert reward("<answer>5*(5-1/5)</answer>", problem) == 1.0


def test_parse_expression():
    assert parse_expression("7/2*2") == (Fraction(7), (7, 2, 2))
    assert parse_expression("10-4-3") == (Fraction(3), (10, 4, 3))  # left-associative
    assert parse_expression("2*3+4*5") == (Fraction(26), (2, 3, 4, 5))
    assert parse_expression("1/3") == (Fraction(1, 3), (1, 3))
    for bad in ["", "3 5", "3+", "(3", "3)", "3**2", "3.5", "1/0", "1/(2-2)", "²+1", "abc"]:
        assert parse_expression(bad) is None, bad


def test_parse_bounds():
    assert parse_expression("(" * 5000 + "1" + ")" * 5000) is None  # no RecursionError
    assert parse_expression("9" * 10_000) is None  # no int-digits limit error
    long_ok = "+".join(["1"] * (MAX_EXPR_CHARS // 2))
    assert parse_expression(long_ok) == (Fraction(MAX_EXPR_CHARS // 2), (1,) * (MAX_EXPR_CHARS // 2))


_ALPHABET = st.sampled_from(list("0123456789+-*/() <>answer/=.x\n") + ["<answer>", "</answer>"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.lists(_ALPHABET, max_size=80).map("".join)))
def test_parser_and_reward_never_raise(text):
    parsed = parse_expression(text)
    assert parsed is None or isinstance(parsed[0], Fraction)
    assert reward(text, PROBLEM) in (0.0, FORMAT_SCORE, 1.0)
    assert reward(f"<answer>{text}</answer>", PROBLEM) in (FORMAT_SCORE, 1.0) or "</answer>" in text
    answer = extract_answer(text)
    assert answer is None or answer == answer.strip()
