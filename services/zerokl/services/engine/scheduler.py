"""The engine's scheduler: which tokens of which samples run in the next step (pure Python).

It owns the samples' queues and the KV block manager and decides, every step: one token
for each running sample (oldest first), then prefill chunks of waiting samples (FCFS)
within the step's token budget, at most ``max_num_seqs`` samples holding a slot. When
blocks run out the newest holder is preempted (its blocks freed; it is recomputed later
with the same bits). It never touches a tensor: moving KV (a handoff's import, a fork's
partial block) is the runner's job, reached through the :class:`KVMover` it is given, so
it is unit-tested with a fake runner (tests/services/engine/test_scheduler.py).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Protocol

from zerokl.services.engine.blocks import BlockManager, block_hashes, prefix_cache_seed
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.vocab import SamplingOptions

__all__ = ["KVMover", "Sample", "SampleState", "Scheduler"]


class SampleState(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclasses.dataclass(eq=False)
class Sample:
    """One sample (sequence) of a request."""

    request: GenerateRequest
    index: int
    token_ids: list[int]                 # prompt + generated
    arrival: int                         # admission order: preemption takes the newest first
    # Replaced by a new list or appended to, never edited in place: the runner keeps an
    # incremental copy of each sample's block table and re-reads only the new tail.
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0                # tokens whose KV is in the cache
    num_cached: int = 0                  # prompt tokens that came from the prefix cache
    state: SampleState = SampleState.WAITING
    num_registered: int = 0              # full blocks already offered to the prefix cache
    chain_key: bytes = b""               # prefix-cache key of block num_registered - 1 (unused while 0)
    sent_prompt_logprobs: bool = False
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    forked: bool = False                 # n > 1: sample 0 forks its siblings at the prompt's end
    sampling_row: Any = None             # the runner's per-sample sampling parameters (built once)
    max_len: int = 0                     # the length at which it finishes by length (0: none known)
    # Overlapped decode: tokens drawn by a launched step whose results the engine has not read
    # yet (0 or 1; 2 between launching a step and reading the one before), and the row of the
    # latest of them in its step. Its KV and token are not counted in num_computed / token_ids.
    num_pending: int = 0
    pending_row: int = -1

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
        """Tokens to compute before the next sampling point (every mode computes the whole prompt)."""
        return len(self.token_ids)


class KVMover(Protocol):
    """What the scheduler asks of the runner: KV copies it cannot do itself."""

    def import_handoff(self, blocks: list[int], handoff) -> None:
        """Write ``handoff``'s KV rows (positions 0..n-1) into ``blocks``' slots."""

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every KV row of block ``src`` into block ``dst`` (bit for bit)."""


