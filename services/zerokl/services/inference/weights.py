"""Switching a replica to another weight-store version (the RL loop's step boundary).

:class:`WeightSwitcher` fetches a version's serving files from the weight store
into a local cache (``CACHE/VERSION``, sha256-checked and resumable), checks that
the version fits the replica (the same model config; trained under the numerics
fingerprint the replica computes with, when the manifest records one), reports
NOT_SERVING, swaps the engine's weights between requests and reports SERVING
again with the new weights version (the scheduler's registry re-reads Info on
that transition).

In place (issue 37): a switch that carries the trainer's
:class:`~zerokl.services.weightstore.shared.SharedExport` copies the version straight from the
trainer's memory when the replica is on the trainer's host (CUDA IPC, or shared memory
on a CPU fleet; :mod:`zerokl.services.weightstore.sync`), checks the checksum of what arrived
(DATA_LOSS otherwise: never served) and the names, shapes and dtypes against the model it
serves, then swaps as above. On another host, or when the memory cannot be opened, it
fetches the version from the store, waiting up to ``record_wait_s`` for the trainer's
asynchronous record of it to appear there.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import shutil
import tempfile
import time
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Callable

import grpc
import grpc.aio
from prometheus_client import Counter

from zerokl.services.engine.types import OwnedWeights
from zerokl.services.inference.replica import Replica
from zerokl.services.runtime.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    PreconditionViolation,
    RelayedError,
)
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.runtime.metrics import REGISTRY, set_serving_info
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.shared import ChecksumMismatch, SharedExport, SharedUnavailable

if TYPE_CHECKING:
    import torch

__all__ = ["SharedLoader", "StoreLoader", "WeightSwitcher", "SWITCHES"]

log = logging.getLogger(__name__)

SWITCHES = Counter("zerokl_replica_weight_switches", "Weight switches by where the bytes came from "
                   "(shared: the trainer's memory on this host; store: the weight store).", ["path"],
                   registry=REGISTRY)


class SharedLoader:
    """``loader(engine) -> state_dict``: a version in the trainer's memory (its SharedExport), copied
    onto the engine's device and checked against its model (names, shapes, dtypes). Raises SharedUnavailable (the store path then: another host, the memory gone, or a
    trainer in another dtype than the fleet's, whose store files are cast on load), ChecksumMismatch
    and ValueError (a malformed descriptor). Picklable: an engine process runs it."""

    def __init__(self, export: SharedExport) -> None:
        self.export = export

    def __call__(self, engine) -> dict[str, torch.Tensor]:  # noqa: ANN001 - an Engine
        from zerokl.services.weightstore.sync import open_shared   # torch: run where the engine is
        own = engine.model.state_dict()
        device = next(iter(own.values())).device
        state = open_shared(self.export, device)
        wrong = sorted(set(own) ^ set(state)) + sorted(
            k for k in set(own) & set(state) if own[k].shape != state[k].shape or own[k].dtype != state[k].dtype)
        if wrong:
            raise SharedUnavailable(f"the shared tensors do not match this replica's model ({wrong[:3]})")
        return OwnedWeights(state)      # our own copy: a sleeping engine takes it as its weights (no second copy)


class ModelConfigMismatch(Exception):
    """A store version's model config differs from the one the replica serves (StoreLoader)."""


class StoreLoader:
    """``loader(engine) -> state_dict``: a version fetched from the store into ``directory`` (config.json +
    safetensors), read where the engine runs, in the replica's numerics dtype ``dtype`` (an FP8 replica
    loads FP8, quantizing a version that is not). The files go straight to the engine's process: the
    gRPC front neither imports torch nor holds a host copy of the model to pickle across. Raises
    ModelConfigMismatch for another model's version. Picklable."""

    def __init__(self, directory: pathlib.Path, dtype: str) -> None:
        self.directory, self.dtype = directory, dtype

    def __call__(self, engine) -> dict[str, torch.Tensor]:  # noqa: ANN001 - an Engine
        from zerokl.kernels.dtypes import to_dtype
        from zerokl.kernels.model import Model
        model = Model.from_pretrained(self.directory, dtype=to_dtype(self.dtype))
        if model.config.to_dict() != engine.model.config.to_dict():
            raise ModelConfigMismatch("differs from the replica's model config")
        return model.state_dict()


