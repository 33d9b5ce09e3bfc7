"""A weight store whose storage has no room, and uploads that fail: over a real `zerokl serve weight-store` process.

The store's disk is made "full" for real without mounting anything: its process gets a file size limit
(RLIMIT_FSIZE, set from here with prlimit), so its writes past the limit fail with EFBIG, as a full disk's fail
with ENOSPC (one mapping for both: ENOSPC, EDQUOT, EFBIG). Lifting the limit is the disk freed.

- The store refuses the write RESOURCE_EXHAUSTED, naming its root and the bytes it was writing, logs it once at
  WARNING, serves every other call, and keeps exactly what it acknowledged: the upload resumes there once there
  is room, and the version reads back whole.
- A client in a loop of refused uploads (a process of its own, as the trainer's record process) sees the store's
  status each time, and leaves no task or async generator of grpc's behind: its stderr has no "Task was destroyed
  but it is pending!" nor "Task exception was never retrieved ... aclose(): asynchronous generator is already
  running" (what flooded the trainer's log on the H100, one pair per failed stream).
- A store that dies mid-upload (a dropped connection, no status) is UNAVAILABLE: an outage, retried.
- On S3, a MinIO whose drives are full (HTTP 507, XMinioStorageFull) is refused the same way (RESOURCE_EXHAUSTED),
  and so is one that says so with HTTP 500 (MinIO's status for XMinioStorageFull before its 507; an InternalError
  whose message says the disk has no space left): the minio client's retries of a 500 end with its error
  document, read, not with urllib3's "too many 500 error responses". Any other 500 stays the S3 error it is.
  (No real MinIO can be made full here: these MinIOs are loopback HTTP servers answering MinIO's error
  documents, read by the real minio client.)
"""
from __future__ import annotations

import asyncio
import hashlib
import http.server
import os
import pathlib
import resource
import signal
import subprocess
import sys
import threading

import grpc
import grpc.aio
import pytest

from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES
from zerokl.services.weightstore import S3Backend, WeightStoreClient
from zerokl.services.weightstore.backends import StorageFull
from zerokl.v1 import weights_pb2, weights_pb2_grpc

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit (Linux) to fill the disk")]

# The store's files may grow to 1.5 chunks: the first chunk of a shard is stored, the second refused half way.
LIMIT = MAX_CHUNK_BYTES + MAX_CHUNK_BYTES // 2


def _store(root: pathlib.Path, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "serve", "weight-store", "--root", str(root),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("weight-store listening on "):
        proc.kill()
        raise AssertionError(f"the weight store did not start: {line!r}; see {log}")
    return proc, line.split()[3]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)
    if proc.stdout is not None:
        proc.stdout.close()


