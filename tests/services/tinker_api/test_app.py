"""The HTTP edge in process: API-key auth against the cluster's tokens (never logged), the error shape
the SDK raises, sessions and futures. Routes that need no trainer or replica run against a real
TinkerService with none (what a sampling-only endpoint with no samplers is)."""
from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.testclient import TestClient

from zerokl.services.runtime.auth import AuthConfig
from zerokl.services.tinker_api.app import CLIENT_CONFIG, build_app
from zerokl.services.tinker_api.samplers import SamplerPool
from zerokl.services.tinker_api.service import TinkerService
from zerokl.services.tinker_api.types import BaseModel
from zerokl.services.weightstore.client import WeightStoreClient

CLIENT, PEER, OPERATOR = "client-secret-1234", "peer-secret-5678", "operator-secret-9abc"
BASE = BaseModel(name="zerokl/tiny", aliases=("tiny", "1"), version="1", numerics_fingerprint="fp",
                 tokenizer_dir="/tmp/zerokl--tiny", vocab_size=64, max_context_length=512)


@pytest.fixture
def client():
    # The store client connects lazily (no route used here reaches it); grpc.aio wants a loop to make it on.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    service = TinkerService(BASE, trainer=None, samplers=SamplerPool([]), store=WeightStoreClient("127.0.0.1:9"))
    with TestClient(build_app(service, AuthConfig(CLIENT, PEER, OPERATOR))) as c:
        yield c
    asyncio.set_event_loop(None)
    loop.close()


def test_the_api_key_is_the_client_or_operator_token_and_is_never_logged(client, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}           # probes carry no key
    for key in (None, "tml-wrong", PEER, f"tml-{PEER}"):                       # the peer token is not a user's
        r = client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": key} if key else {})
        assert r.status_code == 401 and r.json()["code"] == "UNAUTHENTICATED"
        assert (key or "") not in r.text or key is None
    for key in (f"tml-{CLIENT}", CLIENT, f"tml-{OPERATOR}"):
        r = client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": key})
        assert r.status_code == 200, r.text
        assert r.json()["supported_models"] == [{"model_name": "zerokl/tiny", "max_context_length": 512,
                                                 "trainable": False, "sampleable": False}]
    assert not any(secret in caplog.text for secret in (CLIENT, PEER, OPERATOR))


def test_errors_are_json_the_sdk_raises_without_retrying(client) -> None:
    key = {"X-API-Key": f"tml-{CLIENT}"}
    assert client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers=key).json() == CLIENT_CONFIG
    session = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}, headers=key).json()
    sid = session["session_id"]
    assert client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=key).status_code == 200
    r = client.post("/api/v1/create_model", headers=key, json={
        "session_id": sid, "model_seq_id": 0, "base_model": "Qwen/Qwen3-8B", "lora_config": {"rank": 4}})
    assert r.status_code == 404 and "unknown base model 'Qwen/Qwen3-8B'" in r.json()["detail"]
    r = client.post("/api/v1/create_model", headers=key, json={
        "session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}})
    assert r.status_code == 400 and "no trainer" in r.json()["detail"]      # a sampling-only endpoint says so
    r = client.post("/api/v1/create_model", headers=key, content=b"{not json")
    assert r.status_code == 400 and r.json()["field_violations"][0]["field"] == "body"
    r = client.post("/api/v1/retrieve_future", headers=key, json={"request_id": "req-nope"})
    assert r.status_code == 404 and "no request 'req-nope'" in r.json()["detail"]
    r = client.post("/api/v1/create_sampling_session", headers=key,
                    json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny"})
    sampler = r.json()["sampling_session_id"]
    assert client.get(f"/api/v1/samplers/{sampler}", headers=key).json() == {
        "sampler_id": sampler, "base_model": "/tmp/zerokl--tiny", "model_path": None}
    # A sample with no sampler replica: accepted, and its future fails with a server error (retryable later).
    r = client.post("/api/v1/asample", headers=key, json={
        "sampling_session_id": sampler, "seq_id": 0, "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}, "sampling_params": {"max_tokens": 2}})
    request_id = r.json()["request_id"]
    assert r.json()["sample_sequence_ids"] == [f"{request_id}-0", f"{request_id}-1"]
    result = client.post("/api/v1/retrieve_future", headers=key, json={"request_id": request_id}).json()
    assert result["category"] == "server" and "no sampler replicas" in result["error"]
    r = client.post("/api/v1/asample", headers=key, json={
        "sampling_session_id": sampler, "num_samples": 1, "sampling_params": {"max_tokens": 2},
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 400]}]}})
    assert r.status_code == 400 and "outside zerokl/tiny's vocabulary" in r.json()["detail"]
    assert client.post("/api/v1/not_an_api", headers=key).status_code == 404
    assert client.post(f"/api/v1/sessions/{sid}/finish", headers=key, json={"reason": {"type": "success"}}).status_code == 200
    assert client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=key).status_code == 410
