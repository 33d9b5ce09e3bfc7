"""A record whose weight store has no room (the H100 run of the GLM-5 slice's co-located job: its disk nearly full):
the record fails for good with the store's own words, instead of an outage (UNAVAILABLE) retried forever.

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its record process a real child, its
store a real `zerokl serve weight-store` process whose disk is made full for real: a file size limit set on the
store's process (RLIMIT_FSIZE through prlimit; writes past it fail with EFBIG, as a full disk's with ENOSPC).

- RecordWeights answers INTERNAL (the record failed: not durable) with the store's RESOURCE_EXHAUSTED message,
  naming its root and the bytes it could not write, and the record's files leave the trainer's disk; the store
  keeps the upload as far as it acknowledged it (a refusal is not a reason to drop it and start over).
- With room again, the version shared again by the trainer still on it is recorded (the store resumes the upload it
  kept) and reads back equal to what was shared.
"""
from __future__ import annotations

import asyncio
import pathlib
import resource
import subprocess
from typing import Awaitable, Callable

import grpc
import pytest
import torch

from zerokl.kernels.model import Model
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.sync import open_shared

from test_trainer_service import _status, trainer_server
from test_trainer_supersede import _store

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit (Linux) to fill the disk")]

LIMIT = MAX_CHUNK_BYTES + 1024      # a file's first chunk is stored, its second refused


def _file_size_limit(pid: int, limit: int) -> None:
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit if limit != resource.RLIM_INFINITY else hard, hard))


def run_then_read_back(main: Callable[[], Awaitable[str]], proc: subprocess.Popen, root: pathlib.Path,
                       tmp_path: pathlib.Path, shared: dict[str, torch.Tensor]) -> None:
    """Run a test's ``main`` (it returns the version it got recorded in the end) beside the store process ``proc``,
    stop the store, and read that version back from the store's ``root``: the trainer's ``shared`` tensors bit for
    bit."""
    try:
        name = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
    store = VersionStore(LocalDirBackend(root))
    store.fetch(name, tmp_path / "read")
    loaded = Model.from_pretrained(tmp_path / "read").state_dict()
    assert all(torch.equal(loaded[k], shared[k]) for k in shared)


def test_a_store_with_no_room_fails_the_record_for_good_with_its_message(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "w"
    proc, address = _store(root, tmp_path / "store.log")
    shared: dict[str, torch.Tensor] = {}

    async def main() -> str:
        async with trainer_server(address, "--run", "full") as (client, service):
            _file_size_limit(proc.pid, LIMIT)
            manifest, _, desc = await client.share_weights(weights_only=True)
            name = manifest.version
            shared.update({k: v.clone() for k, v in open_shared(desc).items()})
            assert sum(v.numel() * v.element_size() for v in shared.values()) > LIMIT    # more than the store holds
            err = await _status(asyncio.wait_for(client.record_weights(name), 120))
            assert err.code() is grpc.StatusCode.INTERNAL, err
            said = err.details()
            assert f"refused {name}" in said and "has no room" in said and str(root.resolve()) in said, said
            assert f"writing {MAX_CHUNK_BYTES} bytes" in said and f"{name} is not recorded, and is not durable" in said
            assert service._records[name].directory is None     # its files went: never uploaded again
            # The store kept what it acknowledged (the upload was not dropped to start over): the file's first chunk.
            held = VersionStore(LocalDirBackend(root))
            assert name not in {m.version for m in held.manifests()}
            upload = held.begin_upload(name)    # the open upload of the version (a new, empty one if it was dropped)
            assert {(s.name, s.received) for s in upload.shards if not s.complete} == \
                {("model.safetensors", MAX_CHUNK_BYTES)}

            # Room again: shared again (the trainer is still on it: the same bytes), it is recorded.
            _file_size_limit(proc.pid, resource.RLIM_INFINITY)
            again, _, desc2 = await client.share_weights(weights_only=True)
            assert (again.version, desc2.checksum) == (name, desc.checksum)
            recorded = await asyncio.wait_for(client.record_weights(name), 120)
            assert recorded.manifest is not None and recorded.manifest.version == name
            return name
    run_then_read_back(main, proc, root, tmp_path, shared)
