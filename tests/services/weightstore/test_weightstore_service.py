"""The WeightStore gRPC service over real loopback gRPC, on both backends."""
from __future__ import annotations

import asyncio
import hashlib
import pathlib
import signal
import subprocess
import sys
from typing import Awaitable, Callable

import grpc
import grpc.aio
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerokl.services.runtime import ServiceIdentity, ServiceServer, field_violations, status_details
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES, Chunk, chunk_to_proto, make_chunk
from zerokl.services.weightstore import VersionSpec, VersionStore, WeightStoreClient
from zerokl.services.weightstore.client import UploadBase
from zerokl.services.weightstore.backends import LocalDirBackend, S3Backend, StorageBackend
from zerokl.kernels.model.checkpoint import load_tensors
from zerokl.services.weightstore.server import backend_from_args, build_parser
from zerokl.services.weightstore.service import add_weight_store
from zerokl.v1 import weights_pb2, weights_pb2_grpc

IDENTITY = ServiceIdentity("weight-store", "ws-test")


def run(backend: StorageBackend, body: Callable[[WeightStoreClient, VersionStore, ServiceServer], Awaitable[None]],
        **store_kw: object) -> None:
    """Serve ``backend`` on a loopback port and run ``body`` against it."""
    async def main() -> None:
        store = VersionStore(backend, **store_kw)  # type: ignore[arg-type]
        server = ServiceServer("weight-store")
        add_weight_store(server, store, IDENTITY, watch_poll_s=0.2)
        await server.start()
        try:
            async with WeightStoreClient(server.address) as client:
                await body(client, store, server)
        finally:
            await server.drain(0)
    asyncio.run(main())


def tiny_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 16, generator=g)
    return {
        "model.embed_tokens.weight": emb,
        "model.layers.0.self_attn.q_a_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(4),
        "lm_head.weight": emb,  # tied
    }


CONFIG = {"model_type": "glm_moe_dsa", "hidden_size": 16, "vocab_size": 64}


