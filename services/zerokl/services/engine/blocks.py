"""The paged KV block pool: ref-counted blocks, prefix caching on full blocks, LRU eviction.

A full block is keyed by a SHA-256 chain: the key of block i hashes the key of
block i-1 and block i's token ids, and the chain starts from a seed naming the
weights version and numerics fingerprint that computed the KV. Two requests
share a block only if they share the whole prefix: a hit also compares the
cached block's own tokens and its parent's key with the request's, so even a
key collision is a miss, never another prompt's KV. (The keys used to be
Python's builtin 64-bit ``hash``, which can be inverted offline to forge
collisions.) A freed block keeps its key and stays reusable until it is evicted
for a new allocation (least recently freed first). Sharing never changes bits:
the cached rows are exactly the ones a recomputation would write (the model's
parity guarantee).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

__all__ = ["BlockKey", "BlockManager", "block_hashes", "prefix_cache_seed"]

BlockKey = bytes
"""The 32-byte SHA-256 chain key of a full block."""


def prefix_cache_seed(weights_version: str, numerics_fingerprint: str) -> BlockKey:
    """The chain's start for KV computed with these weights under these numerics."""
    h = hashlib.sha256(b"zerokl-prefix-cache-v1")
    for part in (weights_version, numerics_fingerprint):
        raw = part.encode()
        h.update(struct.pack("<Q", len(raw)) + raw)    # length-prefixed: ("v1", "x") != ("v", "1x")
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, seed: BlockKey = b"") -> list[BlockKey]:
    """Chain keys of every full block of token_ids, starting from ``seed``."""
    out, parent = [], seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}Q", *block)).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class _Cached:
    """What a cached block holds: checked against the request on every hit."""

    key: BlockKey
    parent: BlockKey           # the previous block's key (the seed for block 0)
    token_ids: tuple[int, ...]


class BlockManager:
    """Ref-counted KV blocks with a prefix cache keyed by :func:`block_hashes`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.by_hash: dict[BlockKey, int] = {}
        self.cached: dict[int, _Cached] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, or None if there are not enough free ones (nothing is taken then)."""
        if n > len(self.free):
            return None
        blocks = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            if b in self.cached:                        # evict its cached prefix identity
                del self.by_hash[self.cached.pop(b).key]
            self.ref[b] = 1
            blocks.append(b)
        return blocks

    def match_prefix(self, token_ids: Sequence[int], keys: Sequence[BlockKey], seed: BlockKey) -> list[int]:
        """Take a reference on the longest run of cached blocks holding token_ids' full blocks.

        ``keys`` are token_ids' :func:`block_hashes` from ``seed``. A block is a hit only
        when its key, its parent's key and its own tokens all match the request's (a
        colliding key is a miss).
        """
        if not self.enable_prefix_caching:
            return []
        blocks, parent = [], seed
        for i, key in enumerate(keys):
            b = self.by_hash.get(key)
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            if b is None or self.cached[b] != _Cached(key, parent, tokens):
                break
            blocks.append(b)
            parent = key
        for b in blocks:
            self.share(b)
        return blocks

    def share(self, block: int) -> None:
        if self.ref[block] == 0:
            self.free.pop(block)
        self.ref[block] += 1

    def register(self, block: int, key: BlockKey, parent: BlockKey, token_ids: Sequence[int]) -> None:
        """Mark a fully written block (holding ``token_ids``, after the block keyed ``parent``) reusable."""
        if self.enable_prefix_caching and key not in self.by_hash and block not in self.cached:
            self.by_hash[key] = block
            self.cached[block] = _Cached(key, parent, tuple(token_ids))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV was computed with weights that are gone)."""
        self.by_hash.clear()
        self.cached.clear()

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None                     # most recently freed: evicted last
