"""Shared setup of the scheduler tests: real replicas and a real scheduler on loopback, offline references.

Replicas run in process (one model object per weights, built once) or as
`zerokl serve decode` subprocesses where a test must kill one. Every output
is compared exactly (token ids, fp32 logprob floats, text) with the request
run alone on a fresh synchronous engine.
"""
from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from typing import AsyncIterator, Sequence

import pytest

from zerokl.kernels.model import Model, ModelConfig
from zerokl.tokenizer import CountdownTokenizer
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.services.inference import AsyncEngine, Replica
from zerokl.services.inference.decode import Decoder, add_decode_service
from zerokl.services.inference.prefill import Prefiller, add_prefill_service
from zerokl.services.inference.server import make_identity
from zerokl.services.inference.types import SampleResult, fold_samples
from zerokl.services.runtime import ServerOptions, ServiceServer
from zerokl.services.routing import Registry, ReplicaEndpoint, Scheduler, SchedulerConfig, StaticSource
from zerokl.vocab import SamplingOptions

CONFIG = ModelConfig.preset("tiny")
# What `zerokl serve decode --preset tiny --seed 0` reports, so in-process and subprocess replicas agree.
WEIGHTS = "preset-tiny-seed0"
TOKENIZER = CountdownTokenizer()
# Tests fail fast when a replica is missing instead of waiting the default 5 s for one to appear.
QUICK = SchedulerConfig(route_wait_s=2.0)


@pytest.fixture(scope="session")
def model() -> Model:
    return Model(CONFIG, seed=0)


@pytest.fixture(scope="session")
def model_seed1() -> Model:
    return Model(CONFIG, seed=1)


def prompt(rng: random.Random, lo: int, hi: int) -> tuple[int, ...]:
    """Random ids of a random length; ids >= 3 avoid pad/bos/eos."""
    return tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(lo, hi)))


def offline(model: Model, ids: tuple[int, ...], options: SamplingOptions) -> list[SampleResult]:
    """The request run alone on a fresh synchronous engine: per-sample results (prompt logprobs on sample 0)."""
    outs = run_to_completion(Engine(model, EngineConfig(), TOKENIZER), [GenerateRequest("ref", ids, options)])["ref"]
    samples = fold_samples(outs)
    for s in samples.values():
        if s.index:
            s.prompt_logprobs = None
    return [samples.get(i, SampleResult(i)) for i in range(options.n)]


def numbers(samples: Sequence[SampleResult]) -> list[tuple]:
    """What must be identical whichever replica or path computed it."""
    return [(s.index, s.token_ids, s.logprobs, s.text, s.finish_reason, s.prompt_logprobs) for s in samples]


@contextlib.asynccontextmanager
async def replica_server(model: Model, service: str = "decode", weights: str = WEIGHTS,
                         options: ServerOptions = ServerOptions(), handoff_timeout_s: float = 60.0
                         ) -> AsyncIterator[tuple[ServiceServer, Replica]]:
    """An in-process decode (or prefill) replica on a loopback port (KV in 8 KiB chunks)."""
    identity = make_identity(service, model, weights, f"{service}-{weights}-{model.dtype}")
    replica = Replica(AsyncEngine(Engine(model, EngineConfig(), TOKENIZER)), identity, TOKENIZER)
    replica.engine.start()
    server = ServiceServer(service, options)
    decoder = None
    if service == "decode":
        decoder = Decoder(replica, token=options.auth.peer_token, tracer_provider=options.tracer_provider,
                          handoff_timeout_s=handoff_timeout_s)
        add_decode_service(server, decoder)
    else:
        add_prefill_service(server, Prefiller(replica, 8192))
    await server.start()
    try:
        yield server, replica
    finally:
        await server.drain(0)
        if decoder is not None:
            await decoder.close()
        await replica.engine.close()


@contextlib.asynccontextmanager
async def scheduler_server(decode: Sequence[str], prefill: Sequence[str] = (),
                           config: SchedulerConfig = QUICK,
                           poll_interval_s: float = 0.2, options: ServerOptions = ServerOptions()
                           ) -> AsyncIterator[tuple[ServiceServer, Scheduler]]:
    """A scheduler over a static fleet on a loopback port (health already synced)."""
    source = StaticSource([*(ReplicaEndpoint("decode", a) for a in decode),
                           *(ReplicaEndpoint("prefill", a) for a in prefill)])
    registry = Registry([source], poll_interval_s=poll_interval_s, poll_timeout_s=2.0,
                        tracer_provider=options.tracer_provider)
    scheduler = Scheduler(registry, config, replica_id="scheduler-test")
    server = ServiceServer("scheduler", options)
    scheduler.attach(server)
    await scheduler.start()
    await server.start()
    await scheduler.sync_health()
    try:
        yield server, scheduler
    finally:
        await server.drain(0)
        await scheduler.close()


def routed(scheduler: Scheduler) -> dict[str, int]:
    """Attempts the scheduler sent to each replica address."""
    return {v.address: v.routed for v in scheduler.replicas()}


def serve_decode(*flags: str) -> subprocess.Popen:
    """Start `zerokl serve decode --preset tiny ...` as a subprocess (read its address with :func:`wait_listening`)."""
    return subprocess.Popen([sys.executable, "-m", "zerokl", "serve", "decode", "--preset", "tiny", "--port", "0",
                             "--threads", "1", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_listening(proc: subprocess.Popen, service: str = "decode") -> str:
    """The address from a service's ``<service> listening on HOST:PORT`` line."""
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith(f"{service} listening on 127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"{service} did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    return line.split()[3]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()

