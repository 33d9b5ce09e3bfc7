"""Host CPU of the serving path per 1,000 generated tokens, without gRPC or a device: the Python that
carries a step's outputs from the engine core to the client's messages.

    python tools/bench/bench_stream_cpu.py                     # 256 streams of the tiny preset, CPU
    python tools/bench/bench_stream_cpu.py --streams 64 --new-tokens 128 --stream-interval 8 --repeat 5

One wave of N requests (--prompt-len random tokens, --new-tokens generated, temperature 1,
ignore_eos) runs in the real Engine (tiny preset, the countdown tokenizer, so outputs carry text),
and each step's outputs are recorded. They are then replayed, timed with ``time.process_time``:

- **core**: ``EngineCore._dispatch`` of each step (into the pass's :class:`StepOutputs`) and the
  engine process's pickling of the pass's events (what ``core.serve`` sends through the pipe);
- **front**: unpickling each pass, ``AsyncEngine._on_events`` (a stream per request, as ``submit``
  registers it) and every stream's consumer as a decode replica runs it (``Replica.stream_deltas``
  with ``--stream-interval``, then ``convert.delta_to_proto``: the messages gRPC would send).

CPU seconds of one thread on a fixed workload hold still on a loaded box where wall time does not;
the best of ``--repeat`` replays is reported. Every replayed stream's tokens and logprobs are checked
== the engine's (the replay must not change a bit). What it leaves out, by design: gRPC's own work per
message (grpc.aio, HTTP/2) and the engine's step (see bench_serving.py's per-process figures).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine
from zerokl.services.engine.types import EngineConfig, GenerateRequest, SampleOutput
from zerokl.services.inference import convert
from zerokl.services.engine.core import EngineCore, _Live
from zerokl.services.engine.outputs import dumps, loads
from zerokl.services.inference.async_engine import AsyncEngine, RequestStream
from zerokl.services.inference.replica import Replica, ServingLimits
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.tokenizer import load_tokenizer
from zerokl.vocab import SamplingOptions


def record(engine: Engine, requests: list[GenerateRequest]) -> list[list[SampleOutput]]:
    """Every step's outputs of one wave (all requests added at once)."""
    for r in requests:
        engine.add_request(r)
    steps = []
    while engine.has_work():
        steps.append(engine.step())
    return steps


def core_side(engine: Engine, requests: list[GenerateRequest], steps: list[list[SampleOutput]]) -> tuple[float, list[bytes]]:
    """CPU seconds of the core's dispatch and pickling of every pass; the pipe messages."""
    sent: list[bytes] = []
    core = EngineCore(engine, lambda events: sent.append(dumps(events)))
    for key, r in enumerate(requests, 1):
        core._live[r.request_id] = _Live(key, r, r.options.n)
    start = time.process_time()
    for outputs in steps:
        core._dispatch(outputs)        # what one pass of EngineCore._serve does after its step
        core._update_stats()
        core._flush()
    return time.process_time() - start, sent


def front_side(engine: Engine, requests: list[GenerateRequest], sent: list[bytes],
               interval: int) -> tuple[float, int, dict[str, tuple[list[int], list[float]]]]:
    """CPU seconds of the front's unpickling, events and consumers; messages; what the streams carried."""

    async def main() -> tuple[float, int, dict[str, tuple[list[int], list[float]]]]:
        front = AsyncEngine(engine)              # its core thread is not started: the passes are replayed
        front._loop = asyncio.get_running_loop()
        identity = ServiceIdentity(service="decode", replica_id="bench", weights_version="v")
        replica = Replica(front, identity, limits=ServingLimits(stream_interval=interval))
        got: dict[str, tuple[list[int], list[float]]] = {}
        messages = [0]

        async def consume(stream: RequestStream) -> None:
            tokens: list[int] = []
            logprobs: list[float] = []
            async for delta in replica.stream_deltas(stream):
                msg = convert.delta_to_proto(delta)
                messages[0] += 1
                tokens += msg.token_ids
                logprobs += msg.logprobs
            got[stream.request_id] = (tokens, logprobs)

        consumers = []
        for key, r in enumerate(requests, 1):
            stream = RequestStream(front, r, key)
            front._streams[r.request_id] = front._by_key[key] = stream
            consumers.append(asyncio.ensure_future(consume(stream)))
        await asyncio.sleep(0)
        start = time.process_time()
        for data in sent:
            front._on_events(loads(data))
            await asyncio.sleep(0)               # the consumers a pass woke run before the next pass
        await asyncio.gather(*consumers)
        return time.process_time() - start, messages[0], got

    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--stream-interval", type=int, default=8, help="the replica's (default %(default)s, as `zerokl up`)")
    p.add_argument("--repeat", type=int, default=3, help="replays; the best is reported (default %(default)s)")
    p.add_argument("--out", default=None, help="write the results (JSON) here")
    args = p.parse_args()
    torch.set_num_threads(1)
    config = ModelConfig.preset("tiny")
    n = args.streams
    engine = Engine(Model(config, seed=0).eval(),
                    EngineConfig(enable_prefix_caching=False, max_num_seqs=n, max_num_batched_tokens=2048,
                                 num_blocks=n * -(-(args.prompt_len + args.new_tokens) // 16) + 64),
                    load_tokenizer("countdown"))
    rng = random.Random(0)
    requests = [GenerateRequest(f"r{i}", tuple(rng.randrange(3, config.vocab_size) for _ in range(args.prompt_len)),
                                SamplingOptions(temperature=1.0, seed=i, max_tokens=args.new_tokens, ignore_eos=True))
                for i in range(n)]
    steps = record(engine, requests)
    want = {r.request_id: ([], []) for r in requests}
    for outputs in steps:
        for out in outputs:
            want[out.request_id][0].extend(out.token_ids)
            want[out.request_id][1].extend(out.logprobs)
    tokens = sum(len(t) for t, _ in want.values())
    best_core = best_front = float("inf")
    for _ in range(args.repeat):
        core_s, sent = core_side(engine, requests, steps)
        front_s, messages, got = front_side(engine, requests, sent, args.stream_interval)
        assert got == want, "the replayed streams carried other tokens or logprobs than the engine produced"
        best_core, best_front = min(best_core, core_s), min(best_front, front_s)
    report = {"streams": n, "steps": len(steps), "tokens": tokens, "messages": messages,
              "tokens_per_message": tokens / messages, "pipe_bytes_per_step": sum(map(len, sent)) / len(sent),
              "cpu_s_per_1k": {"core": 1000 * best_core / tokens, "front": 1000 * best_front / tokens},
              "core_ms_per_step": 1000 * best_core / len(steps), "identical": True}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
