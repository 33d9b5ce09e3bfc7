"""SaveWeights(share) and RecordWeights (issue 37): the new version leaves the trainer in place, at once,
and the weight store records the same bits in the background.

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its store a local
version directory: the shared tensors equal the trainer's serving weights and the recorded version's
files (torch.equal), a retried share gives the same descriptor, the next step trains while the record
lands, and bad calls get clear statuses.
"""
from __future__ import annotations

import asyncio
import gc
import pathlib

import grpc
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from zerokl.kernels.model import Model
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.weightstore.shared import SharedUnavailable
from zerokl.services.weightstore.sync import open_shared
from zerokl.v1 import trainer_pb2

from test_trainer_service import _flags, _prompts, _reference, _rollouts, _status, trainer_server

pytestmark = pytest.mark.timeout(120)


def test_a_shared_version_is_the_trainers_serving_weights_and_the_store_records_the_same_bits(
        tmp_path: pathlib.Path) -> None:
    config = TrainConfig(lr=3e-3)

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *_flags(config), "--run", "share") as (client, service):
            state = await client.get_state()
            rollouts = _rollouts(service.trainer, _prompts(2, 1), state.weights_version)
            await client.grpo_step(rollouts, 4)
            manifest, created, shared = await client.share_weights()
            assert created and manifest.version == shared.version == "share-step000001"
            assert (await client.info()).weights_version == "share-step000001"
            want = service.trainer.serving_state_dict()
            got = open_shared(shared)
            assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
            # A retry (the reply was lost): the same version, the same memory.
            again, created, repeat = await client.share_weights()
            assert not created and repeat == shared
            answer = await client.record_weights("share-step000001")
            recorded, record_s = answer.manifest, answer.record_s
            assert record_s > 0.0 and not answer.superseded
            assert {s.name for s in recorded.shards} >= {"config.json", "model.safetensors"}
            stored = Model.from_pretrained(tmp_path / "w" / "versions" / recorded.version).state_dict()
            assert all(torch.equal(stored[k], got[k]) for k in want)
            # The next step is on-policy for rollouts sampled under the shared version.
            rollouts = _rollouts(service.trainer, _prompts(2, 2), "share-step000001")
            fb, _ = await client.grpo_step(rollouts, 4)
            assert fb.ppo.kl == 0.0 and fb.ppo.mismatched_tokens == 0
            _, _, second = await client.share_weights()
            assert second.version == "share-step000002"
            assert (await client.record_weights(second.version)).manifest.version == second.version
            # Bad calls: clear statuses, the trainer keeps serving.
            err = await _status(client.record_weights("never-shared"))
            assert err.code() is grpc.StatusCode.NOT_FOUND
            err = await _status(client._stub.RecordWeights(trainer_pb2.RecordWeightsRequest()))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (await client.get_state()).step == 2
        # A new trainer resumes from the recorded version, exactly.
        async with trainer_server(tmp_path / "w", *_flags(config), "--run", "share") as (client, service):
            state = await client.get_state()
            assert (state.step, state.weights_version) == (2, "share-step000002")
    asyncio.run(main())


