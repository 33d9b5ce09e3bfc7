"""The durable record rule (issue 49, ARCHITECTURE.md "Durable versions"), over real processes.

`zerokl up` (bf16 fleet, an RL learning rate: records after the first are deltas), an RL job with a checkpoint
every 2 steps. Once a checkpoint is durable, the weight store is stopped (SIGSTOP); the next step trains and is served
(in place) with its record in flight, and the trainer is killed there (SIGKILL); the store goes on
(SIGCONT). Then:

- the store holds only complete versions: every manifest's files read back through the store, decoded and
  checked against their sha256, and nothing is half published;
- the restarted trainer resumed from the newest durable checkpoint, the job redid the steps since it and
  succeeded, every step once, KL == 0.0 at each (a replica never served a version the store could not give);
- the next job starts from the newest durable version and has KL == 0.0.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal

import pytest

from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.trainer.store_marks import META_STATE
from zerokl.services.weightstore import LocalDirBackend, VersionStore

pytestmark = pytest.mark.timeout(420)

FLAGS = ("--dtype", "bfloat16", "--trainer-flag=--lr=1e-5", "--trainer-flag=--run=crash", "--restart-backoff", "0.2")
TASK = CountdownTask(train_problems=100, test_problems=4)


def _service(workdir: pathlib.Path, name: str) -> dict:
    return next(s for s in json.loads((workdir / "up.json").read_text())["services"] if s["name"] == name)


def test_a_trainer_killed_with_a_record_in_flight_leaves_only_complete_versions(tmp_path, zerokl_up) -> None:  # noqa: ANN001
    workdir = tmp_path / "up"
    manifests = workdir / "weights" / "manifests"
    with zerokl_up(workdir, *FLAGS) as services:
        store_pid, trainer = services["weight-store"]["pid"], _service(workdir, "trainer")
        spec = RLJobSpec(steps=8, countdown=TASK, prompts_per_step=2, group_size=4, max_tokens=10, seed=3,
                         eval_every=0, checkpoint_every=2)

        async def job() -> tuple[list, str, str]:
            async with JobsClient(services["scheduler"]["address"]) as jobs:
                submitted = await jobs.submit(spec, "crash")
                events, stopped, caught, durable = [], False, "", {}
                async for ev in jobs.watch(submitted.job_id):
                    events.append(ev)
                    if caught or ev.step is None or ev.step >= spec.steps - 1:
                        continue
                    if not stopped and ev.metrics["checkpoint_step"] >= 2:
                        # A checkpoint is durable. From here no record lands: the next step's is in flight when
                        # its event comes (the share goes on without the store; replicas switch in place).
                        os.kill(store_pid, signal.SIGSTOP)
                        stopped = True
                    elif stopped:
                        assert not (manifests / f"{ev.weights_version}.json").exists()
                        caught = ev.weights_version
                        durable = max((json.loads(p.read_text()) for p in manifests.iterdir()),
                                      key=lambda d: (d["metadata"].get(META_STATE) == "full", d["step"] or 0))
                        os.kill(trainer["pid"], signal.SIGKILL)     # the trainer dies with the record in flight
                        os.kill(store_pid, signal.SIGCONT)
                return events, caught, durable.get("version", "")
        try:
            events, caught, durable = asyncio.run(job())
        finally:
            os.kill(store_pid, signal.SIGCONT)      # (a no-op unless the job above failed while it was stopped)
        final = events[-1].status
        assert caught
        assert final.state is JobState.SUCCEEDED, final.error
        steps = [ev for ev in events if ev.step is not None]
        assert [ev.step for ev in steps] == list(range(1, spec.steps + 1))
        assert all(ev.metrics["kl"] == 0.0 and ev.metrics["mismatched_tokens"] == 0.0 for ev in steps)
        again = _service(workdir, "trainer")
        assert again["restarts"] >= 1 and again["last_exit"] == -signal.SIGKILL

        # Only complete versions: each reads back whole and verified (deltas decoded over their bases).
        store = VersionStore(LocalDirBackend(workdir / "weights"))
        versions = [m.version for m in store.manifests()]
        assert caught in versions and durable in versions    # re-recorded by the redo; the durable one kept
        for version in versions:
            store.fetch(version, tmp_path / "read" / version)
        assert any(s.base for v in versions for s in store.get_manifest(v).shards)    # deltas were among them

        # The next job starts from the newest durable version (the last one, a checkpoint) with KL == 0.0.
        async def next_job() -> list:
            async with JobsClient(services["scheduler"]["address"]) as jobs:
                submitted = await jobs.submit(RLJobSpec(steps=1, countdown=TASK, prompts_per_step=2, group_size=4,
                                                        max_tokens=10, seed=4, eval_every=0), "after")
                return [ev async for ev in jobs.watch(submitted.job_id)]
        after = asyncio.run(next_job())
        assert after[-1].status.state is JobState.SUCCEEDED, after[-1].status.error
        [step] = [ev for ev in after if ev.step is not None]
        assert step.metrics["kl"] == 0.0 and step.metrics["mismatched_tokens"] == 0.0
        newest = store.get_manifest(steps[-1].weights_version)
        assert newest.spec.metadata[META_STATE] == "full" and newest.spec.step + 1 == store.get_manifest(
            step.weights_version).spec.step
