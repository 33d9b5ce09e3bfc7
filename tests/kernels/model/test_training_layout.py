"""The training layout (AttentionBatch without a key table) and the indexer's KL loss.

The training path's logits must equal the serving path's (forward_tokens over the explicit
[N, L] key table) bit for bit, on each backend, with rows both below and above index_topk.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from zerokl.kernels import use_backend
from zerokl.kernels.model import ModelConfig
from zerokl.kernels.model.indexer_loss import attention_distribution, indexer_kl_loss, indexer_losses
from zerokl.kernels.model.model import AttentionBatch, Model
from zerokl.kernels.model.verify import INTERPRETER_CONFIG

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(b, s, vocab, seed):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_for_sequences_builds_no_key_table():
    batch = AttentionBatch.for_sequences(3, 50)
    assert batch.key_slots is None and batch.key_width == 50
    explicit = batch.explicit()
    assert explicit.key_slots.shape == (150, 50)
    assert explicit.key_slots[60].tolist() == list(range(50, 61)) + [-1] * 39


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_training_path_equals_serving_path(backend):
    if backend == "triton" and DEVICE == "cpu":
        config, (b, s) = INTERPRETER_CONFIG, (2, 12)           # interpreter-sized: index_topk = 8
    else:
        config, (b, s) = ModelConfig.preset("tiny"), (2, 45)     # index_topk = 32
    assert s > config.index_topk                                 # dense and sparse rows
    with use_backend(backend), torch.no_grad():
        model = Model(config, seed=3).to(DEVICE)
        ids = _ids(b, s, config.vocab_size, seed=4)
        train = model(ids)
        serve = model.forward_tokens(ids.reshape(-1), AttentionBatch.for_sequences(b, s, DEVICE).explicit())
    assert torch.equal(train, serve.view(b, s, -1))


def _tiny():
    return Model(ModelConfig.preset("tiny").replace(num_hidden_layers=2), seed=5)


def test_indexer_kl_loss_reaches_only_the_indexer_and_decreases():
    model = _tiny()
    ids = _ids(2, 48, model.config.vocab_size, seed=6).cpu()
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    with use_backend("torch"):
        with indexer_losses(model) as losses:
            model(ids)
        assert len(losses) == 2                                   # one per indexer layer
        loss = torch.stack(losses).mean()
        loss.backward()
        for name, p in model.named_parameters():
            if ".indexer." in name:
                assert p.grad is not None, name
            else:
                assert p.grad is None or not p.grad.any(), name
        assert any(p.grad.abs().sum() > 0 for p in indexer)

        opt = torch.optim.SGD(indexer, lr=2.0)
        history = []
        for _ in range(4):
            opt.zero_grad()
            with indexer_losses(model) as losses:
                model(ids)
            loss = torch.stack(losses).mean()
            history.append(float(loss.detach()))
            loss.backward()
            opt.step()
    assert history[-1] < history[0], history
    assert all(math_finite(v) and v >= 0 for v in history)


def math_finite(v):
    return v == v and abs(v) != float("inf")


def test_indexer_kl_loss_is_zero_when_the_indexer_matches_attention():
    g = torch.Generator().manual_seed(7)
    t, h, r, p, s = 5, 3, 8, 4, 12
    ql, qr = torch.randn(t, h, r, generator=g), torch.randn(t, h, p, generator=g)
    kv, kr = torch.randn(s, r, generator=g), torch.randn(s, p, generator=g)
    slots = torch.stack([torch.randperm(s, generator=g)[:6].sort().values for _ in range(t)])
    slots[0, 4:] = -1
    target = attention_distribution(ql, qr, kv, kr, slots, 0.3)
    assert torch.allclose(target.sum(-1), torch.ones(t)) and not target[0, 4:].any()
    matched = torch.where(slots >= 0, target.log(), torch.full_like(target, float("-inf")))
    assert float(indexer_kl_loss(matched, ql, qr, kv, kr, slots, 0.3)) < 1e-6
    assert float(indexer_kl_loss(torch.zeros(t, 6), ql, qr, kv, kr, slots, 0.3)) > 1e-3


def test_no_indexer_loss_without_request_or_gradient():
    model = _tiny()
    ids = _ids(1, 40, model.config.vocab_size, seed=8).cpu()
    with use_backend("torch"):
        with indexer_losses(model) as losses, torch.no_grad():
            model(ids)
        assert losses == []                                       # reference forwards (no grad) add nothing
        with indexer_losses(model) as losses:
            model(ids[:, :20])                                   # every row <= index_topk: nothing to train
        assert losses == []
    assert all(m.self_attn.indexer_losses is None for m in model.layers)


@pytest.mark.parametrize("backend", ["torch", "stock", "triton"])
def test_sequences_arguments_are_checked_by_the_public_op(backend):
    """ops.mla_attention_sequences checks its arguments once, for every backend (the backends
    assume checked inputs): the same error whichever backend is active."""
    from zerokl.kernels import ops
    t, h, r, p = 4, 2, 16, 16
    ql, qr = torch.zeros(t, h, r, device=DEVICE), torch.zeros(t, h, p, device=DEVICE)
    kv, kr = torch.zeros(t, r, device=DEVICE), torch.zeros(t, p, device=DEVICE)
    pos = torch.tensor([0, 1, 0, 1], device=DEVICE)
    bad = [
        ((ql, qr, kv[:3], kr, pos), "the keys are the T query tokens"),
        ((ql, qr[:, :1], kv, kr, pos), "the keys are the T query tokens"),
        ((ql, qr, kv, kr[:, :8], pos), "the keys are the T query tokens"),
        ((ql[0], qr, kv, kr, pos), r"must be \[T, H, R\]"),
        ((ql, qr, kv.double(), kr, pos), "share one dtype"),
        ((ql, qr, kv, kr, pos.float()), "positions must be int32/int64"),
        ((ql, qr, kv, kr, pos[:3]), "positions must be int32/int64"),
    ]
    if DEVICE == "cpu":
        bad.append(((ql, qr, kv, kr, torch.tensor([0, 1, 2, 4])), "exceeds its token index"))
    with use_backend(backend):
        for args, message in bad:
            with pytest.raises(ValueError, match=message):
                ops.mla_attention_sequences(*args, 1.0)
        with pytest.raises(ValueError, match="selection must be int32/int64"):
            ops.mla_attention_sequences(ql, qr, kv, kr, pos, 1.0, torch.zeros(3, 2, dtype=torch.long, device=DEVICE))
        assert ops.mla_attention_sequences(ql, qr, kv, kr, pos, 1.0).shape == (t, h, r)   # the valid call runs
