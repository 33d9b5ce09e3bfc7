"""The engine's outputs depend only on the request: exact equality under every perturbation
a busy server applies (neighbours, arrival step, chunk budget, block size, prefix-cache hits,
preemption, replicas, KV handoff), and the trainer's forward reproduces its logprobs (KL == 0)."""
import random

import pytest
import torch

from zerokl.kernels.sampling import SamplingParams, sampling_logprobs
from zerokl.kernels.model import Model, ModelConfig
from zerokl.tokenizer import CountdownTokenizer
from zerokl.services.engine.engine import Engine, RequestError, run_to_completion, sample_seed
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

CONFIG = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return Model(CONFIG, seed=0)


def _prompt(rng, lo=3, hi=80):
    return tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(lo, hi)))


def _req(rid, prompt, **opts):
    opts.setdefault("max_tokens", 12)
    opts.setdefault("ignore_eos", True)
    return GenerateRequest(rid, prompt, SamplingOptions(**opts))


def _collect(outs):
    """request_id -> sample index -> (tokens, logprobs, finish_reason)."""
    res = {}
    for rid, deltas in outs.items():
        per = res.setdefault(rid, {})
        for d in deltas:
            toks, lps, _ = per.get(d.index, ([], [], None))
            per[d.index] = (toks + d.token_ids, lps + d.logprobs, d.finish_reason or None)
    return res


def _run_arrivals(eng, arrivals):
    """Step `eng` until idle, adding arrivals[step] (a list of requests) before each step; _collect's result."""
    outs, step = {}, 0
    while step <= max(arrivals) or eng.has_work():
        for r in arrivals.get(step, []):
            eng.add_request(r)
            outs[r.request_id] = []
        for d in eng.step():
            outs[d.request_id].append(d)
        step += 1
    return _collect(outs)


def _run_alone(model, req, **cfg):
    return _collect(run_to_completion(Engine(model, EngineConfig(**cfg)), [req]))[req.request_id]


