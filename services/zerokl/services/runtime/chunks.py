"""Raw-byte chunks for large blobs (weight shards, KV-cache handoff).

A blob travels as :class:`Chunk` s of at most :data:`MAX_CHUNK_BYTES`, each with
its offset in the blob and the SHA-256 of its own bytes, so the receiver checks
every piece as it arrives and a cut transfer resumes at the first missing byte.
The proto form is ``zerokl.v1.BytesChunk`` (protos/zerokl/v1/blob.proto);
:func:`chunk_to_proto` and :func:`chunk_from_proto` are the only converters.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator

from zerokl.services.runtime.errors import DataLoss, InvalidArgument
from zerokl.v1 import blob_pb2

__all__ = [
    "MAX_CHUNK_BYTES",
    "Chunk",
    "make_chunk",
    "chunk_to_proto",
    "chunk_from_proto",
    "rechunk",
    "chunks_from_pieces",
    "split_bytes",
    "verify_chunk",
    "ChunkAssembler",
]

# 4 MiB keeps one chunk well under the servers' message limit (8 MiB) while
# making per-message overhead negligible.
MAX_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Chunk:
    """``data`` sits at ``offset`` in a blob of ``total_size`` bytes (None: unknown)."""

    offset: int
    data: bytes
    sha256: bytes
    total_size: int | None = None

    @property
    def end(self) -> int:
        """Offset one past this chunk's last byte."""
        return self.offset + len(self.data)


def make_chunk(offset: int, data: bytes, total_size: int | None = None) -> Chunk:
    """A chunk whose checksum is computed from ``data``."""
    return Chunk(offset, bytes(data), hashlib.sha256(data).digest(), total_size)


def chunk_to_proto(chunk: Chunk) -> blob_pb2.BytesChunk:
    """Chunk -> ``zerokl.v1.BytesChunk``."""
    msg = blob_pb2.BytesChunk(offset=chunk.offset, data=chunk.data, sha256=chunk.sha256)
    if chunk.total_size is not None:
        msg.total_size = chunk.total_size
    return msg


def chunk_from_proto(msg: blob_pb2.BytesChunk) -> Chunk:
    """``zerokl.v1.BytesChunk`` -> Chunk (not verified: see :func:`verify_chunk`)."""
    return Chunk(msg.offset, msg.data, msg.sha256,
                 msg.total_size if msg.HasField("total_size") else None)


def rechunk(pieces: Iterable[bytes], size: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
    """Regroup byte pieces of any sizes into pieces of exactly ``size`` (last one shorter)."""
    if size <= 0:
        raise ValueError("chunk size must be positive")
    buf = bytearray()
    for piece in pieces:
        buf += piece
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


def chunks_from_pieces(pieces: Iterable[bytes], *, start: int = 0, total_size: int | None = None,
                       chunk_size: int = MAX_CHUNK_BYTES) -> Iterator[Chunk]:
    """Chunks covering ``pieces`` laid out from offset ``start``.

    A blob with nothing to send from ``start`` still yields one empty chunk, so
    the receiver learns ``total_size`` and that the transfer is complete.
    """
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in 1..{MAX_CHUNK_BYTES}")
    offset = start
    for data in rechunk(pieces, chunk_size):
        yield make_chunk(offset, data, total_size)
        offset += len(data)
    if offset == start:
        yield make_chunk(start, b"", total_size)


def split_bytes(data: bytes, *, start: int = 0, chunk_size: int = MAX_CHUNK_BYTES) -> Iterator[Chunk]:
    """Chunks of ``data[start:]`` (offsets relative to ``data``), each with ``total_size``."""
    if not 0 <= start <= len(data):
        raise ValueError(f"start {start} outside 0..{len(data)}")
    view = memoryview(data)
    pieces = (view[i:i + chunk_size] for i in range(start, len(data), chunk_size))
    return chunks_from_pieces(pieces, start=start, total_size=len(data), chunk_size=chunk_size)


def verify_chunk(chunk: Chunk, expected_offset: int, total_size: int | None = None) -> None:
    """Check a received chunk before using it.

    Raises :class:`InvalidArgument` for a chunk that is too large, not where the
    receiver expects it (chunks must be contiguous), past the end of the blob,
    or whose declared ``total_size`` disagrees; :class:`DataLoss` when its bytes
    do not match its checksum.
    """
    if len(chunk.data) > MAX_CHUNK_BYTES:
        raise InvalidArgument.field("chunk.data", f"{len(chunk.data)} bytes exceeds the {MAX_CHUNK_BYTES}-byte chunk limit")
    if chunk.offset != expected_offset:
        raise InvalidArgument.field("chunk.offset", f"got {chunk.offset}, expected {expected_offset} (chunks must be contiguous)")
    if total_size is not None:
        if chunk.total_size is not None and chunk.total_size != total_size:
            raise InvalidArgument.field("chunk.total_size", f"got {chunk.total_size}, the blob has {total_size} bytes")
        if chunk.end > total_size:
            raise InvalidArgument.field("chunk.data", f"chunk ends at {chunk.end}, past the blob's {total_size} bytes")
    if len(chunk.sha256) != 32:
        raise InvalidArgument.field("chunk.sha256", f"must be 32 bytes, got {len(chunk.sha256)}")
    if hashlib.sha256(chunk.data).digest() != chunk.sha256:
        raise DataLoss(f"chunk at offset {chunk.offset} ({len(chunk.data)} bytes) does not match its sha256")


class ChunkAssembler:
    """Reassemble a blob in memory from verified, contiguous chunks.

    ``total_size`` may be given up front or learned from the first chunk that
    carries it; :attr:`complete` turns true once every byte arrived. To resume
    a cut transfer, pass the bytes already held as ``prefix`` and ask the
    sender to start at ``len(prefix)``.
    """

    def __init__(self, total_size: int | None = None, prefix: bytes = b"") -> None:
        self._buf = bytearray(prefix)
        self.total_size = total_size

    @property
    def received(self) -> int:
        """Bytes held so far (the offset the next chunk must start at)."""
        return len(self._buf)

    @property
    def complete(self) -> bool:
        """True when the total size is known and every byte has arrived."""
        return self.total_size is not None and self.received == self.total_size

    def add(self, chunk: Chunk) -> None:
        """Verify ``chunk`` (see :func:`verify_chunk`) and append it."""
        if self.total_size is None:
            self.total_size = chunk.total_size
        verify_chunk(chunk, self.received, self.total_size)
        self._buf += chunk.data

    def value(self) -> bytes:
        """The whole blob; raises :class:`DataLoss` if bytes are still missing."""
        if not self.complete:
            raise DataLoss(f"blob incomplete: {self.received} of {self.total_size} bytes received")
        return bytes(self._buf)
