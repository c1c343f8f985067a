"""Anthropic Messages API against a live server with the official `anthropic` SDK: streaming and not, thinking
with signatures, tool use round trips, prefix reuse, every error in Anthropic's shape, disconnects, restarts.

The bundled model has random weights: it never ends thinking or calls a tool by itself. Tier budgets are small
(`BUDGETS`), and where a test needs the model to *decide* to call a tool, `wants_to_call` adds a logit bias on
<｜tool_call｜> to its requests (as a trained model's preference would); the grammar, engine, parser and adapter
all run for real.
"""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import jsonschema
import pytest

from horizon.chat import ErrorDelta, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from horizon.chat.thinking import DEFAULT_THINKING_BUDGETS
from horizon.server.anthropic import Reply, plan_request, sign_thinking, thinking_config, verified_tier
from horizon.server.anthropic_types import CountTokensRequest, MessagesRequest
from horizon.server.signatures import ThinkingSigner

from .live import LiveServer, busy_server, engine_requests

MODEL = "horizon-test"
# low: thinking ends at once, its closing token the whole budget (the tool round trip relies on it)
BUDGETS = {"low": 1, "high": 6, "max": 12}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Weather forecast for a city", "input_schema": WEATHER_SCHEMA}
CLOCK = {"name": "get_time", "description": "The current time", "input_schema": {"type": "object"}}
USER = {"role": "user", "content": "What will the weather be in Lisbon?"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("keys"), generation_config={"thinking_budgets": BUDGETS}) as s:
        yield s


def sdk(server: LiveServer) -> anthropic.Anthropic:
    # This SDK release sends api_key as `Authorization: Bearer`; the server reads Anthropic keys from x-api-key.
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0,
                               default_headers={"x-api-key": server.api_key})


@pytest.fixture(scope="module")
def client(srv):
    return sdk(srv)


