"""Kubernetes discovery: the scheduler follows EndpointSlices through the real ``kubernetes`` client.

A fake API server on loopback (kube_api_fake) serves list + watch; the
replicas are real in-process prefill/decode servers; the registry and the
scheduler are the production ones. Covers: the first list, pods becoming
ready, joining and leaving through watch events, a watch that expires (410
Gone) and is re-listed, and a rolling upgrade that would mix numerics
fingerprints, which the scheduler refuses exactly as on one machine.
"""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from conftest import CONFIG, WEIGHTS, numbers, offline, replica_server
from kube_api_fake import FakeKubeAPI, endpoint_slice
from zerokl.kernels.model import Model
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.runtime import ServerOptions, ServiceServer
from zerokl.services.routing import Registry, Scheduler, SchedulerConfig
from zerokl.services.routing.kube import EndpointSliceSource, load_api_client
from zerokl.vocab import SamplingOptions

NS = "zerokl"
SERVICES = {"decode": "r1-zerokl-decode", "prefill": "r1-zerokl-prefill"}


def _shared_free_port(*hosts: str) -> int:
    """A port free on every loopback host given (pods of one slice share their port, each at its own IP)."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind((hosts[0], 0))
            port = first.getsockname()[1]
            try:
                for host in hosts[1:]:
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no port free on all of " + ", ".join(hosts))


async def _close(registry: Registry) -> None:
    """Close ``registry`` while it polls every 0.1 s (a close that hung here once: the poll loop now
    also stops on the registry's closing flag, not only on a cancellation grpc.aio may swallow)."""
    await asyncio.wait_for(registry.close(), 30)


async def _until(registry: Registry, predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            views = [(v.describe(), v.healthy, v.reason) for v in registry.views()]
            raise AssertionError(f"timed out waiting for {what}; registry: {views}")
        await registry.wait_changed(0.2)


def _fleet(registry: Registry) -> set[tuple[str, str, str, bool]]:
    return {(v.role, v.address, v.endpoint.name, v.healthy) for v in registry.views()}


def test_the_scheduler_follows_endpoint_slices_as_pods_come_ready_join_and_leave(model: Model,
                                                                                tmp_path: pathlib.Path) -> None:
    port = _shared_free_port("127.0.0.2", "127.0.0.3")

    async def main() -> None:
        async with replica_server(model, options=ServerOptions(host="127.0.0.2", port=port)) as (d0, _), \
                replica_server(model, options=ServerOptions(host="127.0.0.3", port=port)) as (d1, _), \
                replica_server(model, "prefill") as (p0, _):
            with FakeKubeAPI() as api:
                # One decode slice: pod a ready, pod b still starting. A slice of another Service is ignored.
                api.apply("endpointslices", endpoint_slice(
                    "r1-zerokl-decode-x1", SERVICES["decode"],
                    [("127.0.0.2", "decode-a", True), ("127.0.0.3", "decode-b", False)], port))
                api.apply("endpointslices", endpoint_slice(
                    "r1-zerokl-prefill-x1", SERVICES["prefill"], [("127.0.0.1", "prefill-a", True)], p0.port))
                api.apply("endpointslices", endpoint_slice(
                    "other-x1", "other-service", [("127.0.0.1", "other", True)], p0.port))
                client = load_api_client(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")))
                source = EndpointSliceSource(NS, SERVICES, api_client=client, watch_timeout_s=1)
                registry = Registry([source], poll_interval_s=0.1)
                await registry.start()
                try:
                    await _until(registry, lambda: all(v.healthy for v in registry.views()), "first poll")
                    assert _fleet(registry) == {("decode", d0.address, "decode-a", True),
                                                ("prefill", p0.address, "prefill-a", True)}

                    # Pod b becomes ready: a MODIFIED event of the same slice.
                    api.apply("endpointslices", endpoint_slice(
                        "r1-zerokl-decode-x1", SERVICES["decode"],
                        [("127.0.0.2", "decode-a", True), ("127.0.0.3", "decode-b", True)], port))
                    await _until(registry, lambda: ("decode", d1.address, "decode-b", True) in _fleet(registry),
                                 "decode-b to join")

                    # Pod a is terminating (not ready), then its slice entry goes: it leaves the fleet.
                    api.apply("endpointslices", endpoint_slice(
                        "r1-zerokl-decode-x1", SERVICES["decode"], [("127.0.0.3", "decode-b", True)], port))
                    await _until(registry, lambda: d0.address not in {v.address for v in registry.views()},
                                 "decode-a to leave")

                    # The API server compacts its history: the next resume gets 410 Gone, the source lists again
                    # and still follows changes made after that.
                    api.compact()
                    await asyncio.sleep(1.5)  # past the 1 s watch timeout: the resume hits the compaction
                    api.delete("endpointslices", NS, "r1-zerokl-prefill-x1")
                    await _until(registry, lambda: p0.address not in {v.address for v in registry.views()},
                                 "prefill-a to leave after a re-list")
                    assert _fleet(registry) == {("decode", d1.address, "decode-b", True)}
                    lists = [q for m, path, q in api.requests if path.endswith("/endpointslices")
                             and q.get("watch") != "true" and "r1-zerokl-prefill" in q.get("labelSelector", "")]
                    assert len(lists) >= 2, "the expired prefill watch was not re-listed"
                finally:
                    await _close(registry)
            # Only list and watch of EndpointSlices, by the Service label (what the chart's Role grants).
            assert {(m, path) for m, path, _ in api.requests} == {
                ("GET", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices")}
            assert {q["labelSelector"] for _, _, q in api.requests} == {
                f"kubernetes.io/service-name={s}" for s in SERVICES.values()}

    asyncio.run(main())


def test_a_rolling_upgrade_that_mixes_fingerprints_is_refused_by_the_scheduler(model: Model,
                                                                              tmp_path: pathlib.Path) -> None:
    """A new pod whose numerics differ (here bfloat16 weights: another fingerprint) joins through a watch event.

    Requests that pin nothing are refused FAILED_PRECONDITION naming both pods;
    a request pinned to the old fingerprint is still served by the old pod alone,
    with exactly the bits the request gets offline.
    """
    bf16 = Model(CONFIG, seed=0, dtype=torch.bfloat16)
    ids = tuple(range(4, 14))
    options = SamplingOptions(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    expected = numbers(offline(model, ids, options))

    async def main() -> None:
        async with replica_server(model) as (old, old_replica), replica_server(bf16) as (new, new_replica):
            assert old_replica.identity.numerics_fingerprint != new_replica.identity.numerics_fingerprint
            with FakeKubeAPI() as api:
                api.apply("endpointslices", endpoint_slice(
                    "r1-zerokl-decode-old", SERVICES["decode"], [("127.0.0.1", "decode-old", True)], old.port))
                client = load_api_client(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")))
                source = EndpointSliceSource(NS, {"decode": SERVICES["decode"]}, api_client=client)
                registry = Registry([source], poll_interval_s=0.1)
                scheduler = Scheduler(registry, SchedulerConfig(route_wait_s=2.0), replica_id="scheduler-test")
                server = ServiceServer("scheduler")
                scheduler.attach(server)
                await scheduler.start()
                await server.start()
                await scheduler.sync_health()
                try:
                    async with InferenceClient(server.address) as front:
                        request = InferenceRequest(prompt_ids=ids, options=options, request_id="r")
                        before = await front.generate_all(request)
                        assert numbers(before.samples) == expected
                        assert before.numerics_fingerprint == old_replica.identity.numerics_fingerprint

                        # The rollout's new pod (bf16 numerics) becomes ready next to the old one.
                        api.apply("endpointslices", endpoint_slice(
                            "r1-zerokl-decode-new", SERVICES["decode"], [("127.0.0.1", "decode-new", True)],
                            new.port))
                        await _until(registry, lambda: sum(v.healthy for v in registry.views()) == 2,
                                     "the new pod to be polled")
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await front.generate_all(request)
                        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                        detail = refused.value.details()
                        assert "mixed fleet" in detail and "decode-old" in detail and "decode-new" in detail

                        # Pinned to the old numerics (what a blue/green cut-over does), it is served, bit for bit.
                        pinned = InferenceRequest(prompt_ids=ids, options=options, request_id="r2",
                                                  numerics_fingerprint=old_replica.identity.numerics_fingerprint)
                        after = await front.generate_all(pinned)
                        assert numbers(after.samples) == expected
                        assert after.weights_version == WEIGHTS
                        assert {v.endpoint.name: v.routed for v in scheduler.replicas()} == {
                            "decode-old": 2, "decode-new": 0}
                finally:
                    await server.drain(0)
                    registry.poll_interval_s = 3600.0  # park the poller first (see _close)
                    await asyncio.sleep(0.8)
                    await scheduler.close()

    asyncio.run(main())


def test_a_source_routes_only_prefill_and_decode() -> None:
    with pytest.raises(ValueError, match="roles must be among"):
        EndpointSliceSource(NS, {"trainer": "r1-zerokl-trainer"})


def test_the_scheduler_flags_select_the_kubernetes_source() -> None:
    from zerokl.services.routing.server import build_parser, sources_from_args

    args = build_parser().parse_args(["--kube-decode-service", "r1-zerokl-decode", "--kube-prefill-service",
                                      "r1-zerokl-prefill", "--kube-namespace", NS])
    [source] = sources_from_args(args)
    assert isinstance(source, EndpointSliceSource)
    assert (source.namespace, source.services, source.port_name) == (NS, SERVICES, "grpc")
