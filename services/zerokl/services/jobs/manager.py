"""Training jobs the scheduler runs on its trainer: SFT, DPO and on-policy RL (GRPO).

A job is the managed form of the loop a user could drive through the trainer's
low-level API. The scheduler runs one job at a time, in submission order:

* **RL**: sample prompts -> Generate n per prompt through the scheduler, pinned to
  the version the fleet serves -> rewards -> ForwardBackward(ppo) + OptimStep on
  the trainer -> SaveWeights(share) -> SwitchWeights on every replica -> next step,
  while the weight store records the versions someone reads in the background (the trainer
  state only every ``checkpoint_every`` steps; weights-only versions nobody read are superseded;
  see :class:`_TrainerSession`). The loop
  itself is :func:`~zerokl.services.rl.loop.run_rl`; here it gets ports that speak gRPC.
* **SFT / DPO**: batches -> ForwardBackward + OptimStep; publish and switch the
  fleet every ``publish_every`` steps and at the end.

Every step becomes a :class:`JobEvent` that watchers receive (past steps are
replayed first), once per step: a step redone after a trainer restart computes
the same bits and is not reported again. A trainer that restarts mid-job (it
resumes from its newest published resume point) is waited for and the steps
since that point are redone (an RL job's from the rollouts it kept), so no step
is lost or applied twice.
A prefill or decode replica that restarts mid-job is waited for the same way
(bounded by ``fleet_wait_s``): rollouts that failed on it are generated again,
pinned and seeded as before, so they are the same bits, and a fleet switch is
tried again once the fleet is back.

A job succeeds only when every step it trained is published. A weight-store
outage is told apart from a trainer restart (the trainer still holds its
unpublished steps): publishing is retried until the store is back, or the job
fails with :class:`WeightStoreUnavailable`. Each new version is served only
after its canary passes (:meth:`Scheduler.switch_weights`); a version that
fails it fails the job with :class:`CanaryFailed`, the trainer is rolled back
to the last good version and the rejected one is deleted from the store, so no
restart serves or resumes from it. A job that fails after saving a version but
before the fleet switched to it deletes that version the same way: it never
passed a canary, and the next job's step of the same number must be free to publish.

With a state directory, job records (status and step events) are kept in
``jobs.json`` there and survive a scheduler restart; a job that was queued or
running when the scheduler stopped is reported FAILED, saying so.

A job runs in a worker thread; its ports call into the event loop, where the
scheduler and the gRPC clients live.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import pathlib
import random
import threading
import time
import uuid
import dataclasses
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, NoReturn, Sequence, TypeVar

import grpc
import grpc.aio

from zerokl.services.inference.types import GenerateResult, InferenceRequest
from zerokl.services.runtime.errors import (CanaryFailed, FailedPrecondition, InvalidArgument, NotFound, RelayedError,
                                           ServiceError, Unavailable, UnservedPin)
from zerokl.services.jobs.types import (CountdownTask, DPOJobSpec, JobEvent, JobSpec, JobState, JobStatus, RLJobSpec,
                                       SFTJobSpec)
from zerokl.services.rl.loop import StepRecord, Task, as_dict, run_rl
from zerokl.services.rl.ports import Sampled, sampling_seed
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.config import MAX_LR, TrainConfig, check_train_config
from zerokl.services.trainer.store_marks import META_STATE, pin_owner
from zerokl.services.trainer.types import Recorded, TrainerState, dpo_pair_violations
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.shared import SharedExport
from zerokl.services.weightstore.store import WeightsManifest
from zerokl.vocab import InvalidOption, Rollout, SamplingOptions

__all__ = ["JobCancelled", "JobManager", "WeightStoreUnavailable", "TrainerUnavailable", "FleetUnavailable",
           "VersionNotDurable", "RecordPending", "JOBS_FILE", "RECORD_LAG", "validate"]

log = logging.getLogger(__name__)
T = TypeVar("T")

JOBS_FILE = "jobs.json"         # job records in the scheduler's state directory
_OUTAGE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# What RecordWeights answers for a record that ended for good without the store committing it: the record process
# failed (INTERNAL), the store refused (ALREADY_EXISTS, DATA_LOSS, FAILED_PRECONDITION).
_RECORD_FAILED = (grpc.StatusCode.INTERNAL, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DATA_LOSS,
                  grpc.StatusCode.FAILED_PRECONDITION)
# How long a job's start waits for the trainer to say where the record of the version the fleet serves stands.
_RECORD_PROBE_S = 2.0
# How long a call made past its waiter's deadline may still take (:meth:`_TrainerSession._left`): a record that ended
# answers a RecordWeights at once, and a weight store that answers does a Delete in far less.
_RECORD_POLL_S = 1.0
# An RL job's checkpoints (versions recorded with the trainer state) not yet recorded in the weight store, at
# most: a step waits for the oldest beyond it. Each holds its snapshot (the serving bytes, the fp32 masters and
# AdamW moments) in the trainer's memory. A step never waits for a weights-only record: the trainer supersedes
# those nobody reads (SaveWeights(supersede)), which bounds their snapshots without a wait.
RECORD_LAG = 2


# ----------------------------------------------------------------------------- validation

def validate(spec: JobSpec) -> None:
    """INVALID_ARGUMENT naming the first bad field of ``spec``.

    Checked by meaning, as a Generate request is, before the job is accepted: RL sampling
    options go through :meth:`SamplingOptions.check` (finite, float32-safe ranges), a
    learning rate must be finite and at most the ceiling :data:`MAX_LR`, a ``train_config``
    passes :meth:`TrainConfig.check` (``train_config.<field>``), and no DPO pair prefers a
    completion to itself: what the trainer would refuse is refused here, by the same name.
    """
    if spec.steps <= 0:
        raise InvalidArgument.field(f"{spec.kind}.steps", f"must be > 0, got {spec.steps}")
    if not (math.isfinite(spec.learning_rate) and 0.0 <= spec.learning_rate <= MAX_LR):
        raise InvalidArgument.field("learning_rate", f"must be finite, >= 0 and at most {MAX_LR:g} (the learning "
                                                     f"rate ceiling; 0: the trainer's schedule), "
                                                     f"got {spec.learning_rate!r}")
    if spec.train_config is not None:
        check_train_config(spec.train_config, "train_config")
    if isinstance(spec, SFTJobSpec):
        if spec.batch_size <= 0:
            raise InvalidArgument.field("sft.batch_size", "must be > 0")
        if spec.countdown is None and not spec.examples:
            raise InvalidArgument.field("sft.data", "set countdown or examples")
        if spec.examples and len(spec.examples) < spec.batch_size:
            raise InvalidArgument.field("sft.batch_size", f"{spec.batch_size} exceeds the {len(spec.examples)} "
                                                          "examples given")
    elif isinstance(spec, DPOJobSpec):
        if not spec.pairs:
            raise InvalidArgument.field("dpo.pairs", "no preference pairs given: a DPO job needs at least "
                                                     "batch_size (chosen, rejected) pairs")
        if spec.batch_size <= 0 or len(spec.pairs) < spec.batch_size:
            raise InvalidArgument.field("dpo.batch_size", f"must be in 1..{len(spec.pairs)} (the pairs given), "
                                                          f"got {spec.batch_size}")
        same = dpo_pair_violations(spec.pairs, "dpo.pairs")
        if same:
            raise InvalidArgument.field(same[0].field, same[0].description + (
                f" (and {len(same) - 1} more pair(s) like it)" if len(same) > 1 else ""))
    else:
        if spec.group_size < 2:
            raise InvalidArgument.field("rl.group_size", "GRPO needs at least 2 samples per prompt")
        if spec.prompts_per_step <= 0 or spec.max_tokens <= 0:
            raise InvalidArgument.field("rl.prompts_per_step", "prompts_per_step and max_tokens must be > 0")
        try:
            SamplingOptions(temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens,
                            n=spec.group_size).check()
        except InvalidOption as err:
            raise InvalidArgument.field(f"rl.{err.field}", str(err)) from None
        if spec.temperature == 0.0:
            raise InvalidArgument.field("rl.temperature", "RL samples need temperature > 0 (0 is greedy)")
        if spec.checkpoint_every < 0:
            raise InvalidArgument.field("rl.checkpoint_every", f"must be >= 0 (0: never), got {spec.checkpoint_every}")
        from zerokl.tasks.synthetic import REWARDS
        if spec.reward not in REWARDS:
            raise InvalidArgument.field("rl.reward", f"{spec.reward!r} is none of {', '.join(REWARDS)}")
    if getattr(spec, "countdown", None) is not None:
        c = spec.countdown
        if c.train_problems < 1 or c.test_problems < 1 or c.train_problems > 100_000:
            raise InvalidArgument.field("countdown", "train_problems in 1..100000 and test_problems >= 1")


# ----------------------------------------------------------------------------- errors and job records

class JobCancelled(Exception):
    """Raised inside a job's thread at the next step boundary after CancelJob."""


