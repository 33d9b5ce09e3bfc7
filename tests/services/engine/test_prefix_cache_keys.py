"""Prefix-cache keys: SHA-256 chains seeded with the weights version and numerics fingerprint, and a
hit only where the cached block holds the request's own tokens (issue 16, finding 4).

A colliding key (constructed here by making the key function return the same key for every
first block, the worst a forger of the old 64-bit builtin-hash keys could achieve) must never
hand one request another request's KV: its bits stay those of a clean run.
"""
import random

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine import scheduler as engine_module
from zerokl.services.engine.blocks import block_hashes, prefix_cache_seed
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

CONFIG = ModelConfig.preset("tiny")
BLOCK = EngineConfig().block_size


@pytest.fixture(scope="module")
def model():
    return Model(CONFIG, seed=0)


def _run(engine: Engine, rid: str, ids: tuple[int, ...]) -> tuple[list[int], torch.Tensor, int]:
    outs = run_to_completion(engine, [GenerateRequest(rid, ids, SamplingOptions(max_tokens=6, ignore_eos=True,
                                                                                seed=7))])[rid]
    toks = [t for o in outs for t in o.token_ids]
    lps = torch.tensor([lp for o in outs for lp in o.logprobs], dtype=torch.float32)
    return toks, lps, outs[-1].num_cached_tokens


def test_colliding_keys_never_share_another_requests_kv(model, monkeypatch):
    rng = random.Random(3)
    victim = tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(2 * BLOCK + 5))
    other = tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(2 * BLOCK + 5))
    assert victim[:BLOCK] != other[:BLOCK]
    clean_toks, clean_lps, _ = _run(Engine(model, EngineConfig()), "clean", victim)
    clean_other = _run(Engine(model, EngineConfig()), "clean-other", other)

    # Every block key collides with the key of the block at the same position in any other prompt.
    monkeypatch.setattr(engine_module, "block_hashes", lambda ids, size, *rest: list(range(len(ids) // size)))
    engine = Engine(model, EngineConfig())
    _run(engine, "poisoner", other)                 # fills the cache under the colliding keys
    toks, lps, cached = _run(engine, "victim", victim)
    assert cached == 0                              # no block holds the victim's tokens
    assert toks == clean_toks and torch.equal(lps, clean_lps)
    # A true hit still happens: the cached prompt again reuses its two full blocks, with its own bits.
    again_toks, again_lps, cached = _run(engine, "again", other)
    assert cached == 2 * BLOCK and again_toks == clean_other[0] and torch.equal(again_lps, clean_other[1])


def test_keys_are_sha256_chains_seeded_by_version_and_fingerprint():
    ids = list(range(3, 3 + 2 * BLOCK))
    seed = prefix_cache_seed("v1", "fp-a")
    keys = block_hashes(ids, BLOCK, seed)
    assert len(keys) == 2 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert keys == block_hashes(ids, BLOCK, prefix_cache_seed("v1", "fp-a"))      # stable across processes
    assert keys[0] != block_hashes(ids, BLOCK, prefix_cache_seed("v2", "fp-a"))[0]
    assert keys[0] != block_hashes(ids, BLOCK, prefix_cache_seed("v1", "fp-b"))[0]
    # The chain: block 1's key depends on block 0's tokens.
    changed = [ids[0] + 1, *ids[1:]]
    assert block_hashes(changed, BLOCK, seed)[1] != keys[1]
    # Not confusable by splitting: version "v1" + fingerprint "x" differs from "v" + "1x".
    assert prefix_cache_seed("v1", "x") != prefix_cache_seed("v", "1x")


def test_engine_keys_follow_the_weights_version(model):
    engine = Engine(model, EngineConfig())
    ids = tuple(range(3, 3 + 2 * BLOCK + 1))
    engine.set_cache_identity("v1", "fp")
    _run(engine, "a", ids)
    engine.load_weights(model.state_dict(), weights_version="v2")   # same tensors, new version: cache forgotten
    assert _run(engine, "b", ids)[2] == 0
    assert _run(engine, "c", ids)[2] == 2 * BLOCK
