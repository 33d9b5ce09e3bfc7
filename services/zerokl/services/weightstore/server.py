"""``zerokl serve weight-store`` / ``python -m zerokl.services.weightstore``.

Storage is a local directory (``--root``, the embedded default) or an
S3-compatible bucket (``--s3-endpoint`` + ``--s3-bucket``; credentials from
``ZEROKL_S3_ACCESS_KEY``/``ZEROKL_S3_SECRET_KEY`` or the AWS variables, never
from flags, so they stay out of process listings).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import pathlib
import sys
import tempfile
from typing import Sequence

from zerokl.services.runtime.info import ServiceIdentity, default_replica_id
from zerokl.services.runtime.metrics import MetricsServer, set_serving_info
from zerokl.services.runtime.server import ServiceServer, add_server_arguments, options_from_args, serve
from zerokl.services.weightstore.backends import LocalDirBackend, S3Backend, StorageBackend
from zerokl.services.weightstore.cache import DEFAULT_MAX_BYTES
from zerokl.services.weightstore.service import add_weight_store
from zerokl.services.weightstore.store import VersionStore

__all__ = ["DEFAULT_PORT", "DEFAULT_ROOT", "build_parser", "backend_from_args", "cache_dir_from_args", "main"]

DEFAULT_PORT = 50055
DEFAULT_ROOT = os.environ.get("ZEROKL_WEIGHTS_DIR", "~/.zerokl/weights")


def build_parser() -> argparse.ArgumentParser:
    """The weight store's command line."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="zerokl serve weight-store",
                                description="Serve versioned model weights over gRPC.")
    g = p.add_argument_group("storage")
    g.add_argument("--root", default=DEFAULT_ROOT,
                   help="local directory holding the versions (default %(default)s; $ZEROKL_WEIGHTS_DIR)")
    g.add_argument("--s3-endpoint", help="S3/MinIO host:port; use a bucket instead of --root")
    g.add_argument("--s3-bucket", help="bucket name (created if missing)")
    g.add_argument("--s3-prefix", default="", help="key prefix inside the bucket, ending in '/'")
    g.add_argument("--s3-region", default=None, help="S3 region (default: the SDK's own resolution)")
    g.add_argument("--s3-insecure", action="store_true", help="plain HTTP to the S3 endpoint")
    c = p.add_argument_group("decoded-shard cache (accepting or reading a delta decodes one layer, not its chain)")
    c.add_argument("--cache-dir", default=None,
                   help="local directory of the newest decoded version of each shard (default: ROOT/.decoded for "
                        "--root; a directory under the system temp dir named after the bucket for S3)")
    c.add_argument("--cache-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="at most this many bytes in the cache (default %(default)s; 0: no cache)")
    r = p.add_argument_group("retention")
    r.add_argument("--keep-last", type=int, default=None,
                   help="after each publish keep only the newest N unpinned versions (default: keep all)")
    r.add_argument("--upload-ttl", type=float, default=7 * 24 * 3600,
                   help="seconds after which an unpublished upload is garbage (default one week)")
    p.add_argument("--watch-poll", type=float, default=2.0,
                   help="seconds between checks for versions published by other writers")
    p.add_argument("--replica-id", default=None, help="name reported by Info (default: pod name or host-pid)")
    add_server_arguments(p, DEFAULT_PORT)
    return p


def backend_from_args(args: argparse.Namespace) -> StorageBackend:
    """The storage backend the flags select."""
    if args.s3_endpoint or args.s3_bucket:
        if not (args.s3_endpoint and args.s3_bucket):
            raise SystemExit("--s3-endpoint and --s3-bucket go together")
        access = os.environ.get("ZEROKL_S3_ACCESS_KEY") or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = os.environ.get("ZEROKL_S3_SECRET_KEY") or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not (access and secret):
            raise SystemExit("S3 credentials missing: set ZEROKL_S3_ACCESS_KEY and ZEROKL_S3_SECRET_KEY")
        return S3Backend(args.s3_endpoint, args.s3_bucket, access, secret, secure=not args.s3_insecure,
                         region=args.s3_region, prefix=args.s3_prefix)
    return LocalDirBackend(args.root)


def cache_dir_from_args(args: argparse.Namespace, backend: StorageBackend) -> pathlib.Path | None:
    """Where the decoded-shard cache goes: ``--cache-dir``, else the backend's scratch directory, else (a bucket) a
    directory of the system temp dir named after where the data lives, so a restart on this host finds it."""
    if args.cache_dir:
        return pathlib.Path(args.cache_dir).expanduser()
    scratch = backend.scratch_dir()
    if scratch is not None:
        return scratch
    where = hashlib.sha256(backend.describe().encode()).hexdigest()[:16]
    return pathlib.Path(tempfile.gettempdir()) / f"zerokl-weight-store-{where}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the weight store until SIGTERM/SIGINT; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    options = options_from_args(args)
    backend = backend_from_args(args)
    store = VersionStore(backend, keep_last=args.keep_last, upload_ttl_s=args.upload_ttl,
                         cache_dir=cache_dir_from_args(args, backend), cache_bytes=args.cache_bytes)
    identity = ServiceIdentity("weight-store", args.replica_id or default_replica_id("weight-store"))

    def setup(server: ServiceServer) -> None:
        add_weight_store(server, store, identity, args.watch_poll)
        set_serving_info(identity)

    def ready(server: ServiceServer, metrics: MetricsServer | None) -> None:
        where = f" metrics on :{metrics.port}" if metrics is not None else ""
        # One parseable line on stdout: `zerokl up` waits for it to learn the port.
        print(f"weight-store listening on {server.address}{where} storage: {backend.describe()}", flush=True)

    asyncio.run(serve("weight-store", setup, options, metrics_port=args.metrics_port,
                      metrics_host=args.host, on_ready=ready))
    return 0
