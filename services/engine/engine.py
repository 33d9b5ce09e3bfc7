"""The batch-invariant inference engine: continuous batching over a paged KV cache.

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
import enum
import hashlib
import logging
import struct
from typing import Callable, Sequence

import torch

from zerokl.kernels.sampling import SamplingParams, sample, sampling_logprobs
from zerokl.model import KVCache, Model
from zerokl.model.paging import SequenceChunk, batch_for_chunks
from zerokl.model.tokenizer import Tokenizer
from zerokl.services.engine.blocks import BlockManager, block_hashes, prefix_cache_seed
from zerokl.services.engine.types import EngineConfig, GenerateRequest, KVHandoff, SampleOutput, SamplingOptions

__all__ = ["Engine", "RequestError", "sample_seed"]

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve (bad ids, too long, ...): the message says why."""


def sample_seed(seed: int, index: int) -> int:
    """The RNG key of sample `index` of a request: sample 0 uses the request's seed itself."""
    if index == 0:
        return seed
    digest = hashlib.sha256(struct.pack("<QQ", seed, index)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _State(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclasses.dataclass(eq=False)
class _Sample:
    """One sample (sequence) of a request."""

    request: GenerateRequest
    index: int
    token_ids: list[int]                 # prompt + generated
    arrival: int                         # admission order: preemption takes the newest first
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0                # tokens whose KV is in the cache
    num_cached: int = 0                  # prompt tokens that came from the prefix cache
    state: _State = _State.WAITING
    num_registered: int = 0              # full blocks already offered to the prefix cache
    sent_prompt_logprobs: bool = False
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    forked: bool = False                 # n > 1: sample 0 forks its siblings at the prompt's end

    @property
    def opts(self) -> SamplingOptions:
        return self.request.options

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def target(self) -> int:
        """Tokens to compute before the next sampling point (the prefill mode stops one short)."""
        return self.num_prompt - 1 if self.request.mode == "prefill" else len(self.token_ids)


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
        self.cache = KVCache.allocate(mc, config.num_blocks, config.block_size, model.dtype, self.device)
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._numerics_fingerprint = ""
        self._cache_seed = prefix_cache_seed("", "")   # see set_cache_identity
        self.waiting: list[_Sample] = []
        self.running: list[_Sample] = []
        self._by_request: dict[str, list[_Sample]] = {}
        self._arrivals = 0
        self._ready: list[SampleOutput] = []     # outputs decided outside a forward (emitted next step)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "cached_tokens": 0}

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
            if tuple(h.prompt_ids) != tuple(ids[: h.num_tokens]) or h.num_tokens >= len(ids):
                raise RequestError("KV handoff does not match the prompt (it must cover a strict prefix)")
            c = self.model.config
            want = [(c.num_hidden_layers, h.num_tokens, c.kv_lora_rank), (c.num_hidden_layers, h.num_tokens, c.qk_rope_head_dim),
                    (c.num_hidden_layers, h.num_tokens, c.index_head_dim)]
            if [tuple(t.shape) for t in (h.latent, h.rope, h.index_k)] != want or h.latent.dtype != self.model.dtype:
                raise RequestError("KV handoff shapes or dtype do not match this model")

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request (validated first; raises RequestError)."""
        self.validate(request)
        first = _Sample(request, 0, list(request.prompt_ids), self._next_arrival())
        self._by_request[request.request_id] = [first]
        self.stats["prompt_tokens"] += len(request.prompt_ids)
        if request.mode == "prefill" and first.target == 0:      # a 1-token prompt: nothing to export
            self._ready.append(self._finish(first, [], [], "stop", handoff=self._export(first)))
            return
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
        return bool(self.waiting or self.running or self._ready)

    def set_cache_identity(self, weights_version: str, numerics_fingerprint: str) -> None:
        """Name the weights and numerics computing this engine's KV: they seed every prefix-cache key."""
        self._numerics_fingerprint = numerics_fingerprint
        self._cache_seed = prefix_cache_seed(weights_version, numerics_fingerprint)

    def load_weights(self, state_dict: dict[str, torch.Tensor], weights_version: str = "") -> None:
        """Replace the model's weights in place (same config); only between requests.

        Every cached prefix is forgotten: its KV was computed with the old weights;
        new keys are seeded with ``weights_version``.
        Raises RuntimeError while requests are in the engine, and the model's own
        error for missing, unexpected or misshapen tensors (nothing is changed then).
        """
        if self.has_work():
            raise RuntimeError("load_weights with requests in the engine")
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        wrong = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
        if missing or unexpected or wrong:
            raise ValueError(f"weights do not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                             f"wrong shape {wrong[:3]}")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(state_dict[k])
        self.blocks.reset_prefix_cache()
        self.set_cache_identity(weights_version, self._numerics_fingerprint)

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
        """Schedule, run one forward over every scheduled token, sample. Returns the deltas."""
        ready, self._ready = self._ready, []
        work = self._schedule()
        if not work:
            return ready
        chunks = [SequenceChunk(tuple(s.blocks), s.num_computed, n) for s, n in work]
        tokens = torch.tensor([t for s, n in work for t in s.token_ids[s.num_computed:s.num_computed + n]],
                              dtype=torch.int64, device=self.device)
        rows, row_owner, at = [], [], 0
        for s, n in work:
            end = s.num_computed + n
            want_prompt = s.opts.prompt_logprobs or s.request.mode == "score"
            for i in range(n):
                pos = s.num_computed + i
                if (want_prompt and pos < s.num_prompt - 1) or (pos == end - 1 and end == s.target
                                                                and s.request.mode == "generate"):
                    rows.append(at + i)
                    row_owner.append((s, pos))
            at += n
        batch = batch_for_chunks(chunks, self.config.block_size, self.device)
        with torch.no_grad():
            logits = self.model.forward_tokens(tokens, batch, self.cache,
                                               torch.tensor(rows, dtype=torch.int64, device=self.device))
        logits_of = {(id(s), pos): logits[i] for i, (s, pos) in enumerate(row_owner)}
        for s, n in work:
            s.num_computed += n
            self._register_full_blocks(s)
        self._prompt_logprobs(work, logits_of)
        return ready + self._sample_and_finish(work, logits_of)

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> list[tuple[_Sample, int]]:
        budget = self.config.max_num_batched_tokens
        work: list[tuple[_Sample, int]] = []
        scheduled: set[int] = set()
        # 1. one token for each running sample, oldest first.
        for s in sorted(self.running, key=lambda q: q.arrival):
            if s.state is not _State.RUNNING or budget == 0:
                continue
            if not self._ensure_slots_or_reclaim(s, s.num_computed + 1, scheduled):
                self._preempt(s)            # s is the newest holder of blocks: it waits
                continue
            work.append((s, 1))
            scheduled.add(id(s))
            budget -= 1
        # 2. prefill chunks, first come first served.
        for s in list(self.waiting):
            if budget == 0 or len(self.running) + len(work) >= self.config.max_num_seqs:
                break
            if s.state is not _State.WAITING:
                continue
            if not s.blocks and s.num_computed == 0:
                self._admit(s)
            n = min(budget, s.target - s.num_computed)
            if n <= 0:
                continue                    # fully cached / handed-off prefix: sampled below
            if not self._ensure_slots_or_reclaim(s, s.num_computed + n, scheduled):
                n = self._fit(s, n)
            if n <= 0:
                if not work and not any(q.blocks for q in self.running + self.waiting if q is not s):
                    raise RuntimeError("KV cache too small for a single request: raise num_blocks")
                break
            work.append((s, n))
            scheduled.add(id(s))
            budget -= n
        return work

    def _ensure_slots_or_reclaim(self, s: _Sample, upto: int, scheduled: set[int]) -> bool:
        """Blocks for s up to `upto` tokens, taking them from newer samples if needed
        (newest first; a newer sample is recomputed later with the same bits)."""
        while not self._ensure_slots(s, upto):
            newer = [q for q in self.running + self.waiting
                     if q is not s and q.blocks and q.arrival > s.arrival and id(q) not in scheduled]
            if not newer:
                return False
            self._preempt(max(newer, key=lambda q: q.arrival))
        return True

    def _admit(self, s: _Sample) -> None:
        """First scheduling of a sample: import a handoff or reuse cached prefix blocks."""
        h = s.request.handoff
        if h is not None:
            nb = -(-h.num_tokens // self.config.block_size)
            blocks = self.blocks.allocate(nb)
            if blocks is None:
                return
            s.blocks = blocks
            slots = self._slots(s, 0, h.num_tokens)
            self.cache.latent[:, slots] = h.latent.to(self.device)
            self.cache.rope[:, slots] = h.rope.to(self.device)
            self.cache.index_k[:, slots] = h.index_k.to(self.device)
            s.num_computed = h.num_tokens
            return
        # The last token to compute is never taken from cache: its logits are needed. Prompt
        # logprobs need the logits of every prompt position, so those requests compute all.
        if s.opts.prompt_logprobs or s.request.mode == "score":
            return
        ids = s.token_ids[: max(s.target, 1) - 1]
        s.blocks = self.blocks.match_prefix(ids, block_hashes(ids, self.config.block_size, self._cache_seed),
                                            self._cache_seed)
        s.num_computed = s.num_cached = len(s.blocks) * self.config.block_size
        s.num_registered = len(s.blocks)
        self.stats["cached_tokens"] += s.num_cached

    def _fit(self, s: _Sample, n: int) -> int:
        """The largest chunk <= n whose blocks can be allocated now (0 if none)."""
        room = len(s.blocks) * self.config.block_size - s.num_computed + self.blocks.num_free * self.config.block_size
        n = min(n, room)
        return n if n > 0 and self._ensure_slots(s, s.num_computed + n) else 0

    def _ensure_slots(self, s: _Sample, upto: int) -> bool:
        need = -(-upto // self.config.block_size) - len(s.blocks)
        if need <= 0:
            return True
        got = self.blocks.allocate(need)
        if got is None:
            return False
        s.blocks.extend(got)
        return True

    def _preempt(self, s: _Sample) -> None:
        """Free a sample's blocks (running or part-prefilled); it is recomputed later with the same bits."""
        self.blocks.release(s.blocks)
        s.blocks, s.num_computed, s.num_registered = [], 0, 0
        if s.state is _State.RUNNING:
            s.state = _State.WAITING
            self.running.remove(s)
            self.waiting.insert(0, s)
        self.stats["preemptions"] += 1

    def _register_full_blocks(self, s: _Sample) -> None:
        """Offer s's newly completed blocks to the prefix cache (never KV an untrusted peer sent)."""
        h = s.request.handoff
        if h is not None and not h.trusted:
            return  # every later block attends to the handed-off rows: none of them may be shared
        full = s.num_computed // self.config.block_size
        if full > s.num_registered:
            size = self.config.block_size
            keys = block_hashes(s.token_ids[: full * size], size, self._cache_seed)
            for i in range(s.num_registered, full):
                self.blocks.register(s.blocks[i], keys[i], keys[i - 1] if i else self._cache_seed,
                                     s.token_ids[i * size:(i + 1) * size])
            s.num_registered = full

    def _slots(self, s: _Sample, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(s.blocks, dtype=torch.int64)
        return (table[pos // self.config.block_size] * self.config.block_size + pos % self.config.block_size).to(self.device)

    # ------------------------------------------------------------------ sampling and outputs

    def _prompt_logprobs(self, work, logits_of) -> None:
        for s, _ in work:
            if not (s.opts.prompt_logprobs or s.request.mode == "score") or s.sent_prompt_logprobs:
                continue
            done = min(s.num_computed, s.num_prompt - 1)
            positions = [p for p in range(len(s.prompt_logprobs), done) if (id(s), p) in logits_of]
            if positions:
                logits = torch.stack([logits_of[(id(s), p)] for p in positions])
                nxt = torch.tensor([s.token_ids[p + 1] for p in positions], device=self.device)
                lp = sampling_logprobs(logits, nxt, self._params(s, len(positions), positions))
                s.prompt_logprobs.extend(lp.tolist())

    def _params(self, s: _Sample, rows: int, positions: Sequence[int]) -> SamplingParams:
        o = s.opts
        return SamplingParams(
            temperature=torch.full((rows,), float(o.temperature), device=self.device),
            top_k=torch.full((rows,), o.top_k, dtype=torch.int64, device=self.device),
            top_p=torch.full((rows,), float(o.top_p), device=self.device),
            seed=torch.full((rows,), sample_seed(o.seed, s.index), dtype=torch.int64, device=self.device),
            position=torch.tensor(list(positions), dtype=torch.int64, device=self.device),
        )

    def _sample_and_finish(self, work, logits_of) -> list[SampleOutput]:
        out: list[SampleOutput] = []
        to_sample: list[_Sample] = []
        for s, _ in work:
            if s.state is _State.WAITING and s.num_computed >= s.target:
                self.waiting.remove(s)
                self.running.append(s)
                s.state = _State.RUNNING
            if s.request.mode == "score" and s.num_computed >= s.target:
                out.append(self._finish(s, [], [], "stop"))
            elif s.request.mode == "prefill" and s.num_computed >= s.target:
                out.append(self._finish(s, [], [], "stop", handoff=self._export(s)))
            elif s.request.mode == "generate" and s.num_computed == len(s.token_ids):
                to_sample.extend(self._fork(s))
        if not to_sample:
            return out
        # Each sample draws from its own logits row with its own (seed, position) key.
        logits = torch.stack([logits_of[(id(s if not s.forked else self._parent(s)), len(s.token_ids) - 1)]
                              for s in to_sample])
        params = [self._params(s, 1, [len(s.token_ids)]) for s in to_sample]
        params = SamplingParams(*(torch.cat(parts) for parts in zip(*(dataclasses.astuple(p) for p in params))))
        draw = sample(logits.float(), params)
        # A row without a distribution (NaN/+inf logits) fails its own request only.
        failed = sorted({s.request.request_id for s, ok in zip(to_sample, draw.ok.tolist()) if not ok})
        for rid in failed:
            log.error("request %s aborted: its logits have no sampling distribution (NaN or +inf, or none finite)", rid)
            out.extend(self.abort(rid))
        for s, tok, lp in zip(to_sample, draw.tokens.tolist(), draw.logprobs.tolist()):
            if s.request.request_id in failed:
                continue
            s.token_ids.append(tok)
            s.output_logprobs.append(lp)
            self.stats["generation_tokens"] += 1
            out.append(self._after_token(s, tok, lp))
        return out

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
        bs = self.config.block_size
        need = n - 1 if s.num_computed % bs else 0          # a private partial block per sibling
        while self.blocks.num_free < need:
            newer = [q for q in self.running + self.waiting if q is not s and q.blocks and q.arrival > s.arrival]
            if not newer:                                   # wait: recompute the prompt when memory frees
                self._preempt(s)
                return []
            self._preempt(max(newer, key=lambda q: q.arrival))
        family = [s]
        for i in range(1, n):
            child = _Sample(s.request, i, list(s.token_ids), self._next_arrival(), forked=True, state=_State.RUNNING,
                            num_computed=s.num_computed, num_cached=s.num_cached, num_registered=s.num_registered)
            full = s.num_computed // bs
            for b in s.blocks[:full]:
                self.blocks.share(b)
            child.blocks = list(s.blocks[:full])
            if s.num_computed % bs:
                new = self.blocks.allocate(1)           # reserved above: cannot fail
                src = slice(s.blocks[full] * bs, s.blocks[full] * bs + bs)
                dst = slice(new[0] * bs, new[0] * bs + bs)
                for t in (self.cache.latent, self.cache.rope, self.cache.index_k):
                    t[:, dst] = t[:, src]
                child.blocks.append(new[0])
            child.sent_prompt_logprobs = True       # the request's prompt logprobs travel with sample 0
            self.running.append(child)
            family.append(child)
        self._by_request[s.request.request_id] = family
        return family

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
        self.blocks.release(s.blocks)
        s.blocks = []
        if s in self.running:
            self.running.remove(s)
        if s in self.waiting:
            self.waiting.remove(s)
        s.state = _State.FINISHED

    def _output(self, s: _Sample, toks, lps, reason, text: str = "") -> SampleOutput:
        out = SampleOutput(s.request.request_id, s.index, list(toks), list(lps), reason is not None, reason,
                           num_prompt_tokens=s.num_prompt, num_cached_tokens=s.num_cached, text=text)
        if (s.opts.prompt_logprobs or s.request.mode == "score") and not s.sent_prompt_logprobs:
            out.prompt_logprobs, s.sent_prompt_logprobs = list(s.prompt_logprobs), True
        return out

    def _export(self, s: _Sample) -> KVHandoff:
        slots = self._slots(s, 0, s.target)
        return KVHandoff(tuple(s.token_ids[: s.target]), self.cache.latent[:, slots].cpu(),
                         self.cache.rope[:, slots].cpu(), self.cache.index_k[:, slots].cpu(), trusted=True)

    def _next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals


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