class WeightStoreUnavailable(Unavailable):
    """The weight store stayed unreachable while a job had trained steps to publish."""


class TrainerUnavailable(Unavailable):
    """The trainer stayed unreachable longer than the job waits for a restart."""


class FleetUnavailable(Unavailable):
    """The prefill/decode fleet could not serve the job longer than it waits for a replica restart."""


class RecordPending(Unavailable):
    """A version's record did not end (committed or failed) within the time waited for it: it may land later."""


class VersionNotDurable(FailedPrecondition):
    """A version the job shared in place never reaches the weight store: its record failed, or the trainer
    restarted before it landed (:meth:`_TrainerSession._rollback` goes back past it)."""


def _fleet_outage(err: BaseException) -> bool:
    """Whether ``err`` says the fleet cannot serve right now (a replica down or coming back), not that the
    request or the weights are bad: UNAVAILABLE, or a pinned version no replica serves at the moment."""
    if isinstance(err, UnservedPin):
        return True
    code = err.code() if isinstance(err, grpc.aio.AioRpcError) else getattr(err, "code", None)
    return code in _OUTAGE


@dataclass
class _Job:
    job_id: str
    name: str
    kind: str
    total_steps: int
    spec: JobSpec | None              # None for a record read back after a scheduler restart (it cannot run)
    state: JobState = JobState.QUEUED
    step: int = 0
    weights_version: str = ""
    error: str = ""
    started: float | None = None      # wall-clock seconds (records outlive the process)
    ended: float | None = None
    train_config: TrainConfig | None = None   # the effective hyperparameters, once started
    events: list[JobEvent] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> JobStatus:
        end = self.ended or time.time()
        return JobStatus(self.job_id, self.name, self.kind, self.state, self.step, self.total_steps,
                         self.weights_version, self.error, 0.0 if self.started is None else end - self.started,
                         self.train_config)


def _job_to_json(job: _Job) -> dict[str, Any]:
    """A job's record as ``jobs.json`` keeps it: status fields and its step events."""
    return {"job_id": job.job_id, "name": job.name, "kind": job.kind, "total_steps": job.total_steps,
            "state": job.state.value, "step": job.step, "weights_version": job.weights_version, "error": job.error,
            "started": job.started, "ended": job.ended,
            "steps": [{"step": e.step, "weights_version": e.weights_version, "metrics": e.metrics}
                      for e in job.events if e.step is not None]}


def _job_from_json(d: dict[str, Any]) -> _Job:
    """A record read back; a job the previous scheduler left unfinished is FAILED, saying why."""
    job = _Job(d["job_id"], d["name"], d["kind"], int(d["total_steps"]), None, JobState(d["state"]), int(d["step"]),
               d["weights_version"], d["error"], d["started"], d["ended"])
    if not job.state.done:
        job.error = (f"the scheduler stopped while this job was {job.state.value} (at step {job.step}); "
                     "submit it again")
        job.state, job.ended = JobState.FAILED, job.ended or time.time()
    for e in d["steps"]:
        job.events.append(JobEvent(job.status(), int(e["step"]), e["weights_version"],
                                   {k: float(v) for k, v in e["metrics"].items()}))
    job.events.append(JobEvent(job.status()))
    return job


# ----------------------------------------------------------------------------- the manager

