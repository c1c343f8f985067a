"""The agent loop against a live `horizon serve` (both APIs, streamed and not): forced tool calls run,
their results go back, and every request carries the earlier turns exactly as the server returned
them. The server side records the raw bytes of every request and response; the checks read those,
not the agent's own bookkeeping."""

from __future__ import annotations

import json

import pytest

from horizon.agent import Agent, AgentConfig, ClientError, HTTPClient, StepPlan, Tool, Transcript, replay
from horizon.agent.client import OpenAIWire, StepRequest

from .live import LiveServer

BUDGETS = {"low": 6, "high": 10, "max": 14}
ROUTES = ("/v1/chat/completions", "/v1/messages")


class Capture:
    """ASGI middleware: (path, request bytes, response bytes) of every model request, in order."""

    def __init__(self, app, log: list):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)
        entry = {"path": scope["path"], "request": b"", "response": b""}
        self.log.append(entry)

        async def recv():
            message = await receive()
            if message["type"] == "http.request":
                entry["request"] += message.get("body", b"")
            return message

        async def snd(message):
            if message["type"] == "http.response.body":
                entry["response"] += message.get("body", b"")
            await send(message)

        await self.app(scope, recv, snd)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp("keys"), generation_config={"thinking_budgets": BUDGETS})
    server.captured = []
    server.app.add_middleware(Capture, log=server.captured)
    with server:
        yield server


class Note(Tool):
    """A deterministic tool: echoes what it was given, numbered."""

    name = "note"
    description = "Write down a short note."
    parameters = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}},
                  "required": ["text"], "additionalProperties": False}
    strict = True

    def __init__(self):
        self.calls = 0

    def call(self, arguments):
        self.calls += 1
        return f"note {self.calls} saved: {arguments['text']!r}"


class Fails(Tool):
    name = "fails"
    description = "Always fails."
    parameters = {"type": "object", "properties": {}}

    def call(self, arguments):
        raise RuntimeError("disk on fire")


def sse_data(raw: bytes) -> list[dict]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def returned_pieces(api: str, raw: bytes, stream: bool) -> dict:
    """What the server returned for one step, read from its raw bytes: thinking, text, calls."""
    if api == "openai":
        if not stream:
            m = json.loads(raw)["choices"][0]["message"]
            return {"thinking": m.get("reasoning_content"), "text": m.get("content") or "",
                    "calls": [(c["id"], c["function"]["name"], c["function"]["arguments"])
                              for c in m.get("tool_calls") or []]}
        thinking, text, calls = None, "", {}
        for ev in sse_data(raw):
            for ch in ev.get("choices", []):
                d = ch["delta"]
                if d.get("reasoning_content") is not None:
                    thinking = (thinking or "") + d["reasoning_content"]
                text += d.get("content") or ""
                for piece in d.get("tool_calls") or []:
                    c = calls.setdefault(piece["index"], ["", "", ""])
                    c[0] += piece.get("id") or ""
                    c[1] += (piece.get("function") or {}).get("name") or ""
                    c[2] += (piece.get("function") or {}).get("arguments") or ""
        return {"thinking": thinking, "text": text, "calls": [tuple(calls[i]) for i in sorted(calls)]}
    if not stream:
        return {"blocks": json.loads(raw)["content"]}
    blocks, partial = {}, {}
    keys = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}
    for ev in sse_data(raw):
        if ev["type"] == "content_block_start":
            blocks[ev["index"]] = dict(ev["content_block"])
        elif ev["type"] == "content_block_delta":
            d, b = ev["delta"], blocks[ev["index"]]
            if d["type"] == "input_json_delta":
                partial[ev["index"]] = partial.get(ev["index"], "") + d["partial_json"]
            else:
                b[keys[d["type"]]] = b.get(keys[d["type"]], "") + d[keys[d["type"]]]
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text)
    blocks = [blocks[i] for i in sorted(blocks)]
    return {"blocks": blocks}


