"""The batch-invariant inference engine: continuous batching over a paged KV cache.

Three parts, the vLLM / nano-vllm way: the Scheduler (scheduler.py, pure Python: queues,
blocks, admission, preemption) decides what runs, the ModelRunner (runner.py: KV cache,
forward, sampling, CUDA graphs for decode steps) runs it, and this Engine is the facade
the services drive (requests, outputs, failure isolation).

Every step the scheduler takes one token from each running sample and fills the
rest of a token budget with prefill chunks of waiting requests (FCFS), runs ONE
model forward over all of them, and samples. Requests join and leave at every step;
full prompt blocks are shared through the prefix cache; when blocks run out the
newest running sample is preempted and later recomputed. None of this changes a
bit of any request's output: the model's three-path parity makes the logits of a
token independent of chunking, cache hits and neighbours, and sampling is keyed by
(seed, sample, position), never by batch slot.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import logging
import math
import struct
from typing import Callable, Sequence, TypeVar

import torch

from zerokl.kernels.sampling import SamplingParams, sample, sampling_logprobs
from zerokl.kernels.model import Model
from zerokl.kernels.model.paging import SequenceChunk
from zerokl.tokenizer import Tokenizer
from zerokl.services.engine.blocks import prefix_cache_seed
from zerokl.services.engine.runner import DecodeBatch, DecodeLaunch, ModelRunner, SamplingRow
from zerokl.services.engine.scheduler import Sample as _Sample
from zerokl.services.engine.scheduler import SampleState as _State
from zerokl.services.engine.scheduler import Scheduler
from zerokl.services.engine.types import EngineConfig, GenerateRequest, KVHandoff, OwnedWeights, SampleOutput

__all__ = ["Engine", "RequestError", "WeightsCorrupted", "device_failed", "sample_seed"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestError(ValueError):
    """A request the engine cannot serve (bad ids, too long, ...): the message says why."""


class WeightsCorrupted(RuntimeError):
    """Loading weights failed midway: the model holds parts of two versions and must not serve
    until a later load succeeds."""


def device_failed(err: BaseException) -> bool:
    """Whether ``err`` is the device's failure, not one request's: a CUDA error (sticky: the
    context is lost and every later call fails), never attributed to the request that met it."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(err, accelerator_error)) or "CUDA error" in str(err)


