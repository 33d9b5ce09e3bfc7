"""Fewer, larger messages carry the same bits (issue 32): coalesced deltas and the replica's stream interval."""
from __future__ import annotations

import asyncio

from conftest import make_replica, offline
from zerokl.services.inference.replica import ServingLimits
from zerokl.services.inference.types import GenerateDelta, InferenceRequest, Usage, coalesce, fold_samples
from zerokl.vocab import SamplingOptions


def _d(index: int, tokens: tuple[int, ...], finish=None, plp=None, version="1") -> GenerateDelta:  # noqa: ANN001
    return GenerateDelta("r", index, tokens, tuple(-float(t) for t in tokens), text="".join(map(str, tokens)),
                         finish_reason=finish, prompt_logprobs=plp, usage=Usage(3, tokens[-1] if tokens else 0, 0),
                         weights_version=version, numerics_fingerprint="f")


def test_coalesce_merges_each_samples_deltas_in_order_and_keeps_what_must_stay_apart() -> None:
    deltas = [_d(0, (1,), plp=(-0.5,)), _d(1, (1,)), _d(0, (2,)), _d(1, (2,), finish="length"), _d(0, (3,)),
              _d(1, (4,), version="2")]
    merged = coalesce(deltas)
    assert [(d.index, d.token_ids, d.finish_reason) for d in merged] == [
        (0, (1, 2, 3), None), (1, (1, 2), "length"), (1, (4,), None)]   # nothing joins a finished delta
    assert merged[0].prompt_logprobs == (-0.5,) and merged[0].logprobs == (-1.0, -2.0, -3.0)
    assert merged[0].text == "123" and merged[0].usage == Usage(3, 3, 0)   # the last part's running total
    # Folding the merged stream gives what folding the original gives.
    assert fold_samples(merged) == fold_samples(deltas)
    assert coalesce([_d(0, (1,)), _d(0, (2,), plp=(-0.5,))]) == [_d(0, (1,)), _d(0, (2,), plp=(-0.5,))]


def test_a_stream_interval_sends_fewer_messages_with_the_solo_bits(model) -> None:  # noqa: ANN001
    ids = (5, 9, 4, 7, 11)
    options = SamplingOptions(temperature=1.0, seed=3, max_tokens=13, ignore_eos=True, n=2, prompt_logprobs=True)

    async def run(interval: int) -> list[GenerateDelta]:
        replica = make_replica(model, "decode", limits=ServingLimits(stream_interval=interval))
        replica.engine.start()
        try:
            return [d async for d in replica.generate(InferenceRequest(prompt_ids=ids, options=options))]
        finally:
            await replica.engine.close()

    every, spaced = asyncio.run(run(1)), asyncio.run(run(4))
    want = offline(model, ids, options)
    for deltas in (every, spaced):
        got = fold_samples(deltas)
        assert [(got[i].token_ids, got[i].logprobs, got[i].finish_reason) for i in range(2)] == \
               [(w.token_ids, w.logprobs, w.finish_reason) for w in want]
        assert got[0].prompt_logprobs == want[0].prompt_logprobs
    # The first token goes at once, then a message per 4 steps or more (the last may be shorter).
    sizes = [len(d.token_ids) for d in spaced if d.index == 0]
    assert sizes[0] == 1 and all(size >= 4 for size in sizes[1:-1]) and sum(sizes) == 13
    assert len(spaced) < len(every)
