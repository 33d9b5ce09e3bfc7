"""The distributed trainer (FSDP2 x TP x EP on gloo) against the one-process trainer and the engine.

One spawned group of 4 processes (`python this_file RANK PORT4 PORT2 OUT`) runs every layout
of world 4 in turn, then its ranks 0 and 1 form a world of 2 and run those layouts; each
writes what it saw to OUT, the tests read it.
Per layout: forward logprobs torch.equal to the one-process trainer's and to the inference
engine's behaviour logprobs; a GRPO step on engine-sampled rollouts (on-policy: KL exactly 0)
then an SFT step, whose updated weights equal the one-process updates within UPDATE_ATOL (the
gradient sums run in another order: docs/scale.md). A sharded (DCP) checkpoint saved by the
world-4 run at one layout is loaded by the world-2 run at its layouts, with the same bits.

Layouts, each for a path no other covers: dp2 (FSDP over blocks holding the experts), tp2 (the
TP backward, experts split over TP), dp2 x ep2 (all-to-all dispatch, experts outside FSDP),
dp2 x tp2 x ep2 (dispatch with each EP rank's experts split over TP, FSDP over TP shards),
dp4 x ep2 (four-way FSDP; the experts' dp / ep replicas all-reduce their gradients). The
dp2 x tp2 x ep2 trainer also recomputes its blocks' activations in the backward (activation
checkpointing inside FSDP units); the one-process reference does not.
The model is the tiny preset cut to its smallest shapes that still run every path: one dense
and one MoE block, index_topk below the sequence lengths (the sparse attention rows).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from conftest import below_16, engine_rollouts

# |one-process update - distributed update| per weight, at lr 1e-3 (AdamW's first steps move a
# weight by about lr): measured max 2.1e-6 over these layouts; the bound leaves 20x (docs/scale.md).
UPDATE_ATOL = 5e-5

LAYOUTS = {2: [(2, 1, 1), (1, 2, 1), (2, 1, 2)], 4: [(2, 2, 2), (4, 1, 2)]}
SAVE_LAYOUT = (2, 2, 2)            # world 4 saves here; world 2 loads at each of its layouts
CHECKPOINTED = {(2, 2, 2)}         # layouts whose trainer recomputes block activations in the backward
GROUP = 4                          # engine samples per prompt (the GRPO group)
PROMPTS = [tuple(range(5 + i, 15 + 2 * i)) for i in range(2)]   # what the engine samples GROUP completions of


def _config():
    from zerokl.kernels.model import ModelConfig
    # Sequences of 9-21 tokens against index_topk = 8: dense and sparse attention rows.
    return ModelConfig.preset("tiny").replace(num_hidden_layers=2, index_topk=8, max_position_embeddings=64)


def _model():
    from zerokl.kernels.model import Model
    return Model(_config(), seed=0)


def _data():
    from zerokl.vocab import Completion
    g = torch.Generator().manual_seed(7)
    seqs = []
    for i in range(4):                      # uneven lengths: the ranks' shares of tokens differ
        p = torch.randint(3, 64, (6 + 2 * i,), generator=g).tolist()
        c = torch.randint(3, 64, (3 + 3 * (i % 2) + i,), generator=g).tolist()
        seqs.append(Completion(tuple(p), tuple(c)))
    return seqs


def _trainer(activation_checkpointing: bool = False):
    from zerokl.services.trainer.config import TrainConfig
    from zerokl.services.trainer.trainer import Trainer
    return Trainer(_model(), TrainConfig(lr=1e-3, activation_checkpointing=activation_checkpointing))


def _run(t, seqs, rollouts) -> dict:
    """The workload, on a Trainer or a DistributedTrainer (`full` gathers the weights)."""
    full = getattr(t, "full_state_dict", None) or (lambda: {k: v.clone() for k, v in t.model.state_dict().items()})
    out = {"lp0": t.forward_logprobs(seqs), "lp_engine": t.forward_logprobs([r.sequence for r in rollouts])}
    out["grpo"] = t.grpo_step(rollouts, group_size=GROUP)     # on-policy: the engine sampled these weights
    out["w1"] = full()
    out["sft"] = t.sft_step(seqs)
    out["w2"] = full()
    out["lp2"] = t.forward_logprobs(seqs)
    return out


def _run_world(world: int, rank: int, port: int, out: str, seqs, rollouts) -> dict:
    """Every layout of `world` ranks in turn; world 4 saves a sharded checkpoint at SAVE_LAYOUT,
    world 2 then loads it at each of its layouts."""
    import torch.distributed as dist
    from zerokl.services.trainer.checkpointing import load_sharded, save_sharded
    from zerokl.services.trainer.distributed import DistributedTrainer, Layout, ParallelGroup
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ckpt, results = os.path.join(out, "ckpt"), {}
    for layout in LAYOUTS[world]:
        dt = DistributedTrainer(_trainer(layout in CHECKPOINTED), ParallelGroup(Layout(*layout), torch.device("cpu")))
        results[layout] = r = _run(dt, seqs, rollouts)
        if world == 4 and layout == SAVE_LAYOUT:
            save_sharded(dt, ckpt)
            r["opt"] = dt.full_optimizer_state()
    if world == 2:
        for layout in LAYOUTS[2]:
            dt = DistributedTrainer(_trainer(), ParallelGroup(Layout(*layout), torch.device("cpu")))
            load_sharded(dt, ckpt)
            results[("loaded", *layout)] = {"lp": dt.forward_logprobs(seqs), "w": dt.full_state_dict(),
                                            "opt": dt.full_optimizer_state(), "step": dt.step}
    dist.destroy_process_group()
    return results


def worker(rank: int, port4: int, port2: int, out: str) -> None:
    """One process of the spawned group: rank `rank` of the world-4 run, then (ranks 0 and 1)
    of a world-2 run in the same process (a new default group: no second start-up)."""
    torch.set_num_threads(1)
    seqs, rollouts = _data(), torch.load(os.path.join(out, "rollouts.pt"), weights_only=False)
    results = {4: _run_world(4, rank, port4, out, seqs, rollouts)}
    if rank < 2:
        results[2] = _run_world(2, rank, port2, out, seqs, rollouts)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rollouts():
    """Sampled by the inference engine (TP = 1) on the layouts' initial weights: real behaviour logprobs."""
    return engine_rollouts(_model(), PROMPTS, below_16, n=GROUP, seed=3)


