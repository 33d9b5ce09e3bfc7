"""Object storage under the weight store: a local directory or any S3-compatible store.

Backends are deliberately dumb key -> bytes stores; every rule about
versions, uploads and pins lives once above them in
:class:`~zerokl.services.weightstore.store.VersionStore`. What a backend
must guarantee is that a written object appears whole or not at all (local:
write to a temp file then ``os.replace``; S3: a PUT is atomic per object).

Keys are ``/``-separated segments of ``[A-Za-z0-9][A-Za-z0-9._-]*``: no
empty, ``.``/``..`` or hidden segments and no leading ``/``, so no key can
escape the store's root or bucket prefix.

A write the storage refuses for want of room (a full disk or quota, a file size limit: ENOSPC, EDQUOT,
EFBIG; a MinIO whose drives are full, whether it answers HTTP 507 or 500) raises :class:`StorageFull`
(RESOURCE_EXHAUSTED to a caller), naming where the data lives and the bytes being written, and leaves nothing behind
that was not there before.
"""
from __future__ import annotations

import abc
import contextlib
import errno
import io
import os
import pathlib
import re
import secrets
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES
from zerokl.services.runtime.errors import ResourceExhausted

__all__ = [
    "ObjectInfo",
    "ObjectMissing",
    "InvalidKey",
    "validate_key",
    "StorageBackend",
    "StorageFull",
    "LocalDirBackend",
    "S3Backend",
    "NO_ROOM",
]

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_T = TypeVar("_T")


class ObjectMissing(KeyError):
    """The key holds no object."""


class InvalidKey(ValueError):
    """The key could name something outside the store (or is malformed)."""


class StorageFull(ResourceExhausted):
    """The storage refused a write for want of room: a full disk or quota, a file size limit, a full MinIO.
    RESOURCE_EXHAUSTED to a caller, whose upload resumes where the store's copy ends once there is room."""


#: errno values of a write refused for want of room: a full disk, a full quota, a file size limit (RLIMIT_FSIZE).
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def validate_key(key: str) -> str:
    """Return ``key`` if every segment is safe, else raise :class:`InvalidKey`."""
    if not key or len(key) > 1024 or not all(_SEGMENT.fullmatch(seg) for seg in key.split("/")):
        raise InvalidKey(f"invalid storage key {key!r}")
    return key


def _validate_prefix(prefix: str) -> str:
    if prefix and not (prefix.endswith("/") and validate_key(prefix[:-1])):
        raise InvalidKey(f"invalid storage prefix {prefix!r} (must be '' or end in '/')")
    return prefix


@dataclass(frozen=True)
class ObjectInfo:
    """A stored object's key and size in bytes."""

    key: str
    size: int


