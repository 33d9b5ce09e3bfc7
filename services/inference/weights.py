"""Switching a replica to another weight-store version (the RL loop's step boundary).

:class:`WeightSwitcher` fetches a version's serving files from the weight store
into a local cache (``CACHE/VERSION``, sha256-checked and resumable), checks that
the version fits the replica (the same model config; trained under the numerics
fingerprint the replica computes with, when the manifest records one), reports
NOT_SERVING, swaps the engine's weights between requests and reports SERVING
again with the new weights version (the scheduler's registry re-reads Info on
that transition).
"""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
import tempfile
from contextlib import AbstractAsyncContextManager
from typing import Callable

import grpc.aio

import torch

from zerokl.kernels.model import Model
from zerokl.services.inference.replica import Replica
from zerokl.services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    PreconditionViolation,
    RelayedError,
)
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.runtime.metrics import set_serving_info
from zerokl.services.weightstore.client import WeightStoreClient

__all__ = ["WeightSwitcher"]


class WeightSwitcher:
    """Loads weight-store versions into one replica, one switch at a time."""

    def __init__(self, replica: Replica, store: WeightStoreClient, cache_dir: str | None = None,
                 not_serving: Callable[[], AbstractAsyncContextManager[None]] | None = None) -> None:
        self.replica = replica
        self.store = store
        self._own_cache = cache_dir is None
        self.cache = pathlib.Path(cache_dir or tempfile.mkdtemp(prefix="zerokl-weights-"))
        self._not_serving = not_serving   # ServiceServer.not_serving (an async context manager factory)
        self._lock = asyncio.Lock()

    async def switch(self, version: str) -> ServiceIdentity:
        """Serve ``version`` (or ``latest``) from now on; returns the replica's new identity."""
        if not version:
            raise InvalidArgument.field("version", "name a weight-store version or 'latest'")
        async with self._lock:
            try:
                return await self._switch(version)
            except grpc.aio.AioRpcError as err:  # the store's NOT_FOUND / DATA_LOSS / UNAVAILABLE, relayed
                raise RelayedError(err, f"weight store {self.store.target}") from None

    async def _switch(self, version: str) -> ServiceIdentity:
        manifest = await self.store.manifest(version)
        if manifest.version == self.replica.identity.weights_version:
            return self.replica.identity
        self._check_spec(manifest.version, manifest.spec.numerics_fingerprint)
        dest = self.cache / manifest.version
        await self.store.fetch(manifest.version, dest, serving_only=True)
        # An FP8 replica (identity dtype float8_e4m3fn) loads FP8: a non-FP8 version is quantized on load.
        fp8 = self.replica.identity.dtype == "float8_e4m3fn"
        dtype = torch.float8_e4m3fn if fp8 else self.replica.dtype
        model = await asyncio.to_thread(Model.from_pretrained, dest, dtype=dtype)
        if model.config != self.replica.model_config:
            raise FailedPrecondition(
                f"version {manifest.version!r} has another model config than this replica serves",
                precondition_violations=[PreconditionViolation("MODEL_CONFIG", manifest.version,
                                                               "differs from the replica's model config")])
        async with self._not_serving() if self._not_serving else contextlib.nullcontext():
            await self.replica.load_weights(model.state_dict(), manifest.version)
        await asyncio.to_thread(shutil.rmtree, dest, True)  # the weights live in the engine now
        identity = self.replica.identity
        set_serving_info(identity)
        return identity

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

