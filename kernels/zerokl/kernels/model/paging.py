"""Paged-KV addressing: turn block tables into the AttentionBatch the model consumes.

The model never sees blocks: it reads and writes slots. A sequence's block table maps
position p to slot `table[p // block_size] * block_size + p % block_size`; key lists are
built in position order, so where the blocks lie in memory never changes the order in
which attention visits keys (and never changes a bit).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zerokl.kernels.model.model import AttentionBatch

__all__ = ["SequenceChunk", "batch_for_chunks", "decode_batch", "BlockPool"]


@dataclass(frozen=True)
class SequenceChunk:
    """n_new tokens of one sequence starting at position `start`, whose KV lives in `block_table`."""

    block_table: tuple[int, ...]
    start: int
    n_new: int


def batch_for_chunks(chunks: list[SequenceChunk], block_size: int, device: torch.device | str = "cpu") -> AttentionBatch:
    """AttentionBatch for the chunks' new tokens, concatenated in the given order.

    Only [T] positions, [T] chunk ids and the [C, NB] block tables travel to ``device``; the
    [T, width] key-slot table (prefill: 8,192 tokens x 2,048 keys is 134 MB of int64) is formed
    there: row t is ``table[c][col // bs] * bs + col % bs`` for col <= positions[t], else -1.
    """
    # Host side, numpy over chunks and tokens: O(chunks) Python, no per-token or per-chunk tensors.
    starts = np.fromiter((ch.start for ch in chunks), np.int64, len(chunks))
    n_new = np.fromiter((ch.n_new for ch in chunks), np.int64, len(chunks))
    ends = starts + n_new
    width = int(ends.max())
    nb = -(-width // block_size)                 # table columns the widest row reaches
    tables = np.zeros((len(chunks), nb), dtype=np.int64)
    for i, ch in enumerate(chunks):
        if len(ch.block_table) * block_size < ends[i]:
            raise ValueError(f"block table of {len(ch.block_table)} blocks cannot hold {ends[i]} tokens")
        used = ch.block_table[:nb]
        tables[i, :len(used)] = used
    owner = np.repeat(np.arange(len(chunks)), n_new)                                        # [T]
    positions = np.arange(int(n_new.sum())) + np.repeat(starts - (np.cumsum(n_new) - n_new), n_new)
    positions, owner, tables = (torch.from_numpy(a).to(device) for a in (positions, owner, tables))
    cols = torch.arange(width, device=tables.device)
    rows = tables.index_select(0, owner)                                                    # [T, NB]
    slots = rows.gather(1, (cols // block_size).expand(len(owner), width)) * block_size + cols % block_size
    key_slots = torch.where(cols.view(1, -1) <= positions.view(-1, 1), slots, torch.full_like(slots, -1))
    write = rows.gather(1, (positions // block_size).view(-1, 1)).view(-1) * block_size + positions % block_size
    return AttentionBatch(positions, key_slots, write)


def decode_batch(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, width: int) -> AttentionBatch:
    """The AttentionBatch of one new token per sequence, built on the tables' device.

    block_tables [B, NB] int64 (row b: sequence b's blocks, any value past its last block),
    positions [B] int64 (the new token's position; position < NB * block_size), width >= every
    position + 1 (a static width, so a CUDA graph can hold this: padding keys are -1, which
    never changes a bit). Rows equal batch_for_chunks' for the same one-token chunks, padded
    to ``width`` columns. No host sync, no host data.
    """
    b, nb = block_tables.shape
    if width > nb * block_size:
        raise ValueError(f"decode_batch: width {width} > {nb} blocks of {block_size}")
    cols = torch.arange(width, device=block_tables.device)
    slots = block_tables.gather(1, (cols // block_size).expand(b, width)) * block_size + cols % block_size   # [B, W]
    key_slots = torch.where(cols.view(1, -1) <= positions.view(-1, 1), slots, torch.full_like(slots, -1))
    write = block_tables.gather(1, (positions // block_size).view(-1, 1)).view(-1) * block_size + positions % block_size
    return AttentionBatch(positions, key_slots, write)


class BlockPool:
    """A free list of KV blocks (the engine adds ref-counting and prefix hashing on top)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks))

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self.free)}")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