class StorageBackend(abc.ABC):
    """Atomic-per-object key/value storage for the version store."""

    @abc.abstractmethod
    def put_stream(self, key: str, pieces: Iterable[bytes], size: int) -> None:
        """Store the concatenation of ``pieces`` (exactly ``size`` bytes) at ``key``, atomically.

        Raises ValueError, storing nothing, if the pieces add up to another size.
        """

    @abc.abstractmethod
    def iter_read(self, key: str, offset: int = 0, piece_size: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
        """Bytes of ``key`` from ``offset`` to the end, in pieces of at most ``piece_size``.

        Raises :class:`ObjectMissing` (on first iteration) when there is no such object.
        """

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Size of the object at ``key``, None when there is none."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` ('' or ending in '/'), sorted by key."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object at ``key``; a missing object is not an error."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the data lives, for logs (never includes credentials)."""

    def scratch_dir(self) -> pathlib.Path | None:
        """A local directory beside the data for what the store can rebuild from it (its cache of decoded
        shards), or None when the backend has none (a bucket: the server names one)."""
        return None

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` atomically."""
        self.put_stream(key, [data], len(data))

    def read_bytes(self, key: str) -> bytes:
        """The whole object at ``key``."""
        return b"".join(self.iter_read(key))

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under ``prefix``."""
        for obj in self.list(prefix):
            self.delete(obj.key)

    # ---- staging: one object received in order and resumably (an upload's shard) ----
    #
    # Here each staged piece is an object of its own, ``<prefix><offset:020d>``, and the final
    # object is assembled from them (S3 has no append); a backend that can append in place
    # overrides stage() and commit_staged() (LocalDirBackend: one file, then a rename).

    def staged_size(self, prefix: str) -> int:
        """Bytes staged under ``prefix`` ('' or ending in '/') that run contiguously from offset 0."""
        end = 0
        for part in self.list(prefix):
            if int(part.key.rsplit("/", 1)[1]) != end:
                break   # only a contiguous run from 0 counts
            end += part.size
        return end

    def stage(self, prefix: str, offset: int, data: bytes) -> None:
        """Stage ``data`` at ``offset``, which must be :meth:`staged_size` (ValueError otherwise)."""
        self.put_bytes(f"{prefix}{offset:020d}", data)

    def iter_staged(self, prefix: str) -> Iterator[bytes]:
        """The contiguous staged bytes under ``prefix``, in order."""
        end = 0
        for part in self.list(prefix):
            if int(part.key.rsplit("/", 1)[1]) != end:
                return
            end += part.size
            yield from self.iter_read(part.key)

    def commit_staged(self, prefix: str, key: str, size: int) -> None:
        """Make the ``size`` bytes staged under ``prefix`` the object at ``key`` (atomically, durably) and
        drop the staging; ValueError, storing nothing, when another number of bytes is staged."""
        self.put_stream(key, self.iter_staged(prefix), size)
        self.delete_prefix(prefix)


def _in_its_directory(path: pathlib.Path, use: Callable[[], _T]) -> _T:
    """``use()`` (which creates ``path``) after making ``path``'s directories; made again when they are found gone:
    another thread's :meth:`LocalDirBackend._prune` removes directories left empty (``uploads/<id>/parts/`` when its
    last shard commits) and may remove one of them between their making and ``use``."""
    for _ in range(2):
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            return use()
    path.parent.mkdir(parents=True, exist_ok=True)
    return use()


class LocalDirBackend(StorageBackend):
    """Objects as files under ``root`` (the embedded, one-machine default).

    A published version's files sit together in ``root/versions/<version>/``,
    so local tools can load a checkpoint from there directly.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = pathlib.Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> pathlib.Path:
        path = self.root / validate_key(key)
        # Keys are validated above; resolving also refuses symlinks out of the root.
        if not path.resolve().is_relative_to(self.root):
            raise InvalidKey(f"storage key {key!r} resolves outside {self.root}")
        return path

    @contextlib.contextmanager
    def _room(self, what: str, nbytes: int) -> Iterator[None]:
        """Raise a write refused for want of room (:data:`NO_ROOM`) as :class:`StorageFull`: where, how many bytes,
        what the system said, and what room is left on the disk."""
        try:
            yield
        except OSError as err:
            if err.errno not in NO_ROOM:
                raise
            try:
                free = f"{shutil.disk_usage(self.root).free} bytes free there"
            except OSError:
                free = "its free space unknown"
            raise StorageFull(f"the weight store's {self.describe()} has no room: writing {nbytes} bytes of {what} "
                              f"failed ({err.strerror or os.strerror(err.errno)}; {free})") from None

    def put_stream(self, key: str, pieces: Iterable[bytes], size: int) -> None:
        path = self._path(key)
        # Same directory as the target so os.replace is a same-filesystem rename;
        # the leading dot makes it an invalid key, so list() never shows it.
        tmp = path.parent / f".tmp-{secrets.token_hex(8)}-{path.name}"
        with self._room(key, size):
            try:
                written = 0
                with _in_its_directory(tmp, lambda: open(tmp, "wb")) as f:
                    for piece in pieces:
                        f.write(piece)
                        written += len(piece)
                    if written != size:
                        raise ValueError(f"{key}: got {written} bytes, expected {size}")
                    f.flush()
                    # Durable before visible: a manifest must never outlive the shards it names.
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def iter_read(self, key: str, offset: int = 0, piece_size: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
        path = self._path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise ObjectMissing(key) from None
        with f:
            f.seek(offset)
            while piece := f.read(piece_size):
                yield piece

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            return ObjectInfo(key, self._path(key).stat().st_size)
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self.root / _validate_prefix(prefix) if prefix else self.root
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                key = pathlib.Path(dirpath, name).relative_to(self.root).as_posix()
                try:
                    validate_key(key)
                except InvalidKey:
                    continue  # temp files of writes in progress
                try:
                    size = pathlib.Path(dirpath, name).stat().st_size
                except FileNotFoundError:
                    continue  # deleted or renamed since the walk saw it (a shard committed in another thread)
                out.append(ObjectInfo(key, size))
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        self._prune(path.parent)

    def _prune(self, parent: pathlib.Path) -> None:
        """Drop directories left empty so a deleted object leaves no trace."""
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def describe(self) -> str:
        return f"local directory {self.root}"

    def scratch_dir(self) -> pathlib.Path:
        # A hidden segment is no valid key: list() never shows what is under it, no key can reach it.
        return self.root / ".decoded"

    # One staging file from offset 0, appended in place and renamed to its key when complete: each
    # byte is written once, and made durable once (fsync at the commit, not per piece). A crash
    # mid-append leaves a tail of a verified piece (the store checks pieces before staging them,
    # and the whole object's sha256 before committing it), which a resumed upload continues.

    def _staging(self, prefix: str) -> pathlib.Path:
        return self._path(f"{_validate_prefix(prefix)}{0:020d}")

    def stage(self, prefix: str, offset: int, data: bytes) -> None:
        path = self._staging(prefix)
        with self._room(f"{prefix} at offset {offset}", len(data)), \
                _in_its_directory(path, lambda: open(path, "ab", buffering=0)) as f:
            if f.tell() != offset:
                raise ValueError(f"{prefix}: {f.tell()} bytes staged, a piece at offset {offset}")
            try:
                view = memoryview(data)
                while view:
                    view = view[f.write(view):]
            except OSError:
                # A piece written in part (the disk filled up meanwhile) goes: what is staged stays what was
                # acknowledged, and the upload resumes there.
                with contextlib.suppress(OSError):
                    f.truncate(offset)
                raise

    def commit_staged(self, prefix: str, key: str, size: int) -> None:
        path = self._staging(prefix)
        if [p.key for p in self.list(prefix)] != [path.relative_to(self.root).as_posix()]:
            super().commit_staged(prefix, key, size)    # nothing staged (an empty object), or pieces
            return
        if path.stat().st_size != size:
            raise ValueError(f"{key}: {path.stat().st_size} bytes staged, expected {size}")
        with self._room(key, size), open(path, "rb+") as f:
            os.fsync(f.fileno())    # durable before visible, as put_stream (a filesystem may find no room only now)
        target = self._path(key)
        _in_its_directory(target, lambda: os.replace(path, target))
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._prune(path.parent)


class _PieceReader(io.RawIOBase):
    """A file-like view of an iterator of byte pieces, for minio's put_object."""

    def __init__(self, pieces: Iterable[bytes], size: int, key: str) -> None:
        self._pieces = iter(pieces)
        self._buf = bytearray()
        self._size = size
        self._key = key
        self._seen = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            piece = next(self._pieces, None)
            if piece is None:
                break
            self._seen += len(piece)
            if self._seen > self._size:
                raise ValueError(f"{self._key}: more than the {self._size} bytes announced")
            self._buf += piece
        take = len(self._buf) if n < 0 else min(n, len(self._buf))
        out = bytes(self._buf[:take])
        del self._buf[:take]
        if not out and self._seen != self._size:
            raise ValueError(f"{self._key}: got {self._seen} bytes, expected {self._size}")
        return out


# S3 multipart parts must be at least 5 MiB; 64 MiB keeps part count low for
# multi-GB shards while bounding the memory one upload buffers.
_S3_PART_SIZE = 64 * 1024 * 1024
_S3_MISSING = {"NoSuchKey", "NoSuchObject", "ResourceNotFound"}
# A write refused for want of room: MinIO's drives past their free-space threshold (HTTP 507; HTTP 500 before
# MinIO's 507), a bucket's quota.
_S3_NO_ROOM = {"XMinioStorageFull", "XMinioAdminBucketQuotaExceeded"}
# ...or said only in the message of an HTTP 500 (InternalError): a drive that filled below MinIO's own threshold check
# ("no space left on device", the disk's ENOSPC), or the threshold's words under another code.
_S3_NO_ROOM_SAID = re.compile(r"no space left on device|minimum free (disk|drive) threshold", re.IGNORECASE)
_HTTP_INSUFFICIENT_STORAGE = 507
# minio's own HTTP client retries these statuses (5 times, backing off), as this one's does.
_S3_RETRIED = (500, 502, 503, 504)


def _s3_no_room(err: Exception) -> bool:
    """Whether the minio client's ``err`` (S3Error or ServerError) is a write refused for want of room."""
    from minio.error import S3Error     # loaded with the client (S3Backend.__init__)
    if isinstance(err, S3Error):
        return err.code in _S3_NO_ROOM or bool(_S3_NO_ROOM_SAID.search(err.message or ""))
    return getattr(err, "status_code", None) == _HTTP_INSUFFICIENT_STORAGE


def _s3_http() -> Any:
    """The minio client's HTTP pool as the client makes its own (timeouts, pool size, certificates, 5 retries of a 500,
    502, 503 or 504 answer), except that a request still refused after the retries comes back to minio as the last
    answer, not as urllib3's MaxRetryError ("too many 500 error responses"): minio then reads its S3 error document.
    Without it a MinIO with no room that answers HTTP 500 (XMinioStorageFull before MinIO's 507, a drive's "no space
    left on device") was an unexpected error, UNKNOWN to the store's caller, instead of a store with no room."""
    import certifi
    import urllib3
    timeout = 5 * 60
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=timeout, read=timeout), maxsize=10,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=_S3_RETRIED, raise_on_status=False))


class S3Backend(StorageBackend):
    """Objects in an S3-compatible bucket (MinIO in a cluster) through the ``minio`` client.

    ``prefix`` lets several stores share one bucket. The bucket is created
    when missing.
    """

    def __init__(self, endpoint: str, bucket: str, access_key: str, secret_key: str, *,
                 secure: bool = True, region: str | None = None, prefix: str = "") -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = _validate_prefix(prefix)
        # Imported here: the minio client's import (~0.2 s of CPU) is paid by a store on S3 only, not by every
        # process that reads this package (a replica's server, the scheduler, the trainer, a local store).
        from minio import Minio
        from minio.error import S3Error
        self._client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=region,
                             http_client=_s3_http())
        if not self._client.bucket_exists(bucket):
            try:
                self._client.make_bucket(bucket)
            except S3Error as err:
                # Another replica created it between our check and our call.
                if err.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def _name(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def put_stream(self, key: str, pieces: Iterable[bytes], size: int) -> None:
        from minio.error import S3Error, ServerError     # loaded with the client (__init__)
        try:
            self._client.put_object(self.bucket, self._name(key), _PieceReader(pieces, size, key), size,
                                    part_size=_S3_PART_SIZE)
        except (S3Error, ServerError) as err:
            if not _s3_no_room(err):
                raise
            said = f"{err.code}: {err.message}" if isinstance(err, S3Error) else str(err)
            raise StorageFull(f"the weight store's {self.describe()} has no room: writing {size} bytes of {key} "
                              f"failed ({said})") from None

    def iter_read(self, key: str, offset: int = 0, piece_size: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
        name = self._name(key)
        info = self.stat(key)
        if info is None:
            raise ObjectMissing(key)
        if offset >= info.size:
            return  # S3 answers a range starting at the end with an error, not zero bytes
        resp = self._client.get_object(self.bucket, name, offset=offset)
        try:
            yield from resp.stream(piece_size)
        finally:
            resp.close()
            resp.release_conn()

    def stat(self, key: str) -> ObjectInfo | None:
        from minio.error import S3Error     # loaded with the client (__init__)
        try:
            st = self._client.stat_object(self.bucket, self._name(key))
        except S3Error as err:
            if err.code in _S3_MISSING:
                return None
            raise
        return ObjectInfo(key, int(st.size or 0))

    def list(self, prefix: str) -> list[ObjectInfo]:
        full = self.prefix + _validate_prefix(prefix)
        out = []
        for o in self._client.list_objects(self.bucket, prefix=full, recursive=True):
            if o.object_name is None or o.is_dir:
                continue
            key = o.object_name[len(self.prefix):]
            try:
                out.append(ObjectInfo(validate_key(key), int(o.size or 0)))
            except InvalidKey:
                continue  # foreign objects sharing the bucket
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        self._client.remove_object(self.bucket, self._name(key))

    def describe(self) -> str:
        return f"s3 bucket {self.bucket} at {self.endpoint}" + (f" under {self.prefix}" if self.prefix else "")
