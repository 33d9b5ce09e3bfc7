"""A job waits for the trainer's records the scheduler's --store-wait at most (10 s here), over real processes: a record
that never ends (the trainer's record process stopped, as one the host has stopped, or a store that takes the bytes and
never answers) ends the job, saying which version and which wait, and the scheduler goes on with the next job."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Iterator

import pytest

from zerokl.services.jobs.service import JobsClient
from zerokl.services.jobs.types import JobState, RLJobSpec
from zerokl.services.trainer.client import TrainerClient

from test_jobs import TINY_RL, _events, _next_job_trains_from, _record_process, _steps, _trainer_state_and_stored

pytestmark = pytest.mark.timeout(600)

GUARD_S = 120       # a job that waits past this waits for ever (the store wait is 10 s)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, zerokl_up) -> Iterator[dict]:  # noqa: ANN001
    """`zerokl up` with --store-wait 10; one job run on it (the trainer's record process is spawned on its first
    record)."""
    with zerokl_up(tmp_path_factory.mktemp("waits-up"), "--trainer-flag=--run=waits", "--trainer-flag=--lr=3e-3",
                   "--scheduler-flag=--store-wait=10") as services:

        async def first() -> None:
            async with JobsClient(services["scheduler"]["address"]) as jobs:
                done = await _events(jobs, (await jobs.submit(RLJobSpec(steps=1, seed=10, **TINY_RL))).job_id)
                assert done[-1].status.state is JobState.SUCCEEDED, done[-1].status.error
        asyncio.run(first())
        yield services


@contextlib.contextmanager
def _records_held(fleet: dict) -> Iterator[None]:
    """The trainer's record process stopped (no record ends) inside the block."""
    recorder = _record_process(fleet["trainer"]["pid"])
    os.kill(recorder, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(recorder, signal.SIGCONT)


def _run_with_records_held(fleet: dict, spec: RLJobSpec) -> list:
    """The events of a job run with the trainer's records held (until it ends, GUARD_S at most)."""
    async def run() -> list:
        async with JobsClient(fleet["scheduler"]["address"]) as jobs:
            job = await jobs.submit(spec)
            return await asyncio.wait_for(_events(jobs, job.job_id), GUARD_S)
    with _records_held(fleet):
        return asyncio.run(run())


def _lands(fleet: dict, version: str) -> None:
    """``version``'s record lands (the record process goes on) and the store holds it."""
    async def record() -> None:
        async with TrainerClient(fleet["trainer"]["address"]) as trainer:
            assert (await trainer.record_weights(version, timeout=GUARD_S)).manifest.version == version
    asyncio.run(record())
    assert version in _trainer_state_and_stored(fleet)[1]


def test_a_job_whose_last_record_does_not_end_in_the_store_wait_fails_naming_the_version_not_durable_yet(
        fleet: dict) -> None:
    """Every step trained and the fleet serves the job's last version, but its record does not end: the job does not
    succeed as if that version were durable. It fails after the store wait naming the version and the wait; the record
    lands once its process goes on, and the next job trains from that version."""
    events = _run_with_records_held(fleet, RLJobSpec(steps=1, seed=11, **TINY_RL))
    final, [step] = events[-1].status, _steps(events)
    last = step.weights_version
    assert final.state is JobState.FAILED and final.weights_version == last, final
    assert final.error == (
        f"RecordPending: every step trained and the fleet serves {last}, but it is not durable yet: the record of "
        f"{last} did not end within the 10 s waited for it (the scheduler's --store-wait; it may land later)"), \
        final.error
    _lands(fleet, last)
    asyncio.run(_next_job_trains_from(fleet, last))


def test_a_step_waiting_for_a_checkpoint_beyond_the_record_lag_fails_after_the_store_wait_naming_it(
        fleet: dict) -> None:
    """A checkpoint every step, their records held: step 3 waits for the oldest of the two unrecorded checkpoints (the
    record lag) and fails after the store wait naming it; the fleet keeps serving step 2's version, which the next job
    trains from once the records land."""
    events = _run_with_records_held(fleet, RLJobSpec(steps=3, seed=12, checkpoint_every=1, **TINY_RL))
    final, (one, two) = events[-1].status, _steps(events)
    assert final.state is JobState.FAILED and final.weights_version == two.weights_version, final
    assert final.error == (
        f"RecordPending: step 3 waits for the record of the checkpoint {one.weights_version} (a step trains only while "
        f"2 checkpoints at most are not in the weight store: each holds the trainer state's snapshot in the trainer's "
        f"memory): the record of {one.weights_version} did not end within the 10 s waited for it (the scheduler's "
        f"--store-wait; it may land later)"), final.error
    _lands(fleet, two.weights_version)
    asyncio.run(_next_job_trains_from(fleet, two.weights_version))

