"""CUDA graphs keep the bits: graph == eager, bucket-padded == unpadded, alone == batched,
overlapped decode == decode waited for; warm-up captures every decode graph and nothing
compiles after it.

GPU tier (skipped without CUDA). The model is `small`-shaped, bf16, with every layer dense
(MoE routing still synchronizes until it is made sync-free, and a step that synchronizes
is run eagerly: tested below too).
"""
import random

import pytest
import torch

import zerokl.kernels as K
from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

pytestmark = pytest.mark.gpu

SMALL = ModelConfig.preset("small").replace(num_hidden_layers=2, vocab_size=4096)
DENSE = SMALL.replace(first_k_dense_replace=SMALL.num_hidden_layers)


def _model(config: ModelConfig) -> Model:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return Model(config, seed=0, dtype=torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def dense():
    return _model(DENSE)


def _requests(n: int, seed: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(3, 4096) for _ in range(rng.randint(5, 40))),
                            SamplingOptions(temperature=rng.choice([0.0, 1.0, 0.8]), top_k=rng.choice([0, 0, 20]),
                                            top_p=rng.choice([1.0, 1.0, 0.9]), seed=i, max_tokens=rng.randint(8, 40),
                                            ignore_eos=True))
            for i in range(n)]


def _run(model, reqs, **cfg):
    cfg.setdefault("num_blocks", 512)
    cfg.setdefault("warm_up", False)
    with K.use_backend("triton"):
        eng = Engine(model, EngineConfig(**cfg))
        outs = run_to_completion(eng, reqs)
    res = {rid: ([t for d in ds for t in d.token_ids], torch.tensor([x for d in ds for x in d.logprobs]))
           for rid, ds in outs.items()}
    return res, eng


def _same(a, b):
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][0] == b[rid][0], rid
        assert torch.equal(a[rid][1], b[rid][1]), rid


def test_graph_equals_eager_bitwise(dense):
    reqs = _requests(12)
    graph, eng = _run(dense, reqs, max_num_seqs=16)
    assert eng.runner._capturable == {"triton": True} and len(eng.runner._graphs) >= 2
    eager, eng2 = _run(dense, reqs, max_num_seqs=16, cuda_graphs=False)
    assert not eng2.runner._graphs
    _same(graph, eager)


def test_bucket_padded_equals_unpadded(dense):
    """3 running samples: padded to a bucket of 4 (max_num_seqs 4) vs a bucket of exactly 3."""
    reqs = _requests(3, seed=1)
    padded, e4 = _run(dense, reqs, max_num_seqs=4)
    exact, e3 = _run(dense, reqs, max_num_seqs=3)
    assert any(k[0] == 4 for k in e4.runner._graphs) and any(k[0] == 3 for k in e3.runner._graphs)
    _same(padded, exact)


def test_every_request_alone_equals_inside_the_batch_with_graphs(dense):
    reqs = _requests(10, seed=2)
    batched, _ = _run(dense, reqs, max_num_seqs=16)
    for r in reqs:
        alone, eng = _run(dense, [r], max_num_seqs=16)
        assert eng.runner._graphs
        _same({r.request_id: batched[r.request_id]}, alone)


def test_decode_step_issues_no_sync(dense):
    """The device side of a decode step reads nothing back (what lets a graph hold it)."""
    with K.use_backend("triton"):
        eng = Engine(dense, EngineConfig(cuda_graphs=False, warm_up=False))
        run_to_completion(eng, _requests(4, seed=3))          # compiles kernels, caches tile tables
        key = (4, 64, (True, True))
        eng.runner._stage(None, None, 4, 64, 0)
        eng.runner._decode_step(*key)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eng.runner._decode_step(*key)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_moe_model_that_synchronizes_runs_eagerly_with_the_same_bits():
    """Until MoE routing is sync-free its decode step cannot be captured: the runner finds
    that out, runs it eagerly on the device path, and the bits equal the no-graph run."""
    moe = _model(SMALL)
    reqs = _requests(6, seed=4)
    graphs_on, eng = _run(moe, reqs, max_num_seqs=8)
    off, _ = _run(moe, reqs, max_num_seqs=8, cuda_graphs=False)
    _same(graphs_on, off)
    if eng.runner._capturable.get("triton") is False:
        assert not eng.runner._graphs


def test_overlapped_decode_with_graphs_equals_waiting_for_each_step(dense):
    """Step N+1 replayed before step N is read back, N's tokens handed over on the device:
    the same tokens and logprobs as a decode that waits, with neighbours of every length."""
    reqs = _requests(16, seed=5)
    overlapped, eng = _run(dense, reqs, max_num_seqs=16)
    assert eng.overlap and eng.runner._graphs
    waited, eng2 = _run(dense, reqs, max_num_seqs=16, overlap_decode=False)
    assert not eng2.overlap
    _same(overlapped, waited)


def test_warm_up_captures_every_decode_graph_and_nothing_compiles_after(dense):
    """EngineConfig(warm_up=True): every (bucket, key width, filters) graph is captured at
    start-up, and a mixed run (lengths, filters, batch sizes, prefill chunks) captures no graph
    and compiles no Triton kernel after it."""
    import triton
    compiled = []
    with K.use_backend("triton"):
        eng = Engine(dense, EngineConfig(num_blocks=512, max_num_seqs=8, max_model_len=300,
                                         max_num_batched_tokens=256, warm_up=True))
        runner = eng.runner
        assert len(runner._graphs) == len(runner.buckets) * len(runner.widths()) * 3
        graphs = set(runner._graphs)
        previous = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr"))
        try:
            reqs = _requests(12, seed=6)
            reqs += [GenerateRequest("long", tuple(range(3, 250)), SamplingOptions(max_tokens=40, top_p=0.9))]
            run_to_completion(eng, reqs)
        finally:
            triton.knobs.runtime.jit_post_compile_hook = previous
    assert set(runner._graphs) == graphs
    assert compiled == [], compiled[:5]
