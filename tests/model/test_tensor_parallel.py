"""Tensor parallelism, exact: TP = 1, 2 and 4 give identical logits and logprobs.

CPU processes joined by gloo on 127.0.0.1 (torch.multiprocessing spawn), torch backend.
Each TP group runs one fixed workload (zerokl.model.verify.sharded_outputs): a trainer-style
batched full forward, and prompts below and above index_topk through full forward, chunked
prefill, a prefix-cache hit and decode, among random neighbour sequences in a shuffled paged
cache. Every rank's result must equal the single-process (TP = 1) result bit for bit, in
fp32 and bf16. The conventional plain all_reduce layout must NOT (so this test can fail).
"""
import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerokl.kernels import ops, use_backend
from zerokl.model import Model, ModelConfig
from zerokl.model.parallel import MODES, apply_tensor_parallel, supported_tp_degrees
from zerokl.model.verify import sharded_outputs

TINY = ModelConfig.preset("tiny")
SEED = 5
DEGREES = (2, 4)


def _model(dtype: torch.dtype) -> Model:
    m = Model(TINY, seed=SEED, dtype=dtype).eval()
    with torch.no_grad():    # a non-zero correction bias: selection-only bias is exercised
        for layer in m.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(
                    torch.randn(TINY.n_routed_experts, generator=torch.Generator().manual_seed(1)) * 0.01)
    return m


def _workload(sharded: bool) -> dict[str, torch.Tensor]:
    """The same work at any TP degree; sharded=False is the single-process reference."""
    def model(dtype, mode="exact"):
        m = _model(dtype)
        return apply_tensor_parallel(m, mode=mode) if sharded else m

    out = {}
    with use_backend("torch"):
        out.update({f"fp32/{k}": v for k, v in sharded_outputs(model(torch.float32), SEED, prompts=2).items()})
        out.update({f"bf16/{k}": v for k, v in sharded_outputs(model(torch.bfloat16), SEED + 1, prompts=2,
                                                                neighbours=1).items()})
        # The conventional layout (same shards, partial sums joined by dist.all_reduce); at
        # TP = 1 there is nothing to reduce, so the reference is the single-device model.
        for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
            out.update({f"all_reduce/{name}/{k}": v for k, v in
                        sharded_outputs(model(dtype, "all_reduce"), SEED, prompts=0).items()})
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)      # world processes share the CI machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.save(_workload(sharded=True), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict[str, torch.Tensor]]]:
    """{tp: [rank 0 results, rank 1 results, ...]}, with tp = 1 computed in this process."""
    out = {1: [_workload(sharded=False)]}
    for world in DEGREES:
        d = tmp_path_factory.mktemp(f"tp{world}")
        mp.spawn(_worker, args=(world, _free_port(), str(d)), nprocs=world, join=True)
        out[world] = [torch.load(d / f"rank{r}.pt") for r in range(world)]
    return out


def _exact_keys(results: dict) -> list[str]:
    return sorted(k for k in results if not k.startswith("all_reduce/"))


@pytest.mark.parametrize("tp", DEGREES)
def test_every_rank_matches_tp1_bitwise(runs, tp):
    reference = runs[1][0]
    keys = _exact_keys(reference)
    assert len(keys) == 36 and any("decode" in k for k in keys) and any("chunked_prefill" in k for k in keys)
    for rank, got in enumerate(runs[tp]):
        assert _exact_keys(got) == keys
        differ = [k for k in keys if not torch.equal(got[k], reference[k])]
        assert not differ, f"TP={tp} rank {rank}: bits differ from TP=1 for {differ}"


@pytest.mark.parametrize("tp", DEGREES)
def test_paths_agree_within_a_tp_group(runs, tp):
    got = runs[tp][0]
    for key in _exact_keys(got):
        if "prompt" in key and "/full" not in key:
            full = key.replace("chunked_prefill", "full").replace("prefix_hit", "full").replace("decode", "full")
            assert torch.equal(got[key], got[full]), key


@pytest.mark.parametrize("tp", DEGREES)
def test_plain_all_reduce_changes_bits(runs, tp):
    """The guard works: joining partial sums with dist.all_reduce is not the single-device
    order, and the comparison sees it (in fp32 and bf16)."""
    reference, got = runs[1][0], runs[tp][0]
    for dtype in ("fp32", "bf16"):
        key = f"all_reduce/{dtype}/batch/full"
        assert not torch.equal(got[key], reference[key]), f"plain all_reduce at TP={tp} ({dtype}) matched TP=1"
    # ... yet it is the same model: only the order of additions differs. (In bf16 a changed
    # rounding can flip a router or indexer choice, so only fp32 is compared for closeness.)
    key = "all_reduce/fp32/batch/full"
    torch.testing.assert_close(got[key], reference[key], rtol=1e-4, atol=1e-4)


def test_split_linear_partials_join_to_the_single_device_bits():
    """The algebra the ranks rely on, in one process, on both backends: each rank's fp32
    subtree over its K shard, joined by the same tree, is split_linear's exact result."""
    g = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for backend in ("torch", "triton"):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(7, 96, generator=g).to(dev, dtype)
            w = (torch.randn(40, 96, generator=g) * 0.1).to(dev, dtype)
            b = torch.randn(40, generator=g).to(dev)
            with use_backend(backend):
                one = ops.split_linear(x, w, b)
                assert one.dtype == dtype
                for tp in supported_tp_degrees():
                    k = 96 // tp
                    parts = [ops.split_partial(x[:, r * k:(r + 1) * k], w[:, r * k:(r + 1) * k],
                                               ops.REDUCTION_SPLITS // tp) for r in range(tp)]
                    assert torch.equal(ops.split_combine(parts, b, dtype), one), (backend, dtype, tp)


def test_unsupported_layouts_are_refused():
    from zerokl.model.parallel import _check
    assert supported_tp_degrees() == (1, 2, 4)
    with pytest.raises(ValueError, match="does not divide REDUCTION_SPLITS"):
        _check(_model(torch.float32), 3, "exact")
    with pytest.raises(ValueError, match="num_attention_heads = 2 is not divisible"):
        _check(Model(TINY.replace(num_attention_heads=2), seed=0), 4, "exact")
    with pytest.raises(ValueError, match="mode must be one of"):
        _check(_model(torch.float32), 2, "fast")
    assert MODES == ("exact", "all_reduce")
