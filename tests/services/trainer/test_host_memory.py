"""Page-locked host tensors of exactly their size (zerokl.services.trainer.host_memory): the offloaded
optimizer's state, which torch's pinned allocator would round up to powers of two."""
from __future__ import annotations

import gc
import pathlib

import pytest
import torch

from zerokl.services.trainer import host_memory
from zerokl.services.trainer.host_memory import pinned_copy, pinned_zeros

GPU = torch.cuda.is_available()


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (/proc/self/maps)."""
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


class _Driver:
    """What cudaHostRegister / cudaHostUnregister were asked, in order (the CPU machine has no CUDA driver)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, address: int, length: int, flags: int) -> int:  # noqa: N802 - the CUDA name
        assert _mapped(address) and length > 0 and flags == 1
        self.calls.append(("register", address))
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        assert _mapped(address), "unregistered after the pages were unmapped"
        self.calls.append(("unregister", address))
        return 0


def test_the_mapping_is_exactly_the_tensors_bytes_and_ends_with_its_last_view(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: driver)
    n = (3 << 20) + 5                                   # not a page multiple, far from a power of two
    t = host_memory._registered_bytes(n)
    address = t.data_ptr()
    assert t.numel() == n and t.dtype == torch.uint8 and address % 4096 == 0
    assert driver.calls == [("register", address)]
    assert torch.count_nonzero(t) == 0                  # the kernel's zero pages
    t[-1] = 7
    rows = t.view(-1)[:4096]                            # a view keeps the mapping alive
    del t
    gc.collect()
    assert driver.calls == [("register", address)] and _mapped(address)
    rows.fill_(1)
    del rows
    gc.collect()
    assert driver.calls == [("register", address), ("unregister", address)]


def test_a_failed_registration_says_so_and_leaves_no_mapping(monkeypatch):
    class Refusing(_Driver):
        def cudaHostRegister(self, address, length, flags):  # noqa: ANN001, ANN201, N802
            self.address = address
            return 2                                    # cudaErrorMemoryAllocation

    driver = Refusing()
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: driver)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 8192 bytes"):
        host_memory._registered_bytes(8192)
    assert not _mapped(driver.address)


@pytest.mark.parametrize("shape,dtype", [((5, 7), torch.bfloat16), ((), torch.float32), ((0, 3), torch.float32),
                                         ((2, 3, 4), torch.float16)])
def test_zeros_and_copies_have_the_shape_dtype_and_bits_asked_for(monkeypatch, shape, dtype):
    # Through the registered mapping even on a CPU machine (the driver recorded, not called), and the plain path.
    for registered in (True, False):
        if registered:
            monkeypatch.setattr(host_memory.torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(host_memory.torch.cuda, "cudart", _Driver)
        z = pinned_zeros(shape, dtype)
        assert z.shape == torch.Size(shape) and z.dtype == dtype and z.device.type == "cpu"
        assert torch.equal(z, torch.zeros(shape, dtype=dtype))
        src = torch.randn(shape).to(dtype)
        c = pinned_copy(src)
        assert (c.data_ptr() != src.data_ptr() or not src.numel()) and torch.equal(c.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8))
        del z, c
        gc.collect()                                    # released while the recorded driver stands in
        monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_on_cuda_the_state_is_pinned_at_its_exact_size_and_copies_both_ways_asynchronously():
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    n = 129 << 20                                       # 129 MiB: torch's pinned allocator would hold 256
    t = pinned_zeros((n // 2,), torch.bfloat16)
    assert t.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before   # not torch's allocator
    src = torch.randn(n // 2, device="cuda").to(torch.bfloat16)
    t.copy_(src, non_blocking=True)
    back = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back.view(torch.int16), src.view(torch.int16))
    address = t.data_ptr()
    del t
    gc.collect()
    assert not _mapped(address)                         # unregistered and unmapped with the tensor
