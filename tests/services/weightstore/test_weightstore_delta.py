"""Delta shards (issue 49): a version's files stored as what changed since an earlier version's, on a local
directory and on a real S3 server (see conftest). Reads rebuild every file bit for bit; unchanged bytes are not
written again; deleting and collecting versions never removes bytes another version's delta reads."""
from __future__ import annotations

import hashlib
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerokl.services.runtime import DataLoss, FailedPrecondition
from zerokl.services.runtime.chunks import split_bytes
from zerokl.services.weightstore import delta
from zerokl.services.weightstore.backends import StorageBackend
from zerokl.services.weightstore.store import DeltaSpec, VersionSpec, VersionStore

SPEC = VersionSpec(step=1, metadata={"run": "delta"})
NAME = "model.safetensors"


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 tensors over four 4 MiB frames (one of them inside a tensor no step changes)."""
    g = torch.Generator().manual_seed(seed)
    return {"a": (torch.randn(1024, 1536, generator=g) * 0.02).bfloat16(),
            "frozen": (torch.randn(4096, 1024, generator=g) * 0.02).bfloat16(),
            "z": (torch.randn(1024, 1536, generator=g) * 0.02).bfloat16()}


def step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.05) -> dict[str, torch.Tensor]:
    """An RL-like update: a few elements of the trained tensors move by one bf16 step; "frozen" does not move."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in state.items():
        if name == "frozen":
            out[name] = t.clone()
            continue
        bits = t.view(torch.int16).clone()
        moved = torch.rand(t.shape, generator=g) < fraction
        bits[moved] += 1
        out[name] = bits.view(torch.bfloat16)
    return out


def write(directory: pathlib.Path, state: dict[str, torch.Tensor]) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / NAME), metadata={"format": "pt"})
    (directory / "config.json").write_text('{"hidden_size": 64}')
    return directory


def stored_bytes(backend: StorageBackend, prefix: str) -> int:
    return sum(o.size for o in backend.list(prefix))


def chain(store: VersionStore, tmp_path: pathlib.Path, n: int) -> list[dict[str, torch.Tensor]]:
    """Versions v1 (whole) .. vn, each a delta against the one before; their states."""
    states = [weights()]
    store.publish_dir(write(tmp_path / "v1", states[0]), "v1", SPEC)
    for i in range(2, n + 1):
        states.append(step(states[-1], i))
        store.publish_dir(write(tmp_path / f"v{i}", states[-1]), f"v{i}", SPEC, base=(f"v{i - 1}", tmp_path / f"v{i - 1}"))
    return states


def assert_reads_back(store: VersionStore, version: str, state: dict[str, torch.Tensor], dest: pathlib.Path,
                      src: pathlib.Path) -> None:
    store.fetch(version, dest)
    assert (dest / NAME).read_bytes() == (src / NAME).read_bytes()
    loaded = load_file(str(dest / NAME))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_delta_chain_reads_back_bit_for_bit_and_writes_only_what_changed(backend: StorageBackend,
                                                                          tmp_path: pathlib.Path) -> None:
    store = VersionStore(backend)
    states = chain(store, tmp_path, 4)
    size = (tmp_path / "v1" / NAME).stat().st_size
    for i, state in enumerate(states, 1):
        manifest = store.get_manifest(f"v{i}")
        shard = manifest.shard(NAME)
        assert shard.size == size and shard.sha256 == hashlib.sha256((tmp_path / f"v{i}" / NAME).read_bytes()).hexdigest()
        if i == 1:
            assert (shard.base, shard.depth, shard.stored_bytes) == ("", 0, size)
        else:
            # A delta against the version before, a fraction of the file: 5% of two thirds of the elements moved.
            assert (shard.base, shard.depth) == (f"v{i - 1}", i - 1)
            assert shard.stored_bytes < 0.2 * size and manifest.stored_size < manifest.total_size
            assert stored_bytes(backend, f"deltas/v{i}/") == shard.stored_bytes
            assert stored_bytes(backend, f"versions/v{i}/") == manifest.shard("config.json").size
            # The unchanged middle frame costs nothing: its payload is empty.
            header = store._delta_header(f"deltas/v{i}/{NAME}")
            assert 0 in header.lengths and header.base.version == f"v{i - 1}"
        assert_reads_back(store, f"v{i}", state, tmp_path / f"out{i}", tmp_path / f"v{i}")
    # The config file, unchanged, is sent whole (a delta of a few bytes is not smaller than its header).
    assert store.get_manifest("v4").shard("config.json").base == ""


