"""What an upload sends: a shard's name and its bytes, from a file on disk or from a buffer in memory.

A version is uploaded file by file (the store's shards). Most uploads send a directory's files; the trainer's
record process sends a weights-only record's serving files from its own memory instead (the bytes the files would
hold, built there once: for the GLM-5 2-layer slice a whole file copy of the model's 22.7 GiB never reaches the
disk, docs/perf.md "The slice's job: the disk"). Both go through one path: the store client's
:meth:`~zerokl.services.weightstore.client.WeightStoreClient.put_shard` and the local store's
:meth:`~zerokl.services.weightstore.store.VersionStore.put_shard_file` take a :class:`ShardSource` and read its
bytes through :meth:`ShardSource.view`, which maps a file once or hands out the buffer itself.

No torch, no grpc: the weight-store server imports this too.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

__all__ = ["ShardSource", "shard_sources"]


@dataclass(frozen=True)
class ShardSource:
    """One file of a version to upload: ``name``, and its bytes in the file ``path`` or in the buffer ``data``
    (anything :class:`memoryview` takes: bytes, an :class:`mmap.mmap`), exactly one of the two. A buffer is read,
    never changed, and stays its owner's: the source does not close it."""

    name: str
    path: pathlib.Path | None = None
    data: Any = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.data is None):
            raise ValueError(f"a shard source holds a path or a buffer, exactly one (shard {self.name!r})")

    @classmethod
    def file(cls, path: str | os.PathLike[str]) -> "ShardSource":
        """The file at ``path``, under its own name."""
        path = pathlib.Path(path)
        return cls(path.name, path=path)

    @classmethod
    def memory(cls, name: str, data: Any) -> "ShardSource":
        """The bytes of ``data`` as the file ``name``."""
        return cls(name, data=data)

    @property
    def in_memory(self) -> bool:
        return self.data is not None

    @contextlib.contextmanager
    def view(self) -> Iterator[Any]:
        """The bytes, readable as a buffer for as long as the block runs: a file mapped once (read only; ``b""``
        for an empty one), a buffer as it is."""
        if self.path is None:
            yield self.data
            return
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        try:
            yield mapped if mapped is not None else b""
        finally:
            if mapped is not None:
                mapped.close()

    def write_to(self, directory: pathlib.Path) -> "ShardSource":
        """The bytes written to ``directory / name``; the file's source (a buffer's owner may free it then)."""
        target = directory / self.name
        with self.view() as view, open(target, "wb") as f:
            f.write(view)
        return ShardSource.file(target)


def shard_sources(src: str | os.PathLike[str] | Sequence[ShardSource]) -> list[ShardSource]:
    """The sources an upload of ``src`` sends, by name: a directory's regular files (not hidden ones), or the
    sources given."""
    if isinstance(src, (str, os.PathLike)):
        return [ShardSource.file(p) for p in sorted(pathlib.Path(src).iterdir())
                if p.is_file() and not p.name.startswith(".")]
    return sorted(src, key=lambda s: s.name)
