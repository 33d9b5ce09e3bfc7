"""The weight store's cache of decoded shards (issue 49): accepting or reading the n-th delta of a chain decodes
one layer, not n; a miss (a restart on a wiped cache) decodes the chain; a wrong entry is never accepted or
served. On a local directory and on a real S3 server (see conftest). Counted by the store's counters and by a spy
on the backend's reads, never by time."""
from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from zerokl.services.runtime import DataLoss
from zerokl.services.weightstore import delta
from zerokl.services.weightstore.backends import StorageBackend
from zerokl.services.weightstore.store import VersionStore

from conftest import S3_KEY, S3_SECRET
from test_weightstore_delta import NAME, SPEC, step, weights, write


def spy_reads(backend: StorageBackend, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of every object the backend reads from now on."""
    keys: list[str] = []
    real = backend.iter_read

    def iter_read(key: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        keys.append(key)
        return real(key, *args, **kwargs)
    monkeypatch.setattr(backend, "iter_read", iter_read)
    return keys


def stored_shards_read(keys: list[str]) -> list[str]:
    """The stored versions' objects of the weights file among ``keys`` (not manifests, not the upload's staging)."""
    return [k for k in keys if k.startswith(("deltas/", "versions/")) and k.endswith(NAME)]


def publish(store: VersionStore, tmp_path: pathlib.Path, states: list, i: int) -> None:
    """Version ``v<i>``: the next state, a delta against ``v<i-1>`` (v1: whole)."""
    states.append(step(states[-1], i) if states else weights())
    store.publish_dir(write(tmp_path / f"v{i}", states[-1]), f"v{i}", SPEC,
                      base=(f"v{i - 1}", tmp_path / f"v{i - 1}") if i > 1 else None)


def assert_reads_back(store: VersionStore, version: str, tmp_path: pathlib.Path) -> None:
    got = b"".join(c.data for c in store.iter_shard(version, NAME))
    assert got == (tmp_path / version / NAME).read_bytes()


def test_accepting_and_reading_the_nth_delta_decodes_one_layer_not_the_chain(
        backend: StorageBackend, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = delta.MAX_DEPTH + 1             # v1 whole, v2..v9 deltas: v9 sits on 8
    cached = VersionStore(backend, cache_dir=tmp_path / "cache")
    states: list = []
    for i in range(1, n):
        publish(cached, tmp_path, states, i)
    assert cached.get_manifest(f"v{n - 1}").shard(NAME).depth == n - 2
    keys = spy_reads(backend, monkeypatch)
    before = cached.delta_stats.copy()
    publish(cached, tmp_path, states, n)
    assert cached.get_manifest(f"v{n}").shard(NAME).depth == n - 1 == delta.MAX_DEPTH
    # Accepting v9's delta decoded it over the cached v8: one layer, and no stored object of the chain was read.
    assert cached.delta_stats["accept_layers"] - before["accept_layers"] == 1
    assert cached.delta_stats["cache_hit"] - before["cache_hit"] == 1
    assert stored_shards_read(keys) == []
    # A replica reading the newest version gets the cached, checked bytes: nothing decoded, no chain read.
    keys.clear()
    assert_reads_back(cached, f"v{n}", tmp_path)
    assert stored_shards_read(keys) == [] and cached.delta_stats["read_layers"] == 0
    # The same read without the cache decodes v9 over v8 .. v2 over v1: the chain the cache saves.
    keys.clear()
    uncached = VersionStore(backend, cache_bytes=0)
    assert_reads_back(uncached, f"v{n}", tmp_path)
    assert uncached.delta_stats["read_layers"] == n - 1
    assert sorted(stored_shards_read(keys)) == sorted([f"deltas/v{i}/{NAME}" for i in range(2, n + 1)] * 2
                                                      + [f"versions/v1/{NAME}"])   # (headers, then bodies)
    # Every accepted delta of the chain cost one layer but v3's, which decoded v2 too (v2, one delta over a whole
    # file, is not cached): n - 1 deltas, n layers (not 1 + 2 + ... + n - 1).
    assert cached.delta_stats["accept_layers"] == n and cached.delta_stats["cache_rejected"] == 0
    # One entry per shard name: the newest version's (config.json went whole: nothing to decode, nothing cached).
    assert [(name, version) for name, version, _ in cached.cache.entries()] == [(NAME, f"v{n}")]


def test_deltas_over_one_whole_base_leave_the_cache_empty(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    """A trainer recording every version against its start (``--record-deltas start``): each delta is one layer
    over a whole file, so accepting and reading it decodes one layer without a cache, and the cache keeps no
    copy of the model (which a co-located job's disk cannot hold)."""
    store = VersionStore(backend, cache_dir=tmp_path / "cache")
    states = [weights()]
    store.publish_dir(write(tmp_path / "v1", states[0]), "v1", SPEC)
    for i in range(2, 6):
        states.append(step(states[-1], i))
        store.publish_dir(write(tmp_path / f"v{i}", states[-1]), f"v{i}", SPEC, base=("v1", tmp_path / "v1"))
        assert store.get_manifest(f"v{i}").shard(NAME).depth == 1
    assert store.delta_stats["accept_layers"] == 4 and list(store.cache.entries()) == []
    for i in range(1, 6):
        assert_reads_back(store, f"v{i}", tmp_path)
    assert store.delta_stats["read_layers"] == 4 and list(store.cache.entries()) == []


def test_a_cache_miss_decodes_through_the_chain_and_refills_the_cache(
        backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    cache = tmp_path / "cache"
    states: list = []
    store = VersionStore(backend, cache_dir=cache)
    for i in range(1, 6):
        publish(store, tmp_path, states, i)
    # The store restarts on a wiped cache: nothing is lost, the chain (v5 -> v4 -> v3 -> v2 -> v1) decodes.
    shutil.rmtree(cache)
    store = VersionStore(backend, cache_dir=cache)
    publish(store, tmp_path, states, 6)
    assert store.delta_stats["accept_layers"] == 5 and store.delta_stats["cache_miss"] == 5
    assert store.delta_stats["cache_hit"] == 0
    for i in range(1, 7):
        assert_reads_back(store, f"v{i}", tmp_path)
    # v6's decoded bytes, checked, went into the cache: v7 costs one layer again.
    publish(store, tmp_path, states, 7)
    assert store.delta_stats["accept_layers"] == 5 + 1
    # A read after a restart fills an empty cache too: the first read of v7 decodes the chain, the second none.
    shutil.rmtree(cache)
    store = VersionStore(backend, cache_dir=cache)
    assert_reads_back(store, "v7", tmp_path)
    assert store.delta_stats["read_layers"] == 6
    assert_reads_back(store, "v7", tmp_path)
    assert store.delta_stats["read_layers"] == 6 and store.delta_stats["cache_hit"] == 1


def _flip_in_place(path: pathlib.Path) -> None:
    """Change one byte of ``path`` and restore its times: the file looks as it did (same inode, size, mtime)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_corrupt_cache_entry_is_never_accepted_or_served(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    store = VersionStore(backend, cache_dir=tmp_path / "cache")
    states: list = []
    for i in range(1, 4):
        publish(store, tmp_path, states, i)
    [(_, _, sha3)] = store.cache.entries()
    entry = tmp_path / "cache" / NAME / f"{sha3}-v3"
    # The base's entry rots without a trace the store could see: v4's delta decodes over it to the wrong bytes,
    # so the store checks the entry, drops it, decodes the chain (v3 -> v2 -> v1) and accepts v4's real bytes.
    _flip_in_place(entry)
    before = store.delta_stats.copy()
    publish(store, tmp_path, states, 4)
    assert store.delta_stats["cache_rejected"] == 1
    assert store.delta_stats["accept_layers"] - before["accept_layers"] == 1 + 3     # the wrong try, then the chain
    assert_reads_back(store, "v4", tmp_path)
    [(name, version, _)] = store.cache.entries()
    assert (name, version) == (NAME, "v4")
    # An entry that changed on disk (new mtime) is hashed before it is served: dropped, the chain read instead.
    [(_, _, sha4)] = store.cache.entries()
    entry = tmp_path / "cache" / NAME / f"{sha4}-v4"
    data = bytearray(entry.read_bytes())
    data[len(data) // 3] ^= 0x01
    entry.write_bytes(bytes(data))
    assert_reads_back(store, "v4", tmp_path)
    assert store.delta_stats["cache_rejected"] == 2 and not entry.exists()
    # One that changed without a trace is served only up to the last chunk: the read fails DATA_LOSS (never the
    # whole wrong shard), the entry goes, and the next read decodes the chain.
    assert_reads_back(store, "v4", tmp_path)      # (the chain's read refilled the cache)
    [(_, _, sha4)] = store.cache.entries()
    _flip_in_place(entry)
    with pytest.raises(DataLoss, match=NAME):
        list(store.iter_shard("v4", NAME))
    assert store.delta_stats["cache_rejected"] == 3 and not entry.exists()
    assert_reads_back(store, "v4", tmp_path)
    # And a new process never trusts what it finds: it hashes an entry before serving it.
    _flip_in_place(entry)
    fresh = VersionStore(backend, cache_dir=tmp_path / "cache")
    assert_reads_back(fresh, "v4", tmp_path)
    assert fresh.delta_stats["cache_rejected"] == 1


def test_the_server_keeps_the_cache_beside_the_data_or_names_one_per_bucket(tmp_path: pathlib.Path,
                                                                            s3_endpoint: str) -> None:
    from zerokl.services.weightstore.backends import LocalDirBackend, S3Backend
    from zerokl.services.weightstore.server import build_parser, cache_dir_from_args

    args = build_parser().parse_args(["--root", str(tmp_path / "root")])
    assert cache_dir_from_args(args, LocalDirBackend(tmp_path / "root")) == (tmp_path / "root" / ".decoded").resolve()
    buckets = [S3Backend(s3_endpoint, f"zerokl-cache-{i}", S3_KEY, S3_SECRET, secure=False, region="us-east-1")
               for i in range(2)]
    dirs = [cache_dir_from_args(build_parser().parse_args([]), b) for b in buckets]
    assert dirs[0] != dirs[1] and all(d.name.startswith("zerokl-weight-store-") for d in dirs)
    assert cache_dir_from_args(build_parser().parse_args(["--cache-dir", str(tmp_path / "c")]), buckets[0]) \
        == tmp_path / "c"
    assert VersionStore(buckets[0], cache_dir=tmp_path / "c", cache_bytes=0).cache is None
