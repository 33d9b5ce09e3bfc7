"""A checkpoint's record checks its serving weights against the checksum the fleet was sent, as a weights-only
version's does: bytes that changed between the share and the record are never recorded under the version's name.

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its store a local version directory,
its record process (trainer/recorder.py) a real child. A checkpoint (the version with its trainer state) is shared
while the record process is stopped with a weights-only version's write in it, so the checkpoint's record waits
behind that one; meanwhile a byte of the checkpoint's shared memory (its /dev/shm file, which the record writes the
serving files from) is changed, as a stray writer would.

- RecordWeights of the checkpoint answers INTERNAL (not durable), saying the checksums; the store does not hold it,
  and holds the weights-only version before it.
- Shared again by the trainer still on it (its own weights: the bytes the fleet was sent), it is recorded with its
  trainer state and reads back equal to what was shared, bit for bit.
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal

import grpc
import pytest
import torch

from zerokl.kernels.model import Model
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.store_marks import META_STATE
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.sync import open_shared

from test_trainer_service import _flags, _prompts, _rollouts, _status, trainer_server

pytestmark = pytest.mark.timeout(180)


def test_a_checkpoint_whose_serving_bytes_changed_after_the_share_is_not_recorded(tmp_path: pathlib.Path) -> None:
    store = VersionStore(LocalDirBackend(tmp_path / "w"))
    shared: dict[str, dict[str, torch.Tensor]] = {}     # what the trainer shared, by version: the store's to hold

    async def main() -> str:
        async with trainer_server(tmp_path / "w", *_flags(TrainConfig(lr=3e-3)), "--run", "sum") as (client, service):
            version = (await client.get_state()).weights_version

            async def step(prompts: int, weights_only: bool = True):  # noqa: ANN202 - (version, its export)
                nonlocal version
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, prompts), version), 4)
                manifest, _, desc = await client.share_weights(weights_only=weights_only)
                version = manifest.version
                shared[version] = {k: v.clone() for k, v in open_shared(desc).items()}
                return version, desc

            first, _ = await step(1)
            assert (await client.record_weights(first)).manifest is not None     # the record process is up
            recorder = service._recorder._process
            os.kill(recorder.pid, signal.SIGSTOP)
            try:
                before, _ = await step(2)                               # its write waits in the stopped process
                checkpoint, desc = await step(3, weights_only=False)    # its record waits behind that one
                assert service._records[checkpoint].directory is None and not service._records[checkpoint].begun
                where = desc.tensors[0].offset
                with open(desc.path, "r+b") as memory:      # a byte of the serving weights the record will write
                    memory.seek(where)
                    byte = memory.read(1)[0]
                    memory.seek(where)
                    memory.write(bytes([byte ^ 0xFF]))
            finally:
                os.kill(recorder.pid, signal.SIGCONT)
            assert (await asyncio.wait_for(client.record_weights(before), 60)).manifest.version == before
            err = await _status(asyncio.wait_for(client.record_weights(checkpoint), 60))
            assert err.code() is grpc.StatusCode.INTERNAL, err
            said = err.details()
            assert desc.checksum in said and f"{checkpoint} is not recorded, and is not durable" in said, said
            assert checkpoint not in {m.version for m in store.manifests()}

            # Shared again by the trainer still on it, with its trainer state: recorded from its own weights.
            manifest, _, again = await client.share_weights()
            assert (manifest.version, again.checksum) == (checkpoint, desc.checksum)
            recorded = await asyncio.wait_for(client.record_weights(checkpoint), 60)
            assert recorded.manifest.version == checkpoint and recorded.manifest.spec.metadata[META_STATE] == "full"
            return checkpoint
    checkpoint = asyncio.run(main())
    assert set(shared) <= {m.version for m in store.manifests()}
    for name, tensors in shared.items():
        store.fetch(name, tmp_path / "read" / name)
        loaded = Model.from_pretrained(tmp_path / "read" / name).state_dict()
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors), name
    assert (tmp_path / "read" / checkpoint / "trainer-state.json").exists()
