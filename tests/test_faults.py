"""Faults and hostile load against a live server: one request never hurts another, limits hold, nothing stalls.

Loopback only, bounded in time, no timing thresholds: every check is on outcomes and ordering (which
requests completed, with what, while what else was pending).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from horizon.chat import ChatTemplate
from horizon.checkpoint import open_model
from horizon.engine import Engine, EngineConfig, FinishEvent, Request, SamplingParams

from .live import LiveServer

MODEL = "horizon-test"
VOCAB = 4096  # the tiny preset's


def chat(url: str, content: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0,
            **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("keys"), api_key=None, max_body_bytes=16 << 20,
                    engine_config=EngineConfig(max_num_seqs=8, max_model_len=2048, max_batch_tokens=512)) as srv:
        yield srv


# --- poison beside normal requests --------------------------------------------------------------------------------
def test_a_poisoned_request_fails_alone_and_the_others_keep_their_outputs(server):
    prompts = [f"normal request {i}" for i in range(4)]
    alone = [chat(server.url, p).json()["choices"][0]["message"]["content"] for p in prompts]
    everything_banned = {str(t): -100 for t in range(VOCAB)}
    poisons = [
        dict(logit_bias=everything_banned),  # nothing left to sample
        dict(logit_bias=everything_banned, stream=True),
        dict(temperature=1e-40),  # once overflowed to inf and failed the whole batch; now greedy
    ]
    with ThreadPoolExecutor(8) as pool:
        normal = [pool.submit(chat, server.url, p) for p in prompts]
        bad = [pool.submit(chat, server.url, "poison", **kw) for kw in poisons]
        normal, bad = [f.result() for f in normal], [f.result() for f in bad]
    assert [r.status_code for r in normal] == [200] * 4
    assert [r.json()["choices"][0]["message"]["content"] for r in normal] == alone
    # the request that banned every token: a 400 naming why (its own settings), not a 5xx
    assert bad[0].status_code == 400 and "no token can be sampled" in bad[0].json()["error"]["message"]
    # streamed: the status line was sent, so the error is the last event, then [DONE]
    events = [line[6:] for line in bad[1].text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "no token can be sampled" in json.loads(events[-2])["error"]["message"]
    assert bad[2].status_code == 200
    assert bad[2].json()["choices"][0]["message"]["content"] == chat(server.url, "poison").json()[
        "choices"][0]["message"]["content"]
    assert server.engine.metrics()["running"] == 0 and not server.engine.sequences  # nothing leaked


def test_an_image_the_encoder_fails_on_ends_only_its_request(server, monkeypatch):
    import base64
    import io

    from PIL import Image

    def data_url(width: int) -> str:
        buf = io.BytesIO()
        Image.new("RGB", (width, 32), (10, 200, 30)).save(buf, "PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    encode = server.engine.model.vision.encode

    def picky(img):
        if img.shape[1] == 40:
            raise RuntimeError("injected encoder failure")
        return encode(img)

    monkeypatch.setattr(server.engine.model.vision, "encode", picky)
    parts = [{"type": "text", "text": "what is this?"}]
    alone = chat(server.url, parts + [{"type": "image_url", "image_url": {"url": data_url(32)}}]).json()
    with ThreadPoolExecutor(4) as pool:
        bad = pool.submit(chat, server.url, parts + [{"type": "image_url", "image_url": {"url": data_url(40)}}])
        good = [pool.submit(chat, server.url, parts + [{"type": "image_url", "image_url": {"url": data_url(32)}}])
                for _ in range(2)]
        bad, good = bad.result(), [f.result() for f in good]
    assert bad.status_code == 500 and "encoding an image failed" in bad.json()["error"]["message"]
    for r in good:
        assert r.json()["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert not server.engine.sequences


# --- the event loop stays free ---------------------------------------------------------------------------------
def _poll_health_while(url: str, work) -> tuple[list[int], int, object]:
    """Run work() in a thread; poll /health until it returns. (health statuses, health answers completed
    while work was still pending, work's result)."""
    done = threading.Event()
    result = {}

    def run():
        result["r"] = work()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    statuses, during = [], 0
    while not done.is_set():
        r = httpx.get(url + "/health", timeout=30)
        statuses.append(r.status_code)
        during += not done.is_set()
    return statuses, during, result["r"]


def test_health_answers_while_a_request_is_being_prepared(server, monkeypatch):
    """Preparing a request (parsing, validating, rendering, tokenizing) runs off the event loop: a slow
    preparation (held 2 s here) holds up nothing else, on either API."""
    slow = server.service.check_text_size

    def held(conv):
        time.sleep(2)
        return slow(conv)

    monkeypatch.setattr(server.service, "check_text_size", held)
    anthropic = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for work in (lambda: chat(server.url, "hi", max_tokens=4),
                 lambda: httpx.post(server.url + "/v1/messages", json=anthropic, timeout=60),
                 lambda: httpx.post(server.url + "/v1/messages/count_tokens", json=anthropic, timeout=60)):
        statuses, during, r = _poll_health_while(server.url, work)
        assert r.status_code == 200
        assert during >= 3 and set(statuses) == {200}


def test_a_maximal_body_is_refused_without_tokenizing_while_health_answers(server):
    # 100k small messages (~3.5 MB): far past the window on their count alone
    messages = [{"role": "user", "content": f"m{i}"} for i in range(100_000)]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4})
    statuses, _, r = _poll_health_while(server.url, lambda: httpx.post(
        server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
        timeout=120))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in r.json()["error"]["message"] and set(statuses) <= {200}
    # one huge message: refused on its size alone, in Anthropic's shape too
    huge = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (8 << 20)}]}
    r = httpx.post(server.url + "/v1/messages", json=huge, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long: at least")


# --- admission ----------------------------------------------------------------------------------------------
def test_a_burst_never_admits_more_than_the_running_slots_plus_the_queue(tmp_path):
    config = EngineConfig(max_num_seqs=2, max_model_len=512, max_batch_tokens=64)
    with LiveServer(tmp_path, api_key=None, max_queue=2, engine_config=config) as srv:
        engine, accepted = srv.engine, []
        submit = engine.submit

        def counted(request, on_event, max_queued=None):
            submit(request, on_event, max_queued)
            accepted.append(len(engine.sequences))  # everything accepted and unfinished, this one included

        engine.submit = counted

        def one(i: int) -> httpx.Response:
            if i % 2:
                body = {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": f"b{i}"}]}
                return httpx.post(srv.url + "/v1/messages", json=body, timeout=120)
            return chat(srv.url, f"burst {i}", max_tokens=32)

        with ThreadPoolExecutor(30) as pool:
            responses = list(pool.map(one, range(30)))
        codes = [r.status_code for r in responses]
        assert max(accepted) <= 2 + 2  # running slots + queue limit, at every admission
        assert set(codes) <= {200, 429, 529} and codes.count(200) == len(accepted) >= 4
        assert codes.count(200) < 30  # the burst overflowed the queue
        for i, r in enumerate(responses):
            if r.status_code != 200:
                assert r.headers["retry-after"] == "1"
                assert r.status_code == (529 if i % 2 else 429)
        assert not engine.sequences


# --- sibling branches share their history's prefix ---------------------------------------------------------------
def test_sibling_branches_resume_from_their_shared_history_with_the_logits_of_a_full_prefill(server):
    history = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "The pass key is 4172. Remember it."},
               {"role": "assistant", "content": "Noted."}]
    branches = [history + [{"role": "user", "content": q}] for q in ("What is the key?", "Say it backwards.",
                                                                     "Add one to it.")]
    template = ChatTemplate(server.service.tokenizer)
    shared = len(template.render(history).ids)
    server.engine.clear_prefix_cache()
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "logprobs": True}

    def run(messages):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60)
        return r.json()

    cached, outputs = [], []
    for messages in branches:
        out = run(messages)
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        outputs.append(out)
    # the first computes everything; every later sibling resumes from the history they share
    assert cached[0] == 0 and all(c >= shared for c in cached[1:])
    for messages, resumed in zip(branches[1:], outputs[1:], strict=True):
        server.engine.clear_prefix_cache()
        full = run(messages)
        assert full["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        a, b = resumed["choices"][0]["logprobs"]["content"], full["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in a] == [t["token"] for t in b]
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a, b, strict=True)) <= 1e-4


