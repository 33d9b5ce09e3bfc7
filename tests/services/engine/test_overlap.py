"""Overlapped decode (step N+1 launched before step N is read back, N's tokens handed over on
the device) gives exactly the bits of a decode that waits for every step, and of the general
path: under neighbours that finish at different steps (length, stop ids, eos, stop strings),
n > 1 forks, preemption, chunked prefill, prefix-cache hits, arrivals mid-run, aborts
mid-stream, failures and weight swaps between requests.

The overlap runs on CPU too (EngineConfig(overlap_decode=True): the runner's decode path,
eagerly; the token handoff is torch ops), so this is the path CI checks; the GPU tier checks
it with CUDA graphs (test_engine_gpu.py).
"""
import random

import pytest

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine
from zerokl.services.engine.runner import ModelRunner
from zerokl.services.engine.scheduler import SampleState
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.tokenizer import CountdownTokenizer
from zerokl.vocab import SamplingOptions

CONFIG = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return Model(CONFIG, seed=0)


def _engine(model, mode: str, tokenizer=None, **cfg) -> Engine:
    """general: the CPU default (every step on the general path); decode: the runner's decode
    path, each step waited for; overlap: the decode path, overlapped."""
    eng = Engine(model, EngineConfig(**cfg, overlap_decode=mode == "overlap"), tokenizer=tokenizer)
    if mode == "decode":
        eng.runner = eng.scheduler.kv = ModelRunner(model, eng.config, eng.device, eng.max_model_len,
                                                    device_decode=True)
    return eng


def _watch(eng: Engine) -> dict:
    """Count what the overlap did: launches, rows whose input came from the device (src >= 0),
    and tokens drawn for samples that had finished by the time their step was read back."""
    seen = {"launches": 0, "handed_on_device": 0, "dropped": 0}
    launch, read_back = eng.runner.launch, eng._read_back

    def counting_launch(batch):
        seen["launches"] += 1
        seen["handed_on_device"] += sum(i >= 0 for i in batch.src or ())
        return launch(batch)

    def counting_read_back(inflight):
        if inflight is not None:
            seen["dropped"] += sum(s.state is SampleState.FINISHED for s in inflight.seqs)
        return read_back(inflight)

    eng.runner.launch, eng._read_back = counting_launch, counting_read_back
    return seen


def _drive(eng: Engine, arrivals: dict, aborts: dict | None = None) -> dict:
    """Step until idle, adding arrivals[step] before each step; aborts[rid] = k aborts rid once it
    has emitted k tokens (0: before its first). Returns rid -> index -> (tokens, logprobs, reason, text)."""
    aborts = dict(aborts or {})
    res: dict = {}
    step = 0

    def take(d):
        toks, lps, reason, text = res.setdefault(d.request_id, {}).get(d.index, ([], [], None, ""))
        res[d.request_id][d.index] = (toks + d.token_ids, lps + d.logprobs, d.finish_reason or reason, text + d.text)

    while step <= max(arrivals) or eng.has_work():
        for r in arrivals.get(step, []):
            eng.add_request(r)
            res[r.request_id] = {}
        for d in eng.step():
            take(d)
        for rid, k in list(aborts.items()):
            emitted = sum(len(v[0]) for v in res.get(rid, {}).values())
            if rid in res and emitted >= k:
                for d in eng.abort(rid):
                    take(d)
                del aborts[rid]
        step += 1
        assert step < 2000
    return res


def _requests(rng: random.Random, n: int) -> dict:
    """Requests arriving at random steps: lengths, stops, eos, n and sampling all mixed, some
    prompts repeated (prefix-cache hits)."""
    prompts = [tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(3, 45))) for _ in range(n)]
    arrivals: dict = {}
    for i in range(n):
        prompt = prompts[i] if rng.random() < 0.7 else prompts[rng.randrange(i + 1)]
        opts = SamplingOptions(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 5]),
                               top_p=rng.choice([1.0, 0.85]), seed=rng.randrange(1000), n=rng.choice([1, 1, 2, 3]),
                               max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5,
                               stop_token_ids=rng.choice([(), (), (7,), (9, 11, 13)]))
        arrivals.setdefault(rng.choice([0, 0, 1, 3, 6, 10]), []).append(GenerateRequest(f"r{i}", prompt, opts))
    return arrivals


def test_overlap_gives_the_bits_of_waiting_for_every_step(model):
    """Neighbours finish at different steps (length, stop ids, eos), n > 1 forks, preemption
    (a cache too small for all), chunked prefill, prefix-cache hits and requests arriving
    mid-run: overlap on == the general path, every token and logprob (the decode path waited
    for equals the general path: test_runner.py); the dropped over-computed tokens leave no
    block behind."""
    arrivals = _requests(random.Random(2), 12)
    cfg = dict(max_num_batched_tokens=40, max_num_seqs=8, block_size=4, num_blocks=48)
    results, engines = {}, {}
    for mode in ("general", "overlap"):
        eng = engines[mode] = _engine(model, mode, **cfg)
        seen = _watch(eng) if mode == "overlap" else None
        results[mode] = _drive(eng, arrivals)
        assert eng.kv_usage() == 0 and not eng.has_work()
    assert results["overlap"] == results["general"]
    assert seen["handed_on_device"] > 20 and seen["dropped"] > 0
    assert engines["overlap"].stats["preemptions"] > 0 and engines["overlap"].stats["cached_tokens"] > 0
    reasons = {v[2] for r in results["overlap"].values() for v in r.values()}
    assert reasons == {"stop", "length"}