def check_full_history(api: str, captured: list, stream: bool, tool_results: list[list[tuple[str, str, bool]]]):
    """Request k+1 = request k's messages + the reply k as returned + its tool results, for every k."""
    bodies = [json.loads(c["request"]) for c in captured]
    assert len(bodies) >= 3
    for k in range(len(bodies) - 1):
        before, after = bodies[k]["messages"], bodies[k + 1]["messages"]
        assert after[: len(before)] == before, f"request {k + 1} changed earlier messages"
        reply, results = after[len(before)], after[len(before) + 1:]
        got = returned_pieces(api, captured[k]["response"], stream)
        if api == "openai":
            assert reply.get("reasoning_content") == got["thinking"]
            assert got["thinking"] is not None  # thinking was on: the history must carry it
            assert (reply.get("content") or "") == got["text"]
            calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in reply["tool_calls"]]
            assert calls == got["calls"] and calls
            assert [(m["tool_call_id"], m["content"]) for m in results] == [
                (cid, content) for (cid, _, _), (_, content, _) in zip(calls, tool_results[k], strict=True)]
        else:
            assert reply["content"] == got["blocks"]
            uses = [b for b in reply["content"] if b["type"] == "tool_use"]
            assert uses
            (user,) = results
            assert [(b["tool_use_id"], b["content"], b.get("is_error", False)) for b in user["content"]] == [
                (u["id"], content, err) for u, (_, content, err) in zip(uses, tool_results[k], strict=True)]


def forced_then_answer(tiers):
    """Force a call on the first steps (each with its own tier), then let the model answer."""
    def policy(step, history):
        if step < len(tiers):
            return StepPlan(tiers[step], "required")
        return StepPlan(tiers[-1], "none")
    return policy


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_openai_loop_keeps_thinking_calls_and_results_byte_for_byte(srv, tmp_path, stream):
    srv.captured.clear()
    events = []
    note = Note()
    client = HTTPClient(srv.url, api="openai", api_key=srv.api_key, stream=stream)
    transcript = Transcript(tmp_path / "run.jsonl")
    agent = Agent(client, [note, Fails()], forced_then_answer(["low", "high"]),
                  AgentConfig(max_steps=5, max_tokens_per_step=48, seed=1, temperature=1.0),
                  on_event=lambda kind, data: events.append((kind, data)), transcript=transcript)
    result = agent.run("Save two notes, then say done.")
    transcript.close()
    assert result.stop_reason in ("answer", "length"), result.error
    assert result.steps == 3 and len(srv.captured) == 3
    tool_events = [d for k, d in events if k == "tool_result"]
    per_step = []
    n_calls = [len(json.loads(c["request"])["messages"]) for c in srv.captured]
    for k in range(2):
        body = json.loads(srv.captured[k + 1]["request"])
        calls = body["messages"][n_calls[k]]["tool_calls"]
        per_step.append([(e["name"], e["content"], e["is_error"]) for e in tool_events[:len(calls)]])
        tool_events = tool_events[len(calls):]
    check_full_history("openai", srv.captured, stream, per_step)
    bodies = [json.loads(c["request"]) for c in srv.captured]
    assert [b.get("reasoning_effort") for b in bodies] == ["low", "high", "high"]  # the per-step tier
    assert [b["tool_choice"] for b in bodies] == ["required", "required", "none"]
    assert any(k == "thinking" for k, _ in events) and any(k == "tool_call" for k, _ in events)
    # the later steps resume the earlier ones from the server's cache
    assert result.usage.cached_tokens > 0

    # the transcript replays: the same requests, the recorded results
    again = replay(tmp_path / "run.jsonl")
    assert again.error is None
    assert again.messages == result.messages and again.stop_reason == result.stop_reason