def _busy_run(model, target, rng, cfg, n_neighbours=6):
    """Run `target` while neighbours arrive at random steps; return the target's result."""
    eng = Engine(model, cfg)
    arrivals = {rng.randint(0, 6): [] for _ in range(3)}
    for i in range(n_neighbours):
        r = _req(f"n{i}", _prompt(rng), temperature=rng.choice([0.0, 0.8, 1.0]), top_p=rng.choice([1.0, 0.9]),
                 top_k=rng.choice([0, 5]), seed=rng.randrange(1000), max_tokens=rng.randint(1, 20))
        arrivals.setdefault(rng.randint(0, 8), []).append(r)
    arrivals.setdefault(rng.randint(0, 4), []).append(target)
    return _run_arrivals(eng, arrivals)[target.request_id], eng


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_independent_of_load_chunking_blocks_and_preemption(model, seed):
    rng = random.Random(seed)
    target = _req("target", _prompt(rng, 20, 90), temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    want = _run_alone(model, target)
    configs = [
        EngineConfig(max_num_batched_tokens=7, block_size=4, num_blocks=400),
        EngineConfig(max_num_batched_tokens=64, block_size=16, num_blocks=100),
        EngineConfig(max_num_batched_tokens=33, block_size=8, num_blocks=15),     # forces preemption
    ]
    preempted = 0
    for cfg in configs:
        got, eng = _busy_run(model, target, rng, cfg)
        assert got == want, f"output changed under {cfg}"
        preempted += eng.stats["preemptions"]
    assert preempted > 0, "the small cache should have forced at least one preemption"


def test_prefix_cache_hit_gives_the_same_output(model):
    rng = random.Random(5)
    prompt = _prompt(rng, 60, 60)
    eng = Engine(model, EngineConfig(block_size=8))
    first = _collect(run_to_completion(eng, [_req("a", prompt, temperature=0.7, seed=3)]))["a"]
    second = run_to_completion(eng, [_req("b", prompt, temperature=0.7, seed=3)])["b"]
    assert second[0].num_cached_tokens == 56
    assert _collect({"b": second})["b"] == first


def test_replicas_agree(model):
    rng = random.Random(6)
    req = _req("r", _prompt(rng), temperature=1.0, seed=77)
    other = Model(CONFIG, seed=0)      # a second process would load the same weights
    assert _run_alone(model, req) == _run_alone(other, req)


def test_trainer_forward_reproduces_engine_logprobs_exactly(model):
    """The point of zerokl: logprobs recomputed by the training forward equal the sampler's (KL == 0)."""
    rng = random.Random(7)
    reqs = [_req(f"q{i}", _prompt(rng, 5, 70), temperature=1.0, top_k=rng.choice([0, 8]),
                 top_p=rng.choice([1.0, 0.9]), seed=i, max_tokens=20, n=2) for i in range(4)]
    outs = _collect(run_to_completion(Engine(model, EngineConfig(max_num_batched_tokens=40)), reqs))
    kl_terms, compared = [], 0
    for r in reqs:
        for index, (toks, lps, _) in outs[r.request_id].items():
            seq = torch.tensor(list(r.prompt_ids) + toks)
            with torch.no_grad():
                logits = model(seq[None, :-1])[0, len(r.prompt_ids) - 1:]
            o = r.options
            positions = torch.arange(len(r.prompt_ids), len(seq))
            params = SamplingParams.make(len(toks), o.temperature, o.top_k, o.top_p, sample_seed(o.seed, index), positions)
            trainer = sampling_logprobs(logits, seq[len(r.prompt_ids):], params)
            engine = torch.tensor(lps)
            assert torch.equal(trainer, engine)
            kl_terms.append(engine - trainer)
            compared += len(toks)
    assert compared == 4 * 2 * 20 and float(torch.cat(kl_terms).abs().sum()) == 0.0


def test_n_samples_share_the_prompt_and_sample_zero_matches_n1(model):
    rng = random.Random(8)
    prompt = _prompt(rng, 30, 30)
    many = _run_alone(model, _req("m", prompt, temperature=1.0, seed=9, n=3))
    one = _run_alone(model, _req("o", prompt, temperature=1.0, seed=9))
    assert many[0] == one[0]
    assert len({tuple(v[0]) for v in many.values()}) == 3


def test_greedy_is_argmax_of_the_training_forward(model):
    prompt = tuple(range(3, 40))
    toks, lps, reason = _run_alone(model, _req("g", prompt, temperature=0.0, max_tokens=8))[0]
    seq = list(prompt)
    for t in toks:
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1]
        assert t == int(torch.argmax(logits))
        seq.append(t)
    assert reason == "length"


def test_stop_conditions(model):
    prompt = tuple(range(3, 20))
    toks, _, _ = _run_alone(model, _req("s", prompt, temperature=0.0, max_tokens=30))[0]
    stop_at = toks[4]
    toks2, _, reason = _run_alone(model, _req("s2", prompt, temperature=0.0, max_tokens=30,
                                              stop_token_ids=(stop_at,)))[0]
    assert toks2 == toks[: toks.index(stop_at) + 1] and reason == "stop"
    tok = CountdownTokenizer()
    eng = Engine(model, EngineConfig(), tokenizer=tok)
    text = tok.decode([t for t in toks if t < tok.vocab_size])
    if len(text) >= 3:
        stop = text[1:3]
        outs = run_to_completion(eng, [_req("t", prompt, temperature=0.0, max_tokens=30, stop=(stop,))])["t"]
        got = "".join(d.text for d in outs)
        assert outs[-1].finish_reason == "stop" and stop not in got and text.startswith(got)


def test_score_matches_training_forward(model):
    prompt = tuple(random.Random(9).randrange(3, 64) for _ in range(50))
    eng = Engine(model, EngineConfig(max_num_batched_tokens=13))
    out = run_to_completion(eng, [GenerateRequest("sc", prompt, SamplingOptions(), mode="score")])["sc"]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt]))[0, :-1].float(), -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = torch.tensor(out[-1].prompt_logprobs)
    assert len(got) == 49
    torch.testing.assert_close(got, want)   # accuracy vs plain torch log_softmax
    from zerokl.kernels import log_softmax
    with torch.no_grad():
        exact = log_softmax(model(torch.tensor([prompt]))[0, :-1]).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.equal(got, exact)


