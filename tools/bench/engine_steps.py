"""One timed engine step, as the engine benchmarks (bench_e2e, bench_serve, bench_rollout) step an
Engine by hand to time decode apart from prefill."""
from __future__ import annotations

import time
from typing import Callable


def timed_step(eng, outs: dict[str, tuple[list[int], list[float]]],  # noqa: ANN001 - an Engine
               sync: Callable[[], None] = lambda: None) -> tuple[float, int]:
    """Run one ``eng.step()``: its seconds (``sync`` included: the device's work, or nothing for host
    times) and the tokens it produced, each delta's tokens and logprobs appended to ``outs[request_id]``."""
    t0 = time.perf_counter()
    deltas = eng.step()
    sync()
    dt = time.perf_counter() - t0
    n = 0
    for d in deltas:
        outs[d.request_id][0].extend(d.token_ids)
        outs[d.request_id][1].extend(d.logprobs)
        n += len(d.token_ids)
    return dt, n
