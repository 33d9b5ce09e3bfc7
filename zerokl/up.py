"""``zerokl up``: every zerokl service on loopback, as supervised child processes of one command.

    zerokl up [--workdir ~/.zerokl/up] [--model DIR | --preset tiny --seed 0] [--dtype bfloat16|float32|fp8]
              [--decode-replicas 1] [--prefill-replicas 0] [--port 50050]
              [--auth-token T [--peer-token P] [--operator-token O]] [--tls-cert C --tls-key K --tls-ca CA]
              [--tinker [--tinker-port 8000] [--tinker-samplers 1]]

0. refuses, before it starts anything, what could not run as one exact
   cluster: a workdir another ``zerokl up`` runs in, a ``--port`` something
   already listens on, and a fleet whose replicas and trainer would not
   compute one numerics fingerprint (``--dtype`` applies to both; a
   ``--replica-flag``/``--trainer-flag`` that contradicts it, another device
   type, or an FP8 checkpoint the trainer would not train in ``--dtype`` is an
   error naming the flag). Each start gets a cluster id: every child
   advertises it in Info (``$ZEROKL_CLUSTER_ID``), ``up.json`` records it, and
   ``zerokl status`` and the clients check it;
1. starts the weight store on a local directory (``WORKDIR/weights``); when
   it holds no version yet, publishes the model (by default the countdown SFT
   checkpoint shipped in ``zerokl/assets/countdown-sft``; ``--preset`` makes a
   seeded random one in the fleet's ``--dtype``) as version ``1``;
2. fetches the version to serve (``--weights-version``, else the one the fleet
   last served as a whole, recorded in ``WORKDIR/scheduler/fleet.json``: the
   newest that passed a canary, else the store's newest; when the store can no
   longer hand that one out whole, the most recently served good version that
   it can) into ``WORKDIR/models/VERSION`` (hard links to the store's files, checked, where it holds
   them whole: no second copy on disk) and starts the decode replicas (which prefill
   their own prompts; ``--prefill-replicas N`` adds disaggregated prefill
   replicas, for several devices) from it in ``--dtype`` (each decode replica
   streaming a message per 8 steps after the first token, since the scheduler
   relays every message once more), the trainer (when
   this install has ``zerokl.services.trainer.server``) and the scheduler in
   front of the replicas, all at once on free loopback ports, each with its
   log in ``WORKDIR/logs``; Triton's compile cache lives in
   ``WORKDIR/cache/triton`` (unless ``TRITON_CACHE_DIR`` says otherwise), so
   a second start is warm;
3. waits until every service answers grpc.health.v1 SERVING, prints a table
   of services, addresses, weights versions and fingerprints and a
   ``zerokl generate`` line to try, and writes the same to ``WORKDIR/up.json``;
4. supervises: a child that dies is restarted on the same port with
   exponential backoff (a replica at the fleet's target version, which the
   scheduler records durably at each switch and which may be newer than the
   one it started with; at the newest good version when the target's bytes in
   the store are corrupt, see :class:`_Supervisor`); meanwhile the scheduler
   routes around it and ``up.json`` (so ``zerokl status``) names it DOWN or
   RESTARTING, with its restart count, last exit status and why a restart
   could not start it or started it elsewhere, until it is SERVING again;
5. on Ctrl-C / SIGTERM stops the children (the scheduler first, so no request
   is routed to a replica that is going away) and waits for them.

With ``--tinker`` it also runs the Tinker endpoint (``zerokl serve tinker``: Tinker's REST API for
the official ``tinker`` SDK, docs/api.md) on ``--tinker-port``, with ``--tinker-samplers`` decode
replicas of its own outside the scheduler's fleet; ``zerokl status`` leaves them (and, then, the
trainer, which holds the endpoint's training clients) out of the fleet's one-version check.

With ``--auth-token`` every service requires tokens (see docs/operator.md,
"Security model"): the client token for Generate and friends, the peer token
(generated when not given) between services, the operator token (generated
when not given) for internal RPCs called by people and by ``zerokl up``
itself. They reach the children as files in ``WORKDIR/secrets`` (mode 0600),
never on a command line. With ``--tls-cert/--tls-key`` every service serves
TLS with that certificate (it must be valid for 127.0.0.1) and verifies the
others with ``--tls-ca``.

Children run in their own session (a terminal's Ctrl-C reaches only this
process, which stops them in order) and get SIGTERM if this process dies.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import pathlib
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from zerokl.tasks.setup import SFT_CHECKPOINT      # served when neither --model nor --preset is given
from zerokl.services.routing.fleet import FleetRecord, read_fleet, write_fleet
from zerokl.services.runtime.auth import (OPERATOR_TOKEN_ENV, OPERATOR_TOKEN_FILE_ENV, PEER_TOKEN_ENV, PEER_TOKEN_FILE_ENV,
                                          AuthConfig, TlsConfig, load_auth_token)
from zerokl.services.runtime.info import CLUSTER_ID_ENV, ServiceIdentity, identity_from_proto
from zerokl.services.runtime.server import create_channel
from zerokl.services.runtime.streams import unless_set
from zerokl.v1 import common_pb2
from zerokl.vocab import COMPUTE_DTYPES     # --dtype (fp8: e4m3 projections + bf16 activations)

__all__ = ["DEFAULT_WORKDIR", "TRAINER_MODULE", "Child", "ClientSecurity", "UpSecurity", "build_parser",
           "add_arguments", "main", "run", "read_state", "status"]

DEFAULT_WORKDIR = "~/.zerokl/up"
TRAINER_MODULE = "zerokl.services.trainer.server"
_HOST = "127.0.0.1"
# The countdown task's prompt format (zerokl.tasks.countdown.format_prompt: a trailing newline), a problem the
# shipped SFT checkpoint answers right greedily (in fp32 and bf16; it solves about 30% of its test problems).
_EXAMPLE_PROMPT = "nums 13 1 19 target 33\n"
# Stop order: the front doors first, the store last (a trainer may still be publishing).
_STOP_ORDER = ("tinker", "scheduler", "prefill", "decode", "trainer", "weight-store")
# Restart backoff: the first restart after --restart-backoff seconds, doubling while restarts keep
# failing, never more than the cap; a child that served this long before dying starts over at the first delay.
_BACKOFF_CAP_S = 30.0
_STABLE_S = 60.0
_STREAM_INTERVAL = 8   # the decode replicas' --stream-interval


@dataclass
class Child:
    """One service process ``zerokl up`` runs (and restarts when it dies)."""

    name: str                      # "decode-0", "scheduler", ...
    service: str                   # the `zerokl serve` service
    port: int
    flags: list[str]
    log_path: pathlib.Path
    proc: subprocess.Popen | None = None
    identity: ServiceIdentity | None = None
    status: str = "starting"       # SERVING, DOWN, RESTARTING (and "exited N" once stopped)
    required: bool = True          # at startup: False means a failure is reported, the others keep running
    restarts: int = 0              # how often the supervisor started it again
    last_exit: int | None = None   # the exit status of its last death (negative: killed by that signal)
    serving_since: float | None = None
    failures: int = 0              # deaths in a row without serving _STABLE_S: the backoff's exponent
    restart_at: float = 0.0        # monotonic time of the next restart while DOWN
    restarting: asyncio.Future[None] | None = None
    metrics_port: int | None = None  # Prometheus /metrics (replicas and the scheduler)
    fleet: bool = True             # False: outside the scheduler's fleet (the Tinker endpoint's sampler replicas)
    http_port: int | None = None   # the Tinker endpoint's REST port
    note: str = ""                 # why it runs as it does, or is not running (shown by `zerokl status`)

    @property
    def address(self) -> str:
        return f"{_HOST}:{self.port}"

    def serve_metrics(self) -> list[str]:
        """Give it a free loopback port for /metrics; the flag that serves it there."""
        self.metrics_port = _free_port()
        return ["--metrics-port", str(self.metrics_port)]

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "zerokl", "serve", self.service, *self.flags]


@dataclass(frozen=True)
class UpSecurity:
    """The tokens and TLS files every child serves with, and ``zerokl up``'s own credentials (operator)."""

    auth: AuthConfig = AuthConfig()
    token_files: tuple[tuple[str, pathlib.Path], ...] = ()     # (child flag, file) per configured role
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def child_flags(self) -> list[str]:
        """The security flags of every `zerokl serve` child."""
        flags = [f for flag, path in self.token_files for f in (flag, str(path))]
        if self.tls_cert:
            flags += ["--tls-cert", self.tls_cert, "--tls-key", str(self.tls_key), "--peer-ca", str(self.tls_ca)]
        return flags

    def credentials(self) -> grpc.ChannelCredentials | None:
        return TlsConfig.channel_credentials(self.tls_ca) if self.tls_cert else None

    def channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a child carrying the operator token (over TLS when the children serve it)."""
        return create_channel(address, token=self.auth.operator_token, credentials=self.credentials(),
                              tracer_provider=trace.NoOpTracerProvider())

    def token_file(self, flag: str) -> str | None:
        """The file passed to the children as ``flag`` (None when that role has no token)."""
        return next((str(p) for f, p in self.token_files if f == flag), None)


def _security(args: argparse.Namespace, workdir: pathlib.Path) -> UpSecurity:
    """Tokens from the flags or the environment (peer and operator generated when auth is on), written to
    ``WORKDIR/secrets``; TLS files checked."""
    if len({bool(args.tls_cert), bool(args.tls_key), bool(args.tls_ca)}) != 1:
        raise SystemExit("zerokl up: --tls-cert, --tls-key and --tls-ca go together")
    client = args.auth_token or load_auth_token()
    peer = args.peer_token or load_auth_token(env=PEER_TOKEN_ENV, file_env=PEER_TOKEN_FILE_ENV)
    operator = args.operator_token or load_auth_token(env=OPERATOR_TOKEN_ENV, file_env=OPERATOR_TOKEN_FILE_ENV)
    if client or peer or operator:
        peer = peer or secrets.token_urlsafe(32)
        operator = operator or secrets.token_urlsafe(32)
    try:
        auth = AuthConfig(client, peer, operator)
    except ValueError as err:
        raise SystemExit(f"zerokl up: {err}") from None
    files = []
    folder = workdir / "secrets"
    for flag, role, token in (("--auth-token-file", "client", client), ("--peer-token-file", "peer", peer),
                              ("--operator-token-file", "operator", operator)):
        path = folder / f"{role}.token"
        if not token:
            path.unlink(missing_ok=True)   # a token of an earlier run must not look current
            continue
        folder.mkdir(mode=0o700, exist_ok=True)
        path.touch(mode=0o600)
        path.chmod(0o600)                  # before the secret is written, not after
        path.write_text(token + "\n")
        files.append((flag, path))
    tls = [str(pathlib.Path(f).expanduser().resolve()) if f else None for f in (args.tls_cert, args.tls_key, args.tls_ca)]
    return UpSecurity(auth, tuple(files), *tls)


class UpError(RuntimeError):
    """A required service did not come up (the message says which and where its log is)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``zerokl up`` (on a subcommand parser of the CLI)."""
    p.add_argument("--workdir", default=os.environ.get("ZEROKL_UP_DIR", DEFAULT_WORKDIR),
                   help="weights, fetched models and logs live here (default $ZEROKL_UP_DIR or %(default)s)")
    m = p.add_argument_group("model (published as the first version when the weight store is empty)")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", default=None,
                     help="checkpoint directory (config.json + safetensors). Default (no --preset either): the "
                          "countdown SFT checkpoint shipped in zerokl/assets/countdown-sft, a tiny model that "
                          "answers countdown prompts")
    src.add_argument("--preset", default=None, help="a seeded random (untrained) model of this preset, e.g. tiny")
    m.add_argument("--seed", type=int, default=0, help="weights seed of --preset (default %(default)s)")
    m.add_argument("--weights-version", default=None,
                   help="version to publish into an empty store (default 1) and to serve (default: the newest)")
    m.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default=None,
                   help="the fleet's model dtype: a preset is made and published in it, so the replicas serve "
                        "and the trainer trains in it (with fp32 master weights). Default for a preset: bfloat16 "
                        "where CUDA is available, else float32. A --model checkpoint is published as it is: "
                        "the replicas serve it and the trainer trains it in --dtype when given, else in the "
                        "checkpoint's own dtype (one fingerprint for the fleet; a contradicting --replica-flag or "
                        "--trainer-flag=--dtype is refused). "
                        "fp8: a preset is published quantized (e4m3 values + block scales: 1 byte a weight), "
                        "the replicas serve it and the trainer trains on the same FP8 forward (--dtype fp8, fp32 "
                        "masters) and publishes each version in that form; a --model checkpoint that is not FP8 "
                        "is quantized on load by replicas and trainer alike (deterministic: the same bytes)")
    s = p.add_argument_group("services")
    s.add_argument("--port", type=int, default=50050, help="scheduler port, 0 picks one (default %(default)s)")
    s.add_argument("--decode-replicas", type=int, default=1, help="decode replicas, at least 1 (default %(default)s)")
    s.add_argument("--prefill-replicas", type=int, default=0,
                   help="disaggregated prefill: this many prefill replicas whose KV the decode replicas read "
                        "(for several devices; on one device a decode replica's own prefill costs no KV "
                        "handoff). Default %(default)s: the decode replicas prefill themselves")
    s.add_argument("--no-trainer", action="store_true", help="do not start the trainer")
    s.add_argument("--colocate", action="store_true",
                   help="co-location, for a model that does not fit the device twice: the trainer keeps its optimizer "
                        "state in host memory between steps (--offload-optimizer) and, before each RL step trains, "
                        "every replica releases its KV cache and weights (sleep level 2; "
                        "--scheduler-flag=--colocate-sleep-level=1 keeps the weights); the step's in-place weight "
                        "switch wakes them with the new version (ARCHITECTURE.md, \"Co-location\")")
    s.add_argument("--replica-flag", action="append", default=[], metavar="FLAG",
                   help="extra `zerokl serve prefill|decode` flag for every replica, e.g. --replica-flag=--tp=2 "
                        "(repeatable)")
    s.add_argument("--trainer-flag", action="append", default=[], metavar="FLAG",
                   help="extra `zerokl serve trainer` flag, e.g. --trainer-flag=--lr=1e-3 (repeatable)")
    s.add_argument("--scheduler-flag", action="append", default=[], metavar="FLAG",
                   help="extra `zerokl serve scheduler` flag, e.g. --scheduler-flag=--fleet-wait=30 (repeatable; after "
                        "zerokl up's own, so --scheduler-flag=--weight-store=ADDR sends its jobs' store calls to ADDR)")
    t = p.add_argument_group("Tinker endpoint (docs/api.md: the official tinker SDK against this cluster)")
    t.add_argument("--tinker", action="store_true",
                   help="also serve Tinker's REST API (zerokl serve tinker) on --tinker-port, with its own sampler "
                        "replicas; TINKER_BASE_URL=http://127.0.0.1:PORT")
    t.add_argument("--tinker-port", type=int, default=8000, help="its HTTP port, 0 picks one (default %(default)s)")
    t.add_argument("--tinker-samplers", type=int, default=1,
                   help="decode replicas the endpoint samples on, outside the scheduler's fleet: each serves the "
                        "version its sampling clients are bound to (default %(default)s)")
    t.add_argument("--tinker-flag", action="append", default=[], metavar="FLAG",
                   help="extra `zerokl serve tinker` flag, e.g. --tinker-flag=--long-poll=10 (repeatable)")
    s.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of each compute service (default: the CPU cores shared out "
                        "among the replicas and the trainer; threads spinning against each other on a small "
                        "host make every step many times slower, and the bits do not depend on it)")
    s.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for every service to report SERVING")
    s.add_argument("--grace", type=float, default=10.0,
                   help="seconds each service gets to finish in-flight calls when stopping")
    s.add_argument("--restart-backoff", type=float, default=0.5,
                   help="seconds before restarting a service that died; doubles while restarts keep failing, "
                        f"up to {_BACKOFF_CAP_S:.0f}s (default %(default)s)")
    a = p.add_argument_group("security (docs/operator.md, \"Security model\"; default: no auth, plaintext)")
    a.add_argument("--auth-token", default=None, metavar="TOKEN",
                   help="the client token: turns auth on for every service (default $ZEROKL_AUTH_TOKEN; "
                        "tokens on a command line are visible to other local users: prefer the variables)")
    a.add_argument("--peer-token", default=None, metavar="TOKEN",
                   help="the token services present to each other (default $ZEROKL_PEER_TOKEN, else generated)")
    a.add_argument("--operator-token", default=None, metavar="TOKEN",
                   help="the token for internal RPCs called by people, e.g. `zerokl jobs submit` (default "
                        "$ZEROKL_OPERATOR_TOKEN, else generated into WORKDIR/secrets/operator.token)")
    a.add_argument("--tls-cert", default=None, help="PEM certificate every service serves with (valid for 127.0.0.1)")
    a.add_argument("--tls-key", default=None, help="its PEM private key")
    a.add_argument("--tls-ca", default=None, help="PEM CA that signed it: services and zerokl up verify each other")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerokl up", description="Run all zerokl services on loopback until Ctrl-C.",
                                allow_abbrev=False)
    add_arguments(p)
    return p


_HANDED_OUT: set[int] = set()


def _free_port() -> int:
    """A loopback port free now and not handed out before by this process: a planned child binds its
    port only when it starts, and the kernel may offer a port again once its probe socket closed."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((_HOST, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# Runs in each child before the service: asks Linux for SIGTERM when `zerokl up` dies (PR_SET_PDEATHSIG,
