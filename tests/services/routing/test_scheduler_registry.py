"""The registry follows a changing source (the shape of Kubernetes discovery) and the router's pin rules."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Sequence

import grpc
import pytest

from conftest import WEIGHTS, numbers, offline, replica_server, routed, scheduler_server
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.runtime.errors import UnservedPin
from zerokl.services.runtime.info import ServiceIdentity
from zerokl.services.routing import (
    MixedFleet,
    NoReplica,
    Pin,
    Policy,
    Registry,
    ReplicaEndpoint,
    ReplicaSource,
    ReplicaView,
    Router,
    SchedulerConfig,
    resolve_pin,
)
from zerokl.vocab import SamplingOptions


class QueueSource(ReplicaSource):
    """Endpoint sets pushed by the test, as a discovery watch delivers them."""

    name = "queue"

    def __init__(self) -> None:
        self.sets: asyncio.Queue[Sequence[ReplicaEndpoint]] = asyncio.Queue()

    async def watch(self) -> AsyncIterator[Sequence[ReplicaEndpoint]]:
        while True:
            yield await self.sets.get()


def test_the_registry_follows_a_source_as_replicas_come_and_go(model: Model) -> None:
    async def main() -> None:
        async with replica_server(model) as (d0, _), replica_server(model) as (d1, _):
            source = QueueSource()
            registry = Registry([source], poll_interval_s=0.1)
            source.sets.put_nowait([ReplicaEndpoint("decode", d0.address, name="pod-a")])
            await registry.start()
            try:
                [a] = registry.views()
                assert (a.address, a.healthy, a.describe()) == (d0.address, True, f"decode {d0.address} (pod-a)")
                assert a.identity is not None and a.identity.weights_version == WEIGHTS
                with registry.lease(a.endpoint):  # a request in flight on d0 while it leaves the fleet
                    source.sets.put_nowait([ReplicaEndpoint("decode", d1.address, name="pod-b")])
                    while [v.address for v in registry.views() if v.healthy] != [d1.address]:
                        await registry.wait_changed(5)
                    assert registry.client(a.endpoint) is not None  # still reachable until its lease ends
                source.sets.put_nowait([ReplicaEndpoint("decode", d1.address), ReplicaEndpoint("prefill", d0.address)])
                while len(registry.views()) < 2 or not registry.views()[1].reason.startswith("registered as"):
                    await registry.wait_changed(5)
                # d0 answers Info as a decode replica: listed as prefill, it is never routable.
                assert not registry.views()[1].healthy
            finally:
                await registry.close()

    asyncio.run(main())


def test_a_replica_whose_weights_changed_since_the_last_poll_refuses_and_the_request_moves_on(model: Model) -> None:
    ids = tuple(range(4, 20))
    options = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main() -> None:
        async with replica_server(model) as (swapped, replica), replica_server(model) as (steady, _), \
                scheduler_server([swapped.address, steady.address], poll_interval_s=30.0,
                                 config=SchedulerConfig(policy=Policy.ROUND_ROBIN)) as (server, scheduler):
            # What a weight swap does to a replica (the engine now holds "next"); the scheduler's last poll still
            # shows the old version, so the pinned request is refused at admission and moves on.
            replica.engine.weights_version = "next"
            async with InferenceClient(server.address) as client:
                got = await client.generate_all(InferenceRequest(ids, options=options))
            assert numbers(got.samples) == numbers(offline(model, ids, options))
            assert routed(scheduler) == {swapped.address: 1, steady.address: 1}
            while (view := scheduler.replicas()[0]).identity.weights_version != "next":  # type: ignore[union-attr]
                await scheduler.registry.wait_changed(5)  # the failure woke the poller: it re-read Info
            assert view.healthy

    asyncio.run(main())


def _view(address: str, fp: str, weights: str, healthy: bool = True, role: str = "decode",
          in_flight: int = 0) -> ReplicaView:
    identity = ServiceIdentity(role, f"{role}-{address[-1]}", numerics_fingerprint=fp, weights_version=weights,
                               model_config_hash="cfg")
    return ReplicaView(ReplicaEndpoint(role, address), identity, healthy, "" if healthy else "health NOT_SERVING",
                       in_flight, 0)


def test_pin_resolution_and_routing_rules() -> None:
    a, b, c = _view("h:1", "fpA", "v1"), _view("h:2", "fpA", "v1"), _view("h:3", "fpB", "v1")
    assert resolve_pin([a, b], Pin()) == Pin("v1", "fpA")
    with pytest.raises(MixedFleet) as mixed:
        resolve_pin([a, c], Pin())
    assert mixed.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "decode h:1 (decode-1)" in mixed.value.message and "decode h:3 (decode-3)" in mixed.value.message
    assert resolve_pin([a, c], Pin(numerics_fingerprint="fpB")) == Pin("v1", "fpB")
    assert resolve_pin([a, c], Pin(), configured=Pin(numerics_fingerprint="fpA")) == Pin("v1", "fpA")
    # The request's own pin wins over the configured one.
    assert resolve_pin([a, c], Pin(numerics_fingerprint="fpB"), Pin(numerics_fingerprint="fpA")).numerics_fingerprint \
        == "fpB"
    # Weights versions are compared only among replicas that compute alike.
    v2 = _view("h:4", "fpA", "v2")
    with pytest.raises(MixedFleet, match="weights version"):
        resolve_pin([a, v2], Pin())
    assert resolve_pin([a, v2, c], Pin("v2")) == Pin("v2", "fpA")
    # A different model config under one version name is a mixed fleet too.
    odd = dataclasses.replace(b, identity=dataclasses.replace(b.identity, model_config_hash="other"))
    with pytest.raises(MixedFleet, match="model config hash"):
        resolve_pin([a, odd], Pin())
    with pytest.raises(UnservedPin, match="'v9'"):
        resolve_pin([a, c], Pin("v9"))
    with pytest.raises(NoReplica):  # v1/fpA exists but is not healthy now
        resolve_pin([_view("h:1", "fpA", "v1", healthy=False), c], Pin(numerics_fingerprint="fpA"))

    router = Router(Policy.LEAST_LOADED)
    pin = Pin("v1", "fpA")
    busy, idle = _view("h:1", "fpA", "v1", in_flight=2), _view("h:2", "fpA", "v1", in_flight=0)
    assert {router.choose([busy, idle, c], "decode", pin).address for _ in range(4)} == {"h:2"}
    in_turn = Router(Policy.ROUND_ROBIN)
    assert [in_turn.choose([a, b, c], "decode", pin).address for _ in range(4)] == ["h:1", "h:2", "h:1", "h:2"]
    # A replica this request failed on is taken only when nothing else is left.
    assert router.choose([a, b], "decode", pin, avoid=lambda v: v.address == "h:1").address == "h:2"
    assert router.choose([a], "decode", pin, avoid=lambda v: v.address == "h:1").address == "h:1"
    assert router.choose([a, b], "prefill", pin) is None
