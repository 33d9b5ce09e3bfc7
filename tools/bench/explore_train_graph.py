"""Exploration (issue 34): where `small`'s 8 x 512 training step goes on the GPU, and what a
CUDA-graph-captured forward + backward gives. Not a product benchmark: bench_train.py is.

    python tools/bench/explore_train_graph.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, "tools/bench")
from bench_train import _tokens, build_model, hf_model, hf_step  # noqa: E402

from zerokl.kernels import sampling  # noqa: E402
from zerokl.kernels.logprob import fused_logprobs  # noqa: E402
from zerokl.kernels.model import ModelConfig  # noqa: E402
from zerokl.kernels.model.model import AttentionBatch  # noqa: E402
from zerokl.services.trainer.trainer import TrainConfig, Trainer  # noqa: E402
from zerokl.vocab import Completion  # noqa: E402


DEV = "cuda"


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, n=5, warm=2):
    for _ in range(warm):
        fn()
    _sync()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2]


def profile(fn, label, out):
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    _sync()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.device_time for e in kernels) / 1e6  # us -> s
    out[label] = {"wall_s": wall, "kernels": len(kernels), "gpu_kernel_s": gpu, "busy": gpu / wall}
    print(label, out[label], flush=True)
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    out = {}
    cfg = ModelConfig.preset(args.preset)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    model = build_model(cfg, DEV, dt)
    trainer = Trainer(model, TrainConfig(master_weights=False))
    ids = _tokens(cfg, args.batch, args.seq, DEV)
    tokens = args.batch * (args.seq - 1)
    seqs = [Completion((row[0],), tuple(row[1:])) for row in ids.tolist()]

    def product():
        trainer.forward_backward("sft", seqs)
        trainer.optimizer.zero_grad(set_to_none=True)

    s = timed(product)
    out["product_step_s"] = s
    out["product_tok_s"] = tokens / s
    print("product", s, tokens / s, flush=True)
    profile(product, "product_profile", out)

    # Lean: the same math on a prepared batch, no host reads (filters known, targets flat).
    batch = trainer.batch_of(seqs)
    targets = batch.targets[batch.mask > 0].clone()
    n_tok = targets.shape[0]
    orig = sampling._distribution
    sampling._distribution = lambda z, params, filters=None: orig(z, params, (False, False))
    b, sq = batch.input_ids.shape
    layout = AttentionBatch.for_sequences(b, sq, DEV)
    flat_ids = batch.input_ids.reshape(-1).clone()

    def fb():
        hidden = model.hidden_states(flat_ids, layout)[batch.rows]
        head = lambda x: model.lm_head(model.norm(x))  # noqa: E731
        weights = [*model.norm.parameters(), *model.lm_head.parameters()]
        lp = fused_logprobs(hidden, head, weights, targets, batch.params, 4096)
        loss = -lp.sum() / n_tok
        loss.backward()
        return loss

    def lean():
        fb()
        trainer.optimizer.zero_grad(set_to_none=True)

    s = timed(lean)
    out["lean_step_s"] = s
    out["lean_tok_s"] = tokens / s
    print("lean", s, tokens / s, flush=True)
    profile(lean, "lean_profile", out)

    # Eager reference grads
    trainer.optimizer.zero_grad(set_to_none=True)
    loss_e = fb().detach().clone()
    grads_e = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    trainer.optimizer.zero_grad(set_to_none=True)

    # Graph capture
    try:
        if DEV != "cuda":
            raise RuntimeError("no CUDA")
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for _ in range(3):
                fb()
                trainer.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        trainer.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.cuda.graph(g):
            static_loss = fb()
        out["capture_s"] = time.perf_counter() - t0
        params = [p for p in model.parameters() if p.grad is not None]

        def replay():
            g.replay()

        replay()
        _sync()
        out["graph_loss_equal"] = bool(torch.equal(static_loss, loss_e))
        grads_g = [p.grad for p in params]
        out["graph_grads_equal"] = len(grads_g) == len(grads_e) and all(
            torch.equal(a, b) for a, b in zip(grads_g, grads_e))
        s = timed(replay)
        out["graph_step_s"] = s
        out["graph_tok_s"] = tokens / s
        print("graph", out, flush=True)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        out["graph_error"] = repr(e)[:500]
    sampling._distribution = orig

    del trainer, model
    if DEV == "cuda":
        torch.cuda.empty_cache()
    hf, note = hf_model(cfg, DEV, dt)
    if hf is not None:
        step = hf_step(hf, ids)
        s = timed(step)
        out["hf_step_s"] = s
        out["hf_tok_s"] = tokens / s
        out["hf_note"] = note
        profile(step, "hf_profile", out)
    print(json.dumps(out, indent=1), flush=True)
    if args.json:
        open(args.json, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
