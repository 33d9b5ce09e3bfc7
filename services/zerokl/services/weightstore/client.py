"""Async client of the WeightStore service.

RPC failures surface as ``grpc.aio.AioRpcError`` with the server's status
code; a fetched shard that fails its checksum on this side raises
:class:`~zerokl.services.runtime.errors.DataLoss`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import mmap
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Mapping, Sequence

import grpc
import grpc.aio

from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, chunk_from_proto
from zerokl.services.runtime.info import ServiceIdentity, identity_from_proto
from zerokl.services.runtime.client import ServiceClient
from zerokl.services.runtime.errors import DataLoss
from zerokl.services.weightstore import convert, delta
from zerokl.services.weightstore.source import ShardSource, shard_sources
from zerokl.services.weightstore.store import (
    FETCHED_MANIFEST,
    GcResult,
    ShardFileWriter,
    ShardStatus,
    UploadStatus,
    VersionEntry,
    VersionSpec,
    WeightsManifest,
    local_shard_path,
)
from zerokl.v1 import blob_pb2, common_pb2, weights_pb2, weights_pb2_grpc

__all__ = ["WeightStoreClient", "UploadBase", "CHUNKS_IN_FLIGHT", "PARALLEL_SHARDS", "shard_digests", "is_serving_file"]

log = logging.getLogger(__name__)


def is_serving_file(name: str) -> bool:
    """Whether a replica needs this checkpoint file: config, tokenizer and model weights."""
    return name in ("config.json", "tokenizer.json") or name.startswith("model")


# Chunks sent ahead of the store's acknowledgements: enough to keep the client hashing and sending
# while the store verifies and writes (one chunk at a time left both sides idle half the time);
# the bytes held unacknowledged stay bounded (8 x 4 MiB).
CHUNKS_IN_FLIGHT = 8
# Files of one upload sent at once, each on a PutShard stream of its own (the store writes each in a thread of its
# own): a version written as several shards (the trainer's records) takes that many of the host's cores.
PARALLEL_SHARDS = 8
# How grpc's client reports a write core refused to send (the stream was ending): its INTERNAL status's details.
_CORE_REFUSED = "Internal error from Core"


@dataclass(frozen=True)
class UploadBase:
    """A published version whose files the uploader still holds in ``directory``: a file of the same name and size
    goes as a delta against it (:mod:`~zerokl.services.weightstore.delta`: what changed) when that is smaller."""

    manifest: WeightsManifest
    directory: pathlib.Path

    def delta_base(self, name: str, size: int) -> tuple[delta.DeltaBase, pathlib.Path] | None:
        """What a file ``name`` of ``size`` bytes may be a delta against, and the local copy of it."""
        info = next((s for s in self.manifest.shards if s.name == name), None)
        local = self.directory / name
        if size < delta.MIN_SIZE or info is None or info.size != size or info.depth >= delta.MAX_DEPTH \
                or not local.is_file() \
                or local.stat().st_size != size:
            return None
        return delta.DeltaBase(self.manifest.version, name, size, info.sha256), local


def _encode(view: Any, ref: delta.DeltaBase, local: pathlib.Path) -> bytes | None:
    """The delta of ``view`` (the new file's bytes, mapped or in memory) against the base's file ``local``."""
    with open(local, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as old:
        return delta.encode(view, old, ref)


def shard_digests(data: Any) -> tuple[str, list[bytes]]:
    """(hex sha256 of ``data``, the sha256 digest of each MAX_CHUNK_BYTES chunk of it): one pass over
    the bytes, the two hashes in two threads (hashlib releases the GIL on large buffers)."""
    with memoryview(data) as view, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerokl-sha256") as pool:
        total = pool.submit(lambda: hashlib.sha256(view).hexdigest())
        chunks = [hashlib.sha256(view[i:i + MAX_CHUNK_BYTES]).digest() for i in range(0, len(view), MAX_CHUNK_BYTES)]
        return total.result(), chunks


async def _first(wait: Awaitable[Any], failed: "asyncio.Future[Any]") -> None:
    """Await ``wait``, unless ``failed`` ends first (then raise its error); ``wait`` is never left running."""
    task = asyncio.ensure_future(wait)
    try:
        done, _ = await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancelled(task)
    if task not in done:
        failed.result()     # raises the stream's status
        raise RuntimeError("PutShard acknowledged every chunk before all were sent")


async def _cancelled(*tasks: "asyncio.Future[Any]") -> None:
    """Cancel ``tasks`` and wait until each has ended, its error (if any) retrieved: none is left running, nor
    collected later as a task pending or one whose exception was never retrieved."""
    running = [t for t in tasks if not t.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running)
    for task in tasks:
        if not task.cancelled():
            task.exception()


_PENDING = object()


def _settled(coro: Any) -> Any:
    """The value of a call's accessor (``code()``, ``details()``, ``trailing_metadata()``) where grpc holds it already
    (a finished call's status: the coroutine returns without waiting), read now; :data:`_PENDING` where it would wait.
    For :class:`_StreamEnd`'s done callback, which must read the status before anything else runs."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    return _PENDING


class _StreamEnd:
    """The first status grpc gives a call: the server's, or the transport's when the connection dropped.

    grpc can replace it. A write in flight when the server ends the stream fails in core, and grpc then sets INTERNAL
    "Internal error from Core" over the status it had received: the call's ``code()``/``details()`` after that, a
    write (``asyncio.InvalidStateError`` "RPC already finished", read back as that INTERNAL) and even a read say
    INTERNAL, not why the stream ended (seen against a real server ending PutShard with an error while chunks were
    in flight). A done callback runs as grpc sets the first status, before the write's failure can replace it."""

    def __init__(self, call: Any) -> None:
        self.status: tuple[grpc.StatusCode, str, Any] | None = None     # (code, details, trailing metadata)
        call.add_done_callback(self._done)

    def _done(self, call: Any) -> None:
        if self.status is not None:
            return
        code, details, trailing = _settled(call.code()), _settled(call.details()), _settled(call.trailing_metadata())
        if code is not _PENDING and details is not _PENDING:
            self.status = (code, details or "", None if trailing is _PENDING else trailing)


def _core_refused(code: grpc.StatusCode, details: str) -> bool:
    """grpc's INTERNAL for a write core refused to send on a stream that was ending: no status of the server's."""
    return code is grpc.StatusCode.INTERNAL and (details or "").startswith(_CORE_REFUSED)


async def _why_ended(call: Any, end: _StreamEnd, err: BaseException) -> BaseException:
    """The error a PutShard stream that failed with ``err`` (an AioRpcError, or asyncio.InvalidStateError for a write
    to a finished call) is raised as: the status the server ended it with, as it sent it (RESOURCE_EXHAUSTED for a
    store with no room, ...: for the caller to judge), wherever grpc still has it (the first status the call got,
    then ``err``'s, then the call's own); UNAVAILABLE only when none is the server's, the stream gone without one (a
    dropped connection: a PutShard resumes where the store's copy ends, so the caller's retry is safe)."""
    said: list[tuple[grpc.StatusCode, str, Any]] = []
    if end.status is not None:
        said.append(end.status)
    if isinstance(err, grpc.aio.AioRpcError):
        said.append((err.code(), err.details() or "", err.trailing_metadata()))
    if call.done():
        said.append((await call.code(), await call.details() or "", await call.trailing_metadata()))
    for code, details, trailing in said:
        if code is not grpc.StatusCode.OK and not _core_refused(code, details):
            return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details)
    if any(code is grpc.StatusCode.OK for code, _, _ in said):
        return RuntimeError("the store ended the stream before it was sent whole")
    why = said[0][1] if said else f"{type(err).__name__}: {err}"
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                f"the stream to the store ended while sending ({why})")


