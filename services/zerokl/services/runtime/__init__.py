"""zerokl.services.runtime: what every zerokl gRPC service runs on.

- :mod:`.server`: :class:`ServiceServer` (health, reflection, drain on SIGTERM,
  message limits), :func:`serve`, :func:`create_channel`, shared CLI flags.
- :mod:`.metrics`: the ``zerokl_`` Prometheus metrics and their HTTP endpoint.
- :mod:`.tracing`: OTLP export and W3C trace-context interceptors.
- :mod:`.auth`: role-based bearer-token auth (client, peer, operator) and TLS / mTLS credentials.
- :mod:`.chunks`: checksummed raw-byte chunks for large blobs.
- :mod:`.errors`: exceptions that become rich gRPC statuses.
- :mod:`.info`: the service identity behind every Info RPC.
"""
from zerokl.services.runtime.auth import AuthConfig, Role, TlsConfig, caller_role, load_auth_config, load_auth_token
from zerokl.services.runtime.chunks import (
    MAX_CHUNK_BYTES,
    Chunk,
    ChunkAssembler,
    chunk_from_proto,
    chunk_to_proto,
    chunks_from_pieces,
    split_bytes,
    verify_chunk,
)
from zerokl.services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    PreconditionViolation,
    ServiceError,
    Unavailable,
    field_violations,
    status_details,
)
from zerokl.services.runtime.info import ServiceIdentity, identity_from_proto, identity_to_proto, model_config_hash
from zerokl.services.runtime.metrics import set_serving_info, start_metrics_server
from zerokl.services.runtime.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ServerOptions,
    ServiceServer,
    add_server_arguments,
    create_channel,
    options_from_args,
    serve,
)
from zerokl.services.runtime.tracing import configure_tracing

__all__ = [
    "AlreadyExists",
    "Chunk",
    "ChunkAssembler",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DataLoss",
    "FailedPrecondition",
    "FieldViolation",
    "InvalidArgument",
    "MAX_CHUNK_BYTES",
    "NotFound",
    "PreconditionViolation",
    "ServerOptions",
    "ServiceError",
    "ServiceIdentity",
    "ServiceServer",
    "TlsConfig",
    "AuthConfig",
    "Role",
    "caller_role",
    "Unavailable",
    "add_server_arguments",
    "chunk_from_proto",
    "chunk_to_proto",
    "chunks_from_pieces",
    "configure_tracing",
    "create_channel",
    "field_violations",
    "identity_from_proto",
    "identity_to_proto",
    "load_auth_config",
    "load_auth_token",
    "model_config_hash",
    "options_from_args",
    "serve",
    "set_serving_info",
    "split_bytes",
    "start_metrics_server",
    "status_details",
    "verify_chunk",
]
