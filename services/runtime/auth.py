"""Optional shared-token auth and TLS / mutual TLS credentials.

Auth: every RPC except health checks must carry ``authorization: Bearer
<token>`` metadata; the token comes from ``ZEROKL_AUTH_TOKEN`` or the file
named by ``ZEROKL_AUTH_TOKEN_FILE`` (a Kubernetes Secret mounted as a file).
Health is exempt because kubelet and load-balancer probes carry no token.
"""
from __future__ import annotations

import hmac
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

import grpc
import grpc.aio

from zerokl.services.runtime.interceptors import MetadataClientInterceptor, replace_behavior

__all__ = [
    "AUTH_TOKEN_ENV",
    "AUTH_TOKEN_FILE_ENV",
    "HEALTH_METHOD_PREFIX",
    "load_auth_token",
    "BearerTokenServerInterceptor",
    "bearer_token_interceptor",
    "TlsConfig",
]

AUTH_TOKEN_ENV = "ZEROKL_AUTH_TOKEN"
AUTH_TOKEN_FILE_ENV = "ZEROKL_AUTH_TOKEN_FILE"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


def load_auth_token(token_file: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """The shared token: ``token_file`` if given, else the env variables; None disables auth.

    Surrounding whitespace is stripped (files usually end in a newline). An
    explicitly named file that is empty is an error, not "auth off".
    """
    env = os.environ if environ is None else environ
    path = token_file or env.get(AUTH_TOKEN_FILE_ENV)
    if path:
        token = pathlib.Path(path).read_text().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    token = env.get(AUTH_TOKEN_ENV, "").strip()
    return token or None


class BearerTokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` with UNAUTHENTICATED."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (HEALTH_METHOD_PREFIX,)) -> None:
        if not token:
            raise ValueError("empty auth token")
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt_prefixes

    def _reason(self, metadata: Any) -> str | None:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata"
        presented = values[0].encode() if isinstance(values[0], str) else values[0]
        # Constant-time compare so response timing does not leak the token.
        if not hmac.compare_digest(presented, self._expected):
            return "invalid bearer token"
        return None

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        reason = self._reason(handler_call_details.invocation_metadata)
        if reason is None:
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{handler_call_details.method}: {reason}")
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