def test_prefill_handoff_to_another_engine_is_exact(model):
    rng = random.Random(10)
    prompt = _prompt(rng, 40, 70)
    req = _req("h", prompt, temperature=1.0, seed=5)
    prefill = Engine(model, EngineConfig(max_num_batched_tokens=16))
    out = run_to_completion(prefill, [GenerateRequest("h", prompt, req.options, mode="prefill")])["h"]
    handoff = out[-1].handoff
    assert handoff is not None and handoff.num_tokens == len(prompt) and len(handoff.first_token_ids) == 1
    decode = Engine(model, EngineConfig(block_size=8))
    got = _collect(run_to_completion(decode, [GenerateRequest("h", prompt, req.options, handoff=handoff)]))["h"]
    assert got == _run_alone(model, req)
    # A prefix handoff without first tokens (the engine-level form): the decode engine computes the rest.
    import dataclasses
    prefix = dataclasses.replace(handoff, prompt_ids=prompt[:-1], latent=handoff.latent[:, :-1],
                                 rope=handoff.rope[:, :-1], index_k=handoff.index_k[:, :-1],
                                 first_token_ids=(), first_logprobs=())
    decode = Engine(model, EngineConfig(block_size=8))
    got = _collect(run_to_completion(decode, [GenerateRequest("h", prompt, req.options, handoff=prefix)]))["h"]
    assert got == _run_alone(model, req)


def _hand_off(model, req, prefill_cfg=EngineConfig(), decode_cfg=EngineConfig(), warm=()):
    """``req`` prefilled on one engine (after ``warm`` requests filled its prefix cache), then generated
    on another from the handoff: (result, the prefill's output, the decode engine's first step's outputs)."""
    prefill = Engine(model, prefill_cfg)
    if warm:
        run_to_completion(prefill, list(warm))
    out = run_to_completion(prefill, [GenerateRequest(req.request_id, req.prompt_ids, req.options,
                                                      mode="prefill")])[req.request_id]
    assert len(out) == 1 and out[0].finished and out[0].token_ids == []
    decode = Engine(model, decode_cfg)
    decode.add_request(GenerateRequest(req.request_id, req.prompt_ids, req.options, handoff=out[0].handoff))
    forwards = []
    real = decode.runner.forward
    decode.runner.forward = lambda *a: forwards.append(a) or real(*a)
    first = decode.step()
    assert forwards == [], "the first tokens came with the handoff: the decode engine's first step computes nothing"
    decode.runner.forward = real
    outs = {req.request_id: list(first)}
    while decode.has_work():
        outs[req.request_id] += decode.step()
    return _collect(outs)[req.request_id], out[0], first


@pytest.mark.parametrize("length", [15, 16, 17, 31, 32, 33])
def test_the_prefill_draws_the_first_token_the_local_run_draws(model, length):
    """Tokens AND logprobs bitwise: n > 1, temperature, top-k / top-p, prompts around a 16-token
    block boundary. The decode engine's first step emits every sample's first token with no
    forward (nothing scheduled to compute), and its state then continues the local run's."""
    rng = random.Random(length)
    prompt = tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(length))
    for opts in (dict(temperature=1.0, top_p=0.9, seed=7, n=3), dict(temperature=0.7, top_k=12, seed=3, n=2),
                 dict(temperature=0.0, n=1), dict(temperature=1.3, seed=11, n=1)):
        req = _req("h", prompt, max_tokens=6, **opts)
        want = _run_alone(model, req)
        got, prefilled, first = _hand_off(model, req, decode_cfg=EngineConfig(block_size=16))
        assert got == want, opts
        n = req.options.n
        h = prefilled.handoff
        assert h.num_tokens == length and h.prompt_ids == prompt
        assert list(h.first_token_ids) == [want[i][0][0] for i in range(n)]
        assert list(h.first_logprobs) == [want[i][1][0] for i in range(n)]
        assert sorted((o.index, o.token_ids) for o in first) == [(i, [want[i][0][0]]) for i in range(n)]


