"""The scheduler alone (no model, no tensors): admission under max_num_seqs, the token budget,
chunked prefill, preemption of the newest holder when blocks run out, forking under memory
pressure, prefix-cache reuse. A fake runner records the KV moves the scheduler asks for."""
from zerokl.services.engine.scheduler import Sample, SampleState, Scheduler
from zerokl.services.engine.types import EngineConfig, GenerateRequest, KVHandoff
from zerokl.vocab import SamplingOptions


class FakeRunner:
    """Records KV moves; holds no KV (the scheduler never reads it)."""

    def __init__(self):
        self.imports: list[tuple[list[int], int]] = []
        self.copies: list[tuple[int, int]] = []

    def import_handoff(self, blocks, handoff) -> None:
        self.imports.append((list(blocks), handoff.num_tokens))

    def copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))


def _make(**cfg):
    failed = []
    runner = FakeRunner()
    sched = Scheduler(EngineConfig(**cfg), runner, lambda s, err: (failed.append((s, err)), sched.free(s)))
    return sched, runner, failed


def _add(sched: Scheduler, rid: str, prompt_len: int, first: int = 3, **opts) -> Sample:
    opts.setdefault("max_tokens", 100)
    req = GenerateRequest(rid, tuple(range(first, first + prompt_len)), SamplingOptions(**opts))
    s = Sample(req, 0, list(req.prompt_ids), sched.next_arrival())
    sched.waiting.append(s)
    return s


def _run_step(sched: Scheduler, work) -> None:
    """What the engine does after a forward: commit the KV, start finished prefills, add a token."""
    for s, n in work:
        sched.computed(s, n)
        if s.num_computed >= s.target:
            sched.start_running(s)
            if s.num_computed == len(s.token_ids):
                s.token_ids.append(7)


def test_decode_first_then_prefill_chunks_within_the_budget():
    sched, _, _ = _make(max_num_batched_tokens=10, num_blocks=64, block_size=4)
    a = _add(sched, "a", 3)
    b = _add(sched, "b", 25)
    work = sched.schedule()
    assert [(s.request.request_id, n) for s, n in work] == [("a", 3), ("b", 7)]
    _run_step(sched, work)
    work = sched.schedule()                     # a decodes (1 token), b's next chunk fills the rest
    assert [(s.request.request_id, n) for s, n in work] == [("a", 1), ("b", 9)]
    assert a.state is SampleState.RUNNING and b.state is SampleState.WAITING
    assert sum(n for _, n in work) <= 10


def test_max_num_seqs_counts_each_running_sample_once():
    sched, _, _ = _make(max_num_batched_tokens=24, max_num_seqs=4, num_blocks=256, block_size=4)
    samples = [_add(sched, f"r{i}", 20) for i in range(10)]
    most = 0
    for _ in range(40):
        work = sched.schedule()
        holders = {id(s) for s, _ in work} | {id(s) for s in sched.running}
        assert len(holders) <= 4
        _run_step(sched, work)
        most = max(most, len(sched.running))
    assert most == 4
    assert all(s.state is SampleState.RUNNING for s in samples[:4])


def test_the_newest_holder_is_preempted_when_blocks_run_out_and_recomputed_from_zero():
    sched, _, failed = _make(max_num_batched_tokens=64, num_blocks=6, block_size=4)
    old = _add(sched, "old", 11)               # 3 blocks
    new = _add(sched, "new", 11, first=100)    # 3 blocks: the pool is full
    _run_step(sched, sched.schedule())
    assert old.state is new.state is SampleState.RUNNING and sched.blocks.num_free == 0
    _run_step(sched, sched.schedule())          # 12 tokens each: both blocks still fit
    work = sched.schedule()                     # old needs a 4th block: new (newest) gives its blocks up
    assert new.state is SampleState.WAITING and sched.waiting[0] is new and sched.stats["preemptions"] == 1
    # ... and is recomputed from position 0 in the blocks left (2 of them: a chunk of 8 tokens;
    # old's new block evicted new's first cached block, so nothing of new is reused).
    assert [(s.request.request_id, n) for s, n in work] == [("old", 1), ("new", 8)]
    assert new.num_computed == 0 and len(new.blocks) == 2 and len(old.blocks) == 4 and not failed


def test_a_request_that_can_never_fit_fails_alone():
    sched, _, failed = _make(max_num_batched_tokens=64, num_blocks=2, block_size=4)
    big = _add(sched, "big", 20)
    for _ in range(5):                         # chunks of 8 tokens fit, the 9th token never does
        _run_step(sched, sched.schedule())
    assert failed and failed[0][0] is big and "KV cache too small" in str(failed[0][1])
    assert sched.blocks.num_free == 2