def post(server: LiveServer, body: dict, path: str = "/v1/messages", timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": server.api_key}, timeout=timeout)


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE frame, checking the `event: X\\ndata: {...}` framing as it goes."""
    frames = [f for f in text.split("\n\n") if f.strip()]
    out = []
    for frame in frames:
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


def wants_to_call(server: LiveServer, bias: float = 50.0):
    """Make the random model prefer <｜tool_call｜> wherever it may write one (added to the request's own bias,
    below the seam: what the tool policy bans stays banned)."""
    token = server.service.tokenizer.special.tool_call

    def biased(request):
        params = request.params
        params.logit_bias = {**params.logit_bias, token: params.logit_bias.get(token, 0.0) + bias}
        return request

    return engine_requests(server, biased)


def never_ends(server: LiveServer):
    """Steer the random model the way a long answer goes: no end of turn, so a request runs to max_tokens
    (a sampled end token would otherwise end it at a random length, sometimes within a few tokens)."""
    sp = server.service.tokenizer.special

    def endless(request):
        request.params.logit_bias = {**request.params.logit_bias, sp.assistant_end: -100.0, sp.end_of_text: -100.0}
        return request

    return engine_requests(server, endless)


def wait_idle(server: LiveServer, timeout: float = 10.0) -> dict:
    deadline = time.time() + timeout
    while (m := server.engine.metrics())["running"] or m["queue_length"]:
        assert time.time() < deadline, "the engine kept running the request"
        time.sleep(0.02)
    return m


def metric(server: LiveServer, name: str) -> float:
    """One sample of the Prometheus exposition (name with its labels, exactly as exposed)."""
    text = httpx.get(server.url + "/metrics").text
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.rsplit(" ", 1)[0] == name), 0.0)


# --- plain and streamed messages --------------------------------------------------------------------------------
def test_a_plain_message_has_the_reference_shape_and_its_usage_is_recorded(srv, client):
    completion, ttft = 'horizon_tokens_total{kind="completion"}', "horizon_time_to_first_token_seconds_count"
    tokens, ttfts = metric(srv, completion), metric(srv, ttft)
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}], "metadata": {"x": 1}}
    r = post(srv, body)
    assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
    m = r.json()
    assert m["id"].startswith("msg_") and m["type"] == "message" and m["role"] == "assistant" and m["model"] == MODEL
    assert [b["type"] for b in m["content"]] == ["text"] and m["stop_sequence"] is None
    count = post(srv, {k: v for k, v in body.items() if k != "max_tokens"}, "/v1/messages/count_tokens").json()
    # the random model may end its turn early; max_tokens is then not reached
    assert (m["stop_reason"], m["usage"]["output_tokens"]) == ("max_tokens", 6) or m["stop_reason"] == "end_turn"
    assert m["usage"] == {"input_tokens": count["input_tokens"], "output_tokens": m["usage"]["output_tokens"],
                          "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    assert metric(srv, completion) == tokens + m["usage"]["output_tokens"] and metric(srv, ttft) == ttfts + 1
    again = client.messages.create(model=MODEL, max_tokens=6, system="Be brief.", extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Say hi"}])
    assert again.content[0].text == m["content"][0]["text"]  # greedy: the same answer through the SDK


def test_the_stream_follows_the_reference_event_sequence(srv):
    body = {"model": MODEL, "max_tokens": 10, "stream": True, "thinking": {"type": "adaptive"},
            "output_config": {"effort": "high"}, "messages": [USER]}
    r = post(srv, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = " ".join(n if n != "content_block_delta" else d["delta"]["type"] for n, d in events)
    assert re.fullmatch(r"message_start ping content_block_start( thinking_delta)* signature_delta content_block_stop"
                        r"( content_block_start( text_delta)+ content_block_stop)? message_delta message_stop", names)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    blocks = [d for n, d in events if n == "content_block_start"]
    assert [b["index"] for b in blocks] == list(range(len(blocks)))
    assert blocks[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    thinking = "".join(d["delta"]["thinking"] for n, d in events if d.get("delta", {}).get("type") == "thinking_delta")
    signature = next(d["delta"]["signature"] for n, d in events if d.get("delta", {}).get("type") == "signature_delta")
    assert verified_tier(srv.app.state.signer, thinking, signature) == "high"
    final = events[-2][1]
    assert final["usage"]["output_tokens"] <= 10 and final["delta"]["stop_reason"] in ("max_tokens", "end_turn")


def test_the_sdk_stream_and_its_final_message_agree(srv, client):
    deltas = {"thinking_delta": "", "text_delta": ""}
    with client.messages.stream(model=MODEL, max_tokens=12, thinking={"type": "adaptive"},
                                output_config={"effort": "high"}, messages=[USER]) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type in deltas:
                key = "thinking" if event.delta.type == "thinking_delta" else "text"
                deltas[event.delta.type] += getattr(event.delta, key)
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == deltas["thinking_delta"]
    assert "".join(b.text for b in final.content if b.type == "text") == deltas["text_delta"]
    assert verified_tier(srv.app.state.signer, final.content[0].thinking, final.content[0].signature) == "high"
    assert final.usage.output_tokens <= 12 and final.usage.input_tokens > 0


def test_stop_sequences_end_the_answer_and_are_named(srv, client):
    # greedy (this SDK release has no temperature argument: it travels in extra_body)
    base = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "Count to ten"}])
    text = client.messages.create(**base).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"greedy text too short to pick a stop sequence from: {text!r}"
    cut = client.messages.create(**base, stop_sequences=["\x00never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == text[: text.find(stop)]


# --- tools ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}])
def test_a_forced_tool_call_has_schema_valid_input(srv, client, choice):
    m = client.messages.create(model=MODEL, max_tokens=60, tools=[CLOCK, WEATHER], tool_choice=choice,
                               messages=[USER])
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.id.startswith("toolu_") and call.name in ("get_weather", "get_time")
    if choice["type"] == "tool":
        assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA if call.name == "get_weather" else CLOCK["input_schema"])


def test_a_streamed_forced_call_arrives_in_fragments_as_it_is_generated(srv, client):
    # one call: with parallel calls allowed the random model may start another that max_tokens cuts off
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    with client.messages.stream(model=MODEL, max_tokens=60, tools=[WEATHER], messages=[USER],
                                tool_choice=choice) as stream:
        partial = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(calls) == len(final.content) == 1
    assert len(partial) > 1  # streamed token by token (the grammar guarantees a declared name and JSON)
    assert json.loads("".join(partial)) == calls[0].input
    jsonschema.validate(calls[0].input, WEATHER_SCHEMA)


def test_tool_choice_none_bans_calls_even_when_the_model_wants_one(srv, client):
    with wants_to_call(srv):
        m = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"},
                                   messages=[USER])
    assert all(b.type == "text" for b in m.content) and m.stop_reason in ("max_tokens", "end_turn")


def test_structured_output_follows_the_json_schema(srv, client):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=40, messages=[USER],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_a_tool_round_trip_with_thinking_is_accepted_and_a_tampered_history_is_refused(srv, client):
    tools = [{**WEATHER, "strict": True}]
    ask = dict(model=MODEL, tools=tools, thinking={"type": "adaptive"}, output_config={"effort": "low"})
    with wants_to_call(srv):
        first = client.messages.create(**ask, max_tokens=60, messages=[USER],
                                       tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    thinking, call = first.content
    returned = [b.model_dump() for b in first.content]  # the assistant message exactly as the client keeps it
    jsonschema.validate(call.input, WEATHER_SCHEMA)  # strict: constrained to the schema under auto too

    def history(assistant_content, is_error=False):
        result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18C, sun"}],
                  "is_error": is_error}
        return [USER, {"role": "assistant", "content": assistant_content}, {"role": "user", "content": [result]}]

    # the exact prefix the engine can resume: the longest cached turn the new prompt extends
    body = MessagesRequest.model_validate({**ask, "max_tokens": 4, "messages": history(returned)})
    prompt = srv.service.render(plan_request(body, srv.service, srv.app.state.signer).conversation)[0]
    cached = max((len(e.tokens) for e in srv.engine.scheduler.prefix.entries.values()
                  if len(e.tokens) < len(prompt) and prompt[: len(e.tokens)] == e.tokens), default=0)
    second = client.messages.create(**ask, max_tokens=4, messages=history(first.content))
    assert second.usage.cache_read_input_tokens == cached
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == len(prompt)
    errored = client.messages.create(**ask, max_tokens=2, messages=history(first.content, is_error=True))
    assert errored.usage.input_tokens + errored.usage.cache_read_input_tokens > len(prompt)  # the error prefix

    # the thinking block dropped: the server knows the turn and restores it; with other input it knows nothing
    raw = client.messages.with_raw_response.create(**ask, max_tokens=4, messages=history([call]))
    assert raw.headers["x-horizon-restored"] == "1" and raw.parse().content
    forged = {**call.model_dump(), "input": {**call.input, "days": call.input["days"] + 1}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]: .*without its thinking block"):
        client.messages.create(**ask, max_tokens=4, messages=history([forged]))
    edited = {"type": "thinking", "thinking": thinking.thinking + " (edited)", "signature": thinking.signature}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]: .*signature does not verify"):
        client.messages.create(**ask, max_tokens=4, messages=history([edited, call]))
    # the same turn made with thinking off would be fine with thinking off
    client.messages.create(model=MODEL, tools=tools, max_tokens=2, messages=history([call]))


def test_a_thinking_turn_keeps_its_tier_so_the_next_turn_resumes_from_cache(srv, client):
    """Turn 1 ran under `max`; turn 2 turns thinking off. The historic turn still renders under `max` (the tier
    travels in the signature), so the prompt of turn 1 is an exact prefix and is not computed again."""
    question = {"role": "user", "content": "Plan three days in Porto, step by step."}
    first = client.messages.create(model=MODEL, max_tokens=1, thinking={"type": "adaptive"},
                                   output_config={"effort": "max"}, messages=[question])
    assert first.content[0].type == "thinking" and first.content[0].signature.startswith("max.")
    turn2 = [question, {"role": "assistant", "content": first.content}, {"role": "user", "content": "And Lisbon?"}]
    total = client.messages.count_tokens(model=MODEL, messages=turn2).input_tokens
    second = client.messages.create(model=MODEL, max_tokens=2, messages=turn2)
    assert second.usage.cache_read_input_tokens == first.usage.input_tokens > 0
    assert second.usage.input_tokens == total - first.usage.input_tokens


# --- errors -------------------------------------------------------------------------------------------------------
def error_of(r: httpx.Response, status: int, kind: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body) == {"type", "error"}
    return body["error"]["message"]


def test_every_refusal_answers_in_anthropics_shape(srv, client):
    ok = {"model": MODEL, "max_tokens": 4, "messages": [USER]}
    assert "max_tokens" in error_of(post(srv, {k: v for k, v in ok.items() if k != "max_tokens"}), 400)
    assert "horizon-test" in error_of(post(srv, {**ok, "model": "claude-opus-4"}), 404, "not_found_error")
    thinking = {"type": "enabled", "budget_tokens": 1000}
    assert "greater than or equal to 1024" in error_of(post(srv, {**ok, "max_tokens": 2000, "thinking": thinking}), 400)
    thinking["budget_tokens"] = 2000
    assert "must be greater than `thinking.budget_tokens`" in error_of(post(srv, {**ok, "max_tokens": 2000,
                                                                                "thinking": thinking}), 400)
    forced = {**ok, "tools": [WEATHER], "tool_choice": {"type": "any"}, "thinking": {"type": "adaptive"}}
    assert "forces tool use" in error_of(post(srv, forced), 400)
    big = error_of(post(srv, {**ok, "max_tokens": 5000}), 400)
    n, _ = srv.service.count_tokens(plan_request(MessagesRequest.model_validate(ok), srv.service,
                                                 srv.app.state.signer).request)
    assert big == (f"input length and `max_tokens` exceed context limit: {n} + 5000 > 2048, decrease input length "
                   "or `max_tokens` and try again")
    long = {**ok, "messages": [{"role": "user", "content": "word " * 2100}], "max_tokens": 10}
    assert error_of(post(srv, long), 400).startswith("prompt is too long: ")  # what clients match
    prefill = {**ok, "messages": [USER, {"role": "assistant", "content": "Sure"}]}
    assert "messages[1]: the last message must be a user message" in error_of(post(srv, prefill), 400)
    late = {**ok, "messages": [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                                        "name": "get_weather", "input": {}}]},
                               {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                            {"type": "tool_result", "tool_use_id": "toolu_1"}]}]}
    assert "messages[2].content[1]: tool_result blocks must come before" in error_of(post(srv, late), 400)
    orphan = {**ok, "messages": [USER, {"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]}
    assert "messages[2].content[0]: tool_result for 'toolu_9'" in error_of(post(srv, orphan), 400)
    redacted = {**ok, "messages": [USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                                   USER]}
    assert "messages[1].content[0]: redacted_thinking" in error_of(post(srv, redacted), 400)
    document = {**ok, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}
    assert "document" in error_of(post(srv, document), 400)
    server_tool = {**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    assert "tools[0]: tool type 'web_search_20250305' is not supported" in error_of(post(srv, server_tool), 400)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "not base64!"}}
    assert "content[0].source.data: not valid base64" in error_of(
        post(srv, {**ok, "messages": [{"role": "user", "content": [image]}]}), 400)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[USER])
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(model=MODEL, max_tokens=1100, messages=[USER],
                               thinking={"type": "enabled", "budget_tokens": 512})


def test_a_full_queue_answers_529_overloaded(tmp_path):
    with busy_server(tmp_path) as busy:
        message = error_of(post(busy, {"model": MODEL, "max_tokens": 4, "messages": [USER]}), 529, "overloaded_error")
        assert "busy" in message
        with pytest.raises(anthropic.InternalServerError) as e:
            sdk(busy).messages.create(model=MODEL, max_tokens=4, messages=[USER])
        assert e.value.status_code == 529


# --- disconnects, restarts, policies ---------------------------------------------------------------------------------
def test_a_client_that_disconnects_frees_its_request_at_once(srv):
    body = {"model": MODEL, "max_tokens": 1100, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [USER]}
    generated = srv.engine.stats.tokens_generated
    with never_ends(srv):
        with httpx.Client(headers={"x-api-key": srv.api_key}) as http:
            with http.stream("POST", srv.url + "/v1/messages", json={**body, "stream": True}) as r:
                seen = 0
                for line in r.iter_lines():
                    seen += line == "event: content_block_delta"
                    if seen == 3:
                        break
        m = wait_idle(srv)
        assert m["slots_free"] == srv.engine.config.max_num_seqs and m["blocks_used"] == m["blocks_prefix_cache"]
        with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up is cancelled too
            post(srv, body, timeout=0.3)
    m = wait_idle(srv)
    assert m["slots_free"] == srv.engine.config.max_num_seqs and m["blocks_used"] == m["blocks_prefix_cache"]
    assert srv.engine.stats.tokens_generated - generated < 1100  # neither ran to its end (1100 tokens each)


def test_signatures_verify_across_a_restart_and_only_with_the_same_key(srv, client, tmp_path):
    ask = dict(model=MODEL, max_tokens=3, thinking={"type": "adaptive"}, output_config={"effort": "high"})
    with LiveServer(tmp_path) as before:
        first = sdk(before).messages.create(**ask, messages=[USER])
    history = [USER, {"role": "assistant", "content": first.content}, {"role": "user", "content": "Thanks"}]
    with LiveServer(tmp_path) as after:  # the same key file
        assert sdk(after).messages.create(**ask, messages=history).content[0].type == "thinking"
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]"):
        client.messages.create(**ask, messages=history)  # another key
    with LiveServer(tmp_path / "warn", history_policy="warn") as lenient:
        r = post(lenient, {**ask, "messages": [*history[:1], {"role": "assistant", "content": [
            b.model_dump() for b in first.content] + [{"type": "redacted_thinking", "data": "x"}]}, history[2]]})
        assert r.status_code == 200, r.text
        warning = r.headers["x-horizon-warning"]
        assert "messages[1].content[0]: the thinking block's signature does not verify" in warning
        assert "messages[1].content" in warning and "redacted_thinking" in warning


def test_count_tokens_matches_the_prompt_that_is_served(srv, client):
    ask = dict(model=MODEL, system="You are terse.", tools=[WEATHER], messages=[{"role": "user", "content": "x y z"}])
    n = client.messages.count_tokens(**ask).input_tokens
    m = client.messages.create(**ask, max_tokens=2)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    thinking = client.messages.count_tokens(**ask, thinking={"type": "adaptive"}).input_tokens
    assert thinking == n + 1  # the generation prompt opens the thinking block


# --- the translation itself --------------------------------------------------------------------------------------
def test_budget_tokens_state_the_smallest_tier_that_covers_them_and_cap_thinking_exactly():
    def config(n, max_tokens=100_000):
        body = CountTokensRequest.model_validate({"model": MODEL, "messages": [USER],
                                                  "thinking": {"type": "enabled", "budget_tokens": n}})
        return thinking_config(body, max_tokens, DEFAULT_THINKING_BUDGETS)

    assert config(1024) == ("high", 1024) and config(4096) == ("high", 4096) and config(4097) == ("max", 4097)
    assert config(50_000) == ("max", 50_000)  # above every tier: the largest, still capped at N
    for effort, tier in (("low", "low"), ("medium", "high"), ("high", "high"), ("xhigh", "max"), ("max", "max"),
                         (None, "high")):
        body = CountTokensRequest.model_validate({"model": MODEL, "messages": [USER], "thinking": {"type": "adaptive"},
                                                  "output_config": {"effort": effort}})
        assert thinking_config(body, None, DEFAULT_THINKING_BUDGETS) == (tier, None)


def test_a_signature_binds_the_tier_and_the_text(tmp_path):
    signer = ThinkingSigner(tmp_path / "k")
    sig = sign_thinking(signer, "let me think", "low")
    assert verified_tier(signer, "let me think", sig) == "low"
    assert verified_tier(signer, "let me think!", sig) is None
    assert verified_tier(signer, "let me think", "max" + sig[3:]) is None
    assert verified_tier(signer, "let me think", None) is None
    assert verified_tier(ThinkingSigner(tmp_path / "other"), "let me think", sig) is None


def test_malformed_calls_become_text_and_never_a_tool_use_a_client_cannot_run():
    reply = Reply(None, frozenset({"get_weather"}), sign=None)
    events = reply.feed([
        TextDelta("Checking."), ToolCallStart(0, "call_a", "get_weather"), ToolCallArgs(0, '{"city": "Oslo"}'),
        ToolCallEnd(0),
        ToolCallStart(1, "call_b", "get_weather"), ToolCallArgs(1, '{"city": "Os'),
        ErrorDelta("tool_call_not_closed", "cut", 1), ToolCallEnd(1),
        ToolCallStart(2, "call_c", "launch_rockets"), ToolCallArgs(2, "{}"), ToolCallEnd(2),
        ToolCallStart(3, "call_d", ""), ToolCallArgs(3, "not json"), ToolCallEnd(3),
        ToolCallStart(4, "call_e", ""), ToolCallEnd(4),  # nothing written: nothing to report
    ]) + reply.finish()
    assert reply.content == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "text", "text": '{"name": "get_weather", "arguments": {"city": "Os}'},
        {"type": "text", "text": '{"name": "launch_rockets", "arguments": {}}'},
        {"type": "text", "text": "not json"},
    ] and reply.tool_uses == 1
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e for e in events if e["type"] == "content_block_stop"]
    assert [e["index"] for e in starts] == [e["index"] for e in stops] == [0, 1, 2, 3, 4]
    assert starts[1]["content_block"]["input"] == {}  # the input arrives in its input_json_delta


def test_thinking_closes_with_its_signature_before_the_answer():
    reply = Reply("high", frozenset(), sign=lambda text, tier: f"{tier}:{text}")
    events = reply.begin() + reply.feed([ReasoningDelta("hm"), ReasoningDelta("m"), TextDelta("Hi")]) + reply.finish()
    kinds = [e["delta"]["type"] if e["type"] == "content_block_delta" else e["type"] for e in events]
    assert kinds == ["content_block_start", "thinking_delta", "thinking_delta", "signature_delta",
                     "content_block_stop", "content_block_start", "text_delta", "content_block_stop"]
    assert reply.content == [{"type": "thinking", "thinking": "hmm", "signature": "high:hmm"},
                             {"type": "text", "text": "Hi"}]
