"""W3C trace context across real gRPC hops, and OTLP export to a loopback collector."""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent import futures

import grpc
import grpc.aio
import pytest
from echo_service import EchoClient, start_echo_server
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from zerokl.services.runtime import ServerOptions, ServiceServer, configure_tracing, create_channel


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def _spans(exporter: InMemorySpanExporter, n: int) -> list[ReadableSpan]:
    # Client spans end in a callback just after the call completes.
    for _ in range(200):
        spans = list(exporter.get_finished_spans())
        if len(spans) >= n:
            return spans
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {n} spans, got {[s.name for s in exporter.get_finished_spans()]}")


def _one(spans: list[ReadableSpan], name: str, kind: SpanKind) -> ReadableSpan:
    [span] = [s for s in spans if s.name == name and s.kind == kind]
    return span


def test_one_trace_spans_client_and_two_server_hops() -> None:
    async def main() -> None:
        provider, exporter = _provider()
        opts = ServerOptions(tracer_provider=provider)
        downstream = await start_echo_server(ServiceServer("decode", opts))
        down_channel = create_channel(downstream.address, tracer_provider=provider)
        upstream = await start_echo_server(ServiceServer("prefill", opts), relay=lambda: down_channel)
        async with create_channel(upstream.address, tracer_provider=provider) as ch:
            with provider.get_tracer("test").start_as_current_span("request") as root:
                assert await EchoClient(ch).unary("Relay")(b"kv", timeout=5) == b"kv"
            spans = await _spans(exporter, 5)
        await down_channel.close()
        await upstream.drain(0)
        await downstream.drain(0)

        relay_client = _one(spans, "zerokl.test.Echo/Relay", SpanKind.CLIENT)
        relay_server = _one(spans, "zerokl.test.Echo/Relay", SpanKind.SERVER)
        echo_client = _one(spans, "zerokl.test.Echo/Echo", SpanKind.CLIENT)
        echo_server = _one(spans, "zerokl.test.Echo/Echo", SpanKind.SERVER)
        assert {s.context.trace_id for s in spans} == {root.get_span_context().trace_id}
        assert relay_client.parent.span_id == root.get_span_context().span_id
        assert relay_server.parent.span_id == relay_client.context.span_id
        assert relay_server.parent.is_remote
        assert echo_client.parent.span_id == relay_server.context.span_id
        assert echo_server.parent.span_id == echo_client.context.span_id
        assert relay_server.attributes["rpc.method"] == "Relay"
        assert relay_server.attributes["rpc.grpc.status_code"] == 0
    asyncio.run(main())


def test_failed_and_streaming_calls_are_traced_with_their_status() -> None:
    async def main() -> None:
        provider, exporter = _provider()
        server = await start_echo_server(ServiceServer("trainer", ServerOptions(tracer_provider=provider)))
        async with create_channel(server.address, tracer_provider=provider) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await EchoClient(ch).unary("Fail")(b"x", timeout=5)
            assert len([m async for m in EchoClient(ch).stream("Count")(b"4", timeout=5)]) == 4
            spans = await _spans(exporter, 4)
        await server.drain(0)
        for kind in (SpanKind.CLIENT, SpanKind.SERVER):
            failed = _one(spans, "zerokl.test.Echo/Fail", kind)
            assert failed.status.status_code is StatusCode.ERROR
            assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            streamed = _one(spans, "zerokl.test.Echo/Count", kind)
            assert streamed.status.status_code is StatusCode.UNSET
        server_count = _one(spans, "zerokl.test.Echo/Count", SpanKind.SERVER)
        assert server_count.parent.span_id == _one(spans, "zerokl.test.Echo/Count", SpanKind.CLIENT).context.span_id
    asyncio.run(main())


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.got = threading.Event()

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        self.requests.append(request)
        self.got.set()
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_export_only_when_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(var, raising=False)
    assert configure_tracing("decode", set_global=False) is None

    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        provider = configure_tracing("decode", set_global=False)
        assert provider is not None
        with provider.get_tracer("test").start_as_current_span("decode-step"):
            pass
        provider.shutdown()  # flushes the batch
        assert collector.got.wait(10)
        [resource_spans] = collector.requests[0].resource_spans
        service_names = [a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"]
        assert service_names == ["zerokl-decode"]
        assert [s.name for ss in resource_spans.scope_spans for s in ss.spans] == ["decode-step"]
    finally:
        server.stop(0)


def test_a_client_cancelling_a_stream_leaves_no_detach_error_and_a_cancelled_span(caplog) -> None:
    """gRPC closes a cancelled stream from another context; the SERVER span must not be detached there
    (OpenTelemetry used to log "Failed to detach context" with a traceback after every cancel)."""
    async def main() -> list[ReadableSpan]:
        provider, exporter = _provider()
        server = await start_echo_server(ServiceServer("trainer", ServerOptions(tracer_provider=provider)))
        async with create_channel(server.address, tracer_provider=provider) as ch:
            for _ in range(3):
                call = EchoClient(ch).stream("Count")(b"100000000", timeout=5)
                async for i, _ in aenumerate(call):
                    if i == 20:
                        break
                call.cancel()
            spans = await _spans(exporter, 6)
        await server.drain(0)
        return spans

    async def aenumerate(it):  # noqa: ANN001, ANN202
        i = 0
        async for item in it:
            yield i, item
            i += 1

    with caplog.at_level(logging.ERROR):
        spans = asyncio.run(main())
    assert "Failed to detach context" not in caplog.text
    served = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(served) == 3
    assert all(s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0] for s in served)
