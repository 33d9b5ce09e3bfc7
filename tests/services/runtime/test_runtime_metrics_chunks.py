"""The zerokl_ metrics over real HTTP, and checksummed chunking."""
from __future__ import annotations

import hashlib
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from zerokl.services.runtime import (
    MAX_CHUNK_BYTES,
    ChunkAssembler,
    DataLoss,
    InvalidArgument,
    ServiceIdentity,
    chunk_from_proto,
    chunk_to_proto,
    chunks_from_pieces,
    set_serving_info,
    split_bytes,
    start_metrics_server,
)
from zerokl.services.runtime import metrics
from zerokl.services.runtime.chunks import Chunk, make_chunk


def test_a_counted_observation_is_that_many_observations() -> None:
    registry = CollectorRegistry()
    one_by_one = metrics.CountedHistogram("one_by_one_seconds", "x", (0.01, 0.1), registry)
    counted = metrics.CountedHistogram("counted_seconds", "x", (0.01, 0.1), registry)
    for value in (0.01, 0.01, 0.01, 0.05, 2.0):
        one_by_one.observe(value)
    counted.observe(0.01, 3)
    counted.observe(0.05)
    counted.observe(2.0)
    samples = {s.name.split("_seconds")[1] + str(s.labels): s.value
               for m in registry.collect() for s in m.samples if s.name.startswith("one_by_one")}
    assert samples == {s.name.split("_seconds")[1] + str(s.labels): s.value
                       for m in registry.collect() for s in m.samples if s.name.startswith("counted")}
    assert samples["_bucket{'le': '0.01'}"] == 3 and samples["_count{}"] == 5   # an upper bound is inclusive


def test_metrics_endpoint_exports_the_standard_metrics() -> None:
    server = start_metrics_server(0)
    try:
        metrics.TIME_TO_FIRST_TOKEN.observe(0.03)
        metrics.INTER_TOKEN_LATENCY.observe(0.004)
        metrics.E2E_REQUEST_LATENCY.observe(1.2)
        metrics.REQUESTS_RUNNING.set(3)
        metrics.REQUESTS_WAITING.set(1)
        metrics.KV_CACHE_USAGE.set(0.25)
        metrics.PROMPT_TOKENS.inc(11)
        metrics.GENERATION_TOKENS.inc(7)
        set_serving_info(ServiceIdentity("decode", "decode-0", numerics_version="0.1.0",
                                         numerics_fingerprint="f00d", weights_version="v3"))
        set_serving_info(ServiceIdentity("decode", "decode-0", numerics_version="0.1.0",
                                         numerics_fingerprint="f00d", weights_version="v4"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    finally:
        server.close()
    for line in ("zerokl_time_to_first_token_seconds_bucket{le=\"0.04\"}",
                 "zerokl_inter_token_latency_seconds_count",
                 "zerokl_e2e_request_latency_seconds_sum",
                 "zerokl_num_requests_running 3.0",
                 "zerokl_num_requests_waiting 1.0",
                 "zerokl_kv_cache_usage_ratio 0.25",
                 "zerokl_prompt_tokens_total",
                 "zerokl_generation_tokens_total",
                 "process_cpu_seconds_total"):
        assert line in text, line
    [info] = [ln for ln in text.splitlines() if ln.startswith("zerokl_serving_info{")]
    assert 'weights_version="v4"' in info and 'numerics_fingerprint="f00d"' in info
    # Only zerokl's own metrics and process stats: nothing from other libraries' global registries.
    names = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert all(n.startswith(("zerokl_", "process_", "python_info")) for n in names), names


@given(st.binary(max_size=3000), st.integers(1, 700), st.data())
def test_split_and_reassemble_round_trip(data: bytes, chunk_size: int, draw: st.DataObject) -> None:
    start = draw.draw(st.integers(0, len(data)))
    chunks = list(split_bytes(data, start=start, chunk_size=chunk_size))
    assert all(len(c.data) <= chunk_size for c in chunks)
    assert chunks[0].offset == start and chunks[-1].end == len(data)
    asm = ChunkAssembler(prefix=data[:start])  # resuming: the receiver holds the prefix
    for c in chunks:
        asm.add(chunk_from_proto(chunk_to_proto(c)))
    assert asm.complete and asm.value() == data


def test_empty_blob_is_one_empty_chunk() -> None:
    [c] = list(split_bytes(b""))
    assert (c.offset, c.data, c.total_size) == (0, b"", 0)
    asm = ChunkAssembler()
    asm.add(c)
    assert asm.value() == b""


def test_default_chunks_are_4_mib() -> None:
    data = bytes(range(256)) * (9 * 1024 * 1024 // 256)
    chunks = list(chunks_from_pieces([data[:1000], data[1000:]], total_size=len(data)))
    assert [len(c.data) for c in chunks] == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, len(data) - 2 * MAX_CHUNK_BYTES]
    assert all(c.sha256 == hashlib.sha256(c.data).digest() for c in chunks)


def test_bad_chunks_are_refused() -> None:
    asm = ChunkAssembler(total_size=10)
    with pytest.raises(InvalidArgument, match="expected 0"):
        asm.add(make_chunk(4, b"abcd"))
    with pytest.raises(DataLoss, match="sha256"):
        asm.add(Chunk(0, b"abcd", hashlib.sha256(b"abce").digest()))
    with pytest.raises(InvalidArgument, match="past the blob"):
        asm.add(make_chunk(0, b"x" * 11))
    with pytest.raises(InvalidArgument, match="total_size"):
        asm.add(make_chunk(0, b"abcd", total_size=12))
    with pytest.raises(InvalidArgument, match="exceeds"):
        ChunkAssembler().add(make_chunk(0, b"x" * (MAX_CHUNK_BYTES + 1)))
    asm.add(make_chunk(0, b"abcd"))
    with pytest.raises(DataLoss, match="incomplete"):
        asm.value()
