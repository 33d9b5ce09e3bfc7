"""The HTTP edge: Tinker's REST routes (Starlette), auth, errors, metrics and traces.

Every route parses its body with convert.py, calls :class:`~zerokl.services.tinker_api.service.TinkerService`
and answers in the shape the official ``tinker`` SDK (0.38) reads: JSON, or protobuf for a forward's
and a sample's results. Errors are JSON ``{"detail", "code", "field_violations"}`` with the status the
SDK turns into its exception without retrying: 400 for a bad request or a state the caller can fix,
401 a bad API key, 404 an unknown model, session or request; 503 (retried by the SDK) when a service
behind the endpoint is unavailable. A failed call's future answers ``{"error", "category"}``, which
the SDK raises as ``RequestFailedError``.

Auth: with a client token configured (``zerokl up --auth-token``), the SDK's API key
(``TINKER_API_KEY``, sent as ``X-API-Key``) must be ``tml-<client token>`` (the SDK requires the
``tml-`` prefix) or the token itself; the operator token is accepted too. Keys are compared in
constant time and never logged. ``/api/v1/healthz`` needs none (probes carry no key).
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zerokl.services.runtime.auth import AuthConfig
from zerokl.services.runtime.errors import InvalidArgument, ServiceError
from zerokl.services.runtime.metrics import REGISTRY
from zerokl.services.tinker_api import convert
from zerokl.services.tinker_api.service import SessionFinished, TinkerService
from zerokl.services.tinker_api.types import ForwardBackwardOutcome, FutureFailure, SampleOutcome

__all__ = ["CLIENT_CONFIG", "build_app", "api_key_matches"]

log = logging.getLogger(__name__)

HTTP_REQUESTS = Counter("zerokl_tinker_http_requests", "HTTP requests to the Tinker endpoint, by route and status.",
                        ["route", "status"], registry=REGISTRY)
HTTP_SECONDS = Histogram("zerokl_tinker_http_request_seconds", "Time to answer an HTTP request (a retrieve_future "
                         "long-polls up to its wait), by route.", ["route"], registry=REGISTRY)

#: The feature flags the SDK fetches once (/api/v1/client/config): API keys (no JWT exchange), plain
#: httpx transport, uncompressed protobuf forward_backward bodies, custom losses client-side (the SDK
#: runs forward, differentiates the loss and sends the gradient back as cross_entropy weights).
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                 "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True, "custom_loss_server_side": False,
                 "sample_use_retrieve_futures": False, "sample_join_sampling_session": False}
_DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False}
_PROTOBUF = "application/x-protobuf"
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
                grpc.StatusCode.ALREADY_EXISTS: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
                grpc.StatusCode.RESOURCE_EXHAUSTED: 400, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 503}
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER = "zerokl.services.tinker_api"


def api_key_matches(key: str | None, auth: AuthConfig) -> bool:
    """Whether ``key`` is a credential the endpoint accepts (always, with auth off)."""
    if not auth.enabled:
        return True
    if not key:
        return False
    accepted = [t for t in (auth.client_token, auth.operator_token) if t]
    candidates = {key, key.removeprefix("tml-")}
    return any(hmac.compare_digest(c.encode(), t.encode()) for c in candidates for t in accepted)


def _error(status: int, detail: str, code: str, violations: list[dict[str, str]] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail, "code": code, "field_violations": violations or []}, status_code=status)


def _error_response(err: BaseException) -> JSONResponse:
    if isinstance(err, SessionFinished):
        return _error(410, err.message, "SESSION_FINISHED")
    if isinstance(err, ServiceError):
        return _error(_HTTP_STATUS.get(err.code, 500), err.message, err.code.name,
                      [{"field": v.field, "description": v.description} for v in err.field_violations])
    if isinstance(err, grpc.aio.AioRpcError):
        return _error(_HTTP_STATUS.get(err.code(), 500), err.details() or err.code().name, err.code().name)
    log.exception("tinker: unexpected error")
    return _error(500, f"{type(err).__name__}: {err}", "INTERNAL")


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as err:
        raise InvalidArgument.field("body", f"not JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidArgument.field("body", "expected a JSON object")
    return body


def build_app(service: TinkerService, auth: AuthConfig = AuthConfig(), *,
              tracer_provider: trace.TracerProvider | None = None, max_body_bytes: int = 256 * 1024 * 1024
              ) -> Starlette:
    """The ASGI app serving ``service`` (mount it on uvicorn)."""
    tracer = trace.get_tracer(_TRACER, tracer_provider=tracer_provider)

    def route(path: str, handler: Callable[[Request], Awaitable[Any]], method: str = "POST") -> Route:
        """``handler``'s result as JSON (a Response as it is), inside auth, a span, metrics and the error map."""
        async def endpoint(request: Request) -> Response:
            start = time.perf_counter()
            parent = _PROPAGATOR.extract(dict(request.headers))
            token = otel_context.attach(parent)
            status = 500
            try:
                with tracer.start_as_current_span(f"{method} {path}", kind=SpanKind.SERVER,
                                                  attributes={"http.request.method": method, "http.route": path}) as span:
                    response = await _answer(request)
                    status = response.status_code
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, str(status)))
                    return response
            finally:
                otel_context.detach(token)
                HTTP_REQUESTS.labels(path, str(status)).inc()
                HTTP_SECONDS.labels(path).observe(time.perf_counter() - start)

        async def _answer(request: Request) -> Response:
            if path != "/api/v1/healthz" and not api_key_matches(request.headers.get("x-api-key"), auth):
                return _error(401, "invalid or missing API key: set TINKER_API_KEY=tml-<the cluster's client "
                                   "token>", "UNAUTHENTICATED")
            size = int(request.headers.get("content-length") or 0)
            if size > max_body_bytes:
                return _error(413, f"a {size}-byte body exceeds this endpoint's limit of {max_body_bytes}",
                              "RESOURCE_EXHAUSTED")
            try:
                result = await handler(request)
            except Exception as err:  # noqa: BLE001 - every error is an answer; the endpoint keeps serving
                return _error_response(err)
            return result if isinstance(result, Response) else JSONResponse(result)

        return Route(path, endpoint, methods=[method])

    async def healthz(request: Request) -> dict[str, Any]:
        return {"status": "ok"}

    async def capabilities(request: Request) -> dict[str, Any]:
        return service.capabilities()

    async def client_config(request: Request) -> dict[str, Any]:
        return CLIENT_CONFIG

    async def dynamic_config(request: Request) -> dict[str, Any]:
        return _DYNAMIC_CONFIG

    async def create_session(request: Request) -> dict[str, Any]:
        body = await _json(request)
        return {"type": "create_session", "session_id": service.create_session(body.get("user_metadata") or {})}

    async def heartbeat(request: Request) -> dict[str, Any]:
        body = await _json(request)
        service.heartbeat(str(body.get("session_id", "")))
        return {"type": "session_heartbeat"}

    async def finish_session(request: Request) -> Response:
        body = await _json(request)
        reason = body.get("reason") or {}
        service.finish_session(request.path_params["session_id"], str(reason.get("type", "success")))
        return Response(status_code=200, content=b"null", media_type="application/json")

    async def create_model(request: Request) -> dict[str, Any]:
        request_id, model_id = service.create_model(convert.model_spec_from_json(await _json(request)))
        return {"request_id": request_id, "model_id": model_id}

    async def get_info(request: Request) -> dict[str, Any]:
        return service.run_info(str((await _json(request)).get("model_id", "")))

    def ordered(model_id: Any, seq_id: Any, submit: Callable[[], str]) -> dict[str, Any]:
        """A model's numbered call: submitted, or (refused) its number passed over so later calls go on."""
        try:
            return {"request_id": submit(), "model_id": model_id}
        except Exception:
            if isinstance(model_id, str) and isinstance(seq_id, int):
                service.reject(model_id, seq_id)
            raise

    async def forward_backward(request: Request) -> dict[str, Any]:
        body = await request.body()
        ids = convert.call_ids_from_proto(body)

        def submit() -> str:
            encoding = request.headers.get("content-encoding", "identity")
            if encoding != "identity":
                raise InvalidArgument.field("Content-Encoding", f"{encoding!r}: send the body uncompressed (this "
                                                                "endpoint's client config has proto_compress_fwdbwd "
                                                                "off)")
            if not request.headers.get("content-type", "").startswith(_PROTOBUF):
                raise InvalidArgument.field("Content-Type", f"expected {_PROTOBUF} (a ForwardBackwardRequest)")
            return service.submit_forward_backward(convert.forward_backward_from_proto(body))
        return ordered(*ids, submit)

    async def optim_step(request: Request) -> dict[str, Any]:
        body = await _json(request)
        return ordered(body.get("model_id"), body.get("seq_id"),
                       lambda: service.submit_optim_step(convert.optim_step_from_json(body)))

    def save(kind: str) -> Callable[[Request], Awaitable[dict[str, Any]]]:
        async def handler(request: Request) -> dict[str, Any]:
            body = await _json(request)
            return ordered(body.get("model_id"), body.get("seq_id"),
                           lambda: service.submit_save(convert.save_from_json(body, kind)))
        return handler

    async def load_weights(request: Request) -> dict[str, Any]:
        body = await _json(request)
        if body.get("model_id") is None:           # a new model from a checkpoint: no order yet
            request_id, model_id = service.submit_load(convert.load_from_json(body))
            return {"request_id": request_id, "model_id": model_id}
        return ordered(body.get("model_id"), body.get("seq_id"),
                       lambda: service.submit_load(convert.load_from_json(body))[0])

    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await _json(request)
        sampling_session_id = service.create_sampling_session(str(body.get("session_id", "")), body.get("base_model"),
                                                              body.get("model_path"))
        return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}

    async def join_sampling_session(request: Request) -> dict[str, Any]:
        body = await _json(request)
        return {"type": "join_sampling_session",
                "client_counter": service.join_sampling_session(str(body.get("sampling_session_id", "")))}

    async def sampler(request: Request) -> dict[str, Any]:
        return service.sampler_info(request.path_params["sampler_id"])

    async def asample(request: Request) -> dict[str, Any]:
        call = convert.sample_from_json(await _json(request), secrets.randbelow(2**63))
        request_id, sequence_ids = service.submit_sample(call)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    async def retrieve_future(request: Request) -> Response | dict[str, Any]:
        request_id = str((await _json(request)).get("request_id", ""))
        done, result = await service.retrieve(request_id)
        if not done:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if isinstance(result, FutureFailure):
            return {"error": result.message, "category": result.category}
        if isinstance(result, (ForwardBackwardOutcome, SampleOutcome)):
            if _PROTOBUF not in request.headers.get("accept", ""):
                raise InvalidArgument.field("Accept", f"this result is served as {_PROTOBUF} only")
            body = (convert.forward_backward_output_to_proto(result) if isinstance(result, ForwardBackwardOutcome)
                    else convert.sample_response_to_proto(result))
            return Response(body, media_type=_PROTOBUF)
        return result

    async def telemetry(request: Request) -> dict[str, Any]:
        return {"status": "accepted"}       # the SDK's usage telemetry: not collected here

    async def cancel_future(request: Request) -> Response:
        return Response(status_code=200, content=b"null", media_type="application/json")

    routes = [
        route("/api/v1/healthz", healthz, "GET"),
        route("/api/v1/get_server_capabilities", capabilities, "GET"),
        route("/api/v1/client/config", client_config),
        route("/api/v1/client/dynamic_config", dynamic_config),
        route("/api/v1/create_session", create_session),
        route("/api/v1/session_heartbeat", heartbeat),
        route("/api/v1/sessions/{session_id}/finish", finish_session),
        route("/api/v1/create_model", create_model),
        route("/api/v1/get_info", get_info),
        route("/api/v1/forward_backward", forward_backward),
        route("/api/v1/optim_step", optim_step),
        route("/api/v1/save_weights", save("weights")),
        route("/api/v1/save_weights_for_sampler", save("sampler")),
        route("/api/v1/load_weights", load_weights),
        route("/api/v1/create_sampling_session", create_sampling_session),
        route("/api/v1/join_sampling_session", join_sampling_session),
        route("/api/v1/samplers/{sampler_id}", sampler, "GET"),
        route("/api/v1/asample", asample),
        route("/api/v1/retrieve_future", retrieve_future),
        route("/api/v1/telemetry", telemetry),
        route("/api/v1/cancel_future", cancel_future),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"{request.method} {request.url.path} is not part of the Tinker API this endpoint "
                           "serves (docs/api.md lists what it implements)", "NOT_FOUND")

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
