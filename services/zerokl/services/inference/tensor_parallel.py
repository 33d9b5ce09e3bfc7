"""Tensor-parallel replicas: one serving process and tp - 1 followers running the same engine in lockstep.

`zerokl serve decode --tp 2 ...` starts rank 0, which serves gRPC, and spawns the followers
(the same command with ZEROKL_TP_RANK set). Every rank loads the same weights, shards them
with `apply_tensor_parallel` (the exact layout: every rank computes the single-device bits)
and builds the same Engine. Rank 0's engine is wrapped in a `LockstepEngine`: each call that
changes engine state (add_request, abort, step) is broadcast to the followers before it runs,
and they apply it to their own engine. The engine is deterministic (admission counters, seeded
sampling, no clocks in scheduling), so every rank schedules the same batch at every step and
the sharded forward's collectives line up; the followers' outputs are discarded.

What a request gets is what a TP = 1 replica gives it (the same numerics fingerprint: a TP = 2
replica joins a fleet of TP = 1 replicas). SwitchWeights works as on one process: rank 0 fetches
the version, its full tensors are broadcast to the followers, and every rank loads its own shards
(`shard_state_dict`) between steps.
"""
from __future__ import annotations

import logging
import subprocess
from typing import Any, Sequence

import torch
import torch.distributed as dist

from zerokl.kernels.model.parallel import shard_state_dict
from zerokl.services.engine.engine import Engine, RequestError
from zerokl.services.runtime import lockstep

__all__ = ["ENV_RANK", "ENV_PORT", "LockstepEngine", "TensorParallelGroup", "follow", "start_tensor_parallel"]

log = logging.getLogger(__name__)

ENV_RANK = "ZEROKL_TP_RANK"      # set on followers: their rank (1 .. tp-1)
ENV_PORT = "ZEROKL_TP_PORT"      # rank 0's rendezvous port on 127.0.0.1


class TensorParallelGroup:
    """This process's place in a replica's TP group: the compute group (NCCL on GPUs, gloo on
    CPUs) that the sharded model's collectives use, and a gloo group for engine calls."""

    def __init__(self, tp: int, rank: int, port: int, device: torch.device, followers: list[subprocess.Popen]):
        self.tp, self.rank, self.device, self.followers = tp, rank, device, followers
        self.closing = False                      # rank 0: followers may exit now
        lockstep.join_world(rank, tp, port, device)
        self.compute = dist.group.WORLD
        self.control = dist.new_group(backend="gloo")

    def watch_followers(self) -> None:
        """Rank 0: exit the process if a follower dies while serving (its shard is gone; a
        supervisor restarts the whole replica)."""
        lockstep.watch_followers(self.followers, lambda: self.closing, "tensor-parallel replica")

    def close(self, timeout: float = 10.0) -> None:
        """Rank 0: wait for the followers (after LockstepEngine.stop), then end the group."""
        self.closing = True
        lockstep.reap(self.followers, timeout)
        dist.destroy_process_group()


def start_tensor_parallel(tp: int, service: str, argv: Sequence[str], device: str | None) -> TensorParallelGroup:
    """Join (a follower: ZEROKL_TP_RANK set) or start (rank 0: spawn the followers) a TP group.

    Followers run `python -m zerokl.services.inference <service> <argv>` with the rank in their
    environment; on GPUs rank r uses cuda:r of what this process sees.
    """
    rank, port, followers = lockstep.rendezvous(tp, ENV_RANK, ENV_PORT, ["-m", "zerokl.services.inference", service, *argv])
    group = TensorParallelGroup(tp, rank, port, lockstep.rank_device(device, rank), followers)
    if followers:
        group.watch_followers()
    return group


class LockstepEngine:
    """Rank 0's view of a TP replica's engines: the Engine's interface; every state-changing
    call is broadcast to the followers (in call order, from the engine thread) before it runs
    here. Reads (has_work, config, model, stats, ...) go to the local engine."""

    def __init__(self, engine: Engine, group: TensorParallelGroup):
        self.engine, self.group = engine, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _send(self, *call: Any) -> None:
        lockstep.send(self.group.control, *call)

    def add_request(self, request: Any) -> None:
        self._send("add_request", request)
        return self.engine.add_request(request)

    def abort(self, request_id: str) -> list:
        self._send("abort", request_id)
        return self.engine.abort(request_id)

    def step(self) -> list:
        self._send("step")
        return self.engine.step()

    def set_cache_identity(self, weights_version: str, numerics_fingerprint: str) -> None:
        self._send("set_cache_identity", weights_version, numerics_fingerprint)
        self.engine.set_cache_identity(weights_version, numerics_fingerprint)

    def sleep(self, level: int) -> int:
        """Not for a tensor-parallel replica (yet): its followers would keep their memory and fall out of
        lockstep; the core answers FAILED_PRECONDITION."""
        raise ValueError("a tensor-parallel replica does not sleep (co-location is for --tp 1)")

    def load_weights(self, state_dict: dict, weights_version: str = "") -> None:
        """Every rank loads its shards of the full `state_dict` (sent to the followers first)."""
        self._send("load_weights", weights_version)
        _broadcast_state_dict(state_dict, self.group)
        _load_shards(self.engine, state_dict, self.group, weights_version)

    def stop(self) -> None:
        """Tell the followers to exit (after the engine thread has stopped)."""
        self.group.closing = True
        self._send(lockstep.STOP)


def follow(engine: Engine, group: TensorParallelGroup) -> None:
    """A follower's life: apply rank 0's engine calls in order until it says stop (a request
    rank 0's engine refused is refused here too, by the same check: rank 0 tells the client)."""
    def apply(name: str, args: tuple, kwargs: dict) -> None:
        if name == "load_weights":
            _load_shards(engine, _broadcast_state_dict(None, group), group, *args)
        else:
            getattr(engine, name)(*args, **kwargs)
    lockstep.follow(group.control, apply, "engine", group.rank, expected=(RequestError,))


def _broadcast_state_dict(state_dict: dict | None, group: TensorParallelGroup) -> dict:
    """Rank 0 sends `state_dict` (None on followers) to every rank: names, shapes and dtypes as
    one object, then each tensor's bytes (any dtype travels as uint8 over gloo)."""
    meta = [[(k, tuple(t.shape), t.dtype) for k, t in state_dict.items()] if state_dict is not None else None]
    dist.broadcast_object_list(meta, src=0, group=group.control)
    out = {}
    for name, shape, dtype in meta[0]:
        if state_dict is not None:
            t = state_dict[name].detach().to("cpu").contiguous()
            raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        else:
            raw = torch.empty(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
        dist.broadcast(raw, src=0, group=group.control)
        out[name] = state_dict[name] if state_dict is not None else raw.view(dtype).view(shape)
    return out


def _load_shards(engine: Engine, state_dict: dict, group: TensorParallelGroup, weights_version: str = "") -> None:
    model = engine.model
    engine.load_weights(shard_state_dict(state_dict, model.config, group.compute, model.dtype), weights_version)
