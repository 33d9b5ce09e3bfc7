"""The weight store's cache of decoded shards: the newest accepted version of each shard name, whole, on local disk.

A delta shard (:mod:`.delta`) is decoded over its base, which may itself be a delta, up to
:data:`~.delta.MAX_DEPTH` layers: without a cache, accepting (and reading) the n-th delta of a chain decodes
n layers, so each record of an RL job costs more than the one before (docs/perf.md, issue 49). The store
decodes a delta's whole file anyway to check its sha256 before accepting it; this cache keeps that result,
so the next delta against it decodes one layer whatever the chain's depth, and a replica loading the newest
version reads it without decoding at all. Only shards two or more deltas deep are cached: a delta over a whole
file decodes in one layer anyway (a trainer recording every version against its start, ``--record-deltas
start``, keeps no second copy of the model here either).

Layout: ``<directory>/<shard name>/<sha256>-<version>``, one file per entry, the whole decoded bytes of
shard ``name`` of ``version``. Files, not memory: a model is many GB, and the store streams it frame by
frame; the page cache keeps what is hot. Bounded two ways: one entry per shard name (a new one replaces
the name's older ones), and ``max_bytes`` over all of them (the oldest entries go first; a shard larger
than the budget is not cached).

The cache is never trusted: an entry is written only from bytes whose sha256 the store just checked against
the one declared for the shard (temp file, then a rename: whole or absent), looked up by (version, name,
sha256), and

* a delta accepted over a cached base is accepted only when the decoded result matches its own declared
  sha256, as any delta (a corrupt entry fails that check: the store then checks the entry, drops it and
  decodes through the chain);
* an entry served on a read is hashed once per process before its first use (an entry this process wrote is
  known), and the read checks the whole result against the manifest's sha256 as every read does.

A miss (another process's cache, a wiped directory, a restart on a fresh disk) decodes through the chain as
without a cache, and the store refills it. Several store processes may share one directory: every write is
a rename and every entry names its content's hash.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import secrets
import threading
import time
from typing import BinaryIO, Callable, Iterator

from zerokl.services.weightstore import delta

__all__ = ["DecodedCache", "EntryWriter", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 64 * 1024**3       # one large model's serving weights
_STALE_TEMP_S = 3600.0                 # temp files older than this are a crashed writer's


class EntryWriter:
    """One entry being written (from :meth:`DecodedCache.writer`): :meth:`write` the decoded bytes in order, then
    :meth:`commit` once their sha256 matched, or :meth:`abort`."""

    def __init__(self, cache: "DecodedCache", version: str, name: str, sha256: str, size: int, replace: bool) -> None:
        self._cache, self.version, self.name, self.sha256, self.size = cache, version, name, sha256, size
        self._replace = replace
        directory = cache.directory / name
        directory.mkdir(parents=True, exist_ok=True)
        self._tmp = directory / f".tmp-{secrets.token_hex(8)}"
        self._file: BinaryIO | None = open(self._tmp, "wb")
        self._written = 0

    def write(self, piece: bytes) -> None:
        """Append the next decoded bytes; a local write that fails (a full disk) drops the entry, never the caller."""
        if self._file is not None:
            try:
                self._file.write(piece)
            except OSError:
                self.abort()
                return
            self._written += len(piece)

    def commit(self) -> bool:
        """Install the entry (the caller checked its bytes' sha256); False when it did not go in."""
        if self._file is None:
            return False
        self._file.close()
        self._file = None
        if self._written != self.size:
            self._tmp.unlink(missing_ok=True)
            return False
        try:
            return self._cache._install(self._tmp, self.version, self.name, self.sha256, self._replace)
        except OSError:
            self._tmp.unlink(missing_ok=True)
            return False

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


class DecodedCache:
    """Decoded shards under ``directory``, at most ``max_bytes`` of them (see the module docstring). ``on_reject``
    is called with (version, name) for each entry found not to hold its bytes (it is dropped)."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 on_reject: Callable[[str, str], None] | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive (pass no cache to go without one)")
        self.directory = pathlib.Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._on_reject = on_reject
        self._lock = threading.Lock()
        # Entries whose bytes this process knows to hash to their name's sha256: path -> (inode, size, mtime_ns).
        self._verified: dict[str, tuple[int, int, int]] = {}
        now = time.time()
        for tmp in self.directory.glob("*/.tmp-*"):
            try:
                if now - tmp.stat().st_mtime > _STALE_TEMP_S:
                    tmp.unlink()
            except FileNotFoundError:
                pass

    def _path(self, version: str, name: str, sha256: str) -> pathlib.Path:
        return self.directory / name / f"{sha256}-{version}"

    @staticmethod
    def _stamp(st: os.stat_result) -> tuple[int, int, int]:
        return st.st_ino, st.st_size, st.st_mtime_ns

    def has(self, version: str, name: str, sha256: str) -> bool:
        return self._path(version, name, sha256).is_file()

    def entries(self) -> list[tuple[str, str, str]]:
        """(name, version, sha256) of every entry."""
        out = []
        for path in self.directory.glob("*/*"):
            if not path.name.startswith(".") and len(path.name) > 65 and path.name[64] == "-":
                out.append((path.parent.name, path.name[65:], path.name[:64]))
        return sorted(out)

    def open(self, version: str, name: str, sha256: str, *, verify: bool) -> BinaryIO | None:
        """The entry's bytes, open for reading, or None on a miss. ``verify``: hash an entry this process has not
        seen whole yet before returning it (dropped when it does not match)."""
        path = self._path(version, name, sha256)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        stamp = self._stamp(os.fstat(f.fileno()))
        if verify and self._verified.get(str(path)) != stamp:
            h = hashlib.sha256()
            while piece := f.read(delta.FRAME):
                h.update(piece)
            if h.hexdigest() != sha256:
                f.close()
                self.discard(version, name, sha256)
                if self._on_reject is not None:
                    self._on_reject(version, name)
                return None
            with self._lock:
                self._verified[str(path)] = stamp
            f.seek(0)
        return f

    def check(self, version: str, name: str, sha256: str) -> bool:
        """Hash the entry now: True when it holds its bytes; a wrong one is dropped (False)."""
        self._verified.pop(str(self._path(version, name, sha256)), None)
        f = self.open(version, name, sha256, verify=True)
        if f is None:
            return False
        f.close()
        return True

    @staticmethod
    def read(f: BinaryIO) -> Iterator[bytes]:
        """The bytes of an entry from :meth:`open`, frame by frame (the file is closed at the end)."""
        with f:
            while piece := f.read(delta.FRAME):
                yield piece

    def discard(self, version: str, name: str, sha256: str) -> None:
        path = self._path(version, name, sha256)
        with self._lock:
            self._verified.pop(str(path), None)
            path.unlink(missing_ok=True)

    def writer(self, version: str, name: str, sha256: str, size: int, *, replace: bool = True) -> EntryWriter | None:
        """A writer of the entry (version, name, sha256), or None when it is not worth one (larger than the budget,
        already held, or ``replace`` False and the name holds an entry already)."""
        if size > self.max_bytes or self.has(version, name, sha256):
            return None
        if not replace and any((self.directory / name).glob("[0-9a-f]*")):
            return None
        try:
            return EntryWriter(self, version, name, sha256, size, replace)
        except OSError:
            return None

    def _install(self, tmp: pathlib.Path, version: str, name: str, sha256: str, replace: bool) -> bool:
        path = self._path(version, name, sha256)
        with self._lock:
            others = [p for p in (self.directory / name).iterdir() if not p.name.startswith(".") and p != path]
            if others and not replace:
                tmp.unlink(missing_ok=True)
                return False
            os.replace(tmp, path)
            self._verified[str(path)] = self._stamp(path.stat())
            for other in others:     # one entry per name: the newest
                self._verified.pop(str(other), None)
                other.unlink(missing_ok=True)
            self._evict(keep=path)
        return True

    def _evict(self, keep: pathlib.Path) -> None:
        """The oldest entries go until the cache fits its budget (never ``keep``, the one just written)."""
        held = []
        for path in self.directory.glob("*/*"):
            if path.name.startswith("."):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            held.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in held)
        for _, size, path in sorted(held, key=lambda t: t[0]):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            self._verified.pop(str(path), None)
            path.unlink(missing_ok=True)
            total -= size
