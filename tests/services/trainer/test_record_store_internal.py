"""A weight store whose own handler fails a record's upload with INTERNAL: the record fails for good with the store's
status and message, as a store with no room does, instead of dropping the upload and sending it all again.

INTERNAL from the store's handler is a bug, or a request it cannot take, on the store's side: a retry of the whole
upload meets it again. It is not grpc's INTERNAL "Internal error from Core" for a write that raced the stream's end
(the store client keeps the status the store ended the stream with, and a stream that ended with none of the store's
is UNAVAILABLE: an outage, resumed).

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its record process a real child, its
store a real `zerokl serve weight-store` process. The store's code has no INTERNAL of its own to provoke, so its
PutShard handler is given one here: while a flag file exists, it raises the store's `Internal` on a shard's second
chunk, with chunks in flight behind it (what the trainer's upload sends).

- RecordWeights answers INTERNAL (not durable) with the store's message; the store was asked once (the upload was
  not restarted) and keeps the chunk it acknowledged; the record's files leave the trainer's disk.
- The bug gone, the version shared again by the trainer still on it is recorded (the store resumes the upload it
  kept) and reads back equal to what was shared.
"""
from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

import grpc
import pytest
import torch

from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.sync import open_shared

from test_record_full_store import run_then_read_back
from test_trainer_service import _status, trainer_server

pytestmark = pytest.mark.timeout(180)

BUG = "the store's handler failed (a bug of the store's, given to it by this test)"

# `zerokl serve weight-store` with a PutShard that raises the store's Internal on a shard's second chunk while the file
# argv[1] exists (each time said on stderr).
_STORE = r"""
import os, sys
from zerokl.cli import main
from zerokl.services.runtime.errors import Internal
from zerokl.services.weightstore.service import WeightStoreServicer

put_shard = WeightStoreServicer.PutShard

async def put_shard_with_a_bug(self, request_iterator, context):
    async def requests():
        chunks = 0
        async for request in request_iterator:
            chunks += request.WhichOneof("msg") == "chunk"
            if chunks == 2 and os.path.exists(sys.argv[1]):
                print("INJECTED INTERNAL", file=sys.stderr, flush=True)
                raise Internal(sys.argv[2])
            yield request
    async for status in put_shard(self, requests(), context):
        yield status

WeightStoreServicer.PutShard = put_shard_with_a_bug
sys.exit(main(["serve", "weight-store", *sys.argv[3:]]))
"""


def _buggy_store(root: pathlib.Path, flag: pathlib.Path, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _STORE, str(flag), BUG, "--root", str(root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("weight-store listening on "):
        proc.kill()
        raise AssertionError(f"the weight store did not start: {line!r}; see {log}")
    return proc, line.split()[3]


def test_an_internal_status_from_the_store_fails_the_record_for_good_with_its_message(tmp_path: pathlib.Path) -> None:
    root, flag, log = tmp_path / "w", tmp_path / "bug", tmp_path / "store.log"
    flag.touch()
    proc, address = _buggy_store(root, flag, log)
    shared: dict[str, torch.Tensor] = {}

    async def main() -> str:
        async with trainer_server(address, "--run", "internal") as (client, service):
            manifest, _, desc = await client.share_weights(weights_only=True)
            name = manifest.version
            shared.update({k: v.clone() for k, v in open_shared(desc).items()})
            assert sum(v.numel() * v.element_size() for v in shared.values()) > MAX_CHUNK_BYTES    # 2 chunks or more
            err = await _status(asyncio.wait_for(client.record_weights(name), 120))
            assert err.code() is grpc.StatusCode.INTERNAL, err
            said = err.details()
            assert BUG in said and f"{name} is not recorded, and is not durable" in said, said
            assert "Internal error from Core" not in said, said
            assert service._records[name].directory is None     # its files went: never uploaded again
            # Asked once: the upload was not dropped and sent again. The store kept the chunk it acknowledged.
            assert log.read_text().count("INJECTED INTERNAL") == 1, log.read_text()
            held = VersionStore(LocalDirBackend(root))
            assert name not in {m.version for m in held.manifests()}
            upload = held.begin_upload(name)    # the open upload of the version (a new, empty one if it was dropped)
            assert {(s.name, s.received) for s in upload.shards if not s.complete} == \
                {("model.safetensors", MAX_CHUNK_BYTES)}

            # The bug gone: shared again (the trainer is still on it: the same bytes), it is recorded.
            flag.unlink()
            again, _, desc2 = await client.share_weights(weights_only=True)
            assert (again.version, desc2.checksum) == (name, desc.checksum)
            recorded = await asyncio.wait_for(client.record_weights(name), 120)
            assert recorded.manifest is not None and recorded.manifest.version == name
            return name
    run_then_read_back(main, proc, root, tmp_path, shared)
