"""A record process killed mid-record (issue 49): the trainer notices, starts another and records again what was
pending, from the bytes it still holds; the store only ever holds complete, verified versions.

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its store a real `zerokl serve
weight-store` process, its record process (trainer/recorder.py) a real child killed with SIGKILL, as the host's
OOM killer would:

- in its write: the record process stopped (SIGSTOP) before it read a weights-only version's export, with a
  checkpoint and another weights-only version queued behind it, then killed. The version it was writing is
  written again from the export the trainer still holds, and the ones queued behind it follow;
- in its upload: the store stopped once a version's files are written, the record process killed with the upload
  in flight, the store continued. The files on the trainer's disk are uploaded again.

Each version then reads back from the store (every file checked against its sha256) equal to what the trainer
shared, bit for bit.
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal

import pytest
import torch

from zerokl.kernels.model import Model
from zerokl.services.trainer import service as trainer_service
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.store_marks import META_STATE
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.sync import open_shared

from test_trainer_service import _flags, _prompts, _rollouts, trainer_server
from test_trainer_supersede import _store

pytestmark = pytest.mark.timeout(180)


def test_a_killed_record_process_is_replaced_and_what_it_had_pending_is_recorded(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A share asks the stopped store whether it holds the name; it answers nothing, so say so sooner.
    monkeypatch.setattr(trainer_service, "_STORE_CHECK_S", 0.2)
    proc, address = _store(tmp_path / "w", tmp_path / "store.log")
    shared: dict[str, dict[str, torch.Tensor]] = {}

    async def main() -> None:
        async with trainer_server(address, *_flags(TrainConfig(lr=3e-3)), "--run", "died") as (client, service):
            version = (await client.get_state()).weights_version

            async def step(n: int, weights_only: bool = True) -> str:
                nonlocal version
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, n), version), 4)
                manifest, _, desc = await client.share_weights(weights_only=weights_only)
                version = manifest.version
                shared[version] = {k: v.clone() for k, v in open_shared(desc).items()}
                return version

            first = await step(1)
            assert (await client.record_weights(first)).manifest.version == first     # the record process is up
            writer = service._recorder._process
            os.kill(writer.pid, signal.SIGSTOP)
            try:
                held = await step(2)                        # its write waits in the stopped process's pipe
                checkpoint = await step(3, weights_only=False)
                queued = await step(4)
            finally:
                os.kill(writer.pid, signal.SIGKILL)
            recorded = {v: await asyncio.wait_for(client.record_weights(v), 60) for v in (held, checkpoint, queued)}
            assert all(r.manifest is not None and r.manifest.version == v for v, r in recorded.items())
            assert recorded[checkpoint].manifest.spec.metadata[META_STATE] == "full"
            assert service._recorder._process.pid != writer.pid

            # Killed in its upload: the version's files are on the trainer's disk; the store is stopped meanwhile.
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                uploading = await step(5)
                while service._records[uploading].directory is None:
                    await asyncio.sleep(0.01)
                uploader = service._recorder._process
                os.kill(uploader.pid, signal.SIGKILL)
                uploader.join(30)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert (await asyncio.wait_for(client.record_weights(uploading), 60)).manifest.version == uploading
            assert service._recorder._process.pid != uploader.pid
    try:
        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
    store = VersionStore(LocalDirBackend(tmp_path / "w"))
    assert set(shared) <= {m.version for m in store.manifests()}
    for name, tensors in shared.items():
        store.fetch(name, tmp_path / "read" / name)
        loaded = Model.from_pretrained(tmp_path / "read" / name).state_dict()
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors), name
