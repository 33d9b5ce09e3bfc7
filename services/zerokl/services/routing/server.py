"""``zerokl serve scheduler``: the front door over a static fleet of prefill/decode replicas.

    zerokl serve scheduler --decode 127.0.0.1:50052,127.0.0.1:50062 --prefill 127.0.0.1:50051 --port 50050

Replicas come from ``--decode``/``--prefill`` (repeatable, comma-separated)
and/or a YAML ``--replicas FILE``, and in Kubernetes from the EndpointSlices of
the ``--kube-decode-service``/``--kube-prefill-service`` Services. On start one line goes to stdout,
``scheduler listening on HOST:PORT ...``, which ``zerokl up`` and the tests
read. Health stays NOT_SERVING until a decode replica of the current pin is
healthy.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import sys
from typing import Sequence

from zerokl.services.runtime.auth import TlsConfig
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.runtime.metrics import start_metrics_server
from zerokl.services.runtime.server import ServiceServer, add_server_arguments, options_from_args, peer_credentials
from zerokl.services.runtime.tracing import configure_tracing
from zerokl.services.routing.registry import (
    ReplicaSource,
    Registry,
    StaticSource,
    load_static_config,
    parse_addresses,
)
from zerokl.services.jobs.manager import JobManager
from zerokl.services.jobs.service import add_jobs_service
from zerokl.services.routing.router import Pin, Policy
from zerokl.services.routing.scheduler import Scheduler, SchedulerConfig

__all__ = ["DEFAULT_PORT", "build_parser", "sources_from_args", "config_from_args", "main"]

DEFAULT_PORT = 50050


def build_parser() -> argparse.ArgumentParser:
    """The scheduler's command line."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="zerokl serve scheduler",
        description="Route Generate/Score/Abort to prefill and decode replicas that compute the same bits, "
                    "retrying on another replica when one fails.")
    f = p.add_argument_group("fleet")
    f.add_argument("--decode", action="append", metavar="ADDR[,ADDR]", default=[],
                   help="decode replica host:port (repeatable or comma-separated)")
    f.add_argument("--prefill", action="append", metavar="ADDR[,ADDR]", default=[],
                   help="prefill replica host:port (repeatable or comma-separated); with prefill replicas the "
                        "prompt's KV is computed there and handed to a decode replica")
    f.add_argument("--replicas", metavar="FILE", default=None,
                   help="YAML file with 'decode' and 'prefill' address lists (added to the flags)")
    f.add_argument("--kube-decode-service", metavar="NAME", default=None,
                   help="in Kubernetes: follow the EndpointSlices of this decode Service (a ReplicaSource next to "
                        "the flags; needs get/list/watch on endpointslices)")
    f.add_argument("--kube-prefill-service", metavar="NAME", default=None,
                   help="in Kubernetes: follow the EndpointSlices of this prefill Service")
    f.add_argument("--kube-namespace", default=None,
                   help="namespace of those Services (default: this pod's, else 'default')")
    f.add_argument("--kube-port-name", default="grpc", help="the Services' gRPC port name (default %(default)s)")
    f.add_argument("--poll-interval", type=float, default=1.0, help="seconds between health/Info polls")
    f.add_argument("--poll-timeout", type=float, default=2.0, help="deadline of one health/Info poll")
    f.add_argument("--info-interval", type=float, default=30.0,
                   help="seconds between Info reads of a replica that stays SERVING (it is read again whenever "
                        "one returns to SERVING, as after a weight swap)")
    f.add_argument("--replica-ca", default=None,
                   help="PEM CA to verify replicas with (TLS to replicas; with --tls-cert/--tls-key the scheduler "
                        "presents its own certificate for mTLS)")
    j = p.add_argument_group("jobs")
    j.add_argument("--trainer", metavar="ADDR", default=None,
                   help="trainer address: enables the Jobs API (SFT, DPO and RL jobs run there, and the fleet "
                        "switches to every version they publish)")
    j.add_argument("--weight-store", metavar="ADDR", default=None,
                   help="the weight store the trainer publishes to: tells a store outage from a trainer restart, "
                        "and versions that fail their canary are deleted there (so no restart serves them)")
    j.add_argument("--fleet-wait", type=float, default=120.0, metavar="S",
                   help="seconds a job waits for a restarting prefill/decode replica before it fails "
                        "(default %(default)s)")
    j.add_argument("--store-wait", type=float, default=120.0, metavar="S",
                   help="seconds a job waits for an unreachable weight store before it fails, and for the trainer's "
                        "records: a step's for the oldest checkpoint beyond the record lag and the job's last ones "
                        "at its end (past it the job fails, naming the version not durable yet), and those a failed "
                        "job's rollback, the delete of a version (then also the store's Unpin and Delete of it), or a "
                        "co-located step's wake needs (default %(default)s)")
    j.add_argument("--colocate-sleep-level", type=int, choices=(0, 1, 2), default=0, metavar="N",
                   help="co-location (the fleet and the trainer share a device): before each RL step trains, every "
                        "replica releases its KV cache (1) or its KV cache and weights (2); the step's weight switch "
                        "wakes it (0: off, the default)")
    j.add_argument("--state-dir", metavar="DIR", default=None,
                   help="keep job records (jobs.json) and the fleet's target weights version (fleet.json) here, "
                        "so they survive a restart (default: memory only)")
    r = p.add_argument_group("routing")
    r.add_argument("--pin-weights-version", default="",
                   help="serve requests that pin no weights version with this one (default: the one every "
                        "healthy replica agrees on)")
    r.add_argument("--pin-fingerprint", default="",
                   help="serve requests that pin no numerics fingerprint with this one (default: the one every "
                        "healthy replica agrees on)")
    r.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.LEAST_LOADED.value,
                   help="how to pick among replicas that compute alike (default %(default)s)")
    r.add_argument("--max-attempts", type=int, default=3, help="replicas one request may fail on before UNAVAILABLE")
    r.add_argument("--route-wait", type=float, default=5.0,
                   help="seconds a request waits for a healthy replica of its pin before failing")
    r.add_argument("--handoff-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a decode replica may take to read a prompt's KV from the prefill replica "
                        "(prefill included) before the attempt is retried elsewhere (default %(default)s)")
    p.add_argument("--replica-id", default=None, help="name reported by Info (default: pod name or host-pid)")
    add_server_arguments(p, DEFAULT_PORT)
    return p