def test_anthropic_loop_keeps_calls_and_results_byte_for_byte(srv):
    srv.captured.clear()
    events = []
    client = HTTPClient(srv.url, api="anthropic", api_key=srv.api_key, stream=True)
    # Anthropic refuses forced tool choice with thinking on, and a tool loop cannot switch thinking on
    # half-way (the earlier call turns would lack thinking): this loop runs with thinking off
    agent = Agent(client, [Note(), Fails()], forced_then_answer([None, None]),
                  AgentConfig(max_steps=5, max_tokens_per_step=48, temperature=1.0),
                  on_event=lambda kind, data: events.append((kind, data)))
    result = agent.run("Save two notes, then say done.")
    assert result.stop_reason in ("answer", "length"), result.error
    assert len(srv.captured) == 3
    results, it = [], iter(d for k, d in events if k == "tool_result")
    for k in range(2):
        before = len(json.loads(srv.captured[k]["request"])["messages"])
        reply = json.loads(srv.captured[k + 1]["request"])["messages"][before]
        uses = [b for b in reply["content"] if b["type"] == "tool_use"]
        results.append([(e["name"], e["content"], e["is_error"]) for e in (next(it) for _ in uses)])
    check_full_history("anthropic", srv.captured, True, results)
    bodies = [json.loads(c["request"]) for c in srv.captured]
    assert [b["tool_choice"] for b in bodies] == [{"type": "any"}, {"type": "any"}, {"type": "none"}]


def test_tool_failures_and_unknown_tools_go_back_as_error_results(srv):
    client = HTTPClient(srv.url, api="anthropic", api_key=srv.api_key, stream=False)
    agent = Agent(client, [Fails()], lambda step, h: StepPlan(None, "fails" if step == 0 else "none"),
                  AgentConfig(max_steps=3, max_tokens_per_step=32))
    result = agent.run("Try the tool.")
    tool_turn = result.messages[2]["content"]
    assert tool_turn[0]["is_error"] is True
    assert "disk on fire" in tool_turn[0]["content"]


def test_step_limit_token_budget_and_refusals_end_the_run_cleanly(srv):
    client = HTTPClient(srv.url, api="openai", api_key=srv.api_key)
    forced = lambda step, h: StepPlan(None, "required")
    one = Agent(client, [Note()], forced, AgentConfig(max_steps=1, max_tokens_per_step=32)).run("go")
    assert one.stop_reason == "max_steps" and one.steps == 1
    budget = Agent(client, [Note()], forced, AgentConfig(max_steps=10, max_total_tokens=40,
                                                         max_tokens_per_step=32)).run("go")
    assert budget.stop_reason == "token_budget" and budget.usage.completion_tokens >= 40
    assert budget.usage.completion_tokens <= 40  # each step asks for at most what the budget leaves

    bad_key = HTTPClient(srv.url, api="openai", model="horizon-test", api_key="wrong")
    refused = Agent(bad_key, [Note()]).run("hello")
    assert refused.stop_reason == "error" and "401" in refused.error
    with pytest.raises(ValueError, match="not offered"):
        Agent(client, [Note()], lambda s, h: StepPlan(None, "nope")).run("x")


def test_replay_with_rerun_tools_detects_a_changed_result(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    client = HTTPClient(srv.url, api="openai", api_key=srv.api_key, stream=False)
    transcript = Transcript(path)
    Agent(client, [Note()], forced_then_answer([None, None]), AgentConfig(max_steps=4, max_tokens_per_step=32),
          transcript=transcript).run("notes")
    transcript.close()
    assert replay(path, tools=[Note()]).stop_reason != "error"  # the tool is deterministic: same run

    class Other(Note):
        def call(self, arguments):
            return "something else"

    diverged = replay(path, tools=[Other()])
    assert diverged.stop_reason == "error" and "diverged at step 1" in diverged.error


def test_a_stream_accumulates_to_the_whole_message():
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "reasoning_content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                             "function": {"name": "note", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"te'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'xt": "a"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}},
    ]
    turn = OpenAIWire("m").stream(chunks, None)
    assert turn.message == {"role": "assistant", "content": None, "reasoning_content": "hm",
                            "tool_calls": [{"id": "c1", "type": "function",
                                            "function": {"name": "note", "arguments": '{"text": "a"}'}}]}
    assert turn.finish_reason == "tool_calls" and turn.usage.completion_tokens == 7
    body = OpenAIWire("m").body(StepRequest([{"role": "user", "content": "x"}], [Note()], "max", "note", 9), True)
    assert body["reasoning_effort"] == "xhigh" and body["tool_choice"]["function"]["name"] == "note"
    assert body["tools"][0]["function"]["strict"] is True


def test_unreachable_endpoint_is_a_clear_error():
    with pytest.raises(ClientError, match="failed"):
        HTTPClient("http://127.0.0.1:9", api="openai")
