"""Jobs against real services on loopback: bad weights are never served, and a job's record tells the truth.

* One rule (issue 47): no version is served, resumed or recorded as current unless it passed its
  canary. Weights a person put on the trainer by hand that cannot serve (finite, so nothing refused
  them on the way in) fail the canary of the job that publishes them: the job fails by name, the
  trainer is back on the version the fleet serves, what the job saved is deleted, the fleet keeps
  serving bit for bit. A person taking the trainer back to an older version does not make the next
  job collide with the names the run used (no ALREADY_EXISTS); a fresh ``zerokl up`` on the same
  state directory serves the newest good version and the next job succeeds. An lr above the
  ceiling is refused at the source.
* A replica that refuses the trainer's numerics (a fingerprint mismatch) fails a job at once, not
  after --fleet-wait, and the job leaves nothing behind (issue 47, case 3).
* Job records survive a scheduler restart.
* A weight store that dies mid-job is waited for: the job succeeds only with
  every step it trained published, and watchers see each step once.
* The scheduler switches the fleet only after a canary on one replica, and a
  switch that fails anywhere puts every replica back.
"""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import signal
import subprocess
import sys
import time
from typing import AsyncIterator

import grpc
import grpc.aio
import pytest
import torch

from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels.model import Model
from zerokl.services.engine.engine import Engine
from zerokl.services.engine.types import EngineConfig
from zerokl.services.inference import AsyncEngine, InferenceClient, Replica
from zerokl.services.inference.decode import Decoder, add_decode_service
from zerokl.services.inference.server import make_identity
from zerokl.services.inference.types import GenerateResult, InferenceRequest
from zerokl.services.inference.weights import WeightSwitcher
from zerokl.services.routing.fleet import read_fleet
from zerokl.services.runtime import ServiceServer
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.jobs.types import CountdownTask, JobState, RLJobSpec, SFTJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.service import add_weight_store
from zerokl.vocab import Completion, SamplingOptions

from conftest import CONFIG, TOKENIZER, scheduler_server

pytestmark = pytest.mark.timeout(600)

EXAMPLES = tuple(Completion((1, 5 + i, 7, 9), (20 + i % 3, 21, 22, 2)) for i in range(8))
PROBE = InferenceRequest(prompt_ids=(1, 5, 7, 9, 11, 13),
                         options=SamplingOptions(temperature=0.8, seed=3, max_tokens=8, n=2, ignore_eos=True,
                                                 prompt_logprobs=True))


def _numbers(result: GenerateResult) -> list[tuple]:
    return [(s.token_ids, s.logprobs, s.prompt_logprobs) for s in result.samples]


TRUTH_FLAGS = ("--trainer-flag=--lr=3e-3", "--trainer-flag=--run=truth")


async def _run(jobs: JobsClient, spec: SFTJobSpec | RLJobSpec, name: str) -> list:
    job = await jobs.submit(spec, name)
    return [ev async for ev in jobs.watch(job.job_id)]


async def _poisoned_copy(weights: WeightStoreClient, version: str, folder: pathlib.Path) -> str:
    """Publish a copy of ``version`` whose weights are finite but cannot serve (every MLP weight x 1e15: the
    activations overflow and the logits are NaN), as a person might upload a broken checkpoint; its name."""
    await weights.fetch(version, folder / "good", serving_only=True)
    model = Model.from_pretrained(folder / "good")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.mul_(1e15)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    model.save_pretrained(folder / "poisoned")
    await weights.publish(folder / "poisoned", "poisoned-by-hand")
    return "poisoned-by-hand"