def test_handoff_first_token_stop_conditions_match_local(model):
    """max_tokens == 1, and a first token that is a stop id or eos: the same finish as a local run,
    per sample (an n > 1 request whose samples end differently: the others go on)."""
    import dataclasses
    rng = random.Random(5)
    prompt = _prompt(rng, 20, 30)
    probe = _run_alone(model, _req("p", prompt, temperature=1.0, seed=9, n=4, max_tokens=3))
    firsts = [probe[i][0][0] for i in range(4)]
    cases = [dict(max_tokens=1, n=4), dict(max_tokens=1, n=1, temperature=0.0),
             dict(stop_token_ids=(firsts[1],), n=4, max_tokens=5),
             dict(stop_token_ids=(firsts[0],), n=1, max_tokens=5)]
    for opts in cases:
        opts.setdefault("temperature", 1.0)
        req = _req("h", prompt, seed=9, **opts)
        want = _run_alone(model, req)
        got, _, _ = _hand_off(model, req)
        assert got == want, opts
        if opts["max_tokens"] == 1:
            assert all(len(want[i][0]) == 1 and want[i][2] == "length" for i in range(req.options.n))
        else:   # the stopped sample ended on its first token, the others did not
            stopped = [i for i in range(req.options.n) if want[i][0][0] in opts["stop_token_ids"]]
            assert stopped and all(want[i][2] == "stop" and len(want[i][0]) == 1 for i in stopped)
            assert req.options.n == 1 or any(len(want[i][0]) == 5 for i in range(req.options.n))
    # eos as the first token (ignore_eos off): the same weights under a config whose eos is sample 2's draw.
    eos_model = Model(dataclasses.replace(CONFIG, eos_token_id=firsts[2]), seed=0)
    req = _req("h", prompt, seed=9, temperature=1.0, n=4, max_tokens=5, ignore_eos=False)
    want = _run_alone(eos_model, req)
    assert want[2] == ([firsts[2]], [probe[2][1][0]], "stop")
    assert _hand_off(eos_model, req)[0] == want


def test_handoff_joins_a_busy_decode_engine_exactly(model):
    """Handed-off requests (n > 1) arrive while neighbours decode, prefill in chunks and get preempted
    (a small cache): each sample's tokens and logprobs are its local run's."""
    rng = random.Random(13)
    targets = [_req(f"h{i}", _prompt(rng, 14, 40), temperature=1.0, top_p=0.9, seed=30 + i, n=2, max_tokens=8)
               for i in range(3)]
    handoffs = {}
    for t in targets:
        out = run_to_completion(Engine(model), [GenerateRequest(t.request_id, t.prompt_ids, t.options,
                                                                mode="prefill")])[t.request_id]
        handoffs[t.request_id] = GenerateRequest(t.request_id, t.prompt_ids, t.options, handoff=out[-1].handoff)
    eng = Engine(model, EngineConfig(max_num_batched_tokens=24, block_size=8, num_blocks=24))
    neighbours = [_req(f"n{i}", _prompt(rng, 5, 50), temperature=0.8, seed=i, max_tokens=rng.randint(3, 12))
                  for i in range(5)]
    arrivals = {0: neighbours[:3], 2: [handoffs["h0"]], 3: neighbours[3:], 4: [handoffs["h1"], handoffs["h2"]]}
    preempted = []
    real = eng.scheduler.preempt
    eng.scheduler.preempt = lambda s: preempted.append((s.request.request_id, s.num_output)) or real(s)
    got = _run_arrivals(eng, arrivals)
    # Handed-off samples past their first token were preempted, then recomputed from the imported KV.
    assert any(rid.startswith("h") and done > 0 for rid, done in preempted), preempted
    for t in targets:
        assert got[t.request_id] == _run_alone(model, t), t.request_id


def test_handoff_from_a_prefill_that_hit_its_prefix_cache_is_exact(model):
    rng = random.Random(8)
    shared = tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(40))
    req = _req("h", shared + (5, 9, 11), temperature=0.9, top_p=0.8, seed=21, n=2, max_tokens=5)
    want = _run_alone(model, req)
    warm = [_req("w", shared + (7,), temperature=0.0, max_tokens=2)]
    got, prefilled, _ = _hand_off(model, req, prefill_cfg=EngineConfig(block_size=16), warm=warm)
    assert prefilled.num_cached_tokens == 32 and got == want