@pytest.fixture(scope="module")
def runs(rollouts):
    """{world: [rank 0's results, rank 1's, ...]} from one spawned group of 4 processes."""
    with tempfile.TemporaryDirectory(prefix="zerokl-dist-") as out:
        torch.save(rollouts, os.path.join(out, "rollouts.pt"))
        ports = [str(_free_port()), str(_free_port())]
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, str(r), *ports, out], env=env) for r in range(4)]
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert codes == [0] * 4, f"ranks exited with {codes}"
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(4)]
    yield {4: [r[4] for r in ranks], 2: [r[2] for r in ranks[:2]]}


@pytest.fixture(scope="module")
def ref(rollouts):
    return _run(_trainer(), _data(), rollouts)


def _layouts():
    return [(w, layout) for w, layouts in LAYOUTS.items() for layout in layouts]


def _assert_lp_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_engine_rollouts_are_real_samples(rollouts):
    """The rollouts the layouts score: 2 prompts x GROUP engine samples with rewards that differ."""
    assert len(rollouts) == 2 * GROUP and all(len(r.logprobs) == 6 for r in rollouts)
    assert len({r.sequence.completion_ids for r in rollouts}) > 1 and len({r.reward for r in rollouts}) > 1


@pytest.mark.parametrize("world,layout", _layouts(), ids=lambda v: str(v))
def test_forward_logprobs_bitwise_at_every_layout(runs, ref, rollouts, world, layout):
    """Every rank: the one-process trainer's logprobs, and the engine's behaviour logprobs."""
    engine = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
    _assert_lp_equal(ref["lp_engine"], engine)
    for rank_results in runs[world]:
        r = rank_results[layout]
        _assert_lp_equal(r["lp0"], ref["lp0"])
        _assert_lp_equal(r["lp_engine"], engine)


