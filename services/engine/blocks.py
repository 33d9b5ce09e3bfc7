"""The paged KV block pool: ref-counted blocks, prefix caching on full blocks, LRU eviction.

A full block is identified by the hash chain of every token up to its end, so two
requests share a block only if they share the whole prefix. A freed block keeps its
hash and stays reusable until it is evicted for a new allocation (least recently
freed first). Sharing never changes bits: the cached rows are exactly the ones a
recomputation would write (the model's parity guarantee).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

__all__ = ["BlockManager", "block_hashes"]


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of every full block of token_ids."""
    out, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

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
            if b in self.hash_of:                       # evict its cached prefix identity
                del self.by_hash[self.hash_of.pop(b)]
            self.ref[b] = 1
            blocks.append(b)
        return blocks

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference on the longest run of cached blocks matching `hashes`."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        for b in blocks:
            self.share(b)
        return blocks

    def share(self, block: int) -> None:
        if self.ref[block] == 0:
            self.free.pop(block)
        self.ref[block] += 1

    def register(self, block: int, block_hash: int) -> None:
        """Mark a fully written block as reusable under its prefix hash."""
        if self.enable_prefix_caching and block_hash not in self.by_hash and block not in self.hash_of:
            self.by_hash[block_hash] = block
            self.hash_of[block] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV was computed with weights that are gone)."""
        self.by_hash.clear()
        self.hash_of.clear()

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None                     # most recently freed: evicted last
