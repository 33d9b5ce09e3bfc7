"""Storage backends for the weight-store tests: a temp directory, and a real S3 server on loopback.

The S3 side is moto's server mode (a real HTTP S3 implementation) started
here on 127.0.0.1 with a free port; the `minio` client talks to it over HTTP
exactly as it talks to MinIO in a cluster. Every test gets a fresh bucket.
"""
from __future__ import annotations

import io
import logging
import pathlib
import uuid
from typing import Callable, Iterator

import pytest
from minio import Minio

from zerokl.services.weightstore.backends import LocalDirBackend, S3Backend, StorageBackend

S3_KEY = "zerokl-test"
S3_SECRET = "zerokl-test-secret"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer     # here: a module that needs no S3 (the GPU machine's sync tests) loads without moto
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"{host}:{port}"
    server.stop()


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> StorageBackend:
    """A fresh, empty backend of each kind."""
    if request.param == "local":
        return LocalDirBackend(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    return S3Backend(endpoint, f"zerokl-{uuid.uuid4().hex[:12]}", S3_KEY, S3_SECRET, secure=False,
                     region="us-east-1", prefix="weights/")


@pytest.fixture
def corrupt(backend: StorageBackend) -> Callable[[str, bytes], None]:
    """Overwrite a stored object's bytes behind the store's back (disk or bucket)."""
    def overwrite(key: str, data: bytes) -> None:
        if isinstance(backend, LocalDirBackend):
            (backend.root / key).write_bytes(data)
        else:
            assert isinstance(backend, S3Backend)
            client = Minio(backend.endpoint, access_key=S3_KEY, secret_key=S3_SECRET, secure=False,
                           region="us-east-1")
            client.put_object(backend.bucket, backend.prefix + key, io.BytesIO(data), len(data))
    return overwrite
