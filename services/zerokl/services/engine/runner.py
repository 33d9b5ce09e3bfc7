"""The engine's model runner: the paged KV cache, the forward, sampling, and CUDA graphs for decode.

Two paths, the same bits:

* ``forward`` (every step that holds a prefill chunk, and every step on CPU): the
  attention batch is built on the host from the chunks' block tables
  (paging.batch_for_chunks) and only the rows that need logits reach the lm_head.
* ``launch`` / ``collect`` (a step of one new token per running sample, on CUDA): the
  step's metadata -- token (or the row of the previous step whose draw it is), position,
  sampling parameters and block table of each row -- is packed with numpy into one pinned
  host buffer (each sequence keeps a persistent row: its sampling fields are written once,
  its block table grows by the new blocks) and moved by ONE host->device copy into a
  persistent device buffer; the attention batch is built on the device from it
  (paging.decode_batch), the forward and the draw (tokens, logprobs, ok flags) run on the
  device, and ONE device->host copy brings back the results: ``collect`` waits for it, the
  step's only synchronization. ``launch`` returns before the device is done, so the engine
  stages step N+1 while step N runs (overlapped decode): N+1's rows read N's drawn tokens on
  the device, and two pinned buffers alternate so staging never overwrites a copy in flight. The batch
  is padded to a bucket (1, 2, 4, ..., max_num_seqs) and the key width to a power of two,
  and the whole step is captured once per (bucket, width, filters, backend) as a CUDA graph and
  replayed. Padded rows read and write a scratch KV block no sample owns; every op is
  batch-invariant, so they never change a real row's bits, and neither does the key
  width (-1 padding) nor the graph (the same kernels with the same arguments).

A model whose forward still synchronizes (MoE routing before it is made sync-free) is
found by a warm-up run under torch.cuda.set_sync_debug_mode("error"): its decode steps
run the same device-side path eagerly (no graph). ``warm_up`` compiles and captures every
decode shape and runs the general path's shapes before the first request.
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from zerokl.kernels.backend import get_backend
from zerokl.kernels.sampling import SamplingParams, sample
from zerokl.kernels.model import KVCache, Model
from zerokl.kernels.model.paging import SequenceChunk, batch_for_chunks, decode_batch
from zerokl.services.engine.types import EngineConfig, KVHandoff
from zerokl.kernels.cuda_graphs import no_cyclic_gc, sync_checked
from zerokl.vocab import SamplingOptions

__all__ = ["DecodeBatch", "DecodeLaunch", "DecodeSeq", "ModelRunner", "SamplingRow", "batch_buckets"]

log = logging.getLogger(__name__)

# Per-row int64 fields before the block table: token, position, seed, top_k, temperature bits,
# top_p bits, and src (the row of the previous launch whose drawn token is this row's input, -1:
# the token field is the input).
_HEADER = 7


def _f32_bits(x: float) -> int:
    """The IEEE bits of float32(x) as a signed int32 (x is already representable in float32)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


_ONE_BITS = _f32_bits(1.0)
_PAD_HEADER = (0, 0, 0, 0, _ONE_BITS, _ONE_BITS, -1)   # padding: token 0 at position 0, temperature 1


