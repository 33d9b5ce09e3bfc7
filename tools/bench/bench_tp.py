"""Tensor parallelism on GPUs with NCCL: equality across TP degrees and what the exact join costs.

    torchrun --nproc-per-node=2 tools/bench/bench_tp.py --out docs/bench     # any number of GPUs

Runs on any world size; the TP degrees checked are the supported ones (1, 2, 4) that fit.
Keep NVLink multicast off (this script sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 unless they are set).

1. Row-parallel bf16 linear (K = 7168, N = 4096) at several M: the cross-GPU join of the
   exact layout (each candidate checked torch.equal against the one-GPU ops.split_linear)
   timed against a plain bf16 all_reduce of the rounded partial products (the conventional
   join, whose bits are checked too) and, for information, torch symmetric memory's plain bf16
   one-shot sum (the p2p join's transport without the exactness). Times are medians of CUDA-event timings of the join
   alone, and of the whole layer, measured in the same run.
2. The `small` model (bf16, Triton backend, index_topk cut to 64 so the sparse indexer runs):
   full forward, chunked prefill, prefix-cache hit and decode logits and logprobs at every
   TP degree vs TP = 1 (computed on every rank by the unsharded model), torch.equal.
3. Decode throughput of the same Engine at TP = world, exact join vs plain all_reduce layout,
   batch 64, alternating, median.
"""
from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerokl.kernels as K  # noqa: E402
from zerokl.kernels import ops  # noqa: E402


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if DEV == "cuda" else "torch"


