"""Server operations: health, metrics, tokenize, API keys, body limits, request ids, errors in each API's shape."""

import httpx
import openai
import pytest

from .live import LiveServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("keys"), max_body_bytes=4096) as srv:
        yield srv


def headers(server, anthropic=False):
    return {"x-api-key": server.api_key} if anthropic else {"Authorization": f"Bearer {server.api_key}"}


def test_health_metrics_tokenize_and_models(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.headers["x-request-id"].startswith("req_")
    assert r.headers["request-id"] == r.headers["x-request-id"]
    r = httpx.post(server.url + "/tokenize", json={"text": "hello world"})
    tokens = r.json()["tokens"]
    assert r.status_code == 200 and server.service.tokenizer.decode(tokens) == "hello world"
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tier": "low"})
    assert r.json()["count"] == len(r.json()["tokens"]) > 3
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    assert [m.id for m in client.models.list().data] == ["horizon-test"]
    text = httpx.get(server.url + "/metrics").text
    assert "horizon_requests_total" in text and "horizon_cache_blocks_free" in text
    assert 'horizon_thinking_tokens{tier="low"}' in text


def test_api_keys_are_required_in_each_apis_header(server):
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(server.url + "/v1/messages", json={}, headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 400  # Anthropic routes also take a Bearer token (its SDK may send one)
    r = httpx.post(server.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json() == {
        "type": "error", "error": {"type": "authentication_error",
                                   "message": "missing or invalid API key (send it in the x-api-key header)"}}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()


def test_oversized_bodies_and_unknown_routes_answer_in_the_apis_shape(server):
    big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=big, headers=headers(server))
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", json=big, headers=headers(server, anthropic=True))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit still holds
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(server.url + "/tokenize", content=chunks())
    assert r.status_code == 413
    r = httpx.get(server.url + "/v1/nothing", headers=headers(server))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/tokenize", json={"text": 5})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid request: text")
    r = httpx.post(server.url + "/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
