"""The WeightStore gRPC servicer: a thin async layer over :class:`VersionStore`.

Storage calls block (files, HTTP to S3), so each runs in a worker thread and
the event loop keeps serving other calls. Errors are raised as
:class:`ServiceError` s and mapped to statuses by the runtime's interceptor.
A storage out of room refuses writes (RESOURCE_EXHAUSTED, :class:`~.backends.StorageFull`) and serves
everything else; the server says so once, at WARNING, until a write goes through again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

import grpc.aio

from zerokl.services.runtime.chunks import Chunk, chunk_from_proto, chunk_to_proto
from zerokl.services.runtime.errors import InvalidArgument, Unavailable
from zerokl.services.runtime.info import ServiceIdentity, identity_to_proto
from zerokl.services.runtime.server import ServiceServer
from zerokl.services.weightstore import convert
from zerokl.services.weightstore.backends import StorageFull
from zerokl.services.weightstore.store import DeltaSpec, VersionStore, WeightsManifest
from zerokl.v1 import blob_pb2, common_pb2, weights_pb2, weights_pb2_grpc

__all__ = ["SERVICE_NAME", "VersionWatch", "WeightStoreServicer", "add_weight_store"]

log = logging.getLogger(__name__)

SERVICE_NAME = weights_pb2.DESCRIPTOR.services_by_name["WeightStore"].full_name

_T = TypeVar("_T")


class _Room:
    """Whether the storage refuses writes for want of room, said once: a WARNING at the first write refused (with
    where and how many bytes), nothing more while writes keep being refused, and an INFO line once one goes through."""

    def __init__(self) -> None:
        self.full = False

    def refused(self, err: StorageFull) -> None:
        if self.full:
            log.debug("write refused, still no room: %s", err.message)
            return
        self.full = True
        log.warning("%s. Writes are refused (RESOURCE_EXHAUSTED) until there is room; uploads resume where the "
                    "store's copy ends, and every other call is served", err.message)

    def wrote(self) -> None:
        if self.full:
            self.full = False
            log.info("the weight store has room again: a write went through")


class VersionWatch:
    """Tells subscribers about newly published versions.

    Commits through this server announce themselves at once (:meth:`poke`);
    versions published by anyone else on the same storage (the trainer
    writing the local directory, another replica on S3) are found by polling
    every ``poll_s`` seconds. Polling runs only while someone watches.
    """

    _CLOSED = object()

    def __init__(self, store: VersionStore, poll_s: float = 2.0) -> None:
        self._store = store
        self._poll_s = poll_s
        self._subscribers: set[asyncio.Queue[Any]] = set()
        self._known: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self._closed = False

    async def subscribe(self) -> asyncio.Queue[Any]:
        """A queue that receives every version published from now on."""
        if self._closed:
            raise Unavailable("the weight store is shutting down")
        async with self._starting:  # two first watchers must not start two pollers
            if self._task is None:
                # Versions that exist before the first watcher are not news.
                self._known = {m.version for m in await asyncio.to_thread(self._store.manifests)}
                self._task = asyncio.ensure_future(self._run())
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Any]) -> None:
        """Stop delivering to ``queue``; polling stops with the last watcher."""
        self._subscribers.discard(queue)
        if not self._subscribers and self._task is not None:
            self._task.cancel()
            self._task = None

    def poke(self) -> None:
        """Look for new versions now (after a commit through this server)."""
        self._wake.set()

    def close(self) -> None:
        """End every watch (the server is draining)."""
        self._closed = True
        for queue in self._subscribers:
            queue.put_nowait(self._CLOSED)
        if self._task is not None:
            self._task.cancel()
            self._task = None

    @classmethod
    def is_closed_marker(cls, item: Any) -> bool:
        """True for the item :meth:`close` puts in each queue."""
        return item is cls._CLOSED

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._poll_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                manifests = await asyncio.to_thread(self._store.manifests)
            except Exception:  # storage hiccup: keep watching, try again next round
                log.exception("polling for new versions failed")
                continue
            for manifest in manifests:
                if manifest.version not in self._known:
                    self._known.add(manifest.version)
                    for queue in self._subscribers:
                        queue.put_nowait(manifest)


async def _in_threads(it: Iterator[Chunk]) -> AsyncIterator[Chunk]:
    """Iterate a blocking chunk iterator from the event loop, one chunk per worker-thread hop."""
    sentinel = object()
    while True:
        item = await asyncio.to_thread(next, it, sentinel)
        if item is sentinel:
            return
        yield item  # type: ignore[misc]


class WeightStoreServicer(weights_pb2_grpc.WeightStoreServicer):
    """Serves a :class:`VersionStore` as ``zerokl.v1.WeightStore``."""

    def __init__(self, store: VersionStore, identity: ServiceIdentity, watch: VersionWatch) -> None:
        self._store = store
        self._identity = identity
        self._watch = watch
        self._room = _Room()

    async def _writing(self, fn: Callable[..., _T], *args: Any, wrote: bool = False) -> _T:
        """``fn(*args)`` in a worker thread: a call that may write to the storage (a refusal for want of room is said).
        ``wrote``: it surely wrote when it returns (a chunk, a manifest: there is room again), where a call that may
        have written nothing (an upload re-opened) says nothing about room."""
        try:
            out = await asyncio.to_thread(fn, *args)
        except StorageFull as err:
            self._room.refused(err)
            raise
        if wrote:
            self._room.wrote()
        return out

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ServiceInfo:
        # The store computes nothing itself; it reports the newest version it
        # serves and the numerics that version was trained under, which is
        # what `zerokl status` compares across services.
        latest = await asyncio.to_thread(self._store.latest)
        identity = self._identity
        if latest is not None:
            identity = identity.with_weights(latest.version, latest.spec.model_config,
                                             latest.spec.numerics_version, latest.spec.numerics_fingerprint)
        return identity_to_proto(identity)

    async def BeginUpload(self, request: weights_pb2.BeginUploadRequest,
                          context: grpc.aio.ServicerContext) -> weights_pb2.UploadStatus:
        status = await self._writing(self._store.begin_upload, request.version)
        return convert.upload_status_to_proto(status)

    async def GetUpload(self, request: weights_pb2.GetUploadRequest,
                        context: grpc.aio.ServicerContext) -> weights_pb2.UploadStatus:
        return convert.upload_status_to_proto(await asyncio.to_thread(self._store.upload_status, request.upload_id))

    async def PutShard(self, request_iterator: AsyncIterator[weights_pb2.PutShardRequest],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[weights_pb2.ShardStatus]:
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("msg") != "header":
            raise InvalidArgument.field("header", "the first PutShard message must be a ShardHeader")
        h = first.header
        as_delta = DeltaSpec(h.base_version, h.delta_size, h.delta_sha256) if h.base_version else None
        writer = await self._writing(self._store.shard_writer, h.upload_id, h.name, h.size, h.sha256, as_delta)
        yield convert.shard_status_to_proto(writer.status())
        async for req in requests:
            if req.WhichOneof("msg") != "chunk":
                raise InvalidArgument.field("chunk", "only the first PutShard message may be a header")
            # A chunk the storage has no room for ends the stream RESOURCE_EXHAUSTED; what was acknowledged stays.
            await self._writing(writer.write, chunk_from_proto(req.chunk), wrote=True)
            yield convert.shard_status_to_proto(writer.status())

    async def Commit(self, request: weights_pb2.CommitRequest,
                     context: grpc.aio.ServicerContext) -> weights_pb2.WeightsManifest:
        upload_id, shards, spec = convert.commit_request_from_proto(request)
        manifest = await self._writing(self._store.commit, upload_id, shards, spec, wrote=True)
        self._watch.poke()
        return convert.manifest_to_proto(manifest)

    async def AbortUpload(self, request: weights_pb2.AbortUploadRequest,
                          context: grpc.aio.ServicerContext) -> weights_pb2.AbortUploadResponse:
        await asyncio.to_thread(self._store.abort_upload, request.upload_id)
        return weights_pb2.AbortUploadResponse()

    async def GetManifest(self, request: weights_pb2.GetManifestRequest,
                          context: grpc.aio.ServicerContext) -> weights_pb2.WeightsManifest:
        return convert.manifest_to_proto(await asyncio.to_thread(self._store.get_manifest, request.version))

    async def Get(self, request: weights_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[blob_pb2.BytesChunk]:
        offset = request.offset if request.HasField("offset") else 0
        chunks = self._store.iter_shard(request.version, request.shard, offset)
        try:
            async for chunk in _in_threads(chunks):
                yield chunk_to_proto(chunk)
        finally:
            # A client that hung up mid-shard must not leave an S3 response open.
            await asyncio.to_thread(chunks.close)

    async def List(self, request: weights_pb2.ListRequest,
                   context: grpc.aio.ServicerContext) -> weights_pb2.ListResponse:
        entries = await asyncio.to_thread(self._store.list_versions)
        return weights_pb2.ListResponse(versions=[convert.version_entry_to_proto(e) for e in entries])

    async def Watch(self, request: weights_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[weights_pb2.WeightsManifest]:
        queue = await self._watch.subscribe()
        try:
            sent: set[str] = set()
            if request.include_existing:
                # Subscribed first, listed second: nothing published in between is lost.
                existing: list[WeightsManifest] = await asyncio.to_thread(self._store.manifests)
                for manifest in existing:
                    sent.add(manifest.version)
                    yield convert.manifest_to_proto(manifest)
            while True:
                item = await queue.get()
                if VersionWatch.is_closed_marker(item):
                    raise Unavailable("the weight store is shutting down; watch again")
                if item.version not in sent:
                    sent.add(item.version)
                    yield convert.manifest_to_proto(item)
        finally:
            self._watch.unsubscribe(queue)

    async def Delete(self, request: weights_pb2.DeleteRequest,
                     context: grpc.aio.ServicerContext) -> weights_pb2.DeleteResponse:
        await asyncio.to_thread(self._store.delete, request.version)
        return weights_pb2.DeleteResponse()

    async def Pin(self, request: weights_pb2.PinRequest,
                  context: grpc.aio.ServicerContext) -> weights_pb2.VersionEntry:
        entry = await self._writing(self._store.pin, request.version, request.owner)
        return convert.version_entry_to_proto(entry)

    async def Unpin(self, request: weights_pb2.UnpinRequest,
                    context: grpc.aio.ServicerContext) -> weights_pb2.VersionEntry:
        entry = await asyncio.to_thread(self._store.unpin, request.version, request.owner)
        return convert.version_entry_to_proto(entry)

    async def GarbageCollect(self, request: weights_pb2.GarbageCollectRequest,
                             context: grpc.aio.ServicerContext) -> weights_pb2.GarbageCollectResponse:
        keep = request.keep_last if request.HasField("keep_last") else None
        return convert.gc_result_to_proto(await asyncio.to_thread(self._store.gc, keep))


def add_weight_store(server: ServiceServer, store: VersionStore, identity: ServiceIdentity,
                     watch_poll_s: float = 2.0) -> WeightStoreServicer:
    """Serve ``store`` on ``server`` (before it starts); watches end when the server drains."""
    watch = VersionWatch(store, watch_poll_s)
    servicer = WeightStoreServicer(store, identity, watch)
    server.add_servicer(weights_pb2_grpc.add_WeightStoreServicer_to_server, servicer, SERVICE_NAME)
    server.on_drain(watch.close)
    return servicer
