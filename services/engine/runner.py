"""The engine's model runner: the paged KV cache, the forward, sampling, and CUDA graphs for decode.

Two paths, the same bits:

* ``forward`` (every step that holds a prefill chunk, and every step on CPU): the
  attention batch is built on the host from the chunks' block tables
  (paging.batch_for_chunks) and only the rows that need logits reach the lm_head.
* ``decode`` (a step of one new token per running sample, on CUDA): the step's metadata
  -- token, position, sampling parameters and block table of each row -- is packed into
  one pinned host buffer and moved by ONE host->device copy into a persistent device
  buffer; the attention batch is built on the device from it (paging.decode_batch), the
  forward and the draw (tokens, logprobs, ok flags) run on the device, and ONE
  device->host copy brings back the results: the step's only synchronization. The batch
  is padded to a bucket (1, 2, 4, ..., max_num_seqs) and the key width to a power of two,
  and the whole step is captured once per (bucket, width, filters, backend) as a CUDA graph and
  replayed. Padded rows read and write a scratch KV block no sample owns; every op is
  batch-invariant, so they never change a real row's bits, and neither does the key
  width (-1 padding) nor the graph (the same kernels with the same arguments).

A model whose forward still synchronizes (MoE routing before it is made sync-free) is
found by a warm-up run under torch.cuda.set_sync_debug_mode("error"): its decode steps
run the same device-side path eagerly (no graph).
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

import numpy as np
import torch

from zerokl.kernels.backend import get_backend
from zerokl.kernels.sampling import SamplingParams, sample
from zerokl.kernels.model import KVCache, Model
from zerokl.kernels.model.paging import SequenceChunk, batch_for_chunks, decode_batch
from zerokl.services.engine.types import EngineConfig, KVHandoff
from zerokl.vocab import SamplingOptions

__all__ = ["DecodeRow", "ModelRunner", "SamplingRow", "batch_buckets"]

log = logging.getLogger(__name__)

_HEADER = 6            # per-row int64 fields before the block table: token, position, seed, top_k, temperature, top_p


def _f32_bits(x: float) -> int:
    """The IEEE bits of float32(x) as a signed int32 (x is already representable in float32)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


_ONE_BITS = _f32_bits(1.0)


@dataclass(frozen=True)
class SamplingRow:
    """One sample's sampling parameters in the form the runner ships (built once per sample)."""

    temperature: float       # float32 value (0 = greedy)
    top_k: int
    top_p: float             # float32 value
    seed: int                # the sample's own RNG key (engine.sample_seed)

    @staticmethod
    def of(options: SamplingOptions, seed: int) -> "SamplingRow":
        # torch's float32 conversion raises on overflow (a temperature float32 cannot hold) with
        # the same error the per-step parameter tensors would raise: a request error, its own.
        t = float(torch.tensor(float(options.temperature), dtype=torch.float32))
        p = float(torch.tensor(float(options.top_p), dtype=torch.float32))
        return SamplingRow(t, int(options.top_k), p, int(seed))

    @property
    def filters(self) -> tuple[bool, bool]:
        """(uses top-k or top-p, uses top-p)."""
        return (self.top_k > 0 or self.top_p < 1.0, self.top_p < 1.0)