def test_publish_state_dict_then_fetch_and_info(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        state = tiny_state(0)
        manifest = await client.publish(state, "step-0", step=0, numerics_version="0.1.0",
                                        numerics_fingerprint="fp-cpu", model_config=CONFIG,
                                        metadata={"run": "t"}, max_shard_bytes=2048)
        assert manifest.spec.step == 0 and manifest.spec.model_config == CONFIG
        assert len([s for s in manifest.shards if s.name.endswith(".safetensors")]) >= 2
        assert {s.name for s in manifest.shards} >= {"config.json", "model.safetensors.index.json"}
        fetched = await client.fetch("latest", tmp_path / "dst")
        assert fetched == manifest == (await client.manifest("step-0"))
        loaded = load_tensors(tmp_path / "dst")
        assert set(loaded) == set(state)
        assert all(torch.equal(loaded[k], state[k]) and loaded[k].dtype == state[k].dtype for k in state)
        info = await client.info()
        assert (info.weights_version, info.numerics_fingerprint, info.numerics_version) == ("step-0", "fp-cpu", "0.1.0")
        [entry] = await client.list()
        assert entry.manifest == manifest
        health = await health_pb2_grpc.HealthStub(client._channel).Check(health_pb2.HealthCheckRequest(
            service="zerokl.v1.WeightStore"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    run(backend, body)


def test_interrupted_put_resumes_from_the_last_stored_offset(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    big = bytes(range(251)) * (10 * 1024 * 1024 // 251)  # ~10 MiB: three chunks
    (src / "model-00001-of-00001.safetensors").write_bytes(big)
    (src / "config.json").write_text('{"hidden_size": 16}')

    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        upload = await client.begin_upload("v1")
        stub = weights_pb2_grpc.WeightStoreStub(client._channel)
        header = weights_pb2.PutShardRequest(header=weights_pb2.ShardHeader(
            upload_id=upload.upload_id, name="model-00001-of-00001.safetensors", size=len(big),
            sha256=hashlib.sha256(big).hexdigest()))
        call = stub.PutShard()
        await call.write(header)
        assert (await call.read()).received == 0
        for i in range(2):
            chunk = make_chunk(i * MAX_CHUNK_BYTES, big[i * MAX_CHUNK_BYTES:(i + 1) * MAX_CHUNK_BYTES], len(big))
            await call.write(weights_pb2.PutShardRequest(chunk=chunk_to_proto(chunk)))
            assert (await call.read()).received == (i + 1) * MAX_CHUNK_BYTES  # acknowledged = stored
        call.cancel()  # the connection dies mid-shard
        [shard] = (await client.upload_status(upload.upload_id)).shards
        assert (shard.received, shard.complete) == (2 * MAX_CHUNK_BYTES, False)
        # Nothing is visible before the commit.
        assert await client.list() == []
        # A re-sent chunk at the wrong offset is refused with the offset to use.
        retry = stub.PutShard()
        await retry.write(header)
        assert (await retry.read()).received == 2 * MAX_CHUNK_BYTES
        await retry.write(weights_pb2.PutShardRequest(chunk=chunk_to_proto(make_chunk(0, big[:10], len(big)))))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await retry.read()
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "expected 8388608" in err.value.details()
        status = await client.upload_dir(upload.upload_id, src)
        assert all(s.complete for s in status.shards)
        manifest = await client.commit(upload.upload_id, ["config.json", "model-00001-of-00001.safetensors"],
                                       VersionSpec(step=1))
        assert manifest.shard("model-00001-of-00001.safetensors").size == len(big)
        await client.fetch("v1", tmp_path / "dst")
        assert (tmp_path / "dst" / "model-00001-of-00001.safetensors").read_bytes() == big
    run(backend, body)


def test_a_watcher_sees_publishes_through_the_service_and_by_others(backend: StorageBackend,
                                                                    tmp_path: pathlib.Path) -> None:
    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        await client.publish(tiny_state(0), "v0")
        seen: list[str] = []
        got = asyncio.Event()

        async def watch() -> None:
            async for manifest in client.watch(include_existing=True):
                seen.append(manifest.version)
                if len(seen) == 3:
                    got.set()
        task = asyncio.ensure_future(watch())
        await asyncio.sleep(0.1)
        await client.publish(tiny_state(1), "v1")  # through the service: announced at once
        (tmp_path / "direct").mkdir()
        (tmp_path / "direct" / "config.json").write_text("{}")
        await asyncio.to_thread(store.publish_dir, tmp_path / "direct", "v2", VersionSpec())  # behind its back: polled
        await asyncio.wait_for(got.wait(), 10)
        assert seen == ["v0", "v1", "v2"]
        task.cancel()
    run(backend, body)


def test_watch_ends_unavailable_when_the_server_drains(backend: StorageBackend) -> None:
    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        async def watch() -> None:
            async for _ in client.watch():
                pass
        task = asyncio.ensure_future(watch())
        await asyncio.sleep(0.2)
        await server.drain(5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(task, 5)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    run(backend, body)


def test_corrupt_shard_fails_get_with_data_loss(backend: StorageBackend, corrupt: Callable[[str, bytes], None],
                                               tmp_path: pathlib.Path) -> None:
    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        manifest = await client.publish(tiny_state(0), "v1", model_config=CONFIG)
        name = next(s.name for s in manifest.shards if s.name.endswith(".safetensors"))
        key = f"versions/v1/{name}"
        data = bytearray(backend.read_bytes(key))
        data[100] ^= 0xFF
        corrupt(key, bytes(data))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.fetch("v1", tmp_path / "dst")
        assert err.value.code() is grpc.StatusCode.DATA_LOSS
        assert name in err.value.details()
        assert not (tmp_path / "dst" / name).exists()
        assert "zerokl_manifest.json" not in [p.name for p in (tmp_path / "dst").iterdir()]
        assert [e.manifest.version for e in await client.list()] == ["v1"]  # still serving
    run(backend, body)


def test_fetch_resumes_a_partial_file(backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        src = tmp_path / "src"
        src.mkdir()
        big = hashlib.sha256(b"x").digest() * (5 * 1024 * 1024 // 32)
        (src / "w.safetensors").write_bytes(big)
        await client.publish(src, "v1")
        dst = tmp_path / "dst"
        dst.mkdir()
        (dst / ".w.safetensors.partial").write_bytes(big[:MAX_CHUNK_BYTES + 7])
        # A resumed Get starts where asked.
        stub = weights_pb2_grpc.WeightStoreStub(client._channel)
        first = await anext(aiter(stub.Get(weights_pb2.GetRequest(version="v1", shard="w.safetensors",
                                                                   offset=MAX_CHUNK_BYTES + 7))))
        assert first.offset == MAX_CHUNK_BYTES + 7 and first.total_size == len(big)
        await client.fetch("v1", dst)
        assert (dst / "w.safetensors").read_bytes() == big
        assert not (dst / ".w.safetensors.partial").exists()
    run(backend, body)


async def _expect(code: grpc.StatusCode, coro: Awaitable[object], text: str = "") -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() is code, (err.value.code(), err.value.details())
    assert text in (err.value.details() or "")
    return err.value


def test_bad_input_gets_clear_statuses_and_the_service_keeps_serving(backend: StorageBackend,
                                                                     tmp_path: pathlib.Path) -> None:
    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        stub = weights_pb2_grpc.WeightStoreStub(client._channel)
        INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
        err = await _expect(INVALID, client.begin_upload("../etc"))
        assert [v.field for v in field_violations(err)] == ["version"]
        await _expect(INVALID, client.manifest(""))
        await _expect(NOT_FOUND, client.manifest("nope"), "nope")
        await _expect(NOT_FOUND, client.manifest("latest"), "no version")
        await _expect(INVALID, client.upload_status("x/../../y"), "upload id")
        await _expect(NOT_FOUND, client.upload_status("0" * 32))
        await _expect(NOT_FOUND, client.delete("nope"))
        await _expect(INVALID, client.pin("v1", ""))

        published = await client.publish(tiny_state(0), "v1")
        shard = published.shards[0]
        await _expect(grpc.StatusCode.ALREADY_EXISTS, client.begin_upload("v1"))
        await _expect(NOT_FOUND, anext(aiter(stub.Get(weights_pb2.GetRequest(version="v1", shard="nope")))))
        await _expect(INVALID, anext(aiter(stub.Get(weights_pb2.GetRequest(
            version="v1", shard=shard.name, offset=shard.size + 1)))), "offset")
        await _expect(INVALID, anext(aiter(stub.Get(weights_pb2.GetRequest(version="v1", shard="../../x")))))

        await client.pin("v1", "scheduler")
        err = await _expect(grpc.StatusCode.FAILED_PRECONDITION, client.delete("v1"), "pinned by scheduler")
        [failure] = status_details(err)
        assert isinstance(failure, error_details_pb2.PreconditionFailure)
        assert (failure.violations[0].type, failure.violations[0].subject) == ("PINNED", "v1")
        gc = await client.gc(keep_last=0)
        assert (gc.deleted, gc.kept_pinned) == ((), ("v1",))

        upload = await client.begin_upload("v2")
        header = weights_pb2.PutShardRequest(header=weights_pb2.ShardHeader(
            upload_id=upload.upload_id, name="a.bin", size=8, sha256=hashlib.sha256(b"abcdefgh").hexdigest()))

        async def put(*msgs: weights_pb2.PutShardRequest) -> weights_pb2.ShardStatus:
            """Send each message after the previous one's acknowledgement; the last status."""
            call = stub.PutShard()
            status = None
            for m in msgs:
                await call.write(m)
                status = await call.read()
            await call.done_writing()
            if status is None:
                await call.read()  # no message sent: the server's answer is the error
            return status

        def chunk(c: Chunk) -> weights_pb2.PutShardRequest:
            return weights_pb2.PutShardRequest(chunk=chunk_to_proto(c))

        await _expect(INVALID, put(chunk(make_chunk(0, b"abcd"))), "ShardHeader")
        await _expect(INVALID, put(), "ShardHeader")
        await _expect(INVALID, put(header, header), "header")
        await _expect(INVALID, put(header, chunk(make_chunk(4, b"efgh"))), "expected 0")
        await _expect(grpc.StatusCode.DATA_LOSS, put(header, chunk(Chunk(0, b"abcd", hashlib.sha256(b"abce").digest()))))
        await _expect(INVALID, put(header, chunk(make_chunk(0, b"x" * (MAX_CHUNK_BYTES + 1)))), "exceeds")
        await _expect(INVALID, put(header, chunk(make_chunk(0, b"abcdefghi"))), "past the blob")
        bad_sha = weights_pb2.PutShardRequest(header=weights_pb2.ShardHeader(
            upload_id=upload.upload_id, name="b.bin", size=1, sha256="not-hex"))
        await _expect(INVALID, put(bad_sha), "sha256")
        half = await put(header, chunk(make_chunk(0, b"abcd")))
        assert (half.received, half.complete) == (4, False)
        await _expect(grpc.StatusCode.FAILED_PRECONDITION,
                      client.commit(upload.upload_id, ["a.bin"], VersionSpec()), "a.bin incomplete")
        await _expect(INVALID, stub.Commit(weights_pb2.CommitRequest(
            upload_id=upload.upload_id, shards=["a.bin"], model_config_json="[1, 2]")), "JSON object")
        await _expect(INVALID, client.commit(upload.upload_id, [], VersionSpec()), "at least one shard")
        done = await put(header, chunk(make_chunk(4, b"efgh")))
        assert done.complete
        await _expect(grpc.StatusCode.FAILED_PRECONDITION, put(header, chunk(make_chunk(8, b""))), "already complete")
        v2 = await client.commit(upload.upload_id, ["a.bin"], VersionSpec(parent_version="v1"))
        assert v2.spec.parent_version == "v1"
        await _expect(NOT_FOUND, client.commit(upload.upload_id, ["a.bin"], VersionSpec()))
        # Still serving after all of that.
        assert [e.manifest.version for e in await client.list()] == ["v1", "v2"]
    run(backend, body)


def test_module_entry_point_serves_and_drains_on_sigterm(tmp_path: pathlib.Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerokl.services.weightstore", "--root", str(tmp_path / "w"), "--port", "0",
         "--metrics-port", "0", "--watch-poll", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("weight-store listening on 127.0.0.1:"), (line, proc.stderr.read())  # type: ignore[union-attr]
        address = line.split()[3]

        async def main() -> None:
            async with WeightStoreClient(address) as client:
                await client.publish(tiny_state(3), "v3", numerics_fingerprint="fp")
                assert (await client.info()).weights_version == "v3"
                watch = asyncio.ensure_future(anext(aiter(client.watch())))
                await asyncio.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(watch, 10)
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        asyncio.run(main())
        assert proc.wait(timeout=15) == 0
        assert (tmp_path / "w" / "manifests" / "v3.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_command_line_selects_the_backend(s3_endpoint: str, tmp_path: pathlib.Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    local = backend_from_args(parser.parse_args(["--root", str(tmp_path / "w")]))
    assert isinstance(local, LocalDirBackend) and local.root == (tmp_path / "w").resolve()
    args = parser.parse_args(["--s3-endpoint", s3_endpoint, "--s3-bucket", "cli-bucket", "--s3-insecure",
                              "--s3-region", "us-east-1"])
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("ZEROKL_S3_ACCESS_KEY", raising=False)
    with pytest.raises(SystemExit, match="credentials"):
        backend_from_args(args)
    monkeypatch.setenv("ZEROKL_S3_ACCESS_KEY", "k")
    monkeypatch.setenv("ZEROKL_S3_SECRET_KEY", "s")
    s3 = backend_from_args(args)
    assert isinstance(s3, S3Backend)
    s3.put_bytes("probe", b"ok")
    assert s3.read_bytes("probe") == b"ok"
    with pytest.raises(SystemExit, match="go together"):
        backend_from_args(parser.parse_args(["--s3-bucket", "b"]))


def test_a_directory_of_several_multi_chunk_files_uploads_with_chunks_in_flight_and_reads_back_exactly(
        backend: StorageBackend, tmp_path: pathlib.Path) -> None:
    """The client sends several files at once, each with chunks ahead of their acknowledgements (more
    chunks than the window), and the store stages each in place: what is fetched is byte for byte what
    was sent, every shard's sha256 in the manifest, nothing left of the uploads."""
    from zerokl.services.weightstore.client import CHUNKS_IN_FLIGHT
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(3)
    sizes = {"a.bin": (CHUNKS_IN_FLIGHT + 2) * MAX_CHUNK_BYTES + 5, "b.bin": MAX_CHUNK_BYTES, "empty.bin": 0,
             "c.bin": 3 * MAX_CHUNK_BYTES - 1}
    for name, size in sizes.items():
        (src / name).write_bytes(torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).numpy().tobytes())

    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        manifest = await client.publish(src, "big", model_config=CONFIG)
        want = {name: hashlib.sha256((src / name).read_bytes()).hexdigest() for name in sizes}
        assert {s.name: s.sha256 for s in manifest.shards} == want
        await client.fetch("big", tmp_path / "dst")
        assert all((tmp_path / "dst" / name).read_bytes() == (src / name).read_bytes() for name in sizes)
        assert store.backend.list("uploads/") == []
    run(backend, body)


def test_fetch_links_from_the_stores_directory_on_this_host(tmp_path: pathlib.Path) -> None:
    """`local_root` (a fleet whose store's directory is on the replica's disk: `zerokl up`): shards the store holds
    whole are hard-linked from it after their sha256 matched the manifest, not streamed into a second copy; the
    version stored as a delta streams; without `local_root` everything streams."""
    backend = LocalDirBackend(tmp_path / "store")

    async def body(client: WeightStoreClient, store: VersionStore, server: ServiceServer) -> None:
        src = tmp_path / "src"
        src.mkdir()
        big = hashlib.sha256(b"x").digest() * (3 * 1024 * 1024 // 32)
        (src / "model.safetensors").write_bytes(big)
        (src / "config.json").write_text("{}")
        await client.publish(src, "v1")
        held = backend.root / "versions" / "v1" / "model.safetensors"
        await client.fetch("v1", tmp_path / "linked", local_root=backend.root)
        assert (tmp_path / "linked" / "model.safetensors").stat().st_ino == held.stat().st_ino
        await client.fetch("v1", tmp_path / "copied")
        assert (tmp_path / "copied" / "model.safetensors").stat().st_ino != held.stat().st_ino
        assert (tmp_path / "copied" / "model.safetensors").read_bytes() == big
        # A later version stored as a delta has no whole file to link: streamed, decoded, checked.
        changed = bytearray(big)
        changed[10] ^= 1
        src2 = tmp_path / "src2"
        src2.mkdir()
        (src2 / "model.safetensors").write_bytes(bytes(changed))
        (src2 / "config.json").write_text("{}")
        manifest = await client.publish(src2, "v2", base=UploadBase(await client.manifest("v1"), tmp_path / "copied"))
        assert manifest.shard("model.safetensors").base == "v1"
        await client.fetch("v2", tmp_path / "v2", local_root=backend.root)
        assert (tmp_path / "v2" / "model.safetensors").read_bytes() == bytes(changed)
        # The store's file rewritten in place (bit rot, a hand edit: the linked copy changes with it): the fetch
        # does not take the link but asks the store, whose DATA_LOSS the caller sees as from a streamed fetch.
        rotten = bytearray(big)
        rotten[len(rotten) // 2] ^= 0xFF
        held.write_bytes(bytes(rotten))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.fetch("v1", tmp_path / "linked", local_root=backend.root)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
    run(backend, body)


class _StoreEndingUploads(weights_pb2_grpc.WeightStoreServicer):
    """A store that takes a PutShard's header, acknowledges it, takes the first chunk, then ends the stream with an
    error status while the client still has chunks in flight (the client's writes meet a finished call, or race its
    end in core): UNAVAILABLE as one going away mid-upload, or RESOURCE_EXHAUSTED as one whose disk is full."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details

    async def PutShard(self, request_iterator, context):  # noqa: ANN001, ANN201, N802 - gRPC's name
        header = (await context.read()).header
        await context.write(weights_pb2.ShardStatus(name=header.name, size=header.size, received=0))
        await context.read()
        await context.abort(self.code, self.details)


@pytest.mark.parametrize("code, details", [(grpc.StatusCode.UNAVAILABLE, "the store is going away"),
                                           (grpc.StatusCode.RESOURCE_EXHAUSTED, "the store has no room")])
def test_a_store_ending_an_upload_mid_stream_is_raised_as_the_status_it_sent(
        tmp_path: pathlib.Path, code: grpc.StatusCode, details: str) -> None:
    # A write to a call the server has ended raises asyncio.InvalidStateError ("RPC already finished"); one racing its
    # end fails in core, and grpc then replaces the status the server sent with INTERNAL "Internal error from Core"
    # (the call's code() and a read after say INTERNAL). The client raises the status the store sent, every time: a
    # full store's RESOURCE_EXHAUSTED must not reach the trainer as an outage (UNAVAILABLE) it retries forever.
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * (12 * MAX_CHUNK_BYTES // 256))    # chunks in flight when the store ends it

    async def main() -> None:
        # A chunk (4 MiB and its envelope) is over grpc's default 4 MiB message limit: the store's own limit.
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2 * MAX_CHUNK_BYTES)])
        weights_pb2_grpc.add_WeightStoreServicer_to_server(_StoreEndingUploads(code, details), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with WeightStoreClient(f"127.0.0.1:{port}") as client:
                for _ in range(60):     # the read meets the status, or a write meets the finished or ending call
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.put_shard("u1", path)
                    assert (err.value.code(), err.value.details()) == (code, details)
        finally:
            await server.stop(0)
    asyncio.run(main())
