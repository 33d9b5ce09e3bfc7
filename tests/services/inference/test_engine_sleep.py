"""Sleep / wake through the engine process (co-location): a sleep waits for the admitted requests,
requests that arrive while the engine sleeps wait and are admitted at wake, a weight swap wakes a
level-2 sleeper (its weights refilled), and every output equals the offline engine's bits for the
weights that computed it."""
from __future__ import annotations

import asyncio

import pytest

from conftest import CONFIG, TOKENIZER, decode_server, offline
from test_engine_process import assert_same_samples
from zerokl.kernels.model import Model
from zerokl.services.engine.core import engine_of
from zerokl.services.engine.types import EngineConfig, GenerateRequest, SampleOutput
from zerokl.services.inference import AsyncEngine
from zerokl.services.inference.async_engine import collect
from zerokl.services.runtime.errors import FailedPrecondition
from zerokl.vocab import SamplingOptions

pytestmark = pytest.mark.timeout(300)


def test_sleep_holds_requests_and_a_swap_wakes_the_engine_with_the_same_bits(model) -> None:
    other = Model(CONFIG, seed=1)
    long = GenerateRequest("long", tuple(range(3, 20)), SamplingOptions(seed=1, max_tokens=30, ignore_eos=True))
    held = GenerateRequest("held", tuple(range(5, 15)), SamplingOptions(seed=2, max_tokens=10, n=2))
    after = GenerateRequest("after", tuple(range(4, 30)), SamplingOptions(seed=3, max_tokens=8, temperature=0.7))
    engine = AsyncEngine.spawn(engine_of(model, EngineConfig(num_blocks=64), TOKENIZER), weights_version="v1",
                               threads=1)

    async def main() -> dict[str, tuple[str, list[SampleOutput]]]:
        engine.start()
        got: dict[str, tuple[str, list[SampleOutput]]] = {}
        try:
            stream = await engine.submit(long)
            first = [await anext(stream)]
            sleeping = asyncio.create_task(engine.sleep(2))       # waits for "long" to finish
            waiting = asyncio.create_task(engine.submit(held))    # arrives after the sleep: held until a wake
            got["long"] = (stream.weights_version, first + await collect(stream))
            released = await sleeping
            assert released > 0 and engine.sleep_level == 2
            await asyncio.sleep(0.2)
            assert not waiting.done()                             # nothing is admitted while asleep
            with pytest.raises(FailedPrecondition, match="weight switch wakes it"):
                await engine.wake()                               # the weights are gone: only a swap wakes it
            await engine.load_weights(other.state_dict(), "v2")
            assert engine.sleep_level == 0 and engine.weights_version == "v2"
            held_stream = await waiting
            got["held"] = (held_stream.weights_version, await collect(held_stream))
            assert await engine.sleep(1) > 0 and engine.sleep_level == 1
            await engine.wake()
            assert engine.sleep_level == 0
            after_stream = await engine.submit(after, pinned_version="v2")
            got["after"] = (after_stream.weights_version, await collect(after_stream))
            assert (engine.sleeps, engine.wakes) == (2, 2)
        finally:
            await engine.close()
        return got

    got = asyncio.run(main())
    weights = {"v1": model, "v2": other}
    assert [got[r][0] for r in ("long", "held", "after")] == ["v1", "v2", "v2"]
    for request in (long, held, after):
        version, outputs = got[request.request_id]
        assert_same_samples(outputs, weights[version], request.prompt_ids, request.options)


def test_sleep_and_wake_rpcs_on_a_replica(model) -> None:
    """Sleep / Wake over gRPC: a bad level is INVALID_ARGUMENT naming the field; a request sent while the
    replica sleeps waits and completes after Wake with the offline engine's bits."""
    import grpc
    import grpc.aio

    from zerokl.services.inference import InferenceClient, InferenceRequest

    options = SamplingOptions(seed=5, max_tokens=6, temperature=0.8)
    ids = tuple(range(3, 25))

    async def main():
        async with decode_server(model, process=True) as (server, replica):
            client = InferenceClient(server.address)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await client.sleep(3)
                assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "level" in bad.value.details()
                asleep = await client.sleep(1)
                assert asleep.level == 1 and asleep.released_bytes > 0
                waiting = asyncio.create_task(client.generate_all(InferenceRequest(prompt_ids=ids, options=options)))
                await asyncio.sleep(0.2)
                assert not waiting.done()
                awake = await client.wake()
                assert awake.level == 0
                result = await waiting
            finally:
                await client.close()
            return result

    result = asyncio.run(main())
    want = offline(model, ids, options)[0]
    assert list(result.samples[0].token_ids) == want.token_ids
    assert list(result.samples[0].logprobs) == want.logprobs
