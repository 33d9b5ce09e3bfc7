"""Lockstep process groups: rank 0 serves, the followers repeat its calls in order.

A tensor-parallel serving replica (services/zerokl/services/inference/tensor_parallel.py) and a distributed
trainer (services/zerokl/services/trainer/distributed.py) run the same way: rank 0 is the process a supervisor
started; it spawns ``world - 1`` copies of its own command with their rank (and rank 0's
rendezvous port) in the environment, every rank joins one torch.distributed world on
127.0.0.1 (gloo on CPUs, NCCL with cuda:rank on GPUs), and rank 0 broadcasts each call that
changes state, as a ``(name, args, kwargs)`` tuple over a gloo group, before it runs the call
itself. The followers apply the calls in the same order; the work is deterministic, so their
collectives line up with rank 0's. Rank 0 exits when a follower dies and a follower exits when
its parent is gone, so a supervisor restarts the whole group (an idle group sends nothing for
hours: a collective timeout cannot tell).

    rank, port, followers = rendezvous(world, ENV_RANK, ENV_PORT, ["-m", "pkg", *argv])
    device = rank_device(device, rank); join_world(rank, world, port, device)
    rank 0: send(control, "step"); ...; send(control, STOP)     followers: follow(control, apply, ...)
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["STOP", "rendezvous", "rank_device", "join_world", "exit_when", "watch_followers", "reap", "send",
           "receive", "follow"]

log = logging.getLogger(__name__)

STOP = "stop"      # the call that ends a follower's loop


def exit_when(dead: Callable[[], str | None], name: str) -> None:
    """A daemon thread that exits the process (status 1) once ``dead()`` says why."""
    def watch() -> None:
        while (why := dead()) is None:
            time.sleep(0.5)
        log.error("%s", why)
        os._exit(1)
    threading.Thread(target=watch, name=name, daemon=True).start()


def rendezvous(world: int, env_rank: str, env_port: str, command: Sequence[str],
               **popen: Any) -> tuple[int, int, list[subprocess.Popen]]:
    """This process's (rank, rendezvous port, followers). Rank 0 (``env_rank`` unset) picks a
    free port and spawns ranks 1 .. world - 1 as ``python <command>`` with ``env_rank`` and
    ``env_port`` set; a follower reads the port and exits when its parent (rank 0) is gone."""
    rank = int(os.environ.get(env_rank, "0"))
    followers: list[subprocess.Popen] = []
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for r in range(1, world):
            env = dict(os.environ, **{env_rank: str(r), env_port: str(port)})
            followers.append(subprocess.Popen([sys.executable, *command], env=env, stdin=subprocess.DEVNULL, **popen))
    else:
        port = int(os.environ[env_port])
        parent = os.getppid()
        exit_when(lambda: None if os.getppid() == parent else f"rank {rank}: rank 0 is gone", "zerokl-lockstep-parent-watch")
    return rank, port, followers


def rank_device(device: str | torch.device | None, rank: int) -> torch.device:
    """The device of ``rank``: ``device`` (default cuda when there is one, else cpu); on GPUs
    cuda:rank of what this process sees, made current."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    return dev


def join_world(rank: int, world: int, port: int, device: torch.device) -> None:
    """Join the group's torch.distributed world at tcp://127.0.0.1:port (NCCL on GPUs, gloo
    on CPUs); a process already in a world stays in it."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)


def watch_followers(followers: Sequence[subprocess.Popen], closing: Callable[[], bool], what: str) -> None:
    """Rank 0: exit the process when a follower dies while the group is not closing (its shard
    is gone; the supervisor restarts the whole group)."""
    def dead() -> str | None:
        if closing():
            return None
        gone = [p for p in followers if p.poll() is not None]
        return (f"{what}: follower pid {gone[0].pid} exited with {gone[0].returncode}; stopping the group "
                "(the supervisor restarts it)") if gone and not closing() else None
    exit_when(dead, "zerokl-lockstep-follower-watch")


def reap(followers: Sequence[subprocess.Popen], timeout: float) -> None:
    """Rank 0, after sending STOP: wait for each follower, killing one that outlives ``timeout``."""
    for p in followers:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def send(control, name: str, *args: Any, **kwargs: Any) -> None:
    """Rank 0: broadcast the call ``name(*args, **kwargs)`` to the followers."""
    dist.broadcast_object_list([(name, args, kwargs)], src=0, group=control)


def receive(control) -> tuple[str, tuple, dict]:
    """A follower: the next call rank 0 sent."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def follow(control, apply: Callable[[str, tuple, dict], Any], what: str, rank: int,
           expected: tuple[type[BaseException], ...] = ()) -> None:
    """A follower's life: apply rank 0's calls in order until STOP. A call that fails here fails
    the same way on rank 0 (same state, same arguments), which reports it: an ``expected`` error
    is dropped, any other logged, and the follower keeps in step."""
    while True:
        name, args, kwargs = receive(control)
        if name == STOP:
            return
        try:
            apply(name, args, kwargs)
        except expected:
            pass
        except Exception:  # noqa: BLE001 - rank 0 raises the same error to its caller; keep in step
            log.exception("%s call %s failed on rank %d", what, name, rank)
