"""OpenTelemetry tracing: OTLP export and W3C trace context across gRPC hops.

:func:`configure_tracing` exports spans over OTLP/gRPC when
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-specific variable) is set and
does nothing otherwise, so the embedded default costs nothing. The two
interceptors carry the ``traceparent`` header in gRPC metadata: the client
side opens a CLIENT span and injects it, the server side extracts it and runs
the handler inside a SERVER span that is its child, and the handler's own
outgoing calls (e.g. prefill -> decode) continue the same trace.
"""
from __future__ import annotations

import asyncio
import inspect
import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from zerokl.services.runtime.auth import HEALTH_METHOD_PREFIX
from zerokl.services.runtime.interceptors import (ClientInterceptor, method_behavior_attr, replace_behavior,
                                                  with_metadata, wrap_handler)

__all__ = [
    "OTLP_ENDPOINT_ENVS",
    "REQUEST_ID_ATTRIBUTE",
    "configure_tracing",
    "tag_request",
    "TracingServerInterceptor",
    "TracingClientInterceptor",
]

OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_TRACER_NAME = "zerokl.services"
# W3C Trace Context, fixed rather than taken from OTEL_PROPAGATORS: every hop
# must speak the same header or the trace silently breaks in two.
_PROPAGATOR = TraceContextTextMapPropagator()


def configure_tracing(service_name: str, *, environ: Mapping[str, str] | None = None,
                      set_global: bool = True) -> TracerProvider | None:
    """Set up OTLP span export for ``service_name``; None when no endpoint is configured.

    The exporter reads the standard ``OTEL_EXPORTER_OTLP_*`` variables
    (endpoint, ``..._INSECURE``, headers). ``OTEL_SERVICE_NAME`` overrides the
    default resource name ``zerokl-<service>``. Call ``shutdown()`` on the
    result before exiting so batched spans are flushed.
    """
    env = os.environ if environ is None else environ
    if not any(env.get(k) for k in OTLP_ENDPOINT_ENVS):
        return None
    # Imported here: the exporter pulls in its own gRPC stubs, unneeded when off.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    name = env.get("OTEL_SERVICE_NAME") or f"zerokl-{service_name}"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


REQUEST_ID_ATTRIBUTE = "zerokl.request_id"


def tag_request(request_id: str) -> None:
    """Put the request id on the current span (the handler's SERVER span), so Jaeger finds
    every hop of one request by tag: the scheduler and each replica tag theirs."""
    if request_id:
        trace.get_current_span().set_attribute(REQUEST_ID_ATTRIBUTE, request_id)


def _tracer(provider: trace.TracerProvider | None) -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME, tracer_provider=provider)


def _split_method(full: str) -> tuple[str, str]:
    """'/zerokl.v1.WeightStore/Get' -> ('zerokl.v1.WeightStore', 'Get')."""
    service, _, method = full.lstrip("/").partition("/")
    return service, method


def _rpc_attributes(full_method: str) -> dict[str, str]:
    service, method = _split_method(full_method)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _record_code(span: Span, code: grpc.StatusCode | None) -> None:
    code = code or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Runs each handler in a SERVER span parented by the caller's ``traceparent``.

    Health checks are not traced: probes every few seconds would drown the
    traces people look for.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None,
                 skip_prefixes: tuple[str, ...] = (HEALTH_METHOD_PREFIX,)) -> None:
        self._provider = tracer_provider
        self._skip = skip_prefixes

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._skip):
            return handler
        tracer = _tracer(self._provider)
        carrier = {k: v for k, v in (handler_call_details.invocation_metadata or ()) if isinstance(v, str)}
        parent = _PROPAGATOR.extract(carrier)

        name, attributes = method.lstrip("/"), _rpc_attributes(method)

        @asynccontextmanager
        async def around(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            with tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes,
                                              record_exception=False, set_status_on_exception=False) as span:
                try:
                    yield
                except BaseException as exc:
                    _record_failure(span, context, exc)
                    raise
                _record_code(span, context.code())

        behavior = getattr(handler, method_behavior_attr(handler))
        if not inspect.isasyncgenfunction(behavior):
            return wrap_handler(handler, around)

        async def streamed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # The span is current only while the handler computes an item, never across a yield: gRPC may
            # close a cancelled stream from another context, where detaching the span's context would fail
            # (OpenTelemetry's "Failed to detach context" traceback after every client cancel).
            span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
            current = trace.set_span_in_context(span, parent)
            items = behavior(request, context)
            try:
                while True:
                    token = otel_context.attach(current)
                    try:
                        item = await anext(items)
                    except StopAsyncIteration:
                        break
                    finally:
                        otel_context.detach(token)
                    yield item
            except BaseException as exc:
                _record_failure(span, context, exc)
                raise
            else:
                _record_code(span, context.code())
            finally:
                await items.aclose()
                span.end()
        return replace_behavior(handler, streamed)


def _record_failure(span: Span, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """A handler raised: context.abort() raises, and the code it set is the truth; any other exception
    becomes UNKNOWN on the wire (recorded on the span), a cancellation CANCELLED."""
    code = context.code() if context.code() is not None else grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        code = grpc.StatusCode.CANCELLED
    elif code is grpc.StatusCode.UNKNOWN:
        span.record_exception(exc)
    _record_code(span, code)


class TracingClientInterceptor(ClientInterceptor):
    """Opens a CLIENT span per call and sends its W3C ``traceparent`` in metadata.

    The span is a child of whatever span is current where the call is made,
    so a server handler's outgoing calls continue the incoming trace.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._provider = tracer_provider
        # Finishing a span needs an await (the aio call's code()), done in a
        # task; keeping references stops the loop from dropping them mid-way.
        self._finishing: set[asyncio.Task[None]] = set()

    async def intercept(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        span = _tracer(self._provider).start_span(method.lstrip("/"), kind=SpanKind.CLIENT,
                                                  attributes=_rpc_attributes(method))
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, otel_context.get_current()))
        try:
            call = await continuation(with_metadata(details, carrier.items()), request)
        except BaseException:
            _record_code(span, grpc.StatusCode.UNKNOWN)
            span.end()
            raise

        def done(finished: Any) -> None:
            task = asyncio.ensure_future(self._finish(span, finished))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)
        call.add_done_callback(done)
        return call

    @staticmethod
    async def _finish(span: Span, call: Any) -> None:
        try:
            code = await call.code()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
        _record_code(span, code)
        span.end()