@pytest.mark.parametrize("world,layout", _layouts(), ids=lambda v: str(v))
def test_grpo_and_sft_updates_match_one_process(runs, ref, world, layout):
    r = runs[world][0][layout]
    # On-policy: the engine sampled these rollouts from the weights the layout scores them with.
    assert r["grpo"]["kl"] == 0.0 and r["grpo"]["mismatched_tokens"] == 0
    assert r["grpo"]["tokens"] == ref["grpo"]["tokens"]
    assert r["sft"]["tokens"] == ref["sft"]["tokens"]
    for step in ("grpo", "sft"):
        assert r[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6, abs=1e-7), step
        assert r[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), step
    before = _model().state_dict()
    for step, prev in (("w1", before), ("w2", ref["w1"])):
        assert r[step].keys() == ref[step].keys()
        assert any(not torch.equal(ref[step][k], prev[k]) for k in prev), f"{step}: the step moved no weight"
        for k, v in ref[step].items():
            torch.testing.assert_close(r[step][k], v, rtol=0, atol=UPDATE_ATOL, msg=f"{step} {k}")


@pytest.mark.parametrize("world,layout", _layouts(), ids=lambda v: str(v))
def test_updated_weights_serve_the_one_process_bits(runs, world, layout):
    """After the updates, the layout's logprobs are those of a one-device model holding the
    layout's own (gathered) weights: the sharded forward stays exact after training."""
    from zerokl.services.trainer.config import TrainConfig
    from zerokl.services.trainer.trainer import Trainer
    r = runs[world][0][layout]
    m = _model()
    m.load_state_dict(r["w2"])
    _assert_lp_equal(r["lp2"], Trainer(m, TrainConfig()).forward_logprobs(_data()))
    for other in runs[world][1:]:
        _assert_lp_equal(other[layout]["lp2"], r["lp2"])


@pytest.mark.parametrize("layout", LAYOUTS[2], ids=str)
def test_sharded_checkpoint_loads_at_another_layout(runs, layout):
    saved = runs[4][0][SAVE_LAYOUT]
    for rank_results in runs[2]:
        got = rank_results[("loaded", *layout)]
        assert got["step"] == 2
        for k, v in saved["w2"].items():
            assert torch.equal(got["w"][k], v), k
        for name, s in saved["opt"].items():
            for key, v in s.items():
                assert torch.equal(got["opt"][name][key], v), (name, key)
        _assert_lp_equal(got["lp"], saved["lp2"])


# ----------------------------------------------------------------------------- the served group

