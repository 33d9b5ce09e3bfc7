"""Countdown with a search trace (zerokl.tasks.countdown_trace): long demonstrations that earn the reward."""
from zerokl.tasks.countdown import Problem, reward
from zerokl.tasks.countdown_trace import (MAX_TOKENS, TRACE_TOKENS, format_trace_demonstration, search_trace,
                                          trace_problems, trace_tokens)
from zerokl.tasks.setup import DIFFICULTIES, countdown_data, demonstration_batch
from zerokl.tokenizer import CountdownTokenizer


def test_a_trace_is_the_depth_first_search_then_the_answer():
    p = Problem((8, 16, 14), 28, "16*14/8")
    lines, found = search_trace(p)
    assert lines[:2] == ["16+8=24 rest 14 24", "24+14=38"]
    assert lines[-1] == "14*2=28" and found == "14*16/(8)"
    text = format_trace_demonstration(p)
    assert text.endswith("<answer>14*16/(8)</answer>") and reward(text, p) == 1.0
    assert trace_tokens(p) == len(CountdownTokenizer().encode(text))


def test_trace_problems_have_512_plus_token_answers_that_earn_the_reward():
    train, test, tok = countdown_data(0, 12, 4, difficulty="hard", answers="trace")
    assert trace_problems(12, 0, **DIFFICULTIES["hard"]) == train and len(test) == 4
    lo, hi = TRACE_TOKENS
    assert 512 <= lo and hi < MAX_TOKENS
    for p, c in zip(train, demonstration_batch(train, tok, "trace"), strict=True):
        assert lo <= len(c.completion_ids) - 1 <= hi                      # the demonstration, then eos
        assert c.completion_ids[-1] == tok.eos_id and reward(tok.decode(c.completion_ids), p) == 1.0
    # Prefix-stable: fewer problems are the first of more.
    assert trace_problems(5, 0, **DIFFICULTIES["hard"]) == train[:5]
