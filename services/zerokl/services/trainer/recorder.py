"""The store's records of a trainer's shared versions, written and uploaded in a process of its own (issue 49).

An RL job shares every step's version in place and records it in the weight store in the background
(:mod:`zerokl.services.trainer.service`). That record's host work (a version's files written from the
trainer's shared memory, their sha256 and per-chunk checksums, the delta against the version recorded
before, the gRPC upload) ran in threads of the trainer's own process, so its Python-level work took the
trainer's interpreter lock beside the step: on an H100 a ~0.27 s update took 0.6-1.4 s with a record in
flight (docs/perf.md). Here it runs in a child process spawned once per trainer (on the first record),
which opens the store as the trainer does (:func:`zerokl.services.trainer.checkpointing.open_repo`, the same
flags), and is fed plain descriptors over a pipe, one request at a time:

- ``write``: a weights-only version's serving files, from the trainer's shared export
  (:class:`~zerokl.services.weightstore.shared.SharedExport`: the child copies the bytes out and checks
  their checksum, :func:`~zerokl.services.weightstore.sync.open_shared`, so what is recorded is what the
  fleet was sent); a checkpoint's files (its trainer state) the trainer writes itself, its serving weights copied
  out of the export and checked the same way (:func:`~zerokl.services.weightstore.sync.copy_checked`);
- ``upload``: a written directory published as a version (each file that the version recorded before, or
  with ``--record-deltas start`` the version the trainer started from, holds too goes as a delta against it,
  :class:`DeltaBases`); the child owns the directory from then on;
- ``drop``: a record's files the trainer will not upload (its record failed for good).

A weights-only version's files stay in the child's memory, never on disk, when no record reads them after their
upload (``--record-deltas start`` and ``off``: the next record's base is the store's version, or none): the child
builds the bytes :func:`~zerokl.services.trainer.checkpointing.write_snapshot` would write (the same names and
sha256) in buffers of its own, out of its copy of the export, giving that copy's pages back as it goes
(:func:`~zerokl.services.trainer.checkpointing.serving_sources`: the bytes are held once, plus the file being built), and the
upload reads them there. The GLM-5 slice's record then writes none of its 22.7 GiB to the disk and reads none back
(docs/perf.md, "The slice's job: the disk"). The trainer knows such a record by a directory name that does not
exist (:func:`_reserved`): the child holds its files under that name, and writes them there only when a second
record comes while the first still waits for its upload (a store outage), so the records an outage holds take the
disk, as before, not the host's memory. With ``previous`` the record's files are the next record's delta base, read
from the disk: they are written there, as before. A child that dies takes the buffers with it: the trainer's next
upload of the record finds neither (:class:`RecordLost`) and writes it again from the export it still holds.

A ``write`` answers ``copied`` first, once the child holds the export's bytes, so the trainer can free the
export (device memory a co-located trainer's backward needs) while the files are still being written.

The child dies with the trainer (``PR_SET_PDEATHSIG``): a trainer killed with a record in flight leaves an
open upload in the store, never a manifest, as before. A child that dies alone (the host's OOM killer) fails the
request in flight with :class:`RecordProcessDied` and the next request starts another: the trainer asks again with
what it still holds (:meth:`~zerokl.services.trainer.service.TrainerService._record`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import os
import pathlib
import shutil
import tempfile
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

import grpc
import torch

from zerokl.kernels.model import ModelConfig
from zerokl.services.lifetime import die_with_parent
from zerokl.services.runtime import errors
from zerokl.services.runtime.errors import Internal, ServiceError
from zerokl.services.trainer.checkpointing import (CheckpointSnapshot, HostBuffer, WeightsRepo, open_repo,
                                                   publish_checkpoint, serving_sources, write_snapshot)
from zerokl.services.weightstore.client import UploadBase, is_serving_file
from zerokl.services.weightstore.source import ShardSource
from zerokl.services.weightstore.shared import SharedExport
from zerokl.services.weightstore.store import VersionSpec, WeightsManifest
from zerokl.services.weightstore.sync import open_shared

__all__ = ["DeltaBases", "RecordWorker", "RecordFailed", "RecordProcessDied", "RecordLost", "DELTA_BASES",
           "IN_MEMORY"]

log = logging.getLogger(__name__)

DELTA_BASES = ("previous", "start", "off")     # --record-deltas: what a record's files are deltas against
IN_MEMORY = ("start", "off")    # --record-deltas whose weights-only records go from the child's memory (no file read)
_CHILD_THREADS = 4      # the child's torch threads (its host copies); the store client has its own pool


class RecordFailed(Internal):
    """The record process could not write or upload a version (its error, by name): INTERNAL to a RecordWeights
    caller, with that message."""


class RecordProcessDied(RecordFailed):
    """The record process died with the request in flight (killed, or out of memory): the request did not happen
    (an upload cut off leaves an open upload, never a manifest), and the next request starts another process."""


class RecordLost(RecordProcessDied):
    """A record's files were in the memory of a record process that died (or on no disk): the trainer writes them
    again from what it still holds, as after a death in the write."""


class DeltaBases:
    """The serving files the next record's files go as deltas against, kept on disk, so the store writes what
    changed (weightstore/delta.py). A record's upload holds the base it started with (a retried record may upload
    beside the next one): a directory is removed only once no upload reads it.

    ``pinned`` False (``--record-deltas previous``): the base is the newest version recorded, so each delta is one
    step's change, but the record process keeps that version's files whole (the model's bytes again on disk).
    ``pinned`` True (``--record-deltas start``): the base stays the first one (the version the trainer started
    from, hard links into a store on this disk: no bytes) and each recorded directory goes once the store holds
    it; each delta then holds every change since the start, so it grows with the job, until a record goes mostly
    whole (its deltas over half their files), which then becomes the base the same way (:meth:`offer`). For a
    model whose bytes the disk cannot hold twice more (a co-located slice on one machine)."""

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned
        self.current: UploadBase | None = None
        self._step = -1
        self._users: dict[pathlib.Path, int] = {}
        self._retired: set[pathlib.Path] = set()

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[UploadBase | None]:
        base = self.current
        if base is not None:
            self._users[base.directory] = self._users.get(base.directory, 0) + 1
        try:
            yield base
        finally:
            if base is not None:
                self._users[base.directory] -= 1
                await self._collect()

    async def offer(self, step: int, manifest: WeightsManifest, directory: pathlib.Path | None,
                    repo: WeightsRepo | None = None) -> None:
        """``directory`` holds the files of ``manifest`` (recorded at trainer ``step``): keep its serving files as
        the base of the next records (unless a later version's already are); the rest of it goes. None: the files
        were uploaded from memory (pinned only), so a base taken from this record is fetched from ``repo``.

        Pinned, the directory goes whole, and the base stays, unless the record went mostly whole. That happens
        once its deltas against the base were over half their files (the store client's rule). The next records
        then go against this version instead, fetched from ``repo`` (hard links from a store on this disk), so a
        long job's records do not all go whole."""
        if directory is None:
            assert self.pinned, "a record uploaded from memory is no base of a later one (--record-deltas previous)"
            if repo is not None and step >= self._step and (self.current is None or _mostly_whole(manifest)):
                await self._fetch(repo, manifest.version, step)
            return
        await asyncio.to_thread(_keep_serving, directory)
        if step < self._step:
            self._retired.add(directory)
        elif self.pinned and self.current is not None:
            self._retired.add(directory)
            if repo is not None and _mostly_whole(manifest):
                await self._fetch(repo, manifest.version, step)
        else:
            if self.current is not None:
                self._retired.add(self.current.directory)
            self.current, self._step = UploadBase(manifest, directory), step
        await self._collect()

    async def start_from(self, repo: WeightsRepo, version: str) -> None:
        """No base yet (the process's first record): the serving files of ``version`` (the record's parent: the
        version the trainer started from) fetched from the store as the base, so the first record goes as a delta
        too instead of whole. From a store on this host's disk (``--weight-store-root``) they are hard links: no
        bytes. A parent the store does not hold (never recorded, superseded, deleted) leaves no base."""
        if self.current is not None or not version:
            return
        await self._fetch(repo, version, -1)

    async def _fetch(self, repo: WeightsRepo, version: str, step: int) -> None:
        """``version``'s serving files from the store as the base from here (kept when the store cannot give them)."""
        directory = pathlib.Path(tempfile.mkdtemp(prefix="zerokl-trainer-record-base-"))
        try:
            manifest = await repo.fetch(version, directory, serving_only=True)
            await asyncio.to_thread(_keep_serving, directory)     # the fetch's own manifest file too
        except (ServiceError, OSError) as err:
            shutil.rmtree(directory, True)
            log.info("record process: no delta base from %s (%s); the base stays %s", version,
                     getattr(err, "message", None) or err, self.current.manifest.version if self.current else "none")
            return
        if self.current is not None:
            self._retired.add(self.current.directory)
        self.current, self._step = UploadBase(manifest, directory), step
        await self._collect()

    async def close(self) -> None:
        if self.current is not None:
            self._retired.add(self.current.directory)
            self.current = None
        await self._collect()

    async def _collect(self) -> None:
        for directory in [d for d in self._retired if not self._users.get(d)]:
            self._retired.discard(directory)
            self._users.pop(directory, None)
            await asyncio.to_thread(shutil.rmtree, directory, True)


class RecordWorker:
    """The trainer's side of the record process: one request at a time, in the order called.

    ``args``: the trainer's flags (the child opens the same store with them); ``deltas`` (``--record-deltas``):
    send files as deltas against the version recorded before (``previous``), against the version the trainer
    started from (``start``, :class:`DeltaBases` ``pinned``), or whole (``off``)."""

    def __init__(self, args: argparse.Namespace, deltas: str = "previous") -> None:
        if deltas not in DELTA_BASES:
            raise ValueError(f"deltas must be one of {DELTA_BASES}, got {deltas!r}")
        self._args = argparse.Namespace(**{k: v for k, v in vars(args).items() if _plain(v)})
        self.deltas = deltas
        self._process: Any = None
        self._conn: Any = None
        self._lock = asyncio.Lock()

    async def write(self, export: SharedExport, model_config: ModelConfig, dtype: torch.dtype,
                    copied: Callable[[], None] | None = None) -> pathlib.Path:
        """A weights-only version's serving files, made by the child from the trainer's shared ``export``; their
        directory: on disk, or (``--record-deltas`` in :data:`IN_MEMORY`) a name that does not exist, under which
        the child holds them in its memory. The caller keeps the export open until ``copied`` is called (the child
        holds the bytes in its own memory from then on, before it builds the files) or this returns."""
        return pathlib.Path(await self._call(("write", export, model_config, dtype), copied))

    async def upload(self, directory: pathlib.Path, name: str, spec: VersionSpec, step: int) -> WeightsManifest:
        """Publish ``directory`` as ``name`` (recorded at trainer ``step``; the child owns the directory, or the
        buffers it holds under that name, from here: a failed upload keeps them for a retry); its manifest.
        :class:`Unavailable` when the store is out; :class:`RecordLost` when the files were in the memory of a
        record process that died."""
        return await self._call(("upload", str(directory), name, spec, step))

    async def drop(self, directory: pathlib.Path) -> None:
        """Let go of a record's files that will not be uploaded (its record failed for good): the child's buffers
        held under ``directory``, and the directory."""
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(RecordFailed):
                await self._call(("drop", str(directory)))
        await asyncio.to_thread(shutil.rmtree, directory, True)

    async def close(self) -> None:
        """Stop the child (after the request in flight), its delta bases removed."""
        async with self._lock:
            if self._process is None:
                return
            with contextlib.suppress(OSError, EOFError, BrokenPipeError):
                await asyncio.to_thread(self._conn.send, ("close",))
                await asyncio.to_thread(self._conn.recv)
            await asyncio.to_thread(self._process.join, 30)
            if self._process.is_alive():
                self._process.kill()
            self._conn.close()
            self._process = self._conn = None

    async def _call(self, request: tuple, copied: Callable[[], None] | None = None) -> Any:
        async with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            try:
                await asyncio.to_thread(self._conn.send, request)
                kind, value = await asyncio.to_thread(self._conn.recv)
                if kind == "copied":        # a write's bytes are the child's now; its reply follows
                    if copied is not None:
                        copied()
                    kind, value = await asyncio.to_thread(self._conn.recv)
            except (EOFError, OSError) as err:
                process, self._process = self._process, None
                self._conn.close()
                self._conn = None
                await asyncio.to_thread(process.join, 5)
                if process.is_alive():      # its end of the pipe is gone: it can serve no request again
                    process.kill()
                how = (f"killed by signal {-process.exitcode}" if process.exitcode is not None and process.exitcode < 0
                       else f"exit code {process.exitcode}" if process.exitcode is not None else type(err).__name__)
                raise RecordProcessDied(f"the record process died ({how})") from None
        if kind == "ok":
            return value
        if kind == "lost":
            raise RecordLost(value)
        if kind == "raise":     # a service error of the store's (AlreadyExists, Unavailable...), as it was raised
            name, message = value
            error = getattr(errors, name, None)
            raise (error if isinstance(error, type) and issubclass(error, ServiceError) else ServiceError)(message)
        raise RecordFailed(value)

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_main, args=(child, os.getpid(), self._args, self.deltas),
                                    name="zerokl-trainer-record", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent


def _reserved() -> pathlib.Path:
    """A record directory's name, not created: the child holds the files under it in memory until (if ever) it
    writes them there."""
    return pathlib.Path(tempfile.gettempdir()) / f"zerokl-trainer-record-{uuid.uuid4().hex[:12]}"


def _free(sources: Sequence[ShardSource]) -> None:
    """The buffers of ``sources`` given back (a buffer some view still reads goes with that view)."""
    for source in sources:
        if source.in_memory and hasattr(source.data, "close"):
            with contextlib.suppress(BufferError):
                source.data.close()


def _keep_serving(directory: pathlib.Path) -> None:
    """Remove every file of ``directory`` but the serving ones (a delta base's)."""
    for path in directory.iterdir():
        if not is_serving_file(path.name):
            path.unlink()


def _mostly_whole(manifest: WeightsManifest) -> bool:
    """Most of ``manifest``'s serving bytes were stored whole, not as deltas."""
    serving = [s for s in manifest.shards if is_serving_file(s.name)]
    return 2 * sum(s.size for s in serving if not s.base) > sum(s.size for s in serving)


class _Lost(Exception):
    """The child holds no files under the directory name asked for, and no disk does: :class:`RecordLost`."""


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, tuple, pathlib.PurePath))


# ----------------------------------------------------------------------------- the child

def _main(conn: Any, parent_pid: int, args: argparse.Namespace, deltas: str) -> None:
    if not die_with_parent(parent_pid):
        return      # the trainer died before its death signal was armed
    torch.set_num_threads(_CHILD_THREADS)
    asyncio.run(_serve(conn, args, deltas))


async def _serve(conn: Any, args: argparse.Namespace, deltas: str) -> None:
    repo = await open_repo(args)
    bases = DeltaBases(pinned=deltas == "start") if deltas != "off" else None
    # Records whose files this process holds (IN_MEMORY), by their directory's name: buffers, or files written there
    # once a later record came before their upload (an outage).
    held: dict[str, list[ShardSource]] = {}

    def forget(directory: str) -> None:
        _free(held.pop(directory, ()))
        shutil.rmtree(directory, True)

    def spill() -> None:
        """Every record held in memory written to its directory and its buffers freed: one model's bytes in this
        process's memory at most, the one being built (a store out for a while holds one record a step)."""
        for directory, sources in held.items():
            if any(s.in_memory for s in sources):
                path = pathlib.Path(directory)
                path.mkdir(parents=True, exist_ok=True)
                held[directory] = [s.write_to(path) for s in sources]
                _free(sources)
                log.info("record process: %s's files written to %s (a later record came before its upload)",
                         directory, path)

    def build(export: SharedExport, model_config: ModelConfig, dtype: torch.dtype) -> str:
        """The files in memory: the export copied into a buffer whose pages go as the files are built out of it."""
        spill()
        directory = str(_reserved())
        copy = HostBuffer(int(export.total_bytes))
        try:
            tensors = open_shared(export, copied=lambda: conn.send(("copied", None)), into=copy.tensor)
            sources = serving_sources(CheckpointSnapshot(tensors, model_config, dtype), release=copy.release)
        finally:
            tensors = {}
            copy.close()
        held[directory] = sources
        return directory

    try:
        while True:
            try:
                request = await asyncio.to_thread(conn.recv)
            except EOFError:
                return
            kind = request[0]
            if kind == "close":
                return
            try:
                if kind == "write" and deltas in IN_MEMORY:
                    _, export, model_config, dtype = request
                    reply = ("ok", await asyncio.to_thread(build, export, model_config, dtype))
                elif kind == "write":
                    _, export, model_config, dtype = request

                    def write() -> str:
                        directory = tempfile.mkdtemp(prefix="zerokl-trainer-record-")
                        try:
                            # Copied out (the trainer may free its export then), and checked: what the fleet was sent.
                            tensors = open_shared(export, copied=lambda: conn.send(("copied", None)))
                            write_snapshot(CheckpointSnapshot(tensors, model_config, dtype), directory)
                        except BaseException:
                            shutil.rmtree(directory, True)
                            raise
                        return directory
                    reply: tuple = ("ok", await asyncio.to_thread(write))
                elif kind == "upload":
                    _, directory, name, spec, step = request
                    path = pathlib.Path(directory)
                    sources = held.get(directory)
                    if sources is None and not path.is_dir():
                        raise _Lost(f"the files of {name} were in the memory of a record process that died (or on "
                                    f"no disk: {path})")
                    src = path if sources is None else sources
                    if bases is None:
                        manifest, _ = await publish_checkpoint(repo, src, name, spec, None)
                    else:
                        await bases.start_from(repo, spec.parent_version)
                        async with bases.use() as base:
                            manifest, _ = await publish_checkpoint(repo, src, name, spec, base)
                    if sources is not None:
                        forget(directory)       # the store holds them: the buffers (or their spilled files) go
                        if bases is not None:
                            await bases.offer(step, manifest, None, repo)
                    elif bases is None:
                        await asyncio.to_thread(shutil.rmtree, path, True)  # no base kept: the files are the store's
                    else:
                        await bases.offer(step, manifest, path, repo)   # the next record's base, or gone (pinned)
                    reply = ("ok", manifest)
                elif kind == "drop":
                    forget(request[1])
                    reply = ("ok", None)
                else:
                    reply = ("error", f"unknown request {kind!r}")
            except _Lost as err:
                reply = ("lost", str(err))
            except ServiceError as err:
                # By the status class the trainer knows it by (a store's own subclass, StorageFull: ResourceExhausted).
                known = next(c for c in type(err).__mro__ if getattr(errors, c.__name__, None) is c)
                reply = ("raise", (known.__name__, err.message))
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    reply = ("raise", ("Unavailable", err.details()))
                else:
                    reply = ("error", f"{err.code().name}: {err.details()}")
            except Exception as err:  # noqa: BLE001 - said to the trainer, by name; the child keeps serving
                reply = ("error", f"{type(err).__name__}: {err}")
            await asyncio.to_thread(conn.send, reply)
    finally:
        with contextlib.suppress(Exception):
            conn.send(("ok", None))
        if bases is not None:
            await bases.close()
        await repo.close()
