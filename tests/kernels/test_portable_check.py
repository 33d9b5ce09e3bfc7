"""The torch backend's CPU primitives against their references (kernels/zerokl/kernels/portable_check.py), on
this machine's native code path; tests/kernels/test_stock_torch.py repeats it under every ATen
and MKL code path and compares the digests."""
import torch

from zerokl.kernels import portable
from zerokl.kernels.portable_check import check_primitives


def test_every_primitive_matches_its_reference_on_a_million_random_inputs():
    results = check_primitives(1 << 20)
    wrong = {r.name: f"{r.mismatches} of {r.cases}" for r in results if r.mismatches}
    assert not wrong, f"primitives that disagree with their correctly rounded or exact references: {wrong}"
    assert all(r.cases > 10_000 for r in results)


def test_the_check_catches_an_inexact_square_root(monkeypatch):
    """A square root one ulp off on a few inputs (as MKL's vector math is on some CPUs) is found."""
    def off_by_one_ulp(x):
        y = portable.sqrt32(x)
        nudge = (y.view(torch.int32) & 0xFF) == 0x5A                  # ~1 in 256 results
        return torch.where(nudge, (y.view(torch.int32) + 1).view(torch.float32), y)
    monkeypatch.setattr(portable, "sqrt", off_by_one_ulp)
    bad = {r.name: r.mismatches for r in check_primitives(1 << 14) if r.mismatches}
    assert bad.get("sqrt", 0) > 0 and bad.get("rms_norm, layer_norm", 0) > 0, bad


def test_sqrt_is_ieee_on_the_edges():
    x = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -2.0, -float("inf"), 1.4e-45, 4.0, 2.0])
    out = portable.sqrt(x)
    assert torch.equal(out[:3].view(torch.int32), torch.tensor([0.0, -0.0, float("inf")]).view(torch.int32))
    assert torch.isnan(out[3:6]).all()
    assert out[6].item() == 3.743392066509216e-23 and out[7].item() == 2.0 and out[8].item() == 1.4142135381698608


def test_sqrt_gradient_is_the_textbook_one():
    x = torch.tensor([0.25, 4.0, 9.0], requires_grad=True)
    portable.sqrt(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 0.25, 1.0 / 6.0]))