def test_a_co_located_trainer_releases_its_shared_versions_before_a_backward(tmp_path: pathlib.Path) -> None:
    """--offload-optimizer (a replica shares the device): the shared memory of the versions a replica took leaves
    before the next backward (for the GLM-5 slice 23 GiB of an 80 GB device), a record in flight still records the
    shared bits, and a replica opening a released version is told so (SharedUnavailable: it reads the store)."""
    config = TrainConfig(lr=3e-3)

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *_flags(config), "--run", "co", "--offload-optimizer") \
                as (client, service):
            state = await client.get_state()
            await client.grpo_step(_rollouts(service.trainer, _prompts(2, 1), state.weights_version), 4)
            manifest, _, shared = await client.share_weights(weights_only=True)
            got = {k: v.clone() for k, v in open_shared(shared).items()}      # the replica's switch
            # The next step's backward: the shared version is released (its record may still be writing from it).
            await client.grpo_step(_rollouts(service.trainer, _prompts(2, 2), manifest.version), 4)
            recorded = (await client.record_weights(manifest.version)).manifest
            with pytest.raises(SharedUnavailable):
                open_shared(shared)
            stored = Model.from_pretrained(tmp_path / "w" / "versions" / recorded.version).state_dict()
            assert list(stored) == list(got) and all(torch.equal(stored[k], got[k]) for k in got)
            # Sharing again works: a fresh export of the new weights, which the backward after it releases too.
            _, _, second = await client.share_weights(weights_only=True)
            want = service.trainer.serving_state_dict()
            assert all(torch.equal(v, want[k]) for k, v in open_shared(second).items())
            # Each backward waits until no record holds an export on the device (the GLM-5 slice's backward beside
            # one ran out of an H100's memory): a record copies its export only after the records before it were
            # written and uploaded (the record process takes one version at a time).
            held_at_backward = []
            forward_backward = service._forward_backward

            def watched(*args, **kw):  # noqa: ANN002, ANN003, ANN202
                held_at_backward.append([n for n, r in service._records.items() if r.export is not None])
                return forward_backward(*args, **kw)
            service._forward_backward = watched
            upload = service._recorder.upload

            async def slow_upload(*args, **kw):  # noqa: ANN002, ANN003, ANN202
                await asyncio.sleep(1.0)          # a store slower than the step: the next record's copy waits
                return await upload(*args, **kw)
            service._recorder.upload = slow_upload
            for seed in (3, 4, 5):
                version = (await client.get_state()).weights_version
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, seed), version), 4)
                await client.share_weights(weights_only=True)
            assert held_at_backward == [[], [], []]
    asyncio.run(main())


def test_a_co_located_checkpoint_share_leaves_the_export_before_the_next_backward(tmp_path: pathlib.Path) -> None:
    """A full share (a resume point, as a job's start is) keeps its serving weights as views of the export until its
    record copies them; that copy comes at once, not after the records queued before it (written and uploaded one
    at a time), and a co-located backward never runs beside it: the GLM-5 slice's first backward ran out of an
    H100's memory beside its job start's 23 GiB. The record still lands, with the shared bits."""
    config = TrainConfig(lr=3e-3)

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *_flags(config), "--run", "co", "--offload-optimizer") \
                as (client, service):
            upload = service._recorder.upload

            async def slow_upload(*args, **kw):  # noqa: ANN002, ANN003, ANN202
                await asyncio.sleep(1.5)          # a store slower than the step: the next record waits its turn
                return await upload(*args, **kw)
            service._recorder.upload = slow_upload
            exported: list[tuple[int, int]] = []      # each shared version's memory, [start, end) addresses
            memory: dict[str, StorageWeakRef] = {}   # each shared version's memory, dead once nothing holds it

            def remember(version: str) -> None:
                buffer = service._exports[version].buffer
                exported.append((buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()))
                memory[version] = StorageWeakRef(buffer.untyped_storage())
            views_at_backward, held_at_backward = [], []
            forward_backward = service._forward_backward

            def watched(*args, **kw):  # noqa: ANN002, ANN003, ANN202
                views_at_backward.append(sorted(
                    name for name, r in service._records.items() if r.export is not None or (
                        r.snapshot is not None and any(lo <= t.data_ptr() < hi for t in r.snapshot.serving.values()
                                                       for lo, hi in exported))))
                gc.collect()
                held_at_backward.append(sorted(version for version, ref in memory.items() if not ref.expired()))
                return forward_backward(*args, **kw)
            service._forward_backward = watched
            state = await client.get_state()
            await client.grpo_step(_rollouts(service.trainer, _prompts(2, 1), state.weights_version), 4)
            first, _, _ = await client.share_weights(weights_only=True)      # its record uploads slowly
            remember(first.version)
            await client.grpo_step(_rollouts(service.trainer, _prompts(2, 2), first.version), 4)
            full, _, shared = await client.share_weights()                  # a resume point, queued behind it
            remember(full.version)
            got = {k: v.clone() for k, v in open_shared(shared).items()}   # the replica's switch
            await client.grpo_step(_rollouts(service.trainer, _prompts(2, 3), full.version), 4)
            assert views_at_backward == [[], [], []]
            assert held_at_backward == [[], [], []]     # and nothing else in the process holds an export's memory
            recorded = (await client.record_weights(full.version)).manifest
            stored = Model.from_pretrained(tmp_path / "w" / "versions" / recorded.version).state_dict()
            assert list(stored) == list(got) and all(torch.equal(stored[k], got[k]) for k in got)
    asyncio.run(main())
