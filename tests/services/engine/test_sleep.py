"""Engine sleep / wake (co-location with a trainer on one device): asleep, the engine holds no KV
cache (level 1) and no weight bytes either (level 2); woken, it computes the same bits as before it
slept (torch.equal on the logprobs of the same requests), on the general and on the decode path."""
import random

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest, OwnedWeights
from zerokl.vocab import SamplingOptions

CONFIG = ModelConfig.preset("tiny")


def _requests(seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(5, 40))),
                            SamplingOptions(temperature=0.9, seed=i, max_tokens=10, n=2, ignore_eos=True))
            for i in range(4)]


def _run(engine: Engine, requests: list[GenerateRequest]) -> dict:
    """(request id, sample) -> (tokens, logprobs as a tensor)."""
    out: dict = {}
    for rid, deltas in run_to_completion(engine, requests).items():
        for d in deltas:
            toks, lps = out.get((rid, d.index), ([], []))
            out[(rid, d.index)] = (toks + d.token_ids, lps + d.logprobs)
    return {k: (t, torch.tensor(lp, dtype=torch.float64)) for k, (t, lp) in out.items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0], k
        assert torch.equal(a[k][1], b[k][1]), k


@pytest.fixture(params=[False, True], ids=["general", "decode-path"])
def engine(request) -> Engine:
    # The decode path (device_decode, forced on a CPU by overlap_decode) keeps per-row state and graphs keyed by
    # the cache: both must survive a sleep.
    return Engine(Model(CONFIG, seed=0), EngineConfig(num_blocks=64, overlap_decode=request.param))


def test_level_1_releases_the_kv_cache_and_wakes_to_the_same_bits(engine: Engine) -> None:
    requests = _requests(1)
    before = _run(engine, requests)
    assert engine.blocks.cached                         # the prompts' full blocks are cached
    released = engine.sleep(1)
    assert engine.sleep_level == 1 and engine.cache is None
    fresh = Engine(Model(CONFIG, seed=0), engine.config).cache
    assert released == sum(t.numel() * t.element_size() for t in (fresh.latent, fresh.rope, fresh.index_k))
    assert not engine.blocks.cached                     # its KV is gone: no prefix may hit it
    assert engine.sleep(1) == 0                         # already asleep
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request(requests[0])
    engine.wake()
    assert engine.sleep_level == 0 and engine.cache is not None
    _assert_same(before, _run(engine, requests))


def test_level_2_releases_the_weights_and_a_load_refills_them(engine: Engine) -> None:
    requests = _requests(2)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = _run(engine, requests)
    engine.sleep(2)
    assert engine.sleep_level == 2 and engine.cache is None
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.model.state_dict().values())
    with pytest.raises(RuntimeError, match="load weights to wake"):
        engine.wake()
    with pytest.raises(ValueError, match="do not fit"):      # refused before any memory comes back
        engine.load_weights({k: v for k, v in weights.items() if k != "norm.weight"}, "v")
    assert engine.sleep_level == 2
    engine.load_weights(weights, "v")
    assert engine.sleep_level == 1                      # weights back; the KV cache comes at wake
    for k, t in engine.model.state_dict().items():
        assert torch.equal(t, weights[k]), k
    engine.wake()
    # The cache identity was the same before (an unnamed version): compare the bits of a fresh engine's run.
    _assert_same(before, _run(engine, requests))


def test_level_2_takes_owned_weights_without_a_copy(engine: Engine) -> None:
    """A state dict the engine may keep (OwnedWeights: the replica's own copy of the trainer's export) becomes its
    weights as it is (one copy in memory at the wake, not two); a plain one is copied (its owner keeps it)."""
    requests = _requests(5)
    before = _run(engine, requests)
    for owned in (False, True):
        weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.sleep(2)
        engine.load_weights(OwnedWeights(weights) if owned else weights, "")
        engine.wake()
        shared = [t.data_ptr() == weights[k].data_ptr() for k, t in engine.model.state_dict().items()]
        assert all(shared) if owned else not any(shared)
        _assert_same(before, _run(engine, requests))
    engine.sleep(2)                                     # and sleeps again: the adopted memory is released
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.model.state_dict().values())


def test_level_2_serves_each_new_version_it_adopts(engine: Engine) -> None:
    """Each wake serves the version it was given, not one adopted before: new weights every time, each version's
    bytes in one buffer as the replica receives a trainer's export (weightstore.sync: views at the same offsets
    every version). The CPU backend caches what a weight holds (zerokl.kernels.portable's slices) by its version
    counter, which a data swap keeps: a swap that did not bump it served the first adopted version's cached
    weights from the second adoption on (a co-located RL job: KL 2.4e-4 and every token mismatched from its
    third step)."""
    from zerokl.services.weightstore.sync import export_shared, open_shared
    requests = _requests(6)
    _run(engine, requests)
    for seed in (1, 2, 3):
        model = Model(CONFIG, seed=seed)
        expected = _run(Engine(model, engine.config), requests)
        shared = export_shared(model.state_dict(), f"v{seed}")
        try:
            weights = open_shared(shared.export, "cpu")
        finally:
            shared.close()
        engine.sleep(2)
        engine.load_weights(OwnedWeights(weights), f"v{seed}")
        engine.wake()
        _assert_same(expected, _run(engine, requests))


def test_sleep_refuses_a_busy_engine_and_a_bad_level() -> None:
    engine = Engine(Model(CONFIG, seed=0), EngineConfig(num_blocks=64))
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(3)
    engine.add_request(_requests(3)[0])
    with pytest.raises(RuntimeError, match="requests in the engine"):
        engine.sleep(1)
    assert engine.sleep_level == 0


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_on_cuda_releases_device_memory_and_recaptures_graphs_to_the_same_bits(level: int) -> None:
    """On CUDA (decode graphs captured, overlapped decode): asleep, nothing holds what the engine released and it is
    back with the driver; woken (level 2: its weights loaded again), its decode graphs are captured anew
    on the new cache and every request's tokens and logprobs equal those before it slept."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = Model(CONFIG, seed=0, dtype=torch.bfloat16).cuda().eval()
    engine = Engine(model, EngineConfig(num_blocks=2048))       # a KV cache worth measuring
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    requests = _requests(4)
    before = _run(engine, requests)
    assert engine.runner._graphs                                # decode steps ran from graphs
    torch.cuda.synchronize()
    held, live = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    released = engine.sleep(level)
    assert engine.runner._graphs == {}
    assert torch.cuda.memory_allocated() <= live - released     # nothing still holds what it released
    # ...and it went back to the driver: the dropped graphs' memory pool too, which stays reserved until the graphs
    # are collected (they sit in reference cycles: sleep runs the cyclic collector before empty_cache).
    assert torch.cuda.memory_reserved() <= held - released
    if level == 2:
        engine.load_weights(weights, "")
    engine.wake()
    _assert_same(before, _run(engine, requests))
    assert engine.runner._graphs                                # captured again, on the new cache