def cuda_time(fn, iters: int = 30, rounds: int = 5) -> float:
    """Seconds per call of fn in steady state: `rounds` timings of `iters` back-to-back calls
    (the ranks meet in each collective, so host skew enters only the first call), median,
    then the slowest rank's figure."""
    for _ in range(5):
        fn()
    ts = []
    for _ in range(rounds):
        dist.barrier()
        if DEV == "cpu":
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            ts.append((time.perf_counter() - t0) / 3)
            continue
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / iters)
    t = torch.tensor([statistics.median(ts)], device=DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def tp_groups(tp: int):
    """Every rank's TP group of size tp (consecutive ranks); new_group is called by all ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, tp):
        g = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            mine = g
    return mine


def bench_join(ms, n: int, k: int) -> list[dict]:
    from zerokl.kernels.model.parallel import p2p_join_available, row_parallel_join
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world
    group = dist.group.WORLD
    dt = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    w = torch.randn(n, k, device=DEV, dtype=dt, generator=g) * 0.02
    shard = slice(rank * k // tp, (rank + 1) * k // tp)
    w_local = w[:, shard].contiguous()
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=dt, generator=g)
        x_local = x[:, shard].contiguous()
        with K.use_backend(BACKEND):
            ref = ops.split_linear(x, w)                                   # one GPU, canonical
            part = ops.split_partial(x_local, w_local, ops.REDUCTION_SPLITS // tp)
            plain_part = ops.linear(x_local, w_local)
        res = {"M": m, "N": n, "K": k, "tp": tp}

        def plain():
            t = plain_part.clone()
            dist.all_reduce(t, group=group)
            return t

        joins = {"plain_all_reduce_bf16": plain}
        one_shot = _plain_one_shot(plain_part, group)
        if one_shot is not None:
            joins["plain_one_shot_bf16"] = one_shot
        for how in ("p2p", "gather", "gather_list", "all_reduce_fp32", "reduce_scatter"):
            if how == "p2p" and (DEV != "cuda" or not p2p_join_available(group)):
                continue
            if how == "all_reduce_fp32" and tp > 2:
                continue
            if how == "reduce_scatter" and (tp > 2 or (m * n) % tp):
                continue
            joins[how] = (lambda how=how: row_parallel_join(part, group, dt, how))
        for name, fn in joins.items():
            out = fn()
            res[f"{name}_equal_1gpu"] = bool(torch.equal(out, ref))
            res[f"{name}_us"] = cuda_time(fn) * 1e6

        def layer_plain():
            with K.use_backend(BACKEND):
                t = ops.linear(x_local, w_local)
            dist.all_reduce(t, group=group)
            return t

        def layer_exact():
            with K.use_backend(BACKEND):
                p = ops.split_partial(x_local, w_local, ops.REDUCTION_SPLITS // tp)
            return row_parallel_join(p, group, dt)

        res["layer_plain_us"] = cuda_time(layer_plain) * 1e6
        res["layer_exact_us"] = cuda_time(layer_exact) * 1e6
        res["default_join"] = "p2p" if "p2p" in joins else ("all_reduce_fp32" if tp == 2 else "gather")
        res["join_ratio"] = res[f"{res['default_join']}_us"] / res["plain_all_reduce_bf16_us"]
        if "plain_one_shot_bf16" in joins:
            res["join_ratio_vs_one_shot"] = res[f"{res['default_join']}_us"] / res["plain_one_shot_bf16_us"]
        exact = [j for j in joins if not j.startswith("plain") and res[f"{j}_equal_1gpu"]]
        res["best_exact_join"] = min(exact, key=lambda j: res[f"{j}_us"])
        res["best_join_ratio"] = res[f"{res['best_exact_join']}_us"] / res["plain_all_reduce_bf16_us"]
        res["layer_ratio"] = res["layer_exact_us"] / res["layer_plain_us"]
        rows.append(res)
        log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return rows


def _plain_one_shot(t: torch.Tensor, group):
    """The plain bf16 sum over the same transport as the p2p join (torch symmetric memory's
    one-shot all-reduce: each rank reads its peers' bf16 partials and adds them), for
    information: the fastest non-invariant join on the machine at small sizes. None where
    torch lacks it or the GPUs cannot map each other."""
    if DEV != "cuda" or not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(t.numel(), dtype=t.dtype, device=t.device)
        symm_mem.rendezvous(buf, group)
    except Exception as e:  # noqa: BLE001 - reported, the bench goes on without this arm
        log(f"no symmetric-memory one-shot all_reduce: {e}")
        return None

    def run():
        buf.copy_(t.view(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name).view(t.shape)
    return run


PRESET = "small"
JOIN = "auto"     # --join: the exact layout's join in the equality and decode runs


def small_config(topk: int):
    from zerokl.kernels.model import ModelConfig
    c = ModelConfig.preset(PRESET)
    return c.replace(index_topk=min(topk, c.index_topk), max_position_embeddings=min(1024, c.max_position_embeddings))


def equality(degrees, seed: int, topk: int) -> dict:
    from zerokl.kernels.model import Model
    from zerokl.kernels.model.parallel import apply_tensor_parallel
    from zerokl.kernels.model.verify import sharded_outputs
    cfg = small_config(topk)
    out = {}
    with K.use_backend(BACKEND):
        ref = sharded_outputs(Model(cfg, seed=seed, dtype=torch.bfloat16).to(DEV).eval(), seed, prompts=2)
        for tp in degrees:
            if tp == 1:
                continue
            group = tp_groups(tp)
            for mode in ("exact", "all_reduce"):
                model = Model(cfg, seed=seed, dtype=torch.bfloat16).to(DEV).eval()
                apply_tensor_parallel(model, group, mode=mode, join=JOIN)
                got = sharded_outputs(model, seed, prompts=2)
                differ = sorted(k for k in ref if not torch.equal(got[k], ref[k]))
                ok = torch.tensor([0 if differ else 1], device=DEV)
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                out[f"tp{tp}/{mode}"] = {"keys": len(ref), "differ_on_this_rank": differ,
                                         "all_ranks_equal": bool(ok.item())}
                log(f"TP={tp} {mode}: {len(ref)} logits/logprobs tensors; all ranks == TP1: {bool(ok.item())}; "
                    f"rank0 differs in {len(differ)}")
                del model
    return out


def decode_bench(batch: int, max_tokens: int, repeats: int) -> dict:
    from tools_bench_e2e import make_requests, run_engine  # noqa: F401 (path set in main)
    from zerokl.kernels.model import Model, ModelConfig
    from zerokl.kernels.model.parallel import apply_tensor_parallel
    cfg = ModelConfig.preset(PRESET)
    models = {}
    arms = [("exact", None), ("all_reduce", None)] + ([("exact", "all_reduce_fp32")] if dist.get_world_size() == 2 else [])
    for mode, join in arms:
        models[mode + (f"+{join}" if join else "")] = apply_tensor_parallel(
            Model(cfg, seed=0, dtype=torch.bfloat16).to(DEV).eval(), mode=mode, join=join or JOIN)
    reqs = make_requests(batch, max_tokens, cfg.vocab_size)
    for mode in models:
        run_engine(models[mode], reqs[:4], BACKEND, 2048)
    rates = {m: [] for m in models}
    toks = {}
    for _ in range(repeats):
        for mode, model in models.items():
            dist.barrier()
            dt, n, _, o = run_engine(model, reqs, BACKEND, 2048)
            rates[mode].append(n / dt)
            toks[mode] = o
    same = all(toks[m] == toks["exact"] for m in toks if m.startswith("exact"))
    med = {m: statistics.median(v) for m, v in rates.items()}
    res = {"batch": batch, "max_tokens": max_tokens, "decode_tok_s": med, "all": rates,
           "ratio": med["exact"] / med["all_reduce"], "exact_joins_same_tokens": same}
    log(f"decode TP={dist.get_world_size()} batch {batch}: " + ", ".join(f"{m} {v:.0f} tok/s" for m, v in med.items())
        + f"; exact/plain {res['ratio']:.3f}; exact joins give the same tokens+logprobs: {same}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,64,512,2048")
    ap.add_argument("--join-n", type=int, default=4096)
    ap.add_argument("--join-k", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list: join,equality,decode")
    ap.add_argument("--preset", default="small", help="model preset for equality and decode (tiny for a CPU smoke run)")
    ap.add_argument("--join", default="auto", help="the exact layout's join for equality and decode (row_parallel_join)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global PRESET, JOIN
    PRESET, JOIN = args.preset, args.join
    rank = int(os.environ.get("RANK", 0))
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import bench_e2e
    sys.modules["tools_bench_e2e"] = bench_e2e
    world = dist.get_world_size()
    from zerokl.kernels.model.parallel import JOINS, supported_tp_degrees
    if JOIN not in JOINS:
        ap.error(f"--join must be one of {JOINS}")
    degrees = [d for d in supported_tp_degrees() if d <= world and world % d == 0]
    stamp = {"date": str(datetime.date.today()), "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
             "world": world,
             "degrees": degrees, "commit": os.environ.get("ZEROKL_COMMIT") or subprocess.run(
                 ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
             "numerics": K.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if DEV == "cuda" else None,
             "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    log(stamp)
    res = {"stamp": stamp}
    skip = set(args.skip.split(","))
    if "join" not in skip and world > 1 and world in supported_tp_degrees():
        res["join"] = bench_join([int(m) for m in args.ms.split(",")], args.join_n, args.join_k)
    if "equality" not in skip:
        res["equality"] = equality(degrees, 7, args.topk)
    if "decode" not in skip and world > 1 and world in supported_tp_degrees():
        res["decode"] = decode_bench(args.batch, args.max_tokens, args.repeats)
    ok = all(v["all_ranks_equal"] for k, v in res.get("equality", {}).items() if k.endswith("/exact"))
    ok &= all(r[f"{r['default_join']}_equal_1gpu"] for r in res.get("join", []))
    res["exact_everywhere"] = ok
    log(f"exact layout == TP1 everywhere: {ok}")
    if args.out and rank == 0:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"bench-tp{world}-{K.device_name()}"
        (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
        if "join" in res:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(6, 3.4))
            ms = [r["M"] for r in res["join"]]
            for key, lab in (("plain_all_reduce_bf16_us", "plain bf16 all_reduce (differs from 1 GPU)"),
                             ("plain_one_shot_bf16_us", "plain bf16 one-shot p2p sum (differs)"),
                             ("p2p_us", "exact: p2p, peers' fp32 subtrees read in place + tree kernel"),
                             ("gather_us", "exact: fp32 all_gather_into_tensor + tree kernel"),
                             ("gather_list_us", "exact: fp32 list all_gather + torch adds"),
                             ("all_reduce_fp32_us", "exact: fp32 all_reduce (2 ranks)"),
                             ("reduce_scatter_us", "exact: fp32 reduce_scatter + bf16 all_gather")):
                if key in res["join"][0]:
                    ax.plot(ms, [r[key] for r in res["join"]], marker="o", label=lab)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("M (tokens)")
            ax.set_ylabel("join time (us)")
            ax.set_title(f"TP={world} row-parallel join, N={args.join_n} K={args.join_k} bf16 · {stamp['device']} · "
                         f"{stamp['commit']} · {stamp['date']}", fontsize=7)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / f"{tag}.png", dpi=120)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