# --- the engine isolates failures (below the server) ----------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    bundle = open_model("tiny-random")
    return Engine(bundle.model, bundle.tokenizer, EngineConfig(max_num_seqs=4, max_model_len=256,
                                                               max_batch_tokens=64))


def _requests(n: int, max_tokens: int = 8) -> list[Request]:
    return [Request([1, 2 + i, 3, 4 + i], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for i in range(n)]


def _poison_one_row(engine, monkeypatch, requests, poison):
    """Every step's logits row of requests[1] is replaced by `poison(row)`."""
    forward = engine.model.forward_batch

    def poisoned(tokens, batch, *args, **kwargs):
        logits = forward(tokens, batch, *args, **kwargs)
        target = engine.sequences.get(requests[1].request_id)
        if target is not None:
            rows = batch.slots == target.slot  # that sequence's row only
            logits[rows] = poison(logits[rows])
        return logits

    monkeypatch.setattr(engine.model, "forward_batch", poisoned)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_logits_end_only_their_own_sequence(engine, monkeypatch, bad):
    reference = [r.token_ids for r in engine.generate(_requests(3))]
    requests = _requests(3)

    def poison(rows):
        rows[..., 7] = float(bad)  # one logit of the row is enough
        return rows

    _poison_one_row(engine, monkeypatch, requests, poison)
    results = engine.generate(requests)
    assert results[1].finish.reason == "error" and "non-finite logits" in results[1].finish.error
    assert [results[0].token_ids, results[2].token_ids] == [reference[0], reference[2]]
    assert not engine.sequences and engine.scheduler.blocks.num_free + len(
        {b for e in engine.scheduler.prefix.entries.values() for b in e.blocks}) == engine.cache.num_blocks


def test_huge_finite_logits_are_not_taken_for_non_finite(engine, monkeypatch):
    """The engine checks a row's sum first (cheap); a sum that overflows to inf is rechecked exactly."""
    requests = _requests(2)

    def poison(rows):
        rows[:] = 3e38  # finite, but their sum is not
        rows[..., 11] = 3.4e38
        return rows

    _poison_one_row(engine, monkeypatch, requests, poison)
    results = engine.generate(requests)
    assert results[1].finish.reason == "length" and results[1].token_ids == [11] * 8


def test_a_consumer_that_raises_ends_only_its_request_and_a_failed_step_leaves_the_engine_serving(engine,
                                                                                                   monkeypatch):
    reference = [r.token_ids for r in engine.generate(_requests(2))]
    got: dict[str, list] = {}

    def collect(event):
        got.setdefault(event.request_id, []).append(event)

    def broken(event):
        raise RuntimeError("the consumer is gone")

    good, bad = _requests(2)
    engine.submit(good, collect)
    engine.submit(bad, broken)
    engine.run_until_idle()
    assert isinstance(got[good.request_id][-1], FinishEvent) and got[good.request_id][-1].reason == "length"
    assert [e.token_id for e in got[good.request_id][:-1]] == reference[0]
    assert not engine.sequences

    # a failing forward (a bug) fails what it ran, cleanly; the next requests are served as before
    calls = {"n": 0}
    forward = engine.model.forward_batch

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward_batch", fails_once)
    engine.start()
    try:
        async_results = []

        async def run_all(requests):
            import asyncio

            async def one(r):
                events = [e async for e in engine.stream(r)]
                return events[-1]

            return await asyncio.gather(*(one(r) for r in requests))

        import asyncio

        async_results = asyncio.run(run_all(_requests(2)))
        assert {e.reason for e in async_results} == {"error"} and all("injected failure" in e.error
                                                                        for e in async_results)
        after = asyncio.run(run_all(_requests(2)))
        assert [e.reason for e in after] == ["length", "length"]
    finally:
        engine.stop()


def test_the_sampler_keeps_any_temperature_finite():
    from horizon.engine.sampler import NothingToSample, sample

    logits = torch.tensor([3e4, -3e4, 1.0, 2.0])
    g = torch.Generator().manual_seed(0)
    for t in (1e-40, 1e-20, 1e-6):
        assert sample(logits, SamplingParams(temperature=t), [], g) == 0  # as greedy
    for finite in (False, True):  # the engine passes finite=True: bans must still be caught
        with pytest.raises(NothingToSample):
            sample(logits, SamplingParams(logit_bias={i: -100 for i in range(4)}), [], g, finite=finite)
        with pytest.raises(NothingToSample):
            sample(logits, SamplingParams(), [], g, torch.zeros(4, dtype=torch.bool), finite=finite)
        assert sample(logits, SamplingParams(temperature=0), [], g, finite=finite) == 0


# --- SIGTERM: drain, then a proper ending for every stream (the process itself: tests/test_serve_process.py) ---
def test_a_drain_past_its_deadline_ends_each_api_stream_with_its_own_error_event(tmp_path):
    from .live import engine_requests

    def endless(request):  # steer the random model the way a long answer would go: no end of turn
        request.params.logit_bias = {**request.params.logit_bias, 0: -100.0, 6: -100.0}
        request.params.max_tokens = 1500
        return request

    with LiveServer(tmp_path, api_key=None) as srv, engine_requests(srv, endless):
        long = {"model": MODEL, "stream": True, "max_tokens": 1500, "messages": [{"role": "user", "content": "hi"}]}
        streams = {"openai": ("/v1/chat/completions", long), "anthropic": ("/v1/messages", long),
                   "responses": ("/v1/responses", {"model": MODEL, "stream": True, "max_output_tokens": 1500,
                                                   "input": "hi"})}
        out: dict[str, list[dict]] = {}
        started = threading.Barrier(len(streams) + 1, timeout=60)

        def read(name):
            path, body = streams[name]
            events = out[name] = []
            with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        if len(events) == 2:
                            started.wait()
                    elif line == "data: [DONE]":
                        events.append({"done": True})

        readers = [threading.Thread(target=read, args=(n,)) for n in streams]
        for t in readers:
            t.start()
        started.wait()
        srv.service.drain(0.2)
        refused = chat(srv.url, "too late")  # once draining, a new request is refused, with when to retry
        for t in readers:
            t.join(timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert out["openai"][-1] == {"done": True} and out["openai"][-2]["error"]["code"] == "server_shutting_down"
        assert out["anthropic"][-1]["type"] == "error" and out["anthropic"][-1]["error"]["type"] == "overloaded_error"
        assert out["responses"][-1]["type"] == "response.failed"
        assert out["responses"][-1]["response"]["error"]["code"] == "server_shutting_down"
        assert not srv.engine.sequences


# --- clients that stall ---------------------------------------------------------------------------------------
def test_stalled_headers_are_dropped_and_a_stalled_body_gets_a_408(tmp_path):
    import socket

    with LiveServer(tmp_path, api_key=None, header_timeout_s=0.5, body_timeout_s=0.5) as srv:
        held = []
        for _ in range(5):  # slowloris: headers never finished
            s = socket.create_connection((srv.host, srv.port), timeout=20)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        for s in held:
            assert s.recv(1024) == b""  # the server closed it (a socket timeout here would fail the test)
            s.close()
        for path in ("/v1/chat/completions", "/v1/messages"):
            with socket.create_connection((srv.host, srv.port), timeout=20) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: 100\r\n\r\n{\"model\": ".encode())
                reply = b""
                while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408")
            error = json.loads(body)
            if path == "/v1/messages":
                assert error["type"] == "error" and "stalled" in error["error"]["message"]
            else:
                assert error["error"]["code"] == "request_timeout"
        assert httpx.get(srv.url + "/health").status_code == 200