def sources_from_args(args: argparse.Namespace) -> list[ReplicaSource]:
    """The replica sources the flags name (flags first, then the file)."""
    sources: list[ReplicaSource] = []
    decode, prefill = parse_addresses(args.decode), parse_addresses(args.prefill)
    try:
        if decode or prefill:
            sources.append(StaticSource.from_addresses(decode, prefill, name="flags"))
        if args.replicas:
            sources.append(load_static_config(args.replicas))
        if args.kube_decode_service or args.kube_prefill_service:
            from zerokl.services.routing.kube import EndpointSliceSource, in_cluster_namespace
            services = {role: name for role, name in (("decode", args.kube_decode_service),
                                                      ("prefill", args.kube_prefill_service)) if name}
            sources.append(EndpointSliceSource(args.kube_namespace or in_cluster_namespace(), services,
                                               port_name=args.kube_port_name))
    except (OSError, ValueError) as err:
        raise SystemExit(f"zerokl serve scheduler: {err}") from None
    if not sources:
        raise SystemExit("zerokl serve scheduler: name at least one decode replica (--decode ADDR, --replicas FILE "
                         "or --kube-decode-service NAME)")
    return sources


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """Routing settings from the flags."""
    if args.max_attempts < 1:
        raise SystemExit("--max-attempts must be >= 1")
    if not args.handoff_timeout > 0:
        raise SystemExit("--handoff-timeout must be > 0")
    return SchedulerConfig(pin=Pin(args.pin_weights_version, args.pin_fingerprint), policy=Policy(args.policy),
                           max_attempts=args.max_attempts, route_wait_s=args.route_wait,
                           handoff_timeout_s=args.handoff_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scheduler until SIGTERM/SIGINT; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    options = options_from_args(args)
    sources = sources_from_args(args)
    config = config_from_args(args)
    peers = peer_credentials(args)
    credentials = peers
    if args.replica_ca:
        credentials = TlsConfig.channel_credentials(args.replica_ca, args.tls_cert, args.tls_key)

    async def run() -> None:
        provider = configure_tracing("scheduler")
        server = ServiceServer("scheduler", dataclasses.replace(options, tracer_provider=provider))
        # Hops to replicas and the trainer carry the peer token (SwitchWeights, trainer steps are internal).
        registry = Registry(sources, poll_interval_s=args.poll_interval, poll_timeout_s=args.poll_timeout,
                            info_interval_s=args.info_interval,
                            token=options.auth.peer_token, credentials=credentials, tracer_provider=provider)
        scheduler = Scheduler(registry, config, args.replica_id, state_dir=args.state_dir)
        scheduler.attach(server)
        trainer = TrainerClient(args.trainer, token=options.auth.peer_token, credentials=peers) if args.trainer else None
        store = (WeightStoreClient(args.weight_store, token=options.auth.peer_token, credentials=peers)
                 if args.weight_store else None)
        jobs = JobManager(trainer, scheduler.generate, scheduler.switch_weights, weight_store=store,
                          state_dir=args.state_dir, fleet_wait_s=args.fleet_wait, store_wait_s=args.store_wait,
                          served_version=lambda: scheduler.target_version or scheduler.identity.weights_version,
                          sleep_fleet=(functools.partial(scheduler.sleep, args.colocate_sleep_level)
                                       if args.colocate_sleep_level else None),
                          wake_fleet=scheduler.wake if args.colocate_sleep_level else None)
        add_jobs_service(server, jobs)
        metrics = start_metrics_server(args.metrics_port, args.host) if args.metrics_port is not None else None
        try:
            await scheduler.start()
            await jobs.start()
            await server.start()
            # start() reports SERVING; correct it before anyone is told where we listen.
            await scheduler.sync_health()
            where = f" metrics on :{metrics.port}" if metrics is not None else ""
            fleet = " ".join(f"{role}: {','.join(v.address for v in scheduler.replicas() if v.role == role)}"
                             for role in ("decode", "prefill") if any(v.role == role for v in scheduler.replicas()))
            # One parseable line on stdout: `zerokl up` and the tests wait for it to learn the port.
            print(f"scheduler listening on {server.address}{where} {fleet}", flush=True)
            await server.serve_until_signal()
        finally:
            await jobs.close()
            for client in (trainer, store):
                if client is not None:
                    await client.close()
            await scheduler.close()
            if metrics is not None:
                metrics.close()
            if provider is not None:
                provider.shutdown()

    asyncio.run(run())
    return 0
