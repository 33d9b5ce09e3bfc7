"""Role-based bearer-token auth and TLS / mutual TLS credentials.

Three credentials, three roles (see docs/operator.md, "Security model"):

- **client** (``ZEROKL_AUTH_TOKEN`` / ``ZEROKL_AUTH_TOKEN_FILE``): may call what
  a user of the cluster needs: Generate, Score, Abort, Info, job listing and
  watching, weight-store reads.
- **peer** (``ZEROKL_PEER_TOKEN`` / ``..._FILE``): what the services present to
  each other; may call everything, including the internal RPCs (KV handoff,
  SwitchWeights, trainer steps, Save/LoadWeights, weight-store writes and
  deletes, SubmitJob/CancelJob). Only KV handed off by a peer may enter a
  decode replica's prefix cache.
- **operator** (``ZEROKL_OPERATOR_TOKEN`` / ``..._FILE``): a person running
  the cluster; may call everything a peer may.

Every call except health checks must carry ``authorization: Bearer <token>``
whenever any token is configured: no token or an unknown one is
UNAUTHENTICATED, a client token on an internal RPC is PERMISSION_DENIED.
Methods not listed as client methods are internal (a new RPC is closed until
someone opens it). Health is exempt because kubelet and load-balancer probes
carry no token.
"""
from __future__ import annotations

import contextvars
import enum
import hmac
import os
import pathlib
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

import grpc
import grpc.aio

from zerokl.services.runtime.interceptors import MetadataClientInterceptor, replace_behavior, wrap_handler

__all__ = [
    "AUTH_TOKEN_ENV",
    "AUTH_TOKEN_FILE_ENV",
    "PEER_TOKEN_ENV",
    "PEER_TOKEN_FILE_ENV",
    "OPERATOR_TOKEN_ENV",
    "OPERATOR_TOKEN_FILE_ENV",
    "HEALTH_METHOD_PREFIX",
    "CLIENT_METHODS",
    "Role",
    "AuthConfig",
    "load_auth_token",
    "load_auth_config",
    "caller_role",
    "RoleAuthServerInterceptor",
    "bearer_token_interceptor",
    "TlsConfig",
]

AUTH_TOKEN_ENV = "ZEROKL_AUTH_TOKEN"
AUTH_TOKEN_FILE_ENV = "ZEROKL_AUTH_TOKEN_FILE"
PEER_TOKEN_ENV = "ZEROKL_PEER_TOKEN"
PEER_TOKEN_FILE_ENV = "ZEROKL_PEER_TOKEN_FILE"
OPERATOR_TOKEN_ENV = "ZEROKL_OPERATOR_TOKEN"
OPERATOR_TOKEN_FILE_ENV = "ZEROKL_OPERATOR_TOKEN_FILE"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"

#: What a client credential may call; every other method needs a peer or operator credential.
CLIENT_METHODS = frozenset({
    "/zerokl.v1.Inference/Info", "/zerokl.v1.Inference/Generate", "/zerokl.v1.Inference/Abort",
    "/zerokl.v1.Inference/Score",
    "/zerokl.v1.Trainer/Info", "/zerokl.v1.Trainer/GetState",
    "/zerokl.v1.WeightStore/Info", "/zerokl.v1.WeightStore/GetManifest", "/zerokl.v1.WeightStore/Get",
    "/zerokl.v1.WeightStore/List", "/zerokl.v1.WeightStore/Watch",
    "/zerokl.v1.Jobs/WatchJob", "/zerokl.v1.Jobs/ListJobs", "/zerokl.v1.TinkerEndpoint/Info",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
})


class Role(enum.Enum):
    """Who a credential belongs to."""

    CLIENT = "client"
    PEER = "peer"
    OPERATOR = "operator"


_INTERNAL_ROLES = frozenset({Role.PEER, Role.OPERATOR})

# The role of the call being served (None: auth off, or outside a call).
_CALLER_ROLE: contextvars.ContextVar[Role | None] = contextvars.ContextVar("zerokl_caller_role", default=None)


def caller_role() -> Role | None:
    """The authenticated role of the RPC this code serves; None when auth is off."""
    return _CALLER_ROLE.get()


