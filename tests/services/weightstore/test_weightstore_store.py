"""VersionStore without gRPC, on a local directory and on a real S3 server (see conftest)."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import pathlib
from typing import Callable

import pytest

from zerokl.services.runtime import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, make_chunk, split_bytes
from zerokl.services.weightstore.backends import InvalidKey, LocalDirBackend, StorageBackend, validate_key
from zerokl.services.weightstore.store import VersionSpec, VersionStore

SPEC = VersionSpec(parent_version="v0", step=0, numerics_version="0.1.0", numerics_fingerprint="fp-a",
                   model_config={"hidden_size": 64, "architectures": ["GlmMoeDsaForCausalLM"]},
                   metadata={"run": "countdown"})


def make_checkpoint(d: pathlib.Path, seed: int = 0, big: int = 0) -> dict[str, bytes]:
    """A directory of shard files with distinct content; returns name -> bytes."""
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": json.dumps({"hidden_size": 64, "seed": seed}).encode(),
        "model-00001-of-00002.safetensors": hashlib.sha256(f"a{seed}".encode()).digest() * 1000,
        "model-00002-of-00002.safetensors": bytes(range(256)) * 40 + bytes([seed]) + b"\0" * big,
        "model.safetensors.index.json": b"{}",
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    return files


class Clock:
    """Deterministic commit times so "newest" is unambiguous."""

    def __init__(self) -> None:
        self.t = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        self.t += dt.timedelta(seconds=1)
        return self.t


def test_publish_list_fetch_round_trip(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    store = VersionStore(backend)
    files = make_checkpoint(tmp_path / "src")
    manifest = store.publish_dir(tmp_path / "src", "v1", SPEC)
    assert [s.name for s in manifest.shards] == sorted(files)
    assert {s.name: s.sha256 for s in manifest.shards} == {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    assert manifest.spec == SPEC
    [entry] = store.list_versions()
    assert entry.manifest == manifest and entry.pinned_by == ()
    assert store.get_manifest("latest") == manifest
    fetched = store.fetch("v1", tmp_path / "dst")
    assert fetched == manifest
    for name, data in files.items():
        assert (tmp_path / "dst" / name).read_bytes() == data
    assert json.loads((tmp_path / "dst" / "zerokl_manifest.json").read_text())["version"] == "v1"
    with pytest.raises(AlreadyExists):
        store.publish_dir(tmp_path / "src", "v1", SPEC)
    # Only the manifest, the shards and nothing of the upload remain in storage.
    assert {o.key for o in backend.list("")} == {"manifests/v1.json", *(f"versions/v1/{n}" for n in files)}


def test_unfinished_upload_is_invisible_and_abort_leaves_nothing(backend: StorageBackend,
                                                                  tmp_path: pathlib.Path) -> None:
    store = VersionStore(backend)
    make_checkpoint(tmp_path / "src")
    upload = store.begin_upload("v2")
    for path in sorted((tmp_path / "src").iterdir()):
        store.put_shard_file(upload.upload_id, path.name, path)  # every shard, but no commit
    assert store.list_versions() == [] and store.latest() is None
    with pytest.raises(NotFound):
        store.get_manifest("v2")
    with pytest.raises(NotFound):
        next(store.iter_shard("v2", "config.json"))
    assert all(s.complete for s in store.upload_status(upload.upload_id).shards)
    # A second publisher of v2 joins the open upload instead of clobbering it.
    assert store.begin_upload("v2").upload_id == upload.upload_id
    store.abort_upload(upload.upload_id)
    assert backend.list("") == []
    with pytest.raises(NotFound):
        store.upload_status(upload.upload_id)


def test_chunked_upload_resumes_and_verifies(backend: StorageBackend) -> None:
    store = VersionStore(backend)
    data = bytes(range(256)) * 20000  # 5 MB: two chunks
    sha = hashlib.sha256(data).hexdigest()
    upload = store.begin_upload("v3")
    chunks = list(split_bytes(data))
    first = store.shard_writer(upload.upload_id, "w.safetensors", len(data), sha)
    first.write(chunks[0])  # then the stream "breaks"
    [status] = store.upload_status(upload.upload_id).shards
    assert (status.received, status.complete) == (MAX_CHUNK_BYTES, False)
    resumed = store.shard_writer(upload.upload_id, "w.safetensors", len(data), sha)
    assert resumed.received == MAX_CHUNK_BYTES
    with pytest.raises(InvalidArgument, match="expected 4194304"):
        resumed.write(chunks[0])  # a stale chunk is refused, not appended
    resumed.write(chunks[1])
    assert resumed.complete
    with pytest.raises(FailedPrecondition, match="declared with size"):
        store.shard_writer(upload.upload_id, "w.safetensors", len(data), "0" * 64)
    empty = store.shard_writer(upload.upload_id, "empty.json", 0, hashlib.sha256(b"").hexdigest())
    assert empty.complete
    manifest = store.commit(upload.upload_id, ["w.safetensors", "empty.json"], VersionSpec())
    assert b"".join(c.data for c in store.iter_shard("v3", "w.safetensors")) == data
    assert [c.data for c in store.iter_shard("v3", "empty.json")] == [b""]
    assert manifest.total_size == len(data)


def test_bytes_that_do_not_match_the_declared_sha256_reset_the_shard(backend: StorageBackend) -> None:
    store = VersionStore(backend)
    upload = store.begin_upload("v4")
    writer = store.shard_writer(upload.upload_id, "w.bin", 6, hashlib.sha256(b"abcdef").hexdigest())
    writer.write(make_chunk(0, b"abc"))
    with pytest.raises(DataLoss, match="reset"):
        writer.write(make_chunk(3, b"xyz"))
    [status] = store.upload_status(upload.upload_id).shards
    assert (status.received, status.complete) == (0, False)
    with pytest.raises(FailedPrecondition) as err:
        store.commit(upload.upload_id, ["w.bin", "other.bin"], VersionSpec())
    assert {(v.type, v.subject) for v in err.value.precondition_violations} == {("INCOMPLETE", "w.bin"),
                                                                               ("MISSING", "other.bin")}


def test_corrupt_shard_is_never_served(backend: StorageBackend, corrupt: Callable[[str, bytes], None],
                                       tmp_path: pathlib.Path) -> None:
    store = VersionStore(backend)
    files = make_checkpoint(tmp_path / "src", big=2 * MAX_CHUNK_BYTES)
    store.publish_dir(tmp_path / "src", "v5", SPEC)
    name = "model-00002-of-00002.safetensors"
    good = files[name]
    flipped = bytearray(good)
    flipped[-1] ^= 1  # same size, last byte differs: only the full hash can tell
    corrupt(f"versions/v5/{name}", bytes(flipped))
    received = []
    with pytest.raises(DataLoss, match=name):
        for chunk in store.iter_shard("v5", name):
            received.append(chunk)
    assert sum(len(c.data) for c in received) < len(good)  # the last chunk was held back
    with pytest.raises(DataLoss, match=name):
        store.fetch("v5", tmp_path / "dst")
    assert not (tmp_path / "dst" / name).exists()
    corrupt(f"versions/v5/{name}", good[:-5])  # truncated
    with pytest.raises(DataLoss, match=name):
        list(store.iter_shard("v5", name, offset=10))
    corrupt(f"versions/v5/{name}", good + b"extra")  # too long
    with pytest.raises(DataLoss, match=name):
        list(store.iter_shard("v5", name))
    backend.delete(f"versions/v5/{name}")  # gone
    with pytest.raises(DataLoss, match="missing"):
        list(store.iter_shard("v5", name))
    # Other shards of the version are still served.
    assert b"".join(c.data for c in store.iter_shard("v5", "config.json")) == files["config.json"]


def test_pins_block_delete_and_gc_keeps_newest(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    clock = Clock()
    store = VersionStore(backend, clock=clock)
    for i in range(5):
        make_checkpoint(tmp_path / f"v{i}", seed=i)
        store.publish_dir(tmp_path / f"v{i}", f"v{i}", VersionSpec(step=i))
    assert [e.manifest.version for e in store.list_versions()] == ["v0", "v1", "v2", "v3", "v4"]
    assert store.pin("v1", "scheduler").pinned_by == ("scheduler",)
    assert store.pin("v1", "rl-run-7").pinned_by == ("rl-run-7", "scheduler")
    with pytest.raises(FailedPrecondition, match="pinned by rl-run-7, scheduler"):
        store.delete("v1")
    result = store.gc(keep_last=2)
    assert (sorted(result.deleted), result.kept_pinned) == (["v0", "v2"], ("v1",))
    assert [e.manifest.version for e in store.list_versions()] == ["v1", "v3", "v4"]
    assert not [o for o in backend.list("versions/") if o.key.startswith(("versions/v0/", "versions/v2/"))]
    store.unpin("v1", "scheduler")
    assert store.unpin("v1", "scheduler").pinned_by == ("rl-run-7",)  # idempotent
    store.unpin("v1", "rl-run-7")
    store.delete("v1")
    with pytest.raises(NotFound):
        store.delete("v1")
    with pytest.raises(NotFound):
        store.pin("v1", "scheduler")
    # Retention configured on the store applies after every commit.
    retained = VersionStore(backend, keep_last=1, clock=clock)
    make_checkpoint(tmp_path / "v9", seed=9)
    retained.publish_dir(tmp_path / "v9", "v9", VersionSpec())
    assert [e.manifest.version for e in retained.list_versions()] == ["v9"]


def test_stale_uploads_expire(backend: StorageBackend) -> None:
    clock = Clock()
    store = VersionStore(backend, upload_ttl_s=60, clock=clock)
    old = store.begin_upload("old")
    store.shard_writer(old.upload_id, "a.bin", 3, hashlib.sha256(b"abc").hexdigest()).write(
        next(split_bytes(b"abc")))
    clock.t += dt.timedelta(seconds=120)
    fresh = store.begin_upload("fresh")
    assert store.gc().expired_uploads == (old.upload_id,)
    assert {o.key.split("/")[1] for o in backend.list("uploads/")} == {fresh.upload_id}
    assert backend.list("versions/") == []


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "latest", "x" * 129, "v 1", "/abs"])
def test_bad_version_ids_are_refused(backend: StorageBackend, bad: str) -> None:
    store = VersionStore(backend)
    with pytest.raises(InvalidArgument):
        store.begin_upload(bad)


def test_bad_names_and_ids_are_refused(backend: StorageBackend) -> None:
    store = VersionStore(backend)
    upload = store.begin_upload("v1")
    sha = hashlib.sha256(b"").hexdigest()
    for name in ("../../etc/passwd", "a/b", ".x", ""):
        with pytest.raises(InvalidArgument):
            store.shard_writer(upload.upload_id, name, 0, sha)
    with pytest.raises(InvalidArgument, match="sha256"):
        store.shard_writer(upload.upload_id, "a", 0, "ABC")
    with pytest.raises(InvalidArgument, match="upload id"):
        store.upload_status("../uploads")
    with pytest.raises(NotFound):
        store.upload_status("0" * 32)
    with pytest.raises(InvalidArgument, match="owner"):
        store.pin("v1", "a/b")


def test_storage_keys_cannot_escape(tmp_path: pathlib.Path) -> None:
    for key in ("../x", "/abs", "a//b", "a/../b", "a/.", "", "a/"):
        with pytest.raises(InvalidKey):
            validate_key(key)
    root = tmp_path / "root"
    backend = LocalDirBackend(root)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(InvalidKey, match="outside"):
        backend.put_bytes("link/x", b"escape")
    assert not (tmp_path / "outside" / "x").exists()


def test_a_local_listing_skips_an_object_gone_while_it_is_listed(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A shard's stream commits (renames its staging file) in a thread of its own while another stream's declaration
    # lists the upload's staged parts: the file the walk saw is gone by its stat. The listing leaves it out; it
    # failed the other stream with FileNotFoundError (UNKNOWN) before.
    backend = LocalDirBackend(tmp_path)
    backend.put_bytes("uploads/u/parts/a/0", b"1")
    backend.put_bytes("uploads/u/parts/a/1", b"22")
    walk = os.walk

    def walk_then_rename(top: str, *args: object, **kw: object):  # noqa: ANN202
        for dirpath, dirs, files in walk(top, *args, **kw):
            if "0" in files:    # renamed after the walk listed it, before its stat
                os.replace(os.path.join(dirpath, "0"), tmp_path / "elsewhere")
            yield dirpath, dirs, files
    monkeypatch.setattr(os, "walk", walk_then_rename)
    assert [(o.key, o.size) for o in backend.list("uploads/u/parts/")] == [("uploads/u/parts/a/1", 2)]


def test_fetch_from_a_local_directory_links_whole_shards_and_checks_them(tmp_path: pathlib.Path) -> None:
    """A version fetched out of a local-directory store takes no second copy on disk: each shard it holds whole is
    hard-linked (the store never writes a published file in place) and checked against the manifest first; one
    whose bytes went bad is refused as a streamed one, the store's file untouched."""
    backend = LocalDirBackend(tmp_path / "store")
    store = VersionStore(backend)
    files = make_checkpoint(tmp_path / "src", big=2 * MAX_CHUNK_BYTES)
    store.publish_dir(tmp_path / "src", "v1", SPEC)
    store.fetch("v1", tmp_path / "dst")
    for name, data in files.items():
        fetched, held = tmp_path / "dst" / name, backend.root / "versions" / "v1" / name
        assert fetched.read_bytes() == data
        assert fetched.stat().st_ino == held.stat().st_ino      # one file on disk, two names
    name = "model-00002-of-00002.safetensors"
    flipped = bytearray(files[name])
    flipped[-1] ^= 1                                           # same size: only the sha256 tells
    bad = backend.root / "versions" / "v1" / name
    tmp = bad.with_name("rot")
    tmp.write_bytes(bytes(flipped))
    tmp.replace(bad)
    with pytest.raises(DataLoss, match=name):
        store.fetch("v1", tmp_path / "dst2")
    assert not (tmp_path / "dst2" / name).exists() and not (tmp_path / "dst2" / f".{name}.partial").exists()
    assert bad.read_bytes() == bytes(flipped)                   # the store's own file is the store's to judge
    assert (tmp_path / "dst" / name).read_bytes() == files[name]     # a copy linked before keeps its bytes
