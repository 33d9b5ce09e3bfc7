"""The grpc.aio server every zerokl service runs on, and the matching client channel.

:class:`ServiceServer` adds what each service needs around its servicers:
grpc.health.v1 (SERVING / NOT_SERVING, also NOT_SERVING while swapping
weights, while a part reports it cannot serve (:meth:`ServiceServer.set_unfit`) or
draining), server reflection, tracing, optional bearer-token auth,
optional TLS/mTLS, rich error statuses and message size limits. :func:`serve`
runs one until SIGTERM/SIGINT and drains it: health goes NOT_SERVING, new
calls are refused, in-flight calls get ``grace_s`` to finish, then it exits.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import inspect
import logging
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from zerokl.services.runtime.auth import AuthConfig, RoleAuthServerInterceptor, TlsConfig, bearer_token_interceptor, load_auth_config
from zerokl.services.runtime.interceptors import ClientInterceptor, ErrorInterceptor, channel_interceptors
from zerokl.services.runtime.metrics import MetricsServer, start_metrics_server
from zerokl.services.runtime.tracing import TracingClientInterceptor, TracingServerInterceptor, configure_tracing

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ServerOptions",
    "ServiceServer",
    "serve",
    "freeze_startup_heap",
    "add_server_arguments",
    "options_from_args",
    "peer_credentials",
    "create_channel",
    "stream_out",
]

log = logging.getLogger(__name__)

# A 4 MiB chunk plus its envelope must fit, with room to spare; anything much
# larger than that is a client bug or abuse, refused before it is buffered.
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens.

    ``port`` 0 picks a free port (read it back from :attr:`ServiceServer.port`).
    ``drain_delay_s`` keeps accepting calls for a moment after health turns
    NOT_SERVING, so load balancers and the scheduler stop routing here before
    connections are refused.
    """

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 10.0
    drain_delay_s: float = 0.0
    tls: TlsConfig | None = None
    auth: AuthConfig = AuthConfig()          # no token: auth off
    tracer_provider: trace.TracerProvider | None = None


DrainCallback = Callable[[], Awaitable[None] | None]

T = TypeVar("T")
M = TypeVar("M")


async def stream_out(items: AsyncIterator[T], to_proto: Callable[[T], M]) -> AsyncIterator[M]:
    """The body of every server-streaming servicer method: ``to_proto`` of each item of ``items``.

    A call that ends early (client gone, deadline, cancel) closes ``items`` now, which
    aborts the work behind it (an engine request, an upstream call) instead of leaving
    it to garbage collection.
    """
    try:
        async for item in items:
            yield to_proto(item)
    finally:
        await items.aclose()  # type: ignore[attr-defined]


