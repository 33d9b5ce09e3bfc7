"""Tensor parallelism, exact: TP = 1, 2 and 4 give identical logits and logprobs.

CPU processes joined by gloo on 127.0.0.1 (torch.multiprocessing spawn), torch backend.
Each TP group runs one fixed workload (zerokl.kernels.model.verify.sharded_outputs): a trainer-style
batched full forward, and prompts below and above index_topk through full forward, chunked
prefill, a prefix-cache hit and decode, among random neighbour sequences in a shuffled paged
cache. Every rank's result must equal the single-process (TP = 1) result bit for bit, in
fp32 and bf16. The conventional plain all_reduce layout must NOT (so this test can fail).
The exact layout also trains: its gradients (the joins' transposes) are the single
process's up to the order of the sums.
"""
import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerokl.kernels import ops, use_backend
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.parallel import MODES, apply_tensor_parallel, supported_tp_degrees
from zerokl.kernels.model.verify import sharded_outputs

# The tiny preset at its smallest shapes that still run every path: a dense and a MoE block,
# prompts below and above index_topk (dense and sparse attention rows), decode steps of a few
# dozen tokens instead of a hundred (the workload's cost is its decode steps times layers).
TINY = ModelConfig.preset("tiny").replace(num_hidden_layers=2, index_topk=8, max_position_embeddings=64)
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
        out.update(_gradients(model(torch.float32)))
    return out


# Parameters whose gradients are compared: replicated ones (every rank holds the full gradient)
# and sharded ones (rank r holds slice r along `dim`; lm_head's last shard is padded).
GRADIENTS = {"embed_tokens.weight": None, "layers.1.self_attn.q_a_proj.weight": None,
             "layers.1.self_attn.kv_a_proj_with_mqa.weight": None, "layers.1.self_attn.kv_a_layernorm.weight": None,
             "layers.1.mlp.gate.weight": None, "layers.1.self_attn.q_b_proj.weight": 0,
             "layers.1.self_attn.kv_b_proj.weight": 0, "layers.1.self_attn.o_proj.weight": 1,
             "layers.0.mlp.down_proj.weight": 1, "layers.1.mlp.gate_proj": 0,
             "layers.1.mlp.shared_experts.up_proj.weight": 0, "lm_head.weight": 0}


def _gradients(m: Model) -> dict[str, torch.Tensor]:
    """Logits of a training batch and the gradients of a token-level loss through them."""
    for p in m.parameters():
        p.requires_grad_(True)
    tokens = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(SEED))
    logits = m(tokens)
    loss = ops.log_softmax(logits.reshape(-1, TINY.vocab_size)).gather(1, tokens.reshape(-1, 1)).sum()
    loss.backward()
    params = dict(m.named_parameters())
    return {"train/logits": logits.detach(), **{f"grad/{k}": params[k].grad.detach().clone() for k in GRADIENTS}}


def _worker(rank: int, ports: dict[int, int], out_dir: str) -> None:
    """One process of the spawned group: rank `rank` of TP = 4, then (ranks 0 and 1) of TP = 2
    in a new default group (the same processes: no second start-up)."""
    torch.set_num_threads(1)      # world processes share the CI machine's cores
    for world in sorted(ports, reverse=True):
        if rank >= world:
            break
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[world]}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        try:
            torch.save(_workload(sharded=True), os.path.join(out_dir, f"tp{world}-rank{rank}.pt"))
        finally:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict[str, torch.Tensor]]]:
    """{tp: [rank 0 results, rank 1 results, ...]}, with tp = 1 computed in this process and
    every TP > 1 degree by one spawned group of max(DEGREES) processes."""
    out = {1: [_workload(sharded=False)]}
    d = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=({w: _free_port() for w in DEGREES}, str(d)), nprocs=max(DEGREES), join=True)
    for world in DEGREES:
        out[world] = [torch.load(d / f"tp{world}-rank{r}.pt") for r in range(world)]
    return out


def _exact_keys(results: dict) -> list[str]:
    return sorted(k for k in results if not k.startswith(("all_reduce/", "grad/")))


@pytest.mark.parametrize("tp", DEGREES)
def test_every_rank_matches_tp1_bitwise(runs, tp):
    reference = runs[1][0]
    keys = _exact_keys(reference)
    assert len(keys) == 37 and any("decode" in k for k in keys) and any("chunked_prefill" in k for k in keys)
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
    from zerokl.kernels.model.parallel import _check
    assert supported_tp_degrees() == (1, 2, 4)
    with pytest.raises(ValueError, match="does not divide REDUCTION_SPLITS"):
        _check(_model(torch.float32), 3, "exact")
    with pytest.raises(ValueError, match="num_attention_heads = 2 is not divisible"):
        _check(Model(TINY.replace(num_attention_heads=2), seed=0), 4, "exact")
    with pytest.raises(ValueError, match="mode must be one of"):
        _check(_model(torch.float32), 2, "fast")
    assert MODES == ("exact", "all_reduce")


@pytest.mark.parametrize("tp", DEGREES)
def test_tensor_parallel_backward_matches_one_device(runs, tp):
    """Every rank's gradients of replicated weights, and the ranks' shards of sharded ones put
    together, equal TP = 1's up to the order of the sums (the forward is bitwise: train/logits)."""
    reference = runs[1][0]
    for name, dim in GRADIENTS.items():
        want = reference[f"grad/{name}"]
        if dim is None:
            got = [r[f"grad/{name}"] for r in runs[tp]]
        else:
            got = [torch.cat([r[f"grad/{name}"] for r in runs[tp]], dim).narrow(dim, 0, want.shape[dim])]
        for g in got:
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=name)