def _file_size_limit(pid: int, limit: int) -> None:
    """The store's writes past ``limit`` bytes of a file fail (EFBIG): its disk is as good as full."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit if limit != resource.RLIM_INFINITY else hard, hard))


def _source(directory: pathlib.Path, size: int) -> pathlib.Path:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(hashlib.sha256(b"w").digest() * (size // 32) + b"x" * (size % 32))
    (directory / "config.json").write_text('{"hidden_size": 16}')
    return directory


def test_a_store_with_no_room_refuses_writes_clearly_keeps_serving_and_the_upload_resumes(
        tmp_path: pathlib.Path) -> None:
    root, log = tmp_path / "w", tmp_path / "store.log"
    proc, address = _store(root, log)
    small = _source(tmp_path / "small", 1000)
    big = _source(tmp_path / "big", 3 * MAX_CHUNK_BYTES + 5)

    async def main() -> None:
        async with WeightStoreClient(address) as client:
            await client.publish(small, "v0")
            _file_size_limit(proc.pid, LIMIT)
            for _ in range(2):      # refused again: said to the caller each time, in the store's log once
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.publish(big, "v1")
                assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
                said = err.value.details()
                assert str(root.resolve()) in said and f"writing {MAX_CHUNK_BYTES} bytes" in said, said
                assert "File too large" in said, said

            # Every other call is served meanwhile.
            assert [e.manifest.version for e in await client.list()] == ["v0"]
            assert (await client.info()).weights_version == "v0"
            await client.fetch("v0", tmp_path / "read-v0")
            assert (tmp_path / "read-v0" / "model.safetensors").read_bytes() == \
                (small / "model.safetensors").read_bytes()
            assert (await client.pin("v0", "someone")).pinned_by == ("someone",)
            # What the store acknowledged stays, and nothing more (the chunk refused half way is not kept in part).
            upload = await client.begin_upload("v1")
            [shard] = [s for s in (await client.upload_status(upload.upload_id)).shards
                       if s.name == "model.safetensors"]
            assert (shard.received, shard.complete) == (MAX_CHUNK_BYTES, False)

            text = log.read_text()
            warnings = [line for line in text.splitlines() if " WARNING " in line]
            assert len(warnings) == 1 and "has no room" in warnings[0] and str(root.resolve()) in warnings[0], text
            assert "Traceback" not in text and "Unexpected" not in text, text

            # Room again: the upload goes on from the chunk the store holds, and the version reads back whole.
            _file_size_limit(proc.pid, resource.RLIM_INFINITY)
            probe = weights_pb2_grpc.WeightStoreStub(client.channel).PutShard()
            await probe.write(weights_pb2.PutShardRequest(header=weights_pb2.ShardHeader(
                upload_id=upload.upload_id, name="model.safetensors", size=shard.size, sha256=shard.sha256)))
            assert (await probe.read()).received == MAX_CHUNK_BYTES
            probe.cancel()
            manifest = await client.publish(big, "v1")
            assert manifest.shard("model.safetensors").size == 3 * MAX_CHUNK_BYTES + 5
            await client.fetch("v1", tmp_path / "read-v1")
            assert (tmp_path / "read-v1" / "model.safetensors").read_bytes() == (big / "model.safetensors").read_bytes()
    try:
        asyncio.run(main())
    finally:
        _stop(proc)


# A failing upload loop in a process of its own: the store refuses every PutShard. It prints the statuses it got and
# the tasks left on its loop; the garbage collector runs after each round, so what grpc leaves behind is found then
# (a generator it finds suspended is closed by a task of the loop's: a few turns of the loop end those).
_LOOP = r"""
import asyncio, collections, gc, sys
import grpc
from zerokl.services.weightstore import S3Backend, WeightStoreClient
from zerokl.services.weightstore.backends import StorageFull

