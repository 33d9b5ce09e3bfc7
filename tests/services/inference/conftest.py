"""Shared setup of the inference-service tests: the tiny model, real loopback servers, offline references.

Every served result is compared with the synchronous Engine run offline on a
fresh engine holding only that request: exact token ids and exact fp32
logprob floats.
"""
from __future__ import annotations

import contextlib
import random
from typing import AsyncIterator, Iterator

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.tokenizer import CountdownTokenizer
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.services.inference import AsyncEngine, Replica, ServingLimits
from zerokl.services.engine.core import engine_of
from zerokl.services.inference.decode import Decoder, add_decode_service
from zerokl.services.inference.prefill import Prefiller, add_prefill_service
from zerokl.services.inference.server import make_identity
from zerokl.services.inference.types import SampleResult, fold_samples
from zerokl.services.inference.weights import WeightSwitcher
from zerokl.services.runtime import ServerOptions, ServiceServer
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.vocab import SamplingOptions

CONFIG = ModelConfig.preset("tiny")
WEIGHTS = "tiny-seed0"
TOKENIZER = CountdownTokenizer()  # 34 ids: the tiny model's ids 34..63 carry no text


@pytest.fixture(scope="session")
def model() -> Model:
    return Model(CONFIG, seed=0)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread while these tests run (restored after).

    Server, client and engine thread share two cores on CI; a second OpenMP
    thread spinning against them made each tiny GEMM ~100x slower there. The
    offline references run in this process under the same setting, so the
    comparisons do not depend on it.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(rng: random.Random, lo: int, hi: int) -> tuple[int, ...]:
    """Random ids of a random length; ids >= 3 avoid pad/bos/eos."""
    return tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(lo, hi)))


def offline(model: Model, ids: tuple[int, ...], options: SamplingOptions,
            config: EngineConfig = EngineConfig()) -> list[SampleResult]:
    """The request run alone on a fresh synchronous engine: per-sample results.

    Prompt logprobs are sample 0's (the services send them once per request).
    """
    outs = run_to_completion(Engine(model, config, TOKENIZER), [GenerateRequest("ref", ids, options)])["ref"]
    samples = fold_samples(outs)
    for s in samples.values():
        if s.index:
            s.prompt_logprobs = None
    return [samples.get(i, SampleResult(i)) for i in range(options.n)]


def offline_score(model: Model, ids: tuple[int, ...], options: SamplingOptions = SamplingOptions()) -> list[float]:
    outs = run_to_completion(Engine(model, EngineConfig()), [GenerateRequest("ref", ids, options, mode="score")])
    return list(outs["ref"][-1].prompt_logprobs)


def make_replica(model: Model, service: str, config: EngineConfig = EngineConfig(), weights: str = WEIGHTS,
                 limits: ServingLimits = ServingLimits(), process: bool = False) -> Replica:
    """A replica of ``model``; ``process``: its engine in an engine process (the model's tensors go there
    by shared memory: the same weights, so the offline references apply), else on a thread."""
    identity = make_identity(service, model, weights, f"{service}-test")
    if process:
        engine = AsyncEngine.spawn(engine_of(model, config, TOKENIZER), weights_version=weights,
                                   threads=1)
    else:
        engine = AsyncEngine(Engine(model, config, TOKENIZER))
    return Replica(engine, identity, TOKENIZER, limits)


@contextlib.asynccontextmanager
async def decode_server(model: Model, config: EngineConfig = EngineConfig(), weights: str = WEIGHTS,
                        limits: ServingLimits = ServingLimits(), options: ServerOptions = ServerOptions(),
                        weight_store: str | None = None, handoff_timeout_s: float = 60.0, process: bool = False
                        ) -> AsyncIterator[tuple[ServiceServer, Replica]]:
    """A decode replica on a loopback port (serving SwitchWeights from ``weight_store`` when given).

    It reads prefill replicas' KV presenting ``options``' peer token, as `zerokl serve decode` does;
    ``process``: its engine in an engine process.
    """
    replica = make_replica(model, "decode", config, weights, limits, process)
    replica.engine.start()
    server = ServiceServer("decode", options)
    decoder = Decoder(replica, token=options.auth.peer_token, tracer_provider=options.tracer_provider,
                      handoff_timeout_s=handoff_timeout_s)
    async with _switcher(replica, server, weight_store) as switch:
        add_decode_service(server, decoder, switch)
        await server.start()
        try:
            yield server, replica
        finally:
            await server.drain(0)
            await decoder.close()
            await replica.engine.close()


@contextlib.asynccontextmanager
async def _switcher(replica: Replica, server: ServiceServer, weight_store: str | None):  # noqa: ANN202
    """The SwitchWeights handler of ``replica`` against ``weight_store`` (None: no handler)."""
    if weight_store is None:
        yield None
        return
    store = WeightStoreClient(weight_store)
    switcher = WeightSwitcher(replica, store, not_serving=server.not_serving)
    try:
        yield switcher.switch
    finally:
        await switcher.close()
        await store.close()


@contextlib.asynccontextmanager
async def prefill_server(model: Model, config: EngineConfig = EngineConfig(),
                         chunk_bytes: int = 4096, weights: str = WEIGHTS, options: ServerOptions = ServerOptions(),
                         weight_store: str | None = None, process: bool = False
                         ) -> AsyncIterator[tuple[ServiceServer, Replica]]:
    """A prefill replica on a loopback port streaming KV in small chunks
    (serving SwitchWeights from ``weight_store`` when given; ``process``: its engine in an engine process)."""
    replica = make_replica(model, "prefill", config, weights, process=process)
    replica.engine.start()
    server = ServiceServer("prefill", options)
    async with _switcher(replica, server, weight_store) as switch:
        add_prefill_service(server, Prefiller(replica, chunk_bytes), switch)
        await server.start()
        try:
            yield server, replica
        finally:
            await server.drain(0)
            await replica.engine.close()