def test_hand_driven_weights_that_fail_their_canary_are_never_served_resumed_or_kept(tmp_path, zerokl_up) -> None:
    workdir = tmp_path / "up"
    with zerokl_up(workdir, *TRUTH_FLAGS) as services:
        scheduler, store = services["scheduler"]["address"], services["weight-store"]["address"]

        async def poisoned() -> tuple[str, str, str]:
            async with InferenceClient(scheduler) as inference, JobsClient(scheduler) as jobs, \
                    WeightStoreClient(store) as weights, TrainerClient(services["trainer"]["address"]) as trainer:
                # The guard at the source: a hand-driven step at lr 1e9 (finite weights no replica can serve)
                # is refused by name, as is a job's.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await trainer.optim_step(lr=1e9)
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "lr" in err.value.details()
                warmup = await _run(jobs, SFTJobSpec(steps=2, examples=EXAMPLES, batch_size=4, publish_every=1),
                                    "warm-up")
                assert warmup[-1].status.state is JobState.SUCCEEDED, warmup[-1].status.error
                older, good = [ev.weights_version for ev in warmup if ev.step is not None]
                before = await inference.generate_all(PROBE)
                assert before.weights_version == good
                stored = {e.manifest.version for e in await weights.list()}
                # By hand: the trainer loads weights that cannot serve, then a job publishes them at its start.
                await trainer.load_weights(await _poisoned_copy(weights, good, tmp_path))
                events = await _run(jobs, SFTJobSpec(steps=1, examples=EXAMPLES, batch_size=4), "poison")
                final, poisoned_id = events[-1].status, events[0].status.job_id
                # Failed by name: the state and the message say why, and which version the fleet kept.
                assert final.state is JobState.FAILED, final
                assert final.error.startswith("CanaryFailed:") and "failed its canary" in final.error, final.error
                assert f"rolled back to {good}" in final.error and "deleted from the weight store" in final.error
                after = await inference.generate_all(PROBE)
                assert after.weights_version == good and _numbers(after) == _numbers(before)
                # What the job saved is gone (the person's own upload stays), the trainer is back on the good
                # version with nothing pending, and the fleet's record names the good one.
                assert {e.manifest.version for e in await weights.list()} == stored | {"poisoned-by-hand"}
                state = await trainer.get_state()
                assert (state.weights_version, state.step, state.accumulated_batches) == \
                    (good, state.weights_step, 0)
                fleet = read_fleet(workdir / "scheduler")   # its target, and good versions that all passed a canary
                assert fleet.weights_version == good and set(fleet.good) <= stored, fleet
                # By hand again: back to an older version. The next job trains steps the run has published
                # with other contents: it publishes them under the run's next segment, never ALREADY_EXISTS.
                await trainer.load_weights(older, restore_state=True)
                events = await _run(jobs, SFTJobSpec(steps=2, examples=EXAMPLES, batch_size=4, seed=3,
                                                     publish_every=1), "from-older")
                assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
                newest = events[-1].status.weights_version
                assert newest.startswith("truth.2-step") and newest not in stored, newest
                assert (await inference.generate_all(PROBE)).weights_version == newest
                return good, newest, poisoned_id
        good, newest, poisoned_id = asyncio.run(poisoned())

    # A fresh `zerokl up` on the same state directory (Ctrl-C, then up again) serves the newest good version,
    # its trainer resumes from it, it remembers the jobs of the scheduler before it, and runs the next job.
    with zerokl_up(workdir, *TRUTH_FLAGS) as services:
        scheduler = services["scheduler"]["address"]
        # `zerokl jobs list` (its own process) runs beside the checks below; it reads only the poisoned job's row.
        listing = subprocess.Popen([sys.executable, "-m", "zerokl", "jobs", "--server", scheduler, "list"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        async def restarted() -> None:
            async with InferenceClient(scheduler) as inference, JobsClient(scheduler) as jobs, \
                    TrainerClient(services["trainer"]["address"]) as trainer:
                served = await inference.generate_all(PROBE)    # never INTERNAL: a version that passed its canary
                assert served.weights_version == newest
                assert (await trainer.get_state()).weights_version == newest
                listed = {s.name: s for s in await jobs.list()}
                assert listed["warm-up"].state is JobState.SUCCEEDED and listed["warm-up"].weights_version == good
                assert listed["poison"].state is JobState.FAILED and "failed its canary" in listed["poison"].error
                replay = [ev async for ev in jobs.watch(listed["warm-up"].job_id)]
                assert [ev.step for ev in replay if ev.step is not None] == [1, 2]
                events = await _run(jobs, SFTJobSpec(steps=2, examples=EXAMPLES, batch_size=4), "next")
                assert events[-1].status.state is JobState.SUCCEEDED, events[-1].status.error
                assert [ev.step for ev in events if ev.step is not None] == [1, 2]
                assert (await inference.info()).weights_version == events[-1].status.weights_version != newest
        try:
            asyncio.run(restarted())
            out, err = listing.communicate(timeout=120)
        finally:
            if listing.poll() is None:
                listing.kill()
                listing.communicate()
        row = next(line for line in out.splitlines() if poisoned_id in line)
        assert listing.returncode == 0 and "failed" in row, out + err


def _start(service: str, *flags: str, log: pathlib.Path) -> subprocess.Popen:
    """Start `zerokl serve SERVICE FLAGS` on a free loopback port (unless the flags name one)."""
    port = [] if "--port" in flags else ["--port", "0"]
    return subprocess.Popen([sys.executable, "-m", "zerokl", "serve", service, *port, *flags],
                            stdout=subprocess.PIPE, stderr=log.open("a"), text=True)


def _listening(proc: subprocess.Popen, service: str, log: pathlib.Path) -> str:
    """The address of a service :func:`_start` started, from its ``listening on`` line."""
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith(f"{service} listening on "):
        proc.kill()
        raise AssertionError(f"{service} did not start: {line!r}; see {log}")
    return line.split()[3]


def _serve(service: str, *flags: str, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """`zerokl serve SERVICE FLAGS` on a free loopback port (unless the flags name one); (process, address)."""
    proc = _start(service, *flags, log=log)
    return proc, _listening(proc, service, log)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(60)
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_job_whose_weight_store_dies_publishes_every_step_before_it_succeeds(tmp_path) -> None:
    """SIGKILL the weight store while an SFT job publishes every step, start it again on the same port a few
    seconds later: the scheduler tells the outage from a trainer restart (the trainer still holds its steps),
    retries the publish until the store is back, and the job succeeds only with all 10 steps published and
    served, each step reported once. The scheduler's log names the weight store, never a trainer restart."""
    log = tmp_path / "services.log"
    roots = tmp_path / "weights"
    procs: list[subprocess.Popen] = []
    try:
        store_proc, store = _serve("weight-store", "--root", str(roots), log=log)
        procs.append(store_proc)
        # The decode replica and the trainer start side by side (each needs only the store).
        decode_proc = _start("decode", "--preset", "tiny", "--threads", "1", "--weight-store", store, log=log)
        procs.append(decode_proc)
        trainer_proc = _start("trainer", "--weight-store", store, "--init", "preset:tiny:seed0",
                              "--threads", "1", "--run", "outage", "--lr=3e-3", log=log)
        procs.append(trainer_proc)
        decode, trainer = _listening(decode_proc, "decode", log), _listening(trainer_proc, "trainer", log)
        scheduler_log = tmp_path / "scheduler.log"
        scheduler_proc, scheduler = _serve("scheduler", "--decode", decode, "--trainer", trainer, "--weight-store",
                                           store, "--poll-interval", "0.5", log=scheduler_log)
        procs.append(scheduler_proc)
        steps = 10

        async def main() -> tuple[list[int], object]:
            async with JobsClient(scheduler) as jobs:
                job = await jobs.submit(SFTJobSpec(steps=steps, examples=EXAMPLES, batch_size=4, publish_every=1),
                                        "outage")
                seen, last = [], None
                async for ev in jobs.watch(job.job_id):
                    if ev.step is not None:
                        seen.append(ev.step)
                        if ev.step == 3 and procs[0] is store_proc:
                            _stop(store_proc, signal.SIGKILL)
                            await asyncio.sleep(3.0)
                            procs[0], _ = await asyncio.to_thread(
                                _serve, "weight-store", "--root", str(roots), "--port", store.rsplit(":", 1)[1],
                                log=log)
                    last = ev
                return seen, last
        seen, last = asyncio.run(main())
        assert procs[0] is not store_proc, "the job ended before the store was killed"
        assert last.status.state is JobState.SUCCEEDED, last.status.error  # type: ignore[attr-defined]
        assert seen == list(range(1, steps + 1))

        async def published() -> tuple[list[str], str, int]:
            async with WeightStoreClient(store) as weights, InferenceClient(scheduler) as inference, \
                    TrainerClient(trainer) as client:
                versions = [e.manifest.version for e in await weights.list()]
                return versions, (await inference.info()).weights_version, (await client.get_state()).step
        versions, served, trainer_step = asyncio.run(published())
        want = [f"outage-step{s:06d}" for s in range(steps + 1)]
        assert [v for v in versions if v.startswith("outage-")] == want
        assert served == last.status.weights_version == want[-1] and trainer_step == steps  # type: ignore[attr-defined]
        said = scheduler_log.read_text()
        assert "weight store is unreachable" in said and "trainer restarted" not in said
    finally:
        for proc in reversed(procs):
            _stop(proc)


def test_a_fingerprint_mismatch_fails_a_job_at_once_and_leaves_nothing_behind(tmp_path) -> None:
    """Issue 47, case 3 (the job's side): an fp32 checkpoint served in bf16 by the decode replica while the trainer
    trains it in fp32, so the trainer's versions carry another numerics fingerprint than the replica computes
    with. The replica's refusal is permanent: the RL job fails at once with FAILED_PRECONDITION naming the
    fingerprints (not FleetUnavailable after --fleet-wait), and leaves no debris: the version its start saved
    is deleted (unpinned first), and the trainer is back on the version the fleet serves."""
    log = tmp_path / "services.log"
    procs: list[subprocess.Popen] = []
    try:
        store_proc, store = _serve("weight-store", "--root", str(tmp_path / "weights"), log=log)
        procs.append(store_proc)
        checkpoint = tmp_path / "fp32"
        Model(CONFIG, seed=0).save_pretrained(checkpoint)

        async def publish() -> None:
            async with WeightStoreClient(store) as weights:
                await weights.publish(checkpoint, "1")
        asyncio.run(publish())
        decode_proc = _start("decode", "--model", str(checkpoint), "--weights-version", "1", "--dtype", "bfloat16",
                             "--weight-store", store, "--threads", "1", log=log)
        procs.append(decode_proc)
        trainer_proc = _start("trainer", "--weight-store", store, "--init", "1", "--threads", "1", "--run", "mixed",
                              log=log)
        procs.append(trainer_proc)
        decode, trainer = _listening(decode_proc, "decode", log), _listening(trainer_proc, "trainer", log)
        # --fleet-wait 30: an outage would be waited for that long (the old behaviour); this refusal is not one.
        scheduler_proc, scheduler = _serve("scheduler", "--decode", decode, "--trainer", trainer, "--weight-store",
                                           store, "--poll-interval", "0.5", "--fleet-wait", "30", log=log)
        procs.append(scheduler_proc)

        async def main() -> None:
            async with JobsClient(scheduler) as jobs, WeightStoreClient(store) as weights, \
                    TrainerClient(trainer) as client, InferenceClient(scheduler) as inference:
                fingerprints = {(await client.info()).numerics_fingerprint,
                                (await inference.info()).numerics_fingerprint}
                assert len(fingerprints) == 2, fingerprints     # the setup: two numerics
                events = await _run(jobs, RLJobSpec(steps=2, countdown=CountdownTask(train_problems=50,
                                                                                    test_problems=4),
                                                    prompts_per_step=2, group_size=2, max_tokens=4), "mixed")
                final = events[-1].status
                assert final.state is JobState.FAILED and final.error.startswith("FAILED_PRECONDITION:"), final
                assert "numerics fingerprint" in final.error and "FleetUnavailable" not in final.error, final.error
                assert "mixed-step000000 was deleted from the weight store" in final.error, final.error
                assert [e.manifest.version for e in await weights.list()] == ["1"]
                state = await client.get_state()
                assert (state.weights_version, state.step, state.accumulated_batches) == ("1", 0, 0)
                assert (await inference.info()).weights_version == "1"
        asyncio.run(main())
    finally:
        for proc in reversed(procs):
            _stop(proc)


# ----------------------------------------------------------------------------- the fleet switch (in process)

@contextlib.asynccontextmanager
async def _store(root: pathlib.Path, versions: dict[str, Model]) -> AsyncIterator[str]:
    """A weight-store service over ``root`` holding ``versions``; yields its address."""
    server = ServiceServer("weight-store")
    add_weight_store(server, VersionStore(LocalDirBackend(root)), ServiceIdentity("weight-store", root.name))
    await server.start()
    try:
        async with WeightStoreClient(server.address) as client:
            for name, model in versions.items():
                model.save_pretrained(root.parent / f"{root.name}-{name}")
                await client.publish(root.parent / f"{root.name}-{name}", name, numerics_version=numerics_version)
        yield server.address
    finally:
        await server.drain(0)


@contextlib.asynccontextmanager
async def _decode(model: Model, store: str) -> AsyncIterator[str]:
    """A decode replica serving ``model`` as v1, switching weights from ``store``; yields its address."""
    replica = Replica(AsyncEngine(Engine(model, EngineConfig(), TOKENIZER)), make_identity("decode", model, "v1"),
                      TOKENIZER)
    replica.engine.start()
    server = ServiceServer("decode")
    client = WeightStoreClient(store)
    switcher = WeightSwitcher(replica, client, not_serving=server.not_serving)
    add_decode_service(server, Decoder(replica), switcher.switch)
    await server.start()
    try:
        yield server.address
    finally:
        await server.drain(0)
        await switcher.close()
        await client.close()
        await replica.engine.close()


def test_the_fleet_switches_only_after_a_canary_and_a_failed_switch_puts_every_replica_back(tmp_path) -> None:
    """Two decode replicas behind a real scheduler, on v1. Switching to weights that cannot serve (one NaN
    weight) fails its canary on the first replica: FAILED_PRECONDITION, the second never switches. Switching to
    v2 where the second replica cannot fetch it: the first switches back. Both times every replica still
    serves v1 with the same bits; v2 once both stores hold it is served everywhere."""
    v1, v2 = Model(CONFIG, seed=0), Model(CONFIG, seed=1)
    broken = Model(CONFIG, seed=2)
    with torch.no_grad():
        broken.embed_tokens.weight[5, 0] = float("nan")

    async def main() -> None:
        async with _store(tmp_path / "a", {"v1": v1, "v2": v2, "broken": broken}) as store_a, \
                _store(tmp_path / "b", {"v1": v1, "broken": broken}) as store_b, \
                _decode(Model(CONFIG, seed=0), store_a) as decode_a, \
                _decode(Model(CONFIG, seed=0), store_b) as decode_b, \
                scheduler_server([decode_a, decode_b]) as (server, _), InferenceClient(server.address) as client:
            async def served() -> list[str]:
                out = []
                for address in (decode_a, decode_b):
                    async with InferenceClient(address) as replica:
                        out.append((await replica.info()).weights_version)
                return out

            before = await client.generate_all(PROBE)
            assert before.weights_version == "v1"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.switch_weights("broken")
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
            assert "failed its canary" in err.value.details() and "no other replica switched" in err.value.details()
            assert "switched back to v1" in err.value.details(), err.value.details()
            assert await served() == ["v1", "v1"]
            assert _numbers(await client.generate_all(PROBE)) == _numbers(before)

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.switch_weights("v2")
            assert decode_b in err.value.details() and "switched back to v1" in err.value.details(), \
                err.value.details()
            assert await served() == ["v1", "v1"]
            after = await client.generate_all(PROBE)
            assert after.weights_version == "v1" and _numbers(after) == _numbers(before)

            async with WeightStoreClient(store_b) as b:
                await b.publish(tmp_path / "a-v2", "v2")
            assert (await client.switch_weights("v2")).weights_version == "v2"
            assert await served() == ["v2", "v2"]
    asyncio.run(main())


def test_a_job_the_scheduler_stopped_during_is_listed_as_failed_saying_so(tmp_path) -> None:
    """Records of a scheduler that stopped mid-job (its jobs.json as the job's last step left it): the next
    scheduler on that state directory lists the job FAILED with the reason and replays its steps once."""
    from zerokl.services.jobs.manager import JOBS_FILE, JobManager

    async def first() -> str:
        manager = JobManager(None, None, None, state_dir=tmp_path)  # type: ignore[arg-type]
        await manager.start()
        job = manager._jobs.setdefault("j1", _running_job())
        manager._emit(job, 1, "run-step000001", {"loss": 1.5})
        await manager.close()
        return job.job_id

    async def second(job_id: str) -> None:
        manager = JobManager(None, None, None, state_dir=tmp_path)  # type: ignore[arg-type]
        await manager.start()
        [status] = manager.list()
        assert (status.job_id, status.state, status.step, status.total_steps) == (job_id, JobState.FAILED, 1, 5)
        assert "the scheduler stopped while this job was running (at step 1)" in status.error
        events = [ev async for ev in manager.watch(job_id)]
        assert [(ev.step, ev.weights_version, ev.metrics) for ev in events if ev.step is not None] == \
            [(1, "run-step000001", {"loss": 1.5})]
        assert events[-1].status.state is JobState.FAILED
        await manager.close()

    job_id = asyncio.run(first())
    assert (tmp_path / JOBS_FILE).exists()
    asyncio.run(second(job_id))


def _running_job():  # noqa: ANN202 - the manager's private record type
    from zerokl.services.jobs.manager import _Job
    job = _Job("j1", "sft", "sft", 5, SFTJobSpec(steps=5, examples=EXAMPLES, batch_size=4), JobState.RUNNING)
    job.started, job.step = time.time(), 1
    return job
