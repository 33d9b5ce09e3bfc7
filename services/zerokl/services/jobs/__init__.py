"""zerokl.services.jobs: the Jobs API (SFT, DPO and RL jobs run on the trainer, served by the scheduler process).

- :mod:`.manager`: :class:`JobManager`, job specs, states and events; the RL job's gRPC ports.
- :mod:`.service`: the ``zerokl.v1.Jobs`` servicer.
"""
