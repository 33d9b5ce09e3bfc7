"""Small grpc.aio interceptor building blocks shared by auth, tracing and errors.

A grpc.aio server interceptor only gets to choose the method handler; to run
code around the call itself it must replace the handler's behaviour.
:func:`wrap_handler` does that once for all four call shapes, so each concern
is written as one async context manager. :class:`ClientInterceptor` likewise
folds the four client interceptor interfaces into one ``intercept`` method.
"""
from __future__ import annotations

import abc
import inspect
from contextlib import AbstractAsyncContextManager
from typing import Any, Callable, Iterable

import grpc
import grpc.aio

from zerokl.services.runtime.errors import ResourceExhausted, ServiceError, abort

__all__ = [
    "Around",
    "wrap_handler",
    "replace_behavior",
    "method_behavior_attr",
    "ErrorInterceptor",
    "ClientInterceptor",
    "channel_interceptors",
    "MetadataClientInterceptor",
    "with_metadata",
]

#: Given the servicer context, an async context manager entered around the call.
Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[Any]]


def method_behavior_attr(handler: grpc.RpcMethodHandler) -> str:
    """Name of the handler field holding the behaviour (``unary_unary`` ...)."""
    req = "stream" if handler.request_streaming else "unary"
    resp = "stream" if handler.response_streaming else "unary"
    return f"{req}_{resp}"


def replace_behavior(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """The same handler (serializers, shape) running ``behavior`` instead."""
    return handler._replace(**{method_behavior_attr(handler): behavior})  # type: ignore[attr-defined]


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """Run every call of ``handler`` inside ``around(context)``.

    Response-streaming servicer methods written as async generators stay async
    generators, so the context manager spans the whole stream, not just its
    creation.
    """
    behavior = getattr(handler, method_behavior_attr(handler))
    if inspect.isasyncgenfunction(behavior):
        async def wrapped_gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(context):
                async for item in behavior(request, context):
                    yield item
        return replace_behavior(handler, wrapped_gen)

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with around(context):
            return await behavior(request, context)
    return replace_behavior(handler, wrapped)


def _out_of_memory(exc: BaseException) -> bool:
    """``exc`` is torch's OutOfMemoryError (by its class: the weight store's server never imports torch)."""
    return any(c.__name__ == "OutOfMemoryError" and c.__module__.startswith("torch") for c in type(exc).__mro__)


class _ErrorsToStatus:
    """Async context manager: a :class:`ServiceError` escaping the call aborts it richly; so does a device running
    out of memory, as RESOURCE_EXHAUSTED with torch's message (the device, the bytes asked for, what is free)
    instead of UNKNOWN "Unexpected <class ...>"."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, ServiceError):
            await abort(self._context, exc)
        if exc is not None and _out_of_memory(exc):
            said = (exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)).strip().splitlines()
            what = said[0] if said else type(exc).__name__
            await abort(self._context, ResourceExhausted(f"out of device memory: {what}"))
        return False


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns :class:`ServiceError` raised by servicers into rich gRPC statuses.

    Servicers (and the libraries under them) raise; this one place reports, so
    no handler repeats the mapping.
    """

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        return None if handler is None else wrap_handler(handler, _ErrorsToStatus)


def with_metadata(details: grpc.aio.ClientCallDetails, extra: Iterable[tuple[str, str]]) -> grpc.aio.ClientCallDetails:
    """Client call details with ``extra`` metadata appended."""
    md = grpc.aio.Metadata(*(tuple(details.metadata or ())))
    for key, value in extra:
        md.add(key, value)
    return details._replace(metadata=md)  # type: ignore[attr-defined]


class ClientInterceptor(abc.ABC):
    """Base for client interceptors that treat all four call shapes alike.

    Subclasses implement :meth:`intercept`; it receives the continuation, the
    call details and the request (or request iterator) and returns the call.
    Install with :func:`channel_interceptors`.
    """

    @abc.abstractmethod
    async def intercept(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        """Start the call through ``continuation(details, request)`` and return it."""


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, inner: ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._inner.intercept(continuation, client_call_details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, inner: ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._inner.intercept(continuation, client_call_details, request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, inner: ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await self._inner.intercept(continuation, client_call_details, request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, inner: ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await self._inner.intercept(continuation, client_call_details, request_iterator)


def channel_interceptors(*interceptors: ClientInterceptor) -> list[Any]:
    """The ``interceptors=`` list for a grpc.aio channel, outermost first.

    grpc.aio files an interceptor object under the first call shape it
    implements only, so one object implementing all four would silently skip
    streaming calls; each interceptor is installed as four single-shape
    adapters instead.
    """
    return [adapter(i) for i in interceptors for adapter in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class MetadataClientInterceptor(ClientInterceptor):
    """Adds fixed metadata (e.g. ``authorization``) to every outgoing call."""

    def __init__(self, metadata: Iterable[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    async def intercept(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(with_metadata(details, self._metadata), request)
