"""How the command-line clients (`zerokl generate`, `status`, `jobs`) find a server and authenticate.

The server: ``--server``, else ``$ZEROKL_SERVER``, else the scheduler of the
`zerokl up` running in ``$ZEROKL_UP_DIR`` (default ``~/.zerokl/up``; found in
its ``up.json``, so a ``zerokl up --port 0`` cluster needs no address). There is
no default address: with none of them the client stops, telling the user to
start ``zerokl up`` or pass ``--server`` (on a shared machine a well-known port
may be another user's cluster). A cluster found through ``up.json`` is checked
before the first call: its scheduler's Info must name the cluster id ``up.json``
records (each ``zerokl up`` start has its own), so a client never talks to
another cluster that took the address without saying so.

The credentials: ``--token`` (visible to other local users in the process
list: prefer the others), else ``--auth-token-file``, else the role's
environment variables; TLS with ``--tls-ca`` (plus ``--tls-cert/--tls-key``
for servers that require client certificates). A cluster found through
``up.json`` also lends its token file and CA when none is given: they belong
to the same local user who started it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import grpc

from zerokl.services.runtime.auth import (AUTH_TOKEN_ENV, AUTH_TOKEN_FILE_ENV, OPERATOR_TOKEN_ENV,
                                          OPERATOR_TOKEN_FILE_ENV, load_auth_token)
from zerokl.up import DEFAULT_WORKDIR, ClientSecurity, read_state

__all__ = ["Connection", "add_connection_arguments", "add_security_arguments", "connect",
           "client_security", "up_workdir"]

@dataclass(frozen=True)
class Connection:
    """Where to call and with what."""

    target: str
    security: ClientSecurity


def up_workdir() -> str:
    """Where a local `zerokl up` keeps its state ($ZEROKL_UP_DIR or ~/.zerokl/up)."""
    return os.environ.get("ZEROKL_UP_DIR", DEFAULT_WORKDIR)


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    """--token, --auth-token-file, --tls-ca, --tls-cert, --tls-key."""
    g = p.add_argument_group("credentials (docs/operator.md, \"Security model\")")
    g.add_argument("--token", default=None,
                   help="bearer token to present (visible in the process list: prefer --auth-token-file or "
                        "$ZEROKL_AUTH_TOKEN / $ZEROKL_OPERATOR_TOKEN)")
    g.add_argument("--auth-token-file", default=None, help="file holding the bearer token to present")
    g.add_argument("--tls-ca", default=None, help="PEM CA to verify the server with (TLS; default plaintext)")
    g.add_argument("--tls-cert", default=None, help="PEM client certificate, for servers that require mTLS")
    g.add_argument("--tls-key", default=None, help="its PEM private key")


def add_connection_arguments(p: argparse.ArgumentParser, what: str = "the scheduler") -> None:
    """--server plus :func:`add_security_arguments`."""
    p.add_argument("--server", default=None,
                   help=f"host:port of {what} (default $ZEROKL_SERVER, else the scheduler of the `zerokl up` in "
                        f"$ZEROKL_UP_DIR or {DEFAULT_WORKDIR}, checked to be that cluster's)")
    add_security_arguments(p)


def client_security(args: argparse.Namespace, operator: bool = False) -> ClientSecurity:
    """The flags' credentials; without a token flag, the environment's (the operator's first if ``operator``)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    token = args.token or (load_auth_token(args.auth_token_file) if args.auth_token_file else None)
    if token is None and operator:
        token = load_auth_token(env=OPERATOR_TOKEN_ENV, file_env=OPERATOR_TOKEN_FILE_ENV)
    if token is None:
        token = load_auth_token(env=AUTH_TOKEN_ENV, file_env=AUTH_TOKEN_FILE_ENV)
    return ClientSecurity(token, args.tls_ca, args.tls_cert, args.tls_key)


def connect(args: argparse.Namespace, operator: bool = False) -> Connection:
    """The server and credentials the flags, the environment or a running `zerokl up` name (see the module doc);
    SystemExit saying what to do when none names one, or when the address of a `zerokl up` answers as another
    cluster."""
    security = client_security(args, operator)
    target = args.server or os.environ.get("ZEROKL_SERVER")
    if target:
        return Connection(target, security)
    workdir = up_workdir()
    state = read_state(workdir)
    scheduler = next((s for s in (state or {}).get("services", ()) if s["service"] == "scheduler"), None)
    if state is None or scheduler is None:
        raise SystemExit(f"error: no cluster to talk to: no `zerokl up` runs in {workdir} (its up.json is missing or "
                         "names a process that is gone). Start one with `zerokl up` (or point $ZEROKL_UP_DIR at "
                         "its --workdir), or name a scheduler with --server HOST:PORT")
    security = security.with_state(state, operator)
    _check_cluster(scheduler["address"], security, state.get("cluster_id", ""), workdir)
    return Connection(scheduler["address"], security)


def _check_cluster(address: str, security: ClientSecurity, cluster_id: str, workdir: str) -> None:
    """SystemExit unless the scheduler at ``address`` answers Info as cluster ``cluster_id`` (up.json's)."""
    from zerokl.v1 import common_pb2

    credentials = security.credentials()
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    metadata = [("authorization", f"Bearer {security.token}")] if security.token else None
    with channel:
        info = channel.unary_unary("/zerokl.v1.Inference/Info",
                                   request_serializer=common_pb2.InfoRequest.SerializeToString,
                                   response_deserializer=common_pb2.ServiceInfo.FromString)
        try:
            theirs = info(common_pb2.InfoRequest(), timeout=10, metadata=metadata).cluster_id
        except grpc.RpcError as err:
            raise SystemExit(f"error: the scheduler of the `zerokl up` in {workdir} does not answer at {address}: "
                             f"{err.code().name}: {err.details()} (`zerokl status` shows the cluster)") from None
    if theirs != cluster_id:
        raise SystemExit(f"error: {address} answers as cluster {theirs or '(none)'}, not as the `zerokl up` in "
                         f"{workdir} (cluster {cluster_id}): another process holds its scheduler's port. Nothing "
                         "was sent; `zerokl status` shows the cluster, --server names a server explicitly")
