"""A `zerokl up` fleet heals without a person (issue 31), over real processes killed with SIGKILL.

* A replica killed right after a weight switch comes back on the fleet's version, and
  the scheduler serves again within seconds: no mixed fleet left for a person to mend.
* A decode replica killed mid-RL-job is waited for like a trainer restart: the job
  succeeds, every step once, KL == 0.0 at each.
* A trainer killed mid-RL-job, after steps whose versions were recorded weights only (or not
  yet), resumes from the job's newest recorded checkpoint; the job redoes the steps since it
  from the rollouts it kept, and ends bit for bit where an uninterrupted run ends (torch.equal
  with the same job in process), KL == 0.0 at every step.
* A job that fails between SaveWeights and the fleet switch (its decode replica cannot
  come back in time) leaves no version behind: the store ends at the served version
  and the next job, of other contents at the same step, publishes.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import time

import pytest
import torch

from zerokl.services.inference import InferenceClient
from zerokl.services.inference.types import InferenceRequest
from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec, SFTJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.trainer.store_marks import META_STATE
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.vocab import Completion, SamplingOptions

pytestmark = pytest.mark.timeout(300)

FLAGS = ("--trainer-flag=--lr=3e-3", "--trainer-flag=--run=heal", "--restart-backoff", "0.2")
EXAMPLES = tuple(Completion((1, 5 + i, 7, 9), (20 + i % 3, 21, 22, 2)) for i in range(8))
PROBE = InferenceRequest(prompt_ids=(1, 5, 7, 9), options=SamplingOptions(temperature=0.0, max_tokens=4))


def _service(workdir: pathlib.Path, name: str) -> dict:
    return next(s for s in json.loads((workdir / "up.json").read_text())["services"] if s["name"] == name)


def _kill(workdir: pathlib.Path, name: str) -> dict:
    entry = _service(workdir, name)
    os.kill(entry["pid"], signal.SIGKILL)
    return entry


async def _events(jobs: JobsClient, spec, name: str) -> list:  # noqa: ANN001
    job = await jobs.submit(spec, name)
    return [ev async for ev in jobs.watch(job.job_id)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, zerokl_up):  # noqa: ANN001, ANN201
    """`zerokl up` with restarts after 0.2 s; yields (workdir, services)."""
    workdir = tmp_path_factory.mktemp("heal") / "up"
    with zerokl_up(workdir, *FLAGS) as services:
        yield workdir, services


def test_a_replica_killed_right_after_a_switch_comes_back_on_the_fleets_version(fleet) -> None:  # noqa: ANN001
    workdir, services = fleet
    scheduler = services["scheduler"]["address"]

    async def main() -> None:
        async with InferenceClient(scheduler) as inference, JobsClient(scheduler) as jobs:
            done = await _events(jobs, SFTJobSpec(steps=1, examples=EXAMPLES, batch_size=4), "newer")
            assert done[-1].status.state is JobState.SUCCEEDED, done[-1].status.error
            newer = done[-1].status.weights_version
            assert (await inference.info()).weights_version == newer
            # Back to version 1, then decode-0 dies at once: it must rejoin on 1, not on `newer`.
            assert (await inference.switch_weights("1")).weights_version == "1"
            killed = _kill(workdir, "decode-0")
            deadline = time.monotonic() + 60
            while True:
                entry = _service(workdir, "decode-0")
                if entry["pid"] != killed["pid"] and entry["status"] == "SERVING" \
                        and (await inference.info()).weights_version == "1":
                    break
                assert time.monotonic() < deadline, f"the fleet did not converge on version 1: {entry}"
                await asyncio.sleep(0.25)
            async with InferenceClient(entry["address"]) as decode:
                assert (await decode.info()).weights_version == "1"
            # Unpinned requests are served again, on the fleet's version.
            assert (await inference.generate_all(PROBE)).weights_version == "1"
    asyncio.run(main())


def test_a_decode_replica_killed_mid_rl_job_is_waited_for_and_kl_stays_zero(fleet) -> None:  # noqa: ANN001
    workdir, services = fleet

    async def main() -> None:
        async with JobsClient(services["scheduler"]["address"]) as jobs:
            spec = RLJobSpec(steps=3, countdown=CountdownTask(train_problems=100, test_problems=4),
                             prompts_per_step=2, group_size=4, max_tokens=12, seed=5, eval_every=0)
            job = await jobs.submit(spec, "rl-decode-restart")
            killed, events = None, []
            async for ev in jobs.watch(job.job_id):
                events.append(ev)
                if ev.step == 1 and killed is None:
                    killed = _kill(workdir, "decode-0")   # step 2's rollouts need it
            final = events[-1].status
            assert killed is not None and final.state is JobState.SUCCEEDED, final.error
            steps = [ev for ev in events if ev.step is not None]
            assert [ev.step for ev in steps] == [1, 2, 3]
            assert all(ev.metrics["kl"] == 0.0 and ev.metrics["mismatched_tokens"] == 0.0 for ev in steps)
            assert _service(workdir, "decode-0")["restarts"] >= 1
    asyncio.run(main())


def test_a_trainer_killed_mid_rl_job_redoes_the_steps_since_its_checkpoint_bit_for_bit(fleet, tmp_path) -> None:  # noqa: ANN001
    from zerokl.kernels.model import Model
    from zerokl.services.engine.types import EngineConfig
    from zerokl.services.jobs.manager import _countdown_data
    from zerokl.services.rl.loop import RLConfig, Task, run_rl
    from zerokl.services.trainer.checkpointing import read_checkpoint
    from zerokl.services.trainer.config import TrainConfig
    from zerokl.experiment_state import ArmEnginePort, ArmTrainerPort
    from zerokl.tasks.countdown import reward
    from zerokl.tasks.setup import encode_prompt

    workdir, services = fleet
    task = CountdownTask(train_problems=100, test_problems=4)
    # A checkpoint at step 3 (the last); steps 1-2 are recorded weights only. The trainer dies once step 2
    # is served: it resumes from the job's first version and the job redoes steps 1-2.
    spec = RLJobSpec(steps=3, countdown=task, prompts_per_step=2, group_size=4, max_tokens=10, seed=7, eval_every=0,
                     checkpoint_every=3)
    restarts = _service(workdir, "trainer")["restarts"]

    async def job() -> tuple[list, dict]:
        async with JobsClient(services["scheduler"]["address"]) as jobs, \
                WeightStoreClient(services["weight-store"]["address"]) as store:
            submitted = await jobs.submit(spec, "rl-trainer-restart")
            events, killed = [], False
            async for ev in jobs.watch(submitted.job_id):
                events.append(ev)
                if ev.step == 2 and not killed:
                    killed = bool(_kill(workdir, "trainer"))
            manifests = {e.manifest.version: e.manifest for e in await store.list()}
            steps = [ev for ev in events if ev.step is not None]
            start = manifests[steps[0].weights_version].spec.parent_version
            await store.fetch(start, tmp_path / "start")
            await store.fetch(steps[-1].weights_version, tmp_path / "final", serving_only=True)
            return events, manifests

    events, manifests = asyncio.run(job())
    final = events[-1].status
    assert final.state is JobState.SUCCEEDED, final.error
    assert _service(workdir, "trainer")["restarts"] > restarts
    steps = [ev for ev in events if ev.step is not None]
    assert [ev.step for ev in steps] == [1, 2, 3]
    assert all(ev.metrics["kl"] == 0.0 and ev.metrics["mismatched_tokens"] == 0.0 for ev in steps)
    # Every version is in the store; the trainer state only at the checkpoints.
    assert [manifests[ev.weights_version].spec.metadata[META_STATE] for ev in steps] == ["none", "none", "full"]

    # The same job uninterrupted, in process, from the same first version (its trainer state restored).
    trainer = read_checkpoint(tmp_path / "start", restore_state=True, config=TrainConfig()).trainer
    train, test, tok = _countdown_data(task)
    port = ArmTrainerPort(trainer, "reference")
    config = RLConfig(steps=spec.steps, prompts_per_step=spec.prompts_per_step, group_size=spec.group_size,
                      max_tokens=spec.max_tokens, seed=spec.seed, eval_every=0)
    records = run_rl(Task(train, test, lambda p: encode_prompt(p, tok), reward), ArmEnginePort(port, tok, EngineConfig()),
                     port, config)
    for ev, rec in zip(steps, records, strict=True):
        assert (ev.metrics["loss"], ev.metrics["grad_norm"], ev.metrics["reward"], ev.metrics["tokens"]) == \
            (rec.loss, rec.grad_norm, rec.reward, rec.tokens), ev.step
    served, want = Model.from_pretrained(tmp_path / "final").state_dict(), trainer.serving_state_dict()
    assert served.keys() == want.keys() and all(torch.equal(served[k], want[k]) for k in want)


async def _failing_without_a_replica(jobs, spec, name: str, step: int, workdir: pathlib.Path,  # noqa: ANN001
                                     supervisor: int) -> list:
    """Run a job whose only decode replica is killed once ``step`` is served, its supervisor stopped meanwhile
    (so the job finds no replica within --fleet-wait); its events, the last a FleetUnavailable failure."""
    try:
        submitted = await jobs.submit(spec, name)
        events = []
        async for ev in jobs.watch(submitted.job_id):
            events.append(ev)
            if ev.step == step:
                os.kill(supervisor, signal.SIGSTOP)
                _kill(workdir, "decode-0")
    finally:
        os.kill(supervisor, signal.SIGCONT)
    final = events[-1].status
    assert final.state is JobState.FAILED and final.error.startswith("FleetUnavailable:"), final
    return events


async def _serving(inference, version: str, timeout_s: float = 90) -> None:  # noqa: ANN001
    """Wait until the fleet serves ``version`` again (decode-0 back from its restart)."""
    deadline = time.monotonic() + timeout_s
    while (await inference.info()).weights_version != version:
        assert time.monotonic() < deadline, "decode-0 did not come back"
        await asyncio.sleep(0.25)


def test_a_job_failing_between_save_and_switch_leaves_no_version_and_the_next_job_runs(tmp_path, zerokl_up) -> None:
    workdir = tmp_path / "up"
    # A job waits 3 s for a replica here; decode-0 stays down longer (its supervisor is stopped meanwhile).
    # A request waits 1 s (not 5) for a healthy replica before it fails: the RL job's rollouts find none sooner.
    with zerokl_up(workdir, *FLAGS, "--scheduler-flag=--fleet-wait=3", "--scheduler-flag=--route-wait=1") as services:
        scheduler, store = services["scheduler"]["address"], services["weight-store"]["address"]
        supervisor = json.loads((workdir / "up.json").read_text())["pid"]

        async def main() -> None:
            async with JobsClient(scheduler) as jobs, WeightStoreClient(store) as weights, \
                    InferenceClient(scheduler) as inference:
                # Step 2 trains and saves; the switch to it finds no decode replica.
                events = await _failing_without_a_replica(
                    jobs, SFTJobSpec(steps=2, examples=EXAMPLES, batch_size=4, seed=1), "doomed", 1, workdir, supervisor)
                final = events[-1].status
                assert "was deleted from the weight store" in final.error, final.error
                # The store ends at the version the fleet served; step 2's is gone.
                served = final.weights_version
                versions = [e.manifest.version for e in await weights.list()]
                assert versions[-1] == served and served.endswith("step000000"), (versions, served)
                # decode-0 comes back on that version, and the next job publishes
                # step 2 anew, with other contents.
                await _serving(inference, served)
                after = await _events(jobs, SFTJobSpec(steps=2, examples=EXAMPLES, batch_size=4, seed=2), "next")
                assert after[-1].status.state is JobState.SUCCEEDED, after[-1].status.error
                await _an_rl_job_failing_between_checkpoints_and_the_next_one(workdir, supervisor, jobs, weights,
                                                                             inference)
        asyncio.run(main())


async def _an_rl_job_failing_between_checkpoints_and_the_next_one(workdir, supervisor, jobs, weights,  # noqa: ANN001
                                                                  inference) -> None:
    """An RL job fails (no replica for step 3's rollouts) after steps 1-2 were served and recorded weights only:
    the trainer stays on step 2's version, which is no resume point. The next job starts there (it found
    ALREADY_EXISTS before: its start saved the trainer state under that version's name) and records the
    trainer state with its first step."""
    task = CountdownTask(train_problems=100, test_problems=4)
    spec = RLJobSpec(steps=4, countdown=task, prompts_per_step=2, group_size=4, max_tokens=10, seed=3, eval_every=0,
                     checkpoint_every=10)
    events = await _failing_without_a_replica(jobs, spec, "doomed-rl", 2, workdir, supervisor)
    served = events[-1].status.weights_version
    assert served == next(ev for ev in events if ev.step == 2).weights_version
    await _serving(inference, served)
    assert (await weights.manifest(served)).spec.metadata[META_STATE] == "none"
    after = await _events(jobs, RLJobSpec(steps=2, countdown=task, prompts_per_step=2, group_size=4, max_tokens=10,
                                          seed=4, eval_every=0), "after-rl")
    assert after[-1].status.state is JobState.SUCCEEDED, after[-1].status.error
    steps = [ev for ev in after if ev.step is not None]
    assert all(ev.metrics["kl"] == 0.0 and ev.metrics["mismatched_tokens"] == 0.0 for ev in steps)
    # Its first step is a checkpoint (the job started with no resume point), and so is its last.
    assert [ev.metrics["checkpoint"] for ev in steps] == [1.0, 1.0]
    assert [(await weights.manifest(ev.weights_version)).spec.metadata[META_STATE] for ev in steps] == ["full"] * 2
