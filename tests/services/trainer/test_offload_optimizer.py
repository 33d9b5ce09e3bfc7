"""TrainConfig.offload_optimizer (co-location): the optimizer state lives in host memory between steps and
each parameter is stepped alone, in slices of whole rows; the weights, masters and AdamW moments after N
steps equal the on-device step's bit for bit (fp32 model; bf16 model with fp32 masters; bf16 model without
masters, the GLM-5 slice's co-location; whole parameters and slices of a few rows; a refused step undone
alike), and a checkpoint written by one loads into the other."""
import copy
import dataclasses
import random

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer import trainer as trainer_module
from zerokl.services.trainer.optim import NonFiniteStep
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.vocab import Completion, InvalidOption

TINY = ModelConfig.preset("tiny")


def _data(seed: int) -> list[Completion]:
    rng = random.Random(seed)
    return [Completion(tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 20))),
                       tuple(rng.randrange(3, 64) for _ in range(5))) for _ in range(4)]


# (model dtype, master weights): fp32; bf16 with fp32 masters; bf16 stepped in bf16 (the GLM-5 slice's co-location)
KINDS = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, False)]
KIND_IDS = ["fp32", "bf16-masters", "bf16-no-masters"]


@pytest.fixture(params=["whole", "rows"])
def slices(request, monkeypatch):
    """Offloaded parameters stepped whole, or in slices of whole rows (2,000 elements: 15 rows of a 128-wide
    weight, the last slice shorter; one expert of a (16, 128, 96) stack; 1-D norms whole): the same bits either
    way. (Slices of a row or two cost the CPU tier ~20 s a variant for nothing more: the code path is the same.)"""
    if request.param == "rows":
        monkeypatch.setattr(trainer_module, "OFFLOAD_SLICE_ELEMENTS", 2000)
    return request.param


def _trainer(dtype: torch.dtype, masters: bool | None = None, **kw) -> Trainer:
    return Trainer(Model(TINY, seed=3, dtype=dtype),
                   TrainConfig(lr=1e-3, weight_decay=0.01, grad_clip=0.05, master_weights=masters, **kw))


def _state(t: Trainer) -> list[torch.Tensor]:
    out = [p.detach() for p in t.params] + list(t.masters or [])
    for o in t._optimized:
        s = t.optimizer.state.get(o, {})
        out += [s[k] for k in ("exp_avg", "exp_avg_sq") if k in s]
        out += [s["step"]] if "step" in s else []
    return out


def _assert_same(a: Trainer, b: Trainer) -> None:
    sa, sb = _state(a), _state(b)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb, strict=True):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("dtype,masters", KINDS, ids=KIND_IDS)
def test_offloaded_steps_are_the_on_device_steps_bit_for_bit(dtype: torch.dtype, masters: bool | None,
                                                             slices: str) -> None:
    on, off = _trainer(dtype, masters), _trainer(dtype, masters, offload_optimizer=True)
    assert (on.masters is None) == (dtype == torch.float32 or masters is False) and off.offload
    for step in range(3):
        data = _data(step)
        m_on, m_off = on.sft_step(data), off.sft_step(data)
        assert m_on["grad_norm"] == m_off["grad_norm"] and m_on["loss"] == m_off["loss"]
        assert m_on["grad_norm"] > 0.05                 # every step clips (grad_clip 0.05): the clip's bits too
        _assert_same(on, off)
    # Between steps the state is in host memory (pinned where a GPU is present).
    for t in [*(off.masters or []), *(v for s in off.optimizer.state.values() for k, v in s.items() if k != "step")]:
        assert t.device.type == "cpu"
        assert t.is_pinned() == torch.cuda.is_available()
    # A checkpoint of the offloaded trainer resumes an on-device one, and back.
    resumed, back = _trainer(dtype, masters), _trainer(dtype, masters, offload_optimizer=True)
    resumed.load_state_dict(copy.deepcopy(off.state_dict()))     # copies: a state dict holds the live tensors
    back.load_state_dict(copy.deepcopy(on.state_dict()))
    data = _data(9)
    for t in (on, off, resumed, back):
        t.sft_step(data)
    _assert_same(on, off)
    _assert_same(on, resumed)
    _assert_same(on, back)


def test_a_refused_offloaded_step_is_undone_like_an_on_device_one() -> None:
    on, off = _trainer(torch.bfloat16), _trainer(torch.bfloat16, offload_optimizer=True)
    for t in (on, off):
        t.sft_step(_data(0))
    before = [x.clone() for x in _state(off)]
    for t in (on, off):
        t.forward_backward("sft", _data(1))
        with pytest.raises(NonFiniteStep):
            t.optim_step(lr=1e38)           # overflows: every tensor back as it was
    assert all(torch.equal(x, y) for x, y in zip(before, _state(off), strict=True))
    _assert_same(on, off)
    # A step whose results are not finite (an infinite gradient, unclipped) is refused having written nothing:
    # the offloaded step checks every slice before writing one, so its undo snapshot copies no tensor.
    params, masters, state, _ = off.snapshot()
    assert params == [] and masters == [] and state is None
    for t in (on, off):
        t.config = dataclasses.replace(t.config, grad_clip=0.0)
        t.forward_backward("sft", _data(1))
        with torch.no_grad():
            t.params[3].grad.view(-1)[5] = float("inf")
        with pytest.raises(NonFiniteStep):
            t.optim_step()
    assert all(torch.equal(x, y) for x, y in zip(before, _state(off), strict=True))
    for t in (on, off):
        t.sft_step(_data(2))
    _assert_same(on, off)


