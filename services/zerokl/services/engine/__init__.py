"""zerokl.services.engine: the batch-invariant inference engine and the process that owns the device.

- :mod:`.engine`: :class:`~.engine.Engine` (continuous batching, paged KV, prefix cache) over
  :mod:`.scheduler` (what runs) and :mod:`.runner` (runs it on the device); :mod:`.types` its structs.
- :mod:`.core`: :class:`~.core.EngineCore`, the one thread that drives the Engine (commands in, one
  list of events out per pass), and the engine process's main (:func:`~.core.serve`).
- :mod:`.outputs`: what crosses the pipe between the engine process and its front (``EngineInfo``,
  a pass's ``StepOutputs``, ``CoreError``); like :mod:`.types`, it imports no torch, so the front of an
  engine process runs without it.
- :mod:`.child`: spawns the engine process; imports nothing heavy (a replica starts it first thing,
  so its imports overlap the server's start).

Nothing here imports grpc or the service runtime: the replica's front
(:class:`zerokl.services.inference.AsyncEngine`) maps the core's errors to statuses. This
``__init__`` imports nothing, so importing :mod:`.child` stays cheap.
"""
