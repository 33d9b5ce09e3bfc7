"""The engine core in its own process (AsyncEngine.spawn): the same bits, the same contract.

Every result through the engine process is compared with the synchronous Engine run offline
in this process on a fresh engine holding only that request (exact token ids, torch.equal on
the fp32 logprobs, the exported KV tensors): under concurrency, staggered arrivals and n > 1,
for generate, score and prefill (KV export) requests. A weight swap through the process lets the
admitted request finish on the old weights and stamps every output with the weights that computed
it; abort ends every sample and frees the KV; bad input is INVALID_ARGUMENT and the engine serves
on. A killed engine process ends the streams in flight with UNAVAILABLE and makes the served
replica NOT_SERVING (no hang), and an engine process never outlives the process that spawned it.
"""
from __future__ import annotations

import asyncio
import operator
import random
import subprocess
import sys
import textwrap
import time

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import CONFIG, TOKENIZER, decode_server, offline, offline_score, prompt
from zerokl.kernels.model import Model
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest, SampleOutput
from zerokl.vocab import SamplingOptions
from zerokl.services.inference import AsyncEngine, InferenceClient, InferenceRequest
from zerokl.services.engine.core import engine_of
from zerokl.services.inference.async_engine import collect
from zerokl.services.inference.types import fold_samples
from zerokl.services.runtime.errors import FailedPrecondition, InvalidArgument, Unavailable

pytestmark = pytest.mark.timeout(300)

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def spawn(model: Model, version: str = "v1", config: EngineConfig = EngineConfig()) -> AsyncEngine:
    return AsyncEngine.spawn(engine_of(model, config, TOKENIZER), weights_version=version, threads=1)


def assert_same_samples(outputs: list[SampleOutput], model: Model, ids: tuple[int, ...],
                        options: SamplingOptions) -> None:
    """``outputs`` (one request's stream) equal the request run alone offline, bit for bit."""
    got = fold_samples(outputs)
    want = offline(model, ids, options)
    assert sorted(got) == [w.index for w in want]
    for w in want:
        g = got[w.index]
        assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)
        assert torch.equal(torch.tensor(g.logprobs, dtype=torch.float64), torch.tensor(w.logprobs, dtype=torch.float64))
        if w.prompt_logprobs is not None:
            assert torch.equal(torch.tensor(g.prompt_logprobs), torch.tensor(w.prompt_logprobs))


def test_outputs_through_the_process_are_the_in_process_engine_bits_under_concurrency(model) -> None:
    rng = random.Random(32)
    requests = []
    for i in range(10):
        options = SamplingOptions(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 5]),
                                  top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**31),
                                  max_tokens=rng.randint(3, 16), n=rng.choice([1, 1, 2, 3]),
                                  ignore_eos=rng.random() < 0.5, prompt_logprobs=rng.random() < 0.3)
        requests.append(GenerateRequest(f"r{i}", prompt(rng, 1, 40), options))
    delays = [rng.choice([0.0, 0.0, 0.01, 0.05, 0.2]) for _ in requests]
    score = GenerateRequest("score", prompt(rng, 5, 30), SamplingOptions(temperature=0.8), mode="score")
    pre = GenerateRequest("pre", prompt(rng, 20, 50), SamplingOptions(n=2, seed=3), mode="prefill")
    engine = spawn(model)

    async def one(request: GenerateRequest, delay: float) -> list[SampleOutput]:
        await asyncio.sleep(delay)  # staggered arrivals: each joins a running batch at another step
        stream = await engine.submit(request)
        assert stream.weights_version == "v1"
        async with stream:
            return [out for batch in [b async for b in stream.batches()] for out in batch]

    async def main() -> tuple[list, list, list]:
        engine.start()
        try:
            results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)),
                                           one(score, 0.02), one(pre, 0.03))
        finally:
            await engine.close()
        return results[:-2], results[-2], results[-1]

    generated, scored, prefilled = asyncio.run(main())
    for request, outputs in zip(requests, generated):
        assert all(o.request_id == request.request_id for o in outputs)
        assert_same_samples(outputs, model, request.prompt_ids, request.options)
    assert torch.equal(torch.tensor(scored[-1].prompt_logprobs), torch.tensor(offline_score(model, score.prompt_ids,
                                                                                            score.options)))
    # The prefill replica's export: the KV tensors (shared memory across the pipe) and first tokens, exactly.
    want = run_to_completion(Engine(model, EngineConfig(), TOKENIZER), [pre])["pre"][-1].handoff
    got = prefilled[-1].handoff
    assert got is not None and want is not None
    for name in ("latent", "rope", "index_k"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.first_token_ids, got.first_logprobs) == (want.first_token_ids, want.first_logprobs)