@dataclass(frozen=True)
class AuthConfig:
    """The tokens a server accepts, one per role; a role without a token cannot authenticate.

    Auth is on when any token is set. The client and peer tokens must differ
    (a client holding the peer token would be a peer), and with a client token
    a peer token is required (the services could not call each other otherwise).
    """

    client_token: str | None = None
    peer_token: str | None = None
    operator_token: str | None = None

    def __post_init__(self) -> None:
        tokens = [t for t in (self.client_token, self.peer_token, self.operator_token) if t]
        if len(set(tokens)) != len(tokens):
            raise ValueError("the client, peer and operator tokens must differ from each other")
        if self.client_token and not self.peer_token:
            raise ValueError("auth with a client token needs a peer token too (set ZEROKL_PEER_TOKEN or "
                             "--peer-token-file): services present it to each other")

    @property
    def enabled(self) -> bool:
        return bool(self.client_token or self.peer_token or self.operator_token)

    def role_of(self, presented: bytes) -> Role | None:
        """The role whose token ``presented`` (``Bearer <token>``) carries, or None."""
        found = None
        for role, token in ((Role.CLIENT, self.client_token), (Role.PEER, self.peer_token),
                            (Role.OPERATOR, self.operator_token)):
            # Constant-time compares, all of them, so response timing leaks neither token nor role.
            if token and hmac.compare_digest(presented, f"Bearer {token}".encode()):
                found = role
        return found


def _read_token(path: str) -> str:
    token = pathlib.Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


def load_auth_token(token_file: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None, *,
                    env: str = AUTH_TOKEN_ENV, file_env: str = AUTH_TOKEN_FILE_ENV) -> str | None:
    """One token: ``token_file`` if given, else the file named by ``file_env``, else ``env``; None if unset.

    Surrounding whitespace is stripped (files usually end in a newline). An
    explicitly named file that is empty is an error, not "auth off". The
    defaults read the client token.
    """
    environ = os.environ if environ is None else environ
    path = token_file or environ.get(file_env)
    if path:
        return _read_token(str(path))
    return environ.get(env, "").strip() or None


def load_auth_config(client_file: str | None = None, peer_file: str | None = None,
                     operator_file: str | None = None, environ: Mapping[str, str] | None = None) -> AuthConfig:
    """The three tokens from the given files, else from the environment (see the module doc)."""
    return AuthConfig(
        client_token=load_auth_token(client_file, environ),
        peer_token=load_auth_token(peer_file, environ, env=PEER_TOKEN_ENV, file_env=PEER_TOKEN_FILE_ENV),
        operator_token=load_auth_token(operator_file, environ, env=OPERATOR_TOKEN_ENV,
                                       file_env=OPERATOR_TOKEN_FILE_ENV))


class RoleAuthServerInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a known token, PERMISSION_DENIED for a client token on an internal RPC.

    The caller's role is visible to the servicer through :func:`caller_role`.
    """

    def __init__(self, config: AuthConfig, client_methods: frozenset[str] = CLIENT_METHODS,
                 exempt_prefixes: tuple[str, ...] = (HEALTH_METHOD_PREFIX,)) -> None:
        if not config.enabled:
            raise ValueError("RoleAuthServerInterceptor needs at least one token")
        self._config = config
        self._client_methods = client_methods
        self._exempt = exempt_prefixes

    def _check(self, method: str, metadata: Any) -> tuple[Role | None, grpc.StatusCode | None, str]:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return None, grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata"
        presented = values[0].encode() if isinstance(values[0], str) else values[0]
        role = self._config.role_of(presented)
        if role is None:
            return None, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"
        if role not in _INTERNAL_ROLES and method not in self._client_methods:
            return role, grpc.StatusCode.PERMISSION_DENIED, "an internal RPC: it needs a peer or operator token"
        return role, None, ""

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._exempt):
            return handler
        role, code, reason = self._check(method, handler_call_details.invocation_metadata)
        if code is None:
            @asynccontextmanager
            async def as_role(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
                # Set inside the call's own task, so the servicer (and only this call) sees it.
                token = _CALLER_ROLE.set(role)
                try:
                    yield
                finally:
                    _CALLER_ROLE.reset(token)
            return wrap_handler(handler, as_role)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, f"{method}: {reason}")
        return replace_behavior(handler, deny)


def bearer_token_interceptor(token: str) -> MetadataClientInterceptor:
    """Client interceptor presenting ``token`` on every call (works on plaintext channels too)."""
    return MetadataClientInterceptor([("authorization", f"Bearer {token}")])


@dataclass(frozen=True)
class TlsConfig:
    """PEM file paths for TLS; set ``client_ca_file`` to require client certificates (mTLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials; with a client CA, clients must present a certificate it signed."""
        key = pathlib.Path(self.key_file).read_bytes()
        cert = pathlib.Path(self.cert_file).read_bytes()
        ca = pathlib.Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    @staticmethod
    def channel_credentials(root_ca_file: str | None = None, cert_file: str | None = None,
                            key_file: str | None = None) -> grpc.ChannelCredentials:
        """Client credentials: trust ``root_ca_file`` (system roots if None), optionally present a client cert."""
        def read(p: str | None) -> bytes | None:
            return pathlib.Path(p).read_bytes() if p else None
        return grpc.ssl_channel_credentials(read(root_ca_file), read(key_file), read(cert_file))
