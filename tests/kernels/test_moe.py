"""The MoE layer on the device: no host sync in the forward, grouped-GEMM backward.

* The forward of a whole MoE layer (router, moe_route, routed experts, shared expert) on the
  Triton backend reads nothing back to the host: on CPU, every sync-shaped call made by zerokl's
  own code (.item(), .tolist(), nonzero, bool/int/float of a tensor) is trapped; on the GPU,
  torch.cuda.set_sync_debug_mode("error") and a CUDA-graph capture (replay == eager, bitwise).
* The sync-free path (every pair local) gives the same bits as the general path.
* The backward (grouped GEMMs for dX and dW, deterministic pair gather) against a float64 torch
  reference of the same layer, router gradient through the gathered normalized sigmoid weights
  only (HF GlmMoeDsa / DeepSeek-V3); gradients bitwise equal run to run.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before import).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pathlib
import sys

import pytest

from zerokl import kernels as K
from zerokl.kernels import ops
from zerokl.kernels.model import ModelConfig
from zerokl.kernels.model.model import MoE

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ZEROKL_SRC = pathlib.Path(ops.__file__).resolve().parents[3]      # the repository root: zerokl's own code


def _moe(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0) -> MoE:
    g = torch.Generator().manual_seed(seed)
    m = MoE(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "gate.weight" in name else 0.05))
        m.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
    m.to(DEVICE, dtype)
    m.gate.float()                                        # the router stays fp32 (as Model.to keeps it)
    return m


def _tiny(**changes) -> ModelConfig:
    return ModelConfig.preset("tiny").replace(**changes)


_EMULATED_DOT = pathlib.Path(ops.__file__).resolve().with_name("interpreter.py")


class _SyncTrap:
    """Raises when zerokl's own code calls something that reads a tensor back to the host."""

    NAMES = ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._wrap("torch.nonzero", torch.nonzero))

    def _wrap(self, name, fn):
        def trapped(*args, **kwargs):
            caller = pathlib.Path(sys._getframe(1).f_code.co_filename).resolve()
            # kernels/zerokl/kernels/interpreter.py is the CPU emulation of the device's tl.dot (its numpy
            # exchange is the emulator's arithmetic, not a read-back), as Triton's own interpreter is.
            if ZEROKL_SRC in caller.parents and "tests" not in caller.parts and caller != _EMULATED_DOT:
                self.calls.append(f"{name} from {caller.name}:{sys._getframe(1).f_lineno}")
                raise AssertionError(f"host sync: {name} called from {caller}:{sys._getframe(1).f_lineno}")
            return fn(*args, **kwargs)
        return trapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_forward_makes_no_host_sync(monkeypatch, dtype):
    m = _moe(_tiny(), dtype)
    x = (torch.randn(5, 128, generator=torch.Generator().manual_seed(1)) * 0.5).to(DEVICE, dtype)
    with K.use_backend("triton"), torch.no_grad():
        want = m(x)
        trap = _SyncTrap(monkeypatch)
        got = m(x)
        assert trap.calls == []
        assert torch.equal(got, want)
        # The trap catches what it should: the expert-parallel path reads the local pair count back.
        with pytest.raises(AssertionError, match="host sync"):
            ops.moe_expert_outputs(x, torch.zeros(5, 2, dtype=torch.int64, device=DEVICE), m.gate_proj[2:],
                                   m.up_proj[2:], m.down_proj[2:], first_expert=2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_all_local_path_equals_general_path(backend):
    """num_experts = E (no sync) and the general subset path compute the same bits; a rank's
    subset gives exactly the matching pairs' outputs."""
    cfg = _tiny()
    m = _moe(cfg, torch.bfloat16, seed=3)
    x = (torch.randn(9, 128, generator=torch.Generator().manual_seed(4)) * 0.5).to(DEVICE, torch.bfloat16)
    with K.use_backend(backend), torch.no_grad():
        _, ids = m.gate(x)
        p_all, y_all = ops.moe_expert_outputs(x, ids, m.gate_proj, m.up_proj, m.down_proj, num_experts=16)
        p_gen, y_gen = ops.moe_expert_outputs(x, ids, m.gate_proj, m.up_proj, m.down_proj)
        assert torch.equal(p_all, p_gen) and torch.equal(p_all, torch.arange(18, device=DEVICE))
        assert torch.equal(y_all, y_gen)
        p_half, y_half = ops.moe_expert_outputs(x, ids, m.gate_proj[8:], m.up_proj[8:], m.down_proj[8:], first_expert=8)
        assert torch.equal(p_half, torch.nonzero(ids.reshape(-1) >= 8).squeeze(1))
        assert torch.equal(y_half, y_all[p_half])


def _reference_grads(m: MoE, x: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """The MoE layer in float64 plain torch with the given expert choice (top-k is not
    differentiable): HF GlmMoeDsa / DeepSeek-V3 - sigmoid scores, the chosen experts' scores
    gathered and normalized, times the scaling factor; the correction bias only selects."""
    c = m.gate.c
    p = {n: t.detach().double().cpu().requires_grad_() for n, t in m.named_parameters()}
    xd = x.detach().double().cpu().requires_grad_()
    ids = ids.cpu()
    scores = torch.sigmoid(xd @ p["gate.weight"].T)
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
    out = torch.zeros_like(xd)
    for j in range(ids.shape[1]):
        e = ids[:, j]
        h = torch.nn.functional.silu(torch.einsum("td,tid->ti", xd, p["gate_proj"][e])) \
            * torch.einsum("td,tid->ti", xd, p["up_proj"][e])
        out = out + w[:, j:j + 1] * torch.einsum("ti,tdi->td", h, p["down_proj"][e])
    s = p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"], p["shared_experts.down_proj.weight"]
    out = out + (torch.nn.functional.silu(xd @ s[0].T) * (xd @ s[1].T)) @ s[2].T
    out.backward(grad_out.double().cpu())
    return {"x": xd.grad, **{n: t.grad for n, t in p.items()}}


def _grads(m: MoE, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    m.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_()
    m(xx).backward(grad_out)
    return {"x": xx.grad, **{n: t.grad for n, t in m.named_parameters()}}


def _check_backward(m: MoE, x: torch.Tensor, tol: float) -> None:
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, x.dtype)
    with K.use_backend("triton"):
        got = _grads(m, x, grad_out)
        again = _grads(m, x, grad_out)
        with torch.no_grad():
            _, ids = m.gate(x)
    for name in got:
        assert got[name] is not None, name
        assert torch.equal(got[name], again[name]), f"{name}: gradient bits differ run to run"
    ref = _reference_grads(m, x, ids, grad_out)
    for name, r in ref.items():
        err = (got[name].double().cpu() - r).norm() / r.norm().clamp_min(1e-30)
        assert err < tol, f"{name}: relative error {err:.2e} vs the float64 reference"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_moe_backward_grouped_gemms(monkeypatch, dtype, tol):
    """The CUDA backward (grouped GEMMs, no per-expert loop), run here by the interpreter."""
    monkeypatch.setattr(ops, "_OWN_GRAD_DEVICES", ("cuda", "cpu"))
    calls = []
    backward = ops._GroupedLinearGrad.backward
    monkeypatch.setattr(ops._GroupedLinearGrad, "backward", staticmethod(lambda ctx, g: calls.append(1) or backward(ctx, g)))
    m = _moe(_tiny(), dtype, seed=5)
    x = (torch.randn(7, 128, generator=torch.Generator().manual_seed(6)) * 0.5).to(DEVICE, dtype)
    _check_backward(m, x, tol)
    assert len(calls) == 2 * 3                                        # two runs, gate/up/down each


# --------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["small", "glm5-experts"])
@pytest.mark.parametrize("tokens", [64, 1024])
def test_moe_forward_graph_capture_and_no_sync_on_gpu(preset, tokens):
    """set_sync_debug_mode("error") over the layer's forward, then a CUDA-graph capture whose
    replays equal eager runs bitwise on fresh inputs (decode- and prefill-sized batches)."""
    cfg = ModelConfig.preset("small") if preset == "small" else \
        ModelConfig.preset("glm5").replace(hidden_size=1024, moe_intermediate_size=256)   # 256 experts, top-8, glm5 routing
    m = _moe(cfg, torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    xs = [(torch.randn(tokens, cfg.hidden_size, generator=g) * 0.5).to(DEVICE, torch.bfloat16) for _ in range(3)]
    with K.use_backend("triton"), torch.no_grad():
        eager = [m(x) for x in xs]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = m(xs[0])                                     # compared after: torch.equal itself syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(again, eager[0])
        static = xs[0].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m(static)                                            # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(static)
        for x, want in zip(xs, eager):
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_backward_on_gpu():
    """Grouped-GEMM backward on CUDA: accurate against float64, the same bits run to run."""
    cfg = ModelConfig.preset("small").replace(hidden_size=256, moe_intermediate_size=128)
    m = _moe(cfg, torch.bfloat16, seed=8)
    x = (torch.randn(300, 256, generator=torch.Generator().manual_seed(9)) * 0.5).to(DEVICE, torch.bfloat16)
    _check_backward(m, x, 2e-2)