def test_a_delta_that_does_not_decode_to_the_declared_file_is_refused_and_a_corrupt_one_never_served(
        backend: StorageBackend, tmp_path: pathlib.Path, corrupt) -> None:  # noqa: ANN001
    store = VersionStore(backend)
    states = chain(store, tmp_path, 2)
    nxt = step(states[1], 3)
    write(tmp_path / "v3", nxt)
    new = (tmp_path / "v3" / NAME).read_bytes()
    good = delta.encode(new, (tmp_path / "v2" / NAME).read_bytes(),
                        delta.DeltaBase("v2", NAME, len(new), store.get_manifest("v2").shard(NAME).sha256))
    assert good is not None
    upload = store.begin_upload("v3")
    # Declared as the file of v1's content: it decodes to other bytes, so the store refuses it (and resets it).
    old = (tmp_path / "v1" / NAME).read_bytes()
    writer = store.shard_writer(upload.upload_id, NAME, len(new), hashlib.sha256(old).hexdigest(),
                                DeltaSpec("v2", len(good), hashlib.sha256(good).hexdigest()))
    with pytest.raises(DataLoss, match="decodes to"):
        for chunk in split_bytes(good):
            writer.write(chunk)
    [status] = store.upload_status(upload.upload_id).shards
    assert (status.received, status.complete) == (0, False) and backend.list("deltas/v3/") == []
    store.abort_upload(upload.upload_id)
    # A base the store cannot use is FAILED_PRECONDITION (type BASE): unpublished, or of another size.
    upload = store.begin_upload("v3")
    with pytest.raises(FailedPrecondition, match="v9 is not published") as err:
        store.shard_writer(upload.upload_id, NAME, len(new), hashlib.sha256(new).hexdigest(),
                           DeltaSpec("v9", len(good), hashlib.sha256(good).hexdigest()))
    assert err.value.precondition_violations[0].type == "BASE"
    with pytest.raises(FailedPrecondition, match="not 12"):
        store.shard_writer(upload.upload_id, NAME, 12, hashlib.sha256(b"x" * 12).hexdigest(),
                           DeltaSpec("v2", len(good), hashlib.sha256(good).hexdigest()))
    store.abort_upload(upload.upload_id)
    # A stored delta whose bytes rot is never served whole: DATA_LOSS naming the shard. (Read by a store without
    # the cache of decoded shards: this one's cache still holds v2's checked bytes, and serves those.)
    data = bytearray(backend.read_bytes(f"deltas/v2/{NAME}"))
    data[-3] ^= 0xFF
    corrupt(f"deltas/v2/{NAME}", bytes(data))
    with pytest.raises(DataLoss, match=NAME):
        list(VersionStore(backend, cache_bytes=0).iter_shard("v2", NAME))


def test_deleting_and_collecting_versions_keeps_the_bytes_a_later_delta_reads(backend: StorageBackend,
                                                                             tmp_path: pathlib.Path) -> None:
    store = VersionStore(backend)
    states = chain(store, tmp_path, 4)
    whole = backend.stat(f"versions/v1/{NAME}").size
    # v4 failed its canary: deleting it removes its own delta only; v3, v2 and v1 (which it read) stay readable.
    store.delete("v4")
    assert backend.list("deltas/v4/") == [] and backend.list("versions/v4/") == []
    assert_reads_back(store, "v3", states[2], tmp_path / "o3", tmp_path / "v3")
    # The version the next step would publish under that name is free again.
    store.publish_dir(write(tmp_path / "v4b", step(states[2], 44)), "v4", SPEC, base=("v3", tmp_path / "v3"))
    # Deleting a middle version (v2) keeps its bytes: v3 is a delta of it. Its name stays taken meanwhile.
    store.delete("v2")
    assert [m.version for m in store.manifests()] == ["v1", "v3", "v4"]
    assert stored_bytes(backend, "deltas/v2/") > 0
    assert_reads_back(store, "v3", states[2], tmp_path / "o3b", tmp_path / "v3")
    with pytest.raises(FailedPrecondition, match="still the base") as err:
        store.begin_upload("v2")
    assert err.value.precondition_violations[0].type == "RETAINED"
    # Retention keeps the newest version and what its chain reads (v3, v2, v1's objects), nothing else.
    result = store.gc(keep_last=1)
    assert set(result.deleted) == {"v1", "v3"} and [m.version for m in store.manifests()] == ["v4"]
    assert backend.stat(f"versions/v1/{NAME}").size == whole     # (its config.json went: nothing reads it)
    store.fetch("v4", tmp_path / "o4")
    assert (tmp_path / "o4" / NAME).read_bytes() == (tmp_path / "v4b" / NAME).read_bytes()
    # The last version gone: every stored byte goes with it, and every name is free again.
    store.delete("v4")
    assert backend.list("versions/") == [] and backend.list("deltas/") == []
    store.begin_upload("v2")


def test_an_open_uploads_delta_keeps_its_base_through_a_delete(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    store = VersionStore(backend)
    states = chain(store, tmp_path, 2)
    write(tmp_path / "v3", step(states[1], 3))
    upload = store.begin_upload("v3")
    store._put_shard_delta(upload.upload_id, NAME, (tmp_path / "v3" / NAME).read_bytes(), "v2", tmp_path / "v2" / NAME)
    store.put_shard_file(upload.upload_id, "config.json", tmp_path / "v3" / "config.json")
    # v2 and v1 are deleted while v3's upload, whose delta reads v2 (and so v1), is open.
    store.delete("v2")
    store.delete("v1")
    assert stored_bytes(backend, "deltas/v2/") > 0 and stored_bytes(backend, "versions/v1/") > 0
    store.commit(upload.upload_id, [NAME, "config.json"], SPEC)
    store.fetch("v3", tmp_path / "o3")
    assert (tmp_path / "o3" / NAME).read_bytes() == (tmp_path / "v3" / NAME).read_bytes()


def test_chains_stop_at_max_depth_with_a_whole_file(tmp_path: pathlib.Path) -> None:
    from zerokl.services.weightstore.backends import LocalDirBackend
    store = VersionStore(LocalDirBackend(tmp_path / "store"))
    chain(store, tmp_path, delta.MAX_DEPTH + 2)
    depths = [store.get_manifest(f"v{i}").shard(NAME).depth for i in range(1, delta.MAX_DEPTH + 3)]
    assert depths == [*range(delta.MAX_DEPTH + 1), 0]
