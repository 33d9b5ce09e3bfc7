"""Serving in FP8 (`zerokl serve prefill|decode --dtype fp8`): every request's tokens and logprobs
are the same bits alone as inside a busy batch (other neighbours, positions, arrival steps, chunk
budgets, block sizes, prefix-cache hits, preemption, the prefill -> decode KV handoff), through the
engine and through served replicas; the replica advertises the FP8 fingerprint (key
`.../float8_e4m3fn`), and a request pinned to another fingerprint is refused."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from conftest import CONFIG, WEIGHTS, decode_server, offline, prefill_server, prompt
from zerokl.kernels import fingerprint
from zerokl.kernels.model import Model
from zerokl.kernels.model.fp8 import is_fp8, numerics_dtype, quantize_fp8
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions
from zerokl.services.inference import GenerateResult, InferenceClient, InferenceRequest
from zerokl.services.inference.server import build_parser, load_model, make_identity

FP8 = fingerprint(dtype=torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def fp8_model() -> Model:
    """The tiny preset as `zerokl serve decode --preset tiny --seed 0 --dtype fp8` builds it."""
    return quantize_fp8(Model(CONFIG, seed=0, dtype=torch.bfloat16)).eval()


def _opts(rng: random.Random, **kw) -> SamplingOptions:
    kw.setdefault("max_tokens", rng.randint(1, 10))
    return SamplingOptions(temperature=rng.choice([0.0, 0.8, 1.0]), top_p=rng.choice([1.0, 0.9]),
                           top_k=rng.choice([0, 5]), seed=rng.randrange(1000), ignore_eos=True, **kw)


def _collect(outs: dict) -> dict:
    """request id -> sample index -> (tokens, logprobs, finish reason)."""
    res: dict = {}
    for rid, deltas in outs.items():
        per = res.setdefault(rid, {})
        for d in deltas:
            toks, lps, _ = per.get(d.index, ((), (), None))
            per[d.index] = (toks + tuple(d.token_ids), lps + tuple(d.logprobs), d.finish_reason or None)
    return res


def test_the_served_preset_is_fp8_and_advertises_the_fp8_fingerprint(fp8_model):
    args = build_parser("decode").parse_args(["--preset", "tiny", "--seed", "0", "--dtype", "fp8", "--device", "cpu"])
    loaded = load_model(args)
    assert is_fp8(loaded.model) and numerics_dtype(loaded.model) == torch.float8_e4m3fn
    assert loaded.model.dtype == torch.bfloat16                       # activations (and the KV cache)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for a, b in zip(loaded.model.state_dict().values(), fp8_model.state_dict().values(), strict=True))
    identity = make_identity("decode", loaded.model, loaded.weights_version)
    assert identity.numerics_fingerprint == FP8 != fingerprint(dtype=torch.bfloat16)
    assert identity.dtype == "float8_e4m3fn"


@pytest.mark.parametrize("seed", [0])
def test_fp8_engine_output_is_independent_of_the_batch(fp8_model, seed):
    """Alone == among neighbours arriving at random steps, under small and large chunk budgets and
    block sizes, with preemption (tokens and fp32 logprobs, exact), and again on a prefix-cache hit."""
    rng = random.Random(seed)
    target = GenerateRequest("target", prompt(rng, 20, 70), _opts(rng, max_tokens=10, n=2))
    want = _collect(run_to_completion(Engine(fp8_model, EngineConfig()), [target]))["target"]
    preempted = 0
    for cfg in (EngineConfig(max_num_batched_tokens=7, block_size=4, num_blocks=400),
                EngineConfig(max_num_batched_tokens=64, block_size=16, num_blocks=100),
                EngineConfig(max_num_batched_tokens=29, block_size=8, num_blocks=14)):      # preempts
        eng = Engine(fp8_model, cfg)
        arrivals: dict[int, list] = {}
        for i in range(5):
            arrivals.setdefault(rng.randint(0, 6), []).append(
                GenerateRequest(f"n{i}", prompt(rng, 3, 60), _opts(rng, n=rng.choice([1, 2]))))
        arrivals.setdefault(rng.randint(0, 4), []).append(target)
        outs, step = {}, 0
        while step <= max(arrivals) or eng.has_work():
            for r in arrivals.get(step, []):
                eng.add_request(r)
                outs[r.request_id] = []
            for d in eng.step():
                outs[d.request_id].append(d)
            step += 1
        assert _collect(outs)["target"] == want, f"FP8 output changed under {cfg}"
        preempted += eng.stats["preemptions"]
        # A second run of the target on the warm engine hits its prefix cache: the same bits.
        again = GenerateRequest("again", target.prompt_ids, target.options)
        hit = run_to_completion(eng, [again])["again"]
        assert hit[0].num_cached_tokens > 0 and _collect({"again": hit})["again"] == want
    assert preempted > 0, "the small cache should have forced a preemption"


def test_fp8_replicas_serve_each_request_its_solo_bits(fp8_model):
    """Concurrent clients over loopback gRPC (random neighbours, shared prefixes, chunked prefill)
    and the prefill -> decode KV handoff: each equals the FP8 engine run offline on it alone."""
    rng = random.Random(3)
    shared = prompt(rng, 30, 30)
    requests = [InferenceRequest(prompt_ids=shared + prompt(rng, 1, 12) if i % 2 else prompt(rng, 3, 50),
                                 options=_opts(rng, n=rng.choice([1, 2]))) for i in range(8)]
    delays = [rng.uniform(0, 0.2) for _ in requests]
    busy = EngineConfig(max_num_batched_tokens=24, block_size=8, num_blocks=256)
    handed = InferenceRequest(prompt_ids=prompt(rng, 20, 40), options=_opts(rng, n=2, max_tokens=6))

    async def main() -> None:
        async with decode_server(fp8_model, busy) as (dsrv, replica), \
                prefill_server(fp8_model, EngineConfig(max_num_batched_tokens=16)) as (psrv, _), \
                InferenceClient(dsrv.address) as client:
            assert replica.identity.numerics_fingerprint == FP8

            async def one(r: InferenceRequest, delay: float) -> GenerateResult:
                await asyncio.sleep(delay)
                return await client.generate_all(r)
            results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays, strict=True)))
            for r, got in zip(requests, results, strict=True):
                assert got.samples == offline(fp8_model, r.prompt_ids, r.options)
                assert (got.weights_version, got.numerics_fingerprint) == (WEIGHTS, FP8)
            got = GenerateResult.collect([d async for d in client.generate_from_prefill(handed, psrv.address)])
            assert got.samples == offline(fp8_model, handed.prompt_ids, handed.options)
            # Pinned to the bf16 fleet's fingerprint: refused, not computed in other numerics.
            pinned = InferenceRequest(prompt_ids=(5, 6, 7), options=_opts(rng),
                                      numerics_fingerprint=fingerprint(dtype=torch.bfloat16))
            with pytest.raises(Exception, match="(?i)fingerprint"):
                await client.generate_all(pinned)
    asyncio.run(main())


def test_fp8_with_tensor_parallelism_is_refused_by_name(capsys):
    from zerokl.services.inference.server import main
    with pytest.raises(SystemExit):
        main("decode", ["--preset", "tiny", "--dtype", "fp8", "--tp", "2", "--device", "cpu"])
    assert "--dtype fp8 serves at --tp 1" in capsys.readouterr().err