class WeightSwitcher:
    """Loads weight-store versions into one replica, one switch at a time."""

    def __init__(self, replica: Replica, store: WeightStoreClient, cache_dir: str | None = None,
                 not_serving: Callable[[], AbstractAsyncContextManager[None]] | None = None,
                 record_wait_s: float = 120.0) -> None:
        self.replica = replica
        self.store = store
        self._own_cache = cache_dir is None
        self.cache = pathlib.Path(cache_dir or tempfile.mkdtemp(prefix="zerokl-weights-"))
        self._not_serving = not_serving   # ServiceServer.not_serving (an async context manager factory)
        self._lock = asyncio.Lock()
        self.record_wait_s = record_wait_s
        self.last_path = ""         # "shared" | "store": where the last switch's bytes came from

    async def switch(self, version: str, shared: SharedExport | None = None) -> ServiceIdentity:
        """Serve ``version`` (or ``latest``) from now on; returns the replica's new identity.

        ``shared``: the trainer's in-memory copy of ``version`` (module docstring)."""
        if not version:
            raise InvalidArgument.field("version", "name a weight-store version or 'latest'")
        if shared is not None and shared.version != version:
            raise InvalidArgument.field("shared.version", f"the shared weights are {shared.version!r}, the switch "
                                                          f"names {version!r}")
        async with self._lock:
            try:
                if shared is not None:
                    if await self._serving(version):
                        return self.replica.identity
                    try:
                        return await self._switch_shared(shared)
                    except SharedUnavailable as err:
                        log.info("in-place weights of %s unavailable here (%s): fetching them from the store",
                                 version, err)
                return await self._switch(version, wait_for_record=shared is not None)
            except grpc.aio.AioRpcError as err:  # the store's NOT_FOUND / DATA_LOSS / UNAVAILABLE, relayed
                raise RelayedError(err, f"weight store {self.store.target}") from None

    async def _switch_shared(self, shared: SharedExport) -> ServiceIdentity:
        """Copy the version from the trainer's memory, check it, swap: where the engine runs (its
        process owns the device), by a loader the engine's core calls when the swap runs."""
        self._check_spec(shared.version, shared.numerics_fingerprint)
        try:
            async with self._not_serving() if self._not_serving else contextlib.nullcontext():
                await self.replica.load_weights(SharedLoader(shared), shared.version)
        except ChecksumMismatch as err:
            raise DataLoss(f"version {shared.version!r} from the trainer's memory: {err}; not served") from None
        except ValueError as err:
            raise InvalidArgument.field("shared", str(err)) from None
        self.last_path = "shared"
        SWITCHES.labels("shared").inc()
        identity = self.replica.identity
        set_serving_info(identity)
        return identity

    async def _manifest(self, version: str, wait_for_record: bool):  # noqa: ANN202 - WeightsManifest
        """The store's manifest; with ``wait_for_record``, NOT_FOUND is waited out (the trainer records a
        version it shared asynchronously) for up to ``record_wait_s``."""
        deadline = time.monotonic() + self.record_wait_s
        while True:
            try:
                return await self.store.manifest(version)
            except grpc.aio.AioRpcError as err:
                if not wait_for_record or err.code() is not grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _switch(self, version: str, wait_for_record: bool = False) -> ServiceIdentity:
        manifest = await self._manifest(version, wait_for_record)
        if await self._serving(manifest.version):
            return self.replica.identity
        self._check_spec(manifest.version, manifest.spec.numerics_fingerprint)
        dest = self.cache / manifest.version
        await self.store.fetch(manifest.version, dest, serving_only=True)
        try:
            async with self._not_serving() if self._not_serving else contextlib.nullcontext():
                await self.replica.load_weights(StoreLoader(dest, self.replica.identity.dtype), manifest.version)
        except ModelConfigMismatch as err:
            raise FailedPrecondition(
                f"version {manifest.version!r} has another model config than this replica serves",
                precondition_violations=[PreconditionViolation("MODEL_CONFIG", manifest.version, str(err))]) from None
        await asyncio.to_thread(shutil.rmtree, dest, True)  # the weights live in the engine now
        self.last_path = "store"
        SWITCHES.labels("store").inc()
        identity = self.replica.identity
        set_serving_info(identity)
        return identity

    async def _serving(self, version: str) -> bool:
        """Whether the replica holds ``version`` already (nothing to swap): an engine asleep with its KV
        cache released just wakes; one whose weights were released (sleep level 2) needs them again."""
        engine = self.replica.engine
        if version != self.replica.identity.weights_version or engine.sleep_level == 2:
            return False
        if engine.sleep_level:
            await engine.wake()
        return True

    def _check_spec(self, version: str, fingerprint: str) -> None:
        ours = self.replica.identity.numerics_fingerprint
        if fingerprint and fingerprint != ours:
            raise FailedPrecondition(
                f"version {version!r} was trained under numerics fingerprint {fingerprint!r}; this replica "
                f"computes {ours!r}",
                precondition_violations=[PreconditionViolation("NUMERICS_FINGERPRINT", fingerprint,
                                                               f"this replica computes {ours!r}")])

    async def close(self) -> None:
        if self._own_cache:
            await asyncio.to_thread(shutil.rmtree, self.cache, True)

