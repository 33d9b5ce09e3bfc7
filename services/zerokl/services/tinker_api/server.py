"""``zerokl serve tinker`` / ``python -m zerokl.services.tinker_api``: the Tinker endpoint.

    zerokl serve tinker --weight-store ADDR [--trainer ADDR] --sampler ADDR[,ADDR...]
                        [--base-model VERSION] [--model-name NAME ...] [--tokenizer countdown|PATH]
                        [--http-port 8000] [--port 50056]

Serves Tinker's REST API on ``--http-port`` (uvicorn; TLS with --tls-cert/--tls-key) for the
official ``tinker`` SDK (``TINKER_BASE_URL=http://HOST:PORT``), and gRPC health and reflection on
``--port`` like every zerokl service (what ``zerokl up`` and Kubernetes probe), with ``zerokl_``
Prometheus metrics on ``--metrics-port`` and OTLP traces (each HTTP request a span whose trace
continues into its trainer and sampler calls).

The endpoint trains and samples one base model: weight-store version ``--base-model`` (default:
the store's newest at start), named ``--model-name`` (the first is canonical; default
``zerokl/<version>``) in Tinker's ``base_model``. Its tokenizer (``--tokenizer``) is written as a
local directory transformers loads offline, which ``get_tokenizer()`` returns. Calls to the trainer,
the samplers and the store carry the peer token (the trainer's steps are internal RPCs); the SDK's
API key is checked against the client token.

On start one line goes to stdout, ``tinker listening on http://HOST:PORT grpc HOST:PORT ...``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import pathlib
import re
import sys
import tempfile
from typing import Sequence

import uvicorn

import grpc

from zerokl.kernels.dtypes import COMPUTE_DTYPES
from zerokl.services.runtime.auth import PEER_TOKEN_ENV, PEER_TOKEN_FILE_ENV, load_auth_token
from zerokl.services.runtime.info import ServiceIdentity, default_replica_id, identity_to_proto
from zerokl.services.runtime.metrics import MetricsServer, set_serving_info
from zerokl.services.runtime.server import (ServiceServer, add_server_arguments, options_from_args, peer_credentials,
                                            serve)
from zerokl.services.tinker_api.app import build_app
from zerokl.services.tinker_api.futures import FutureStore
from zerokl.services.tinker_api.samplers import SamplerPool
from zerokl.services.tinker_api.service import TinkerService
from zerokl.services.tinker_api.types import BaseModel
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.tokenizer import write_hf_tokenizer
from zerokl.v1 import common_pb2, tinker_endpoint_pb2_grpc

__all__ = ["DEFAULT_PORT", "DEFAULT_HTTP_PORT", "build_parser", "main"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 50056
DEFAULT_HTTP_PORT = 8000
_PRESET = re.compile(r"preset:([A-Za-z0-9_-]+)(?::seed(\d+))?")


class _EndpointInfo(tinker_endpoint_pb2_grpc.TinkerEndpointServicer):
    """``zerokl.v1.TinkerEndpoint/Info``: the endpoint's identity (its cluster id among it)."""

    def __init__(self, identity: ServiceIdentity) -> None:
        self._identity = identity

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ServiceInfo:
        return identity_to_proto(self._identity)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerokl serve tinker", allow_abbrev=False,
                                description="Tinker's REST API (the official tinker SDK) on zerokl's trainer and "
                                            "replicas.")
    c = p.add_argument_group("cluster")
    c.add_argument("--weight-store", metavar="ADDR", required=True, help="host:port of the weight store")
    c.add_argument("--trainer", metavar="ADDR", default=None,
                   help="host:port of the trainer (absent: sampling only)")
    c.add_argument("--sampler", metavar="ADDR", action="append", default=[],
                   help="host:port of a decode replica this endpoint owns for sampling, outside the scheduler's "
                        "fleet (repeatable, or comma-separated)")
    m = p.add_argument_group("model")
    m.add_argument("--base-model", metavar="VERSION", default=None,
                   help="weight-store version of the base model (default: the store's newest at start), or "
                        "preset:NAME[:seedN]: the version preset-NAME-seedN (what replicas started with --preset "
                        "serve), published into the store in --dtype when it is not there yet")
    m.add_argument("--dtype", choices=COMPUTE_DTYPES, default="float32",
                   help="the dtype a preset base model is published in (the fleet's; default %(default)s)")
    m.add_argument("--model-name", metavar="NAME", action="append", default=[],
                   help="a name Tinker's base_model may use for it; the first is canonical (repeatable; "
                        "default zerokl/<version>)")
    m.add_argument("--tokenizer", default="countdown",
                   help="'countdown', or a tokenizer.json path / directory (default %(default)s)")
    m.add_argument("--state-dir", default=None,
                   help="where the tokenizer directory get_tokenizer() returns is written (default: a fresh "
                        "temporary directory)")
    h = p.add_argument_group("http")
    h.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="Tinker REST port, 0 picks a free one (default %(default)s)")
    h.add_argument("--long-poll", type=float, default=30.0,
                   help="seconds a retrieve_future waits for a result before answering try_again (default "
                        "%(default)s; the SDK waits 45)")
    c.add_argument("--sampler-wait", type=float, default=300.0,
                   help="seconds to wait at start for the sampler replicas to answer (default %(default)s)")
    h.add_argument("--swap-wait", type=float, default=600.0,
                   help="seconds a model's call waits for another model to reach a step boundary on the trainer "
                        "(default %(default)s)")
    p.add_argument("--replica-id", default=None, help="name reported by Info (default: pod name or host-pid)")
    add_server_arguments(p, DEFAULT_PORT)
    return p


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the gRPC side's serve() owns SIGTERM and drains both."""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201 - uvicorn's hook
        yield