class JobManager:
    """Queues jobs and runs them one at a time against ``trainer`` and the scheduler's fleet.

    ``generate(request)`` streams GenerateDeltas through the scheduler (pinned
    requests); ``switch_weights(version)`` switches every replica after a
    canary (raising :class:`CanaryFailed` when the version fails it).
    ``weight_store``: the store the trainer publishes to, where versions that
    fail their canary are deleted (without one they stay, and the job says so).
    ``served_version()``: the version the fleet serves now (on the event loop): where
    a job that fails before serving a version of its own takes the trainer back.
    ``sleep_fleet()`` (co-location: the fleet and the trainer share a device): put every replica to
    sleep before each RL step trains; the step's weight switch wakes them (None: they stay awake).
    ``state_dir``: where job records are kept across restarts (None: memory
    only). A job waits up to ``trainer_wait_s`` for a restarting trainer,
    ``fleet_wait_s`` for a restarting prefill/decode replica and
    ``store_wait_s`` for an unreachable weight store, for the trainer's
    records and for the store's answers (:meth:`_TrainerSession._records_deadline`).
    """

    def __init__(self, trainer: TrainerClient | None, generate: Callable[[InferenceRequest], AsyncIterator[Any]],
                 switch_weights: Callable[[str], Awaitable[Any]], *, weight_store: WeightStoreClient | None = None,
                 state_dir: str | os.PathLike[str] | None = None, trainer_wait_s: float = 120.0,
                 fleet_wait_s: float = 120.0, store_wait_s: float = 120.0,
                 served_version: Callable[[], str] = lambda: "",
                 sleep_fleet: Callable[[], Awaitable[Any]] | None = None,
                 wake_fleet: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.trainer = trainer
        self._sleep_fleet, self._wake_fleet = sleep_fleet, wake_fleet   # co-location (_TrainerSession._colocated)
        self.weight_store = weight_store
        self._served_version = served_version
        self._generate = generate
        self._switch = switch_weights
        self.trainer_wait_s = trainer_wait_s
        self.fleet_wait_s = fleet_wait_s
        self.store_wait_s = store_wait_s
        self._records = pathlib.Path(state_dir) / JOBS_FILE if state_dir is not None else None
        self._jobs: dict[str, _Job] = {}
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._runner: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Read the records a previous scheduler left (if any), then run queued jobs."""
        self._loop = asyncio.get_running_loop()
        if self._records is not None:
            self._records.parent.mkdir(parents=True, exist_ok=True)
            if self._records.exists():
                try:
                    jobs = [_job_from_json(d) for d in json.loads(self._records.read_text())["jobs"]]
                except (ValueError, KeyError, TypeError) as err:
                    raise RuntimeError(f"{self._records} is not a job record file: {err}") from None
                self._jobs = {j.job_id: j for j in jobs}
                self._save_records()
        self._runner = asyncio.ensure_future(self._run_queue())

    async def close(self) -> None:
        for job in self._jobs.values():
            job.cancel.set()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner

    # ---- API ------------------------------------------------------------------

    def submit(self, spec: JobSpec, name: str = "") -> JobStatus:
        if self.trainer is None:
            raise FailedPrecondition("this scheduler has no trainer configured (--trainer ADDR)")
        validate(spec)
        job = _Job(uuid.uuid4().hex[:12], name or spec.kind, spec.kind, spec.steps, spec)
        self._jobs[job.job_id] = job
        self._emit(job)
        self._queue.put_nowait(job)
        return job.status()

    def get(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        return job

    def list(self) -> list[JobStatus]:
        return [j.status() for j in self._jobs.values()]

    def cancel(self, job_id: str) -> JobStatus:
        job = self.get(job_id)
        if not job.state.done:
            job.cancel.set()
            if job.state is JobState.QUEUED:
                self._finish(job, JobState.CANCELLED)
        return job.status()

    async def watch(self, job_id: str) -> AsyncIterator[JobEvent]:
        """Every event of the job from its start, then live ones, until it ends."""
        job = self.get(job_id)
        seen = 0
        yield JobEvent(job.status())
        while True:
            while seen < len(job.events):
                event = job.events[seen]
                seen += 1
                if event.step is not None:
                    yield event
            if job.state.done:
                yield JobEvent(job.status())
                return
            job.changed.clear()  # nothing new since the drain above: events arrive on this loop only
            await job.changed.wait()

    # ---- running --------------------------------------------------------------

    def _emit(self, job: _Job, step: int | None = None, version: str = "", metrics: dict | None = None) -> None:
        job.events.append(JobEvent(job.status(), step, version, dict(metrics or {})))
        job.changed.set()
        self._save_records()

    def _save_records(self) -> None:
        """Rewrite ``jobs.json`` (atomically: a crash leaves the old or the new file, never half of one)."""
        if self._records is None:
            return
        tmp = self._records.with_suffix(".tmp")
        tmp.write_text(json.dumps({"jobs": [_job_to_json(j) for j in self._jobs.values()]}))
        tmp.replace(self._records)

    def _finish(self, job: _Job, state: JobState, error: str = "") -> None:
        job.state, job.error, job.ended = state, error, time.time()
        self._emit(job)

    async def _run_queue(self) -> None:
        while True:
            job = await self._queue.get()
            if job.state is not JobState.QUEUED:
                continue  # cancelled while queued
            job.state, job.started = JobState.RUNNING, time.time()
            self._emit(job)
            try:
                await asyncio.to_thread(self._run_job, job)
                self._finish(job, JobState.SUCCEEDED)
            except JobCancelled:
                self._finish(job, JobState.CANCELLED)
            except Exception as err:  # noqa: BLE001 - a failed job must not stop the queue
                log.exception("job %s failed", job.job_id)
                self._finish(job, JobState.FAILED, _describe(err))

    async def _wait_fleet(self, job: _Job, deadline: float | None, what: str, err: BaseException) -> float:
        """Wait a moment while the fleet is out (on the event loop); the deadline to keep; FleetUnavailable
        past ``fleet_wait_s``."""
        now = time.monotonic()
        deadline = deadline or now + self.fleet_wait_s
        if now > deadline:
            raise FleetUnavailable(f"the fleet could not serve the job for {self.fleet_wait_s:g} s ({what}): "
                                   f"{err}") from None
        log.warning("job %s: %s (%s); waiting for the fleet", job.job_id, what, err)
        await asyncio.sleep(0.5)
        if job.cancel.is_set():
            raise JobCancelled()
        return deadline

    def served_version(self) -> str:
        """From the job's thread: the version the fleet serves now ("" when none is known)."""
        async def read() -> str:
            return self._served_version()
        return self._call(read())

    def _call(self, coro: Awaitable[T]) -> T:
        """From the job's thread: run ``coro`` on the event loop and wait for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def _step_done(self, job: _Job, step: int, version: str, metrics: dict[str, float], stoppable: bool = True) -> None:
        """Step ``step`` finished; ``version`` is what it published ("" when it published none). A cancelled
        job stops here when ``stoppable`` (an RL job: after a step whose record is a resume point)."""
        def apply() -> None:
            job.weights_version = version or job.weights_version
            if step <= job.step:
                # Redone after a trainer restart: the same batch from the same weights gives the same
                # bits, and watchers have seen this step already.
                return
            job.step = step
            self._emit(job, step, version, metrics)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(apply)
        if job.cancel.is_set() and stoppable:
            raise JobCancelled()

    def _run_job(self, job: _Job) -> None:
        """Run ``job``; when it fails, the steps it trained but did not publish are dropped from the trainer
        (so the next job starts from weights the fleet served), and the job's error says so."""
        assert job.spec is not None
        trainer = _TrainerSession(self, job)
        # An RL job's problems are made (or found made: _countdown_data) beside the trainer's start, which waits on
        # the trainer and the fleet: 20,000 countdown problems take seconds of the job's start on their own.
        data = None
        if isinstance(job.spec, RLJobSpec):
            data = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerokl-job-data")
            problems = data.submit(_countdown_data, job.spec.countdown)
        try:
            t0 = time.perf_counter()
            version = trainer.start()
            started = time.perf_counter()
            self._loop.call_soon_threadsafe(lambda: setattr(job, "weights_version", version))  # type: ignore
            if isinstance(job.spec, RLJobSpec):
                problems.result()
                log.info("job %s: started on %s in %.2f s (the trainer's share and the fleet's switch %.2f s, then "
                         "the task's problems %.2f s more)", job.job_id, version, time.perf_counter() - t0,
                         started - t0, time.perf_counter() - started)
                self._run_rl(job, job.spec, trainer)
            else:
                self._run_supervised(job, job.spec, trainer)
        except JobCancelled:
            raise
        except Exception as err:
            note = trainer.discard_unpublished()
            if note:
                err.add_note(note)
            raise
        finally:
            if data is not None:
                data.shutdown(wait=False)

    def _run_rl(self, job: _Job, spec: RLJobSpec, trainer: "_TrainerSession") -> None:
        from zerokl.tasks.setup import encode_prompt
        from zerokl.tasks.countdown import reward
        from zerokl.tasks.synthetic import vowel_share
        train, test, tok = _countdown_data(spec.countdown)
        task = Task(train, test, lambda p: encode_prompt(p, tok), vowel_share if spec.reward == "vowel_share" else reward)
        port = _FleetRollouts(self, job)

        def on_step(record: StepRecord) -> None:
            metrics = {k: float(v) for k, v in as_dict(record).items()
                       if k not in ("step", "weights_version") and v is not None}
            # A cancelled RL job stops after a checkpoint: the version it leaves the trainer at is a resume
            # point in the store (its name is taken: a weights-only record cannot become one later). A
            # cancel makes the next step a checkpoint (_TrainerSession._checkpoint_due).
            self._step_done(job, record.step, record.weights_version, metrics, stoppable=bool(record.checkpoint))

        run_rl(task, port, trainer, spec, on_step)
        trainer._unit(lambda: (trainer.await_end(), {})[1])

    def _run_supervised(self, job: _Job, spec: SFTJobSpec | DPOJobSpec, trainer: "_TrainerSession") -> None:
        if isinstance(spec, SFTJobSpec):
            if spec.countdown is not None:
                from zerokl.tasks.setup import demonstration_batch
                train, _, tok = _countdown_data(spec.countdown)
                data: Sequence[Any] = demonstration_batch(train, tok)
            else:
                data = spec.examples
        else:
            data = spec.pairs
        data = list(data)
        base = trainer.base_step
        step = 0
        while step < spec.steps:
            # A step's batch depends only on (seed, step): a step redone after a trainer restart sees the same data.
            batch = random.Random(f"{spec.seed}:{step}").sample(data, spec.batch_size)
            published = ""
            try:
                m = trainer.supervised_step(spec.kind, batch, first=step == 0)
                step += 1
                if step == spec.steps or (spec.publish_every and step % spec.publish_every == 0):
                    trainer.publish_now()
                    published = trainer.weights_version
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                # The trainer restarted from its newest published version: continue from the step it holds.
                state = trainer.recover()
                step = state.step - base
                log.warning("trainer restarted; job %s continues at step %d", job.job_id, step + 1)
                continue
            self._step_done(job, step, published, m)


@functools.lru_cache(maxsize=4)
def _countdown_data(task: CountdownTask) -> tuple[Any, Any, Any]:
    """(train, test, tokenizer) of ``task``, made once per task: generating 20000 problems (each solved to
    check it is reachable) is most of a job's first step on a small CPU, and the next job of the same task,
    as the demo's RL job after its SFT job, reads the same problems."""
    from zerokl.tasks.setup import countdown_data
    return countdown_data(task.seed, task.train_problems, task.test_problems)


def _describe(err: BaseException) -> str:
    """A failed job's error: the cause by name, then what was done about it (the exception's notes)."""
    if isinstance(err, grpc.aio.AioRpcError):
        text = f"{err.code().name}: {err.details()}"
    elif isinstance(err, RelayedError):     # a replica's refusal, passed on: its status by code
        text = f"{err.code.name}: {err.message}"
    else:
        text = f"{type(err).__name__}: {err}"
    return "; ".join([text, *getattr(err, "__notes__", ())])


# ----------------------------------------------------------------------------- ports over gRPC

class _FleetRollouts:
    """RolloutPort: Generate through the scheduler, every request pinned to the version being updated."""

    def __init__(self, manager: JobManager, job: _Job) -> None:
        self.manager, self.job = manager, job

    def generate(self, prompts, options, weights_version):  # noqa: ANN001, ANN201
        async def one(i: int, ids: tuple[int, ...]) -> GenerateResult:
            request = InferenceRequest(prompt_ids=ids, options=dataclasses.replace(
                options, seed=sampling_seed(options.seed + i)), weights_version=weights_version)
            return GenerateResult.collect([d async for d in self.manager._generate(request)])

        async def all_prompts() -> list[GenerateResult]:
            results: list[GenerateResult | None] = [None] * len(prompts)
            deadline = None
            while True:
                todo = [i for i, r in enumerate(results) if r is None]
                outs = await asyncio.gather(*(one(i, prompts[i]) for i in todo), return_exceptions=True)
                failed = []
                for i, out in zip(todo, outs, strict=True):
                    if not isinstance(out, BaseException):
                        results[i] = out
                    elif _fleet_outage(out):
                        failed.append(out)
                    else:
                        raise out
                if not failed:
                    return results  # type: ignore[return-value]
                # A replica is restarting: the same pinned, seeded requests give the same bits when it is back.
                deadline = await self.manager._wait_fleet(self.job, deadline, f"{len(failed)} rollouts failed",
                                                          failed[0])

        results = self.manager._call(all_prompts())
        return [[Sampled(tuple(p), tuple(s.token_ids), tuple(s.logprobs), s.text, r.weights_version)
                 for s in r.samples] for p, r in zip(prompts, results, strict=True)]


class _Restarted(Exception):
    """The trainer forgot a version it shared (it restarted): :meth:`_TrainerSession._unit` recovers."""


@dataclass(frozen=True)
class _SharedStep:
    """An RL step whose version the fleet serves, kept until a full checkpoint at or after it is recorded:
    what the job redoes on a trainer that resumed from an earlier checkpoint."""

    parent: str                     # the version it trained from (its rollouts were sampled under it)
    version: str
    rollouts: tuple[Rollout, ...]
    group_size: int
    weights_only: bool              # recorded without the trainer state (not a resume point)
    checksum: str                   # of the serving bytes shared: a redo must give the same


class _Durability:
    """Which of an RL job's versions are durable (their store record landed), for its step events: the newest
    durable version's job step and the newest durable resume point's, and what the records that landed since
    the last report cost (bytes of the versions, bytes the store wrote: deltas write what changed, seconds)."""

    def __init__(self) -> None:
        self._steps: dict[str, tuple[int, bool]] = {}   # version -> (job step, carries the trainer state)
        self._start = ""                                # the job's start version when shared with its state
        self._start_landed = False
        self.durable_step = self.checkpoint_step = -1.0  # -1: none of the job's versions is durable yet
        self._bytes = self._written = self._seconds = 0.0
        self._superseded = 0                            # versions superseded (never recorded) since the last report
        self.superseded_total = 0

    def checkpoint(self, version: str) -> bool:
        """Whether ``version`` was shared with its trainer state (a resume point once recorded)."""
        return self._steps.get(version, (-1, False))[1]

    def shared(self, version: str, step: int, checkpoint: bool) -> None:
        self._steps[version] = (step, checkpoint)
        if step == 0 and checkpoint:
            self._start = version

    def first_checkpoint(self, pending: bool = False) -> str:
        """The job's start version once recorded (with ``pending``: also while its record is on the way)."""
        return self._start if self._start_landed or pending else ""

    def landed(self, version: str, recorded: Recorded | None) -> None:
        """``version``'s record is done: committed (``recorded``; None: the store held it already), or superseded
        (never recorded, never durable: counted apart)."""
        if recorded is not None and recorded.manifest is None:
            self._superseded += 1
            self.superseded_total += 1
            return
        step, checkpoint = self._steps.get(version, (-1, False))
        if recorded is not None:    # what the store holds says (a same-named weights-only version carries no state)
            checkpoint = recorded.manifest.spec.metadata.get(META_STATE) == "full"
        self.durable_step = max(self.durable_step, float(step))
        if checkpoint:
            self.checkpoint_step = max(self.checkpoint_step, float(step))
        self._start_landed |= version == self._start and checkpoint
        if recorded is not None:
            assert recorded.manifest is not None
            self._bytes += recorded.manifest.total_size
            self._written += recorded.manifest.stored_size
            self._seconds += recorded.record_s

    def report(self) -> dict[str, float]:
        out = {"durable_step": self.durable_step, "checkpoint_step": self.checkpoint_step,
               "record_bytes": self._bytes, "record_written_bytes": self._written, "record_s": self._seconds,
               "superseded": float(self._superseded)}
        self._bytes = self._written = self._seconds = 0.0
        self._superseded = 0
        return out


class _TrainerSession:
    """TrainerPort over TrainerClient, with the fleet switched after every publish.

    An RL step is one unit (ForwardBackward(ppo), OptimStep, SaveWeights(share), the fleet's
    switch). Its version is recorded in the weight store in the background: with the trainer state (a
    resume point) every ``checkpoint_every`` steps and at the job's last, of which at most
    :data:`RECORD_LAG` are ever unrecorded (the next step waits for the oldest beyond that); weights
    only otherwise, and then only if nobody reads it: the trainer supersedes a weights-only version
    whose record has not started once the fleet serves a newer one (ARCHITECTURE.md, "Durable
    versions"), and no step waits for one. The steps since the newest recorded full checkpoint are kept: when the
    trainer restarts (UNAVAILABLE, or a record it no longer knows), the session waits for it,
    reads where it resumed (that checkpoint, or a later one whose record landed) and redoes every
    kept step after it from the same rollouts: the same bits (checked against each version's
    checksum) and the same version names, so the fleet keeps serving and KL stays 0. A trainer that
    answers and still holds its steps did not restart: then the weight store is out, and
    recording is retried until it is back (see the module docstring).
    """

    def __init__(self, manager: JobManager, job: _Job) -> None:
        self.manager, self.job = manager, job
        self.client = manager.trainer
        self.weights_version = ""          # the version the fleet serves that the trainer's steps build on
        self.started = False               # past the checks of start(): from here a failure rolls the trainer back
        self.rejected = False              # a version failed its canary: _reject rolled back, and its error says how
        # What the fleet served when the job started: where a failure takes the trainer back before the job
        # serves a version of its own (loaded under the trainer's configuration from before the job when it
        # has no trainer state).
        self.served = ""
        self.config: TrainConfig | None = None
        self.base_step = 0
        self.trainer_step = 0           # the trainer's step counter after our last OptimStep
        self.unswitched = ""            # a version saved that the fleet has not switched to yet
        self._last: dict[str, Any] = {}
        # RL steps publish in place (SaveWeights with share): the versions the fleet served may not be
        # in the store yet, and only checkpoints are resume points.
        self.unrecorded: list[str] = []     # versions shared whose store record is pending, oldest first
        self.checkpoint = ""                # the newest full checkpoint known recorded (a resume point)
        self._kept: list[_SharedStep] = []  # the steps since it, oldest first
        self.durability = _Durability()     # which versions are durable, and what their records cost

    def _call(self, coro: Awaitable[T]) -> T:
        return self.manager._call(coro)

    @property
    def _resume_points(self) -> bool:
        """Whether the job records the trainer state at all (an RL job with checkpoint_every 0 does not)."""
        spec = self.job.spec
        return not isinstance(spec, RLJobSpec) or spec.checkpoint_every > 0

    def _sleep(self, seconds: float) -> None:
        if self.job.cancel.wait(seconds):
            raise JobCancelled()

    def start(self) -> str:
        """Publish the trainer's current weights (a no-op when already published) and serve them, after their
        canary. The trainer may hold what no canary has passed yet (steps driven by hand through its API,
        weights loaded by hand, a resume point saved by hand): on any failure here the trainer goes back to
        the version the fleet serves and a version this start saved is deleted (:meth:`discard_unpublished`),
        one that failed its canary in any case (:meth:`_reject`)."""
        self.served = self.manager.served_version()
        state = self._call(self.client.get_state())
        if state.accumulated_batches:
            raise FailedPrecondition(f"the trainer holds {state.accumulated_batches} unapplied ForwardBackward "
                                     "batches; OptimStep or LoadWeights first")
        self._check_served(state)
        self.config = state.config
        self.base_step = self.trainer_step = state.step
        self.started = True
        if isinstance(self.job.spec, RLJobSpec) and self.job.spec.train_config is None:
            self._show_train_config(state.config)
            return self._start_shared()
        manifest, created = self._save(weights_only=not self._resume_points)
        if created and manifest.version != self.served:
            self.unswitched = manifest.version      # this job's own: a failure before the fleet serves it deletes it
        if self.job.spec.train_config is not None:
            # The job's hyperparameters: a fresh trainer (optimizer, adapters, step 0) on these weights.
            state = self._call(self.client.load_weights(manifest.version, restore_state=False,
                                                        config=self.job.spec.train_config))
            self.base_step = self.trainer_step = state.step
        self._show_train_config(state.config)
        try:
            self._switch_fleet(manifest.version)
        except CanaryFailed as err:
            self._reject(manifest.version, err)
        self.unswitched = ""
        self.weights_version = manifest.version
        # The trainer's weights may be a version recorded weights only (a job that failed between checkpoints
        # left it there): no resume point then, until this job's first step records one (_checkpoint_due).
        self.checkpoint = manifest.version if manifest.spec.metadata.get(META_STATE) == "full" else ""
        return manifest.version

    def _check_served(self, state: TrainerState) -> None:
        """The job starts on the version the fleet serves, and goes back to it if it fails before serving one of its
        own. One the trainer shared in place may be in no store: its record still on its way (fine: it lands),
        failed, or deleted from the store since. One whose record failed the job's start records again while the
        trainer's weights are still that version (SaveWeights(share) of a version whose record failed records the
        trainer's weights once their checksum is that of the bytes the fleet was sent; a plain save publishes
        them); else the job fails here, before touching anything (FAILED_PRECONDITION naming the version and what
        to do), rather than at its end or in a rollback to a version nothing holds. A version this trainer process
        never shared (one the replicas loaded from elsewhere, a preset or a model directory, or one a trainer
        that restarted since forgot) is left as before: the start shares the trainer's weights and serves them."""
        served = self.served
        if not served or self.manager.weight_store is None or self._held_by_store(served) is not False:
            return      # held, or the store cannot say now (the job waits out its outage where it reads it)
        failed = False      # its record failed: a share of it records it again
        try:
            recorded = self._call(self.client.record_weights(served, timeout=_RECORD_PROBE_S))
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND):
                return      # its record is on its way, or this trainer never shared it
            if err.code() not in _RECORD_FAILED:
                raise
            why, failed = f"its record failed: {err.details()}", True
        else:
            if recorded.manifest is not None and self._held_by_store(served) is not False:
                return      # landed meanwhile
            why = (f"superseded by {recorded.superseded_by}, never recorded" if recorded.manifest is None else
                   "it was deleted from the store after its record landed")
        on_it = (state.weights_version, state.step) == (served, state.weights_step)
        if failed and on_it:
            log.warning("job %s: the fleet serves %s, which the weight store does not hold (%s); the job's start "
                        "records it again from the trainer's weights", self.job.job_id, served, why)
            return
        holds = state.weights_version + (f" and {state.step - state.weights_step} step(s) past it"
                                         if state.step != state.weights_step else "")
        example = f", e.g. to {state.weights_version}" if self._held_by_store(state.weights_version) else ""
        raise FailedPrecondition(
            f"the fleet serves {served}, which the weight store does not hold ({why})"
            + ("" if on_it else f", and the trainer no longer holds it (its weights are {holds})")
            + f": switch the fleet to a version the store holds (SwitchWeights on the scheduler{example}), then "
            "submit the job again")

    def _show_train_config(self, config: TrainConfig) -> None:
        """What the job trains with (its status shows it): a set learning_rate is every step's, unscheduled."""
        lr = self.job.spec.learning_rate
        self.job.train_config = config if not lr else dataclasses.replace(config, lr=lr, warmup_steps=0,
                                                                           total_steps=0)

    def _start_shared(self) -> str:
        """An RL job's start off its critical path: the trainer's weights shared in place with their trainer state
        (a resume point), the fleet switched to them at once, and their record left to land in the background like
        every step's (the job's first steps train meanwhile). Until it lands the job has no resume point of its
        own: a trainer that restarts before then comes back on an older durable version, and the job fails
        saying so (the store lost nothing; the next job starts from that version)."""
        manifest, created, shared = self._call(self.client.share_weights(weights_only=not self._resume_points))
        # Co-location: the fleet sleeps first, so each replica's switch takes its copy of the export in place of
        # its weights, not beside them (the GLM-5 slice: a second replica copy beside the trainer's model and
        # export did not fit an 80 GB H100).
        with self._colocated():
            # this job's own when created: a failure before the fleet serves it deletes it
            self._serve_shared(manifest, shared, own=created and manifest.version != self.served, step=0,
                               checkpoint=manifest.spec.metadata.get(META_STATE) == "full")
        return manifest.version

    def recover(self):  # noqa: ANN201 - TrainerState
        """After UNAVAILABLE: wait for the trainer, serve the version it resumed from; its state."""
        state = self._wait_for_trainer()
        self.trainer_step = state.step
        if state.weights_version != self.weights_version:
            self._switch_fleet(state.weights_version)
            self.weights_version = state.weights_version
        return state

    def _unit(self, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one RL step's trainer work, surviving a trainer restart (see the class docstring), also one
        during the redo of the steps a restart lost."""
        recover = False
        for attempt in itertools.count():
            try:
                if recover:
                    self._recover()
                    recover = False
                return work()
            except (grpc.aio.AioRpcError, _Restarted) as err:
                if isinstance(err, grpc.aio.AioRpcError) and err.code() is not grpc.StatusCode.UNAVAILABLE \
                        or attempt >= 3:
                    raise
                log.warning("trainer unavailable (%s); waiting for it to come back",
                            err.details() if isinstance(err, grpc.aio.AioRpcError) else err)
                recover = True
        raise AssertionError("unreachable")

    def _recover(self) -> None:
        """Wait for the trainer, then bring it from where it resumed to the version the fleet serves."""
        state = self._wait_for_trainer()
        if state.step != state.weights_step or state.accumulated_batches:
            raise FailedPrecondition(
                f"the trainer answers again at step {state.step} beyond its version {state.weights_version} "
                f"(step {state.weights_step}): it did not restart, and this job cannot tell which of its "
                "steps it holds")
        self.trainer_step = state.step
        self._rebuild(state.weights_version)

    def _rebuild(self, resumed: str) -> None:
        """The trainer holds ``resumed`` (it restarted, or was rolled back): bring it to the version the fleet
        serves by redoing the kept steps after ``resumed``."""
        # The job's start version counts once the trainer resumed from it: a trainer resumes only from the store.
        if not self._resume_points:
            if resumed == self.weights_version:
                return              # at the version the fleet serves already (its start): nothing to redo
            raise FailedPrecondition(f"the trainer resumed from {resumed}; this job records no trainer state "
                                     f"(checkpoint_every 0), so it cannot redo its steps up to {self.weights_version}")
        chain = [self.checkpoint or self.durability.first_checkpoint(pending=True), *(s.version for s in self._kept)]
        if resumed not in chain:
            since = (f"{self.checkpoint} (its newest recorded checkpoint)" if self.checkpoint else
                     "the checkpoint of its first step (it started on a version recorded weights only)")
            raise FailedPrecondition(f"the trainer resumed from {resumed}; this job can redo its steps only from "
                                     f"{since} or a later one of its own")
        at = chain.index(resumed)
        redo = self._kept[at:]
        if at and not self._kept[at - 1].weights_only:
            # A later checkpoint of the job landed before the trainer went away: the newest resume point now.
            self._kept, self.checkpoint = redo, resumed
        if redo:
            log.warning("job %s: the trainer is at %s; redoing %d step(s) up to %s", self.job.job_id, resumed,
                        len(redo), self.weights_version)
        again = [step.version for step in redo]
        # Versions up to ``resumed`` stay pending until the store has them (a restarted trainer forgot their
        # records: await_records asks the store); every later one is recorded again by this trainer (one
        # whose record landed already is recognized as the same files).
        self.unrecorded = [v for v in self.unrecorded if v not in again]
        for step in redo:
            self._train(step.rollouts, step.group_size)
            manifest, _, shared = self._call(self.client.share_weights(weights_only=step.weights_only,
                                                                       supersede=True))
            if (manifest.version, shared.checksum) != (step.version, step.checksum):
                raise FailedPrecondition(
                    f"redoing the step that made {step.version} gave {manifest.version} with checksum "
                    f"{shared.checksum}, not {step.checksum}: the trainer is not deterministic here")
            self.unrecorded.append(step.version)

    def _wait_for_trainer(self):  # noqa: ANN202
        deadline = time.monotonic() + self.manager.trainer_wait_s
        while True:
            try:
                return self._call(self.client.get_state(timeout=5))
            except grpc.aio.AioRpcError as err:
                if err.code() not in _OUTAGE:
                    raise
                if time.monotonic() > deadline:
                    raise TrainerUnavailable(f"the trainer did not answer for {self.manager.trainer_wait_s:g} s: "
                                             f"{err.details()}") from None
                self._sleep(0.5)

    def _store_reachable(self) -> bool:
        """Whether the weight store answers (True when this scheduler has none to ask)."""
        store = self.manager.weight_store
        if store is None:
            return True
        try:
            self._call(asyncio.wait_for(store.info(), 5.0))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):
            return False
        return True

    def _outage(self, deadline: float | None, what: str, cause: str) -> float:
        """Wait a moment in a weight-store outage; the deadline to keep; WeightStoreUnavailable past it."""
        now = time.monotonic()
        deadline = deadline or now + self.manager.store_wait_s
        if now > deadline:
            raise WeightStoreUnavailable(f"the weight store stayed unreachable for {self.manager.store_wait_s:g} s "
                                         f"while {what}: {cause}")
        log.warning("job %s: the weight store is unreachable while %s (%s); retrying", self.job.job_id, what, cause)
        self._sleep(1.0)
        return deadline

    def _save(self, weights_only: bool = False) -> tuple[WeightsManifest, bool]:
        """SaveWeights (``weights_only``: without the trainer state), retried while the weight store is out;
        UNAVAILABLE when the trainer restarted meanwhile; (manifest, created)."""
        deadline = None
        while True:
            try:
                return self._call(self.client.save_weights(weights_only=weights_only))
            except grpc.aio.AioRpcError as err:
                if err.code() not in _OUTAGE:
                    raise
                if self._wait_for_trainer().step != self.trainer_step:
                    raise   # the trainer restarted without the unpublished steps: the caller redoes them
                # The trainer answers and holds its steps: what failed is the weight store (or the way to it).
                deadline = self._outage(deadline, f"trainer step {self.trainer_step} waited to be published",
                                        err.details())

    def _switch_fleet(self, version: str, shared: Any = None) -> None:
        """Switch the fleet (after its canary), retried while the weight store the replicas fetch from is out
        and while a replica restarts (up to ``fleet_wait_s``); ``shared``: the trainer's in-memory copy."""
        deadline = fleet_deadline = None
        while True:
            try:
                self._call(self.manager._switch(version) if shared is None else self.manager._switch(version, shared))
                return
            except (CanaryFailed, JobCancelled):
                raise
            except Exception as err:  # noqa: BLE001 - retried only while the store or a replica is out
                if self._store_reachable():
                    if not _fleet_outage(err):
                        raise
                    fleet_deadline = self._call(self.manager._wait_fleet(
                        self.job, fleet_deadline, f"switching the fleet to {version} failed", err))
                    continue
                deadline = self._outage(deadline, f"the replicas switched to {version}", str(err))

    def discard_unpublished(self) -> str:
        """Bring the trainer back to the version the fleet serves if it holds anything beyond it (steps the job
        trained and did not publish; or, when the job failed before serving a version of its own, whatever the
        trainer held that the fleet never served), and delete a version saved that the fleet never switched
        to; what was done."""
        if not self.started:
            return ""       # refused before touching the trainer (e.g. it holds batches a person accumulated)
        if self.rejected:
            return ""       # done by _reject (the rollback tried once, the version deleted), said in its error
        good = self.weights_version or self.served
        notes = []
        until = self._records_deadline()    # what the rollback and the delete wait for records, in all
        try:
            state = self._call(self.client.get_state(timeout=10))
            if (state.weights_version, state.step, state.accumulated_batches) != (good, state.weights_step, 0):
                back, lost = self._rollback(until)
                what = "the job's unpublished steps" if self.weights_version else "what it held beyond it"
                notes.append(f"the trainer dropped {what} and is back on {back} (step {self.trainer_step})"
                             + (f", as is the fleet: {lost}" if lost else ""))
        except (grpc.aio.AioRpcError, ServiceError) as err:
            why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else str(err)
            log.error("job %s: could not roll the trainer back to %s: %s", self.job.job_id, good, why)
            notes.append(f"rolling the trainer back to {good or 'the served version'} failed ({why})")
        if self.unswitched:
            notes.append(self._delete(self.unswitched, "no replica serves it", until))
        return "; ".join(notes)

    def _records_deadline(self) -> float:
        """When the waits of one thing the job does for the trainer's records and the weight store's answers end
        (monotonic): ``store_wait_s`` (the scheduler's ``--store-wait``) from now, for all of them together. That
        thing is a failure's rollback and delete, a wake after a failed step, a step's wait for the checkpoint beyond
        :data:`RECORD_LAG`, or the job's end waiting for its last records. A record that never ends (its process
        stopped, a store that takes the bytes and never answers) or a store call never answered must not hold the
        job, and the jobs queued behind it, for ever; a store outage is waited out for as long."""
        return time.monotonic() + self.manager.store_wait_s

    @staticmethod
    def _left(until: float) -> float:
        """The gRPC deadline of a call made while waiting until ``until`` (monotonic): the time left, and
        :data:`_RECORD_POLL_S` once none is (a call that can answer at once still does)."""
        return max(until - time.monotonic(), _RECORD_POLL_S)

    def _record_ended(self, version: str, until: float) -> bool:
        """Wait for the trainer's record of ``version`` to end (committed, failed or superseded), until ``until`` (a
        monotonic time) at most; False when it is still running then (it may land later). A record this trainer does
        not know, or an error of the trainer's, leaves nothing to wait for: True."""
        try:
            self._call(self.client.record_weights(version, timeout=self._left(until)))
        except grpc.aio.AioRpcError as err:
            return err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED
        return True

    def _pending(self, version: str, call: str = "") -> str:
        """Why the job goes on without ``version``'s record (with ``call``: the weight store's answer to that call on
        ``version``): it did not end in the time waited for it."""
        what, later = ((f"the weight store's {call} of {version}", "the store may still do it") if call else
                       (f"the record of {version}", "it may land later"))
        return (f"{what} did not end within the {self.manager.store_wait_s:g} s waited for it (the scheduler's "
                f"--store-wait; {later})")

    def _rollback(self, until: float) -> tuple[str, str]:
        """The trainer back on the version the fleet serves; (the version it is on now, "" or why that is another).

        The job's newest recorded checkpoint, then the kept steps since it redone (the served version may be
        recorded weights only: no resume point). A job with no checkpoint of its own yet (it failed at its start)
        loads the served version itself: with its trainer state when it has one, else its weights under the
        trainer's configuration from before the job (a fresh optimizer, at step 0). What it loads comes from the
        weight store, where a version the job shared in place may not be yet: its record is waited for
        (:meth:`_await_landed`), until ``until`` (monotonic) at most. One whose record failed, or that a restarted
        trainer forgot, never will be, and one whose record did not end by then is not there for this job: then the
        trainer and the fleet go back to the version the fleet served before the job (in the store), so the fleet
        serves no version that neither the store nor the trainer holds and the next job starts from there."""
        good = self.weights_version or self.served
        try:
            self._go_back(good, until)
            return good, ""
        except (VersionNotDurable, RecordPending) as err:
            lost = str(err)
        before = self.served
        if not before or before == good or not self._in_store(before):
            raise FailedPrecondition(f"{lost}, and the weight store holds no version the fleet served before this "
                                     f"job to go back to")
        log.error("job %s: %s; taking the trainer and the fleet back to %s", self.job.job_id, lost, before)
        self._load(before)
        self._switch_fleet(before)
        self.weights_version = before
        return before, f"{lost}; {before} is what the fleet served before this job"

    def _go_back(self, good: str, until: float) -> None:
        """The trainer onto ``good`` (:meth:`_rollback`); :class:`VersionNotDurable` when what it needs never reaches
        the store, :class:`RecordPending` when its record has not ended by ``until``."""
        self._collect_records()     # the job's start may have landed meanwhile: a resume point
        start = self.durability.first_checkpoint(pending=True)
        if not self.checkpoint and start:
            self._await_landed(start, until)    # the job's start, shared with its trainer state: a resume point
        if self.checkpoint:
            state = self._call(self.client.load_weights(self.checkpoint, restore_state=True))
            self.trainer_step = state.step
            self._rebuild(self.checkpoint)
            return
        if not good:
            raise FailedPrecondition("the fleet serves no version to go back to")
        if self.weights_version and self._kept:
            raise FailedPrecondition("the job has no recorded checkpoint to go back to yet (it started on a version "
                                     "recorded weights only)")
        self._await_landed(good, until)     # one of the job's own versions (weights only), shared in place
        self._load(good)

    def _load(self, version: str) -> None:
        """LoadWeights ``version`` with its trainer state, or without when it has none (a version published from
        outside, or recorded weights only: its weights under the trainer's configuration from before the job)."""
        try:
            state = self._call(self.client.load_weights(version, restore_state=True))
        except grpc.aio.AioRpcError as err:
            if err.code() is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
            state = self._call(self.client.load_weights(version, restore_state=False, config=self.config))
        self.trainer_step = state.step

    def _await_landed(self, version: str, until: float) -> None:
        """Until the store holds ``version`` when the job shared it in place and its record is pending (with the
        records shared before it: they land in that order), ``until`` (a monotonic time, :meth:`_records_deadline`)
        at most, however long the records take or the store is out: :class:`RecordPending` past it, naming the
        record and the wait. :class:`VersionNotDurable` when it never will be: its record failed, or the trainer
        restarted before it landed."""
        while version in self.unrecorded:
            head = self.unrecorded[0]
            try:
                recorded = self._await_record(head, until)
            except (grpc.aio.AioRpcError, _Restarted, VersionNotDurable) as err:
                if head != version:
                    self.unrecorded.pop(0)      # never durable; what the trainer goes back to was shared after it
                    continue
                if isinstance(err, VersionNotDurable):
                    raise
                why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else str(err)
                raise VersionNotDurable(f"{version} never reached the weight store ({why})") from None
            self._landed(head, recorded)

    def _delete(self, version: str, why: str, until: float) -> str:
        """Delete ``version`` (never served by the fleet, or rejected by its canary) from the weight store; a
        clause saying what happened. The version the fleet serves is never deleted. Its record is waited for first,
        until ``until`` (monotonic) at most: one still running then is not deleted (its upload would bring it back),
        and the clause says so."""
        self.unswitched = ""
        store = self.manager.weight_store
        if store is None:
            return f"{version} stays in the weight store (this scheduler has no --weight-store to delete it from)"
        if version in (self.weights_version, self.manager.served_version()):
            return f"{version} stays in the weight store (the fleet serves it)"
        try:
            # A version shared in place is recorded in the background: let that land first, so deleting it is
            # final (an upload finishing after the delete would bring it back).
            if not self._record_ended(version, until):
                log.error("job %s: %s was not deleted from the weight store: %s", self.job.job_id, version,
                          self._pending(version))
                return (f"{version} was not deleted from the weight store: {self._pending(version)}, and a delete "
                        f"before it lands is undone by it ({why}: delete it once it is there)")
            if version in self.unrecorded:
                self.unrecorded.remove(version)
            unanswered = self._call(self._delete_from(store, version, until))
            if unanswered:
                said = self._pending(version, unanswered)
                log.error("job %s: %s was not deleted from the weight store: %s", self.job.job_id, version, said)
                return (f"{version} was not deleted from the weight store: {said} ({why}: delete it once the store "
                        "answers)")
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.NOT_FOUND:
                return f"{version} is not in the weight store ({why})"
            log.error("job %s: could not delete %s from the weight store: %s", self.job.job_id, version, err.details())
            return f"deleting {version} from the weight store failed ({err.details()})"
        return f"{version} was deleted from the weight store ({why})"

    async def _delete_from(self, store: WeightStoreClient, version: str, until: float) -> str:
        """Delete ``version``; the trainer's own pin on it (a resume point it saved) is released first, since
        the trainer no longer stands on it. A pin of anyone else keeps it (FAILED_PRECONDITION, said). Each store
        call's gRPC deadline is what is left of ``until`` (:meth:`_left`): a store that never answers must not hold
        the job's end. "" once deleted; else the call the store did not answer in time (Unpin: the version and the
        trainer's pin on it stay; Delete: the version stays, unless the store still deletes it)."""
        try:
            run: str | None = (await self.client.get_state(timeout=10)).run
        except grpc.aio.AioRpcError:
            run = None      # the trainer cannot say: a pin of its own keeps the version, and the delete says so
        if run is not None:
            try:
                await store.unpin(version, pin_owner(run), timeout=self._left(until))
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    return "Unpin"
        try:
            await store.delete(version, timeout=self._left(until))
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return "Delete"
            raise
        return ""

    def _reject(self, version: str, err: CanaryFailed) -> NoReturn:
        """``version`` failed its canary: roll the trainer back to the served version, delete ``version``, fail."""
        good = self.weights_version or self.served
        # A version shared in place is still being recorded: let it land first, so the record's resume-point
        # pin cannot move back to it after the rollback, and the delete below is final. Not for ever: the waits
        # for records here, the rollback's and the delete's together, end after the scheduler's --store-wait.
        until = self._records_deadline()
        self._record_ended(version, until)
        try:
            back, lost = self._rollback(until)
            rolled = (f"The trainer was rolled back to {back} (step {self.trainer_step}), which the fleet keeps serving"
                      if not lost else f"The trainer and the fleet were rolled back to {back} "
                                       f"(step {self.trainer_step}): {lost}")
        except grpc.aio.AioRpcError as load_err:
            rolled = (f"The fleet keeps serving {good}, but rolling the trainer back to it failed "
                      f"({load_err.code().name}: {load_err.details()})")
        except ServiceError as load_err:
            rolled = f"The fleet keeps serving {good}, but rolling the trainer back to it failed ({load_err})"
        self.rejected = True
        fate = self._delete(version, "it failed its canary", until)
        raise CanaryFailed(f"{err.message}. {rolled}; {fate}") from None

    # ---- TrainerPort (zerokl.services.rl.ports) ----

    def grpo_step(self, rollouts: Sequence[Rollout], group_size: int) -> dict[str, Any]:
        with self._colocated() as slept:
            out = self._grpo_unit(rollouts, group_size)
        return {**out, **slept}

    @contextlib.contextmanager
    def _colocated(self) -> Iterator[dict[str, float]]:
        """Co-location (the manager's ``sleep_fleet``): the fleet sleeps (its KV cache and weights released)
        before the step trains, and the step's switch to the new version wakes it (SwitchWeights refills the
        weights from the trainer's shared copy). The dict it yields gets the sleep's seconds and bytes. A step
        that fails wakes the fleet on what it serves (a replica whose weights were released takes them back
        through a switch to that version), so no replica is left asleep; the step's own error stands. It is logged
        (WARNING) before the wake, and the wake waits for that version's record ``store_wait_s`` at most: a wake
        that cannot be done is said in the step's error, which the job then ends with."""
        sleep = self.manager._sleep_fleet
        if sleep is None:
            yield {}
            return
        try:
            t0 = time.perf_counter()
            state = self._call(sleep())     # a replica that could not sleep fails the step: the others wake below
            yield {"sleep_s": time.perf_counter() - t0, "sleep_bytes": float(state.released_bytes)}
        except BaseException as err:
            served = self.weights_version or self.served
            if isinstance(err, Exception) and not isinstance(err, JobCancelled):
                said = _describe(err)
                log.warning("job %s: the step failed with the fleet asleep: %s; waking the fleet on %s",
                            self.job.job_id, said if said.startswith(type(err).__name__)
                            else f"{type(err).__name__} {said}", served)
            else:
                log.info("job %s: the step stopped with the fleet asleep (%s); waking the fleet on %s",
                         self.job.job_id, type(err).__name__, served)
            why = self._wake_after_failure(served)
            if why and isinstance(err, Exception):
                err.add_note(f"the fleet could not be woken on {served} ({why})")
            raise

    def _wake_after_failure(self, served: str) -> str:
        """Wake the fleet after a step failed while it slept: back on ``served``; "" once it is, else why not."""
        try:
            if self.manager._wake_fleet is not None:
                self._call(self.manager._wake_fleet())
            return ""
        except Exception as err:  # noqa: BLE001 - the weights were released: a switch brings them back
            log.info("job %s: waking the fleet after a failed step: %s; switching it to %s", self.job.job_id, err,
                     served)
        try:
            # From the store (a co-located trainer keeps no export past its backward), where the version's record
            # may still be on its way (the job's start, shared in place, while its first step trains): waited for,
            # but not for ever (a record that never ends must not hide the step's error).
            self._await_landed(served, self._records_deadline())
            self._call(self.manager._switch(served))
            return ""
        except Exception as err:  # noqa: BLE001 - the step's error is the job's; this one is said with it
            why = _describe(err)
            log.error("job %s: the fleet could not be woken on %s after a failed step: %s", self.job.job_id, served,
                      why)
            return why

    def _grpo_unit(self, rollouts: Sequence[Rollout], group_size: int) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            # The earlier versions' store records upload in the background; beyond RECORD_LAG checkpoints
            # this step waits for the oldest (backpressure: each holds the trainer state's snapshot in the
            # trainer's memory). Weights-only records are never waited for. Not train_s: recording's tail.
            t0 = time.perf_counter()
            self._collect_records(strict=True)
            self._await_checkpoints()
            record_wait_s = time.perf_counter() - t0
            self._train_and_publish(rollouts, group_size)
            self._collect_records()
            self._last["record_wait_s"] = record_wait_s
            self._last["record_lag"] = float(len(self.unrecorded))  # versions served, not yet recorded
            self._last.update(self.durability.report())
            return self._last
        return self._unit(work)

    def _await_checkpoints(self) -> None:
        """Before a step trains: wait for the records of the oldest checkpoints until at most ``RECORD_LAG - 1`` are
        pending (the step's own makes ``RECORD_LAG``), ``store_wait_s`` at most: a step that cannot get its
        checkpoint recorded by then fails the job (:class:`RecordPending`, naming the checkpoint and the wait), the
        fleet serving the job's last version."""
        oldest = next((v for v in self.unrecorded if self.durability.checkpoint(v)), "")
        try:
            self.await_records(self._records_deadline(), checkpoints=RECORD_LAG - 1)
        except RecordPending as err:
            step = self.trainer_step - self.base_step + 1
            raise RecordPending(
                f"step {step} waits for the record of the checkpoint {oldest} (a step trains only while {RECORD_LAG} "
                f"checkpoints at most are not in the weight store: each holds the trainer state's snapshot in the "
                f"trainer's memory): {err}") from None

    def _train(self, rollouts: Sequence[Rollout], group_size: int) -> dict[str, Any]:
        """ForwardBackward(ppo) + OptimStep; the step's metrics."""
        spec = self.job.spec
        max_staleness = spec.max_staleness if isinstance(spec, RLJobSpec) else 0
        fb, opt = self._call(self.client.grpo_step(rollouts, group_size, max_staleness=max_staleness or None,
                                                   lr=spec.learning_rate or None))
        assert fb.ppo is not None
        self.trainer_step = opt.step
        waited = fb.metrics.get("export_wait_s")      # co-located trainers only
        return {"reward": fb.ppo.reward_mean, "kl": fb.ppo.kl, "mismatched_tokens": fb.ppo.mismatched_tokens,
                "clip_fraction": fb.ppo.clip_fraction, "ratio_min": fb.ppo.ratio_min, "ratio_max": fb.ppo.ratio_max,
                "loss": fb.loss, "grad_norm": opt.grad_norm, "lr": opt.lr, "tokens": fb.tokens,
                **({"export_wait_s": waited} if waited is not None else {})}

    def _checkpoint_due(self) -> bool:
        """Whether the step just trained records the trainer state: every ``checkpoint_every`` steps of the
        job, its last, the one a cancel stops it after, and its first when it started with no resume point."""
        spec = self.job.spec
        assert isinstance(spec, RLJobSpec)
        if not spec.checkpoint_every:
            return False            # never: the job records no trainer state
        done = self.trainer_step - self.base_step
        unresumable = not self.checkpoint and not self.durability.first_checkpoint(pending=True) \
            and all(step.weights_only for step in self._kept)
        return done % spec.checkpoint_every == 0 or done >= spec.steps or self.job.cancel.is_set() or unresumable

    def _train_and_publish(self, rollouts: Sequence[Rollout], group_size: int) -> None:
        """ForwardBackward(ppo) + OptimStep, then the new version shared in place and served; its metrics
        in ``self._last`` (with sync_s: the optimizer step's end -> every replica serving it)."""
        last = self._train(rollouts, group_size)
        optimized = time.perf_counter()
        parent, weights_only = self.weights_version, not self._checkpoint_due()
        nbytes, exported, checksum = self.publish_shared(weights_only)
        done = time.perf_counter()
        sync_s = done - optimized
        if self._resume_points:     # steps a trainer restart redoes from the newest resume point
            self._kept.append(_SharedStep(parent, self.weights_version, tuple(rollouts), group_size, weights_only,
                                          checksum))
        # Bytes of the serving weights each replica received, and the rate of the whole sync; the sync split
        # into the trainer's SaveWeights(share) and the fleet's switch (canary included).
        self._last = {**last, "sync_s": sync_s, "sync_bytes": float(nbytes),
                      "sync_bytes_per_s": nbytes / max(sync_s, 1e-9), "sync_export_s": exported - optimized,
                      "sync_switch_s": done - exported, "checkpoint": float(not weights_only)}

    def publish(self) -> str:
        return self.weights_version  # grpo_step published as part of its unit

    def publish_shared(self, weights_only: bool = False) -> tuple[int, float, str]:
        """SaveWeights(share): the new version from the trainer's memory to the fleet (replicas on its host
        copy it in place, others read the store once the trainer's background record lands), after its
        canary; the serving bytes shared, the perf_counter time the trainer answered, and their checksum."""
        # supersede: the fleet serves the version shared before this one (the step's unit switched to it), so the
        # weights-only versions before that one whose record has not started are read by no one.
        manifest, _, shared = self._call(self.client.share_weights(weights_only=weights_only, supersede=True))
        exported = time.perf_counter()
        self._serve_shared(manifest, shared, own=manifest.version != self.weights_version,
                           step=self.trainer_step - self.base_step, checkpoint=not weights_only)
        return int(shared.total_bytes), exported, shared.checksum

    def _serve_shared(self, manifest: WeightsManifest, shared: SharedExport, *, own: bool, step: int,
                      checkpoint: bool) -> None:
        """The fleet switched to a version the trainer shared in place (``own``: saved for this job, deleted if
        its canary fails, with the trainer rolled back); its record left to land in the background (a version
        the store holds already lands at once) and counted for the job's durability reports."""
        if own:
            self.unswitched = manifest.version
        try:
            self._switch_fleet(manifest.version, shared)
        except CanaryFailed as err:
            self._reject(manifest.version, err)
        self.unswitched = ""
        self.weights_version = manifest.version
        self.unrecorded.append(manifest.version)
        self.durability.shared(manifest.version, step, checkpoint=checkpoint)

    def await_records(self, until: float, checkpoints: int | None = None) -> None:
        """Wait for the store's records of the versions shared, oldest first (recorded or superseded): all of them,
        or until at most ``checkpoints`` checkpoints are pending (the weights-only records ahead of one are done
        before it anyway: records land in the order shared). Until ``until`` (monotonic, :meth:`_records_deadline`)
        at most, a store outage included: :class:`RecordPending` past it, naming the record. A trainer that forgot one
        (restarted) is UNAVAILABLE to :meth:`_unit`, which redoes the steps since its checkpoint."""
        while self.unrecorded and (checkpoints is None or
                                   sum(self.durability.checkpoint(v) for v in self.unrecorded) > checkpoints):
            version = self.unrecorded[0]
            self._landed(version, self._await_record(version, until))

    def await_end(self) -> None:
        """The job's end: every version it served is in the store before it succeeds (resume, audit), the last ones'
        records uploading in the background until then (redone by :meth:`_unit` if the trainer restarted before they
        landed). ``store_wait_s`` at most: a job whose records have not ended by then does not succeed as if its last
        version were durable: :class:`RecordPending` says which version the fleet serves that the store may not hold
        yet, and which record it waited for (it may land later)."""
        last = self.weights_version
        try:
            self.await_records(self._records_deadline())
        except RecordPending as err:
            head = self.unrecorded[0]
            raise RecordPending(f"every step trained and the fleet serves {last}, but it is not durable yet: {err}"
                                + ("" if head == last else f", and {last}'s lands after it")) from None

    def _collect_records(self, strict: bool = False) -> None:
        """The records done already (landed or superseded), oldest first, without waiting for one that is not (a
        RecordWeights with a short deadline): the job's reports say which versions are durable as soon as they
        are. ``strict`` (before a step): a version the trainer no longer knows is asked after (:meth:`_await_record`:
        in the store, or the trainer restarted: :meth:`_unit` redoes the steps), and one whose record failed fails
        the job then, not at its end (:class:`VersionNotDurable`: no step builds on what the store will not hold)."""
        while self.unrecorded:
            try:
                recorded = self._call(self.client.record_weights(self.unrecorded[0], timeout=0.01))
            except grpc.aio.AioRpcError as err:
                if strict and err.code() in (grpc.StatusCode.NOT_FOUND, *_RECORD_FAILED):
                    recorded = self._await_record(self.unrecorded[0])
                else:
                    return      # not yet (or the trainer is out: the step's calls tell which)
            self._landed(self.unrecorded[0], recorded)

    def _landed(self, version: str, recorded: Recorded | None) -> None:
        """``version``'s record is done (``recorded``: its manifest and seconds, or superseded; None: found in the
        store)."""
        assert self.unrecorded[0] == version
        self.unrecorded.pop(0)
        self.durability.landed(version, recorded)
        if recorded is not None and recorded.superseded:
            return      # never durable: neither a resume point nor the end of a kept step
        if self.durability.first_checkpoint() == version and not self.checkpoint:
            self.checkpoint = version    # the job's start, recorded with its trainer state: a resume point
        steps = [s.version for s in self._kept]
        if version in steps and not self._kept[steps.index(version)].weights_only:
            # A resume point in the store: the steps up to it need never be redone.
            self._kept, self.checkpoint = self._kept[steps.index(version) + 1:], version

    def _await_record(self, version: str, until: float | None = None) -> Recorded | None:
        """RecordWeights of ``version`` (None: the store held it already), waiting out a weight-store outage;
        :class:`_Restarted` when the trainer forgot it, :class:`VersionNotDurable` when its record failed,
        :class:`RecordPending` when it has not ended by ``until`` (a monotonic time; None: no limit)."""
        deadline = None
        while True:
            left = None if until is None else until - time.monotonic()
            if left is not None and left <= 0:
                raise RecordPending(self._pending(version))
            try:
                return self._call(self.client.record_weights(version, timeout=left))
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.NOT_FOUND:
                    if self._in_store(version):
                        return None  # recorded before the trainer restarted
                    raise _Restarted(f"the trainer no longer knows {version}: it restarted") from None
                if err.code() in _RECORD_FAILED:
                    raise VersionNotDurable(f"{version} never reached the weight store ({err.code().name}: "
                                            f"{err.details()})") from None
                if err.code() not in _OUTAGE:
                    raise
                if until is not None and time.monotonic() >= until:
                    continue    # (DEADLINE_EXCEEDED: the time left ran out in the call)
                if self._wait_for_trainer().step != self.trainer_step:
                    raise _Restarted(f"the trainer restarted before recording {version}") from None
                deadline = self._outage(deadline, f"{version} waited to be recorded", err.details())

    def _in_store(self, version: str) -> bool:
        """Whether the weight store holds ``version`` (False when this scheduler has none to ask)."""
        store = self.manager.weight_store
        if store is None:
            return False
        try:
            self._call(store.manifest(version))
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True

    def _held_by_store(self, version: str) -> bool | None:
        """:meth:`_in_store`, or None while the weight store is out (it cannot say)."""
        try:
            return self._in_store(version)
        except grpc.aio.AioRpcError as err:
            if err.code() in _OUTAGE:
                return None
            raise

    def publish_now(self) -> None:
        """SaveWeights, then switch the fleet to the new version once its canary passes (else the job fails)."""
        manifest, _ = self._save()
        if manifest.version != self.weights_version:
            self.unswitched = manifest.version
        try:
            self._switch_fleet(manifest.version)
        except CanaryFailed as err:
            self._reject(manifest.version, err)
        self.unswitched = ""
        self.weights_version = self.checkpoint = manifest.version   # a full save: a resume point
        self._kept = []

    # ---- SFT / DPO (the job loop handles UNAVAILABLE: state only survives a restart when published) ----

    def supervised_step(self, method: str, batch: Sequence[Any], first: bool = False) -> dict[str, float]:
        """One step; a DPO job's first step freezes its reference (the weights it starts from)."""
        t0 = time.perf_counter()
        fb = self._call(self.client.forward_backward(method, batch, reset_reference=first and method == "dpo"))
        opt = self._call(self.client.optim_step(lr=self.job.spec.learning_rate or None))
        self.trainer_step = opt.step
        metrics = {"loss": fb.loss, "grad_norm": opt.grad_norm, "lr": opt.lr, "tokens": fb.tokens,
                   "tokens_per_s": fb.tokens / max(time.perf_counter() - t0, 1e-9),
                   **{k: v for k, v in fb.metrics.items() if k not in ("loss", "tokens", "tokens_per_s")}}
        return {k: float(v) for k, v in metrics.items()}