@dataclass(frozen=True)
class DecodeRow:
    """One running sample's decode step: the token at ``position`` goes in, the next is drawn."""

    token: int
    position: int
    blocks: list[int]
    sampling: SamplingRow


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
            n = self.buckets[-1] * (_HEADER + self.max_blocks)
            self._host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
            self._host_np = self._host.numpy()
            self._dev = torch.zeros(n, dtype=torch.int64, device=device)
            self._out_host = torch.zeros(3 * self.buckets[-1], dtype=torch.int64, pin_memory=cuda)
            self._out_np = self._out_host.numpy()
            self._copied = torch.cuda.Event() if cuda else None

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

    def decode(self, rows: list[DecodeRow]) -> tuple[list[int], list[float], list[bool]]:
        """Draw the next token of each row: (tokens, logprobs, ok). One H2D copy, one D2H copy."""
        n = len(rows)
        bucket = self.bucket(n)
        width = self.width(max(r.position for r in rows) + 1)
        filters = (any(r.sampling.filters[0] for r in rows), any(r.sampling.filters[1] for r in rows))
        self._stage(rows, bucket, width)
        key = (bucket, width, filters)
        with torch.no_grad():
            if self.use_graphs and self._capturable.get(get_backend()) is not False:
                # A graph replays the kernels of the backend it was captured under.
                g = self._graphs.get((*key, get_backend())) or self._capture(key, rows)
                if g is not None:
                    g.graph.replay()
                    out = g.out
                else:
                    out = self._decode_step(*key)
            else:
                out = self._decode_step(*key)
        host = self._out_host[: 3 * bucket]
        host.copy_(out.view(-1), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._copied.synchronize()          # the step's one wait for the device
        res = self._out_np[: 3 * bucket].reshape(3, bucket)[:, :n]
        lps = res[1].astype(np.int32).view(np.float32)
        return res[0].tolist(), lps.tolist(), (res[2] != 0).tolist()

    def _stage(self, rows: list[DecodeRow], bucket: int, width: int) -> None:
        """Pack the rows (padded to ``bucket``) into the pinned buffer and copy it to the device."""
        nb = -(-width // self.block_size)
        stride = _HEADER + nb
        size = bucket * stride
        arr = self._host_np[:size].reshape(bucket, stride)
        arr[:, :_HEADER] = (0, 0, 0, 0, _ONE_BITS, _ONE_BITS)   # padding: token 0 at position 0, temperature 1
        arr[:, _HEADER:] = self.scratch_block
        if rows:
            arr[: len(rows), :_HEADER] = [(r.token, r.position, r.sampling.seed, r.sampling.top_k,
                                           _f32_bits(r.sampling.temperature), _f32_bits(r.sampling.top_p))
                                          for r in rows]
        for i, r in enumerate(rows):
            blocks = r.blocks[:nb]
            arr[i, _HEADER:_HEADER + len(blocks)] = blocks
        self._dev[:size].copy_(self._host[:size], non_blocking=True)

    def _decode_step(self, bucket: int, width: int, filters: tuple[bool, bool]) -> torch.Tensor:
        """The device side of a decode step on the staged buffer: [3, bucket] int64 (tokens,
        logprob float32 bits, ok). Reads no device value on the host (capturable)."""
        stride = _HEADER + -(-width // self.block_size)
        meta = self._dev[: bucket * stride].view(bucket, stride)
        tokens, positions = meta[:, 0].contiguous(), meta[:, 1].contiguous()
        params = SamplingParams(
            temperature=meta[:, 4].to(torch.int32).view(torch.float32),
            top_k=meta[:, 3].contiguous(),
            top_p=meta[:, 5].to(torch.int32).view(torch.float32),
            seed=meta[:, 2].contiguous(),
            position=positions + 1,
        )
        batch = decode_batch(meta[:, _HEADER:], positions, self.block_size, width)
        logits = self.model.forward_tokens(tokens, batch, self.cache)
        draw = sample(logits.float(), params, filters)
        return torch.stack([draw.tokens, draw.logprobs.view(torch.int32).to(torch.int64), draw.ok.to(torch.int64)])

    def _capture(self, key: tuple, rows: list[DecodeRow]) -> _Graph | None:
        """Capture the decode step of ``key`` (warm-up first: kernels compile, and the second
        warm-up runs under sync-debug "error" to prove nothing in the step reads the device).
        Warm-ups and capture run on padding only (the scratch block), then the real rows are
        staged again. Returns None (and stops trying) when the step synchronizes."""
        bucket, width, _ = key
        torch.cuda.current_stream(self.device).synchronize()     # the pinned buffer is free to rewrite
        self._stage([], bucket, width)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                self._decode_step(*key)
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self._decode_step(*key)
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._decode_step(*key)
        except Exception as err:  # noqa: BLE001 - a step that synchronizes (or any capture failure): run eagerly
            if "CUDA error" in str(err):
                raise                       # the device failed: nobody's fallback
            torch.cuda.current_stream(self.device).wait_stream(stream)
            log.warning("decode steps run without CUDA graphs: capture failed (%s: %s)", type(err).__name__, err)
            self._capturable[get_backend()] = False
            torch.cuda.current_stream(self.device).synchronize()
            self._stage(rows, bucket, width)
            return None
        self._capturable[get_backend()] = True
        g = self._graphs[(*key, get_backend())] = _Graph(graph, out)
        torch.cuda.current_stream(self.device).synchronize()
        self._stage(rows, bucket, width)
        return g


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: a pinned copy enqueued on the current stream for a CUDA tensor (synchronize before use)."""
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
