"""The runner's decode path (one packed copy in, the attention batch built on the device, the
draw on the device, one copy out) gives exactly the general path's bits. On CPU it runs
eagerly (forced on); tests/services/engine/test_engine_gpu.py checks it with CUDA graphs."""
import random

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.paging import SequenceChunk, batch_for_chunks, decode_batch
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.runner import ModelRunner, batch_buckets
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

CONFIG = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return Model(CONFIG, seed=0)


def test_decode_batch_equals_batch_for_chunks_padded():
    rng = random.Random(0)
    bs, nb = 4, 12
    tables = [rng.sample(range(100), nb) for _ in range(5)]
    positions = [0, 3, 4, 17, 40]
    ref = batch_for_chunks([SequenceChunk(tuple(t), p, 1) for t, p in zip(tables, positions)], bs)
    width = 48
    got = decode_batch(torch.tensor(tables), torch.tensor(positions), bs, width)
    assert torch.equal(got.positions, ref.positions) and torch.equal(got.write_slots, ref.write_slots)
    w = ref.key_slots.shape[1]
    assert torch.equal(got.key_slots[:, :w], ref.key_slots) and bool((got.key_slots[:, w:] == -1).all())


def test_batch_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]


def _device_decode(engine: Engine) -> list[int]:
    """Force the runner's decode path on (CPU) and count the rows it decodes per step."""
    runner = ModelRunner(engine.model, engine.config, engine.device, engine.max_model_len, device_decode=True)
    engine.runner = engine.scheduler.kv = runner
    sizes = []
    launch = runner.launch
    runner.launch = lambda batch: (sizes.append(len(batch.seqs)), launch(batch))[1]
    return sizes


def test_decode_path_equals_general_path(model):
    rng = random.Random(3)
    reqs = [GenerateRequest(f"r{i}", tuple(rng.randrange(3, 64) for _ in range(rng.randint(3, 40))),
                            SamplingOptions(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 5]),
                                            top_p=rng.choice([1.0, 0.8]), seed=i, n=rng.choice([1, 1, 2]),
                                            max_tokens=rng.randint(4, 14), ignore_eos=True))
            for i in range(7)]
    cfg = EngineConfig(max_num_batched_tokens=48, max_num_seqs=6, block_size=4, num_blocks=128)

    def run(engine):
        outs = run_to_completion(engine, reqs)
        return {rid: sorted((d.index, d.token_ids, d.logprobs, d.finish_reason) for d in ds) for rid, ds in outs.items()}

    general = run(Engine(model, cfg))
    fast = Engine(model, cfg)
    sizes = _device_decode(fast)
    assert run(fast) == general
    assert sum(sizes) > 20 and max(sizes) > 1 and len(set(sizes)) > 1     # batched decode steps of varied size


def test_decode_path_fails_a_row_without_a_distribution_alone(model, monkeypatch):
    """A row whose logits have no distribution (NaN) fails its request; its neighbours keep their bits."""
    reqs = [GenerateRequest(f"r{i}", (3 + i, 9, 11), SamplingOptions(seed=i, max_tokens=6, ignore_eos=True))
            for i in range(3)]
    cfg = EngineConfig(block_size=4, num_blocks=64)
    alone = {r.request_id: run_to_completion(Engine(model, cfg), [r])[r.request_id] for r in reqs}
    eng = Engine(model, cfg)
    sizes = _device_decode(eng)
    forward = eng.model.forward_tokens

    def poisoned(tokens, batch, cache, rows=None):
        logits = forward(tokens, batch, cache, rows)
        if rows is None and tokens.numel() > 1 and int(batch.positions[1]) == 5:
            logits[1] = float("nan")            # r1's row at its 3rd decode step
        return logits

    monkeypatch.setattr(eng.model, "forward_tokens", poisoned)
    outs = run_to_completion(eng, reqs)
    assert outs["r1"][-1].finish_reason == "error" and "no sampling distribution" in outs["r1"][-1].error
    for rid in ("r0", "r2"):
        assert [(d.token_ids, d.logprobs) for d in outs[rid]] == [(d.token_ids, d.logprobs) for d in alone[rid]]
    assert sizes and eng.kv_usage() == 0


def test_a_padding_only_step_writes_nothing_but_the_scratch_block(model):
    """What graph capture runs (all rows padding): it touches only the scratch block's KV."""
    cfg = EngineConfig(block_size=4, num_blocks=16, max_num_seqs=4)
    runner = ModelRunner(model, cfg, torch.device("cpu"), 64, device_decode=True)
    for t in (runner.cache.latent, runner.cache.rope, runner.cache.index_k):
        t.normal_()
    before = [t.clone() for t in (runner.cache.latent, runner.cache.rope, runner.cache.index_k)]
    runner._stage(None, None, 4, 16, 0)
    with torch.no_grad():
        out = runner._decode_step(4, 16, (True, True))
    assert out.shape == (3, 4) and bool((out[2] == 1).all())
    scratch = slice(16 * 4, 17 * 4)
    for old, new in zip(before, (runner.cache.latent, runner.cache.rope, runner.cache.index_k)):
        assert torch.equal(old[:, :scratch.start], new[:, :scratch.start])
        assert not torch.equal(old[:, scratch], new[:, scratch])


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.9), (5, 0.8)])
def test_host_filter_flags_give_the_same_draw(top_k, top_p):
    """sample(..., filters=...) reads nothing back; saying True where no row filters, or the
    exact flags, gives the same tokens and logprobs as reading the flags from the device."""
    from zerokl.kernels.sampling import SamplingParams, sample
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(6, 50, generator=g) * 3
    params = SamplingParams(temperature=torch.tensor([0.0, 1.0, 0.7, 1.0, 2.0, 1.0]),
                            top_k=torch.tensor([0, top_k, top_k, 0, top_k, 3]).clamp(max=top_k),
                            top_p=torch.tensor([1.0, top_p, 1.0, top_p, top_p, 1.0]),
                            seed=torch.arange(6), position=torch.arange(6) + 10)
    ref = sample(logits, params)
    exact = (top_k > 0 or top_p < 1.0, top_p < 1.0)
    for flags in (exact, (True, True)):
        got = sample(logits, params, flags)
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.logprobs, ref.logprobs)
        assert torch.equal(got.ok, ref.ok)