class Scheduler:
    """Queues, blocks, admission, chunked-prefill budget and preemption."""

    def __init__(self, config: EngineConfig, kv: KVMover, on_fail: Callable[[Sample, BaseException], None],
                 stats: dict | None = None):
        self.config, self.kv, self.on_fail = config, kv, on_fail
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.cache_seed = prefix_cache_seed("", "")
        self.waiting: list[Sample] = []
        self.running: list[Sample] = []
        self.stats = stats if stats is not None else {"preemptions": 0, "cached_tokens": 0}
        self._arrivals = 0

    def next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    # ------------------------------------------------------------------ the step's work

    def schedule(self) -> list[tuple[Sample, int]]:
        """(sample, number of new tokens) for the next forward, decode entries first.

        A waiting sample whose whole prompt is already here (a handoff that covers it) comes
        with 0 new tokens: it reaches its sampling point without a forward. A running sample
        with a pending token (overlapped decode) is scheduled for the token after it, unless
        the pending token is its last by length (it would only be discarded)."""
        budget = self.config.max_num_batched_tokens
        work: list[tuple[Sample, int]] = []
        scheduled: set[int] = set()
        # 1. one token for each running sample, oldest first.
        for s in sorted(self.running, key=lambda q: q.arrival):
            if s.state is not SampleState.RUNNING or budget == 0:
                continue
            if s.num_pending and 0 < s.max_len <= len(s.token_ids) + s.num_pending:
                continue
            if not self.ensure_slots_or_reclaim(s, s.num_computed + s.num_pending + 1, scheduled):
                self.preempt(s)             # s is the newest holder of blocks: it waits
                continue
            work.append((s, 1))
            scheduled.add(id(s))
            budget -= 1
        # 2. prefill chunks, first come first served, while fewer than max_num_seqs samples hold
        # a slot (the running ones, whose decode entries are already in `work`, count once).
        prefilling = 0
        for s in list(self.waiting):
            if budget == 0 or len(self.running) + prefilling >= self.config.max_num_seqs:
                break
            if s.state is not SampleState.WAITING:
                continue
            if not s.blocks and s.num_computed == 0:
                try:
                    self.admit(s)
                except Exception as err:  # noqa: BLE001 - e.g. a handoff that cannot be copied: its own failure
                    self.on_fail(s, err)
                    continue
            n = min(budget, s.target - s.num_computed)
            if n <= 0:
                # A handoff of the whole prompt (with its first tokens): nothing to compute, the
                # engine takes the tokens at this step's sampling point. It holds a slot like a prefill.
                work.append((s, 0))
                scheduled.add(id(s))
                prefilling += 1
                continue
            if not self.ensure_slots_or_reclaim(s, s.num_computed + n, scheduled):
                n = self.fit(s, n)
            if n <= 0:
                if not work and not any(q.blocks for q in self.running + self.waiting if q is not s):
                    # Alone with the whole cache and still no room: this request can never run.
                    self.on_fail(s, RuntimeError("KV cache too small for this request: raise num_blocks"))
                    continue
                break
            work.append((s, n))
            scheduled.add(id(s))
            budget -= n
            prefilling += 1
        return work

    def ensure_slots_or_reclaim(self, s: Sample, upto: int, scheduled: set[int]) -> bool:
        """Blocks for s up to `upto` tokens, taking them from newer samples if needed
        (newest first; a newer sample is recomputed later with the same bits)."""
        while not self.ensure_slots(s, upto):
            newer = [q for q in self.running + self.waiting
                     if q is not s and q.blocks and q.arrival > s.arrival and id(q) not in scheduled]
            if not newer:
                return False
            self.preempt(max(newer, key=lambda q: q.arrival))
        return True

    def admit(self, s: Sample) -> None:
        """First scheduling of a sample: import a handoff or reuse cached prefix blocks."""
        h = s.request.handoff
        size = self.config.block_size
        if h is not None:
            blocks = self.blocks.allocate(-(-h.num_tokens // size))
            if blocks is None:
                return
            s.blocks = blocks
            self.kv.import_handoff(blocks, h)
            s.num_computed = h.num_tokens
            return
        # The last token to compute is never taken from cache: its logits are needed. Prompt
        # logprobs need the logits of every prompt position, so those requests compute all.
        if s.opts.prompt_logprobs or s.request.mode == "score":
            return
        ids = s.token_ids[: max(s.target, 1) - 1]
        keys = block_hashes(ids, size, self.cache_seed)
        s.blocks = self.blocks.match_prefix(ids, keys, self.cache_seed)
        s.num_computed = s.num_cached = len(s.blocks) * size
        s.num_registered = len(s.blocks)
        s.chain_key = keys[len(s.blocks) - 1] if s.blocks else b""
        self.stats["cached_tokens"] += s.num_cached

    def fit(self, s: Sample, n: int) -> int:
        """The largest chunk <= n whose blocks can be allocated now (0 if none)."""
        room = len(s.blocks) * self.config.block_size - s.num_computed + self.blocks.num_free * self.config.block_size
        n = min(n, room)
        return n if n > 0 and self.ensure_slots(s, s.num_computed + n) else 0

    def ensure_slots(self, s: Sample, upto: int) -> bool:
        need = -(-upto // self.config.block_size) - len(s.blocks)
        if need <= 0:
            return True
        got = self.blocks.allocate(need)
        if got is None:
            return False
        s.blocks.extend(got)
        return True

    def preempt(self, s: Sample) -> None:
        """Free a sample's blocks (running or part-prefilled); it is recomputed later with the same bits."""
        self.blocks.release(s.blocks)
        s.blocks, s.num_computed, s.num_registered = [], 0, 0
        if s.state is SampleState.RUNNING:
            s.state = SampleState.WAITING
            self.running.remove(s)
            self.waiting.insert(0, s)
        self.stats["preemptions"] += 1

    # ------------------------------------------------------------------ after the forward

    def computed(self, s: Sample, n: int) -> None:
        """``n`` more tokens of ``s`` have their KV in the cache."""
        s.num_computed += n
        if s.num_computed >= (s.num_registered + 1) * self.config.block_size:
            self.register_full_blocks(s)

    def register_full_blocks(self, s: Sample) -> None:
        """Offer s's newly completed blocks to the prefix cache (never KV an untrusted peer sent)."""
        h = s.request.handoff
        if h is not None and not h.trusted:
            return  # every later block attends to the handed-off rows: none of them may be shared
        size = self.config.block_size
        full = s.num_computed // size
        if full > s.num_registered:
            # The chain goes on from the last registered block's key: hashing only the new
            # blocks keeps this O(new blocks), not O(context), per sample per step.
            first = s.num_registered
            parent = s.chain_key if first else self.cache_seed
            for i, key in enumerate(block_hashes(s.token_ids[first * size: full * size], size, parent), first):
                self.blocks.register(s.blocks[i], key, parent, s.token_ids[i * size:(i + 1) * size])
                parent = key
            s.chain_key, s.num_registered = parent, full

    def start_running(self, s: Sample) -> None:
        """A waiting sample whose prompt is computed joins the running set."""
        if s.state is SampleState.WAITING:
            self.waiting.remove(s)
            self.running.append(s)
            s.state = SampleState.RUNNING

    def fork(self, s: Sample, n: int) -> list[Sample] | None:
        """n - 1 siblings of ``s`` (at its prompt's end): they share its full blocks and get a
        private copy of its partial last block. None when memory is short: ``s`` is then
        preempted (its prompt is recomputed when memory frees)."""
        bs = self.config.block_size
        need = n - 1 if s.num_computed % bs else 0          # a private partial block per sibling
        while self.blocks.num_free < need:
            newer = [q for q in self.running + self.waiting if q is not s and q.blocks and q.arrival > s.arrival]
            if not newer:
                self.preempt(s)
                return None
            self.preempt(max(newer, key=lambda q: q.arrival))
        children = []
        for i in range(1, n):
            child = Sample(s.request, i, list(s.token_ids), self.next_arrival(), forked=True,
                           state=SampleState.RUNNING, num_computed=s.num_computed, num_cached=s.num_cached,
                           num_registered=s.num_registered, chain_key=s.chain_key, max_len=s.max_len)
            full = s.num_computed // bs
            for b in s.blocks[:full]:
                self.blocks.share(b)
            child.blocks = list(s.blocks[:full])
            if s.num_computed % bs:
                new = self.blocks.allocate(1)           # reserved above: cannot fail
                self.kv.copy_block(s.blocks[full], new[0])
                child.blocks.append(new[0])
            child.sent_prompt_logprobs = True       # the request's prompt logprobs travel with sample 0
            self.running.append(child)
            children.append(child)
        return children

    def free(self, s: Sample) -> None:
        """``s`` is done (finished, aborted or failed): its blocks go back, it leaves the queues."""
        self.blocks.release(s.blocks)
        s.blocks = []
        if s in self.running:
            self.running.remove(s)
        if s in self.waiting:
            self.waiting.remove(s)
        s.state = SampleState.FINISHED