@dataclass(frozen=True)
class SamplingRow:
    """One sample's sampling parameters, built once per sample: the one place a request's
    SamplingOptions become the tensors :func:`~zerokl.kernels.sampling.sample` reads, eagerly
    (:meth:`params`) or packed into the runner's int64 row header (:attr:`packed`, :meth:`unpack`)."""

    temperature: float       # float32 value (0 = greedy)
    top_k: int
    top_p: float             # float32 value
    seed: int                # the sample's own RNG key (engine.sample_seed)

    @staticmethod
    def of(options: SamplingOptions, seed: int) -> "SamplingRow":
        # torch's float32 conversion raises on overflow (a temperature float32 cannot hold): a
        # request error, its own.
        t = torch.full((), float(options.temperature), dtype=torch.float32).item()
        p = torch.full((), float(options.top_p), dtype=torch.float32).item()
        return SamplingRow(t, int(options.top_k), p, int(seed))

    def params(self, positions: Sequence[int], device: torch.device | str) -> SamplingParams:
        """The row's parameters for one row per position in ``positions`` (the absolute position of the
        token each row draws or scores): tensors [len(positions)] on ``device``."""
        rows = len(positions)
        return SamplingParams(
            temperature=torch.full((rows,), self.temperature, dtype=torch.float32, device=device),
            top_k=torch.full((rows,), self.top_k, dtype=torch.int64, device=device),
            top_p=torch.full((rows,), self.top_p, dtype=torch.float32, device=device),
            seed=torch.full((rows,), self.seed, dtype=torch.int64, device=device),
            position=torch.tensor(list(positions), dtype=torch.int64, device=device),
        )

    @property
    def packed(self) -> tuple[int, int, int, int]:
        """(seed, top_k, temperature bits, top_p bits): the row's header fields 2..5."""
        return (self.seed, self.top_k, _f32_bits(self.temperature), _f32_bits(self.top_p))

    @staticmethod
    def unpack(packed: torch.Tensor, position: torch.Tensor) -> SamplingParams:
        """:attr:`packed` rows [rows, 4] int64 back to parameters, on the device (reads nothing on the host)."""
        return SamplingParams(
            temperature=packed[:, 2].to(torch.int32).view(torch.float32),
            top_k=packed[:, 1].contiguous(),
            top_p=packed[:, 3].to(torch.int32).view(torch.float32),
            seed=packed[:, 0].contiguous(),
            position=position,
        )

    @property
    def filters(self) -> tuple[bool, bool]:
        """(uses top-k or top-p, uses top-p)."""
        return (self.top_k > 0 or self.top_p < 1.0, self.top_p < 1.0)


class DecodeSeq(Protocol):
    """What the runner reads of a decoding sequence (the scheduler's Sample)."""

    blocks: list[int]            # its block table: appended to or replaced, never edited in place
    sampling_row: SamplingRow


@dataclass
class DecodeBatch:
    """One decode step's rows as columns: row i is ``seqs[i]``'s token ``tokens[i]`` at
    ``positions[i]``; where ``src[i] >= 0`` the token is instead the one row ``src[i]`` of the
    previous launch drew, read on the device (overlapped decode: that launch is not read back yet)."""

    seqs: Sequence[DecodeSeq]
    tokens: list[int]
    positions: list[int]
    src: list[int] | None = None


@dataclass
class DecodeLaunch:
    """A launched decode step: :meth:`ModelRunner.collect` reads its results."""

    n: int                                   # real rows
    out: np.ndarray                          # [3, bucket] int64 view of pinned host memory: tokens, logprob bits, ok
    done: "torch.cuda.Event | None"          # recorded after the device->host copy (CUDA)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Graph batch sizes: powers of two below max_num_seqs, then max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max(1, max_num_seqs)]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    out: torch.Tensor        # [3, bucket] int64: tokens, logprob bits, ok


