"""Test-suite setup: Triton interprets on CPU-only machines; hypothesis stays small and fast."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit decorates a kernel.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's shapes are tiny: one intra-op thread is ~10x faster on a 2-core machine
# (no OpenMP spin-waits), and no test may depend on the thread count for its bits.
torch.set_num_threads(1)

from hypothesis import HealthCheck, settings  # noqa: E402
import pytest  # noqa: E402

settings.register_profile(
    "ci", max_examples=10, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

BACKENDS = ["torch", "triton"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_backend(monkeypatch):
    """The backend a CPU-only machine defaults to (torch), also on a CUDA machine, whose default
    is triton: for CPU-tier tests whose tensors live on the CPU. An environment variable, not
    `use_backend`, so threads the test starts compute with it too."""
    monkeypatch.setenv("ZEROKL_BACKEND", "torch")


def _tree_sum_last(x: torch.Tensor) -> torch.Tensor:
    """A pairwise fp32 tree over the last dim by explicit slice additions (IEEE, any machine)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.cat([x, torch.zeros_like(x[..., :1])], dim=-1)
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


@pytest.fixture
def shape_dependent_contract(monkeypatch):
    """Install, in place of the torch backend's exact contraction, an fp32 contraction whose
    K order depends on the operand shapes: a negative control that is batch- (or shard-)
    dependent on EVERY machine, not by a BLAS accident. `install(flip)` with
    flip(a, b) -> bool: the K terms are rotated by one place (other pairs in the tree) when it is true."""
    from zerokl.kernels import portable

    def install(flip):
        def contract(a, b, b_is_weight=False):
            products = a.float().unsqueeze(-2) * b.float().unsqueeze(-3)        # [..., M, N, K]
            return _tree_sum_last(products.roll(1, -1) if flip(a, b) else products)
        monkeypatch.setattr(portable, "contract", contract)
    return install
