"""``zerokl.v1.Jobs`` on the scheduler: the proto edge of :class:`~.manager.JobManager`, and its client.

One converter per direction per message; nothing below the servicer sees a
proto type. Absent fields take the spec dataclasses' defaults (one home for
each default).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc.aio

from zerokl.services.runtime.client import ServiceClient
from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.runtime.server import ServiceServer
from zerokl.services.jobs.types import (
    CountdownTask,
    DPOJobSpec,
    JobEvent,
    JobSpec,
    JobState,
    JobStatus,
    RLJobSpec,
    SFTJobSpec,
)
from zerokl.services.trainer.convert import (
    completion_from_proto,
    completion_to_proto,
    train_config_from_proto,
    train_config_to_proto,
)
from zerokl.v1 import jobs_pb2, jobs_pb2_grpc, trainer_pb2

if TYPE_CHECKING:    # the servicer's; a client (`zerokl jobs`) loads no job runner
    from zerokl.services.jobs.manager import JobManager

__all__ = ["JOBS_SERVICE", "JobsServicer", "JobsClient", "add_jobs_service", "spec_to_proto", "spec_from_proto"]

JOBS_SERVICE = jobs_pb2.DESCRIPTOR.services_by_name["Jobs"].full_name

_STATES = {s: getattr(jobs_pb2, f"JOB_STATE_{s.name}") for s in JobState}
_STATES_BACK = {v: k for k, v in _STATES.items()}


# ----------------------------------------------------------------------------- converters

def _countdown_to_proto(c: CountdownTask) -> jobs_pb2.CountdownTask:
    return jobs_pb2.CountdownTask(seed=c.seed, train_problems=c.train_problems, test_problems=c.test_problems)


def _countdown_from_proto(msg: jobs_pb2.CountdownTask) -> CountdownTask:
    d = CountdownTask()
    return CountdownTask(msg.seed, msg.train_problems or d.train_problems, msg.test_problems or d.test_problems)


def spec_to_proto(spec: JobSpec, name: str = "") -> jobs_pb2.JobSpec:
    """JobSpec dataclass -> ``zerokl.v1.JobSpec``."""
    if isinstance(spec, SFTJobSpec):
        sft = jobs_pb2.SFTJob(steps=spec.steps, batch_size=spec.batch_size, publish_every=spec.publish_every,
                              seed=spec.seed)
        if spec.countdown is not None:
            sft.countdown.CopyFrom(_countdown_to_proto(spec.countdown))
        else:
            sft.examples.CopyFrom(trainer_pb2.SFTBatch(completions=[completion_to_proto(c) for c in spec.examples]))
        return _with_train_config(jobs_pb2.JobSpec(name=name, sft=sft, learning_rate=spec.learning_rate), spec)
    if isinstance(spec, DPOJobSpec):
        pairs = trainer_pb2.DPOBatch(pairs=[trainer_pb2.PreferencePair(chosen=completion_to_proto(c),
                                                                       rejected=completion_to_proto(r))
                                            for c, r in spec.pairs])
        return _with_train_config(jobs_pb2.JobSpec(name=name, dpo=jobs_pb2.DPOJob(
            pairs=pairs, steps=spec.steps, batch_size=spec.batch_size, publish_every=spec.publish_every,
            seed=spec.seed), learning_rate=spec.learning_rate), spec)
    rl = jobs_pb2.RLJob(countdown=_countdown_to_proto(spec.countdown), steps=spec.steps,
                        prompts_per_step=spec.prompts_per_step, group_size=spec.group_size,
                        max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed,
                        max_staleness=spec.max_staleness, eval_every=spec.eval_every, eval_prompts=spec.eval_prompts,
                        checkpoint_every=spec.checkpoint_every, reward=spec.reward, ignore_eos=spec.ignore_eos)
    return _with_train_config(jobs_pb2.JobSpec(name=name, rl=rl, learning_rate=spec.learning_rate), spec)


def _with_train_config(msg: jobs_pb2.JobSpec, spec: JobSpec) -> jobs_pb2.JobSpec:
    if spec.train_config is not None:
        msg.train_config.CopyFrom(train_config_to_proto(spec.train_config))
    return msg


def spec_from_proto(msg: jobs_pb2.JobSpec) -> JobSpec:
    """``zerokl.v1.JobSpec`` -> JobSpec dataclass (INVALID_ARGUMENT when no kind is set)."""
    spec = _spec_from_proto(msg)
    if msg.HasField("train_config"):
        spec = dataclasses.replace(spec, train_config=train_config_from_proto(msg.train_config))
    return spec


def _spec_from_proto(msg: jobs_pb2.JobSpec) -> JobSpec:
    kind = msg.WhichOneof("job")
    if kind == "sft":
        m = msg.sft
        d = SFTJobSpec(steps=1)
        data = m.WhichOneof("data")
        examples = tuple(completion_from_proto(c) for c in m.examples.completions)
        # No data named: the built-in countdown demonstrations, as an RL job defaults its task.
        countdown = _countdown_from_proto(m.countdown) if data == "countdown" else None if data else CountdownTask()
        return SFTJobSpec(m.steps, countdown, examples, m.batch_size or d.batch_size, m.publish_every, m.seed,
                          msg.learning_rate)
    if kind == "dpo":
        m = msg.dpo
        pairs = tuple((completion_from_proto(p.chosen), completion_from_proto(p.rejected)) for p in m.pairs.pairs)
        return DPOJobSpec(m.steps, pairs, m.batch_size or DPOJobSpec(1, ()).batch_size, m.publish_every, m.seed,
                          msg.learning_rate)
    if kind == "rl":
        m = msg.rl
        d = RLJobSpec(steps=1)
        return RLJobSpec(
            steps=m.steps, countdown=_countdown_from_proto(m.countdown) if m.HasField("countdown") else d.countdown,
            prompts_per_step=m.prompts_per_step or d.prompts_per_step, group_size=m.group_size or d.group_size,
            max_tokens=m.max_tokens or d.max_tokens,
            temperature=m.temperature if m.HasField("temperature") else d.temperature,
            top_p=m.top_p if m.HasField("top_p") else d.top_p, seed=m.seed, max_staleness=m.max_staleness,
            eval_every=m.eval_every, eval_prompts=m.eval_prompts or d.eval_prompts, learning_rate=msg.learning_rate,
            checkpoint_every=m.checkpoint_every if m.HasField("checkpoint_every") else d.checkpoint_every, reward=m.reward or d.reward,
            ignore_eos=m.ignore_eos)
    raise InvalidArgument.field("job", "set one of sft, dpo, rl")


def status_to_proto(s: JobStatus) -> jobs_pb2.JobStatus:
    msg = jobs_pb2.JobStatus(job_id=s.job_id, name=s.name, kind=s.kind, state=_STATES[s.state], step=s.step,
                             total_steps=s.total_steps, weights_version=s.weights_version, error=s.error,
                             elapsed_s=s.elapsed_s)
    if s.train_config is not None:
        msg.train_config.CopyFrom(train_config_to_proto(s.train_config))
    return msg


def status_from_proto(m: jobs_pb2.JobStatus) -> JobStatus:
    return JobStatus(m.job_id, m.name, m.kind, _STATES_BACK[m.state], m.step, m.total_steps, m.weights_version,
                     m.error, m.elapsed_s, train_config_from_proto(m.train_config) if m.HasField("train_config") else None)


def event_to_proto(e: JobEvent) -> jobs_pb2.JobEvent:
    msg = jobs_pb2.JobEvent(status=status_to_proto(e.status))
    if e.step is not None:
        msg.step.CopyFrom(jobs_pb2.StepMetrics(step=e.step, weights_version=e.weights_version, metrics=e.metrics))
    return msg


def event_from_proto(m: jobs_pb2.JobEvent) -> JobEvent:
    if m.HasField("step"):
        return JobEvent(status_from_proto(m.status), m.step.step, m.step.weights_version, dict(m.step.metrics))
    return JobEvent(status_from_proto(m.status))


# ----------------------------------------------------------------------------- servicer and client

class JobsServicer(jobs_pb2_grpc.JobsServicer):
    """Serves ``zerokl.v1.Jobs`` from a :class:`JobManager`."""

    def __init__(self, jobs: JobManager) -> None:
        self._jobs = jobs

    async def SubmitJob(self, request: jobs_pb2.JobSpec, context: grpc.aio.ServicerContext) -> jobs_pb2.JobStatus:
        return status_to_proto(self._jobs.submit(spec_from_proto(request), request.name))

    async def WatchJob(self, request: jobs_pb2.WatchJobRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[jobs_pb2.JobEvent]:
        async for event in self._jobs.watch(request.job_id):
            yield event_to_proto(event)

    async def CancelJob(self, request: jobs_pb2.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> jobs_pb2.JobStatus:
        return status_to_proto(self._jobs.cancel(request.job_id))

    async def ListJobs(self, request: jobs_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> jobs_pb2.ListJobsResponse:
        return jobs_pb2.ListJobsResponse(jobs=[status_to_proto(s) for s in self._jobs.list()])


def add_jobs_service(server: ServiceServer, jobs: JobManager) -> None:
    """Serve ``jobs`` as ``zerokl.v1.Jobs`` on ``server`` (before it starts)."""
    server.add_servicer(jobs_pb2_grpc.add_JobsServicer_to_server, JobsServicer(jobs), JOBS_SERVICE)


class JobsClient(ServiceClient):
    """Submit and follow training jobs on a scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stub = jobs_pb2_grpc.JobsStub(self._channel)

    async def submit(self, spec: JobSpec, name: str = "") -> JobStatus:
        return status_from_proto(await self._stub.SubmitJob(spec_to_proto(spec, name)))

    async def watch(self, job_id: str) -> AsyncIterator[JobEvent]:
        """The job's events from its start until it ends (closing the iterator cancels the call)."""
        call = self._stub.WatchJob(jobs_pb2.WatchJobRequest(job_id=job_id))
        try:
            async for msg in call:
                yield event_from_proto(msg)
        finally:
            call.cancel()

    async def cancel(self, job_id: str) -> JobStatus:
        return status_from_proto(await self._stub.CancelJob(jobs_pb2.CancelJobRequest(job_id=job_id)))

    async def list(self) -> list[JobStatus]:
        return [status_from_proto(s) for s in (await self._stub.ListJobs(jobs_pb2.ListJobsRequest())).jobs]
