"""Training jobs the scheduler runs on its trainer: SFT, DPO and on-policy RL (GRPO).

A job is the managed form of the loop a user could drive through the trainer's
low-level API. The scheduler runs one job at a time, in submission order:

* **RL**: sample prompts -> Generate n per prompt through the scheduler, pinned to
  the version the fleet serves -> rewards -> ForwardBackward(ppo) + OptimStep on
  the trainer -> SaveWeights -> SwitchWeights on every replica -> next step. The
  loop itself is :func:`~.rl_loop.run_rl`; here it gets ports that speak gRPC.
* **SFT / DPO**: batches -> ForwardBackward + OptimStep; publish and switch the
  fleet every ``publish_every`` steps and at the end.

Every step becomes a :class:`JobEvent` that watchers receive (past steps are
replayed first). A trainer that restarts mid-job (it resumes from its newest
published version) is waited for and the interrupted step is redone from the
trainer's state, so no step is lost or applied twice. A job runs in a worker
thread; its ports call into the event loop, where the scheduler and the gRPC
clients live.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import math
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import grpc
import grpc.aio

from zerokl.services.engine.types import InvalidOption, SamplingOptions
from zerokl.services.inference.types import GenerateResult, InferenceRequest
from zerokl.services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from zerokl.services.scheduler.rl_loop import RLConfig, Sampled, StepRecord, Task, as_dict, run_rl
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.trainer import Completion, Rollout

__all__ = ["CountdownTask", "SFTJobSpec", "DPOJobSpec", "RLJobSpec", "JobSpec", "JobState", "JobStatus",
           "JobEvent", "JobCancelled", "JobManager"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_FLOAT32_MAX = 3.4028234663852886e38   # a learning rate above it overflows float32 weights' updates


# ----------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class CountdownTask:
    """Built-in countdown problems (zerokl.tasks.countdown, the demo's distribution)."""

    seed: int = 0
    train_problems: int = 20000
    test_problems: int = 200


@dataclass(frozen=True)
class SFTJobSpec:
    steps: int
    countdown: CountdownTask | None = None          # solver demonstrations, or:
    examples: tuple[Completion, ...] = ()           # the caller's completions
    batch_size: int = 32
    publish_every: int = 0                          # 0: publish only at the end
    seed: int = 0
    learning_rate: float = 0.0                      # > 0: every step's lr; 0: the trainer's schedule
    kind = "sft"


@dataclass(frozen=True)
class DPOJobSpec:
    steps: int
    pairs: tuple[tuple[Completion, Completion], ...]  # (chosen, rejected)
    batch_size: int = 8
    publish_every: int = 0
    seed: int = 0
    learning_rate: float = 0.0
    kind = "dpo"


@dataclass(frozen=True)
class RLJobSpec:
    steps: int
    countdown: CountdownTask = CountdownTask()
    prompts_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_staleness: int = 0
    eval_every: int = 5
    eval_prompts: int = 32
    learning_rate: float = 0.0
    kind = "rl"


JobSpec = SFTJobSpec | DPOJobSpec | RLJobSpec


def validate(spec: JobSpec) -> None:
    """INVALID_ARGUMENT naming the first bad field of ``spec``.

    Checked by meaning, as a Generate request is: RL sampling options go through
    :meth:`SamplingOptions.check` (finite, float32-safe ranges), and a learning rate
    must be a finite float32 (the optimizer applies it to float32 weights).
    """
    if spec.steps <= 0:
        raise InvalidArgument.field(f"{spec.kind}.steps", f"must be > 0, got {spec.steps}")
    if not (math.isfinite(spec.learning_rate) and 0.0 <= spec.learning_rate <= _FLOAT32_MAX):
        raise InvalidArgument.field("learning_rate", f"must be finite, >= 0 and at most {_FLOAT32_MAX:.4g} "
                                                     f"(0: the trainer's schedule), got {spec.learning_rate!r}")
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
    if getattr(spec, "countdown", None) is not None:
        c = spec.countdown
        if c.train_problems < 1 or c.test_problems < 1 or c.train_problems > 100_000:
            raise InvalidArgument.field("countdown", "train_problems in 1..100000 and test_problems >= 1")


# ----------------------------------------------------------------------------- status

class JobState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    name: str
    kind: str
    state: JobState
    step: int
    total_steps: int
    weights_version: str = ""
    error: str = ""
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class JobEvent:
    """A status change, or a finished step (``step``/``metrics`` set)."""

    status: JobStatus
    step: int | None = None
    weights_version: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


class JobCancelled(Exception):
    """Raised inside a job's thread at the next step boundary after CancelJob."""


@dataclass
class _Job:
    job_id: str
    name: str
    spec: JobSpec
    state: JobState = JobState.QUEUED
    step: int = 0
    weights_version: str = ""
    error: str = ""
    started: float | None = None
    ended: float | None = None
    events: list[JobEvent] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> JobStatus:
        end = self.ended or time.monotonic()
        return JobStatus(self.job_id, self.name, self.spec.kind, self.state, self.step, self.spec.steps,
                         self.weights_version, self.error, 0.0 if self.started is None else end - self.started)


# ----------------------------------------------------------------------------- the manager

class JobManager:
    """Queues jobs and runs them one at a time against ``trainer`` and the scheduler's fleet.

    ``generate(request)`` streams GenerateDeltas through the scheduler (pinned
    requests); ``switch_weights(version)`` switches every replica.
    """

    def __init__(self, trainer: TrainerClient | None, generate: Callable[[InferenceRequest], AsyncIterator[Any]],
                 switch_weights: Callable[[str], Awaitable[Any]], *, trainer_wait_s: float = 120.0) -> None:
        self.trainer = trainer
        self._generate = generate
        self._switch = switch_weights
        self.trainer_wait_s = trainer_wait_s
        self._jobs: dict[str, _Job] = {}
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._runner: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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
        job = _Job(uuid.uuid4().hex[:12], name or spec.kind, spec)
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

    def _finish(self, job: _Job, state: JobState, error: str = "") -> None:
        job.state, job.error, job.ended = state, error, time.monotonic()
        self._emit(job)

    async def _run_queue(self) -> None:
        while True:
            job = await self._queue.get()
            if job.state is not JobState.QUEUED:
                continue  # cancelled while queued
            job.state, job.started = JobState.RUNNING, time.monotonic()
            self._emit(job)
            try:
                await asyncio.to_thread(self._run_job, job)
                self._finish(job, JobState.SUCCEEDED)
            except JobCancelled:
                self._finish(job, JobState.CANCELLED)
            except Exception as err:  # noqa: BLE001 - a failed job must not stop the queue
                log.exception("job %s failed", job.job_id)
                self._finish(job, JobState.FAILED, _describe(err))

    def _call(self, coro: Awaitable[T]) -> T:
        """From the job's thread: run ``coro`` on the event loop and wait for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def _step_done(self, job: _Job, step: int, version: str, metrics: dict[str, float]) -> None:
        """Step ``step`` finished; ``version`` is what it published ("" when it published none)."""
        def apply() -> None:
            job.step = step
            job.weights_version = version or job.weights_version
            self._emit(job, step, version, metrics)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(apply)
        if job.cancel.is_set():
            raise JobCancelled()

    def _run_job(self, job: _Job) -> None:
        trainer = _TrainerSession(self, job)
        version = trainer.start()
        self._loop.call_soon_threadsafe(lambda: setattr(job, "weights_version", version))  # type: ignore[union-attr]
        if isinstance(job.spec, RLJobSpec):
            self._run_rl(job, job.spec, trainer)
        else:
            self._run_supervised(job, job.spec, trainer)

    def _run_rl(self, job: _Job, spec: RLJobSpec, trainer: "_TrainerSession") -> None:
        from zerokl.tasks.setup import countdown_data, encode_prompt
        from zerokl.tasks.countdown import reward
        train, test, tok = countdown_data(spec.countdown.seed, spec.countdown.train_problems,
                                          spec.countdown.test_problems)
        task = Task(train, test, lambda p: encode_prompt(p, tok), reward)
        config = RLConfig(steps=spec.steps, prompts_per_step=spec.prompts_per_step, group_size=spec.group_size,
                          max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                          seed=spec.seed, max_staleness=spec.max_staleness, eval_every=spec.eval_every,
                          eval_prompts=spec.eval_prompts)
        port = _FleetRollouts(self, job)

        def on_step(record: StepRecord) -> None:
            metrics = {k: float(v) for k, v in as_dict(record).items()
                       if k not in ("step", "weights_version") and v is not None}
            self._step_done(job, record.step, record.weights_version, metrics)

        run_rl(task, port, trainer, config, on_step)

    def _run_supervised(self, job: _Job, spec: SFTJobSpec | DPOJobSpec, trainer: "_TrainerSession") -> None:
        if isinstance(spec, SFTJobSpec):
            if spec.countdown is not None:
                from zerokl.tasks.setup import countdown_data, demonstration_batch
                train, _, tok = countdown_data(spec.countdown.seed, spec.countdown.train_problems,
                                               spec.countdown.test_problems)
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


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"


# ----------------------------------------------------------------------------- ports over gRPC

class _FleetRollouts:
    """RolloutPort: Generate through the scheduler, every request pinned to the version being updated."""

    def __init__(self, manager: JobManager, job: _Job) -> None:
        self.manager, self.job = manager, job

    def generate(self, prompts, n, max_tokens, temperature, top_p, seed, weights_version):  # noqa: ANN001, ANN201
        async def one(i: int, ids: tuple[int, ...]) -> GenerateResult:
            options = SamplingOptions(temperature=temperature, top_p=top_p, max_tokens=max_tokens, n=n,
                                      seed=seed + i)
            request = InferenceRequest(prompt_ids=ids, options=options, weights_version=weights_version)
            return GenerateResult.collect([d async for d in self.manager._generate(request)])

        async def all_prompts() -> list[GenerateResult]:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        results = self.manager._call(all_prompts())
        return [[Sampled(tuple(p), tuple(s.token_ids), tuple(s.logprobs), s.text, r.weights_version)
                 for s in r.samples] for p, r in zip(prompts, results, strict=True)]


class _TrainerSession:
    """TrainerPort over TrainerClient, with the fleet switched after every publish.

    Each step runs as a unit (ForwardBackward, OptimStep, SaveWeights): when the
    trainer becomes UNAVAILABLE meanwhile, the session waits for it to come
    back, reads its state and either takes the step as done (it was published)
    or redoes it from the restored weights.
    """

    def __init__(self, manager: JobManager, job: _Job) -> None:
        self.manager, self.job = manager, job
        self.client = manager.trainer
        self.weights_version = ""
        self.base_step = 0
        self._last: dict[str, Any] = {}

    def _call(self, coro: Awaitable[T]) -> T:
        return self.manager._call(coro)

    def start(self) -> str:
        """Publish the trainer's current weights (a no-op when already published) and serve them."""
        state = self._call(self.client.get_state())
        if state.accumulated_batches:
            raise FailedPrecondition(f"the trainer holds {state.accumulated_batches} unapplied ForwardBackward "
                                     "batches; OptimStep or LoadWeights first")
        self.base_step = state.step
        manifest, _ = self._call(self.client.save_weights())
        self.weights_version = manifest.version
        self._call(self.manager._switch(manifest.version))
        return manifest.version

    def recover(self):  # noqa: ANN201 - TrainerState
        """After UNAVAILABLE: wait for the trainer, serve the version it resumed from; its state."""
        state = self._wait_for_trainer()
        if state.weights_version != self.weights_version:
            self._call(self.manager._switch(state.weights_version))
            self.weights_version = state.weights_version
        return state

    def _unit(self, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one step's trainer work, surviving a trainer restart (see the class docstring)."""
        for attempt in itertools.count():
            try:
                return work()
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE or attempt >= 3:
                    raise
                log.warning("trainer unavailable (%s); waiting for it to come back", err.details())
                served = self.weights_version
                if self.recover().weights_version != served:
                    # The interrupted step was published before the trainer went away.
                    return dict(self._last, resumed=1.0)
                # Otherwise the trainer resumed from the version we serve: redo the step.
        raise AssertionError("unreachable")

    def _wait_for_trainer(self):  # noqa: ANN202
        deadline = time.monotonic() + self.manager.trainer_wait_s
        while True:
            if self.job.cancel.is_set():
                raise JobCancelled()
            try:
                return self._call(self.client.get_state(timeout=5))
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    # ---- TrainerPort (rl_loop) ----

    def grpo_step(self, rollouts: Sequence[Rollout], group_size: int) -> dict[str, Any]:
        max_staleness = self.job.spec.max_staleness if isinstance(self.job.spec, RLJobSpec) else 0

        def work() -> dict[str, Any]:
            fb, opt = self._call(self.client.grpo_step(rollouts, group_size, max_staleness=max_staleness or None,
                                                       lr=self.job.spec.learning_rate or None))
            assert fb.ppo is not None
            self._last = {"reward": fb.ppo.reward_mean, "kl": fb.ppo.kl, "mismatched_tokens": fb.ppo.mismatched_tokens,
                          "clip_fraction": fb.ppo.clip_fraction, "ratio_min": fb.ppo.ratio_min,
                          "ratio_max": fb.ppo.ratio_max, "loss": fb.loss, "grad_norm": opt.grad_norm,
                          "lr": opt.lr, "tokens": fb.tokens}
            self.publish_now()
            return self._last
        return self._unit(work)

    def publish(self) -> str:
        return self.weights_version  # grpo_step published as part of its unit

    def publish_now(self) -> None:
        """SaveWeights, then switch the fleet to the new version."""
        manifest, _ = self._call(self.client.save_weights())
        self._call(self.manager._switch(manifest.version))
        self.weights_version = manifest.version

    # ---- SFT / DPO (the job loop handles UNAVAILABLE: state only survives a restart when published) ----

    def supervised_step(self, method: str, batch: Sequence[Any], first: bool = False) -> dict[str, float]:
        """One step; a DPO job's first step freezes its reference (the weights it starts from)."""
        t0 = time.perf_counter()
        fb = self._call(self.client.forward_backward(method, batch, reset_reference=first and method == "dpo"))
        opt = self._call(self.client.optim_step(lr=self.job.spec.learning_rate or None))
        metrics = {"loss": fb.loss, "grad_norm": opt.grad_norm, "lr": opt.lr, "tokens": fb.tokens,
                   "tokens_per_s": fb.tokens / max(time.perf_counter() - t0, 1e-9),
                   **{k: v for k, v in fb.metrics.items() if k not in ("loss", "tokens", "tokens_per_s")}}
        return {k: float(v) for k, v in metrics.items()}

