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

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.store import VersionSpec
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


def test_the_first_record_of_a_trainer_started_from_a_stored_version_is_a_delta_against_it(
        tmp_path: pathlib.Path) -> None:
    """The record process's first base is the version the trainer started from, read from the store (hard links
    from a local one): the first record goes as a delta against it too, not whole, and reads back bit for bit."""
    store = VersionStore(LocalDirBackend(tmp_path / "w"))
    (tmp_path / "v0").mkdir()
    Model(ModelConfig.preset("tiny"), seed=1, dtype=torch.bfloat16).save_pretrained(tmp_path / "v0")
    store.publish_dir(tmp_path / "v0", "start-v0", VersionSpec())

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *FLAGS, "--init", "start-v0") as (client, service):
            version = (await client.get_state()).weights_version
            assert version == "start-v0"
            await client.grpo_step(_rollouts(service.trainer, _prompts(2, 1), version), 4)
            manifest, _, desc = await client.share_weights(weights_only=True)
            shared = {k: v.clone() for k, v in open_shared(desc).items()}
            recorded = (await client.record_weights(manifest.version)).manifest
        shard = recorded.shard(MODEL)
        assert (shard.base, shard.depth) == ("start-v0", 1) and shard.stored_bytes < 0.5 * shard.size
        store.fetch(recorded.version, tmp_path / "read")
        loaded = Model.from_pretrained(tmp_path / "read").state_dict()
        assert all(torch.equal(loaded[k], shared[k]) for k in shared)
    asyncio.run(main())


def test_records_sent_whole_leave_no_files_behind(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--record-deltas off: nothing is a delta base, so once the store holds a record the record process keeps none
    of its files (with deltas it keeps the newest record's serving files, the next one's base)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *FLAGS, "--record-deltas", "off") as (client, service):
            version = (await client.get_state()).weights_version
            for step in range(1, 3):
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, step), version), 4)
                manifest, _, _ = await client.share_weights(weights_only=True)
                version = manifest.version
                recorded = (await client.record_weights(version)).manifest
                assert recorded.shard(MODEL).base == ""
                assert not list((tmp_path / "tmp").glob("zerokl-trainer-record-*")), step
    asyncio.run(main())


def _store_with_start(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> VersionStore:
    """A local store holding ``start-v0`` (a tiny bf16 model) for a trainer to start from; the trainer's temp files
    (the record process's directories) under ``tmp_path / "tmp"``."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    store = VersionStore(LocalDirBackend(tmp_path / "w"))
    (tmp_path / "v0").mkdir()
    Model(ModelConfig.preset("tiny"), seed=1, dtype=torch.bfloat16).save_pretrained(tmp_path / "v0")
    store.publish_dir(tmp_path / "v0", "start-v0", VersionSpec())
    return store


def test_records_against_the_start_keep_no_copy_and_read_back_bit_for_bit(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--record-deltas start: every record is a delta against the version the trainer started from (one layer deep,
    however many steps), and once the store holds a record the record process keeps none of its files: its only
    base is the start's files, hard links into the store (no bytes of their own)."""
    store = _store_with_start(tmp_path, monkeypatch)

    def record_files() -> list[pathlib.Path]:
        return [f for f in (tmp_path / "tmp").rglob("*") if f.is_file() and "zerokl-trainer-record" in str(f)]

    async def main() -> None:
        shared: dict[str, dict[str, torch.Tensor]] = {}
        async with trainer_server(tmp_path / "w", *FLAGS, "--init", "start-v0", "--record-deltas", "start") \
                as (client, service):
            version = (await client.get_state()).weights_version
            for step in range(1, 4):
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, step), version), 4)
                manifest, _, desc = await client.share_weights(weights_only=True)
                version = manifest.version
                shared[version] = {k: v.clone() for k, v in open_shared(desc).items()}
                recorded = (await client.record_weights(version)).manifest
                shard = recorded.shard(MODEL)
                assert (shard.base, shard.depth) == ("start-v0", 1), step
                assert shard.stored_bytes < 0.5 * shard.size
                # What the record process keeps: the start's serving files, each a hard link into the store.
                kept = record_files()
                assert kept and all(f.stat().st_nlink > 1 for f in kept), (step, kept)
        for name, tensors in shared.items():
            store.fetch(name, tmp_path / "read" / name)
            loaded = Model.from_pretrained(tmp_path / "read" / name).state_dict()
            assert all(torch.equal(loaded[k], tensors[k]) for k in tensors), name
    asyncio.run(main())


def test_records_against_the_start_move_their_base_to_a_record_that_went_whole(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--record-deltas start, and a step that changed nearly every byte (lr 0.05: its delta against the start is over
    half the file, so it went whole): the next records go as deltas against that record, not whole against the
    start forever after; the record process still keeps no bytes of its own (its base: hard links)."""
    store = _store_with_start(tmp_path, monkeypatch)

    async def main() -> list:
        recorded = []
        async with trainer_server(tmp_path / "w", *FLAGS, "--init", "start-v0", "--record-deltas", "start") \
                as (client, service):
            version = (await client.get_state()).weights_version
            for step, lr in enumerate((0.05, 1e-5, 1e-5), start=1):
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, step), version), 4, lr=lr)
                manifest, _, _ = await client.share_weights(weights_only=True)
                version = manifest.version
                recorded.append((await client.record_weights(version)).manifest)
                kept = [f for f in (tmp_path / "tmp").rglob("*") if f.is_file()]
                assert kept and all(f.stat().st_nlink > 1 for f in kept), (step, kept)
        return recorded

    whole, second, third = asyncio.run(main())
    assert whole.shard(MODEL).base == ""        # lr 0.05 changed nearly every byte: sent whole
    for later in (second, third):
        shard = later.shard(MODEL)
        assert (shard.base, shard.depth) == (whole.version, 1) and shard.stored_bytes < 0.5 * shard.size
    store.fetch(third.version, tmp_path / "read")
    assert Model.from_pretrained(tmp_path / "read").state_dict()
