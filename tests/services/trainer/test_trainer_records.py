"""The store's records of an RL job's versions cost what changed (issue 49).

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it (bf16 forward, fp32 masters,
an RL learning rate), its store a local version directory: each version recorded after the first is stored
as a delta against the one before (its bf16 weights moved in a few elements), the store wrote a fraction of
the bytes, every version reads back (fetched through the store, decoded) equal to what the trainer shared,
torch.equal, and a restart resumes from the checkpoint whose trainer state was recorded whole beside them.
"""
from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch

from zerokl.kernels.model import Model
from zerokl.services.trainer.trainer import TrainConfig
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.sync import open_shared

from test_trainer_service import _flags, _prompts, _rollouts, trainer_server

pytestmark = pytest.mark.timeout(180)

FLAGS = (*_flags(TrainConfig(lr=1e-5)), "--dtype", "bfloat16", "--master-weights", "on", "--run", "rec")
MODEL = "model.safetensors"


def test_records_after_the_first_are_deltas_that_read_back_bit_for_bit(tmp_path: pathlib.Path) -> None:
    store = VersionStore(LocalDirBackend(tmp_path / "w"))

    async def main() -> None:
        shared: dict[str, dict[str, torch.Tensor]] = {}
        async with trainer_server(tmp_path / "w", *FLAGS) as (client, service):
            version = (await client.get_state()).weights_version
            for step in range(1, 4):
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, step), version), 4)
                # Steps 1-2 weights only, step 3 a checkpoint (the trainer state rides along, whole).
                manifest, _, desc = await client.share_weights(weights_only=step < 3)
                version = manifest.version
                shared[version] = {k: v.clone() for k, v in open_shared(desc).items()}
            recorded = [await client.record_weights(v) for v in shared]
        first, *later = [r.manifest for r in recorded]
        assert first.shard(MODEL).base == ""    # nothing recorded before it by this trainer: whole
        for before, manifest in zip([first, *later], later):
            shard = manifest.shard(MODEL)
            # A delta against the version recorded before it, a fraction of the file.
            assert (shard.base, shard.depth) == (before.version, before.shard(MODEL).depth + 1)
            assert shard.stored_bytes < 0.5 * shard.size
        assert later[-1].shard("trainer-state.safetensors").base == ""
        on_disk = sum(o.size for o in store.backend.list("deltas/"))
        assert on_disk == sum(m.shard(MODEL).stored_bytes for m in later)
        for name, tensors in shared.items():
            store.fetch(name, tmp_path / "read" / name)
            loaded = Model.from_pretrained(tmp_path / "read" / name).state_dict()
            assert all(torch.equal(loaded[k], tensors[k]) for k in tensors), name
        # A new trainer resumes from the checkpoint (step 3).
        async with trainer_server(tmp_path / "w", *FLAGS) as (client, service):
            state = await client.get_state()
            assert (state.step, state.weights_version) == (3, later[-1].version)
    asyncio.run(main())