class ModelRunner:
    """Owns the KV cache and runs forwards and draws for the engine (see the module docstring)."""

    def __init__(self, model: Model, config: EngineConfig, device: torch.device, max_model_len: int,
                 device_decode: bool | None = None):
        """``device_decode``: use the decode path (default: on CUDA; tests force it on CPU, where
        it runs eagerly, to check it against the general path)."""
        self.model, self.config, self.device = model, config, device
        mc, bs = model.config, config.block_size
        self.block_size = bs
        # One block past the pool: the scratch block padded decode rows read and write.
        self.scratch_block = config.num_blocks
        self.cache = KVCache.allocate(mc, config.num_blocks + 1, bs, model.dtype, device)
        self.max_blocks = -(-max_model_len // bs)
        self.buckets = batch_buckets(config.max_num_seqs)
        cuda = device.type == "cuda"
        self.device_decode = cuda if device_decode is None else device_decode
        self.use_graphs = cuda and self.device_decode and config.cuda_graphs
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self._capturable: dict[str, bool] = {}          # per backend, decided by the first capture's sync probe
        if self.device_decode:
            top = self.buckets[-1]
            n = top * (_HEADER + self.max_blocks)
            # Two pinned staging buffers and two pinned result buffers, used in turn: step N+1 is
            # staged while step N's copies may still be in flight (overlapped decode).
            self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
            self._host_np = [h.numpy() for h in self._host]
            self._dev = torch.zeros(n, dtype=torch.int64, device=device)
            self._out_host = [torch.zeros(3 * top, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
            self._out_np = [o.numpy() for o in self._out_host]
            self._launches: list[DecodeLaunch | None] = [None, None]
            self._flip = 0
            # The tokens the last decode step drew, [top] on the device, outside any graph's pool:
            # the next step reads its rows' inputs here (src >= 0) before the host has seen them.
            self._drawn = torch.zeros(top, dtype=torch.int64, device=device)
            # Persistent per-sequence rows (vLLM's persistent batch, host side): a sequence keeps a
            # slot while it decodes; its sampling fields are written once and its block table
            # grows by the blocks appended since the last step, instead of being rebuilt.
            slots = 2 * top
            self._tables = np.full((slots, self.max_blocks), self.scratch_block, dtype=np.int64)
            self._params = np.zeros((slots, 4), dtype=np.int64)       # seed, top_k, temperature / top_p bits
            self._filters = np.zeros((slots, 2), dtype=bool)
            self._slot_of: dict[int, int] = {}                       # id(seq) -> slot
            self._slot_seq: list = [None] * slots                    # holds the seq: its id stays unique
            self._slot_blocks: list = [None] * slots                 # the blocks list last copied
            self._slot_len = [0] * slots                              # how many of its entries
            self._free_slots = list(range(slots - 1, -1, -1))

    # ------------------------------------------------------------------ sleep (co-location)

    def release_kv(self) -> None:
        """Drop the KV cache and the decode graphs (they captured its addresses): the engine sleeps."""
        self.cache = None  # type: ignore[assignment]
        self._graphs.clear()
        self._pool = None

    def allocate_kv(self) -> None:
        """A fresh KV cache of the configured size (graphs are captured again at their first use)."""
        mc = self.model.config
        self.cache = KVCache.allocate(mc, self.config.num_blocks + 1, self.block_size, self.model.dtype, self.device)

    # ------------------------------------------------------------------ KV moves (the scheduler's KVMover)

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def import_handoff(self, blocks: list[int], handoff: KVHandoff) -> None:
        slots = self.slots(blocks, 0, handoff.num_tokens)
        self.cache.latent[:, slots] = handoff.latent.to(self.device)
        self.cache.rope[:, slots] = handoff.rope.to(self.device)
        self.cache.index_k[:, slots] = handoff.index_k.to(self.device)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for t in (self.cache.latent, self.cache.rope, self.cache.index_k):
            t[:, dst * bs:(dst + 1) * bs] = t[:, src * bs:(src + 1) * bs]

    def export(self, blocks: list[int], token_ids: tuple[int, ...]) -> KVHandoff:
        slots = self.slots(blocks, 0, len(token_ids))
        # On a GPU the rows go to pinned host memory (DMA, no pageable staging copy), once synchronized.
        host = [_to_host(c[:, slots]) for c in (self.cache.latent, self.cache.rope, self.cache.index_k)]
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return KVHandoff(tuple(token_ids), *host, trusted=True)

    # ------------------------------------------------------------------ the general path

    def forward(self, chunks: list[SequenceChunk], tokens: list[int], rows: list[int]) -> torch.Tensor:
        """Logits [len(rows), V] of the chunks' new tokens (concatenated) at ``rows``; writes their KV."""
        batch = batch_for_chunks(chunks, self.block_size, self.device)
        with torch.no_grad():
            return self.model.forward_tokens(torch.tensor(tokens, dtype=torch.int64, device=self.device), batch,
                                             self.cache, torch.tensor(rows, dtype=torch.int64, device=self.device))

    # ------------------------------------------------------------------ the decode path

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def width(self, need: int) -> int:
        """The key width for a step whose longest row attends ``need`` keys: a power of two (>= 16),
        except that a step whose rows all fit the indexer's top-k keeps a width <= index_topk
        (the dense selection, cheaper than scoring padding)."""
        w = 16
        while w < need:
            w *= 2
        topk = self.model.config.index_topk
        if need <= topk < w:
            w = topk
        return min(w, self.max_blocks * self.block_size)

    def widths(self) -> list[int]:
        """Every key width :meth:`width` can return (the decode graphs' widths): it is constant
        between its breakpoints (powers of two, index_topk), so their neighbours give every value."""
        top, topk = self.max_blocks * self.block_size, self.model.config.index_topk
        needs, w = {1, topk, topk + 1, top}, 16
        while w <= top:
            needs |= {w, w + 1}
            w *= 2
        return sorted({self.width(n) for n in needs if 1 <= n <= top})

    def decode(self, batch: DecodeBatch) -> tuple[list[int], list[float], list[bool]]:
        """Draw the next token of each row: (tokens, logprobs, ok). One H2D copy, one D2H copy."""
        return self.collect(self.launch(batch))

    def launch(self, batch: DecodeBatch) -> DecodeLaunch:
        """Stage and enqueue a decode step; returns without waiting for the device.

        Rows with ``src >= 0`` read their input token from the tokens the previous launch drew
        (on the device). The caller collects every launch, in order, before launching twice more.
        """
        n = len(batch.seqs)
        bucket = self.bucket(n)
        width = self.width(max(batch.positions) + 1)
        buf, self._flip = self._flip, self._flip ^ 1
        previous = self._launches[buf]
        if previous is not None and previous.done is not None:
            previous.done.synchronize()     # its copies out of this buffer pair are over (collected already)
        slots = self._slots(batch.seqs)
        f = self._filters[slots].any(axis=0)
        key = (bucket, width, (bool(f[0]), bool(f[1])))
        self._stage(batch, slots, bucket, width, buf)
        with torch.no_grad():
            out = None
            if self.use_graphs and self._capturable.get(get_backend()) is not False:
                # A graph replays the kernels of the backend it was captured under.
                g = self._graphs.get((*key, get_backend())) or self._capture(key, buf, batch, slots)
                if g is not None:
                    g.graph.replay()
                    out = g.out
            if out is None:
                out = self._decode_step(*key)
        host = self._out_host[buf][: 3 * bucket]
        host.copy_(out.view(-1), non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        launched = self._launches[buf] = DecodeLaunch(n, self._out_np[buf][: 3 * bucket].reshape(3, bucket), done)
        return launched

    def collect(self, launched: DecodeLaunch) -> tuple[list[int], list[float], list[bool]]:
        """Wait for a launched step's results: (tokens, logprobs, ok) of its real rows."""
        if launched.done is not None:
            launched.done.synchronize()          # the step's one wait for the device
        res = launched.out[:, : launched.n]
        lps = res[1].astype(np.int32).view(np.float32)
        return res[0].tolist(), lps.tolist(), (res[2] != 0).tolist()

    def _slots(self, seqs: Sequence[DecodeSeq]) -> np.ndarray:
        """The persistent row of each sequence ([n] int64), its block table brought up to date."""
        if len(self._free_slots) < len(seqs):
            self._reclaim(seqs)
        slot_of, tables = self._slot_of, self._tables
        known_blocks, known_len = self._slot_blocks, self._slot_len
        out = []
        for s in seqs:
            slot = slot_of.get(id(s))
            if slot is None:
                slot = self._assign(s)
            blocks, known = s.blocks, known_len[slot]
            if blocks is not known_blocks[slot] or len(blocks) < known:
                known_blocks[slot], known = blocks, 0            # a new table (admitted again, forked)
            if len(blocks) > known:
                tables[slot, known:len(blocks)] = blocks[known:]
                known_len[slot] = len(blocks)
            out.append(slot)
        return np.array(out, dtype=np.int64)

    def _assign(self, s: DecodeSeq) -> int:
        slot = self._free_slots.pop()
        self._slot_of[id(s)] = slot
        self._slot_seq[slot], self._slot_blocks[slot], self._slot_len[slot] = s, None, 0
        self._params[slot] = s.sampling_row.packed
        self._filters[slot] = s.sampling_row.filters
        return slot

    def release(self, s: DecodeSeq) -> None:
        """``s`` is done: its persistent row (and the reference to it) goes now, not at the next reclaim."""
        slot = self._slot_of.pop(id(s), None) if self.device_decode else None
        if slot is not None:
            self._slot_seq[slot] = self._slot_blocks[slot] = None
            self._free_slots.append(slot)

    def _reclaim(self, keep: Sequence[DecodeSeq]) -> None:
        """Free the slots of every sequence not in ``keep`` (finished, preempted or not decoding
        now: one that comes back gets a fresh slot). At least half the slots come free."""
        ids = {id(s) for s in keep}
        for key, slot in list(self._slot_of.items()):
            if key not in ids:
                del self._slot_of[key]
                self._slot_seq[slot] = self._slot_blocks[slot] = None
                self._free_slots.append(slot)

    def _stage(self, batch: DecodeBatch | None, slots: np.ndarray | None, bucket: int, width: int, buf: int) -> None:
        """Pack the rows (padded to ``bucket``; None: padding only) into pinned buffer ``buf`` and
        copy it to the device: [bucket, _HEADER + width / block_size] int64, numpy over rows."""
        nb = -(-width // self.block_size)
        stride = _HEADER + nb
        size = bucket * stride
        arr = self._host_np[buf][:size].reshape(bucket, stride)
        n = len(batch.seqs) if batch is not None else 0
        arr[n:, :_HEADER] = _PAD_HEADER
        arr[n:, _HEADER:] = self.scratch_block
        if n:
            arr[:n, 0] = batch.tokens
            arr[:n, 1] = batch.positions
            arr[:n, 2:6] = self._params[slots]
            arr[:n, 6] = batch.src if batch.src is not None else -1
            # Columns past a row's last block hold stale or scratch blocks: decode_batch masks
            # every column past the row's position to -1.
            arr[:n, _HEADER:] = self._tables[slots, :nb]
        self._dev[:size].copy_(self._host[buf][:size], non_blocking=True)

    def _decode_step(self, bucket: int, width: int, filters: tuple[bool, bool]) -> torch.Tensor:
        """The device side of a decode step on the staged buffer: [3, bucket] int64 (tokens,
        logprob float32 bits, ok). Reads no device value on the host (capturable)."""
        stride = _HEADER + -(-width // self.block_size)
        meta = self._dev[: bucket * stride].view(bucket, stride)
        positions, src = meta[:, 1].contiguous(), meta[:, 6]
        # The previous step's draw, handed over on the device (overlapped decode).
        tokens = torch.where(src >= 0, self._drawn[src.clamp(min=0)], meta[:, 0])
        params = SamplingRow.unpack(meta[:, 2:6], positions + 1)
        batch = decode_batch(meta[:, _HEADER:], positions, self.block_size, width)
        logits = self.model.forward_tokens(tokens, batch, self.cache)
        draw = sample(logits.float(), params, filters)
        self._drawn[:bucket].copy_(draw.tokens)
        return torch.stack([draw.tokens, draw.logprobs.view(torch.int32).to(torch.int64), draw.ok.to(torch.int64)])

    def _capture(self, key: tuple, buf: int, batch: DecodeBatch | None = None,
                 slots: np.ndarray | None = None) -> _Graph | None:
        """Capture the decode step of ``key`` (a warm-up run first: kernels compile; while the
        backend is unproven, a second one under sync-debug "error" proves nothing in the step
        reads the device). Warm-up and capture run on padding only (the scratch block) and keep
        the previous step's drawn tokens; then ``batch`` is staged again. Returns None (and
        stops trying) when the step synchronizes."""
        bucket, width, _ = key
        torch.cuda.current_stream(self.device).synchronize()     # the pinned buffer is free to rewrite
        drawn = self._drawn.clone()
        self._stage(None, None, bucket, width, buf)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                self._decode_step(*key)
                if get_backend() not in self._capturable:
                    with sync_checked():
                        self._decode_step(*key)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with no_cyclic_gc(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._decode_step(*key)
        except Exception as err:  # noqa: BLE001 - a step that synchronizes (or any capture failure): run eagerly
            if "CUDA error" in str(err):
                raise                       # the device failed: nobody's fallback
            torch.cuda.current_stream(self.device).wait_stream(stream)
            log.warning("decode steps run without CUDA graphs: capture failed (%s: %s)", type(err).__name__, err)
            self._capturable[get_backend()] = False
            torch.cuda.current_stream(self.device).synchronize()
            self._drawn.copy_(drawn)
            self._stage(batch, slots, bucket, width, buf)
            return None
        self._capturable[get_backend()] = True
        g = self._graphs[(*key, get_backend())] = _Graph(graph, out)
        torch.cuda.current_stream(self.device).synchronize()
        self._drawn.copy_(drawn)
        self._stage(batch, slots, bucket, width, buf)
        return g

    # ------------------------------------------------------------------ warm-up

    def warm_up(self, max_num_batched_tokens: int) -> dict:
        """Compile every kernel shape a server meets and capture every decode graph, before the
        first request: each decode (bucket, key width, filter set) once (captured, or run eagerly
        where graphs are off), and the general path at each power-of-two token count up to
        ``max_num_batched_tokens`` with a dense and a sparse key width, logits for up to
        max_num_seqs rows. Uses free KV blocks (no request holds any yet: their contents are
        rewritten before anything reads them). Returns what it ran."""
        done = {"decode_shapes": 0, "forward_shapes": 0}
        if self.device_decode:
            for bucket in self.buckets:
                for width in self.widths():
                    for filters in ((False, False), (True, False), (True, True)):
                        key = (bucket, width, filters)
                        if self.use_graphs and self._capturable.get(get_backend()) is not False:
                            if (*key, get_backend()) not in self._graphs:
                                self._capture(key, 0)
                        else:
                            self._stage(None, None, bucket, width, 0)
                            with torch.no_grad():
                                self._decode_step(*key)
                        done["decode_shapes"] += 1
            self._drawn.zero_()
        bs, topk = self.block_size, self.model.config.index_topk
        limit = min(self.config.num_blocks, self.max_blocks) * bs
        blocks = tuple(range(min(self.config.num_blocks, self.max_blocks)))
        t = 1
        while True:
            t = min(t, max_num_batched_tokens, limit)
            # Keys from 0 (dense up to index_topk) and past index_topk with a width of 16k + 1.
            sparse_width = min(limit, max(t, topk) + 1)
            for start in sorted({0, sparse_width - t}):
                rows = list(range(max(0, t - self.config.max_num_seqs), t))
                self.forward([SequenceChunk(blocks, start, t)], [0] * t, rows)
                done["forward_shapes"] += 1
            if t >= min(max_num_batched_tokens, limit):
                break
            t *= 2
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return done


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: a pinned copy enqueued on the current stream for a CUDA tensor (synchronize before use)."""
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
