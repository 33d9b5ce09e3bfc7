"""A weights-only record uploaded from the record process's memory (``--record-deltas start`` and ``off``): no file of
it on the disk, the store holding the same version bit for bit as the file path would (docs/perf.md, "The slice's
job: the disk": for the GLM-5 slice that file was a whole extra copy of the model's 22.7 GiB on a 64 GiB disk).

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its record process a real child:

- ``start``: every record's manifest holds the sha256 of each file :func:`write_snapshot` writes for the shared
  bytes (the file path's record), and no record directory ever appears in the trainer's TMPDIR (only the start's
  delta base, hard links into the store); ``previous`` still writes its records there (the next one's base) and
  records the same bits;
- ``off``, against a real `zerokl serve weight-store` that cuts the first PutShard stream after acknowledging one
  chunk (UNAVAILABLE, an outage): RecordWeights' retry resumes at the acknowledged offset, from the buffers, no file
  on disk, and the version reads back equal to what was shared;
- ``start``, the record process killed once it holds a record's files (the store stopped meanwhile): the files went
  with it, and the trainer writes them again from the export it keeps, then records them bit for bit.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
from typing import Iterator

import contextlib

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES
from zerokl.services.trainer import service as trainer_service
from zerokl.services.trainer.checkpointing import CheckpointSnapshot, write_snapshot
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.store import WeightsManifest
from zerokl.services.weightstore.sync import open_shared

from test_trainer_records import FLAGS, _store_with_start
from test_trainer_service import _prompts, _rollouts, trainer_server

pytestmark = pytest.mark.timeout(180)

RECORD_DIR = "zerokl-trainer-record-"
BASE_DIR = "zerokl-trainer-record-base-"


@contextlib.contextmanager
def _record_dirs_seen(tmp: pathlib.Path) -> Iterator[set[str]]:
    """The record directories (not delta bases) that appear in ``tmp`` while the block runs, looked for every ms: a
    record's directory lives from its write to its upload's end, far longer."""
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                seen.update(p.name for p in tmp.iterdir()
                            if p.name.startswith(RECORD_DIR) and not p.name.startswith(BASE_DIR))
            stop.wait(0.001)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def _file_path_sha256(tensors: dict[str, torch.Tensor], where: pathlib.Path) -> dict[str, str]:
    """sha256 of each file the file path writes for these serving weights (write_snapshot, as before this change)."""
    write_snapshot(CheckpointSnapshot(tensors, ModelConfig.preset("tiny"), torch.bfloat16), where)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in where.iterdir()}


def _shards(manifest: WeightsManifest) -> dict[str, str]:
    return {s.name: s.sha256 for s in manifest.shards}


@pytest.mark.parametrize("deltas", ["start", "previous"])
def test_a_record_from_memory_is_the_file_paths_bits_and_leaves_no_directory(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, deltas: str) -> None:
    store = _store_with_start(tmp_path, monkeypatch)
    shared: dict[str, dict[str, torch.Tensor]] = {}
    recorded: dict[str, WeightsManifest] = {}

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *FLAGS, "--init", "start-v0", "--record-deltas", deltas) \
                as (client, service):
            version = (await client.get_state()).weights_version
            for step in range(1, 3):
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, step), version), 4)
                manifest, _, desc = await client.share_weights(weights_only=True)
                version = manifest.version
                shared[version] = {k: v.clone() for k, v in open_shared(desc).items()}
                recorded[version] = (await client.record_weights(version)).manifest

    with _record_dirs_seen(tmp_path / "tmp") as seen:
        asyncio.run(main())
    if deltas == "start":
        assert not seen, seen       # its files were never on the disk
    else:
        assert seen                 # written there, the next record's base
    for i, (name, tensors) in enumerate(shared.items()):
        assert _shards(recorded[name]) == _file_path_sha256(tensors, tmp_path / "file-path" / str(i)), name
        assert recorded[name].shard("model.safetensors").base == ("start-v0" if deltas == "start" or i == 0
                                                                  else list(shared)[i - 1])
        store.fetch(name, tmp_path / "read" / name)
        loaded = Model.from_pretrained(tmp_path / "read" / name).state_dict()
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors), name


# `zerokl serve weight-store` whose PutShard, while the file argv[1] exists, cuts the stream with UNAVAILABLE on a
# shard's second chunk (after acknowledging the first) and removes the file: one outage. Each stream's first chunk
# offset is said on stderr.
_CUTTING_STORE = r"""
import os, sys
from zerokl.cli import main
from zerokl.services.runtime.errors import Unavailable
from zerokl.services.weightstore.service import WeightStoreServicer