async def main(address, path, rounds):
    codes = collections.Counter()
    async with WeightStoreClient(address) as client:
        upload = await client.begin_upload("loop")
        for _ in range(rounds):
            try:
                await client.put_shard(upload.upload_id, path)
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] += 1
            gc.collect()
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    print(dict(codes), len(left), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
gc.collect()
"""


def test_a_loop_of_refused_uploads_says_the_stores_status_and_leaves_nothing_of_grpc_behind(
        tmp_path: pathlib.Path) -> None:
    proc, address = _store(tmp_path / "w", tmp_path / "store.log")
    path = _source(tmp_path / "big", 4 * MAX_CHUNK_BYTES) / "model.safetensors"
    rounds = 30
    try:
        _file_size_limit(proc.pid, LIMIT)
        out = subprocess.run([sys.executable, "-c", _LOOP, address, str(path), str(rounds)], capture_output=True,
                             text=True, timeout=150)
    finally:
        _stop(proc)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["{'RESOURCE_EXHAUSTED':", f"{rounds}}}", "0"], (out.stdout, out.stderr[-3000:])
    for flood in ("Task was destroyed but it is pending", "Task exception was never retrieved",
                  "asynchronous generator is already running"):
        assert flood not in out.stderr, out.stderr[-3000:]


def test_a_store_gone_mid_upload_is_unavailable(tmp_path: pathlib.Path) -> None:
    proc, address = _store(tmp_path / "w", tmp_path / "store.log")
    path = _source(tmp_path / "big", 3 * MAX_CHUNK_BYTES) / "model.safetensors"

    async def main() -> None:
        async with WeightStoreClient(address) as client:
            upload = await client.begin_upload("gone")
            os.kill(proc.pid, signal.SIGSTOP)       # the upload hangs on the store...
            put = asyncio.ensure_future(client.put_shard(upload.upload_id, path))
            await asyncio.sleep(0.2)
            proc.kill()                             # ...which dies: the connection drops, no status comes
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await put
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value
            assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(30)
        _stop(proc)


class _FullMinio(http.server.BaseHTTPRequestHandler):
    """A MinIO whose drives are past their free-space threshold, as it answers on the wire: the bucket is there, and
    every object PUT is refused with HTTP ``status`` (507) and its ``code`` (XMinioStorageFull) error document."""

    status = 507
    code = "XMinioStorageFull"
    message = "Storage backend has reached its minimum free drive threshold. Please delete a few objects to proceed."

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_PUT(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{self.code}</Code><Message>{self.message}'
                '</Message><Key>k</Key><BucketName>weights</BucketName><Resource>/weights/k</Resource>'
                '<RequestId>1</RequestId><HostId>h</HostId></Error>').encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_full_minio_refuses_writes_as_resource_exhausted_too(tmp_path: pathlib.Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FullMinio)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"127.0.0.1:{server.server_address[1]}"
        backend = S3Backend(endpoint, "weights", "k", "s", secure=False, region="us-east-1")
        with pytest.raises(StorageFull) as err:     # (the store's every write is one: RESOURCE_EXHAUSTED to a caller)
            backend.put_bytes("uploads/0123/upload.json", b"{}")
        assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        said = err.value.message
        assert f"s3 bucket weights at {endpoint} has no room: writing 2 bytes of uploads/0123/upload.json" in said \
            and "XMinioStorageFull" in said, said
    finally:
        server.shutdown()
        server.server_close()


class _OldFullMinio(_FullMinio):
    """A MinIO of before its 507: XMinioStorageFull with HTTP 500 ("minimum free disk threshold")."""

    status = 500
    message = "Storage backend has reached its minimum free disk threshold. Please delete a few objects to proceed."


class _NoSpaceMinio(_FullMinio):
    """A MinIO whose drive filled below its threshold check: HTTP 500, InternalError, the disk's own words."""

    status = 500
    code = "InternalError"
    message = "We encountered an internal error, please try again. (cause: write /data/weights/k: no space left on device)"


class _BrokenMinio(_FullMinio):
    """A MinIO failing for another reason: HTTP 500, InternalError, nothing about room."""

    status = 500
    code = "InternalError"
    message = "We encountered an internal error, please try again. (cause: read quorum not met)"


def _put_to(answers: type[_FullMinio]) -> tuple[Exception, str]:
    """What S3Backend.put_bytes of 2 bytes raises against a MinIO answering as ``answers`` does, and its endpoint."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"127.0.0.1:{server.server_address[1]}"
        backend = S3Backend(endpoint, "weights", "k", "s", secure=False, region="us-east-1")
        with pytest.raises(Exception) as err:
            backend.put_bytes("uploads/0123/upload.json", b"{}")
        return err.value, endpoint
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("answers", [_OldFullMinio, _NoSpaceMinio], ids=["XMinioStorageFull", "no-space-left"])
def test_a_minio_saying_it_is_full_with_http_500_refuses_writes_as_resource_exhausted(
        answers: type[_FullMinio]) -> None:
    err, endpoint = _put_to(answers)
    assert isinstance(err, StorageFull), repr(err)
    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    said = err.message
    assert f"s3 bucket weights at {endpoint} has no room: writing 2 bytes of uploads/0123/upload.json" in said \
        and f"{answers.code}: {answers.message}" in said, said


def test_a_minio_500_for_another_reason_stays_its_s3_error() -> None:
    from minio.error import S3Error
    err, _ = _put_to(_BrokenMinio)
    assert isinstance(err, S3Error) and not isinstance(err, StorageFull), repr(err)
    assert (err.code, err.message) == (_BrokenMinio.code, _BrokenMinio.message)