def test_overlap_keeps_stop_strings_exact(model):
    """Stop strings end samples at different steps (their text cut at the stop): the same
    tokens, logprobs and text with and without overlap."""
    tok = CountdownTokenizer()
    prompt = tuple(range(3, 20))
    free = _drive(_engine(model, "general", tok), {0: [GenerateRequest("probe", prompt, SamplingOptions(
        temperature=1.0, seed=5, n=3, max_tokens=16, ignore_eos=True))]})["probe"]
    texts = [v[3] for v in free.values()]
    stops = sorted({t[j:j + 2] for t in texts for j in (2, 6) if len(t) >= j + 2})[:3]
    assert stops
    reqs = {0: [GenerateRequest(f"s{i}", prompt, SamplingOptions(temperature=1.0, seed=5, n=3, max_tokens=16,
                                                                 ignore_eos=True, stop=(stop,)))
                for i, stop in enumerate(stops)]}
    got = {mode: _drive(_engine(model, mode, tok), reqs) for mode in ("general", "overlap")}
    assert got["overlap"] == got["general"]
    assert any(v[2] == "stop" and len(v[0]) < 16 for r in got["overlap"].values() for v in r.values())


def test_overlap_aborts_mid_stream_exactly(model):
    """Requests aborted before their first token, after it, and mid-stream (while their next
    token is in flight): each stream is the same prefix in both modes, the neighbours' bits do
    not move, and every block comes back."""
    rng = random.Random(11)
    arrivals = {0: [GenerateRequest(f"a{i}", tuple(rng.randrange(3, 64) for _ in range(rng.randint(5, 30))),
                                    SamplingOptions(temperature=1.0, seed=i, n=1 + i % 2, max_tokens=20,
                                                    ignore_eos=True)) for i in range(6)]}
    aborts = {"a0": 0, "a1": 1, "a2": 5, "a3": 9}
    got = {}
    for mode in ("decode", "overlap"):
        eng = _engine(model, mode, max_num_batched_tokens=64, block_size=4, num_blocks=128)
        got[mode] = _drive(eng, arrivals, aborts)
        assert eng.kv_usage() == 0 and not eng.has_work()
    assert got["overlap"] == got["decode"]
    assert {rid for rid, r in got["overlap"].items() if any(v[2] == "abort" for v in r.values())} == set(aborts)
    assert all(len(v[0]) == 20 for rid in ("a4", "a5") for v in got["overlap"][rid].values())


def test_overlap_fails_a_row_alone_and_swaps_weights_between_requests(model, monkeypatch):
    """A row without a distribution (NaN logits) fails its request alone while the step after
    it is already launched; a step that fails to launch runs on the general path; weights load
    only once nothing is in flight, and the next requests run on the new weights."""
    reqs = [GenerateRequest(f"r{i}", (3 + i, 9, 11), SamplingOptions(seed=i, max_tokens=6, ignore_eos=True))
            for i in range(3)]
    alone = {r.request_id: _drive(_engine(model, "general", block_size=4, num_blocks=64), {0: [r]})[r.request_id]
             for r in reqs}
    eng = _engine(model, "overlap", block_size=4, num_blocks=64)
    forward, launch = eng.model.forward_tokens, eng.runner.launch
    launches = []

    def poisoned(tokens, batch, cache, rows=None):
        logits = forward(tokens, batch, cache, rows)
        if rows is None and tokens.numel() > 1 and int(batch.positions[1]) == 5:
            logits[1] = float("nan")            # r1's row at its 3rd decode step
        return logits

    def flaky_launch(batch):
        launches.append(len(batch.seqs))
        if len(launches) == 2:
            raise RuntimeError("a launch that fails (not the device)")
        return launch(batch)

    monkeypatch.setattr(eng.model, "forward_tokens", poisoned)
    eng.runner.launch = flaky_launch
    got = _drive(eng, {0: reqs})
    assert got["r1"][0][2] == "error"
    assert got["r0"] == alone["r0"] and got["r2"] == alone["r2"]
    assert len(launches) > 3 and eng.kv_usage() == 0
    monkeypatch.undo()

    eng = _engine(model, "overlap", block_size=4, num_blocks=64)
    eng.add_request(reqs[0])
    eng.step()                                  # the prefill
    eng.step()                                  # a decode step, launched and not read back
    with pytest.raises(RuntimeError, match="requests in the engine"):
        eng.load_weights(model.state_dict())
    _drive(eng, {0: []})
    other = Model(CONFIG, seed=1)
    eng.load_weights(other.state_dict(), weights_version="v2")
    assert _drive(eng, {0: reqs}) == _drive(_engine(other, "general", block_size=4, num_blocks=64), {0: reqs})


def test_warm_up_runs_every_decode_shape_and_leaves_no_trace(model):
    """EngineConfig(warm_up=True) runs each decode (bucket, key width, filters) and the general
    path's token counts once before the first request (writing only KV blocks nobody holds):
    afterwards the engine is empty and serves the same bits as one that never warmed up."""
    cfg = dict(max_num_seqs=2, max_model_len=40, max_num_batched_tokens=16, block_size=4, num_blocks=64)
    warm = _engine(model, "overlap", warm_up=True, **cfg)
    runner = warm.runner
    assert warm.warm_up_stats["decode_shapes"] == len(runner.buckets) * len(runner.widths()) * 3
    assert warm.warm_up_stats["forward_shapes"] >= 5 and warm.kv_usage() == 0 and not warm.has_work()
    arrivals = {0: [GenerateRequest("a", (5, 9, 11, 3, 17), SamplingOptions(seed=1, max_tokens=12, ignore_eos=True)),
                    GenerateRequest("b", tuple(range(3, 30)), SamplingOptions(temperature=0.0, max_tokens=6))],
                3: [GenerateRequest("c", (7, 8), SamplingOptions(top_p=0.9, seed=2, max_tokens=5, ignore_eos=True))]}
    assert _drive(warm, arrivals) == _drive(_engine(model, "overlap", **cfg), arrivals)
