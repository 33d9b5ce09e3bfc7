"""Versioned weights over any :class:`StorageBackend`: the weight store's logic, once.

Usable without gRPC (the trainer on one machine publishes through it
directly); the gRPC service is a thin layer over it.

Storage layout (keys)::

    manifests/<version>.json          the manifest; its presence IS publication
    versions/<version>/<shard>        shard files (a Hugging Face style checkpoint dir)
    uploads/<id>/upload.json          an open upload: version, creation time
    uploads/<id>/shards/<shard>.json  a declared shard: size, sha256, complete
    uploads/<id>/parts/<shard>/<offset:020d>  bytes received so far (StorageBackend.stage: one
                                      object per chunk, or one file appended in place)
    pins/<version>/<owner>            who keeps the version from deletion

Rules: shards are written (and verified) before the manifest and the manifest
last, so a reader never sees a version with missing or unverified shards; a
delete removes the manifest first. A shard whose bytes no longer match the
manifest's sha256 is never handed out whole (:meth:`VersionStore.iter_shard`).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import pathlib
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, Chunk, make_chunk, rechunk, verify_chunk
from zerokl.services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PreconditionViolation,
)
from zerokl.services.weightstore.backends import ObjectMissing, StorageBackend

__all__ = [
    "LATEST",
    "MANIFEST_FORMAT",
    "ShardInfo",
    "VersionSpec",
    "WeightsManifest",
    "ShardStatus",
    "UploadStatus",
    "VersionEntry",
    "GcResult",
    "ShardWriter",
    "ShardFileWriter",
    "VersionStore",
    "validate_version",
    "validate_name",
    "file_sha256",
]

LATEST = "latest"
MANIFEST_FORMAT = "zerokl.weights/1"
FETCHED_MANIFEST = "zerokl_manifest.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def validate_name(value: str, what: str) -> str:
    """A version id, shard name or pin owner: 1-128 of ``[A-Za-z0-9._-]``, starting alphanumeric."""
    if not _NAME.fullmatch(value or ""):
        raise InvalidArgument.field(what, f"{value!r} is not 1-128 characters of [A-Za-z0-9._-] starting "
                                          "with a letter or digit")
    return value


def validate_version(version: str, what: str = "version") -> str:
    """A version id; ``latest`` is reserved (it names the newest version in reads)."""
    validate_name(version, what)
    if version == LATEST:
        raise InvalidArgument.field(what, f"{LATEST!r} is reserved")
    return version


def _validate_upload_id(upload_id: str) -> str:
    if not _UPLOAD_ID.fullmatch(upload_id or ""):
        raise InvalidArgument.field("upload_id", f"{upload_id!r} is not an upload id (32 hex digits)")
    return upload_id


def _validate_sha256(value: str) -> str:
    if not _SHA256.fullmatch(value or ""):
        raise InvalidArgument.field("sha256", f"{value!r} is not a lowercase hex sha256")
    return value


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Lowercase hex sha256 of a file, read in 4 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(MAX_CHUNK_BYTES):
            h.update(piece)
    return h.hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """One file of a version: name, size in bytes, lowercase hex sha256."""

    name: str
    size: int
    sha256: str


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
            validate_version(self.parent_version, "parent_version")
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
            "shards": [dataclasses.asdict(s) for s in self.shards],
        }, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "WeightsManifest":
        """Parse the stored form; raises ValueError/KeyError when it is not one."""
        d = json.loads(data)
        if d.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unknown manifest format {d.get('format')!r}")
        spec = VersionSpec(d["parent_version"], d["step"], d["numerics_version"], d["numerics_fingerprint"],
                           d["model_config"], d["metadata"])
        shards = tuple(ShardInfo(s["name"], int(s["size"]), s["sha256"]) for s in d["shards"])
        return cls(d["version"], spec, shards, dt.datetime.fromisoformat(d["created_at"]))


@dataclass(frozen=True)
class ShardStatus:
    """A declared shard of an upload; ``received`` is where PutShard resumes."""

    name: str
    size: int
    sha256: str
    received: int
    complete: bool


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


class ShardWriter:
    """Receives one shard's chunks for an upload (from :meth:`VersionStore.shard_writer`).

    Each chunk is verified against its own sha256, staged in place (the backend appends it where it
    can) and fed to the shard's running sha256 as it arrives, so a broken stream resumes at
    :attr:`received` and no byte is read back or written twice. When the last byte arrives the
    running hash is checked against the declared sha256 and the staged bytes become the shard.
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
        verify_chunk(chunk, self.received, self._decl.size)
        if chunk.data:
            try:
                self._store._backend.stage(self._prefix, chunk.offset, chunk.data)
            except ValueError as err:
                # Another stream of the same shard moved it meanwhile: this one starts again from GetUpload.
                raise FailedPrecondition(f"shard {self._decl.name}: {err}; ask GetUpload where it stands") from None
            self._sha256.update(chunk.data)
            self.received = chunk.end
        if self.received == self._decl.size:
            self._finish()

    def _finish(self) -> None:
        store, decl = self._store, self._decl
        key = store._shard_key(self._version, decl.name)
        got = self._sha256.hexdigest()
        if got != decl.sha256:
            store._reset_shard(self._upload_id, key, decl.name)
            raise DataLoss(f"shard {decl.name}: received bytes hash to {got}, declared {decl.sha256}; "
                           "the shard was reset, upload it again from offset 0")
        try:
            store._backend.commit_staged(self._prefix, key, decl.size)
        except ValueError as err:
            store._reset_shard(self._upload_id, key, decl.name)
            raise DataLoss(f"shard {decl.name}: {err}; the shard was reset, upload it again from offset 0") from None
        store._write_decl(self._upload_id, dataclasses.replace(decl, received=decl.size, complete=True))
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
            self.partial.unlink()
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
    """

    def __init__(self, backend: StorageBackend, *, keep_last: int | None = None,
                 upload_ttl_s: float = 7 * 24 * 3600, clock: Callable[[], dt.datetime] = _now) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        self._backend = backend
        self.keep_last = keep_last
        self.upload_ttl_s = upload_ttl_s
        self._clock = clock
        self._lock = threading.RLock()

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
        manifest = self._load_manifest(validate_version(version))
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

        def tail() -> Iterator[bytes]:
            nonlocal seen
            for piece in self._backend.iter_read(self._shard_key(manifest.version, name), 0, chunk_size):
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
            for data in rechunk(tail(), chunk_size):
                if pending is not None:
                    yield pending
                pending = make_chunk(position, data, shard.size)
                position += len(data)
        except ObjectMissing:
            raise DataLoss(f"shard {name} of version {manifest.version} is missing from storage") from None
        if seen != shard.size or h.hexdigest() != shard.sha256:
            raise DataLoss(f"shard {name} of version {manifest.version} is corrupt: its bytes do not match "
                           f"the manifest sha256 {shard.sha256}; it will not be served")
        yield pending if pending is not None else make_chunk(offset, b"", shard.size)

    def fetch(self, version: str, dest: str | os.PathLike[str]) -> WeightsManifest:
        """Copy a version into directory ``dest`` (a loadable checkpoint dir), verified and resumable.

        Files already there with the right checksum are kept; partial ones
        are resumed. ``zerokl_manifest.json`` is written last.
        """
        manifest = self.get_manifest(version)
        pathlib.Path(dest).mkdir(parents=True, exist_ok=True)
        for shard in manifest.shards:
            writer = ShardFileWriter(dest, shard)
            if not writer.done:
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
            received = d["size"] if d["complete"] else self._backend.staged_size(self._parts_prefix(upload_id,
                                                                                                     name))
            out[name] = ShardStatus(name, d["size"], d["sha256"], received, d["complete"])
        return out

    def _write_decl(self, upload_id: str, s: ShardStatus) -> None:
        self._backend.put_bytes(self._decl_key(upload_id, s.name), json.dumps(
            {"size": s.size, "sha256": s.sha256, "complete": s.complete}).encode())

    def upload_status(self, upload_id: str) -> UploadStatus:
        """Where an upload stands: per declared shard, bytes held and whether complete."""
        version, created = self._read_upload(upload_id)
        shards = tuple(sorted(self._declared(upload_id).values(), key=lambda s: s.name))
        return UploadStatus(upload_id, version, shards, created)

    def begin_upload(self, version: str) -> UploadStatus:
        """Open an upload for ``version``, or return the open one (so a crashed publisher resumes).

        :class:`AlreadyExists` when the version is already published.
        """
        validate_version(version)
        with self._lock:
            if self._load_manifest(version) is not None:
                raise AlreadyExists(f"version {version} is already published")
            for upload_id, v, _created in self._open_uploads():
                if v == version:
                    return self.upload_status(upload_id)
            upload_id = secrets.token_hex(16)
            created = self._clock()
            self._backend.put_bytes(self._upload_key(upload_id), json.dumps(
                {"version": version, "created_at": created.isoformat()}).encode())
            return UploadStatus(upload_id, version, (), created)

    def _declare(self, upload_id: str, name: str, size: int, sha256: str) -> tuple[str, ShardStatus]:
        version, _ = self._read_upload(upload_id)
        validate_name(name, "name")
        _validate_sha256(sha256)
        if size < 0:
            raise InvalidArgument.field("size", f"{size} is negative")
        with self._lock:
            decl = self._declared(upload_id).get(name)
            if decl is None:
                decl = ShardStatus(name, size, sha256, 0, False)
                self._write_decl(upload_id, decl)
            elif (decl.size, decl.sha256) != (size, sha256):
                raise FailedPrecondition(
                    f"shard {name} of upload {upload_id} was declared with size {decl.size} and sha256 "
                    f"{decl.sha256}; abort the upload to change its content")
        return version, decl

    def shard_writer(self, upload_id: str, name: str, size: int, sha256: str) -> ShardWriter:
        """Declare (or re-open) a shard of an upload and return a writer resuming at its ``received``.

        Re-declaring with another size or sha256 is :class:`FailedPrecondition`.
        """
        version, decl = self._declare(upload_id, name, size, sha256)
        writer = ShardWriter(self, upload_id, version, decl)
        if writer.received == size and not writer.complete:
            # Every byte is already held (an empty shard, or a writer cut off
            # between its last chunk and the final check): finish now, since
            # no further chunk will come to trigger it.
            writer._finish()
        return writer

    def put_shard_file(self, upload_id: str, name: str, path: str | os.PathLike[str]) -> ShardStatus:
        """Upload a local file as a shard in one pass (no per-chunk parts), verified."""
        size = os.path.getsize(path)
        version, decl = self._declare(upload_id, name, size, file_sha256(path))
        if not decl.complete:
            def pieces() -> Iterator[bytes]:
                with open(path, "rb") as f:
                    while piece := f.read(MAX_CHUNK_BYTES):
                        yield piece
            self._store_verified(upload_id, version, decl, pieces())
            self._backend.delete_prefix(self._parts_prefix(upload_id, name))
        return dataclasses.replace(decl, received=size, complete=True)

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
                obj = self._backend.stat(self._shard_key(status.version, name))
                if obj is None or obj.size != declared[name].size:
                    raise DataLoss(f"shard {name} of upload {upload_id} vanished or changed size in storage")
                infos.append(ShardInfo(name, declared[name].size, declared[name].sha256))
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
        if self._load_manifest(version) is None:
            self._backend.delete_prefix(f"versions/{version}/")
        self._backend.delete_prefix(f"uploads/{upload_id}/")

    def publish_dir(self, src: str | os.PathLike[str], version: str, spec: VersionSpec) -> WeightsManifest:
        """Publish every regular file directly inside ``src`` as one version."""
        files = sorted(p for p in pathlib.Path(src).iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise InvalidArgument.field("src", f"{src} holds no files")
        upload = self.begin_upload(version)
        for path in files:
            self.put_shard_file(upload.upload_id, path.name, path)
        return self.commit(upload.upload_id, [p.name for p in files], spec)

    # ---- deleting, pins, retention -----------------------------------------

    def delete(self, version: str) -> None:
        """Delete a published version: :class:`FailedPrecondition` while pinned, :class:`NotFound` if absent."""
        with self._lock:
            self.get_manifest(validate_version(version))
            owners = self.pins(version)
            if owners:
                raise FailedPrecondition(
                    f"version {version} is pinned by {', '.join(owners)}",
                    precondition_violations=[PreconditionViolation("PINNED", version, f"pinned by {o}") for o in owners])
            self._delete_unchecked(version)

    def _delete_unchecked(self, version: str) -> None:
        # Manifest first: from this instant the version is gone for readers.
        self._backend.delete(self._manifest_key(version))
        self._backend.delete_prefix(f"versions/{version}/")

    def pin(self, version: str, owner: str) -> VersionEntry:
        """Keep ``version`` from deletion until ``owner`` unpins it (idempotent)."""
        validate_name(owner, "owner")
        with self._lock:
            manifest = self.get_manifest(validate_version(version))
            self._backend.put_bytes(f"pins/{version}/{owner}", json.dumps(
                {"created_at": self._clock().isoformat()}).encode())
            return VersionEntry(manifest, self.pins(version))

    def unpin(self, version: str, owner: str) -> VersionEntry:
        """Release ``owner``'s pin (idempotent)."""
        validate_name(owner, "owner")
        with self._lock:
            manifest = self.get_manifest(validate_version(version))
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
                        self._delete_unchecked(manifest.version)
                        deleted.append(manifest.version)
            cutoff = self._clock() - dt.timedelta(seconds=self.upload_ttl_s)
            for upload_id, version, created in self._open_uploads():
                if created < cutoff:
                    self._drop_upload(upload_id, version)
                    expired.append(upload_id)
        return GcResult(tuple(deleted), tuple(kept_pinned), tuple(expired))