def test_malformed_first_tokens_are_refused_by_the_engine(model):
    import dataclasses
    prompt = tuple(range(3, 23))
    out = run_to_completion(Engine(model), [GenerateRequest("p", prompt, SamplingOptions(n=2), mode="prefill")])
    h = out["p"][-1].handoff
    eng = Engine(model)
    bad = [(dataclasses.replace(h, first_token_ids=h.first_token_ids[:1]), "for n=2 samples"),
           (dataclasses.replace(h, first_token_ids=(3, CONFIG.vocab_size)), "outside the vocabulary"),
           (dataclasses.replace(h, first_logprobs=(float("nan"), -1.0)), "finite"),
           (dataclasses.replace(h, first_logprobs=(float("-inf"), -1.0)), "finite")]
    for handoff, match in bad:
        with pytest.raises(RequestError, match=match):
            eng.add_request(GenerateRequest("d", prompt, SamplingOptions(n=2), handoff=handoff))
    with pytest.raises(RequestError, match="prompt logprobs"):
        eng.add_request(GenerateRequest("d", prompt, SamplingOptions(n=2, prompt_logprobs=True), handoff=h))
    with pytest.raises(RequestError, match="cover all of it"):
        eng.add_request(GenerateRequest("d", prompt + (4,), SamplingOptions(n=2), handoff=h))


def test_every_uint64_seed_is_served_and_fixes_its_draws(model):
    """The proto's seed is uint64: seeds of 2**63 and more are served, their draws a function of the request."""
    prompt = (3, 4, 5, 6, 7)
    runs = {}
    for seed in (2**63, 2**64 - 1):
        req = _req("big", prompt, temperature=1.0, seed=seed, n=2)
        runs[seed] = _run_alone(model, req)
        assert runs[seed] == _run_alone(model, req, max_num_batched_tokens=3, block_size=4)
    assert runs[2**63] != runs[2**64 - 1]
    with pytest.raises(RequestError, match="seed"):
        Engine(model, EngineConfig()).add_request(GenerateRequest("b", prompt, SamplingOptions(seed=2**64)))


def test_abort_frees_blocks(model):
    eng = Engine(model, EngineConfig(num_blocks=64))
    eng.add_request(_req("x", tuple(range(3, 60)), max_tokens=50))
    eng.step()
    assert eng.kv_usage() > 0
    out = eng.abort("x")
    assert out[0].finish_reason == "abort" and eng.kv_usage() == 0 and not eng.has_work()


