"""A job waits for the trainer's records and for the weight store's answers the scheduler's --store-wait at most (10 s
here), over real processes: a record that never ends (the trainer's record process stopped, as one the host has
stopped, or a store that takes the bytes and never answers) or a store call that is never answered (a proxy in front of
the store, the scheduler's --weight-store, that leaves it unanswered) ends the job, saying which version and which wait,
and the scheduler goes on with the next job."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import grpc
import pytest

from zerokl.services.jobs.service import JobsClient
from zerokl.services.jobs.types import JobState, RLJobSpec
from zerokl.services.trainer.client import TrainerClient

from test_jobs import (TINY_RL, _events, _first_step_fails_while_its_start_is_recorded, _next_job_trains_from,
                       _record_process, _steps, _trainer_state_and_stored)

pytestmark = pytest.mark.timeout(600)

GUARD_S = 120       # a job that waits past this waits for ever (the store wait is 10 s)


class _Store(grpc.GenericRpcHandler):
    """A proxy in front of the weight store (unary calls, bytes passed through as they are) that leaves the calls
    named in ``hang`` unanswered until :meth:`release`."""

    def __init__(self) -> None:
        self.target = ""            # the store's address, set once `zerokl up` says it
        self.hang: set[str] = set()
        self._released = threading.Event()
        self._server = grpc.server(ThreadPoolExecutor(8))
        self._server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()
        self._channel: grpc.Channel | None = None

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            if method.rsplit("/", 1)[1] in self.hang:
                self._released.wait()
                context.abort(grpc.StatusCode.UNAVAILABLE, "released by the test")
            if self._channel is None:
                self._channel = grpc.insecure_channel(self.target)
            try:
                return self._channel.unary_unary(method)(request, timeout=context.time_remaining(),
                                                         metadata=context.invocation_metadata())
            except grpc.RpcError as err:
                context.abort(err.code(), err.details())
        return grpc.unary_unary_rpc_method_handler(forward)

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self.release()
        self._server.stop(0)


@pytest.fixture(scope="module")
def store() -> Iterator[_Store]:
    """The scheduler's way to the weight store (:class:`_Store`)."""
    proxy = _Store()
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, zerokl_up, store: _Store) -> Iterator[dict]:  # noqa: ANN001
    """`zerokl up` with --store-wait 10, its scheduler reaching the store through ``store``; one job run on it (the
    trainer's record process is spawned on its first record)."""
    with zerokl_up(tmp_path_factory.mktemp("waits-up"), "--trainer-flag=--run=waits", "--trainer-flag=--lr=3e-3",
                   "--scheduler-flag=--store-wait=10", f"--scheduler-flag=--weight-store={store.address}") as services:
        store.target = services["weight-store"]["address"]

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


def test_a_delete_the_store_never_answers_ends_the_failed_job_after_the_store_wait(
        fleet: dict, store: _Store, tmp_path) -> None:  # noqa: ANN001
    """A version that failed its canary is deleted from the store once its record landed; here the store never answers
    that Delete. The job still ends, after the store wait, saying the version was not deleted and why; the fleet and
    the trainer are back on the job's start, and the next job trains from it."""
    store.hang = {"Delete"}

    async def failed_job() -> tuple[str, str, str]:
        return await asyncio.wait_for(_first_step_fails_while_its_start_is_recorded(
            fleet, tmp_path, lambda recorder: os.kill(recorder, signal.SIGCONT)), GUARD_S)
    try:
        _, start, error = asyncio.run(failed_job())
    finally:
        store.hang = set()
        store.release()
    rejected = error.split("weights version ", 1)[1].split()[0]
    assert f"rolled back to {start}" in error, error
    assert error.endswith(
        f"{rejected} was not deleted from the weight store: the weight store's Delete of {rejected} did not end within "
        f"the 10 s waited for it (the scheduler's --store-wait; the store may still do it) (it failed its canary: "
        f"delete it once the store answers)"), error
    state, stored = _trainer_state_and_stored(fleet)
    assert state.weights_version == start and {start, rejected} <= stored
    asyncio.run(_next_job_trains_from(fleet, start))
