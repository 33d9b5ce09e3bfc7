"""The per-op trace recorder (kernels/zerokl/kernels/trace.py): it sees every covered op, changes no bits,
costs nothing when off, records only its own thread, and its digests tell any bit apart."""
from __future__ import annotations

import threading

import pytest
import torch

from zerokl.kernels import trace
from zerokl.kernels.trace import MODEL_LAYER, Trace, recording, row_digests, trace_sequence
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.model import AttentionBatch, KVCache

pytestmark = pytest.mark.usefixtures("cpu_backend")   # CPU tensors; the default backend of a CPU machine

CONFIG = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CONFIG, seed=0)


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CONFIG.vocab_size, (n,), generator=g).tolist()


def _no_hooks(model: Model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_tracing_changes_no_output_bits(model):
    # 40 tokens > index_topk (32): the indexer's scoring and selection run and are traced too.
    ids = torch.tensor(_ids(40))
    batch = AttentionBatch.for_sequences(1, 40)
    plain = model.forward_tokens(ids, batch)
    with recording(model, capture=["*"]) as rec:
        traced = model.forward_tokens(ids, batch)
    assert torch.equal(plain, traced)
    assert rec.ops and _no_hooks(model)
    # The serving path (paged cache, two chunks) with the recorder on gives the same logits too.
    cache = KVCache.allocate(CONFIG, num_blocks=8, block_size=8)
    with recording(model):
        first = model.forward_tokens(ids[:17], _chunk(0, 17, 40), cache)
        rest = model.forward_tokens(ids[17:], _chunk(17, 40, 40), cache)
    assert torch.equal(torch.cat([first, rest]), plain)
    # And bf16: the recorder reads bf16 rows as 16-bit words.
    m16 = Model(CONFIG, seed=0, dtype=torch.bfloat16)
    want = m16.forward_tokens(ids, batch)
    with recording(m16):
        assert torch.equal(m16.forward_tokens(ids, batch), want)


def _chunk(start: int, end: int, total: int) -> AttentionBatch:
    """Tokens start..end-1 of one sequence whose key slots are its positions (cache slot = position)."""
    pos = torch.arange(start, end)
    cols = torch.arange(end).view(1, -1)
    key_slots = torch.where(cols <= pos.view(-1, 1), cols.expand(len(pos), -1), torch.full((len(pos), end), -1))
    return AttentionBatch(pos, key_slots, pos.clone())


def test_trace_covers_the_contracts_ops_in_execution_order(model):
    t = trace_sequence(model, _ids(40))
    keys = [(o.layer, o.op) for o in t.ops]
    assert keys[0] == (MODEL_LAYER, "embed_tokens")
    assert keys[-3:] == [(MODEL_LAYER, "norm"), (MODEL_LAYER, "lm_head"), (MODEL_LAYER, "logprobs")]
    layer0 = [op for layer, op in keys if layer == 0]
    for op in ("input_layernorm", "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
               "self_attn.q_rope", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.k_rope",
               "self_attn.indexer.k_norm", "self_attn.indexer.scores", "self_attn.indexer.chosen",
               "self_attn.selected", "self_attn.attention", "self_attn.o_proj", "post_attention_layernorm", "mlp",
               "block.out"):
        assert op in layer0, op
    assert layer0.index("self_attn.q_a_proj") < layer0.index("self_attn.q_a_layernorm") < layer0.index("mlp")
    layer1 = [op for layer, op in keys if layer == 1]       # a MoE layer
    moe = layer1[layer1.index("mlp.gate.logits"):]
    assert moe[:5] == ["mlp.gate.logits", "mlp.gate.weights", "mlp.gate.experts", "mlp.experts", "mlp.combine"]
    assert {o.layer for o in t.ops} == {MODEL_LAYER, 0, 1, 2, 3}
    assert all(len(o.digests) == 40 for o in t.ops if o.op != "logprobs")
    experts = next(o for o in t.ops if o.layer == 1 and o.op == "mlp.experts")
    assert experts.shape == (CONFIG.num_experts_per_tok, CONFIG.hidden_size)


def test_traced_rows_are_the_models_bits(model):
    """The digests are of the very tensors the forward computed: the lm_head op is the logits, the
    logprobs op is the logprob of each next token, the expert outputs combine to the combine."""
    ids = _ids(20, seed=3)
    t = trace_sequence(model, ids, capture=["*"])
    logits = model.forward_tokens(torch.tensor(ids), AttentionBatch.for_sequences(1, 20))
    op = {(o.layer, o.op): o for o in t.ops}
    assert op[(MODEL_LAYER, "lm_head")].digests == row_digests(logits)
    assert torch.equal(op[(MODEL_LAYER, "lm_head")].tensor(), logits)
    lp = torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(ids[1:]).view(-1, 1)).float()
    assert torch.allclose(op[(MODEL_LAYER, "logprobs")].tensor(), lp, atol=1e-5)
    from zerokl.kernels import ops
    w, outs = op[(1, "mlp.gate.weights")].tensor(), op[(1, "mlp.experts")].tensor()
    assert torch.equal(ops.moe_combine(w, outs), op[(1, "mlp.combine")].tensor())


