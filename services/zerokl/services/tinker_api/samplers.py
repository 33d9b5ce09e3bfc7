"""The sampler replicas: decode replicas the Tinker endpoint owns, outside the scheduler's fleet.

A Tinker sampling client is bound to one weights version (a base model, or what a training client
saved for sampling). The fleet serves one version for everyone (its canary, its jobs); switching it
for one user's checkpoint would change every other client's answers. So the endpoint samples on
replicas of its own (``zerokl up --tinker-samplers N``): ordinary decode replicas, the same engine and
kernels, each serving one version at a time and switched with the same ``SwitchWeights`` (the
trainer's shared memory on its host, checksum checked; else the weight store) when a request names
another one:

    async with pool.serving(version, shared) as replica:   # a replica serving `version`
        async for delta in replica.generate(request): ...  # pinned to the version and its fingerprint

Requests for the version a replica serves run on it at once, concurrently; a request for another
version takes an idle replica (preferring one whose version no request waits for) and switches it,
or waits. A replica serving a version others wait for stops admitting new requests for it once one
of them has waited (``drain_after_s``), so two sampling clients alternating on one replica both get
served.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
from opentelemetry import trace

from zerokl.services.inference.client import InferenceClient
from zerokl.services.runtime.errors import Unavailable
from zerokl.services.weightstore.shared import SharedExport

__all__ = ["SamplerPool"]

log = logging.getLogger(__name__)


@dataclass
class _Replica:
    client: InferenceClient
    address: str
    version: str = ""
    inflight: int = 0
    switching: bool = False


class SamplerPool:
    """Version-bound access to the endpoint's sampler replicas (see the module docstring)."""

    def __init__(self, addresses: Sequence[str], *, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 tracer_provider: trace.TracerProvider | None = None, switch_timeout_s: float = 600.0,
                 drain_after_s: float = 1.0) -> None:
        self._replicas = [_Replica(InferenceClient(a, token=token, credentials=credentials,
                                                   tracer_provider=tracer_provider), a) for a in addresses]
        self.switch_timeout_s, self.drain_after_s = switch_timeout_s, drain_after_s
        self._changed = asyncio.Condition()
        self._waiting: dict[str, list[float]] = {}     # version -> when each of its waiters started waiting

    def __len__(self) -> int:
        return len(self._replicas)

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self._replicas]

    async def start(self, wait_s: float = 60.0) -> None:
        """Learn what each replica serves (waiting up to ``wait_s`` for them to answer)."""
        deadline = time.monotonic() + wait_s
        for r in self._replicas:
            while True:
                try:
                    r.version = (await r.client.info()).weights_version
                    break
                except grpc.aio.AioRpcError as err:
                    if time.monotonic() > deadline:
                        raise Unavailable(f"sampler replica {r.address} did not answer: {err.details()}") from None
                    await asyncio.sleep(0.5)

    async def close(self) -> None:
        for r in self._replicas:
            await r.client.close()

    def versions(self) -> dict[str, str]:
        """What each replica serves now (address -> version)."""
        return {r.address: r.version for r in self._replicas}

    @contextlib.asynccontextmanager
    async def serving(self, version: str, shared: SharedExport | None = None
                      ) -> AsyncIterator[InferenceClient]:
        """A replica serving ``version`` for the duration (switched to it first if needed; ``shared``:
        the trainer's in-memory copy of it). UNAVAILABLE when there are no sampler replicas."""
        if not self._replicas:
            raise Unavailable("this Tinker endpoint has no sampler replicas (zerokl up --tinker-samplers N; "
                              "serve tinker --sampler ADDR)")
        replica = await self._acquire(version, shared)
        try:
            yield replica.client
        except grpc.aio.AioRpcError:
            # The replica may not serve what we think (it restarted at its start version, or died):
            # learn what it serves, or make the next request switch it.
            try:
                replica.version = (await replica.client.info()).weights_version
            except grpc.aio.AioRpcError:
                replica.version = ""
            raise
        finally:
            async with self._changed:
                replica.inflight -= 1
                self._changed.notify_all()

    async def _acquire(self, version: str, shared: SharedExport | None) -> _Replica:
        since = time.monotonic()
        async with self._changed:
            self._waiting.setdefault(version, []).append(since)
            try:
                while True:
                    serving = [r for r in self._replicas if r.version == version and not r.switching]
                    if serving and not self._drained(serving[0]):
                        r = min(serving, key=lambda r: r.inflight)
                        r.inflight += 1
                        return r
                    # (one already serving `version` but drained for another's waiters is not taken back)
                    idle = [r for r in self._replicas if r.inflight == 0 and not r.switching and r.version != version]
                    if idle:
                        # Prefer a replica whose version nobody waits for (it will not be missed).
                        r = min(idle, key=lambda r: r.version in self._waiting)
                        r.switching, r.inflight = True, 1
                        break
                    await self._changed.wait()
            finally:
                waiters = self._waiting[version]
                waiters.remove(since)
                if not waiters:
                    del self._waiting[version]
        try:
            identity = await r.client.switch_weights(version, shared=shared, timeout=self.switch_timeout_s)
            r.version = identity.weights_version
            log.info("tinker: sampler replica %s serves %s", r.address, r.version)
        except BaseException:
            # The replica keeps what it served when a switch fails (its contract); ask it to be sure.
            with contextlib.suppress(grpc.aio.AioRpcError):
                r.version = (await r.client.info()).weights_version
            async with self._changed:
                r.switching, r.inflight = False, 0
                self._changed.notify_all()
            raise
        async with self._changed:
            r.switching = False
            self._changed.notify_all()
        return r

    def _drained(self, replica: _Replica) -> bool:
        """True when requests for another version have waited long enough that ``replica`` should
        stop admitting its own version's (it switches once they finish)."""
        if len(self._replicas) > 1:
            return False
        now = time.monotonic()
        return any(v != replica.version and now - min(since) >= self.drain_after_s for v, since in self._waiting.items())
