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
    """With more than one thread, one long row's sum is split across threads; inside a
    batch it is summed serially."""
    x = torch.randn(48, 154880, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not torch.equal(x[:1].sum(-1), x.sum(-1)[:1])
    finally:
        torch.set_num_threads(threads)


def test_zerokl_linear_is_invariant_on_the_same_shapes():
    import zerokl.kernels as K
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g)
    x = torch.randn(128, 1024, generator=g)
    with K.use_backend("torch"):
        full = K.linear(x, w)
        assert all(torch.equal(K.linear(x[i:i + 1], w)[0], full[i]) for i in range(0, 128, 9))


def test_plain_torch_mm_changes_a_columns_bits_with_n_here():
    """Column parallelism's failure mode: for large K, MKL's sgemm sums a column in a
    different order when the weight has fewer columns (a TP shard), even on 16-row tiles."""
    g = torch.Generator().manual_seed(0)

    def differs(k, n, c):
        x, w = torch.randn(16, k, generator=g), torch.randn(n, k, generator=g)
        full = x @ w.T
        return any(not torch.equal(x @ w[r:r + c].T, full[:, r:r + c]) for r in range(0, n, c))
    assert any(differs(k, n, c) for k, n, c in [(1024, 256, 64), (2048, 256, 64), (4096, 512, 128)])


def test_plain_torch_mm_bits_depend_on_the_thread_count_here():
    """A CPU TP rank gets a share of the cores: MKL threads the K sum of small GEMMs for
    K >= 1024 (and of long row sums), so stock bits change with torch.get_num_threads()."""
    g = torch.Generator().manual_seed(0)
    x, w, v = torch.randn(16, 2048, generator=g), torch.randn(2048, 128, generator=g), torch.randn(16, 154880, generator=g)
    ones = torch.ones(154880, 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (x @ w, v @ ones)
        torch.set_num_threads(4)
        four = (x @ w, v @ ones)
    finally:
        torch.set_num_threads(before)
    assert not (torch.equal(one[0], four[0]) and torch.equal(one[1], four[1]))


def test_zerokl_torch_backend_bits_do_not_depend_on_threads_or_column_shards():
    import zerokl.kernels as K
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 2048, generator=g), torch.randn(256, 2048, generator=g)
    v = torch.randn(20, 154880, generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        with K.use_backend("torch"):
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                full = K.linear(x, w)
                assert all(torch.equal(K.linear(x, w[r:r + 64]), full[:, r:r + 64]) for r in range(0, 256, 64))
                results.append((full, K.split_linear(x, w), K.log_softmax(v)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