async def _base_model(args: argparse.Namespace, store: WeightStoreClient, state_dir: pathlib.Path) -> BaseModel:
    preset = _PRESET.fullmatch(args.base_model or "")
    if preset:
        name, seed = preset.group(1), int(preset.group(2) or 0)
        version = f"preset-{name}-seed{seed}"
        if version not in {e.manifest.version for e in await store.list()}:
            try:
                await store.publish_preset(name, seed, args.dtype, version)
            except ValueError as err:
                raise SystemExit(f"--base-model {args.base_model}: {err}") from None
        manifest = await store.manifest(version)
    else:
        manifest = await store.manifest(args.base_model or "latest")
    config = manifest.spec.model_config
    names = args.model_name or [f"zerokl/{manifest.version}"]
    # Named after the model: the SDK's SamplingClient.get_base_model() returns this path.
    tokenizer_dir = write_hf_tokenizer(args.tokenizer, state_dir / names[0].replace("/", "--")).resolve()
    return BaseModel(name=names[0], aliases=tuple(dict.fromkeys((*names[1:], manifest.version))),
                     version=manifest.version, numerics_fingerprint=manifest.spec.numerics_fingerprint,
                     tokenizer_dir=str(tokenizer_dir), vocab_size=int(config["vocab_size"]),
                     max_context_length=int(config["max_position_embeddings"]))


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    options = options_from_args(args)
    peer = load_auth_token(args.peer_token_file, env=PEER_TOKEN_ENV, file_env=PEER_TOKEN_FILE_ENV)
    credentials = peer_credentials(args)
    samplers = [a for spec in args.sampler for a in spec.split(",") if a]
    state_dir = pathlib.Path(args.state_dir or tempfile.mkdtemp(prefix="zerokl-tinker-")).expanduser()

    async def run() -> None:
        store = WeightStoreClient(args.weight_store, token=peer, credentials=credentials)
        trainer = TrainerClient(args.trainer, token=peer, credentials=credentials) if args.trainer else None
        pool = SamplerPool(samplers, token=peer, credentials=credentials)
        service: TinkerService | None = None
        http: _Uvicorn | None = None
        serving: asyncio.Task[None] | None = None
        try:
            base = await _base_model(args, store, state_dir)
            await pool.start(args.sampler_wait)
            # The endpoint computes nothing itself: its identity names it, its cluster and the base model.
            identity = ServiceIdentity("tinker", args.replica_id or default_replica_id("tinker"),
                                       weights_version=base.version)
            service = TinkerService(base, trainer=trainer, samplers=pool, store=store,
                                    futures=FutureStore(), swap_wait_s=args.swap_wait, long_poll_s=args.long_poll)

            async def setup(server: ServiceServer) -> None:
                nonlocal http, serving
                server.add_servicer(tinker_endpoint_pb2_grpc.add_TinkerEndpointServicer_to_server,
                                    _EndpointInfo(identity), "zerokl.v1.TinkerEndpoint")
                set_serving_info(identity)
                tls = options.tls
                http = _Uvicorn(uvicorn.Config(
                    build_app(service, options.auth), host=args.host, port=args.http_port, lifespan="off",
                    log_level="warning", access_log=False, ssl_certfile=tls.cert_file if tls else None,
                    ssl_keyfile=tls.key_file if tls else None))
                serving = asyncio.ensure_future(http.serve())
                while not http.started:
                    if serving.done():
                        serving.result()            # raises what stopped it (e.g. the port is taken)
                        raise SystemExit(f"tinker: the HTTP server on port {args.http_port} stopped at start")
                    await asyncio.sleep(0.05)

                async def stop_http() -> None:      # draining: stop taking requests, let in-flight ones end
                    assert http is not None
                    http.should_exit = True
                server.on_drain(stop_http)

            def ready(server: ServiceServer, metrics: MetricsServer | None) -> None:
                assert http is not None
                port = http.servers[0].sockets[0].getsockname()[1]
                scheme = "https" if options.tls else "http"
                where = f" metrics on :{metrics.port}" if metrics is not None else ""
                print(f"tinker listening on {scheme}://{args.host}:{port} grpc {server.address}{where} base model: "
                      f"{base.name} = {base.version} trainer: {args.trainer or '-'} samplers: "
                      f"{','.join(samplers) or '-'} tokenizer: {base.tokenizer_dir}", flush=True)

            await serve("tinker", setup, options, metrics_port=args.metrics_port, metrics_host=args.host,
                        on_ready=ready)
        finally:
            if serving is not None:
                if http is not None:
                    http.should_exit = True
                with contextlib.suppress(Exception):
                    await serving
            if service is not None:
                await service.close()
            await pool.close()
            if trainer is not None:
                await trainer.close()
            await store.close()

    asyncio.run(run())
    return 0