put_shard = WeightStoreServicer.PutShard

async def put_shard_cut(self, request_iterator, context):
    async def requests():
        chunks = 0
        async for request in request_iterator:
            if request.WhichOneof("msg") == "chunk":
                chunks += 1
                if chunks == 1:
                    print(f"FIRST CHUNK AT {request.chunk.offset}", file=sys.stderr, flush=True)
                if chunks == 2 and os.path.exists(sys.argv[1]):
                    os.unlink(sys.argv[1])
                    print("CUT", file=sys.stderr, flush=True)
                    raise Unavailable("the stream was cut (by this test)")
            yield request
    async for status in put_shard(self, requests(), context):
        yield status

WeightStoreServicer.PutShard = put_shard_cut
sys.exit(main(["serve", "weight-store", *sys.argv[2:]]))
"""


def test_an_upload_cut_mid_way_resumes_from_memory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    root, flag, log = tmp_path / "w", tmp_path / "cut", tmp_path / "store.log"
    flag.touch()
    proc = subprocess.Popen([sys.executable, "-c", _CUTTING_STORE, str(flag), "--root", str(root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("weight-store listening on "), (line, log.read_text())
    shared: dict[str, torch.Tensor] = {}

    async def main() -> WeightsManifest:
        async with trainer_server(line.split()[3], "--run", "cut", "--record-deltas", "off") as (client, _):
            manifest, _, desc = await client.share_weights(weights_only=True)
            shared.update({k: v.clone() for k, v in open_shared(desc).items()})
            assert sum(v.numel() * v.element_size() for v in shared.values()) > MAX_CHUNK_BYTES    # 2 chunks or more
            return (await asyncio.wait_for(client.record_weights(manifest.version), 120)).manifest
    try:
        with _record_dirs_seen(tmp_path / "tmp") as seen:
            recorded = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
    said = log.read_text()
    assert said.count("CUT") == 1 and not flag.exists(), said
    # The cut shard's stream again, from the chunk the store acknowledged: the buffers were still there.
    assert f"FIRST CHUNK AT {MAX_CHUNK_BYTES}" in said, said
    assert not seen, seen
    store = VersionStore(LocalDirBackend(root))
    store.fetch(recorded.version, tmp_path / "read")
    loaded = Model.from_pretrained(tmp_path / "read").state_dict()
    assert all(torch.equal(loaded[k], shared[k]) for k in shared)


def test_a_record_process_killed_holding_a_record_in_memory_is_replaced_and_the_record_written_again(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_trainer_supersede import _store

    monkeypatch.setattr(trainer_service, "_STORE_CHECK_S", 0.2)     # a share asks the stopped store: sooner
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    proc, address = _store(tmp_path / "w", tmp_path / "store.log")
    shared: dict[str, torch.Tensor] = {}

    async def main() -> WeightsManifest:
        async with trainer_server(address, *FLAGS, "--run", "lost", "--record-deltas", "start") as (client, service):
            version = (await client.get_state()).weights_version
            first = (await client.share_weights(weights_only=True))[0].version
            await client.record_weights(first)      # the record process is up
            await client.grpo_step(_rollouts(service.trainer, _prompts(2, 1), version), 4)
            os.kill(proc.pid, signal.SIGSTOP)       # the upload waits: the record's files stay in the child
            try:
                manifest, _, desc = await client.share_weights(weights_only=True)
                shared.update({k: v.clone() for k, v in open_shared(desc).items()})
                record = service._records[manifest.version]
                while record.directory is None:
                    await asyncio.sleep(0.01)
                assert not record.directory.exists()    # held in the child's memory, not on the disk
                holder = service._recorder._process
                os.kill(holder.pid, signal.SIGKILL)
                holder.join(30)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            recorded = (await asyncio.wait_for(client.record_weights(manifest.version), 60)).manifest
            assert service._recorder._process.pid != holder.pid
            return recorded
    try:
        recorded = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
    assert _shards(recorded) == _file_path_sha256(shared, tmp_path / "file-path")
    store = VersionStore(LocalDirBackend(tmp_path / "w"))
    store.fetch(recorded.version, tmp_path / "read")
    loaded = Model.from_pretrained(tmp_path / "read").state_dict()
    assert all(torch.equal(loaded[k], shared[k]) for k in shared)
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith(RECORD_DIR)
                and not p.name.startswith(BASE_DIR)]
