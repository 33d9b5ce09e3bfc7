"""A shared version whose record failed (issue 49): shared again, it is recorded again from the trainer's weights
when they are the bytes the fleet was sent (checked by checksum), and its name never takes other bytes.

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its store a local version directory,
its record process (trainer/recorder.py) a real child. A record fails for good when the version's shared memory is
gone before the record process reads it (it is stopped meanwhile, and the /dev/shm file removed, as a cleanup of
/dev/shm would): it cannot check the bytes against the checksum the fleet was sent, so it records nothing.

- Shared again by a trainer still on it (a job starting on the version the fleet serves), the version is recorded
  from the trainer's weights, their checksum the one the fleet was sent, and reads back bit for bit.
- A trainer taken back by hand that trains to the same step with other data shares other bytes: the failed
  version's name is not theirs (ALREADY_EXISTS for it), and a default name moves to the run's next segment.
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


def test_a_version_whose_record_failed_is_recorded_again_from_the_same_bytes_only(tmp_path: pathlib.Path) -> None:
    store = VersionStore(LocalDirBackend(tmp_path / "w"))
    shared: dict[str, dict[str, torch.Tensor]] = {}     # what the trainer shared, by version: the store's to hold
    sent: dict[str, str] = {}                           # the checksum of each version's bytes the fleet was sent
    memory: dict[str, pathlib.Path] = {}                # the shared-memory file each was sent from

    async def main() -> str:
        async with trainer_server(tmp_path / "w", *_flags(TrainConfig(lr=3e-3)), "--run", "again") as (client, service):
            version = (await client.get_state()).weights_version

            async def step(prompts: int, weights_only: bool = True) -> str:
                nonlocal version
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, prompts), version), 4)
                manifest, _, desc = await client.share_weights(weights_only=weights_only)
                version = manifest.version
                shared[version] = {k: v.clone() for k, v in open_shared(desc).items()}
                sent[version], memory[version] = desc.checksum, pathlib.Path(desc.path)
                return version

            async def lost_step(prompts: int) -> str:
                """A step whose record fails: its memory removed while the record process is stopped."""
                recorder = service._recorder._process
                os.kill(recorder.pid, signal.SIGSTOP)
                try:
                    lost = await step(prompts)
                    memory[lost].unlink()
                finally:
                    os.kill(recorder.pid, signal.SIGCONT)
                err = await _status(client.record_weights(lost))
                assert err.code() is grpc.StatusCode.INTERNAL and "SharedUnavailable" in err.details(), err.details()
                assert lost not in {m.version for m in store.manifests()}
                del shared[lost]
                return lost

            first = await step(1, weights_only=False)
            assert (await client.record_weights(first)).manifest is not None     # the record process is up
            lost = await lost_step(2)
            # Shared again by the trainer still on it, with its trainer state: recorded from its weights.
            manifest, _, desc = await client.share_weights()
            assert manifest.version == lost and desc.checksum == sent[lost]
            shared[lost] = {k: v.clone() for k, v in open_shared(desc).items()}
            recorded = await client.record_weights(lost)
            assert recorded.manifest.version == lost and recorded.manifest.spec.metadata[META_STATE] == "full"
            resume_point = lost

            lost = await lost_step(3)
            # Taken back by hand to the version before, then a step of other data: the same step, other bytes.
            await client.load_weights(resume_point, restore_state=True)
            version = resume_point
            other = await step(4)
            assert other.startswith("again.2-step") and sent[other] != sent[lost], (other, lost)
            assert (await client.record_weights(other)).manifest.version == other
            # A name the caller chooses is theirs: the failed version's name, with other bytes, is refused.
            err = await _status(client.share_weights(version=lost))
            assert err.code() is grpc.StatusCode.ALREADY_EXISTS and lost in err.details(), err.details()
            return lost
    lost = asyncio.run(main())
    assert set(shared) <= {m.version for m in store.manifests()} and lost not in {m.version for m in store.manifests()}
    for name, tensors in shared.items():
        store.fetch(name, tmp_path / "read" / name)
        loaded = Model.from_pretrained(tmp_path / "read" / name).state_dict()
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors), name
