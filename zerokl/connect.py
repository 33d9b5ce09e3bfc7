"""How the command-line clients (`zerokl generate`, `status`, `jobs`) find a server and authenticate.

The server: ``--server``, else ``$ZEROKL_SERVER``, else the scheduler of the
`zerokl up` running in ``$ZEROKL_UP_DIR`` (default ``~/.zerokl/up``; found in
its ``up.json``, so a ``zerokl up --port 0`` cluster needs no address), else
``127.0.0.1:50050``.

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

from zerokl.services.runtime.auth import (AUTH_TOKEN_ENV, AUTH_TOKEN_FILE_ENV, OPERATOR_TOKEN_ENV,
                                          OPERATOR_TOKEN_FILE_ENV, load_auth_token)
from zerokl.up import DEFAULT_WORKDIR, ClientSecurity, read_state

__all__ = ["DEFAULT_SERVER", "Connection", "add_connection_arguments", "add_security_arguments", "connect",
           "client_security", "up_workdir"]

DEFAULT_SERVER = "127.0.0.1:50050"


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
                        f"$ZEROKL_UP_DIR or {DEFAULT_WORKDIR}, else {DEFAULT_SERVER})")
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
    """The server and credentials the flags, the environment or a running `zerokl up` name (see the module doc)."""
    security = client_security(args, operator)
    target = args.server or os.environ.get("ZEROKL_SERVER")
    if target:
        return Connection(target, security)
    state = read_state(up_workdir())
    scheduler = next((s for s in (state or {}).get("services", ()) if s["service"] == "scheduler"), None)
    if state is None or scheduler is None:
        return Connection(DEFAULT_SERVER, security)
    return Connection(scheduler["address"], security.with_state(state, operator))
