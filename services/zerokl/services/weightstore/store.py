"""Versioned weights over any :class:`StorageBackend`: the weight store's logic, once.

Usable without gRPC (the trainer on one machine publishes through it
directly); the gRPC service is a thin layer over it.

Storage layout (keys)::

    manifests/<version>.json          the manifest; its presence IS publication
    versions/<version>/<shard>        shard files stored whole (a Hugging Face style checkpoint dir)
    deltas/<version>/<shard>          shards stored as a delta against the same shard of an earlier
                                      version (:mod:`.delta`: what changed, frame by frame)
    uploads/<id>/upload.json          an open upload: version, creation time
    uploads/<id>/shards/<shard>.json  a declared shard: size, sha256, complete
    uploads/<id>/parts/<shard>/<offset:020d>  bytes received so far (StorageBackend.stage: one
                                      object per chunk, or one file appended in place)
    pins/<version>/<owner>            who keeps the version from deletion

Rules: shards are written (and verified) before the manifest and the manifest
last, so a reader never sees a version with missing or unverified shards; a
delete removes the manifest first. A shard whose bytes no longer match the
manifest's sha256 is never handed out whole (:meth:`VersionStore.iter_shard`).

Delta shards share content: a version's delta reads the bytes of its base version's
shard, which may itself be a delta (at most :data:`~.delta.MAX_DEPTH` deep). A delta is
accepted only against a published base, and only once it decodes, against the base the
store holds, to the sha256 declared for the whole file. Deleting a version removes its
manifest, then every stored shard no version or open upload needs any more, following
delta bases (mark and sweep, :meth:`VersionStore.sweep`): the bytes of a deleted version
that a later version's delta reads stay until that version goes too, and its name cannot
be published again meanwhile.

Decoding a chain costs a layer per delta; the store keeps the newest decoded bytes of each
shard name in a local cache (:mod:`.cache`, files under the backend's scratch directory or
``cache_dir``), so accepting the next delta, or reading the newest version, reads one layer
whatever the depth. The cache only stands in for bytes the backend holds: a miss (a restart
on a wiped disk) decodes the chain, and no byte from it is accepted or served unchecked.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import mmap
import os
import pathlib
import re
import secrets
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn, Sequence

from zerokl.services.runtime.chunks import (
    MAX_CHUNK_BYTES,
    Chunk,
    chunks_from_pieces,
    make_chunk,
    rechunk,
    verify_chunk,
)
from zerokl.services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PreconditionViolation,
)
from zerokl.services.runtime.metrics import WEIGHTSTORE_DECODED_CACHE, WEIGHTSTORE_DELTA_LAYERS
from zerokl.services.weightstore import delta
from zerokl.services.weightstore.backends import LocalDirBackend, ObjectMissing, StorageBackend
from zerokl.services.weightstore.cache import DEFAULT_MAX_BYTES, DecodedCache, EntryWriter
from zerokl.services.weightstore.source import ShardSource, shard_sources
from zerokl.services.weightstore.versions import LATEST, WeightsVersion, validate_name

__all__ = [
    "MANIFEST_FORMAT",
    "ShardInfo",
    "VersionSpec",
    "WeightsManifest",
    "ShardStatus",
    "UploadStatus",
    "VersionEntry",
    "GcResult",
    "DeltaSpec",
    "ShardWriter",
    "ShardFileWriter",
    "VersionStore",
    "local_shard_path",
    "file_sha256",
]

MANIFEST_FORMAT = "zerokl.weights/1"
FETCHED_MANIFEST = "zerokl_manifest.json"
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _validate_upload_id(upload_id: str) -> str:
    if not _UPLOAD_ID.fullmatch(upload_id or ""):
        raise InvalidArgument.field("upload_id", f"{upload_id!r} is not an upload id (32 hex digits)")
    return upload_id


def _validate_sha256(value: str) -> str:
    if not _SHA256.fullmatch(value or ""):
        raise InvalidArgument.field("sha256", f"{value!r} is not a lowercase hex sha256")
    return value


def local_shard_path(root: str | os.PathLike[str], version: str, shard: ShardInfo) -> pathlib.Path | None:
    """Where a store in the local directory ``root`` (:class:`LocalDirBackend`) holds ``shard`` of ``version``
    whole, None when it holds a delta (its bytes exist nowhere whole)."""
    if shard.base:
        return None
    return pathlib.Path(root) / VersionStore._shard_key(version, validate_name(shard.name, "shard"))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Lowercase hex sha256 of a file, read in 4 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(MAX_CHUNK_BYTES):
            h.update(piece)
    return h.hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """One file of a version: name, size in bytes, lowercase hex sha256 (of the whole file), and how the store
    holds it: whole, or as a delta against the shard of the same name in version ``base``."""

    name: str
    size: int
    sha256: str
    base: str = ""                      # "": stored whole; else the version whose same-named shard the delta reads
    stored_size: int | None = None      # bytes the store holds for it (the delta's); None: ``size``
    depth: int = 0                      # deltas from here down to a shard stored whole (0: stored whole)

    @property
    def stored_bytes(self) -> int:
        """Bytes the store wrote for this shard."""
        return self.size if self.stored_size is None else self.stored_size


@dataclass(frozen=True)
class VersionSpec:
    """What the publisher says about a version (the rest of the manifest the store fills in)."""

    parent_version: str = ""
    step: int | None = None
    numerics_version: str = ""
    numerics_fingerprint: str = ""
    model_config: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` for a malformed spec."""
        if self.parent_version:
            WeightsVersion.validate(self.parent_version, "parent_version")
        if self.step is not None and self.step < 0:
            raise InvalidArgument.field("step", f"{self.step} is negative")
        if not isinstance(self.model_config, Mapping):
            raise InvalidArgument.field("model_config", "must be a JSON object")
        try:
            json.dumps(dict(self.model_config))
        except (TypeError, ValueError) as err:
            raise InvalidArgument.field("model_config", f"not JSON-serializable: {err}") from None
        for k, v in self.metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InvalidArgument.field("metadata", f"{k!r}: keys and values must be strings")