def test_a_swap_through_the_process_lets_admitted_requests_finish_and_stamps_every_output(model) -> None:
    other = Model(CONFIG, seed=1)                  # v2: other weights, same config
    weights = {"v1": model, "v2": other}
    long = GenerateRequest("long", tuple(range(3, 20)), SamplingOptions(seed=1, max_tokens=40, ignore_eos=True))
    during = GenerateRequest("during", tuple(range(5, 15)), SamplingOptions(seed=2, max_tokens=10, n=2))
    after = GenerateRequest("after", tuple(range(5, 15)), SamplingOptions(seed=2, max_tokens=10, n=2))
    bad = {k: v[:, :1] if v.dim() == 2 else v for k, v in other.state_dict().items()}
    engine = spawn(model)

    async def main() -> dict[str, tuple[str, list[SampleOutput]]]:
        engine.start()
        got: dict[str, tuple[str, list[SampleOutput]]] = {}
        try:
            stream = await engine.submit(long)
            first = [await anext(stream)]
            swap = asyncio.create_task(engine.load_weights(other.state_dict(), "v2"))
            during_stream = await engine.submit(during)   # held by the swap, or admitted just before it
            got["long"] = ("v1" if stream.weights_version == "v1" else "?", first + await collect(stream))
            got["during"] = (during_stream.weights_version, await collect(during_stream))
            await swap
            assert engine.weights_version == "v2"
            with pytest.raises(FailedPrecondition):      # pinned to the version it no longer holds
                await engine.submit(GenerateRequest("pinned", (3, 4), SamplingOptions()), pinned_version="v1")
            with pytest.raises(FailedPrecondition):      # weights that do not fit: nothing changes
                await engine.load_weights(bad, "v3")
            assert engine.weights_version == "v2" and engine.unfit_reason is None
            after_stream = await engine.submit(after, pinned_version="v2")
            got["after"] = (after_stream.weights_version, await collect(after_stream))
        finally:
            await engine.close()
        return got

    got = asyncio.run(main())
    assert got["long"][0] == "v1" and got["after"][0] == "v2"
    for request in (long, during, after):
        version, outputs = got[request.request_id]
        assert_same_samples(outputs, weights[version], request.prompt_ids, request.options)


def test_abort_and_bad_input_through_the_process(model) -> None:
    long = GenerateRequest("long", tuple(range(3, 30)), SamplingOptions(n=2, max_tokens=300, ignore_eos=True))
    again = GenerateRequest("long", tuple(range(3, 30)), SamplingOptions(n=2, max_tokens=6, seed=4))
    engine = spawn(model)

    async def main() -> list[SampleOutput]:
        engine.start()
        try:
            stream = await engine.submit(long)
            outputs = [await anext(stream), await anext(stream)]
            assert engine.abort("long") and engine.in_flight("long")
            outputs += await collect(stream)
            ends = {o.index: o.finish_reason for o in outputs if o.finished}
            assert ends == {0: "abort", 1: "abort"}
            assert not engine.in_flight("long")
            assert await engine.call(operator.methodcaller("kv_usage")) == 0.0
            # A consumer that leaves early aborts, too.
            async with await engine.submit(long) as left:
                await anext(left)
            while engine.in_flight("long"):
                await asyncio.sleep(0.01)
            with pytest.raises(InvalidArgument):
                await engine.submit(GenerateRequest("bad", (3, CONFIG.vocab_size + 5), SamplingOptions()))
            return await collect(await engine.submit(again))   # the id is free and the engine serves on
        finally:
            await engine.close()

    assert_same_samples(asyncio.run(main()), model, again.prompt_ids, again.options)


def test_a_killed_engine_process_ends_streams_unavailable_and_the_replica_not_serving(model) -> None:
    request = InferenceRequest(prompt_ids=tuple(range(3, 20)), options=SamplingOptions(max_tokens=400,
                                                                                        ignore_eos=True))

    async def main() -> None:
        async with decode_server(model, process=True) as (server, replica), \
                InferenceClient(server.address) as client:
            health = health_pb2_grpc.HealthStub(client.channel)
            ok = await client.generate_all(InferenceRequest(prompt_ids=(3, 4, 5), options=SamplingOptions(seed=1)))
            assert [s.token_ids for s in ok.samples] == [s.token_ids for s in offline(model, (3, 4, 5),
                                                                                        SamplingOptions(seed=1))]
            reasons: list[str | None] = []
            replica.engine.on_fitness(reasons.append)
            stream = client.generate(request)
            await anext(stream)
            replica.engine.kill()                    # what a crash of the engine process does
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "engine process ended" in err.value.details()
            assert reasons and reasons[-1] is not None and "engine process ended" in reasons[-1]
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            assert status == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate_all(request)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            with pytest.raises(Unavailable):
                await replica.engine.submit(GenerateRequest("x", (3, 4), SamplingOptions()))

    asyncio.run(main())


def test_the_engine_process_dies_with_the_process_that_spawned_it(tmp_path) -> None:
    script = textwrap.dedent("""
        import functools, sys, time
        import torch
        from zerokl.kernels.model import Model, ModelConfig
        from zerokl.services.engine.engine import Engine
        from zerokl.services.inference import AsyncEngine
        if __name__ == "__main__":
            torch.set_num_threads(1)
            engine = AsyncEngine.spawn(functools.partial(Engine, Model(ModelConfig.preset("tiny"), seed=0)),
                                       threads=1)
            print(engine.pid, flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()                                  # no cleanup runs in the parent
        parent.wait()
        deadline = time.monotonic() + 60               # a bound on a hang, not a timing claim
        while _alive(child):
            assert time.monotonic() < deadline, f"engine process {child} outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