class ServiceServer:
    """A grpc.aio server with health, reflection, tracing, auth, TLS and rich errors.

    Register servicers with :meth:`add_servicer` before :meth:`start`.
    """

    def __init__(self, service: str, options: ServerOptions = ServerOptions()) -> None:
        self.service = service
        self.options = options
        interceptors: list[grpc.aio.ServerInterceptor] = [TracingServerInterceptor(options.tracer_provider)]
        if options.auth.enabled:
            interceptors.append(RoleAuthServerInterceptor(options.auth))
        # Innermost, so tracing records the status the error was mapped to.
        interceptors.append(ErrorInterceptor())
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            # gRPC sets SO_REUSEPORT by default, which lets a second server
            # bind a busy port and silently split its traffic.
            ("grpc.so_reuseport", 0),
        ])
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = []
        self._drain_callbacks: list[DrainCallback] = []
        self._draining: asyncio.Future[None] | None = None
        self._stop_requested = asyncio.Event()
        self._swaps = 0
        self._unfit: dict[str, str] = {}   # what cannot serve now, and why (NOT_SERVING while any)
        self.port = 0

    @property
    def address(self) -> str:
        """``host:port`` clients dial (valid after :meth:`start`)."""
        return f"{self.options.host}:{self.port}"

    def add_servicer(self, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any,
                     service_name: str) -> None:
        """Register a generated-code servicer under its full name (e.g. ``zerokl.v1.WeightStore``)."""
        add_to_server(servicer, self._server)
        self._service_names.append(service_name)

    def add_generic_handler(self, handler: grpc.GenericRpcHandler, service_name: str) -> None:
        """Register a hand-built handler (no generated code) under ``service_name``."""
        self._server.add_generic_rpc_handlers((handler,))
        self._service_names.append(service_name)

    def on_drain(self, callback: DrainCallback) -> None:
        """Call ``callback`` when draining starts, e.g. to end long-lived watch streams."""
        self._drain_callbacks.append(callback)

    async def start(self) -> None:
        """Bind, start serving and report SERVING for the server and every service."""
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server)
        target = f"{self.options.host}:{self.options.port}"
        if self.options.tls is not None:
            self.port = self._server.add_secure_port(target, self.options.tls.server_credentials())
        else:
            self.port = self._server.add_insecure_port(target)
        if not self.port:
            raise OSError(f"{self.service}: cannot bind {target}")
        await self._server.start()
        await self._sync_health()
        log.info("%s listening on %s", self.service, self.address)

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the whole server and each service (no-op once draining)."""
        status = _SERVING if serving else _NOT_SERVING
        for name in ("", *self._service_names):
            await self._health.set(name, status)

    @asynccontextmanager
    async def not_serving(self) -> AsyncIterator[None]:
        """Report NOT_SERVING for the duration, e.g. while swapping weights.

        Nested or overlapping uses keep NOT_SERVING until the last one ends.
        """
        self._swaps += 1
        await self.set_serving(False)
        try:
            yield
        finally:
            self._swaps -= 1
            await self._sync_health()

    def set_unfit(self, part: str, reason: str | None) -> None:
        """Report that ``part`` (e.g. "engine") cannot serve, and why, or can again (None).

        Health is NOT_SERVING while any part is unfit (or weights are swapping);
        call from the event loop. The reason is logged, not sent: health has no text.
        """
        if reason is None:
            self._unfit.pop(part, None)
        else:
            self._unfit[part] = reason
            log.error("%s: %s cannot serve: %s", self.service, part, reason)
        asyncio.ensure_future(self._sync_health())

    async def _sync_health(self) -> None:
        """SERVING unless weights are swapping or a part is unfit (each call reads the state now)."""
        await self.set_serving(self._swaps == 0 and not self._unfit)

    async def drain(self, grace_s: float | None = None) -> None:
        """Gracefully stop: NOT_SERVING, refuse new calls, let in-flight ones finish within the grace.

        Safe to call more than once; later calls wait for the first.
        """
        self._stop_requested.set()
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain(self.options.grace_s if grace_s is None else grace_s))
        await asyncio.shield(self._draining)

    async def _drain(self, grace_s: float) -> None:
        log.info("%s draining (grace %.1fs)", self.service, grace_s)
        await self._health.enter_graceful_shutdown()
        if self.options.drain_delay_s > 0:
            await asyncio.sleep(self.options.drain_delay_s)
        for callback in self._drain_callbacks:
            result = callback()
            if inspect.isawaitable(result):
                await result
        await self._server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        """Wait until the server has stopped."""
        await self._server.wait_for_termination()

    async def serve_until_signal(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Serve until one of ``signals`` arrives, then :meth:`drain`.

        A second signal during the drain cuts the grace short. Must run in
        the main thread (Python delivers signals there).
        """
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if self._stop_requested.is_set():
                log.warning("%s: second %s, stopping without grace", self.service, sig.name)
                asyncio.ensure_future(self._server.stop(0))
            self._stop_requested.set()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            # Woken by a signal or by a drain() started elsewhere.
            await self._stop_requested.wait()
            await self.drain()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)