def test_prefix_cache_reuses_full_blocks_and_counts_them():
    sched, _, _ = _make(max_num_batched_tokens=64, num_blocks=64, block_size=4)
    a = _add(sched, "a", 13)
    _run_step(sched, sched.schedule())
    b = _add(sched, "b", 13)                    # the same prompt
    work = sched.schedule()
    n_b = dict((s.request.request_id, n) for s, n in work)["b"]
    assert b.num_cached == 12 and n_b == 1 and b.blocks[:3] == a.blocks[:3]
    assert sched.stats["cached_tokens"] == 12


def test_handoff_is_imported_through_the_runner():
    import torch
    sched, runner, _ = _make(max_num_batched_tokens=64, num_blocks=16, block_size=4)
    prompt = tuple(range(3, 13))
    h = KVHandoff(prompt[:9], torch.zeros(1, 9, 1), torch.zeros(1, 9, 1), torch.zeros(1, 9, 1))
    s = Sample(GenerateRequest("h", prompt, handoff=h), 0, list(prompt), sched.next_arrival())
    sched.waiting.append(s)
    work = sched.schedule()
    assert runner.imports == [(s.blocks[:3], 9)] and work == [(s, 1)]


def test_a_handoff_of_the_whole_prompt_is_scheduled_with_nothing_to_compute():
    """Its first tokens came with it: admitted (imported, holding a slot) with 0 new tokens, within
    max_num_seqs; after it reaches its sampling point it decodes like any running sample."""
    import torch
    sched, runner, _ = _make(max_num_batched_tokens=64, num_blocks=16, block_size=4, max_num_seqs=2)
    prompt = tuple(range(3, 11))                # 8 tokens: two full blocks
    h = KVHandoff(prompt, torch.zeros(1, 8, 1), torch.zeros(1, 8, 1), torch.zeros(1, 8, 1),
                  first_token_ids=(9,), first_logprobs=(-1.0,))
    s = Sample(GenerateRequest("h", prompt, handoff=h), 0, list(prompt), sched.next_arrival())
    sched.waiting.append(s)
    other, third = _add(sched, "o", 5), _add(sched, "t", 5)
    work = sched.schedule()
    assert runner.imports == [(s.blocks, 8)] and len(s.blocks) == 2 and s.num_computed == 8
    assert work == [(s, 0), (other, 5)]         # the third waits: two samples hold the slots
    _run_step(sched, work)
    assert s.state is SampleState.RUNNING and s.token_ids[-1] == 7
    work = sched.schedule()
    assert (s, 1) in work and len(s.blocks) == 3 and third.blocks == []


def test_fork_copies_the_partial_block_or_preempts_under_pressure():
    sched, runner, _ = _make(max_num_batched_tokens=64, num_blocks=8, block_size=4)
    s = _add(sched, "f", 6, n=3)
    _run_step(sched, sched.schedule())
    children = sched.fork(s, 3)
    assert len(children) == 2 and [c.blocks[0] for c in children] == [s.blocks[0]] * 2
    assert [src for src, _ in runner.copies] == [s.blocks[1]] * 2
    assert len({dst for _, dst in runner.copies}) == 2 and all(c.state is SampleState.RUNNING for c in children)

    sched, runner, _ = _make(max_num_batched_tokens=64, num_blocks=2, block_size=4)
    s = _add(sched, "g", 6, n=3)
    _run_step(sched, sched.schedule())
    assert sched.fork(s, 3) is None             # no room for 2 private blocks, nobody newer: s waits
    assert s.state is SampleState.WAITING and s.blocks == [] and runner.copies == []


def test_a_pending_token_is_scheduled_past_and_its_last_one_is_not():
    """Overlapped decode: a running sample with a pending token (drawn by a launched step not
    read back yet) is scheduled for the token after it, with blocks for it; one whose pending
    token is its last by length is left out (its token after would only be dropped)."""
    sched, _, _ = _make(max_num_batched_tokens=16, num_blocks=64, block_size=4)
    a = _add(sched, "a", 7, max_tokens=5)
    b = _add(sched, "b", 7, first=20, max_tokens=5)
    _run_step(sched, sched.schedule())           # both prompts, each draws its first token
    for s in (a, b):
        s.max_len = s.num_prompt + 5
        s.num_pending = 1                         # a launched step draws the token at position 8
    assert len(a.token_ids) == 8 and a.num_computed == 7 and len(a.blocks) == 2
    work = sched.schedule()
    assert [(s.request.request_id, n) for s, n in work] == [("a", 1), ("b", 1)]
    assert len(a.blocks) == 3                     # room for position 8 (pending) and 9 (this step)
    b.token_ids += [7, 7, 7]                      # b's pending token is its 5th and last
    work = sched.schedule()
    assert [s.request.request_id for s, _ in work] == ["a"]
