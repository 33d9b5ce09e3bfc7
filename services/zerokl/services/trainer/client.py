"""Async client of the trainer service: the Tinker-style low-level API over gRPC.

Methods mirror the RPCs and take the trainer's own dataclasses
(:class:`Completion`, :class:`Rollout`), so a loop written against the
in-process :class:`~zerokl.services.trainer.trainer.Trainer` moves to the
service unchanged in shape. RPC failures surface as ``grpc.aio.AioRpcError``
with the server's status code (rich details via
:func:`zerokl.services.runtime.errors.field_violations`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from zerokl.services.runtime.info import ServiceIdentity, identity_from_proto
from zerokl.services.runtime.client import ServiceClient
from zerokl.services.trainer import convert
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.types import (
    AdamParams,
    DPOBatch,
    ForwardBackwardResult,
    OptimResult,
    PPOBatch,
    Recorded,
    SFTBatch,
    TrainBatch,
    TrainerState,
)
from zerokl.services.weightstore.convert import shared_export_from_proto
from zerokl.services.weightstore.shared import SharedExport
from zerokl.services.weightstore.store import WeightsManifest
from zerokl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from zerokl.vocab import Completion, Rollout

if TYPE_CHECKING:    # logprobs arrive as tensors, made by the converter: a client that reads none runs without torch
    import torch

__all__ = ["TrainerClient"]


class TrainerClient(ServiceClient):
    """ForwardLogprobs, ForwardBackward, OptimStep, SaveWeights, LoadWeights and GetState against one trainer.

    Pass a ``target`` (``host:port``) and optionally a bearer ``token``, TLS
    ``credentials`` and a tracer provider, or an existing ``channel``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    async def info(self) -> ServiceIdentity:
        """What the trainer computes with; weights_version is the last published or loaded version."""
        return identity_from_proto(await self._stub.Info(common_pb2.InfoRequest()))

    async def forward_logprobs(self, completions: Sequence[Completion], *,
                               timeout: float | None = None) -> list[torch.Tensor]:
        """Per-token fp32 logprobs of each completion (bitwise :meth:`Trainer.forward_logprobs`)."""
        msg = trainer_pb2.ForwardLogprobsRequest(completions=[convert.completion_to_proto(c) for c in completions])
        return convert.logprobs_from_proto(await self._stub.ForwardLogprobs(msg, timeout=timeout))

    async def forward_backward(self, method: str, items: Sequence[Any], *, group_size: int | None = None,
                               advantages: Sequence[float] | None = None, max_staleness: int | None = None,
                               reset_reference: bool = False,
                               timeout: float | None = None) -> ForwardBackwardResult:
        """Accumulate one objective's gradients, as :meth:`Trainer.forward_backward` does.

        ``method`` 'sft' takes Completions, 'dpo' (chosen, rejected) pairs
        (``reset_reference``: freeze the current weights as DPO's reference first),
        'ppo' Rollouts with ``group_size`` (GRPO advantages from the rewards) or
        explicit ``advantages``; ``max_staleness`` admits rollouts from older weights.
        """
        batch: TrainBatch
        if method == "sft":
            batch = SFTBatch(tuple(items))
        elif method == "dpo":
            batch = DPOBatch(tuple((c, r) for c, r in items), reset_reference)
        elif method == "ppo":
            batch = PPOBatch(tuple(items), group_size, None if advantages is None else tuple(advantages),
                             max_staleness)
        else:
            raise ValueError(f"unknown method {method!r}: expected sft, dpo or ppo")
        return await self.forward_backward_batch(batch, timeout=timeout)

    async def forward_backward_batch(self, batch: TrainBatch, *,
                                     timeout: float | None = None) -> ForwardBackwardResult:
        """ForwardBackward on an :class:`SFTBatch`, :class:`DPOBatch`, :class:`PPOBatch` or
        :class:`TokenLossBatch` (Tinker's per-token losses; the result's ``token_logprobs`` hold the
        trainer's logprob of every target)."""
        return convert.forward_backward_result_from_proto(
            await self._stub.ForwardBackward(convert.batch_to_proto(batch), timeout=timeout))

    async def optim_step(self, *, lr: float | None = None, adam: AdamParams | None = None,
                         timeout: float | None = None) -> OptimResult:
        """Apply the accumulated gradients at `lr` (None: the trainer's schedule), or with this step's
        own ``adam`` hyperparameters (learning rate, betas, eps, weight decay, clip)."""
        msg = trainer_pb2.OptimStepRequest(lr=lr or 0.0)
        if adam is not None:
            msg.adam.CopyFrom(convert.adam_params_to_proto(adam))
        return convert.optim_result_from_proto(await self._stub.OptimStep(msg, timeout=timeout))

    async def grpo_step(self, rollouts: Sequence[Rollout], group_size: int, *, max_staleness: int | None = None,
                        lr: float | None = None,
                        timeout: float | None = None) -> tuple[ForwardBackwardResult, OptimResult]:
        """ForwardBackward('ppo') then OptimStep: :meth:`Trainer.grpo_step` over the wire."""
        fb = await self.forward_backward("ppo", rollouts, group_size=group_size, max_staleness=max_staleness,
                                         timeout=timeout)
        return fb, await self.optim_step(lr=lr, timeout=timeout)

    async def save_weights(self, version: str = "", *, metadata: Mapping[str, str] | None = None,
                           weights_only: bool = False, timeout: float | None = None) -> tuple[WeightsManifest, bool]:
        """Publish the current weights (and trainer state) as a version; (manifest, created)."""
        msg = trainer_pb2.SaveWeightsRequest(version=version, metadata=dict(metadata or {}), weights_only=weights_only)
        return convert.save_result_from_proto(await self._stub.SaveWeights(msg, timeout=timeout))

    async def share_weights(self, version: str = "", *, weights_only: bool = False, supersede: bool = False,
                            metadata: Mapping[str, str] | None = None, timeout: float | None = None
                            ) -> tuple[WeightsManifest, bool, SharedExport]:
        """SaveWeights(share): the new version in the trainer's shared memory for the replicas on its
        host, recorded in the store in the background (``weights_only``: without the trainer state, so
        not a resume point); (manifest to be, created, descriptor). ``supersede``: the caller serves the
        version shared before this one, so older weights-only versions not yet being recorded need never be
        (:class:`Recorded`)."""
        msg = trainer_pb2.SaveWeightsRequest(version=version, share=True, weights_only=weights_only,
                                             supersede=supersede, metadata=dict(metadata or {}))
        response = await self._stub.SaveWeights(msg, timeout=timeout)
        manifest, created = convert.save_result_from_proto(response)
        return manifest, created, shared_export_from_proto(response.shared)

    async def record_weights(self, version: str, *, timeout: float | None = None) -> Recorded:
        """Wait until a version shared by :meth:`share_weights` is committed to the weight store (its manifest:
        ``stored_size`` says what the store wrote, seconds from the share to the commit), or answer at once that
        it was superseded (never recorded)."""
        response = await self._stub.RecordWeights(trainer_pb2.RecordWeightsRequest(version=version), timeout=timeout)
        return convert.recorded_from_proto(response)

    async def load_weights(self, version: str, *, restore_state: bool = False, config: TrainConfig | None = None,
                           timeout: float | None = None) -> TrainerState:
        """Switch to a published version (with its trainer state when ``restore_state``; else a
        fresh trainer with ``config``, default the current one)."""
        msg = trainer_pb2.LoadWeightsRequest(version=version, restore_state=restore_state)
        if config is not None:
            msg.config.CopyFrom(convert.train_config_to_proto(config))
        return convert.state_from_proto(await self._stub.LoadWeights(msg, timeout=timeout))

    async def get_state(self, *, timeout: float | None = None) -> TrainerState:
        """Step, weights version, counters and configuration."""
        return convert.state_from_proto(await self._stub.GetState(trainer_pb2.GetStateRequest(), timeout=timeout))