def test_a_lora_adapted_model_traces_the_same_ops(model):
    """The trainer's LoRA projections are parametrized subclasses of Linear: still traced, under the
    same names; with B = 0 at the start they compute the plain model's bits, op for op."""
    from zerokl.kernels.model.lora import apply_lora
    adapted = Model(CONFIG, seed=0)
    apply_lora(adapted, rank=4)
    ids = _ids(10)
    want, got = trace_sequence(model, ids), trace_sequence(adapted, ids)
    assert [(o.layer, o.op, o.digests) for o in got.ops] == [(o.layer, o.op, o.digests) for o in want.ops]


def test_recording_off_costs_one_check_and_records_nothing(model):
    assert trace._ACTIVE is None
    trace.record("anything", torch.ones(2, 2))             # no recorder: nothing happens, nothing raised
    assert _no_hooks(model)
    with recording(model):
        with pytest.raises(RuntimeError, match="already recording"):
            recording(model).__enter__()
    assert trace._ACTIVE is None and _no_hooks(model)


def test_only_the_recording_thread_is_recorded(model):
    """A serving engine keeps computing other requests on its own thread while a trace runs."""
    ids = torch.tensor(_ids(12))
    batch = AttentionBatch.for_sequences(1, 12)
    other = threading.Thread(target=lambda: model.forward_tokens(torch.tensor(_ids(9, 1)),
                                                                 AttentionBatch.for_sequences(1, 9)))
    with recording(model) as rec:
        other.start()
        other.join()
        model.forward_tokens(ids, batch)
    assert {len(o.digests) for o in rec.ops} == {12}


def test_traces_from_two_threads_wait_for_each_other(model):
    """Two traced requests at once (a replica's concurrent Score calls): each gets its own trace."""
    want = {n: trace_sequence(model, _ids(n)).ops for n in (7, 11)}
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda n=n: got.__setitem__(n, trace_sequence(model, _ids(n)).ops))
               for n in (7, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want and _no_hooks(model) and trace._ACTIVE is None


def test_digests_tell_every_single_bit_apart_and_ignore_layout():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g)
    base = row_digests(x)
    assert len(set(base)) == 3
    for flat in (0, 17, 34):                                # every bit of a few words
        for bit in range(32):
            y = x.clone()
            y.view(-1).view(torch.int32)[flat] ^= (1 << bit) if bit < 31 else -(1 << 31)
            changed = row_digests(y)
            row = flat // 35
            assert changed[row] != base[row] and changed[:row] + changed[row + 1:] == base[:row] + base[row + 1:]
    assert row_digests(x.transpose(1, 2).contiguous().transpose(1, 2)) == base      # strides do not matter
    assert row_digests(torch.tensor([[0.0]])) != row_digests(torch.tensor([[-0.0]]))   # bits, not values
    b = x.to(torch.bfloat16)
    assert row_digests(b) != row_digests(b.float())
    assert row_digests(torch.tensor([[1, 2]])) == row_digests(torch.tensor([[1, 2]]))


def test_digest_is_the_documented_multilinear_hash():
    """sum_i w_i * word_i + width mod 2^64, w from splitmix64: the same on every machine."""
    x = torch.tensor([[1.5, -2.0, 0.0]])
    words = [int(v) & 0xFFFFFFFF for v in x.view(torch.int32)[0].tolist()]
    words = [w - (1 << 32) if w >> 31 else w for w in words]          # sign-extended, as int64
    mask = (1 << 64) - 1

    def splitmix(i: int) -> int:
        z = (i + 1) * 0x9E3779B97F4A7C15 & mask
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        return (z ^ (z >> 31)) | 1
    want = (sum(splitmix(i) * w for i, w in enumerate(words)) + 3) & mask
    assert row_digests(x) == [want]


def test_a_trace_file_round_trips(model, tmp_path):
    t = trace_sequence(model, _ids(6), capture=["0:self_attn.q_a_proj"], meta={"backend": "torch"})
    back = Trace.from_json(t.to_json())
    assert back == t
    q = next(o for o in back.ops if o.key == "0:self_attn.q_a_proj")
    assert q.tensor().shape == (6, CONFIG.q_lora_rank)
