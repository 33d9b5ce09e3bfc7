"""Delta shards: a file stored as what changed since the same file of an earlier version.

Between two RL steps most bf16 weights do not change at all: AdamW at RL learning rates moves a
weight by less than half a unit in its last place, so its rounding to bf16 stays where it was
(docs/perf.md, "Records that cost what changed": 76-92% of `tiny`'s bf16 elements unchanged per
step at lr 1e-5, more at lower rates). Unchanged bytes are spread through every tensor, so
deduplicating whole chunks of a file finds none; what works is the exclusive-or of the new file
with the old one (zero wherever a byte did not change) compressed frame by frame.

The encoded form (one object in the store, ``deltas/<version>/<shard>``)::

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON) | payload 0 | payload 1 | ...

The header names the base (``version``, ``name``, ``size``, ``sha256`` of the base's whole bytes),
the decoded ``size`` and the ``frame`` size, and lists each frame's payload length. Frame ``i``
covers bytes ``[i * frame, (i + 1) * frame)`` of the file; its payload is the zstd-compressed XOR
of those bytes with the base's, or empty when they are the base's bytes exactly (no zstd call at
all). Reading is one pass over the base's frames (themselves decoded the same way when the base
is a delta: a chain, bounded by :data:`MAX_DEPTH`) and the payloads, in order.

Integrity is the store's as for any shard: the delta travels in checksummed chunks, the store
decodes it against the base it holds and checks the result against the sha256 declared for the
file before it accepts it, and every read checks the decoded bytes against that sha256 again.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import zstandard

from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, rechunk

__all__ = ["MAGIC", "FRAME", "MAX_DEPTH", "MAX_RATIO", "MIN_SIZE", "DeltaBase", "DeltaHeader", "encode", "decode",
           "read_header", "header_size"]

MAGIC = b"ZKDELTA1"
FRAME = MAX_CHUNK_BYTES         # bytes of the file per frame: one wire chunk
# Deltas of deltas a shard may sit on: a reader decodes up to this many layers over the whole base. After
# it, the writer stores the file whole again (a key frame).
MAX_DEPTH = 8
# A delta larger than this fraction of the file is not worth its decoding: the file goes whole.
MAX_RATIO = 0.5
# Files smaller than this go whole (config files, indexes): a few bytes saved are not worth a base to read.
MIN_SIZE = 64 * 1024
_LEVEL = 1                      # zstd level: the XOR is mostly zeros, and level 1 runs at hundreds of MB/s a core
_PREFIX = struct.Struct("<8sI")


@dataclass(frozen=True)
class DeltaBase:
    """The shard a delta is taken against: ``name`` of ``version``, whose whole bytes are ``size`` long with
    ``sha256``."""

    version: str
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class DeltaHeader:
    """What a delta object says about itself (see the module docstring)."""

    base: DeltaBase
    size: int                       # bytes of the decoded file
    frame: int
    lengths: tuple[int, ...]        # payload bytes per frame; 0: the base's bytes

    def to_bytes(self) -> bytes:
        doc = json.dumps({"base": {"version": self.base.version, "name": self.base.name, "size": self.base.size,
                                   "sha256": self.base.sha256},
                          "size": self.size, "frame": self.frame, "lengths": list(self.lengths)},
                         sort_keys=True, separators=(",", ":")).encode()
        return _PREFIX.pack(MAGIC, len(doc)) + doc

    @property
    def nbytes(self) -> int:
        """Bytes of the whole delta object (header and payloads)."""
        return len(self.to_bytes()) + sum(self.lengths)


def header_size(prefix: bytes) -> int:
    """Bytes of the header (magic and length included) of the object starting with ``prefix`` (>= 12 bytes);
    ValueError when it is no delta object."""
    magic, length = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ValueError("not a delta object (bad magic)")
    return _PREFIX.size + length


def read_header(data: bytes) -> DeltaHeader:
    """Parse the header at the start of ``data`` (which holds at least :func:`header_size` bytes); ValueError
    when it is malformed or inconsistent."""
    end = header_size(data)
    try:
        doc = json.loads(bytes(data[_PREFIX.size:end]))
        base = DeltaBase(str(doc["base"]["version"]), str(doc["base"]["name"]), int(doc["base"]["size"]),
                         str(doc["base"]["sha256"]))
        header = DeltaHeader(base, int(doc["size"]), int(doc["frame"]), tuple(int(n) for n in doc["lengths"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"unreadable delta header: {err}") from None
    if header.frame <= 0 or header.size < 0 or header.base.size != header.size \
            or len(header.lengths) != -(-header.size // header.frame) or any(n < 0 for n in header.lengths):
        raise ValueError("inconsistent delta header (sizes, frame or payload lengths)")
    return header


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def encode(new: Any, base: Any, ref: DeltaBase, *, max_ratio: float = MAX_RATIO) -> bytes | None:
    """The delta object turning ``base``'s bytes into ``new``'s (buffers of equal length, e.g. mmaps of two
    files), or None when it would be larger than ``max_ratio`` of ``new`` (store the file whole).

    Frames are encoded in worker threads (numpy's XOR and zstd release the GIL)."""
    new_v, base_v = memoryview(new).cast("B"), memoryview(base).cast("B")
    if len(new_v) != len(base_v) or len(new_v) != ref.size:
        raise ValueError(f"a delta needs files of one size: {len(new_v)} bytes against a base of {len(base_v)}")
    size = len(new_v)
    starts = range(0, size, FRAME)

    def frame(start: int) -> bytes:
        a = np.frombuffer(new_v[start:start + FRAME], np.uint8)
        b = np.frombuffer(base_v[start:start + FRAME], np.uint8)
        x = np.bitwise_xor(a, b)
        if not x.any():
            return b""
        return zstandard.ZstdCompressor(level=_LEVEL).compress(x.data)

    with concurrent.futures.ThreadPoolExecutor(_workers(), thread_name_prefix="zerokl-delta") as pool:
        payloads = list(pool.map(frame, starts))
    header = DeltaHeader(ref, size, FRAME, tuple(len(p) for p in payloads))
    out = header.to_bytes() + b"".join(payloads)
    return out if len(out) <= max_ratio * max(size, 1) else None


class _Reader:
    """Exact-length reads over an iterator of byte pieces."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self._pieces = iter(pieces)
        self._buf = bytearray()

    def read(self, n: int) -> bytes:
        while len(self._buf) < n:
            piece = next(self._pieces, None)
            if piece is None:
                raise ValueError(f"the delta object ends {n - len(self._buf)} bytes early")
            self._buf += piece
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def at_end(self) -> bool:
        if self._buf:
            return False
        for piece in self._pieces:
            if piece:
                self._buf += piece
                return False
        return True


def decode(base: Iterable[bytes], delta: Iterable[bytes]) -> Iterator[bytes]:
    """The decoded file, one frame at a time: ``base`` is the base file's bytes (pieces of any size), ``delta``
    the delta object's. ValueError when the two do not fit together (the caller checks the sha256)."""
    reader = _Reader(delta)
    head = reader.read(_PREFIX.size)
    header = read_header(head + reader.read(header_size(head) - _PREFIX.size))
    frames = rechunk(base, header.frame)
    decompress = zstandard.ZstdDecompressor()
    for i, length in enumerate(header.lengths):
        want = min(header.frame, header.size - i * header.frame)
        b = next(frames, None)
        if b is None or len(b) != want:
            raise ValueError(f"the base ends before frame {i} of the delta")
        if not length:
            yield b
            continue
        try:
            x = decompress.decompress(reader.read(length), max_output_size=want)
        except zstandard.ZstdError as err:
            raise ValueError(f"frame {i} of the delta does not decompress: {err}") from None
        if len(x) != want:
            raise ValueError(f"frame {i} of the delta decodes to {len(x)} bytes, not {want}")
        yield np.bitwise_xor(np.frombuffer(b, np.uint8), np.frombuffer(x, np.uint8)).tobytes()
    if next(frames, None) is not None or not reader.at_end():
        raise ValueError("the base or the delta object is longer than the header says")
