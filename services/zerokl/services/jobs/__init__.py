"""zerokl.services.jobs: the Jobs API (SFT, DPO and RL jobs run on the trainer, served by the scheduler process).

- :mod:`.types`: job specs, states, statuses and step events (plain dataclasses, no torch).
- :mod:`.manager`: :class:`~.manager.JobManager`, which runs jobs in the scheduler; the RL job's gRPC ports.
- :mod:`.service`: the ``zerokl.v1.Jobs`` servicer and :class:`~.service.JobsClient`.

A client needs only what this package exports (docs/api.md, "The Jobs API")::

    from zerokl.services.jobs import CountdownTask, JobsClient, JobState, RLJobSpec
"""
from zerokl.services.jobs.service import JobsClient
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

__all__ = [
    "CountdownTask",
    "DPOJobSpec",
    "JobEvent",
    "JobSpec",
    "JobState",
    "JobStatus",
    "JobsClient",
    "RLJobSpec",
    "SFTJobSpec",
]
