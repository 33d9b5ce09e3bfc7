"""Long contexts on the GPU (issue 33): prompts of 4-5k tokens, where the DSA indexer's top-k
(512 for `small`) picks a strict subset of the keys, keep every request's bits under what a busy
server changes: neighbours and batch size, chunked prefill at other boundaries, arrival times,
prefix-cache hits, the row a request lands in; and the trainer recomputes the engine's logprobs
exactly (KL == 0.0) at those lengths.

GPU tier (skipped without CUDA). `small`'s widths with 2 layers (one dense, one MoE) and a 4k
vocabulary, bf16, Triton backend, CUDA graphs on.
"""
import random

import pytest
import torch

import zerokl.kernels as K
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion, SamplingOptions

pytestmark = pytest.mark.gpu

CONFIG = ModelConfig.preset("small").replace(num_hidden_layers=2, vocab_size=4096)
PROMPT_LENGTHS = (4_100, 4_900)          # > 8 x index_topk: the sparse rows select 512 of 4-5k keys
NEW_TOKENS = 24
SHARED_PREFIX = 4_096                    # tokens the prefix-cache test's requests share (256 blocks)
# (temperature, top_k, top_p): every sampling mode in flight at once
MODES = [(1.0, 0, 1.0), (0.0, 0, 1.0), (1.0, 20, 1.0), (0.8, 0, 0.9), (1.0, 20, 0.95)]


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert CONFIG.index_topk * 8 < PROMPT_LENGTHS[0] <= CONFIG.max_position_embeddings - NEW_TOKENS
    return Model(CONFIG, seed=0, dtype=torch.bfloat16).cuda().eval()


def _requests(n: int, seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        temperature, top_k, top_p = MODES[i % len(MODES)]
        prompt = tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(*PROMPT_LENGTHS)))
        out.append(GenerateRequest(f"r{i}", prompt, SamplingOptions(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=100 + i, max_tokens=NEW_TOKENS,
            ignore_eos=True)))
    return out


def _engine(model, **cfg) -> Engine:
    cfg.setdefault("num_blocks", 3_000)                  # 16-token blocks: 48k tokens of KV
    cfg.setdefault("max_num_seqs", 16)
    cfg.setdefault("warm_up", False)
    return Engine(model, EngineConfig(**cfg))


def _collect(outs) -> dict:
    return {rid: ([t for d in ds for t in d.token_ids], torch.tensor([x for d in ds for x in d.logprobs]))
            for rid, ds in outs.items()}


def _same(got: dict, want: dict, what: str) -> None:
    for rid, (tokens, logprobs) in got.items():
        assert tokens == want[rid][0], f"{what}: {rid}'s tokens differ"
        assert torch.equal(logprobs, want[rid][1]), f"{what}: {rid}'s logprobs differ"


def _staggered(engine: Engine, requests: list[GenerateRequest], every: int) -> dict:
    """One request added every ``every`` engine steps (arrivals while others prefill and decode)."""
    pending, outs, step = list(requests), {r.request_id: [] for r in requests}, 0
    while pending or engine.has_work():
        if pending and step % every == 0:
            engine.add_request(pending.pop(0))
        for d in engine.step():
            outs[d.request_id].append(d)
        step += 1
    return _collect(outs)


def test_long_prompts_alone_equal_every_batching(model):
    requests = _requests(6, seed=0)
    with K.use_backend("triton"):
        alone = {}
        for r in requests:                                # the whole prompt in one prefill chunk, no neighbour
            alone.update(_collect(run_to_completion(_engine(model, max_num_batched_tokens=8_192,
                                                            enable_prefix_caching=False), [r])))
        # every request at once, prefill chunked at 1,000 tokens (boundaries mid-block and mid-prompt)
        _same(_collect(run_to_completion(_engine(model, max_num_batched_tokens=1_000), requests)), alone,
              "batched, chunks of 1,000")
        # reversed order (other rows, other neighbours), chunks of 3,072
        _same(_collect(run_to_completion(_engine(model, max_num_batched_tokens=3_072), requests[::-1])), alone,
              "reversed, chunks of 3,072")
        # arrivals spread over the run: each joins a batch already prefilling and decoding
        _same(_staggered(_engine(model, max_num_batched_tokens=2_048), requests, every=3), alone, "staggered")


def test_long_prefix_cache_hits_keep_the_bits(model):
    """Requests sharing a 4,096-token prefix: the later ones find it cached (a hit at a block
    boundary past the indexer's top-k), and every result equals the request alone, uncached."""
    rng = random.Random(1)
    prefix = tuple(rng.randrange(3, CONFIG.vocab_size) for _ in range(SHARED_PREFIX))
    requests = [GenerateRequest(f"p{i}", prefix + tuple(rng.randrange(3, CONFIG.vocab_size)
                                                        for _ in range(rng.randint(1, 300))),
                                SamplingOptions(temperature=1.0, seed=200 + i, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
                for i in range(4)]
    with K.use_backend("triton"):
        alone = {}
        for r in requests:
            alone.update(_collect(run_to_completion(_engine(model, max_num_batched_tokens=8_192,
                                                            enable_prefix_caching=False), [r])))
        engine = _engine(model, max_num_batched_tokens=2_048)
        first = _collect(run_to_completion(engine, requests[:1]))
        rest = _collect(run_to_completion(engine, requests[1:]))
        assert engine.stats["cached_tokens"] >= 3 * SHARED_PREFIX      # each later request hit the whole prefix
        _same({**first, **rest}, alone, "prefix-cache hits")


def test_trainer_recomputes_long_context_logprobs_exactly(model):
    """KL == 0.0 at 4-5k tokens: the trainer's forward over prompt + completion gives the engine's
    sampled logprobs bit for bit, whether the completions are scored together or one at a time."""
    requests = _requests(5, seed=2)
    with K.use_backend("triton"):
        trainer = Trainer(Model(CONFIG, seed=0, dtype=torch.bfloat16).cuda())
        outs = _collect(run_to_completion(_engine(trainer.serving_model(), max_num_batched_tokens=2_048), requests))
        completions = [Completion(r.prompt_ids, tuple(outs[r.request_id][0]), *MODES[i % len(MODES)])
                       for i, r in enumerate(requests)]
        together = trainer.forward_logprobs(completions)
        alone = [trainer.forward_logprobs([c])[0] for c in completions]
    for r, both, one in zip(requests, together, alone):
        sampled = outs[r.request_id][1]
        assert torch.equal(both, sampled) and torch.equal(one, sampled), r.request_id
        assert float((sampled - both).mean()) == 0.0