async def _finish(call: Any) -> None:
    """End a PutShard ``call`` leaving nothing of it behind: cancelled unless it is done, and its writes ended.

    The channel's interceptors make it grpc's intercepted call, whose writes go through a queue to a task of grpc's
    that sends them (``_consume_request_iterator``, reading an async generator that waits on the queue). Once the
    server has ended the call, ``call.cancel()`` no longer stops that task: it waits on the queue forever, and when
    the call is dropped the garbage collector finds it pending ("Task was destroyed but it is pending!") and closes
    its generator while it runs ("Task exception was never retrieved ... aclose(): asynchronous generator is already
    running"), once per failed stream: a store refusing every upload flooded the trainer's log with them. Ending the
    writes (``done_writing``) lets that task finish."""
    call.cancel()
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
        await call.done_writing()


class WeightStoreClient(ServiceClient):
    """Publish, fetch, list and watch weight versions over gRPC.

    Pass a ``target`` (``host:port``) and optionally a bearer ``token``, TLS
    ``credentials`` and a tracer provider, or an existing ``channel``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stub = weights_pb2_grpc.WeightStoreStub(self._channel)

    async def info(self) -> ServiceIdentity:
        """The store's identity, with the newest version as its weights version."""
        return identity_from_proto(await self._stub.Info(common_pb2.InfoRequest()))

    # ---- publishing ---------------------------------------------------------

    async def publish(self, source: Mapping[str, Any] | str | os.PathLike[str] | Sequence[ShardSource],
                      version: str, *,
                      parent_version: str = "", step: int | None = None, numerics_version: str = "",
                      numerics_fingerprint: str = "", model_config: Mapping[str, Any] | None = None,
                      metadata: Mapping[str, str] | None = None,
                      max_shard_bytes: int = 2 * 1024**3, base: UploadBase | None = None) -> WeightsManifest:
        """Publish a state dict, a checkpoint directory or a version's files (:class:`ShardSource` s: on disk or in
        memory) as ``version``.

        A state dict is written as a sharded safetensors checkpoint (with
        ``model_config`` as config.json) first. For files, a missing
        ``model_config`` is read from their config.json. Re-running after a
        crash resumes the open upload of that version. ``base``: files that
        an earlier version holds too go as deltas against it (:class:`UploadBase`).
        """
        if isinstance(source, Mapping):
            # torch is imported on use: the weight-store server itself never needs it.
            from zerokl.kernels.model.checkpoint import save_tensors
            with tempfile.TemporaryDirectory(prefix="zerokl-publish-") as tmp:
                await asyncio.to_thread(save_tensors, source, tmp, max_shard_bytes)
                if model_config is not None:
                    (pathlib.Path(tmp) / "config.json").write_text(json.dumps(dict(model_config), indent=2, sort_keys=True))
                return await self.publish(tmp, version, parent_version=parent_version, step=step,
                                          numerics_version=numerics_version,
                                          numerics_fingerprint=numerics_fingerprint,
                                          model_config=model_config, metadata=metadata)
        sources = shard_sources(source)
        config = next((s for s in sources if s.name == "config.json"), None)
        if model_config is None and config is not None:
            with config.view() as view:
                model_config = json.loads(bytes(view))
        spec = VersionSpec(parent_version, step, numerics_version, numerics_fingerprint,
                           dict(model_config or {}), dict(metadata or {}))
        upload = await self.begin_upload(version)
        await self.upload_dir(upload.upload_id, sources, base)
        return await self.commit(upload.upload_id, [s.name for s in sources], spec)

    async def publish_preset(self, preset: str, seed: int, dtype: str, version: str) -> WeightsManifest:
        """Publish the seeded random model of a preset, made in ``dtype`` ("float32", "bfloat16", or "fp8":
        the bf16 model quantized, e4m3 values + block scales, as the trainer publishes FP8 versions),
        with the numerics fingerprint it is served under. ValueError for an unknown preset or dtype."""
        from zerokl.kernels import __version__ as numerics_version
        from zerokl.kernels import fingerprint
        from zerokl.kernels.dtypes import COMPUTE_DTYPES, FP8, to_dtype
        from zerokl.kernels.model import Model, ModelConfig
        from zerokl.kernels.model.fp8 import FP8_ACTIVATIONS, quantize_fp8

        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected float32, bfloat16 or fp8")
        torch_dtype = to_dtype(dtype)
        if torch_dtype == FP8:
            model = quantize_fp8(Model(ModelConfig.preset(preset), seed=seed, dtype=FP8_ACTIVATIONS))
        else:
            model = Model(ModelConfig.preset(preset), seed=seed, dtype=torch_dtype)
        with tempfile.TemporaryDirectory(prefix="zerokl-preset-") as tmp:
            model.save_pretrained(tmp)
            return await self.publish(tmp, version, numerics_version=numerics_version,
                                      numerics_fingerprint=fingerprint(dtype=torch_dtype),
                                      metadata={"source": f"preset-{preset}-seed{seed}"})

    async def begin_upload(self, version: str) -> UploadStatus:
        """Open (or re-open) the upload of ``version``."""
        return convert.upload_status_from_proto(
            await self._stub.BeginUpload(weights_pb2.BeginUploadRequest(version=version)))

    async def upload_status(self, upload_id: str) -> UploadStatus:
        """Per-shard bytes the server holds for an upload."""
        return convert.upload_status_from_proto(
            await self._stub.GetUpload(weights_pb2.GetUploadRequest(upload_id=upload_id)))

    async def upload_dir(self, upload_id: str, src: str | os.PathLike[str] | Sequence[ShardSource],
                         base: UploadBase | None = None) -> UploadStatus:
        """Send every file of ``src`` (a directory, or the :class:`ShardSource` s given: files or buffers) as a shard,
        each from where the server's copy ends (as a delta against ``base``'s file of the same name where
        :meth:`put_shard` finds that smaller).

        Safe to call again after an interruption: complete shards are
        skipped, partial ones continue at their last acknowledged offset.
        Up to :data:`PARALLEL_SHARDS` files travel at once (the store writes
        each in a thread of its own).
        """
        held = {s.name: s for s in (await self.upload_status(upload_id)).shards}
        slots = asyncio.Semaphore(PARALLEL_SHARDS)

        async def put(source: ShardSource) -> None:
            async with slots:
                await self.put_shard(upload_id, source, base)
        puts = [asyncio.ensure_future(put(source)) for source in shard_sources(src)
                if source.name not in held or not held[source.name].complete]
        try:
            await asyncio.gather(*puts)
        finally:
            await _cancelled(*puts)     # a failed file ends the others' streams: none uploads on behind the error
        return await self.upload_status(upload_id)

    async def put_shard(self, upload_id: str, source: ShardSource | str | os.PathLike[str],
                        base: UploadBase | None = None) -> ShardStatus:
        """Stream one file (a path, or a :class:`ShardSource`: a file, or its bytes in memory) as a shard,
        starting where the server says its copy ends.

        The bytes are read once (a file mapped) for both of its checksums: the whole file's sha256 for
        the header and each chunk's for the wire (:func:`shard_digests`). Up to
        :data:`CHUNKS_IN_FLIGHT` chunks are sent ahead of the store's acknowledgements; each
        acknowledgement says the chunk is stored, so an interruption loses no acknowledged byte,
        and an error status ends the stream and is raised here.

        With a ``base`` holding a file of the same name and size, what travels is the delta against
        it when that is at most half the file (:func:`~zerokl.services.weightstore.delta.encode`, in
        threads beside the file's sha256); a store that refuses the base (FAILED_PRECONDITION) or
        finds the delta does not decode to the file (DATA_LOSS) gets the file whole instead.
        """
        if not isinstance(source, ShardSource):
            source = ShardSource.file(source)
        name = source.name
        with source.view() as view:
            with memoryview(view) as whole:
                size = whole.nbytes
            against = base.delta_base(name, size) if base is not None and size else None
            if against is not None:
                sha256, encoded = await asyncio.gather(
                    asyncio.to_thread(lambda: hashlib.sha256(view).hexdigest()),
                    asyncio.to_thread(_encode, view, *against))
                if encoded is not None:
                    delta_sha256, digests = await asyncio.to_thread(shard_digests, encoded)
                    header = weights_pb2.ShardHeader(upload_id=upload_id, name=name, size=size, sha256=sha256,
                                                     base_version=against[0].version, delta_size=len(encoded),
                                                     delta_sha256=delta_sha256)
                    try:
                        return await self._put(header, encoded, digests)
                    except grpc.aio.AioRpcError as err:
                        if err.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS):
                            raise
                        log.warning("the store took no delta of %s against %s (%s: %s); sending it whole", name,
                                    against[0].version, err.code().name, err.details())
            sha256, digests = await asyncio.to_thread(shard_digests, view)
            return await self._put(weights_pb2.ShardHeader(upload_id=upload_id, name=name, size=size,
                                                           sha256=sha256), view, digests)

    async def _put(self, header: weights_pb2.ShardHeader, view: Any, digests: list[bytes]) -> ShardStatus:
        """One PutShard stream: ``header``, then ``view``'s chunks from where the store's copy ends. A stream the store
        ends is raised as the status it sent (:func:`_why_ended`); nothing of the call is left running after."""
        call = self._stub.PutShard()
        end = _StreamEnd(call)
        try:
            await call.write(weights_pb2.PutShardRequest(header=header))
            status = await self._ack(call)
            if not status.complete:
                status = await self._send_chunks(call, view, status.received, len(view), digests)
            await call.done_writing()
            await call.read()   # the store's end of the stream (EOF once it returns; its status if it fails now)
            return convert.shard_status_from_proto(status)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            raise await _why_ended(call, end, err) from None
        finally:
            await _finish(call)

    async def _send_chunks(self, call: Any, view: Any, start: int, size: int,
                           digests: list[bytes]) -> weights_pb2.ShardStatus:
        """Chunks of ``view[start:]``, up to CHUNKS_IN_FLIGHT ahead of their acknowledgements; the last one."""
        offsets = list(range(start, size, MAX_CHUNK_BYTES)) or [start]    # an empty remainder: one empty chunk
        window = asyncio.Semaphore(CHUNKS_IN_FLIGHT)

        async def acknowledgements() -> weights_pb2.ShardStatus:
            status = None
            for _ in offsets:
                status = await self._ack(call)
                window.release()
            assert status is not None
            return status
        acks = asyncio.ensure_future(acknowledgements())
        try:
            for offset in offsets:
                data = bytes(view[offset:offset + MAX_CHUNK_BYTES])
                # A resume from an offset between chunk boundaries (not one this client sent) hashes afresh.
                aligned = offset % MAX_CHUNK_BYTES == 0 and len(data) > 0
                digest = digests[offset // MAX_CHUNK_BYTES] if aligned else hashlib.sha256(data).digest()
                await _first(window.acquire(), acks)
                await call.write(weights_pb2.PutShardRequest(chunk=blob_pb2.BytesChunk(
                    offset=offset, data=data, sha256=digest, total_size=size)))
            return await acks
        finally:
            await _cancelled(acks)

    @staticmethod
    async def _ack(call: Any) -> weights_pb2.ShardStatus:
        msg = await call.read()    # a stream ended with an error status raises it here
        if msg is grpc.aio.EOF:
            raise RuntimeError("PutShard ended without acknowledging")  # OK status without an ack
        return msg

    async def commit(self, upload_id: str, shards: list[str], spec: VersionSpec) -> WeightsManifest:
        """Publish an upload whose shards are exactly ``shards``."""
        return convert.manifest_from_proto(
            await self._stub.Commit(convert.commit_request_to_proto(upload_id, shards, spec)))

    async def abort_upload(self, upload_id: str) -> None:
        """Drop an unpublished upload."""
        await self._stub.AbortUpload(weights_pb2.AbortUploadRequest(upload_id=upload_id))

    # ---- reading ------------------------------------------------------------

    async def manifest(self, version: str) -> WeightsManifest:
        """The manifest of ``version`` (or ``latest``)."""
        return convert.manifest_from_proto(
            await self._stub.GetManifest(weights_pb2.GetManifestRequest(version=version)))

    async def fetch(self, version: str, dest: str | os.PathLike[str], *,
                    serving_only: bool = False, local_root: str | os.PathLike[str] | None = None) -> WeightsManifest:
        """Download ``version`` (or ``latest``) into directory ``dest``, verified and resumable.

        Complete files already in ``dest`` are kept, partial ones resumed;
        each file appears under its name only after its sha256 matched, and
        ``zerokl_manifest.json`` is written last. ``serving_only`` skips what
        an inference replica never reads (a trainer's optimizer state).
        ``local_root``: the store's directory (its ``--root``) when this host
        sees it: a shard it holds whole is hard-linked from there where that
        is the same filesystem (no second copy on disk), then checked against
        the manifest's sha256 as a streamed one; the rest is streamed.
        """
        manifest = await self.manifest(version)
        pathlib.Path(dest).mkdir(parents=True, exist_ok=True)
        for shard in manifest.shards:
            if serving_only and not is_serving_file(shard.name):
                continue
            writer = await asyncio.to_thread(ShardFileWriter, dest, shard)
            source = local_shard_path(local_root, manifest.version, shard) if local_root is not None else None
            if not writer.done and source is not None and await asyncio.to_thread(writer.link, source):
                try:
                    await asyncio.to_thread(writer.finish)
                    continue
                except DataLoss:
                    # The store's file no longer matches its manifest (bit rot, a hand edit): its Get says so as
                    # DATA_LOSS, as for any replica that streams it (the caller's fallback), so stream it.
                    writer = await asyncio.to_thread(ShardFileWriter, dest, shard)
            if not writer.done:
                call = self._stub.Get(weights_pb2.GetRequest(version=manifest.version, shard=shard.name,
                                                             offset=writer.offset))
                async for msg in call:
                    writer.write(chunk_from_proto(msg))
            await asyncio.to_thread(writer.finish)
        (pathlib.Path(dest) / FETCHED_MANIFEST).write_bytes(manifest.to_json())
        return manifest

    async def list(self) -> list[VersionEntry]:
        """Published versions, oldest first, with their pins."""
        resp = await self._stub.List(weights_pb2.ListRequest())
        return [convert.version_entry_from_proto(e) for e in resp.versions]

    async def watch(self, include_existing: bool = False) -> AsyncIterator[WeightsManifest]:
        """Versions as they are published (the existing ones first if asked)."""
        async for msg in self._stub.Watch(weights_pb2.WatchRequest(include_existing=include_existing)):
            yield convert.manifest_from_proto(msg)

    # ---- deleting, pins, retention ------------------------------------------

    async def delete(self, version: str, *, timeout: float | None = None) -> None:
        """Delete an unpinned version."""
        await self._stub.Delete(weights_pb2.DeleteRequest(version=version), timeout=timeout)

    async def pin(self, version: str, owner: str) -> VersionEntry:
        """Keep ``version`` from deletion on behalf of ``owner``."""
        return convert.version_entry_from_proto(
            await self._stub.Pin(weights_pb2.PinRequest(version=version, owner=owner)))

    async def unpin(self, version: str, owner: str, *, timeout: float | None = None) -> VersionEntry:
        """Release ``owner``'s pin."""
        return convert.version_entry_from_proto(
            await self._stub.Unpin(weights_pb2.UnpinRequest(version=version, owner=owner), timeout=timeout))

    async def gc(self, keep_last: int | None = None) -> GcResult:
        """Garbage-collect old unpinned versions and expired uploads."""
        req = weights_pb2.GarbageCollectRequest()
        if keep_last is not None:
            req.keep_last = keep_last
        return convert.gc_result_from_proto(await self._stub.GarbageCollect(req))