def _start(weights, init, *flags):
    proc = subprocess.Popen([sys.executable, "-m", "zerokl.services.trainer", "--weights-dir", str(weights),
                             "--init", str(init), "--run", "job", "--port", "0", "--threads", "1", "--lr", "1e-3",
                             *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1"))
    line = proc.stdout.readline()
    if not line.startswith("trainer listening on 127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"trainer did not start: {line!r}")
    return proc, line.split()[3], line


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_served_group_survives_a_killed_rank_and_stays_on_policy(tmp_path):
    """`--dp 2 --ep 2`: rank 0 serves the Trainer API; logprobs are the one-process bits; DPO is
    refused with FAILED_PRECONDITION (no reference model under --dp/--tp/--ep); a killed
    follower takes the group down (rank 0 exits 1); the restarted group resumes from the last
    published version and an RL step on engine-sampled rollouts of it has KL exactly 0."""
    import asyncio
    import signal
    import grpc
    from zerokl.kernels.model import Model
    from zerokl.services.trainer.client import TrainerClient
    seqs = _data()
    init = tmp_path / "init"
    _model().save_pretrained(init)
    want = _trainer().forward_logprobs(seqs)

    async def before(address):
        async with TrainerClient(address) as client:
            for got, w in zip(await client.forward_logprobs(seqs), want, strict=True):
                assert torch.equal(got, w)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.forward_backward("dpo", [(seqs[0], seqs[1])], reset_reference=True)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "--dp/--tp/--ep" in refused.value.details()
            await client.forward_backward("sft", seqs)
            await client.optim_step()
            assert (await client.save_weights())[0].version == "job-step000001"

    async def after(address, rollouts):
        async with TrainerClient(address) as client:
            assert (await client.get_state()).step == 1
            fb, opt = await client.grpo_step(rollouts, group_size=GROUP)
            assert fb.ppo is not None and (fb.ppo.kl, fb.ppo.mismatched_tokens) == (0.0, 0)
            assert opt.step == 2

    weights = tmp_path / "w"
    proc, address, _ = _start(weights, init, "--dp", "2", "--ep", "2")
    try:
        asyncio.run(before(address))
        (follower,) = _children(proc.pid)
        os.kill(follower, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1            # the group is torn down: a supervisor restarts it
    finally:
        proc.kill()
        proc.wait()
    served = Model.from_pretrained(weights / "versions" / "job-step000001")
    rollouts = engine_rollouts(served, PROMPTS, below_16, n=GROUP, seed=3, version="job-step000001")
    proc, address, line = _start(weights, init, "--dp", "2", "--ep", "2")
    try:
        assert " step: 1 " in line and "resumed from job-step000001" in line
        asyncio.run(after(address, rollouts))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("flags", [("--lora-rank", "4"), ("--kl-coef", "0.1")], ids=lambda f: f[0])
def test_lora_and_kl_reference_are_refused_under_parallel_flags(flags, capsys):
    """LoRA and a KL reference model are one-process features: --dp/--tp/--ep refuses them at start."""
    from zerokl.services.trainer.server import main
    with pytest.raises(SystemExit) as exit_:
        main(["--dp", "2", *flags])
    assert exit_.value.code == 2
    assert "--dp/--tp/--ep train full weights without a reference" in capsys.readouterr().err


def test_micro_batches_are_refused_under_parallel_flags(capsys):
    """Each rank would split its own share by its own lengths: different numbers of forwards, whose FSDP
    collectives would wait on each other forever. Refused at start, and by the distributed trainer itself."""
    from zerokl.services.trainer.server import main
    with pytest.raises(SystemExit) as exit_:
        main(["--dp", "2", "--micro-batch-tokens", "4096"])
    assert exit_.value.code == 2 and "--micro-batch-tokens 0" in capsys.readouterr().err
    from zerokl.kernels.model import Model, ModelConfig
    from zerokl.services.trainer.distributed import DistributedTrainer
    from zerokl.services.trainer.config import TrainConfig
    from zerokl.services.trainer.trainer import Trainer
    trainer = Trainer(Model(ModelConfig.preset("tiny"), seed=0), TrainConfig(micro_batch_tokens=4096))
    with pytest.raises(ValueError, match="micro_batch_tokens=0"):
        DistributedTrainer(trainer, None)       # refused before its group is touched


@pytest.mark.slow
def test_zerokl_up_with_a_dp2_trainer_runs_an_rl_job_at_kl_zero(tmp_path, zerokl_up):
    """`zerokl up --trainer-flag=--dp=2`: the Jobs API is unchanged, and an RL job's every step
    reports the exact train/inference KL 0.0 (TP = 1 replicas sample, the dp = 2 trainer scores)."""
    import asyncio
    from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec
    from zerokl.services.jobs.service import JobsClient
    flags = ("--trainer-flag=--dp=2", "--trainer-flag=--ep=2", "--trainer-flag=--run=dist")
    with zerokl_up(tmp_path / "up", *flags, timeout=240) as services:
        async def job():
            async with JobsClient(services["scheduler"]["address"]) as jobs:
                spec = RLJobSpec(2, countdown=CountdownTask(seed=0), prompts_per_step=2, group_size=4,
                                 max_tokens=8, eval_every=0)
                submitted = await jobs.submit(spec, "dp2 grpo")
                return [ev async for ev in jobs.watch(submitted.job_id)]
        events = asyncio.run(job())
    assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
    steps = [ev for ev in events if ev.step is not None]
    assert len(steps) == 2
    assert all(ev.metrics["kl"] == 0.0 and ev.metrics["mismatched_tokens"] == 0 for ev in steps)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
