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