@pytest.mark.parametrize("bad,msg", [
    (GenerateRequest("b", ()), "prompt is empty"),
    (GenerateRequest("b", (1, 999)), "outside the vocabulary"),
    (GenerateRequest("b", (5,), SamplingOptions(max_tokens=0)), "max_tokens must be > 0"),
    (GenerateRequest("b", (5,), SamplingOptions(top_p=0.0)), "top_p"),
    (GenerateRequest("b", (5,), SamplingOptions(temperature=-1)), "temperature"),
    (GenerateRequest("b", tuple([5] * 600)), "does not fit the context"),
    (GenerateRequest("b", (5,), SamplingOptions(stop=("x",))), "need a tokenizer"),
    # Finite but beyond float32, inf, and positive values that float32 turns into 0 or inf logits.
    (GenerateRequest("b", (5,), SamplingOptions(temperature=1e300)), r"temperature must be 0 \(greedy\) or in "
                                                                     r"\[1e-06, 1e\+06\], got 1e\+300"),
    (GenerateRequest("b", (5,), SamplingOptions(temperature=float("inf"), top_k=3)), "temperature must be"),
    (GenerateRequest("b", (5,), SamplingOptions(temperature=1e-300)), "temperature must be"),
    (GenerateRequest("b", (5,), SamplingOptions(top_p=1e-300)), r"top_p must be in \(0, 1\]"),
    (GenerateRequest("b", (5,), SamplingOptions(top_p=float("nan"))), "top_p"),
    (GenerateRequest("b", (5,), SamplingOptions(stop=("",))), "stop strings must not be empty"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(model, bad, msg):
    eng = Engine(model, EngineConfig())
    with pytest.raises(RequestError, match=msg):
        eng.add_request(bad)
    assert _collect(run_to_completion(eng, [_req("ok", (3, 4, 5), max_tokens=2)]))["ok"][0][2] == "length"


def test_forking_under_memory_pressure_preempts_instead_of_failing(model):
    """n > 1 needs a private partial block per sibling: when the cache is full the engine
    preempts newer work (or waits), and every output still equals its solo run."""
    eng = Engine(model, EngineConfig(num_blocks=12, block_size=4))
    long = _req("long", tuple(range(3, 33)), temperature=0.0, max_tokens=16)
    fork = _req("fork", (5, 6, 7, 8, 9, 10), temperature=1.0, seed=4, n=4, max_tokens=6)
    eng.add_request(long)
    outs = {"long": [], "fork": []}
    for step in range(40):
        if step == 4:
            eng.add_request(fork)
        for d in eng.step():
            outs[d.request_id].append(d)
        if not eng.has_work():
            break
    got = _collect(outs)
    assert got["long"] == _run_alone(model, long)
    assert got["fork"] == _run_alone(model, fork, num_blocks=12, block_size=4)
    assert len(got["fork"]) == 4


def _add_unchecked(eng, request):
    """Queue ``request`` past the engine's validation: what a gap in it would let reach a step."""
    eng.validate = lambda r: None
    try:
        eng.add_request(request)
    finally:
        del eng.validate


def test_a_request_failing_inside_a_step_fails_alone_and_its_neighbours_keep_their_bits(model):
    """Poison that passes validation (here: validation bypassed) fails in the batched forward
    (an id outside the embedding: found by bisecting the batch) or in its own sampling
    parameters (a temperature float32 cannot hold); it ends with an "error" output, and every
    neighbour equals its solo run exactly, then the engine serves a new request as usual."""
    rng = random.Random(7)
    bystanders = [_req(f"b{i}", _prompt(rng, 3, 40), temperature=rng.choice([0.0, 0.9]), seed=i, top_k=5,
                       n=rng.choice([1, 2]), max_tokens=rng.randint(2, 10), prompt_logprobs=i % 3 == 0)
                  for i in range(8)]
    poison = [GenerateRequest("bad-id", (5, 6, 10**6, 7)),
              GenerateRequest("bad-temperature", (5, 6, 7), SamplingOptions(temperature=1e300, max_tokens=4)),
              GenerateRequest("bad-prompt-logprobs", (5, 6, 7, 8),
                              SamplingOptions(temperature=1e300, prompt_logprobs=True, max_tokens=4))]
    eng = Engine(model, EngineConfig(max_num_batched_tokens=64))
    outs = {r.request_id: [] for r in bystanders + poison}
    for r in bystanders[:4]:
        eng.add_request(r)
    for step in range(200):
        if step == 2:
            for r in poison:
                _add_unchecked(eng, r)
            for r in bystanders[4:]:
                eng.add_request(r)
        for d in eng.step():
            outs[d.request_id].append(d)
        if step > 2 and not eng.has_work():
            break
    for r in poison:
        assert [(d.finish_reason, d.finished) for d in outs[r.request_id]] == [("error", True)] * r.options.n
        assert outs[r.request_id][0].error
    assert "IndexError" in outs["bad-id"][0].error or "index" in outs["bad-id"][0].error
    assert "overflow" in outs["bad-temperature"][0].error
    got = _collect({r.request_id: outs[r.request_id] for r in bystanders})
    for r in bystanders:
        alone = _run_alone(model, r)
        assert got[r.request_id].keys() == alone.keys()
        for i, (toks, lps, reason) in alone.items():
            assert got[r.request_id][i][0] == toks and got[r.request_id][i][2] == reason
            assert torch.equal(torch.tensor(got[r.request_id][i][1]), torch.tensor(lps))
    assert eng.kv_usage() == 0
    after = _req("after", (3, 4, 5), max_tokens=3, seed=9)
    assert _collect(run_to_completion(eng, [after]))["after"] == _run_alone(model, after)


def test_max_num_seqs_samples_run_at_once_when_prefill_takes_several_steps(model):
    """Admission counts each running sample once: with prompts that need several prefill
    steps, the engine still reaches max_num_seqs running samples (it used to count the
    running samples' decode entries twice and stall at about half)."""
    engine = Engine(model, EngineConfig(max_num_batched_tokens=24, max_num_seqs=8, num_blocks=512))
    rng = random.Random(5)
    for i in range(16):
        prompt = tuple(rng.randrange(3, 64) for _ in range(40))            # two steps of prefill each
        engine.add_request(GenerateRequest(f"r{i}", prompt, SamplingOptions(max_tokens=40, ignore_eos=True, seed=i)))
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, engine.num_running)
    assert most == 8