async def serve(service: str, setup: Callable[[ServiceServer], Awaitable[None] | None],
                options: ServerOptions, *, metrics_port: int | None = None,
                metrics_host: str = "127.0.0.1",
                on_ready: Callable[[ServiceServer, MetricsServer | None], None] | None = None) -> None:
    """Run one service until SIGTERM/SIGINT, then drain and return.

    ``setup`` registers servicers on the server; tracing is configured from
    the OTEL environment unless ``options`` carries a provider; metrics are
    served on ``metrics_port`` when given (0 picks one). ``on_ready`` runs
    once both listen (``zerokl up`` reads the addresses it prints).
    """
    provider = options.tracer_provider
    owned_provider = None
    if provider is None:
        owned_provider = configure_tracing(service)
        provider = owned_provider
    server = ServiceServer(service, dataclasses.replace(options, tracer_provider=provider))
    result = setup(server)
    if inspect.isawaitable(result):
        await result
    metrics = start_metrics_server(metrics_port, metrics_host) if metrics_port is not None else None
    try:
        await server.start()
        freeze_startup_heap()
        if on_ready is not None:
            on_ready(server, metrics)
        await server.serve_until_signal()
    finally:
        if metrics is not None:
            metrics.close()
        if owned_provider is not None:
            owned_provider.shutdown()


def freeze_startup_heap() -> None:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze``).

    What a service made at start-up (modules: torch, protobuf descriptors, grpc; its model config and
    servicers: ~200k objects) lives as long as the process. Left to the collector, each of its full
    passes walks all of it while the event loop (or an engine step) waits: 150 ms a pass on a CI core,
    and a full pass comes every few hundred thousand allocations under load (vLLM freezes its start-up
    heap too). Cycles made later are still collected.
    """
    gc.collect()
    gc.freeze()


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The listening, security and metrics flags every service's command line shares."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    g.add_argument("--port", type=int, default=default_port, help="gRPC port, 0 picks a free one (default %(default)s)")
    g.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (0 picks one)")
    g.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get to finish on SIGTERM")
    g.add_argument("--drain-delay", type=float, default=0.0, help="seconds to stay NOT_SERVING but accepting before stopping")
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest gRPC message sent or received (default %(default)s)")
    g.add_argument("--tls-cert", help="PEM certificate (enables TLS together with --tls-key)")
    g.add_argument("--tls-key", help="PEM private key")
    g.add_argument("--tls-client-ca", help="PEM CA; clients must present a certificate it signed (mTLS)")
    g.add_argument("--peer-ca", help="PEM CA of the other zerokl services: this service's own calls to them "
                                      "(weight store, decode, trainer) go over TLS verified with it, presenting "
                                      "--tls-cert/--tls-key for mTLS (default: plaintext)")
    g.add_argument("--auth-token-file", help="the client token: clients present 'authorization: Bearer <token>' "
                                              "(default: $ZEROKL_AUTH_TOKEN_FILE or $ZEROKL_AUTH_TOKEN; no token "
                                              "of any role: no auth)")
    g.add_argument("--peer-token-file", help="the peer token: services present it to each other; internal RPCs "
                                              "need it or the operator token (default: $ZEROKL_PEER_TOKEN_FILE or "
                                              "$ZEROKL_PEER_TOKEN)")
    g.add_argument("--operator-token-file", help="the operator token: everything a peer may call "
                                                  "(default: $ZEROKL_OPERATOR_TOKEN_FILE or $ZEROKL_OPERATOR_TOKEN)")


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    """ServerOptions from the flags of :func:`add_server_arguments`."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    try:
        auth = load_auth_config(args.auth_token_file, args.peer_token_file, args.operator_token_file)
    except (OSError, ValueError) as err:
        raise SystemExit(f"auth: {err}") from None
    return ServerOptions(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                         grace_s=args.grace, drain_delay_s=args.drain_delay, tls=tls, auth=auth)


def peer_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials for this service's calls to other zerokl services (None: plaintext), from --peer-ca."""
    if not args.peer_ca:
        return None
    return TlsConfig.channel_credentials(args.peer_ca, args.tls_cert, args.tls_key)


def create_channel(target: str, *, token: str | None = None,
                   credentials: grpc.ChannelCredentials | None = None,
                   tracer_provider: trace.TracerProvider | None = None,
                   max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """A grpc.aio channel that propagates traces and, with ``token``, authenticates.

    ``credentials`` (see :meth:`TlsConfig.channel_credentials`) makes it a TLS
    channel; otherwise it is plaintext, as on one machine's loopback.
    """
    chain: list[ClientInterceptor] = [TracingClientInterceptor(tracer_provider)]
    if token:
        chain.append(bearer_token_interceptor(token))
    interceptors = channel_interceptors(*chain)
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