@dataclass(frozen=True)
class WeightsManifest:
    """A published version: what it is, where it came from, and the checksum of every shard."""

    version: str
    spec: VersionSpec
    shards: tuple[ShardInfo, ...]
    created_at: dt.datetime

    def shard(self, name: str) -> ShardInfo:
        """The named shard; :class:`NotFound` if the version has none by that name."""
        for s in self.shards:
            if s.name == name:
                return s
        raise NotFound(f"version {self.version} has no shard {name!r}")

    @property
    def total_size(self) -> int:
        """Bytes over all shards."""
        return sum(s.size for s in self.shards)

    @property
    def stored_size(self) -> int:
        """Bytes the store wrote for this version (less than :attr:`total_size` where shards are deltas)."""
        return sum(s.stored_bytes for s in self.shards)

    def to_json(self) -> bytes:
        """The stored form (also written next to fetched checkpoints)."""
        return json.dumps({
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "parent_version": self.spec.parent_version,
            "step": self.spec.step,
            "numerics_version": self.spec.numerics_version,
            "numerics_fingerprint": self.spec.numerics_fingerprint,
            "model_config": dict(self.spec.model_config),
            "metadata": dict(self.spec.metadata),
            "created_at": self.created_at.isoformat(),
            "shards": [{**dataclasses.asdict(s), "stored_size": s.stored_bytes} for s in self.shards],
        }, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "WeightsManifest":
        """Parse the stored form; raises ValueError/KeyError when it is not one."""
        d = json.loads(data)
        if d.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unknown manifest format {d.get('format')!r}")
        spec = VersionSpec(d["parent_version"], d["step"], d["numerics_version"], d["numerics_fingerprint"],
                           d["model_config"], d["metadata"])
        shards = tuple(ShardInfo(s["name"], int(s["size"]), s["sha256"], s.get("base", ""),
                                 int(s.get("stored_size", s["size"])), int(s.get("depth", 0))) for s in d["shards"])
        return cls(d["version"], spec, shards, dt.datetime.fromisoformat(d["created_at"]))


@dataclass(frozen=True)
class ShardStatus:
    """A declared shard of an upload; ``received`` is where PutShard resumes, in the bytes that travel: the
    file's, or the delta's when ``base`` is set."""

    name: str
    size: int
    sha256: str
    received: int
    complete: bool
    base: str = ""                      # the delta's base version ("": the file travels whole)
    delta_size: int = 0                 # bytes of the delta object
    delta_sha256: str = ""              # its sha256
    # The store's own record (not on the wire): the base shard as it was when the delta was declared, so the
    # upload completes and commits even if that version is deleted meanwhile (its bytes stay: the sweep keeps them).
    base_info: ShardInfo | None = field(default=None, compare=False)

    @property
    def sent_size(self) -> int:
        """Bytes that travel for this shard."""
        return self.delta_size if self.base else self.size


@dataclass(frozen=True)
class DeltaSpec:
    """A shard declared as a delta: against the same-named shard of version ``base``, ``size`` bytes with ``sha256``."""

    base: str
    size: int
    sha256: str


@dataclass(frozen=True)
class UploadStatus:
    """An open upload and its declared shards (sorted by name)."""

    upload_id: str
    version: str
    shards: tuple[ShardStatus, ...]
    created_at: dt.datetime


@dataclass(frozen=True)
class VersionEntry:
    """A published version and who pins it."""

    manifest: WeightsManifest
    pinned_by: tuple[str, ...]


@dataclass(frozen=True)
class GcResult:
    """What a garbage collection removed, and what it kept only because of pins."""

    deleted: tuple[str, ...]
    kept_pinned: tuple[str, ...]
    expired_uploads: tuple[str, ...]


@dataclass
class _Trace:
    """One decode of a shard: whether it may read the cache of decoded shards (and hash an entry it has not
    seen before serving it), and what it did: delta layers decoded, entries read, lookups that missed."""

    use_cache: bool = True
    verify: bool = True
    layers: int = 0
    hits: list[tuple[str, str, str]] = field(default_factory=list)
    misses: int = 0


class ShardWriter:
    """Receives one shard's chunks for an upload (from :meth:`VersionStore.shard_writer`).

    Each chunk is verified against its own sha256, staged in place (the backend appends it where it
    can) and fed to the shard's running sha256 as it arrives, so a broken stream resumes at
    :attr:`received` and no byte is read back or written twice. When the last byte arrives the
    running hash is checked against the declared sha256 and the staged bytes become the shard.
    A shard declared as a delta receives the delta object's bytes (checked against its own
    sha256), and is accepted only when it decodes, against its base, to the whole file's sha256.
    """

    def __init__(self, store: "VersionStore", upload_id: str, version: str, decl: ShardStatus) -> None:
        self._store = store
        self._upload_id = upload_id
        self._version = version
        self._decl = decl
        self._prefix = store._parts_prefix(upload_id, decl.name)
        self.received = decl.received
        self.complete = decl.complete
        self._sha256 = hashlib.sha256()
        if self.received and not self.complete:
            # A resumed upload: the bytes staged before it, hashed once.
            for piece in store._backend.iter_staged(self._prefix):
                self._sha256.update(piece)

    def status(self) -> ShardStatus:
        """Where this shard stands now."""
        return dataclasses.replace(self._decl, received=self.received, complete=self.complete)

    def write(self, chunk: Chunk) -> None:
        """Verify and stage the next chunk; finishes the shard on its last byte."""
        if self.complete:
            raise FailedPrecondition(f"shard {self._decl.name} is already complete")
        verify_chunk(chunk, self.received, self._decl.sent_size)
        if chunk.data:
            try:
                self._store._backend.stage(self._prefix, chunk.offset, chunk.data)
            except ValueError as err:
                # Another stream of the same shard moved it meanwhile: this one starts again from GetUpload.
                raise FailedPrecondition(f"shard {self._decl.name}: {err}; ask GetUpload where it stands") from None
            self._sha256.update(chunk.data)
            self.received = chunk.end
        if self.received == self._decl.sent_size:
            self._finish()

    def _finish(self) -> None:
        store, decl = self._store, self._decl
        key = store._delta_key(self._version, decl.name) if decl.base else store._shard_key(self._version, decl.name)
        got = self._sha256.hexdigest()
        want = decl.delta_sha256 if decl.base else decl.sha256
        if got != want:
            store._reset_shard(self._upload_id, key, decl.name)
            raise DataLoss(f"shard {decl.name}: received bytes hash to {got}, declared {want}; "
                           "the shard was reset, upload it again from offset 0")
        if decl.base:
            store._check_delta(self._upload_id, key, decl, lambda: store._backend.iter_staged(self._prefix))
        try:
            store._backend.commit_staged(self._prefix, key, decl.sent_size)
        except ValueError as err:
            store._reset_shard(self._upload_id, key, decl.name)
            raise DataLoss(f"shard {decl.name}: {err}; the shard was reset, upload it again from offset 0") from None
        store._write_decl(self._upload_id, dataclasses.replace(decl, received=decl.sent_size, complete=True))
        self.complete = True


class ShardFileWriter:
    """Writes one shard of a fetched version into a directory, resumably and verified.

    Bytes go to ``.<name>.partial``; a later fetch resumes at its length
    (:attr:`offset`). The file gets its real name only after the whole shard
    matched its sha256, so a corrupt shard never appears in ``dest``.
    """

    def __init__(self, dest: str | os.PathLike[str], shard: ShardInfo) -> None:
        self.shard = shard
        self.final = pathlib.Path(dest) / shard.name
        self.partial = pathlib.Path(dest) / f".{shard.name}.partial"
        self.done = self.final.exists() and self.final.stat().st_size == shard.size \
            and file_sha256(self.final) == shard.sha256
        if self.done:
            self.partial.unlink(missing_ok=True)
            self.offset = shard.size
        else:
            held = self.partial.stat().st_size if self.partial.exists() else 0
            # A partial longer than the shard is garbage: start over.
            self.offset = held if held <= shard.size else 0
            if held > shard.size:
                self.partial.unlink()

    def link(self, source: str | os.PathLike[str]) -> bool:
        """Take the shard's bytes from ``source``, a file of the store's own on this filesystem, by a hard link
        instead of a copy (no second copy on disk: the store never writes a published file in place, and this
        side only reads it); :meth:`finish` checks its sha256 as for streamed bytes. False (nothing changed)
        when it is not the shard's size or missing; False with any partial bytes dropped (streamed from 0) when
        the link itself fails: the caller streams the shard."""
        if self.done:
            return True
        try:
            if os.stat(source).st_size != self.shard.size:
                return False
        except OSError:     # no such file: streamed instead, resuming any partial bytes
            return False
        self.partial.unlink(missing_ok=True)
        self.offset = 0
        try:
            os.link(source, self.partial)
        except OSError:     # another filesystem, links refused: streamed instead, from 0
            return False
        self.offset = self.shard.size
        return True

    def write(self, chunk: Chunk) -> None:
        """Verify and append a chunk (which must start at :attr:`offset`)."""
        verify_chunk(chunk, self.offset, self.shard.size)
        with open(self.partial, "ab") as f:
            f.write(chunk.data)
        self.offset = chunk.end

    def finish(self) -> None:
        """Check the whole file against the shard's sha256 and give it its name."""
        if self.done:
            return
        if not self.partial.exists():
            self.partial.write_bytes(b"")
        got = file_sha256(self.partial)
        if self.offset != self.shard.size or got != self.shard.sha256:
            self.partial.unlink()   # (a link: only this name goes, never the store's file)
            raise DataLoss(f"shard {self.shard.name}: fetched bytes do not match the manifest sha256 "
                           f"({got} != {self.shard.sha256}); partial file discarded")
        os.replace(self.partial, self.final)
        self.done = True


class VersionStore:
    """Immutable weight versions with atomic publication, pins and retention.

    ``keep_last``: after every commit, delete all but the newest ``keep_last``
    unpinned versions (None keeps everything). ``upload_ttl_s``: garbage
    collection drops unpublished uploads older than this. Mutations are
    serialized within this process; across processes, uploads of different
    versions never touch the same keys.

    ``cache_dir``: where the cache of decoded shards lives (:mod:`.cache`; default: the backend's
    :meth:`~.backends.StorageBackend.scratch_dir`, none for a bucket); ``cache_bytes``: its budget (0: no
    cache). :attr:`delta_stats` counts delta layers decoded (``accept_layers``, ``read_layers``) and cache
    lookups (``cache_hit``, ``cache_miss``, ``cache_rejected``).
    """

    def __init__(self, backend: StorageBackend, *, keep_last: int | None = None,
                 upload_ttl_s: float = 7 * 24 * 3600, clock: Callable[[], dt.datetime] = _now,
                 cache_dir: str | os.PathLike[str] | None = None, cache_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        self._backend = backend
        self.keep_last = keep_last
        self.upload_ttl_s = upload_ttl_s
        self._clock = clock
        self._lock = threading.RLock()
        directory = cache_dir if cache_dir is not None else backend.scratch_dir()
        self.delta_stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()     # shards are accepted in threads of their own
        self.cache = DecodedCache(directory, cache_bytes, self._cache_rejected) \
            if directory is not None and cache_bytes > 0 else None

    @property
    def backend(self) -> StorageBackend:
        """The storage this store writes to."""
        return self._backend

    # ---- keys -------------------------------------------------------------

    @staticmethod
    def _manifest_key(version: str) -> str:
        return f"manifests/{version}.json"

    @staticmethod
    def _shard_key(version: str, name: str) -> str:
        return f"versions/{version}/{name}"

    @staticmethod
    def _delta_key(version: str, name: str) -> str:
        return f"deltas/{version}/{name}"

    @staticmethod
    def _upload_key(upload_id: str) -> str:
        return f"uploads/{upload_id}/upload.json"

    @staticmethod
    def _decl_key(upload_id: str, name: str) -> str:
        return f"uploads/{upload_id}/shards/{name}.json"

    @staticmethod
    def _parts_prefix(upload_id: str, name: str) -> str:
        return f"uploads/{upload_id}/parts/{name}/"

    @classmethod
    def _part_key(cls, upload_id: str, name: str, offset: int) -> str:
        return f"{cls._parts_prefix(upload_id, name)}{offset:020d}"

    # ---- reading ----------------------------------------------------------

    def _load_manifest(self, version: str) -> WeightsManifest | None:
        try:
            data = self._backend.read_bytes(self._manifest_key(version))
        except ObjectMissing:
            return None
        try:
            manifest = WeightsManifest.from_json(data)
        except (ValueError, KeyError, TypeError) as err:
            raise DataLoss(f"manifest of version {version} is unreadable: {err}") from None
        if manifest.version != version:
            raise DataLoss(f"manifest stored as {version} names version {manifest.version}")
        return manifest

    def manifests(self) -> list[WeightsManifest]:
        """Every published version, oldest first (ties broken by id)."""
        out = []
        for obj in self._backend.list("manifests/"):
            version = obj.key[len("manifests/"):-len(".json")]
            manifest = self._load_manifest(version)
            if manifest is not None:  # deleted between list and read
                out.append(manifest)
        return sorted(out, key=lambda m: (m.created_at, m.version))

    def latest(self) -> WeightsManifest | None:
        """The newest published version, None when there is none."""
        all_versions = self.manifests()
        return all_versions[-1] if all_versions else None

    def get_manifest(self, version: str) -> WeightsManifest:
        """The manifest of ``version`` (``latest`` names the newest); :class:`NotFound` if unpublished."""
        if version == LATEST:
            newest = self.latest()
            if newest is None:
                raise NotFound("no version is published yet")
            return newest
        manifest = self._load_manifest(WeightsVersion.validate(version))
        if manifest is None:
            raise NotFound(f"version {version} is not published")
        return manifest

    def pins(self, version: str) -> tuple[str, ...]:
        """Owners pinning ``version``, sorted."""
        prefix = f"pins/{version}/"
        return tuple(sorted(o.key[len(prefix):] for o in self._backend.list(prefix)))

    def list_versions(self) -> list[VersionEntry]:
        """Published versions, oldest first, with their pins."""
        return [VersionEntry(m, self.pins(m.version)) for m in self.manifests()]

    def _delta_header(self, key: str) -> delta.DeltaHeader:
        """The header of the delta object at ``key`` (ObjectMissing when there is none; ValueError if malformed)."""
        data = b""
        pieces = self._backend.iter_read(key, 0, 64 * 1024)
        try:
            for piece in pieces:
                data += piece
                if len(data) >= 12 and len(data) >= delta.header_size(data):
                    return delta.read_header(data)
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        raise ValueError(f"{key} ends inside its delta header")

    def _content(self, version: str, name: str, is_delta: bool | None = None, depth: int = 0,
                 sha256: str = "", trace: "_Trace | None" = None) -> Iterator[bytes]:
        """The whole bytes of shard ``name`` as stored for ``version`` (whole, or a delta decoded over its base's
        content), unverified: the caller checks the sha256. ``is_delta`` None: look which object exists (a
        delta's base, whose manifest may be gone). ObjectMissing / ValueError when the store cannot make it.

        With a ``trace`` that allows it, the bytes come from the cache of decoded shards where it holds this
        shard (``sha256``: its bytes'), or the first base down the chain it holds: one layer, not the chain.
        ``trace`` counts the layers decoded and the cache entries read."""
        if depth > delta.MAX_DEPTH:
            raise ValueError(f"shard {name} of {version} sits on more than {delta.MAX_DEPTH} deltas")
        if trace is not None and trace.use_cache and sha256 and self.cache is not None:
            f = self.cache.open(version, name, sha256, verify=trace.verify)
            if f is not None:
                trace.hits.append((version, name, sha256))
                yield from self.cache.read(f)
                return
            trace.misses += 1
        key = self._delta_key(version, name)
        if is_delta is None:
            is_delta = self._backend.stat(key) is not None
        if not is_delta:
            yield from self._backend.iter_read(self._shard_key(version, name), 0, delta.FRAME)
            return
        header = self._delta_header(key)
        if trace is not None:
            trace.layers += 1
        yield from delta.decode(self._content(header.base.version, header.base.name, None, depth + 1,
                                              header.base.sha256, trace),
                                self._backend.iter_read(key, 0, delta.FRAME))

    def _count(self, trace: "_Trace", purpose: str) -> None:
        """Add what ``trace`` saw to :attr:`delta_stats` and the process's metrics."""
        with self._stats_lock:
            self.delta_stats.update({f"{purpose}_layers": trace.layers, "cache_hit": len(trace.hits),
                                     "cache_miss": trace.misses})
        WEIGHTSTORE_DELTA_LAYERS.labels(purpose).inc(trace.layers)
        if trace.hits:
            WEIGHTSTORE_DECODED_CACHE.labels("hit").inc(len(trace.hits))
        if trace.misses:
            WEIGHTSTORE_DECODED_CACHE.labels("miss").inc(trace.misses)

    def _cache_rejected(self, version: str, name: str) -> None:
        with self._stats_lock:
            self.delta_stats["cache_rejected"] += 1
        WEIGHTSTORE_DECODED_CACHE.labels("rejected").inc()

    def _cache_was_wrong(self, trace: "_Trace") -> bool:
        """After a decode over cached bytes did not give the declared file: check the entries it read (dropping
        a wrong one); True when one was wrong (decode again, through the chain)."""
        if self.cache is None or not trace.hits:
            return False
        return not all([self.cache.check(*hit) for hit in trace.hits])

    def iter_shard(self, version: str, name: str, offset: int = 0,
                   chunk_size: int = MAX_CHUNK_BYTES) -> Iterator[Chunk]:
        """Chunks of one shard from ``offset``, verified against the manifest.

        The whole shard is hashed (bytes before ``offset`` too) and the last
        chunk is held back until the hash matched, so a consumer never
        receives a complete corrupt shard: it gets :class:`DataLoss` naming
        the shard instead.
        """
        manifest = self.get_manifest(version)
        shard = manifest.shard(validate_name(name, "shard"))
        if not 0 <= offset <= shard.size:
            raise InvalidArgument.field("offset", f"{offset} is outside 0..{shard.size} (size of {name})")
        h = hashlib.sha256()
        seen = 0
        trace = _Trace()
        # A delta decoded through its chain (the cache did not hold it: a restart, a wiped disk) fills the cache
        # for the next reader, unless the name has an entry already (the newest accepted version's).
        entry: EntryWriter | None = self.cache.writer(manifest.version, name, shard.sha256, shard.size, replace=False) \
            if self.cache is not None and shard.depth >= 2 else None

        def tail() -> Iterator[bytes]:
            nonlocal seen
            for piece in self._content(manifest.version, name, bool(shard.base), 0, shard.sha256, trace):
                if entry is not None and not trace.hits:
                    entry.write(piece)
                h.update(piece)
                start = seen
                seen += len(piece)
                if seen > shard.size:
                    raise DataLoss(f"shard {name} of version {manifest.version} is corrupt: "
                                   f"longer than its {shard.size} bytes")
                if seen > offset:
                    yield piece[max(0, offset - start):]

        pending: Chunk | None = None
        position = offset
        try:
            try:
                for data in rechunk(tail(), chunk_size):
                    if pending is not None:
                        yield pending
                    pending = make_chunk(position, data, shard.size)
                    position += len(data)
            except ObjectMissing:
                raise DataLoss(f"shard {name} of version {manifest.version} is missing from storage") from None
            except ValueError as err:   # a delta that does not decode over its base
                self._cache_was_wrong(trace)
                raise DataLoss(f"shard {name} of version {manifest.version} is corrupt: {err}") from None
            finally:
                self._count(trace, "read")
            if seen != shard.size or h.hexdigest() != shard.sha256:
                # A cache entry that changed behind this process's back is dropped: a retry reads the chain.
                self._cache_was_wrong(trace)
                raise DataLoss(f"shard {name} of version {manifest.version} is corrupt: its bytes do not match "
                               f"the manifest sha256 {shard.sha256}; it will not be served")
            if entry is not None and not trace.hits:
                entry.commit()
        finally:
            if entry is not None:
                entry.abort()       # (a no-op once committed)
        yield pending if pending is not None else make_chunk(offset, b"", shard.size)

    def fetch(self, version: str, dest: str | os.PathLike[str]) -> WeightsManifest:
        """Copy a version into directory ``dest`` (a loadable checkpoint dir), verified and resumable.

        Files already there with the right checksum are kept; partial ones
        are resumed. A shard stored whole in a local directory on ``dest``'s
        filesystem is hard-linked, not copied (:meth:`ShardFileWriter.link`).
        ``zerokl_manifest.json`` is written last.
        """
        manifest = self.get_manifest(version)
        pathlib.Path(dest).mkdir(parents=True, exist_ok=True)
        root = self._backend.root if isinstance(self._backend, LocalDirBackend) else None
        for shard in manifest.shards:
            writer = ShardFileWriter(dest, shard)
            source = local_shard_path(root, manifest.version, shard) if root is not None else None
            if not writer.done and (source is None or not writer.link(source)):
                for chunk in self.iter_shard(manifest.version, shard.name, writer.offset):
                    writer.write(chunk)
            writer.finish()
        (pathlib.Path(dest) / FETCHED_MANIFEST).write_bytes(manifest.to_json())
        return manifest

    # ---- uploading --------------------------------------------------------

    def _read_upload(self, upload_id: str) -> tuple[str, dt.datetime]:
        try:
            d = json.loads(self._backend.read_bytes(self._upload_key(_validate_upload_id(upload_id))))
        except ObjectMissing:
            raise NotFound(f"upload {upload_id} does not exist (committed, aborted or expired)") from None
        return d["version"], dt.datetime.fromisoformat(d["created_at"])

    def _open_uploads(self) -> list[tuple[str, str, dt.datetime]]:
        """(upload id, version, created) of every open upload."""
        out = []
        for obj in self._backend.list("uploads/"):
            parts = obj.key.split("/")
            if len(parts) == 3 and parts[2] == "upload.json":
                try:
                    version, created = self._read_upload(parts[1])
                except NotFound:
                    continue
                out.append((parts[1], version, created))
        return out

    def _declared(self, upload_id: str) -> dict[str, ShardStatus]:
        prefix = f"uploads/{upload_id}/shards/"
        out = {}
        for obj in self._backend.list(prefix):
            d = json.loads(self._backend.read_bytes(obj.key))
            name = obj.key[len(prefix):-len(".json")]
            base, delta_size = d.get("base", ""), int(d.get("delta_size", 0))
            received = (delta_size if base else d["size"]) if d["complete"] else \
                self._backend.staged_size(self._parts_prefix(upload_id, name))
            info = d.get("base_info")
            out[name] = ShardStatus(name, d["size"], d["sha256"], received, d["complete"], base, delta_size,
                                    d.get("delta_sha256", ""),
                                    ShardInfo(name, info["size"], info["sha256"], info["base"], None, info["depth"])
                                    if info else None)
        return out

    def _write_decl(self, upload_id: str, s: ShardStatus) -> None:
        self._backend.put_bytes(self._decl_key(upload_id, s.name), json.dumps(
            {"size": s.size, "sha256": s.sha256, "complete": s.complete, "base": s.base, "delta_size": s.delta_size,
             "delta_sha256": s.delta_sha256,
             "base_info": {"size": s.base_info.size, "sha256": s.base_info.sha256, "base": s.base_info.base,
                           "depth": s.base_info.depth} if s.base_info is not None else None}).encode())

    def upload_status(self, upload_id: str) -> UploadStatus:
        """Where an upload stands: per declared shard, bytes held and whether complete."""
        version, created = self._read_upload(upload_id)
        shards = tuple(sorted(self._declared(upload_id).values(), key=lambda s: s.name))
        return UploadStatus(upload_id, version, shards, created)

    def begin_upload(self, version: str) -> UploadStatus:
        """Open an upload for ``version``, or return the open one (so a crashed publisher resumes).

        :class:`AlreadyExists` when the version is already published.
        """
        WeightsVersion.validate(version)
        with self._lock:
            if self._load_manifest(version) is not None:
                raise AlreadyExists(f"version {version} is already published")
            for upload_id, v, _created in self._open_uploads():
                if v == version:
                    return self.upload_status(upload_id)
            if self._stored_objects(version):
                self.sweep()    # leftovers of a deleted version go, unless a later version's delta reads them
            if self._stored_objects(version):
                # A deleted version whose bytes a later version's delta still reads: its name stays taken.
                raise FailedPrecondition(
                    f"version {version} was deleted, but its stored shards are still the base of a later version's "
                    "delta; name another version",
                    precondition_violations=[PreconditionViolation("RETAINED", version, "bytes read by a later delta")])
            upload_id = secrets.token_hex(16)
            created = self._clock()
            self._backend.put_bytes(self._upload_key(upload_id), json.dumps(
                {"version": version, "created_at": created.isoformat()}).encode())
            return UploadStatus(upload_id, version, (), created)

    def _declare(self, upload_id: str, name: str, size: int, sha256: str,
                 as_delta: DeltaSpec | None = None) -> tuple[str, ShardStatus]:
        version, _ = self._read_upload(upload_id)
        validate_name(name, "name")
        _validate_sha256(sha256)
        if size < 0:
            raise InvalidArgument.field("size", f"{size} is negative")
        if as_delta is not None:
            WeightsVersion.validate(as_delta.base, "base_version")
            _validate_sha256(as_delta.sha256)
            if as_delta.size <= 0:
                raise InvalidArgument.field("delta_size", f"{as_delta.size}: a delta object holds at least its header")
        with self._lock:
            base_info = self._check_base(as_delta.base, name, size) if as_delta is not None else None
            decl = self._declared(upload_id).get(name)
            wanted = ShardStatus(name, size, sha256, 0, False, *((as_delta.base, as_delta.size, as_delta.sha256,
                                                                  base_info) if as_delta is not None else ()))
            if decl is not None and (decl.size, decl.sha256) != (size, sha256):
                raise FailedPrecondition(
                    f"shard {name} of upload {upload_id} was declared with size {decl.size} and sha256 "
                    f"{decl.sha256}; abort the upload to change its content")
            if decl is None or not decl.complete and (decl.base, decl.delta_size, decl.delta_sha256) != \
                    (wanted.base, wanted.delta_size, wanted.delta_sha256):
                # New, or the same file sent another way (whole after a refused delta): staged bytes start over.
                if decl is not None:
                    self._backend.delete_prefix(self._parts_prefix(upload_id, name))
                decl = wanted
                self._write_decl(upload_id, decl)
        return version, decl

    def _check_base(self, base: str, name: str, size: int) -> ShardInfo:
        """The published shard a delta of ``name`` (``size`` bytes) may be taken against; FailedPrecondition
        (type BASE) when there is none or the chain would grow past MAX_DEPTH."""
        manifest = self._load_manifest(base)
        info = next((s for s in manifest.shards if s.name == name), None) if manifest is not None else None
        why = ("is not published" if manifest is None else f"has no shard {name}" if info is None
               else f"holds {name} with {info.size} bytes, not {size}" if info.size != size
               else f"holds {name} {info.depth} deltas deep already" if info.depth >= delta.MAX_DEPTH else "")
        if why:
            raise FailedPrecondition(f"shard {name} cannot be a delta against version {base}: {base} {why}; "
                                     "send it whole", precondition_violations=[PreconditionViolation("BASE", base, why)])
        assert info is not None
        return info

    def _check_delta(self, upload_id: str, key: str, decl: ShardStatus,
                     staged: Callable[[], Iterable[bytes]]) -> None:
        """A received delta (``staged()``: its bytes) decodes, against the base the store holds, to the file
        declared; DataLoss (the shard reset) otherwise.

        The base comes from the cache of decoded shards where it holds it (one layer to decode, not the chain);
        the file decoded, checked, replaces it there (the next version's delta reads it). A decode over a cached
        base that does not give the declared file checks that entry, and decodes through the chain when the
        entry was wrong: a cached byte never decides whether a delta is accepted."""
        def fail(why: str) -> NoReturn:
            self._reset_shard(upload_id, key, decl.name)
            raise DataLoss(f"shard {decl.name}: the delta against {decl.base} {why}; the shard was reset, "
                           "upload it again from offset 0 (or whole)")
        base = decl.base_info
        assert base is not None
        pieces = iter(staged())
        first = next(pieces, b"")
        try:
            in_first = len(first) >= 12 and len(first) >= delta.header_size(first)
            header = delta.read_header(first if in_first else first + b"".join(pieces))
        except (ValueError, struct.error) as err:
            fail(f"is malformed ({err})")
        if header.base != delta.DeltaBase(decl.base, decl.name, base.size, base.sha256) or header.size != decl.size:
            fail(f"names another base or size ({header.base}, {header.size} bytes)")
        version, _ = self._read_upload(upload_id)

        def decoded(trace: _Trace, delta_bytes: Iterable[bytes]) -> tuple[int, str, str, EntryWriter | None]:
            """(bytes, sha256, error) of the file the delta decodes to, and a cache entry of it, uncommitted."""
            h, seen, error = hashlib.sha256(), 0, ""
            # Cached only over a base that is a delta itself: a delta over a whole file decodes in one layer
            # anyway, and an entry would be the model's bytes again on the store's disk.
            entry = self.cache.writer(version, decl.name, decl.sha256, decl.size) \
                if self.cache is not None and base.base else None
            try:
                for piece in delta.decode(self._content(decl.base, decl.name, bool(base.base), 0, base.sha256, trace),
                                          delta_bytes):
                    h.update(piece)
                    seen += len(piece)
                    if entry is not None:
                        entry.write(piece)
            except (ValueError, ObjectMissing) as err:
                error = str(err)
            finally:
                trace.layers += 1       # the received delta itself
                self._count(trace, "accept")
            return seen, h.hexdigest(), error, entry

        trace = _Trace(verify=False)    # the result is checked whole: an entry is not hashed first
        seen, got, error, entry = decoded(trace, itertools.chain([first], pieces) if in_first else staged())
        if (error or (seen, got) != (decl.size, decl.sha256)) and self._cache_was_wrong(trace):
            if entry is not None:
                entry.abort()
            seen, got, error, entry = decoded(_Trace(use_cache=False), staged())
        if error or (seen, got) != (decl.size, decl.sha256):
            if entry is not None:
                entry.abort()
            if error:
                fail(f"does not decode ({error})")
            fail(f"decodes to {seen} bytes hashing to {got}, not the {decl.size} declared with {decl.sha256}")
        if entry is not None:
            entry.commit()

    def shard_writer(self, upload_id: str, name: str, size: int, sha256: str,
                     as_delta: DeltaSpec | None = None) -> ShardWriter:
        """Declare (or re-open) a shard of an upload and return a writer resuming at its ``received``.

        Re-declaring with another size or sha256 is :class:`FailedPrecondition`. ``as_delta``: the chunks will
        be a delta object (:mod:`.delta`) against the same-named shard of a published version (FailedPrecondition,
        type BASE, when that cannot be: send the file whole).
        """
        version, decl = self._declare(upload_id, name, size, sha256, as_delta)
        writer = ShardWriter(self, upload_id, version, decl)
        if writer.received == decl.sent_size and not writer.complete:
            # Every byte is already held (an empty shard, or a writer cut off
            # between its last chunk and the final check): finish now, since
            # no further chunk will come to trigger it.
            writer._finish()
        return writer

    def put_shard_file(self, upload_id: str, name: str, path: str | os.PathLike[str] | ShardSource,
                       base: tuple[str, str | os.PathLike[str]] | None = None) -> ShardStatus:
        """Upload a local file (a path, or a :class:`ShardSource`: a file or its bytes in memory) as the shard
        ``name`` in one pass (no per-chunk parts), verified. ``base``: (version, a local copy of its same-named
        shard): store the file as a delta against it when that is worth it."""
        source = path if isinstance(path, ShardSource) else ShardSource.file(path)
        with source.view() as view:
            if base is not None:
                status = self._put_shard_delta(upload_id, name, view, *base)
                if status is not None:
                    return status
            data = memoryview(view)
            try:
                size = data.nbytes
                version, decl = self._declare(upload_id, name, size, hashlib.sha256(data).hexdigest())
                if not decl.complete:
                    pieces = (bytes(data[i:i + MAX_CHUNK_BYTES]) for i in range(0, size, MAX_CHUNK_BYTES))
                    self._store_verified(upload_id, version, decl, pieces)
                    self._backend.delete_prefix(self._parts_prefix(upload_id, name))
            finally:
                data.release()
        return dataclasses.replace(decl, received=size, complete=True)

    def _put_shard_delta(self, upload_id: str, name: str, new: Any, base_version: str,
                         base_path: str | os.PathLike[str]) -> ShardStatus | None:
        """put_shard_file of the bytes ``new`` as a delta against ``base_path`` (the base version's shard); None
        when the base does not fit or the delta is not worth it (the caller stores the file whole)."""
        with memoryview(new) as whole:
            size = whole.nbytes
        if size < delta.MIN_SIZE:
            return None
        try:
            with self._lock:
                info = self._check_base(base_version, name, size)
        except FailedPrecondition:
            return None
        with open(base_path, "rb") as g:
            if os.fstat(g.fileno()).st_size != size:
                return None
            with mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ) as old:
                encoded = delta.encode(new, old, delta.DeltaBase(base_version, name, size, info.sha256))
                sha256 = hashlib.sha256(new).hexdigest()
        if encoded is None:
            return None
        writer = self.shard_writer(upload_id, name, size, sha256,
                                   DeltaSpec(base_version, len(encoded), hashlib.sha256(encoded).hexdigest()))
        for chunk in chunks_from_pieces([encoded[writer.received:]], start=writer.received, total_size=len(encoded)):
            if not writer.complete:
                writer.write(chunk)
        return writer.status()

    def _store_verified(self, upload_id: str, version: str, decl: ShardStatus, pieces: Iterable[bytes]) -> None:
        """Write a shard's final object from ``pieces`` and mark it complete if it matches its sha256."""
        h = hashlib.sha256()

        def hashed() -> Iterator[bytes]:
            for piece in pieces:
                h.update(piece)
                yield piece
        key = self._shard_key(version, decl.name)
        try:
            self._backend.put_stream(key, hashed(), decl.size)
        except ValueError as err:
            self._reset_shard(upload_id, key, decl.name)
            raise DataLoss(f"shard {decl.name}: {err}; the shard was reset, upload it again from offset 0") from None
        if h.hexdigest() != decl.sha256:
            self._reset_shard(upload_id, key, decl.name)
            raise DataLoss(f"shard {decl.name}: received bytes hash to {h.hexdigest()}, declared {decl.sha256}; "
                           "the shard was reset, upload it again from offset 0")
        self._write_decl(upload_id, dataclasses.replace(decl, received=decl.size, complete=True))

    def _reset_shard(self, upload_id: str, key: str, name: str) -> None:
        self._backend.delete(key)
        self._backend.delete_prefix(self._parts_prefix(upload_id, name))

    def commit(self, upload_id: str, shards: Sequence[str], spec: VersionSpec) -> WeightsManifest:
        """Publish an upload whose shards are exactly ``shards``, all complete; the manifest goes last."""
        spec.validate()
        if not shards:
            raise InvalidArgument.field("shards", "a version needs at least one shard")
        if len(set(shards)) != len(shards):
            raise InvalidArgument.field("shards", "names repeat")
        for name in shards:
            validate_name(name, "shards")
        with self._lock:
            status = self.upload_status(upload_id)
            declared = {s.name: s for s in status.shards}
            violations = [PreconditionViolation("INCOMPLETE", n, f"{declared[n].received} of {declared[n].size} bytes")
                          for n in shards if n in declared and not declared[n].complete]
            violations += [PreconditionViolation("MISSING", n, "never uploaded") for n in shards if n not in declared]
            violations += [PreconditionViolation("UNLISTED", n, "uploaded but not named in the commit")
                           for n in declared if n not in shards]
            if violations:
                raise FailedPrecondition(
                    f"upload {upload_id} cannot be committed: "
                    + "; ".join(f"{v.subject} {v.type.lower()} ({v.description})" for v in violations),
                    precondition_violations=violations)
            if self._load_manifest(status.version) is not None:
                raise AlreadyExists(f"version {status.version} is already published")
            infos = []
            for name in sorted(shards):
                decl = declared[name]
                key = self._delta_key(status.version, name) if decl.base else self._shard_key(status.version, name)
                obj = self._backend.stat(key)
                if obj is None or obj.size != decl.sent_size:
                    raise DataLoss(f"shard {name} of upload {upload_id} vanished or changed size in storage")
                depth = decl.base_info.depth + 1 if decl.base and decl.base_info is not None else 0
                infos.append(ShardInfo(name, decl.size, decl.sha256, decl.base, decl.sent_size, depth))
            manifest = WeightsManifest(status.version, dataclasses.replace(
                spec, model_config=dict(spec.model_config), metadata=dict(spec.metadata)), tuple(infos), self._clock())
            self._backend.put_bytes(self._manifest_key(status.version), manifest.to_json())
            self._backend.delete_prefix(f"uploads/{upload_id}/")
            if self.keep_last is not None:
                self.gc()
        return manifest

    def abort_upload(self, upload_id: str) -> None:
        """Drop an unpublished upload and the shards it stored."""
        with self._lock:
            version, _ = self._read_upload(upload_id)
            self._drop_upload(upload_id, version)

    def _drop_upload(self, upload_id: str, version: str) -> None:
        self._backend.delete_prefix(f"uploads/{upload_id}/")
        self.sweep()     # the shards it stored, unless published or still a delta's base

    def publish_dir(self, src: str | os.PathLike[str] | Sequence[ShardSource], version: str, spec: VersionSpec,
                    base: tuple[str, str | os.PathLike[str]] | None = None) -> WeightsManifest:
        """Publish every regular file directly inside ``src`` (or the :class:`ShardSource` s given: files or
        buffers) as one version. ``base``: (a published version, a local directory of its files): a file with a
        same-named, same-sized file there is stored as a delta against it when that is smaller (:mod:`.delta`)."""
        files = shard_sources(src)
        if not files:
            raise InvalidArgument.field("src", f"{src} holds no files")
        upload = self.begin_upload(version)
        for source in files:
            other = pathlib.Path(base[1]) / source.name if base is not None else None
            self.put_shard_file(upload.upload_id, source.name, source,
                                (base[0], other) if base is not None and other is not None and other.is_file()
                                else None)
        return self.commit(upload.upload_id, [s.name for s in files], spec)

    # ---- deleting, pins, retention -----------------------------------------

    def delete(self, version: str) -> None:
        """Delete a published version: :class:`FailedPrecondition` while pinned, :class:`NotFound` if absent."""
        with self._lock:
            self.get_manifest(WeightsVersion.validate(version))
            owners = self.pins(version)
            if owners:
                raise FailedPrecondition(
                    f"version {version} is pinned by {', '.join(owners)}",
                    precondition_violations=[PreconditionViolation("PINNED", version, f"pinned by {o}") for o in owners])
            self._delete_unchecked(version)

    def _delete_unchecked(self, version: str, sweep: bool = True) -> None:
        # Manifest first: from this instant the version is gone for readers. Its shards go with the sweep,
        # unless a later version's delta reads them.
        self._backend.delete(self._manifest_key(version))
        if sweep:
            self.sweep()

    def _stored_objects(self, version: str) -> list[str]:
        return [o.key for o in self._backend.list(f"versions/{version}/") + self._backend.list(f"deltas/{version}/")]

    def sweep(self) -> list[str]:
        """Delete every stored shard that no published version and no open upload needs, directly or as a
        delta's base (mark and sweep); the keys deleted.

        Safe beside uploads of other processes on the same storage: the objects are listed first, then the
        open uploads (whose shards and delta bases are kept), then the manifests; an object written after the
        listing is not looked at, one written before it belongs to an upload declared before it, and an
        upload committed meanwhile was seen as an upload or its manifest is seen.
        """
        with self._lock:
            objects = [o.key for prefix in ("versions/", "deltas/") for o in self._backend.list(prefix)]
            live: set[str] = set()
            todo: list[str] = []             # keys to keep, and to follow when they are deltas
            for upload_id, version, _created in self._open_uploads():
                live.add(version)
                for decl in self._declared(upload_id).values():
                    if decl.base:            # an upload's delta reads its base (whole or a delta itself)
                        todo += [self._delta_key(decl.base, decl.name), self._shard_key(decl.base, decl.name)]
            live.update(m.version for m in self.manifests())
            present = set(objects)
            todo += [k for k in objects if k.split("/", 2)[1] in live]
            marked: set[str] = set()
            while todo:
                key = todo.pop()
                if key not in present or key in marked:
                    continue
                marked.add(key)
                if key.startswith("deltas/"):
                    try:
                        base = self._delta_header(key).base
                    except (ObjectMissing, ValueError):
                        continue    # unreadable: it keeps nothing (reading it fails as DataLoss anyway)
                    todo += [self._delta_key(base.version, base.name), self._shard_key(base.version, base.name)]
            doomed = [k for k in objects if k not in marked]
            for key in doomed:
                self._backend.delete(key)
            return doomed

    def pin(self, version: str, owner: str) -> VersionEntry:
        """Keep ``version`` from deletion until ``owner`` unpins it (idempotent)."""
        validate_name(owner, "owner")
        with self._lock:
            manifest = self.get_manifest(WeightsVersion.validate(version))
            self._backend.put_bytes(f"pins/{version}/{owner}", json.dumps(
                {"created_at": self._clock().isoformat()}).encode())
            return VersionEntry(manifest, self.pins(version))

    def unpin(self, version: str, owner: str) -> VersionEntry:
        """Release ``owner``'s pin (idempotent)."""
        validate_name(owner, "owner")
        with self._lock:
            manifest = self.get_manifest(WeightsVersion.validate(version))
            self._backend.delete(f"pins/{version}/{owner}")
            return VersionEntry(manifest, self.pins(version))

    def gc(self, keep_last: int | None = None) -> GcResult:
        """Delete all but the newest ``keep_last`` (default: the store's) unpinned versions, and expired uploads.

        With no retention given or configured only expired uploads go.
        """
        keep = self.keep_last if keep_last is None else keep_last
        if keep is not None and keep < 0:
            raise InvalidArgument.field("keep_last", f"{keep} is negative")
        deleted, kept_pinned, expired = [], [], []
        with self._lock:
            if keep is not None:
                newest_first = list(reversed(self.manifests()))
                for manifest in newest_first[keep:]:
                    if self.pins(manifest.version):
                        kept_pinned.append(manifest.version)
                    else:
                        self._delete_unchecked(manifest.version, sweep=False)
                        deleted.append(manifest.version)
                if deleted:
                    self.sweep()
            cutoff = self._clock() - dt.timedelta(seconds=self.upload_ttl_s)
            for upload_id, version, created in self._open_uploads():
                if created < cutoff:
                    self._drop_upload(upload_id, version)
                    expired.append(upload_id)
        return GcResult(tuple(deleted), tuple(kept_pinned), tuple(expired))
