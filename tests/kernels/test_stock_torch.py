"""The problem the library guards against is real on this machine: stock torch is not batch-invariant.

If these ever stop failing for stock torch, the invariance suite is not proving much on
this machine; they are the suite's evidence that it can see the failure mode.
"""
import torch


def _first_mismatch_shape():
    g = torch.Generator().manual_seed(0)
    for k, n in [(4096, 4096), (1024, 512), (512, 1024), (333, 777), (2048, 256)]:
        w = torch.randn(n, k, generator=g)
        for m in (7, 32, 64, 128, 256):
            x = torch.randn(m, k, generator=g)
            full = x @ w.T
            for i in range(m):
                if not torch.equal(x[i:i + 1] @ w.T, full[i:i + 1]):
                    return (m, n, k)
    return None


def test_plain_torch_mm_is_not_batch_invariant_here():
    assert _first_mismatch_shape() is not None, "torch.mm was batch-invariant for every probed shape"


def test_plain_torch_row_sum_is_not_batch_invariant_for_long_rows():
    x = torch.randn(48, 154880, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(x[:1].sum(-1), x.sum(-1)[:1])


def test_zerokl_linear_is_invariant_on_the_same_shapes():
    import zerokl.kernels as K
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g)
    x = torch.randn(128, 1024, generator=g)
    with K.use_backend("torch"):
        full = K.linear(x, w)
        assert all(torch.equal(K.linear(x[i:i + 1], w)[0], full[i]) for i in range(0, 128, 9))