def sample_seed(seed: int, index: int) -> int:
    """The RNG key of sample `index` of a request (an int64): sample 0 uses the request's seed itself.

    A uint64 seed of 2**63 or more is keyed by the int64 with the same 64 bits: the noise hashes the
    bit pattern (kernels.sampling.uniform_noise), so every uint64 seed draws its own numbers.
    """
    if index == 0:
        return seed - 2**64 if seed >= 2**63 else seed
    digest = hashlib.sha256(struct.pack("<QQ", seed, index)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclasses.dataclass
class _InFlight:
    """A launched decode step (overlapped decode): its samples in row order and the runner's handle."""

    seqs: list[_Sample]
    launched: DecodeLaunch


class Engine:
    """Synchronous core: `add_request`, `abort`, `step()`; the async server drives it."""

    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), tokenizer: Tokenizer | None = None,
                 device: torch.device | str | None = None):
        self.model, self.config, self.tokenizer = model.eval(), config, tokenizer
        self.device = torch.device(device) if device else model.embed_tokens.weight.device
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if self.max_model_len > config.num_blocks * config.block_size:
            self.max_model_len = config.num_blocks * config.block_size
        self._numerics_fingerprint = ""
        self._by_request: dict[str, list[_Sample]] = {}
        self._ready: list[SampleOutput] = []     # outputs decided outside a forward (emitted next step)
        self._failed: list[SampleOutput] = []    # "error" outputs of requests that failed in this step
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "cached_tokens": 0}
        cuda = self.device.type == "cuda"
        self.runner = ModelRunner(self.model, config, self.device, self.max_model_len,
                                  device_decode=True if config.overlap_decode else None)
        self.scheduler = Scheduler(config, self.runner, self._fail, self.stats)
        self.overlap = (cuda if config.overlap_decode is None else config.overlap_decode)
        self._inflight: _InFlight | None = None   # the launched decode step not read back yet (overlap)
        self._sleep_level = 0                     # 0 awake; 1 the KV cache released; 2 the weights too (sleep)
        self._released: list[tuple[torch.UntypedStorage, int]] = []   # the weights' storages and their sizes
        if config.warm_up:
            self.warm_up_stats = self.runner.warm_up(config.max_num_batched_tokens)

    # The scheduler's and runner's state, under the names the services and tests use.
    @property
    def cache(self):
        return self.runner.cache

    @property
    def blocks(self):
        return self.scheduler.blocks

    @property
    def waiting(self) -> list[_Sample]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[_Sample]:
        return self.scheduler.running

    # ------------------------------------------------------------------ requests

    def validate(self, request: GenerateRequest) -> None:
        """Raise RequestError with a clear message for input the engine cannot serve."""
        vocab = self.model.config.vocab_size
        ids = request.prompt_ids
        if not request.request_id:
            raise RequestError("request_id is empty")
        if request.request_id in self._by_request:
            raise RequestError(f"request_id {request.request_id!r} is already in flight")
        if not ids:
            raise RequestError("prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        try:
            request.options.validate(vocab)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if request.options.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if len(ids) > self.max_model_len or (request.mode == "generate" and len(ids) >= self.max_model_len):
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len}")
        if request.mode not in ("generate", "score", "prefill"):
            raise RequestError(f"unknown mode {request.mode!r}")
        if request.handoff is not None:
            h = request.handoff
            if h.first_token_ids or h.first_logprobs:
                self._validate_first_tokens(request)
            elif tuple(h.prompt_ids) != tuple(ids[: h.num_tokens]) or h.num_tokens >= len(ids):
                raise RequestError("KV handoff does not match the prompt (without first tokens it must cover "
                                   "a strict prefix)")
            c = self.model.config
            want = [(c.num_hidden_layers, h.num_tokens, c.kv_lora_rank), (c.num_hidden_layers, h.num_tokens, c.qk_rope_head_dim),
                    (c.num_hidden_layers, h.num_tokens, c.index_head_dim)]
            if [tuple(t.shape) for t in (h.latent, h.rope, h.index_k)] != want or h.latent.dtype != self.model.dtype:
                raise RequestError("KV handoff shapes or dtype do not match this model")

    def _validate_first_tokens(self, request: GenerateRequest) -> None:
        """A handoff carrying first tokens: the KV of the whole prompt and one finite draw per sample."""
        h, n = request.handoff, request.options.n
        assert h is not None
        if request.mode != "generate":
            raise RequestError(f"a KV handoff with first tokens is for generating, not mode {request.mode!r}")
        if tuple(h.prompt_ids) != tuple(request.prompt_ids) or h.num_tokens != len(request.prompt_ids):
            raise RequestError("KV handoff does not match the prompt (with first tokens it must cover all of it)")
        if request.options.prompt_logprobs:
            raise RequestError("a KV handoff with first tokens has no prompt logits here: its prompt logprobs "
                               "come from the prefill replica")
        if len(h.first_token_ids) != n or len(h.first_logprobs) != n:
            raise RequestError(f"KV handoff carries {len(h.first_token_ids)} first tokens and "
                               f"{len(h.first_logprobs)} logprobs for n={n} samples")
        vocab = self.model.config.vocab_size
        bad = next((t for t in h.first_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"KV handoff first token id {bad} is outside the vocabulary [0, {vocab})")
        if not all(math.isfinite(lp) for lp in h.first_logprobs):
            raise RequestError("KV handoff first-token logprobs must be finite")

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request (validated first; raises RequestError; RuntimeError while asleep)."""
        if self._sleep_level:
            raise RuntimeError("the engine is asleep: wake it before adding requests")
        self.validate(request)
        first = _Sample(request, 0, list(request.prompt_ids), self.scheduler.next_arrival(),
                        max_len=min(len(request.prompt_ids) + request.options.max_tokens, self.max_model_len))
        self._by_request[request.request_id] = [first]
        self.stats["prompt_tokens"] += len(request.prompt_ids)
        self.waiting.append(first)

    def abort(self, request_id: str) -> list[SampleOutput]:
        """Stop a request; returns a final 'abort' output for each of its live samples."""
        out = []
        for s in self._by_request.pop(request_id, []):
            if s.state is not _State.FINISHED:
                self._free(s)
                out.append(self._output(s, [], [], "abort"))
        return out

    def has_work(self) -> bool:
        """Whether a step has anything to do (requests, outputs to emit, a launched step to read)."""
        return bool(self.waiting or self.running or self._ready or self._inflight is not None)

    def set_cache_identity(self, weights_version: str, numerics_fingerprint: str) -> None:
        """Name the weights and numerics computing this engine's KV: they seed every prefix-cache key."""
        self._numerics_fingerprint = numerics_fingerprint
        self.scheduler.cache_seed = prefix_cache_seed(weights_version, numerics_fingerprint)

    def load_weights(self, state_dict: dict[str, torch.Tensor], weights_version: str = "") -> None:
        """Replace the model's weights in place (same config); only between requests.

        Every cached prefix is forgotten: its KV was computed with the old weights;
        new keys are seeded with ``weights_version``. An engine asleep at level 2 takes an
        :class:`OwnedWeights` dict's tensors as they are, else gets its weights' memory back and
        copies; either way it stays asleep at level 1 (:meth:`wake` then allocates the
        KV cache, once the caller dropped ``state_dict``: the two never hold memory together).
        Raises RuntimeError while requests are in the engine and ValueError for
        missing, unexpected or misshapen tensors (nothing is changed then);
        WeightsCorrupted when a copy fails after others were made.
        """
        if self.has_work():
            raise RuntimeError("load_weights with requests in the engine")
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        wrong = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
        if missing or unexpected or wrong:
            raise ValueError(f"weights do not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                             f"wrong shape {wrong[:3]}")
        name = ""
        if self._sleep_level == 2 and self._adopt(state_dict):
            self._released, self._sleep_level = [], 1
            self.blocks.reset_prefix_cache()
            self.set_cache_identity(weights_version, self._numerics_fingerprint)
            return
        try:
            if self._sleep_level == 2:
                # The weights' memory comes back (its bytes are garbage until the copies below land).
                for storage, nbytes in self._released:
                    storage.resize_(nbytes)
                self._released, self._sleep_level = [], 1
            with torch.no_grad():
                for name, t in own.items():
                    t.copy_(state_dict[name])
        except Exception as err:
            raise WeightsCorrupted(f"loading weights failed at {name!r} after some tensors were replaced "
                                   f"({type(err).__name__}: {err})") from err
        finally:
            self.blocks.reset_prefix_cache()    # whatever is in the model now, the cached KV is not its
        self.set_cache_identity(weights_version, self._numerics_fingerprint)

    # ------------------------------------------------------------------ sleep (co-location)

    @property
    def sleep_level(self) -> int:
        """0: awake; 1: asleep, the KV cache released; 2: asleep, the weights released too."""
        return self._sleep_level

    def sleep(self, level: int) -> int:
        """Release device memory for a co-located trainer (vLLM's sleep mode); only between requests.

        Level 1 drops the KV cache (every cached prefix with it: its KV is gone) and the decode graphs,
        which captured its addresses; level 2 also releases the storage of every weight (shapes and
        dtypes stay: :meth:`load_weights` refills them). Returns the bytes released by this call (0 when
        already asleep at that level). Raises RuntimeError while requests are in the engine, ValueError
        for another level.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: expected 1 (KV cache) or 2 (KV cache and weights)")
        if self.has_work():
            raise RuntimeError("sleep with requests in the engine")
        released = 0
        if self._sleep_level == 0:
            cache = self.runner.cache
            released += sum(t.numel() * t.element_size() for t in (cache.latent, cache.rope, cache.index_k))
            del cache       # this frame must not hold the cache through empty_cache below (it stayed reserved)
            self.blocks.reset_prefix_cache()
            self.runner.release_kv()
            self._sleep_level = 1
        if level == 2 and self._sleep_level == 1:
            # Weights received from another process (shared memory, CUDA IPC) live in storage that cannot be
            # resized: the model lets go of it instead (its memory goes with the last reference), each such
            # tensor on a fresh empty storage of its own that load_weights refills.
            detached = self._detach_shared_weights()
            storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
            for t in self.model.state_dict().values():
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in storages:
                    storages[storage.data_ptr()] = (storage, storage.nbytes())
            for storage, _ in storages.values():
                storage.resize_(0)
            self._released = [*storages.values(), *detached]
            released += sum(n for _, n in self._released)
            self._sleep_level = 2
        if self.device.type == "cuda":
            # Nothing released may be referenced here (a local holding the KV cache kept it reserved: an H100 gave back
            # 4 of 20 MB until bb83f28, tools/bench/sleep_probe.py; since, reserved falls from 52 to 8 MB). The
            # dropped decode graphs hold their private memory pool until they are freed, and a CUDAGraph may sit in
            # reference cycles that only the cyclic collector breaks.
            gc.collect()
            torch.cuda.empty_cache()        # back to the driver: another process (the trainer) allocates it
        return released

    def _weight_slots(self):  # noqa: ANN202 - Iterator[tuple[str, dict, str]]
        """(state-dict name, the module's _parameters or _buffers dict, key) of every weight: where a weight's
        tensor can be replaced (a tied weight appears under each of its names)."""
        for module_name, module in self.model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for group in (module._parameters, module._buffers):
                for key, t in group.items():
                    if t is not None:
                        yield prefix + key, group, key

    @staticmethod
    def _set_slot(group: dict, key: str, tensor: torch.Tensor) -> None:
        if isinstance(group[key], torch.nn.Parameter):
            group[key].data = tensor
            # A data swap keeps the Parameter's version counter, which caches of what a weight holds read
            # (zerokl.kernels.portable's slices): bumped, they recompute instead of serving the old weights.
            torch.autograd.graph.increment_version(group[key])
        else:
            group[key] = tensor

    @torch.no_grad()
    def _detach_shared_weights(self) -> list[tuple[torch.UntypedStorage, int]]:
        """Every weight whose storage cannot be resized (received from another process) moved onto a fresh
        empty storage of its own, same shape and strides; each new storage with the bytes it will need."""
        out: list[tuple[torch.UntypedStorage, int]] = []
        for _, group, key in self._weight_slots():
            t = group[key]
            if t.untyped_storage().resizable():
                continue
            storage = torch.UntypedStorage(0, device=t.device)
            fresh = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
            self._set_slot(group, key, fresh)
            out.append((storage, extent * t.element_size()))
        return out

    def _adopt(self, state_dict: dict[str, torch.Tensor]) -> bool:
        """Take an :class:`OwnedWeights` state dict's tensors as the model's weights (no copy); False (nothing
        changed) for any other dict or when a tensor's dtype, device or layout differs from the model's."""
        if not isinstance(state_dict, OwnedWeights):
            return False
        own = self.model.state_dict()
        if any(t.dtype != own[k].dtype or t.device != own[k].device or not t.is_contiguous()
               for k, t in state_dict.items()):
            return False
        with torch.no_grad():
            for name, group, key in self._weight_slots():
                if name in state_dict:
                    self._set_slot(group, key, state_dict[name])
        return True

    def wake(self) -> None:
        """Serve again: a fresh KV cache. An engine whose weights were released (level 2) wakes only
        after :meth:`load_weights` refilled them (RuntimeError otherwise). A no-op when awake."""
        if self._sleep_level == 2:
            raise RuntimeError("the engine's weights were released (sleep level 2): load weights to wake it")
        if self._sleep_level == 1:
            self.runner.allocate_kv()
            self._sleep_level = 0

    def probe(self) -> None:
        """Raise if the device cannot compute (a lost CUDA context fails every call, this one too)."""
        x = torch.ones(8, device=self.device)
        float((x * x).sum())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return self.blocks.usage()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[SampleOutput]:
        """Schedule, run one forward over every scheduled token, sample. Returns the deltas.

        With overlapped decode a decode-only step is launched and the step before it is read
        back while it runs: the deltas returned are the previous step's, and the scheduler
        runs one step behind on stop conditions (a sample that finished in step N has its
        step-N+1 token dropped; see :meth:`_launch`). Any other step first reads back the
        launched one, then runs as without overlap. Either way the same tokens and logprobs.

        A request whose work raises fails alone: it gets one final output per live
        sample with ``finish_reason`` "error" and the exception in ``error``, its
        blocks are freed, and every other request steps on with its usual bits
        (see :meth:`_isolating`).
        """
        ready, self._ready = self._ready, []
        work = self.scheduler.schedule()
        # Whole prompts handed off with their first tokens compute nothing: they reach their sampling
        # point after the forward (a fork there may preempt newer samples), and the others' step keeps
        # its path (a decode-only step stays on the runner's decode path).
        handed = [(s, n) for s, n in work if n == 0]
        work = [(s, n) for s, n in work if n > 0]
        decode_path = bool(work) and self._decode_only(work)
        if decode_path and self.overlap and not handed:
            try:
                launched = self._launch(work)
            except Exception as err:  # noqa: BLE001 - the general path below isolates the request at fault
                if device_failed(err):
                    raise
                log.warning("a decode step failed to launch (%s: %s); running it on the general path",
                            type(err).__name__, err)
                decode_path = False
            else:
                previous, self._inflight = self._inflight, launched
                ready += self._read_back(previous)     # step N's results while step N+1 runs
                failed, self._failed = self._failed, []
                return ready + failed
        # Nothing stays in flight past here: the general path needs every token on the host.
        previous, self._inflight = self._inflight, None
        ready += self._read_back(previous)
        work = [(s, n) for s, n in work if s.state is not _State.FINISHED]
        handed = [(s, n) for s, n in handed if s.state is not _State.FINISHED]
        if work and decode_path and self._decode_only(work):
            try:
                ready += self._decode(work)
                work = []
            except Exception as err:  # noqa: BLE001 - the general path below isolates the request at fault
                if device_failed(err):
                    raise
                log.warning("a decode step failed (%s: %s); retrying it on the general path", type(err).__name__, err)
        if work:
            logits_of = self._isolating(work, self._forward, lambda item: item[0])
            work = [(s, n) for s, n in work if s.state is not _State.FINISHED]
            for s, n in work:
                self.scheduler.computed(s, n)
            self._prompt_logprobs(work, logits_of)
            ready += self._sample_and_finish(work, logits_of)
        if handed:
            for s, _ in handed:
                self.scheduler.computed(s, 0)       # offers the handed-off full blocks to the prefix cache
            ready += self._sample_and_finish(handed, {})
        failed, self._failed = self._failed, []
        return ready + failed

    def _decode_only(self, work: list[tuple[_Sample, int]]) -> bool:
        """Whether the step is one new token per running sample, each drawing its next token
        from its own row (the runner's device-side decode path, graphs on CUDA)."""
        if not self.runner.device_decode or len(work) > self.runner.buckets[-1]:
            return False
        return all(n == 1 and s.state is _State.RUNNING and s.request.mode == "generate" and not s.forked
                   and s.num_computed == len(s.token_ids) - 1 for s, n in work)

    def _decode_rows(self, work: list[tuple[_Sample, int]]) -> list[_Sample]:
        """The samples of a decode step that can run: each gets its runner sampling row once (a
        parameter float32 cannot hold fails its own request)."""
        for s, _ in work:
            if s.sampling_row is None and s.state is not _State.FINISHED:
                try:
                    s.sampling_row = SamplingRow.of(s.opts, sample_seed(s.opts.seed, s.index))
                except Exception as err:  # noqa: BLE001
                    self._fail(s, err)
        return [s for s, _ in work if s.state is not _State.FINISHED]

    def _decode(self, work: list[tuple[_Sample, int]]) -> list[SampleOutput]:
        """A decode step through the runner, waited for: one forward and draw, one copy each way."""
        seqs = self._decode_rows(work)
        if not seqs:
            return []
        batch = DecodeBatch(seqs, [s.token_ids[-1] for s in seqs], [s.num_computed for s in seqs])
        return self._accept_decoded(seqs, *self.runner.decode(batch))

    def _launch(self, work: list[tuple[_Sample, int]]) -> "_InFlight | None":
        """Launch a decode step without waiting for it (overlapped decode).

        A sample with a pending token (drawn by the launched step the host has not read yet)
        decodes the token after it: its input is that step's draw, read on the device
        (``src``), at position num_computed + 1. Its stop conditions are checked when the
        pending token is read (:meth:`_read_back`, right after this launch): a sample that
        finished there (stop id or string, eos, abort, failure) has its token from this step
        dropped, and its KV row here lands in a block it no longer owns, before any later
        step (stream order) reuses that block. A sample whose pending token is its last by
        length is not scheduled at all (Scheduler.schedule).
        """
        seqs = self._decode_rows(work)
        if not seqs:
            return None
        src = [s.pending_row if s.num_pending else -1 for s in seqs]
        positions = [s.num_computed + s.num_pending for s in seqs]
        launched = self.runner.launch(DecodeBatch(seqs, [s.token_ids[-1] for s in seqs], positions, src))
        for i, s in enumerate(seqs):
            s.num_pending += 1
            s.pending_row = i
        return _InFlight(seqs, launched)

    def _read_back(self, inflight: "_InFlight | None") -> list[SampleOutput]:
        """Wait for a launched decode step and take its tokens (in row order, as a synchronous
        step would): a sample finished since (aborted, failed, stopped) drops its token; one
        preempted since keeps it (its KV is recomputed with the same bits)."""
        if inflight is None:
            return []
        tokens, lps, ok = self.runner.collect(inflight.launched)
        for s in inflight.seqs:
            s.num_pending -= 1
        return self._accept_decoded(inflight.seqs, tokens, lps, ok)

    def _accept_decoded(self, seqs: list[_Sample], tokens: list[int], lps: list[float],
                        ok: list[bool]) -> list[SampleOutput]:
        out: list[SampleOutput] = []
        computed = self.scheduler.computed
        for s, tok, lp, good in zip(seqs, tokens, lps, ok):
            if s.state is _State.FINISHED:
                continue
            if s.state is _State.RUNNING:
                computed(s, 1)
            if not good:
                self._fail(s, ValueError("the logits have no sampling distribution (NaN or +inf, or none finite)"))
                continue
            self._accept(s, tok, lp, out)
        return out

    def _forward(self, work: list[tuple[_Sample, int]]) -> dict[tuple[int, int], torch.Tensor]:
        """One model forward over ``work``'s tokens: the logits rows it needs, by (sample, position).

        It writes the KV of exactly these tokens, into slots no committed token uses,
        so running it again (on a subset, see :meth:`_isolating`) rewrites the same bits.
        """
        chunks = [SequenceChunk(tuple(s.blocks), s.num_computed, n) for s, n in work]
        tokens: list[int] = []
        rows: list[int] = []                          # rows of the step's tokens that need logits
        row_owner: list[tuple[_Sample, int]] = []     # (sample, position) of each
        at = 0
        for s, n in work:
            start, end = s.num_computed, s.num_computed + n
            tokens.extend(s.token_ids[start:end])
            stop = start
            if s.opts.prompt_logprobs or s.request.mode == "score":
                stop = max(start, min(end, s.num_prompt - 1))      # prompt positions with a next token
                rows.extend(range(at, at + stop - start))
                row_owner.extend((s, p) for p in range(start, stop))
            if end == s.target and end - 1 >= stop and s.request.mode in ("generate", "prefill"):
                rows.append(at + n - 1)                # the sampling point
                row_owner.append((s, end - 1))
            at += n
        logits = self.runner.forward(chunks, tokens, rows)
        return {(id(s), pos): logits[i] for i, (s, pos) in enumerate(row_owner)}

    def _isolating(self, items: list[T], run: Callable[[list[T]], dict], owner: Callable[[T], _Sample]) -> dict:
        """``run(items)``; when it raises, the requests at fault fail and the others' results stand.

        Why bisect instead of failing the batch: every op is batch-invariant, so an
        item computed in a smaller batch gets exactly the bits it gets in the full one.
        Re-running halves of the batch is therefore invisible to the innocent requests;
        halving until a failing run holds one item names the culprit (its request fails
        with that exception) at O(k log n) extra runs for k culprits, paid only when a
        run failed. A failure no single item reproduces (both halves succeed) fails
        nobody: the halves' results are the full run's bits. ``run`` must not change
        engine state beyond what re-running it overwrites (see :meth:`_forward`).
        """
        items = [i for i in items if owner(i).state is not _State.FINISHED]
        if not items:
            return {}
        try:
            return run(items)
        except Exception as err:  # noqa: BLE001 - attributed below, never swallowed
            if device_failed(err):
                raise
            if len(items) == 1:
                self._fail(owner(items[0]), err)
                return {}
            log.warning("a batch of %d failed (%s: %s); isolating the request at fault", len(items),
                        type(err).__name__, err)
        mid = len(items) // 2
        out = self._isolating(items[:mid], run, owner)
        out.update(self._isolating(items[mid:], run, owner))
        return out

    def _fail(self, s: _Sample, err: BaseException) -> None:
        """End ``s``'s request with an "error" output per live sample (emitted by this step).

        A device failure is nobody's request: it is raised again, out of the step.
        """
        if device_failed(err):
            raise err
        rid = s.request.request_id
        log.error("request %s failed in the engine: %s: %s", rid, type(err).__name__, err,
                  exc_info=(type(err), err, err.__traceback__))
        message = f"{type(err).__name__}: {err}"
        for q in self._by_request.pop(rid, [s]):
            if q.state is not _State.FINISHED:
                self._free(q)
                out = self._output(q, [], [], "error")
                out.error = message
                self._failed.append(out)

    # ------------------------------------------------------------------ sampling and outputs

    def _prompt_logprobs(self, work, logits_of) -> None:
        for s, _ in work:
            if not (s.opts.prompt_logprobs or s.request.mode == "score") or s.sent_prompt_logprobs:
                continue
            done = min(s.num_computed, s.num_prompt - 1)
            positions = [p for p in range(len(s.prompt_logprobs), done) if (id(s), p) in logits_of]
            if positions:
                try:        # one request's rows, computed apart: a failure here is that request's alone
                    logits = torch.stack([logits_of[(id(s), p)] for p in positions])
                    nxt = torch.tensor([s.token_ids[p + 1] for p in positions], device=self.device)
                    lp = sampling_logprobs(logits, nxt, self._params(s, positions))
                except Exception as err:  # noqa: BLE001
                    self._fail(s, err)
                    continue
                s.prompt_logprobs.extend(lp.tolist())

    def _params(self, s: _Sample, positions: Sequence[int], index: int | None = None) -> SamplingParams:
        """``s``'s request's parameters for one row per position, keyed by sample ``index`` (``s``'s own by
        default; a prefill request's one sample draws the first token of each of its n)."""
        row = SamplingRow.of(s.opts, sample_seed(s.opts.seed, s.index if index is None else index))
        return row.params(positions, self.device)

    def _sample_and_finish(self, work, logits_of) -> list[SampleOutput]:
        out: list[SampleOutput] = []
        # (sample, index of the sample whose key draws, logits row, parameters)
        to_sample: list[tuple[_Sample, int, torch.Tensor, SamplingParams]] = []
        given: list[_Sample] = []           # first tokens that came with a handoff of the whole prompt
        prefilled: list[_Sample] = []       # prefill requests: every sample's first token drawn, then exported
        for s, _ in work:
            if s.state is _State.FINISHED:      # failed earlier in this step
                continue
            try:        # per request: a failure here (a KV export, a fork, its parameters) is its own
                if s.state is _State.WAITING and s.num_computed >= s.target:
                    self.scheduler.start_running(s)
                if s.request.mode == "score" and s.num_computed >= s.target:
                    out.append(self._finish(s, [], [], "stop"))
                elif s.request.mode == "prefill" and s.num_computed >= s.target:
                    # The local sampling point, here: sample i's first token from the last prompt
                    # position's row with sample i's key (seed, i, position len(prompt)), exactly
                    # as a local n > 1 request's forked siblings draw from their parent's row.
                    row = logits_of[(id(s), s.target - 1)]
                    for i in range(s.opts.n):
                        to_sample.append((s, i, row, self._params(s, [s.num_prompt], index=i)))
                    prefilled.append(s)
                elif s.request.mode == "generate" and s.num_computed == len(s.token_ids):
                    h = s.request.handoff
                    takes_given = s.num_output == 0 and h is not None and bool(h.first_token_ids)
                    for q in self._fork(s):     # forked siblings read their parent's row
                        if takes_given:
                            given.append(q)
                            continue
                        row = logits_of[(id(q if not q.forked else self._parent(q)), len(q.token_ids) - 1)]
                        to_sample.append((q, q.index, row, self._params(q, [len(q.token_ids)])))
            except Exception as err:  # noqa: BLE001
                self._fail(s, err)
        # Each sample draws from its own logits row with its own (seed, position) key: sampling is
        # row-wise, so it is isolated like the forward.
        drawn = self._isolating(to_sample, self._draw, lambda item: item[0])
        for s in given:                         # drawn by the prefill replica: accepted like a draw
            if s.state is not _State.FINISHED:
                h = s.request.handoff
                self._accept(s, h.first_token_ids[s.index], h.first_logprobs[s.index], out)
        for s, index, _, _ in to_sample:
            if s.state is _State.FINISHED or s.request.mode == "prefill":
                continue
            tok, lp = drawn[(id(s), index)]
            self._accept(s, tok, lp, out)
        for s in prefilled:
            if s.state is _State.FINISHED:
                continue
            try:
                first = [drawn[(id(s), i)] for i in range(s.opts.n)]
                handoff = dataclasses.replace(self._export(s), first_token_ids=tuple(t for t, _ in first),
                                              first_logprobs=tuple(lp for _, lp in first))
                out.append(self._finish(s, [], [], "stop", handoff=handoff))
            except Exception as err:  # noqa: BLE001
                self._fail(s, err)
        return out

    @staticmethod
    def _draw(to_sample: list[tuple[_Sample, int, torch.Tensor, SamplingParams]]) -> dict[tuple[int, int], tuple[int, float]]:
        """One token for each (sample, index, logits row, parameters): (token, logprob) by (id of the sample, index)."""
        logits = torch.stack([row for _, _, row, _ in to_sample])
        params = SamplingParams(*(torch.cat(parts) for parts in zip(*(dataclasses.astuple(p)
                                                                      for _, _, _, p in to_sample))))
        draw = sample(logits.float(), params)
        if not bool(draw.ok.all()):
            # Raised for the whole draw: the isolating caller bisects it down to the request whose
            # logits have no distribution (NaN or +inf, or none finite) and fails that one alone.
            raise ValueError("the logits have no sampling distribution (NaN or +inf, or none finite)")
        return {(id(s), i): (tok, lp) for (s, i, _, _), tok, lp in zip(to_sample, draw.tokens.tolist(),
                                                                        draw.logprobs.tolist())}

    def _parent(self, s: _Sample) -> _Sample:
        return self._by_request[s.request.request_id][0]

    def _fork(self, s: _Sample) -> list[_Sample]:
        """At the end of the prompt, sample 0 of an n > 1 request forks its siblings.

        Siblings share the full prompt blocks and get a private copy of the partial last
        block (rows copied bit for bit), then draw with their own seeds.
        """
        n = s.opts.n
        if n == 1 or s.num_output > 0 or len(self._by_request.get(s.request.request_id, [])) > 1:
            return [s]
        children = self.scheduler.fork(s, n)
        if children is None:                        # wait: recompute the prompt when memory frees
            return []
        family = [s, *children]
        self._by_request[s.request.request_id] = family
        return family

    def _accept(self, s: _Sample, tok: int, lp: float, out: list[SampleOutput]) -> None:
        """Append a drawn token and its logprob to ``s`` and its output (detokenized, stops
        checked) to ``out``; the decode path and the general path both end here."""
        s.token_ids.append(tok)
        s.output_logprobs.append(lp)
        self.stats["generation_tokens"] += 1
        try:        # detokenizing and stop strings: per request
            out.append(self._after_token(s, tok, lp))
        except Exception as err:  # noqa: BLE001
            self._fail(s, err)

    def _after_token(self, s: _Sample, tok: int, lp: float) -> SampleOutput:
        o, mc = s.opts, self.model.config
        s.forked = False                            # from now on it reads its own logits
        text_delta = ""
        if self.tokenizer is not None:
            # A model's vocabulary may be padded past the tokenizer's: such ids carry no text.
            full = self.tokenizer.decode([t for t in s.token_ids[s.num_prompt:] if t < self.tokenizer.vocab_size])
            text_delta, s.text = full[len(s.text):], full
            hit = [t for t in o.stop if t in s.text]
            if hit:
                cut = min(s.text.find(t) for t in hit)
                text_delta = text_delta[: max(0, len(text_delta) - (len(s.text) - cut))]
                s.text = s.text[:cut]
                return self._finish(s, [tok], [lp], "stop", text=text_delta)
        if (tok == mc.eos_token_id and not o.ignore_eos) or tok in o.stop_token_ids:
            return self._finish(s, [tok], [lp], "stop", text=text_delta)
        if s.num_output >= o.max_tokens or len(s.token_ids) >= self.max_model_len:
            return self._finish(s, [tok], [lp], "length", text=text_delta)
        return self._output(s, [tok], [lp], None, text=text_delta)

    def _finish(self, s: _Sample, toks, lps, reason: str, text: str = "", handoff: KVHandoff | None = None) -> SampleOutput:
        out = self._output(s, toks, lps, reason, text=text)
        out.handoff = handoff
        self._free(s)
        family = self._by_request.get(s.request.request_id, [])
        if all(q.state is _State.FINISHED for q in family):
            self._by_request.pop(s.request.request_id, None)
        return out

    def _free(self, s: _Sample) -> None:
        self.scheduler.free(s)
        self.runner.release(s)

    def _output(self, s: _Sample, toks: list[int], lps: list[float], reason, text: str = "") -> SampleOutput:
        """``s``'s delta; ``toks`` and ``lps`` are fresh lists the output keeps."""
        request = s.request
        out = SampleOutput(request.request_id, s.index, toks, lps, reason is not None, reason, None,
                           len(request.prompt_ids), s.num_cached, text)
        if not s.sent_prompt_logprobs and (request.options.prompt_logprobs or request.mode == "score"):
            out.prompt_logprobs, s.sent_prompt_logprobs = list(s.prompt_logprobs), True
        return out

    def _export(self, s: _Sample) -> KVHandoff:
        return self.runner.export(s.blocks, tuple(s.token_ids[: s.num_prompt]))



def run_to_completion(engine: Engine, requests: Sequence[GenerateRequest],
                      on_step: Callable[[int], None] | None = None) -> dict[str, list[SampleOutput]]:
    """Offline helper: run requests until done, collecting every delta per request id."""
    outs: dict[str, list[SampleOutput]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    step = 0
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
        step += 1
        if on_step:
            on_step(step)
    return outs