def test_offload_refused_with_fp8() -> None:
    bad = (TrainConfig(dtype="fp8", offload_optimizer=True), TrainConfig(offload_optimizer=1))  # type: ignore[arg-type]
    for config in bad:
        with pytest.raises(InvalidOption) as err:
            config.check()
        assert err.value.field == "offload_optimizer"


def test_offload_refuses_cuda_graphs_and_leaves_them_off_when_unset() -> None:
    """A captured step keeps its gradients (the model's bytes again) and activations on the device between steps: a
    co-located trainer (the offloaded optimizer) must give that memory to the replica waking beside it. The GLM-5
    slice's first co-located wake on an H100 ran out of memory with 68.8 GiB held by the trainer."""
    with pytest.raises(InvalidOption) as err:
        TrainConfig(offload_optimizer=True, cuda_graphs=True).check()
    assert err.value.field == "cuda_graphs"
    for graphs in (None, False):
        TrainConfig(offload_optimizer=True, cuda_graphs=graphs).check()
    TrainConfig(offload_optimizer=False, cuda_graphs=True).check()


@pytest.mark.gpu
def test_an_offloaded_trainer_on_cuda_captures_no_step() -> None:
    """On CUDA, with the graphs unset (the trainer service's default), an offloaded trainer runs its steps eagerly:
    after the steps that would have captured a graph, no graph holds device memory and nothing is left allocated
    but the weights (and a few flags)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = Trainer(Model(TINY, seed=3, dtype=torch.bfloat16).cuda(),
                TrainConfig(lr=1e-3, master_weights=False, offload_optimizer=True))
    weights = torch.cuda.memory_allocated()
    for _ in range(3):          # seen, then captured: the steps a graph would take
        t.sft_step(_data(2))
    assert t._graphs is None
    assert torch.cuda.memory_allocated() - weights < 2**20       # a few 0-dim flags, no gradient nor activation


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,masters", KINDS, ids=KIND_IDS)
def test_offloaded_steps_on_cuda_are_the_on_device_steps_bit_for_bit(dtype: torch.dtype, masters: bool | None,
                                                                     slices: str) -> None:
    """On CUDA the state lives in pinned host memory between steps and is stepped on the device: the same bits as
    AdamW with its state on the device (torch's single-tensor AdamW), a refused step undone alike."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make = lambda **kw: Trainer(Model(TINY, seed=3, dtype=dtype).cuda(),  # noqa: E731
                                TrainConfig(lr=1e-3, weight_decay=0.01, grad_clip=0.05, cuda_graphs=False,
                                            master_weights=masters, **kw))
    on, off = make(), make(offload_optimizer=True)
    for step in range(3):
        on.sft_step(_data(step))
        off.sft_step(_data(step))
        _assert_same(on, off)
    hosted = [*(off.masters or []), *(v for s in off.optimizer.state.values() for k, v in s.items() if k != "step")]
    assert hosted and all(t.device.type == "cpu" and t.is_pinned() for t in hosted)
    for t in (on, off):
        t.forward_backward("sft", _data(5))
        # lr=1e38 overflows the CPU step but not every CUDA one (measured on an H100): a non-finite gradient
        # makes the step non-finite on any device
        with torch.no_grad():
            t.params[0].grad.view(-1)[0] = float("inf")
        with pytest.raises(NonFiniteStep):
            t.optim_step()
        t.sft_step(_data(6))
    _assert_same(on, off)


@pytest.mark.gpu
def test_an_offloaded_step_on_cuda_gives_all_its_device_memory_back() -> None:
    """Co-located, the replica wakes into the memory the trainer's step gave back: after an offloaded step the
    trainer's cache holds nothing a later empty_cache could still return. The step's list of gradients outlived
    its empty_cache, so 22.7 GiB of the GLM-5 slice's gradients stayed in the trainer's cache and the replica's
    wake ran out of an H100's memory."""
    import gc
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # `small`: its gradients fill whole segments of the caching allocator (a tiny model's share small ones)
    t = Trainer(Model(ModelConfig.preset("small"), seed=0, dtype=torch.bfloat16).cuda(),
                TrainConfig(lr=1e-5, master_weights=False, offload_optimizer=True, cuda_graphs=False))
    t.sft_step(_data(1))
    after = torch.cuda.memory_reserved()
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == after