# kept across exec), so no service outlives it, then becomes the service. A wrapper instead of
# Popen(preexec_fn=...): that is unsafe in a threaded process, and gRPC's threads run here.
_EXEC_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit("zerokl up exited before this service started")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _launch(child: Child, cluster_id: str) -> None:
    """Start ``child`` as a member of cluster ``cluster_id`` (its services advertise it in Info)."""
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = child.argv
    if sys.platform == "linux":
        argv = [sys.executable, "-c", _EXEC_WITH_PARENT, str(os.getpid()), *argv]
    with open(child.log_path, "ab") as log:  # the child keeps its own descriptor
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(child.argv)}\n".encode())
        log.flush()
        # From the main thread: PDEATHSIG fires when the forking *thread* ends.
        child.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", CLUSTER_ID_ENV: cluster_id},
                                      start_new_session=True)


def _log_tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def _wait_serving(child: Child, deadline: float, security: UpSecurity, cluster_id: str) -> None:
    """Wait for ``child`` to answer health SERVING and read its Info (UpError if it exits or times out, or if
    what answers on its port is not of cluster ``cluster_id``: another process took the port)."""
    async with security.channel(child.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            assert child.proc is not None
            if child.proc.poll() is not None:
                raise UpError(f"{child.name} exited with status {child.proc.returncode}; its log "
                              f"{child.log_path}:\n{_log_tail(child.log_path)}")
            if time.monotonic() > deadline:
                raise UpError(f"{child.name} did not report SERVING in time; its log {child.log_path}:\n"
                              f"{_log_tail(child.log_path)}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            await asyncio.sleep(0.2)
        while (identity := await _info(channel, child.service)) is None:
            if child.proc.poll() is not None or time.monotonic() > deadline:
                raise UpError(f"{child.address} answers health but no Info: is another process on {child.name}'s "
                              f"port? Its log {child.log_path}:\n{_log_tail(child.log_path)}")
            await asyncio.sleep(0.2)
        child.identity = identity
    if identity.cluster_id != cluster_id:
        raise UpError(f"{child.address} answers as another cluster ({identity.cluster_id or 'no cluster id'}), not "
                      f"this one ({cluster_id}): another process listens on {child.name}'s port")
    child.status = "SERVING"
    child.serving_since = time.monotonic()


# The gRPC service whose Info each zerokl service answers (one request and response type everywhere).
_INFO_SERVICE = {"prefill": "zerokl.v1.Inference", "decode": "zerokl.v1.Inference",
                 "scheduler": "zerokl.v1.Inference", "weight-store": "zerokl.v1.WeightStore",
                 "trainer": "zerokl.v1.Trainer", "tinker": "zerokl.v1.TinkerEndpoint"}


async def _info(channel: grpc.aio.Channel, service: str) -> ServiceIdentity | None:
    """The service's Info (None when it does not answer one: the table shows '-')."""
    info = channel.unary_unary(f"/{_INFO_SERVICE[service]}/Info",
                               request_serializer=common_pb2.InfoRequest.SerializeToString,
                               response_deserializer=common_pb2.ServiceInfo.FromString)
    try:
        return identity_from_proto(await info(common_pb2.InfoRequest(), timeout=5))
    except (grpc.aio.AioRpcError, ValueError):
        return None


async def _prepare_weights(args: argparse.Namespace, store: Child, workdir: pathlib.Path,
                           security: UpSecurity) -> tuple[str, pathlib.Path, FleetRecord]:
    """Publish the model into an empty store, then fetch the version to serve and record it as the fleet's
    target (for the scheduler and the supervisor); (version, directory, the fleet's record).

    The version to serve is ``--weights-version``, else the fleet's recorded target, else the store's newest.
    A recorded target the store cannot hand out whole (corrupt bytes: DATA_LOSS) is given up for the newest
    good version that fetches (:func:`_fetch_servable`), and the record says why."""
    from zerokl.services.weightstore.client import WeightStoreClient

    state_dir = workdir / "scheduler"
    async with security.channel(store.address) as channel, WeightStoreClient(channel=channel) as client:
        versions = [e.manifest.version for e in await client.list()]
        if not versions:
            version = args.weights_version or "1"
            print(f"zerokl up: the weight store is empty; publishing {_source_name(args)} as version {version}",
                  flush=True)
            await _publish(client, args, version)
            versions = [version]
        if args.weights_version and args.weights_version not in versions:
            raise UpError(f"--weights-version {args.weights_version}: the store holds {versions}, not that one")
        # What the fleet last served as a whole passed a canary; a version saved after it may not have.
        record = read_fleet(state_dir)
        wanted = args.weights_version or (record.weights_version if record.weights_version in versions else "") \
            or (await client.manifest("latest")).version
        # An explicit --weights-version is served or refused, never replaced.
        fallbacks = [] if args.weights_version else [v for v in record.fallbacks(wanted) if v in versions]
        version, dest, why = await _fetch_servable(client, workdir, wanted, fallbacks)
    record = write_fleet(state_dir, record.fell_back(wanted, version, why) if why else record.served(version))
    if why:
        print(f"zerokl up: {record.note}", file=sys.stderr, flush=True)
    return version, dest, record


async def _fetch_servable(client: object, workdir: pathlib.Path, version: str,
                          fallbacks: Sequence[str]) -> tuple[str, pathlib.Path, str]:
    """Fetch the serving files of ``version`` into ``WORKDIR/models/VERSION`` (resumable; complete, verified
    files are kept). When the store cannot hand it out whole (DATA_LOSS: a shard's bytes no longer match its
    sha256; NOT_FOUND: deleted), the first of ``fallbacks`` that it can, instead: (version, directory, why
    ``version`` was not served, "" when it was). UpError when none can be."""
    problems: list[str] = []
    for candidate in (version, *fallbacks):
        dest = workdir / "models" / candidate
        try:
            # The store's directory is ours (--root WORKDIR/weights): its whole shards are linked, not copied.
            await client.fetch(candidate, dest, serving_only=True,  # type: ignore[attr-defined]
                               local_root=workdir / "weights")
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND):
                raise
            problems.append(f"{err.code().name}: {err.details()}")
            continue
        return candidate, dest, problems[0] if candidate != version else ""
    tried = ", ".join([version, *fallbacks])
    raise UpError(f"no weights version the fleet served can be fetched whole from the weight store (tried "
                  f"{tried}): {'; '.join(problems)}")


def _source_name(args: argparse.Namespace) -> str:
    if args.model and pathlib.Path(args.model).resolve() == SFT_CHECKPOINT:
        return f"the shipped countdown SFT checkpoint ({args.model})"
    return args.model if args.model else f"the {args.preset} preset (seed {args.seed})"


def _fleet_dtype(args: argparse.Namespace) -> str | None:
    """``--dtype``; else a checkpoint's own (None), and for a preset bfloat16 where CUDA is available
    (the GPU kernels' serving dtype), else float32."""
    if args.dtype or args.model:
        return args.dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"




def _flag(flags: Sequence[str], name: str) -> str | None:
    """The value a child's parser would give ``name`` among ``flags`` (the last one wins), None if absent."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument(name, default=None)
    return getattr(p.parse_known_args(list(flags))[0], name.lstrip("-").replace("-", "_"))


def _stored_dtype(directory: str | os.PathLike[str], what: str) -> str:
    """The dtype a checkpoint directory stores its weights in (float8_e4m3fn for an FP8 checkpoint)."""
    from zerokl.kernels.dtypes import dtype_name
    from zerokl.kernels.model.checkpoint import CheckpointError, config_from_hf

    try:
        _, dtype = config_from_hf(json.loads((pathlib.Path(directory) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, CheckpointError) as err:
        raise UpError(f"{what}: not a glm_moe_dsa checkpoint directory: {err}") from None
    return dtype_name(dtype)


def _canonical_dtype(name: str) -> str:
    """The canonical name of a --dtype ("fp8" -> "float8_e4m3fn"), what the fingerprint key names."""
    from zerokl.kernels.dtypes import canonical_name   # not at module level: zerokl up starts without torch
    return canonical_name(name)


def _check_exact(args: argparse.Namespace, stored: str | None, what: str) -> None:
    """Refuse (UpError naming the flag) a plan whose replicas and trainer would not compute one numerics
    fingerprint: a fingerprint is keyed by backend (one environment), device type and the dtype the numbers
    are computed in, and train/inference KL is exactly 0 only between equal ones.

    ``stored``: the dtype of the checkpoint the fleet serves (``what`` names it), None while unknown. A replica
    computes in its ``--dtype`` (an FP8 checkpoint stays FP8 whatever it asks), else the stored dtype; the
    trainer likewise, except that it cannot train an FP8 checkpoint in another dtype (it does not dequantize).
    """
    from zerokl.kernels.dtypes import FP8_ALIAS, canonical_name, names_fp8   # not at module level: as above
    sides = {}
    for side, extra, option in (("replicas", args.replica_flag, "--replica-flag"),
                                ("trainer", args.trainer_flag, "--trainer-flag")):
        if side == "trainer" and args.no_trainer:
            continue
        asked, device = _flag(extra, "--dtype"), _flag(extra, "--device")
        if asked is not None and args.dtype is not None and asked != args.dtype:
            raise UpError(f"{option}=--dtype={asked} contradicts --dtype {args.dtype}: the {side} would compute "
                          f"in {asked}, the rest of the fleet in {args.dtype}; drop {option}=--dtype")
        culprit = f"{option}=--dtype={asked}" if asked is not None else f"--dtype {args.dtype}"
        asked = asked or args.dtype
        if asked is not None and asked not in COMPUTE_DTYPES:
            raise UpError(f"{option}=--dtype={asked}: expected one of {', '.join(sorted(COMPUTE_DTYPES))}")
        if side == "trainer" and names_fp8(stored) and not (asked is None or names_fp8(asked)):
            raise UpError(f"{culprit}: {what} is an FP8 checkpoint, which the replicas serve in FP8 whatever "
                          f"they are asked and the trainer cannot train in {asked} (it does not dequantize): "
                          "leave --dtype out or pass --dtype fp8")
        # the dtype its numbers are computed in, by canonical name (the fingerprint key's last part)
        computes = canonical_name(FP8_ALIAS) if names_fp8(stored) or names_fp8(asked) else \
            canonical_name(asked) if asked else stored
        kind = _device_type(device)
        sides[side] = (kind, computes, culprit if asked is not None else "", f"{option}=--device={device}"
                       if device is not None else "")
    if len(sides) < 2:
        return
    (r_dev, r_dtype, r_flag, r_dev_flag), (t_dev, t_dtype, t_flag, t_dev_flag) = sides["replicas"], sides["trainer"]
    if r_dev != t_dev:
        raise UpError(f"{t_dev_flag or r_dev_flag}: the replicas would compute on {r_dev}, the trainer on "
                      f"{t_dev}: one fleet computes one numerics fingerprint (train/inference KL is exactly 0 only "
                      "then); give both the same device type")
    if r_dtype is not None and t_dtype is not None and r_dtype != t_dtype:
        flag = t_flag if t_flag and t_flag != r_flag else r_flag or t_flag or "--dtype"
        raise UpError(f"{flag}: the replicas would compute in {r_dtype}, the trainer in {t_dtype}: one fleet "
                      "computes one numerics fingerprint (train/inference KL is exactly 0 only then); give the "
                      "fleet one --dtype and no other")


def _device_type(device: str | None) -> str:
    """The device type a child's ``--device`` (None: the default, cuda where available) runs on."""
    import torch

    try:
        return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    except RuntimeError as err:
        raise UpError(f"--device {device}: {err}") from None


def _replica_devices() -> list[str]:
    """The CUDA devices replicas are spread over (none: each child's default device)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] if count > 1 else []


async def _publish(client: object, args: argparse.Namespace, version: str) -> None:
    if args.model:
        # An imported checkpoint was not trained under these numerics: no fingerprint is claimed for it.
        await client.publish(args.model, version, metadata={"source": str(args.model)})  # type: ignore[attr-defined]
        return
    try:
        # Made and published in the serving dtype: replicas fetch and load only the bytes they serve
        # (FP8: the bf16 preset quantized, e4m3 values and scales, as the trainer publishes each version).
        await client.publish_preset(args.preset, args.seed, args.dtype, version)  # type: ignore[attr-defined]
    except ValueError as err:
        raise UpError(str(err)) from None


def _plan(args: argparse.Namespace, workdir: pathlib.Path, store: Child, version: str,
          model_dir: pathlib.Path, security: UpSecurity) -> list[Child]:
    """Every service after the weight store, with its flags and port."""
    logs = workdir / "logs"
    secure = security.child_flags()
    trainer = not args.no_trainer and importlib.util.find_spec(TRAINER_MODULE) is not None
    samplers = args.tinker_samplers if args.tinker else 0
    compute = args.decode_replicas + args.prefill_replicas + samplers + int(trainer)
    threads = ["--threads", str(args.threads or max(1, (os.cpu_count() or 1) // compute))]
    # Replicas fetch from the store what they switch to (SwitchWeights: RL steps, jobs).
    dtype = ["--dtype", args.dtype] if args.dtype else []
    model = ["--model", str(model_dir), "--weights-version", version, "--weight-store", store.address, *dtype,
             *threads]
    if not (model_dir / "tokenizer.json").exists():
        model += ["--tokenizer", "countdown"]  # the presets speak countdown
    common = ["--grace", str(args.grace), *secure]
    children: list[Child] = []
    decode = [Child(f"decode-{i}", "decode", _free_port(), [], logs / f"decode-{i}.log")
              for i in range(args.decode_replicas)]
    prefill = [Child(f"prefill-{i}", "prefill", _free_port(), [], logs / f"prefill-{i}.log")
               for i in range(args.prefill_replicas)]
    # Several GPUs: the replicas take turns over them (decode first); one GPU or none: each child's default.
    devices = _replica_devices()
    for i, r in enumerate([*decode, *prefill]):
        extra = ["--device", devices[i % len(devices)]] if devices else []
        if r.service == "decode":
            # Behind the scheduler every message is relayed once more: a message per 8 steps after
            # the first token (docs/perf.md, issue 32). A --replica-flag=--stream-interval=N wins.
            extra += ["--stream-interval", str(_STREAM_INTERVAL)]
        # A prefill replica is paired with a decode replica per request by the scheduler; that replica
        # reads the KV from it directly.
        r.flags = [*model, *extra, "--port", str(r.port), "--replica-id", r.name, *r.serve_metrics(), *common,
                   *args.replica_flag]
    children += [*decode, *prefill]
    # The Tinker endpoint's own decode replicas: outside the fleet (the scheduler never routes to them),
    # each switched to the version its sampling clients are bound to.
    sampler_replicas = [Child(f"tinker-sampler-{i}", "decode", _free_port(), [], logs / f"tinker-sampler-{i}.log",
                              required=False, fleet=False) for i in range(samplers)]
    for r in sampler_replicas:
        r.flags = [*model, "--stream-interval", str(_STREAM_INTERVAL), "--port", str(r.port), "--replica-id", r.name,
                   *r.serve_metrics(), *common, *args.replica_flag]
    children += sampler_replicas
    if trainer:
        t = Child("trainer", "trainer", _free_port(), [], logs / "trainer.log", required=False)
        # The trainer's forward in the fleet's dtype, as the replicas serve it (an FP8 fleet's on the FP8
        # forward, from a non-FP8 --model too): one fingerprint for the whole fleet (_check_exact).
        t.flags = ["--weight-store", store.address, "--weight-store-root", str(workdir / "weights"), "--init", version,
                   *dtype, *threads, "--port", str(t.port),
                   "--replica-id", "trainer", *(["--offload-optimizer"] if args.colocate else []), *common,
                   *args.trainer_flag]
        children.append(t)
    port = args.port or _free_port()
    s = Child("scheduler", "scheduler", port, [], logs / "scheduler.log")
    s.flags = ["--decode", ",".join(d.address for d in decode), "--port", str(port), "--poll-interval", "0.5",
               "--replica-id", "scheduler", "--state-dir", str(workdir / "scheduler"), *s.serve_metrics(), *common,
               *(["--colocate-sleep-level", "2"] if args.colocate else [])]
    if trainer:
        s.flags += ["--trainer", t.address, "--weight-store", store.address]
    if args.prefill_replicas:
        s.flags += ["--prefill", ",".join(c.address for c in children if c.service == "prefill")]
    s.flags += args.scheduler_flag      # last, as --trainer-flag: a flag given overrides zerokl up's own
    if args.tinker:
        children.append(_tinker_child(args, workdir, store, version, model_dir, common, sampler_replicas,
                                      t.address if trainer else None))
    children.append(s)
    return children


def _tinker_child(args: argparse.Namespace, workdir: pathlib.Path, store: Child, version: str,
                  model_dir: pathlib.Path, common: list[str], samplers: Sequence[Child], trainer: str | None) -> Child:
    """`zerokl serve tinker` for --tinker: the fleet's version is its base model, named after the preset
    (zerokl/tiny, tiny) or the checkpoint directory (zerokl/NAME, NAME, its path)."""
    c = Child("tinker", "tinker", _free_port(), [], workdir / "logs" / "tinker.log", required=False,
              http_port=args.tinker_port or _free_port())
    if args.model:
        path = pathlib.Path(args.model).expanduser().resolve()
        names = [f"zerokl/{path.name}", path.name, str(path)]
    else:
        names = [f"zerokl/{args.preset}", args.preset]
    tokenizer = str(model_dir) if (model_dir / "tokenizer.json").exists() else "countdown"
    c.flags = ["--weight-store", store.address, *(["--trainer", trainer] if trainer else []),
               "--sampler", ",".join(r.address for r in samplers), "--base-model", version,
               *(f for name in names for f in ("--model-name", name)), "--tokenizer", tokenizer,
               "--state-dir", str(workdir / "tinker"), "--http-port", str(c.http_port), "--port", str(c.port),
               "--replica-id", c.name,
               *c.serve_metrics(), *common, *args.tinker_flag]
    return c


def _table(children: Sequence[Child]) -> str:
    rows = [("SERVICE", "ADDRESS", "PID", "WEIGHTS", "FINGERPRINT", "STATUS")]
    for c in children:
        ident = c.identity
        rows.append((c.name, c.address, str(c.proc.pid) if c.proc else "-",
                     (ident.weights_version if ident else "") or "-",
                     (ident.numerics_fingerprint if ident else "") or "-", c.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _write_state(workdir: pathlib.Path, children: Sequence[Child], security: UpSecurity, cluster_id: str,
                 fleet: FleetRecord) -> None:
    """``up.json``: where each service listens and what the supervisor knows of it (for ``zerokl status``,
    ``zerokl generate`` and scripts); rewritten at every change. ``cluster_id``: this start's identity, which
    every service advertises in Info and clients check; ``fleet``: the fleet's record (its target version)."""
    state = {"pid": os.getpid(), "cluster_id": cluster_id, "weights_version": fleet.weights_version,
             "auth": security.auth.enabled,
             "client_token_file": security.token_file("--auth-token-file"),
             "operator_token_file": security.token_file("--operator-token-file"),
             "tls_ca": security.tls_ca if security.tls_cert else None, "services": [
                 {"name": c.name, "service": c.service, "address": c.address, "pid": c.proc.pid if c.proc else None,
                  "log": str(c.log_path), "status": c.status, "restarts": c.restarts, "last_exit": c.last_exit,
                  "note": c.note,
                  "metrics": f"{_HOST}:{c.metrics_port}" if c.metrics_port is not None else None,
                  "fleet": c.fleet, "http": f"http://{_HOST}:{c.http_port}" if c.http_port is not None else None,
                  "weights_version": c.identity.weights_version if c.identity else "",
                  "numerics_fingerprint": c.identity.numerics_fingerprint if c.identity else ""}
                 for c in children]}
    tmp = workdir / "up.json.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(workdir / "up.json")


def read_state(workdir: str | os.PathLike[str]) -> dict | None:
    """The ``up.json`` of a running ``zerokl up`` in ``workdir`` (None when there is none: no file, or one
    left by a ``zerokl up`` that is gone, e.g. killed by SIGKILL)."""
    path = pathlib.Path(os.path.expanduser(workdir)) / "up.json"
    try:
        state = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return state if isinstance(state, dict) and _alive(state.get("pid")) else None


def _alive(pid: object) -> bool:
    """Whether process ``pid`` exists."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's: it exists
        return True
    return True


def _stop(children: Sequence[Child], timeout_s: float) -> bool:
    """SIGTERM the children in stop order (each group waited for); SIGKILL what outlives the timeout.

    True when every child exited by itself (status 0, or killed by our SIGTERM before it set its handler).
    """
    clean = True
    for service in _STOP_ORDER:
        group = [c for c in children if c.service == service and c.proc is not None and c.proc.poll() is None]
        for c in group:
            c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        for c in group:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                print(f"zerokl up: {c.name} did not stop in {timeout_s:.0f}s; killing it", file=sys.stderr)
                c.proc.kill()  # type: ignore[union-attr]
                c.proc.wait()  # type: ignore[union-attr]
                clean = False
            if c.proc.returncode not in (0, -signal.SIGTERM):  # type: ignore[union-attr]
                clean = False
            c.status = f"exited {c.proc.returncode}"  # type: ignore[union-attr]
    return clean


class _NotLaunched(UpError):
    """A restart that could not launch the process (what it needed first failed)."""


class _Supervisor:
    """Restarts children that die, with backoff, and keeps ``up.json`` current.

    A replica comes back at the fleet's target version: the one the scheduler
    recorded in ``WORKDIR/scheduler/fleet.json`` at its last whole-fleet
    switch (jobs switch the fleet to the versions they publish; a replica back
    at its first version would roll the cluster back, or make a mixed fleet).
    The record is written before the switch returns, so it is current even
    while the scheduler cannot answer (its only decode replica down); should
    a replica still come back at another version, the scheduler switches it.

    A target the weight store can no longer hand out whole (a corrupt byte:
    DATA_LOSS) cannot be loaded by a replica that restarts: the replica comes
    back at the most recently served good version that can, its ``note`` says
    why (``zerokl status`` shows it), and the scheduler, finding the target
    lost when it tries to bring the replica there, moves the whole fleet to
    that version and records the fallback.
    """

    def __init__(self, args: argparse.Namespace, workdir: pathlib.Path, children: list[Child], store: Child,
                 security: UpSecurity, cluster_id: str, fleet: FleetRecord) -> None:
        self.args, self.workdir, self.children, self.store, self.security = args, workdir, children, store, security
        self.cluster_id = cluster_id
        self.fleet = fleet

    def _read_fleet(self) -> FleetRecord:
        fleet = read_fleet(self.workdir / "scheduler")
        return fleet if fleet.weights_version else self.fleet

    def write_state(self, children: Sequence[Child] | None = None) -> None:
        """Rewrite ``up.json`` (``children``: every child, those that never came up too; default the supervised)."""
        _write_state(self.workdir, self.children if children is None else children, self.security, self.cluster_id,
                     self.fleet)

    async def tick(self) -> None:
        """Notice deaths, start restarts that are due, follow the fleet's version, record what changed."""
        now = time.monotonic()
        changed = False
        fleet = self._read_fleet()
        if fleet != self.fleet:
            self.fleet, changed = fleet, True
        for c in self.children:
            if c.restarting is not None:
                if not c.restarting.done():
                    continue
                err = c.restarting.exception()
                c.restarting = None
                changed = True
                if err is None:
                    print(f"zerokl up: {c.name} is back (restart {c.restarts})", flush=True)
                    continue
                print(f"zerokl up: restarting {c.name} failed: {err}", file=sys.stderr, flush=True)
                if c.proc is not None and c.proc.poll() is None:   # up but never SERVING: try again
                    c.proc.kill()
                    c.proc.wait()
                if isinstance(err, _NotLaunched):                   # why, for `zerokl status`
                    c.note = f"not started again: {err}"
                    c.status, c.restart_at = "DOWN", now + self._backoff(c, now)
                    continue
            assert c.proc is not None
            if c.status != "DOWN" and c.proc.poll() is not None:
                delay = self._backoff(c, now)
                c.status, c.last_exit, c.serving_since, c.restart_at = "DOWN", c.proc.returncode, None, now + delay
                print(f"zerokl up: {c.name} exited with status {c.proc.returncode}; restarting it in {delay:.1f}s. "
                      f"Its log {c.log_path}:\n{_log_tail(c.log_path)}", file=sys.stderr, flush=True)
                changed = True
            if c.status == "DOWN" and now >= c.restart_at:
                c.restarting = asyncio.ensure_future(self._restart(c))
                changed = True
        if changed:
            self.write_state()

    def _backoff(self, c: Child, now: float) -> float:
        """The delay before ``c``'s next start: doubling while starts keep failing, back to the first after
        it served ``_STABLE_S``."""
        if c.serving_since is not None and now - c.serving_since >= _STABLE_S:
            c.failures = 0
        delay = min(_BACKOFF_CAP_S, self.args.restart_backoff * 2 ** c.failures)
        c.failures += 1
        return delay

    async def _restart(self, c: Child) -> None:
        c.status = "RESTARTING"
        if c.service in ("prefill", "decode") and c.fleet:
            try:
                await self._follow_fleet_version(c)
            except (UpError, grpc.aio.AioRpcError) as err:
                why = f"weight store: {err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) \
                    else str(err)
                raise _NotLaunched(why) from None
        c.restarts += 1
        _launch(c, self.cluster_id)
        self.write_state()
        await _wait_serving(c, time.monotonic() + self.args.startup_timeout, self.security, self.cluster_id)

    async def _follow_fleet_version(self, c: Child) -> None:
        """Point the replica's --model/--weights-version at the fleet's target version, or, when the store cannot
        hand that out whole, at the most recently served good version it can (``c.note`` says why)."""
        self.fleet = self._read_fleet()
        version = self.fleet.weights_version
        flag = c.flags.index("--weights-version") + 1
        if not version or version == c.flags[flag]:
            c.note = ""
            return
        from zerokl.services.weightstore.client import WeightStoreClient
        async with self.security.channel(self.store.address) as channel, \
                WeightStoreClient(channel=channel) as client:
            served, dest, why = await _fetch_servable(client, self.workdir, version, self.fleet.fallbacks(version))
        c.flags[c.flags.index("--model") + 1] = str(dest)
        c.flags[flag] = served
        c.note = f"restarted at weights version {served}: {version} cannot be fetched whole ({why})" if why else ""
        print(f"zerokl up: {c.name} {c.note}" if why else
              f"zerokl up: {c.name} comes back at weights version {served} (the fleet's)", flush=True)


async def run(args: argparse.Namespace) -> int:
    """Start everything, supervise until a signal, stop everything."""
    workdir = pathlib.Path(args.workdir).expanduser().resolve()
    if args.decode_replicas < 1 or args.prefill_replicas < 0:
        raise SystemExit("zerokl up: need at least one decode replica and no negative counts")
    if args.colocate and args.no_trainer:
        raise SystemExit("zerokl up: --colocate shares the device between the replicas and the trainer: not with "
                         "--no-trainer")
    if not args.model and not args.preset:
        args.model = str(SFT_CHECKPOINT)
    args.dtype = _fleet_dtype(args)
    try:
        # Refused before anything starts: a place another cluster holds, a fleet that could not be exact.
        _check_free(workdir, {"--port": args.port, **({"--tinker-port": args.tinker_port} if args.tinker else {})})
        _check_exact(args, _stored_dtype(args.model, f"--model {args.model}") if args.model
                     else _canonical_dtype(args.dtype), f"--model {args.model}" if args.model else "the preset")
    except UpError as err:
        print(f"zerokl up: {err}", file=sys.stderr)
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    security = _security(args, workdir)
    # This start's identity: every child advertises it in Info, up.json names it, clients check it.
    cluster_id = secrets.token_hex(8)
    # Compiled kernels stay with the workdir: a second `zerokl up` (and every restart) starts warm.
    os.environ.setdefault("TRITON_CACHE_DIR", str(workdir / "cache" / "triton"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    store = Child("weight-store", "weight-store", _free_port(), [], workdir / "logs" / "weight-store.log")
    store.flags = ["--root", str(workdir / "weights"), "--port", str(store.port), "--replica-id", "weight-store",
                   "--grace", str(args.grace), *security.child_flags()]
    children = [store]
    waits: dict[str, asyncio.Future[None]] = {}
    status = 0
    try:
        started = time.monotonic()
        deadline = started + args.startup_timeout
        _launch(store, cluster_id)
        await _until(_wait_serving(store, deadline, security, cluster_id), stop)
        version, model_dir, record = await _until(_prepare_weights(args, store, workdir, security), stop)
        _check_exact(args, _stored_dtype(model_dir, f"weights version {version}"), f"weights version {version}")
        children += _plan(args, workdir, store, version, model_dir, security)
        for child in children[1:]:
            _launch(child, cluster_id)
        waits.update({c.name: asyncio.ensure_future(_wait_serving(c, deadline, security, cluster_id))
                      for c in children[1:]})
        await _until(asyncio.wait(waits.values()), stop)
        for child in children[1:]:
            err = waits[child.name].exception()
            if err is None:
                continue
            if child.required:
                raise err
            child.status = "FAILED (see log)"
            print(f"zerokl up: {child.name} did not come up, the others keep running: {err}", file=sys.stderr)
        _check_one_fingerprint(children)
        if not any(c.service == "trainer" for c in children):
            why = "--no-trainer" if args.no_trainer else f"this install has no {TRAINER_MODULE}"
            print(f"zerokl up: not starting the trainer ({why})", flush=True)
        # What never came up is not restarted: its log says why, and a restart would fail the same way.
        supervised = [c for c in children if c.status == "SERVING"]
        supervisor = _Supervisor(args, workdir, supervised, store, security, cluster_id, record)
        supervisor.write_state(children)
        scheduler = children[-1]
        print(f"zerokl up: {len(children)} services on loopback in {time.monotonic() - started:.1f}s "
              f"(workdir {workdir}, logs in {workdir / 'logs'}, cluster {cluster_id})", flush=True)
        print(_table(children), flush=True)
        if security.auth.enabled:
            print(f"auth is on: tokens in {workdir / 'secrets'} (client.token for generate, operator.token for "
                  f"jobs and internal RPCs)", flush=True)
        tinker = [c for c in children if c.service == "tinker" and c.status == "SERVING"]
        key = "tml-<client token>" if security.auth.enabled else "tml-local"
        print(f"try:\n  {_example(scheduler.address)}" + ("\n  (an untrained preset answers with noise: without "
              "--preset, `zerokl up` serves the shipped countdown SFT checkpoint)" if args.preset else "")
              + "".join(f"\n  TINKER_BASE_URL=http://{_HOST}:{c.http_port} TINKER_API_KEY={key} python your_script.py"
                        "   (the tinker SDK; docs/api.md)" for c in tinker)
              + "\nCtrl-C stops all services.", flush=True)
        while not stop.is_set():
            await supervisor.tick()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    except UpError as err:
        print(f"zerokl up: {err}", file=sys.stderr)
        status = 1
    except grpc.aio.AioRpcError as err:  # the weight store refused to publish or fetch
        print(f"zerokl up: weight store {store.address}: {err.code().name}: {err.details()}", file=sys.stderr)
        status = 1
    except _Stopped:
        pass
    finally:
        pending = [*waits.values(), *(c.restarting for c in children if c.restarting is not None)]
        for wait in pending:
            wait.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        print("zerokl up: stopping services ...", flush=True)
        clean = await asyncio.to_thread(_stop, children, args.grace + 10.0)
        state = read_state(workdir)
        if state is not None and state["pid"] == os.getpid():   # ours, not another `zerokl up`'s
            with contextlib.suppress(OSError):
                (workdir / "up.json").unlink()
        print("zerokl up: stopped" + ("" if clean else " (some services did not exit cleanly; see their logs)"),
              flush=True)
    return status


def _example(address: str) -> str:
    """A `zerokl generate` line to try against the scheduler at ``address`` (bash quoting: the prompt ends in a
    newline, as the task's prompts do)."""
    prompt = "$'" + _EXAMPLE_PROMPT.replace("\n", "\\n") + "'"
    return f"zerokl generate --server {address} {prompt} --temperature 0 --max-tokens 32"


def _check_free(workdir: pathlib.Path, ports: dict[str, int]) -> None:
    """UpError when another `zerokl up` runs in ``workdir`` or something listens on one of the fixed ``ports``
    (flag -> port; 0: picked at start, always free)."""
    state = read_state(workdir)
    if state is not None:
        raise UpError(f"another `zerokl up` (pid {state['pid']}) runs in {workdir}: stop it first, or give this "
                      "one its own --workdir")
    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As the service binds it (SO_REUSEADDR: a port in TIME_WAIT is free; a listening one never is).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((_HOST, port))
            except OSError as err:
                raise UpError(f"{flag} {port}: {_HOST}:{port} is taken ({err.strerror}); another cluster may be "
                              f"serving there. Pass another {flag}, or {flag} 0 for a free one") from None


def _check_one_fingerprint(children: Sequence[Child]) -> None:
    """UpError when the compute services that came up report more than one numerics fingerprint (what the plan
    could not foresee, e.g. a trainer resuming a run that keeps its own dtype)."""
    compute = [c for c in children if c.service in ("prefill", "decode", "trainer") and c.identity is not None]
    if len({c.identity.numerics_fingerprint for c in compute}) > 1:  # type: ignore[union-attr]
        seen = "; ".join(f"{c.name} {i.numerics_fingerprint} ({i.backend}/{i.device}/{i.dtype})"
                         for c in compute if (i := c.identity) is not None)
        raise UpError(f"the services compute more than one numerics fingerprint ({seen}): train/inference KL is "
                      "exactly 0 only within one. A trainer that resumes its run keeps the run's dtype: start with "
                      "the run's --dtype, or a fresh --workdir")


class _Stopped(Exception):
    """A signal arrived while starting up."""


async def _until(awaitable: object, stop: asyncio.Event):  # noqa: ANN202 - the awaitable's result
    """``awaitable``'s result, or :class:`_Stopped` if a stop signal arrives first."""
    result = await unless_set(awaitable, stop)  # type: ignore[arg-type]
    if stop.is_set():
        raise _Stopped
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``zerokl up`` as a function (the CLI calls :func:`run` with its own parsed flags)."""
    return asyncio.run(run(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))))


# ----------------------------------------------------------------------------- zerokl status

@dataclass(frozen=True)
class ClientSecurity:
    """What a command-line client presents: a bearer token and the CA to verify TLS servers with."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None      # a client certificate, for servers that require mTLS
    tls_key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        return TlsConfig.channel_credentials(self.tls_ca, self.tls_cert, self.tls_key) if self.tls_ca else None

    def with_state(self, state: dict, operator: bool = False) -> "ClientSecurity":
        """Fill what was not given from a ``zerokl up`` state (the same local user started it): its client
        (or operator) token file and its CA."""
        token = self.token
        path = state.get("operator_token_file" if operator else "client_token_file")
        if token is None and path:
            token = load_auth_token(path, {})
        return ClientSecurity(token, self.tls_ca or state.get("tls_ca"), self.tls_cert, self.tls_key)


async def _probe(entry: dict, security: ClientSecurity, cluster_id: str) -> dict:
    """Live health and identity of one service listed in up.json, with what the supervisor recorded. A service
    whose Info names another cluster than ``cluster_id`` (up.json's) is reported as such, not as this one's."""
    row = {"name": entry["name"], "service": entry["service"], "address": entry["address"],
           "fleet": entry.get("fleet", True),
           "health": "UNREACHABLE", "state": entry.get("status", ""), "restarts": entry.get("restarts", 0),
           "last_exit": entry.get("last_exit"), "note": entry.get("note", ""),
           "weights_version": "", "numerics_fingerprint": "", "numerics_version": "", "cluster_id": ""}
    async with create_channel(entry["address"], token=security.token, credentials=security.credentials(),
                              tracer_provider=trace.NoOpTracerProvider()) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            row["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError:
            return row
        ident = await _info(channel, entry["service"])
        if ident is not None:
            row.update(weights_version=ident.weights_version, numerics_fingerprint=ident.numerics_fingerprint,
                       numerics_version=ident.numerics_version, cluster_id=ident.cluster_id)
    if cluster_id and row["cluster_id"] != cluster_id:
        row["health"] = "OTHER CLUSTER"
        row["note"] = (f"{entry['address']} answers as cluster {row['cluster_id'] or '(none)'}, not this one "
                       f"({cluster_id}): the service is gone and another process has its port")
    return row


def status(workdir: str, as_json: bool = False, security: ClientSecurity = ClientSecurity(),
           wait_s: float = 0.0) -> int:
    """`zerokl status`: each service's health, supervisor state, restarts, fingerprint and weights version.

    Exit status 0 only when every service is SERVING, the compute services (the trainer
    included) agree on one numerics fingerprint and the serving fleet (replicas and the
    scheduler) on one weights version; the trainer's own version is shown apart (it trains
    ahead of the fleet, or stays where a job left it after the fleet switched back). A
    service the supervisor is restarting is named DOWN or RESTARTING (with its restart count,
    last exit status and, when a restart could not start it or it came back elsewhere, why)
    until it is back; a fleet that fell back from a version it could not load says so.
    ``wait_s``: wait up to this long for that (a `zerokl up` still starting, a restart), then report.
    """
    deadline = time.monotonic() + wait_s
    while True:
        state = read_state(workdir)
        if state is not None:
            rows = asyncio.run(_gather_probes(state["services"], security.with_state(state),
                                              state.get("cluster_id", "")))
            verdict = _verdict(rows)
            if verdict.ok:
                break
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if state is None:
        print(f"no running `zerokl up` found ({pathlib.Path(os.path.expanduser(workdir)) / 'up.json'} "
              f"does not exist or names a process that is gone" + (f", after {wait_s:g}s" if wait_s else
                                                                   "; `zerokl status --wait 60` waits for one "
                                                                   "that is starting") + ")", file=sys.stderr)
        return 1
    # The scheduler's record, read where it writes it: current even between two of the supervisor's ticks.
    fleet_note = read_fleet(pathlib.Path(os.path.expanduser(workdir)) / "scheduler").note
    if as_json:
        print(json.dumps({"ok": verdict.ok, "down": verdict.down, "fingerprints": verdict.fingerprints,
                          "weights_versions": verdict.versions, "trainer_weights_version": verdict.trainer,
                          "cluster_id": state.get("cluster_id", ""), "fleet_note": fleet_note,
                          "services": rows}, indent=2))
    else:
        table = [("SERVICE", "ADDRESS", "HEALTH", "STATE", "RESTARTS", "WEIGHTS", "FINGERPRINT")]
        table += [(r["name"], r["address"], r["health"], r["state"] or "-",
                   f"{r['restarts']}" + (f" (last exit {r['last_exit']})" if r["last_exit"] is not None else ""),
                   r["weights_version"] or "-", r["numerics_fingerprint"] or "-") for r in rows]
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        print("\n".join("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip() for t in table))
        for r in rows:
            if r["note"]:
                print(f"{r['name']}: {r['note']}")
        if fleet_note:
            print(f"fleet: {fleet_note}")
        trainer = f" (trainer at {verdict.trainer})" if verdict.trainer else ""
        print(f"{'OK' if verdict.ok else 'NOT OK'}: {sum(r['health'] == 'SERVING' for r in rows)}/{len(rows)} "
              f"serving, fingerprints {verdict.fingerprints or ['-']}, weights versions {verdict.versions or ['-']}"
              f"{trainer}" + (f"; down: {', '.join(verdict.down)}" if verdict.down else ""))
    return 0 if verdict.ok else 1


@dataclass(frozen=True)
class _Verdict:
    """What `zerokl status` concludes from its probes."""

    ok: bool
    down: list[str]             # services not SERVING (or not this cluster's)
    fingerprints: list[str]     # of the compute services, the trainer included
    versions: list[str]         # weights versions the serving fleet (replicas, scheduler) serves
    trainer: str                # the trainer's own weights version ("" without a trainer)


def _verdict(rows: list[dict]) -> _Verdict:
    """The verdict of probed rows (see :func:`status`)."""
    # The fleet's compute services must agree on one fingerprint; the Tinker endpoint and its sampler
    # replicas (outside the fleet) serve the versions its clients ask for, the trainer its own.
    compute = [r for r in rows if r["service"] not in ("weight-store", "tinker") and r.get("fleet", True)]
    fingerprints = sorted({r["numerics_fingerprint"] for r in compute})
    fleet = [r for r in compute if r["service"] != "trainer" and (r["service"] != "scheduler" or r["weights_version"])]
    versions = sorted({r["weights_version"] for r in fleet})
    trainer = next((r["weights_version"] for r in rows if r["service"] == "trainer"), "")
    down = [r["name"] for r in rows if r["health"] != "SERVING" or r["state"] not in ("SERVING", "")]
    ok = not down and len(fingerprints) == 1 and len(versions) == 1 and fingerprints[0] != ""
    return _Verdict(ok, down, fingerprints, versions, trainer)


async def _gather_probes(entries: list[dict], security: ClientSecurity, cluster_id: str) -> list[dict]:
    return list(await asyncio.gather(*(_probe(e, security, cluster_id) for e in entries)))
