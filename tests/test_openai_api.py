"""OpenAI Chat Completions against a live server, driven by the official `openai` SDK (and raw httpx for SSE).

The bundled model has random weights: its text is gibberish, so tests check shapes, grammars, the
engine's own numbers and exact round trips, never what the text says. Greedy decoding (temperature 0)
or seeds make every run the same.
"""

import json
import time

import httpx
import jsonschema
import openai
import pytest

from .live import LiveServer, busy_server

MODEL = "horizon-test"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("keys")) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0)


def special(srv, name: str) -> str:
    return str(getattr(srv.service.tokenizer.special, name))


def chat(client, **kw):
    extra = {k: kw.pop(k) for k in ("thinking_budget",) if k in kw}  # Horizon fields the SDK has no argument for
    return client.chat.completions.create(**{"model": MODEL, "messages": USER, "max_tokens": 16, **kw},
                                          extra_body=extra or None)


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE body, checking the framing: each event is one data line and a blank line."""
    events = []
    for block in response.read().decode().split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def accumulate(chunks) -> dict:
    """A streamed choice rebuilt the way clients do it: concatenate the deltas per field and per call index."""
    msg = {"content": "", "reasoning_content": None, "tool_calls": {}, "finish_reason": None, "role": None}
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            msg["role"] = msg["role"] or d.role
            msg["content"] += d.content or ""
            extra = d.model_extra or {}
            if "reasoning_content" in extra:
                msg["reasoning_content"] = (msg["reasoning_content"] or "") + extra["reasoning_content"]
            if "thinking_tier" in extra:
                msg["thinking_tier"] = extra["thinking_tier"]
            for tc in d.tool_calls or []:
                call = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None and tc.function.arguments == ""  # id and name come first, alone
                    call["id"], call["name"] = tc.id, tc.function.name
                elif tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            msg["finish_reason"] = msg["finish_reason"] or choice.finish_reason
    return msg


# --- the basics -------------------------------------------------------------------------------------------
def test_non_streaming_chat_completion_shape_usage_and_metrics(srv, client):
    r = chat(client, max_completion_tokens=12, temperature=0, user="u-1", metadata={"x": "y"}, store=False)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert abs(r.created - time.time()) < 60
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert c.message.model_extra["thinking_tier"] == "off" and c.message.model_extra["reasoning_content"] is None
    u = r.usage
    assert u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    rendered = httpx.post(srv.url + "/tokenize", json={"messages": USER}).json()
    assert u.prompt_tokens == rendered["count"]
    assert u.completion_tokens_details.reasoning_tokens == 0 and u.prompt_tokens_details.cached_tokens == 0
    if c.finish_reason == "length":
        assert u.completion_tokens == 12
    metrics = httpx.get(srv.url + "/metrics").text
    assert "horizon_time_to_first_token_seconds_count" in metrics
    count = [line for line in metrics.splitlines() if line.startswith("horizon_time_to_first_token_seconds_count")]
    assert float(count[0].split()[-1]) >= 1
    assert 'horizon_tokens_total{kind="completion"}' in metrics


def test_streaming_rebuilds_the_non_streaming_message_with_thinking_and_tools(srv, client):
    kw = dict(reasoning_effort="low", tools=TOOLS, tool_choice="required", max_tokens=80, seed=3,
              logit_bias={special(srv, "think_end"): 7})  # thinking ends after a few tokens
    whole = chat(client, **kw)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
        whole.usage.completion_tokens_details.reasoning_tokens > 0
    streamed, message = accumulate(chunks[:-1]), whole.choices[0].message
    assert streamed["role"] == "assistant" and streamed["thinking_tier"] == "low"
    assert streamed["reasoning_content"] == message.model_extra["reasoning_content"]
    assert streamed["content"] == (message.content or "")
    assert streamed["finish_reason"] == whole.choices[0].finish_reason == "tool_calls"
    calls = [streamed["tool_calls"][i] for i in sorted(streamed["tool_calls"])]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (tc.function.name, tc.function.arguments) for tc in message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)


def test_sse_framing_and_done(srv):
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "stream": True, "temperature": 0}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {srv.api_key}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0] is chunks[-1]  # no usage chunk without stream_options


def test_message_forms_and_reasoning_effort_tiers(srv, client):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    r = chat(client, messages=messages, max_tokens=2)
    rendered = httpx.post(srv.url + "/tokenize", json={"messages": messages}).json()
    assert r.usage.prompt_tokens == rendered["count"]
    for effort, tier in [("none", "off"), ("minimal", "low"), ("low", "low"), ("medium", "high"), ("high", "high"),
                         ("xhigh", "max"), ("max", "max"), (None, "off")]:
        r = chat(client, max_tokens=2, **({"reasoning_effort": effort} if effort else {}))
        message = r.choices[0].message.model_extra
        assert message["thinking_tier"] == tier
        assert message["reasoning_content"] is None if tier == "off" else isinstance(message["reasoning_content"], str)


def test_max_tokens_defaults_to_what_the_window_leaves(srv, client):
    def user_turn(n_tokens):  # one token per word in the bundled vocabulary
        words = n_tokens
        for _ in range(5):
            msgs = [{"role": "user", "content": " ".join(["word"] * words)}]
            count = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()["count"]
            if count == n_tokens:
                return msgs
            words += n_tokens - count
        raise AssertionError("could not size the prompt")

    window = srv.service.context_window
    no_end = {special(srv, "assistant_end"): -100, special(srv, "end_of_text"): -100}
    r = client.chat.completions.create(model=MODEL, messages=user_turn(window - 3), logit_bias=no_end)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user_turn(window))
    err = error_of(e.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert f"maximum context length is {window} tokens. However, your messages resulted in {window}" in err["message"]


# --- tools and formats -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_tool_calls_validate_against_their_schemas(client, seed):
    schemas = {"get_weather": WEATHER, "add": ADD}
    # 128 tokens: the random model's sampled calls (an integer may run to any length) ended within them for 200
    # seeds of 200, within 48 for 121-133 of 200 (which seeds, depends on how the sampler draws)
    r = chat(client, tools=TOOLS, tool_choice="required", max_tokens=128, seed=seed)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls and c.message.content is None
    for tc in c.message.tool_calls:
        assert tc.type == "function" and tc.id.startswith("call_")
        jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])
    r = chat(client, tools=TOOLS, max_tokens=128, seed=seed,
             tool_choice={"type": "function", "function": {"name": "add"}})
    (tc,) = r.choices[0].message.tool_calls  # a named function: exactly one call, to it
    assert r.choices[0].finish_reason == "tool_calls" and tc.function.name == "add"
    jsonschema.validate(json.loads(tc.function.arguments), ADD)


def test_parallel_tool_calls_false_allows_one_call(client):
    for seed in range(3):
        r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=48, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1


def test_strict_tools_under_auto_are_held_to_their_schema(srv, client):
    # the bias makes the model open a call at once; the grammar then holds the call to the schema
    r = chat(client, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False, max_tokens=48, temperature=0,
             logit_bias={special(srv, "tool_call"): 100})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    for tc in calls:
        jsonschema.validate(json.loads(tc.function.arguments), {"get_weather": WEATHER, "add": ADD}[tc.function.name])


def test_tool_choice_none_keeps_the_model_from_calling_and_broken_calls_do_not_fail(srv, client):
    loose = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]  # not strict
    push = {special(srv, "tool_call"): 100}  # the client itself pushes the model to call
    r = chat(client, tools=loose, tool_choice="none", logit_bias=push, max_tokens=10, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    assert "<｜tool_call｜>" not in json.dumps(r.to_dict())
    # under auto the same push can only make calls to the declared tool, with JSON-object arguments
    r = chat(client, tools=loose, tool_choice="auto", logit_bias=push, max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    # a call cut off by max_tokens is reported, not fatal, and goes back into a history without trouble
    r = chat(client, tools=loose, tool_choice="auto", logit_bias=push, max_tokens=6, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and "tool_call_not_closed" in {e["code"] for e in c.model_extra["parse_errors"]}
    again = chat(client, tools=loose, max_tokens=4,
                 messages=USER + [c.message.to_dict(), {"role": "user", "content": "and now?"}])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # a broken call in the history (another model's) goes back in without trouble, with a warning
    broken = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}]}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, tools=loose, max_tokens=4, messages=USER + [broken, {"role": "tool", "tool_call_id": "call_1",
                                                                         "content": "error: bad JSON"}])
    assert raw.parse().choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "invalid_tool_arguments" in raw.headers["x-horizon-warning"]


def test_response_format_with_tools_is_that_json_or_calls(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(4):  # which of the two a random model picks is its business; both must be well-formed
        c = chat(client, tools=TOOLS, response_format=fmt, max_tokens=128, seed=seed).choices[0]  # (as above)
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and not c.message.content
            for tc in c.message.tool_calls:
                jsonschema.validate(json.loads(tc.function.arguments), {"get_weather": WEATHER, "add": ADD}[
                    tc.function.name])
        else:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), schema)


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_response_format_answers_are_valid_json(client, kind):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = ({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
           if kind == "json_schema" else {"type": "json_object"})
    for seed in range(2):
        r = chat(client, response_format=fmt, max_tokens=40, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, schema if kind == "json_schema" else {"type": "object"})


# --- multi-turn history ----------------------------------------------------------------------------------
def tool_turn(srv, client, **kw):
    """Turn 1 of a tool loop with thinking on; the call is forced and its arguments pinned by the schema.

    Random weights write text whose tokens are not what the tokenizer would make of that text, so a
    free-running turn never re-renders to the same tokens. Here thinking is closed at once (a logit
    bias on <｜/think｜>: reasoning_content is "") and the grammar leaves one way to write the call,
    so the reply is exactly what re-rendering the returned message gives.
    """
    city = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city, "strict": True}}]
    r = chat(client, tools=tools, reasoning_effort="low", max_tokens=40, seed=0,
             tool_choice={"type": "function", "function": {"name": "get_weather"}},
             logit_bias={special(srv, "think_end"): 100}, **kw)
    return tools, r


def test_tool_round_trip_with_thinking_resumes_from_the_cache(srv, client):
    tools, r = tool_turn(srv, client)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "" and message.model_extra["thinking_tier"] == "low"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    history = USER + [message.to_dict(), {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                          "content": '{"temperature": 21}'}]
    second = chat(client, messages=history, tools=tools, reasoning_effort="low", max_tokens=6, seed=1)
    # everything turn 1 computed is reused: its prompt and every token it generated but the last
    expected = r.usage.prompt_tokens + r.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert second.usage.prompt_tokens > expected


def test_round_trip_with_free_running_thinking_is_accepted(srv, client):
    r = chat(client, tools=TOOLS, tool_choice="required", reasoning_effort="high", max_tokens=60, seed=5,
             logit_bias={special(srv, "think_end"): 5})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] and message.tool_calls
    history = USER + [message.to_dict()] + [{"role": "tool", "tool_call_id": tc.id, "content": "ok"}
                                            for tc in message.tool_calls]
    second = chat(client, messages=history, tools=TOOLS, reasoning_effort="high", max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # `reasoning` is accepted as the name of the thinking too
    renamed = dict(history[1])
    renamed["reasoning"] = renamed.pop("reasoning_content")
    chat(client, messages=[history[0], renamed, *history[2:]], tools=TOOLS, reasoning_effort="high", max_tokens=2)


def test_a_turn_sent_back_without_its_thinking_is_restored_and_an_unknown_one_rejected(srv, client):
    tools, r = tool_turn(srv, client)
    stripped = r.choices[0].message.to_dict()
    del stripped["reasoning_content"], stripped["thinking_tier"]  # what a client without a reasoning field sends
    history = USER + [stripped, {"role": "tool", "tool_call_id": stripped["tool_calls"][0]["id"], "content": "21"}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=history, tools=tools,
                                                           reasoning_effort="low", max_tokens=2)
    assert raw.headers["x-horizon-restored"] == "1" and raw.parse().choices
    # an edited earlier message: not the conversation the turn was generated in, so nothing is restored
    edited = [{"role": "user", "content": "What is the weather in Lyon?"}, *history[1:]]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=edited, tools=tools, reasoning_effort="low")
    err = error_of(e.value)
    assert e.value.status_code == 400 and err["param"] == "messages[1]" and err["type"] == "invalid_request_error"
    assert err["code"] == "missing_thinking" and "missing_thinking" in err["message"] and e.value.body == err
    # the same turn in an earlier, finished tool loop is fine under the default policy
    finished = edited + [{"role": "assistant", "content": "It is 21."}, {"role": "user", "content": "Thanks!"}]
    assert chat(client, messages=finished, tools=tools, reasoning_effort="low", max_tokens=2).choices
    # and with thinking off nothing is checked
    assert chat(client, messages=edited, tools=tools, max_tokens=2).choices


def test_warn_policy_serves_with_a_warning_header(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("warn"), history_policy="warn") as warn:
        client = openai.OpenAI(base_url=warn.url + "/v1", api_key=warn.api_key, max_retries=0)
        call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        history = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=history, tools=TOOLS,
                                                               reasoning_effort="low", max_tokens=2)
        warning = raw.headers["x-horizon-warning"]
        assert "messages[1]" in warning and "missing_thinking" in warning
        assert raw.parse().choices[0].finish_reason in ("stop", "length", "tool_calls")


# --- sampling options ------------------------------------------------------------------------------------
def test_n_choices_use_seed_plus_i(client):
    both = chat(client, n=2, seed=11, max_tokens=8)
    assert [c.index for c in both.choices] == [0, 1]
    first_alone, second_alone = chat(client, seed=11, max_tokens=8), chat(client, seed=12, max_tokens=8)
    assert both.choices[0].message.content == first_alone.choices[0].message.content
    assert both.choices[1].message.content == second_alone.choices[0].message.content
    assert both.choices[0].message.content != both.choices[1].message.content
    assert both.usage.prompt_tokens == first_alone.usage.prompt_tokens  # the prompt counts once
    assert both.usage.completion_tokens == first_alone.usage.completion_tokens + second_alone.usage.completion_tokens
    streamed = list(chat(client, n=2, seed=11, max_tokens=8, stream=True))
    for i in (0, 1):
        mine = [ch for ch in streamed if ch.choices and ch.choices[0].index == i]
        assert accumulate(mine)["content"] == both.choices[i].message.content


def test_logprobs_shape(srv, client):
    r = chat(client, logprobs=True, top_logprobs=3, max_tokens=8, temperature=0)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens  # thinking off: every token is an answer token
    for e in entries:
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        assert len(e.top_logprobs) == 3 and e.logprob <= e.top_logprobs[0].logprob + 1e-6  # greedy: the best
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert all(bytes(t.bytes).decode("utf-8", errors="replace") == t.token for t in e.top_logprobs)
    answer = b"".join(bytes(e.bytes) for e in entries if not e.token.startswith("<｜"))
    assert answer.decode("utf-8", errors="replace") == r.choices[0].message.content
    # with thinking on, the thinking tokens are listed apart
    r = chat(client, logprobs=True, reasoning_effort="low", max_tokens=12, seed=2,
             logit_bias={special(srv, "think_end"): 5})
    lp = r.choices[0].logprobs.model_extra["reasoning_content"]
    assert len(lp) == r.usage.completion_tokens_details.reasoning_tokens
    assert len(lp) + len(r.choices[0].logprobs.content) == r.usage.completion_tokens


def test_stop_strings_cut_the_answer(srv, client):
    no_end = {special(srv, "assistant_end"): -100, special(srv, "end_of_text"): -100}
    free = chat(client, max_tokens=24, temperature=0, logit_bias=no_end)
    text = free.choices[0].message.content
    assert len(text) > 12, text
    stop = text[8:11]
    for given in (stop, [stop, "never-appears"]):
        cut = chat(client, max_tokens=24, temperature=0, logit_bias=no_end, stop=given)
        assert cut.choices[0].message.content == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


# --- errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param, words", [
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]", "unknown role"),
    ({"messages": []}, "messages", "at least 1"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "no tools are offered"),
    ({"tool_choice": "sometimes"}, "tool_choice", "Input should be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Invalid type: foo"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object", "required": "a"}}}]},
     "tools[0]", "Expected array for 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "defined twice"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"stop": ""}, "stop", "must not be empty"),
    ({"response_format": {"type": "xml"}}, "response_format", "does not match any of the expected tags"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "messages[0]",
     "content[0] must be a part"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "[0, 4096)"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "Input should be"),
    ({"max_tokens": 5000}, "max_tokens", "5000 in the completion"),
    ({"messages": [{"role": "user", "content": "word " * 2100}]}, "max_tokens", "maximum context length is 2048"),
    ({"thinking_budget": "bogus"}, "thinking_budget", "'none', 'low', 'high', 'max' or an integer >= 1"),
    ({"thinking_budget": 0}, "thinking_budget", "an integer >= 1"),
    ({"thinking_budget": "max", "reasoning_effort": "low"}, "thinking_budget", "disagrees with reasoning_effort"),
])
def test_bad_requests_are_400s_in_openais_shape(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    err = error_of(e.value)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert words in err["message"], err


def test_context_overflow_names_the_numbers_in_openais_words(srv, client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_completion_tokens=2040)
    err = error_of(e.value)
    prompt = int(err["message"].split("(")[1].split()[0])
    assert err["code"] == "context_length_exceeded", err  # what clients match (litellm, langchain)
    assert (f"This model's maximum context length is 2048 tokens. However, you requested {prompt + 2040} tokens "
            f"({prompt} in the messages, 2040 in the completion)") in err["message"]


def test_malformed_json_and_wrong_model(srv, client):
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {srv.api_key}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="gpt-4o")
    err = error_of(e.value)
    assert e.value.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-4o" in err["message"]


def test_a_full_queue_is_a_429(tmp_path_factory):
    with busy_server(tmp_path_factory.mktemp("busy")) as busy:
        client = openai.OpenAI(base_url=busy.url + "/v1", api_key=busy.api_key, max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as e:
                chat(client, stream=stream)
            err = error_of(e.value)
            assert e.value.status_code == 429 and err["type"] == "rate_limit_error" and err["code"] == "server_busy"
        assert busy.engine.metrics()["running"] == 1  # the request that holds the slot, nothing more


def test_an_engine_error_after_streaming_started_is_a_final_error_event(srv, client, monkeypatch):
    forward, calls = srv.engine.model.forward_batch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("the accelerator caught fire")
        return forward(*args, **kwargs)

    monkeypatch.setattr(srv.engine.model, "forward_batch", failing)
    body = {"model": MODEL, "messages": USER, "max_tokens": 50, "stream": True,
            "logit_bias": {special(srv, "assistant_end"): -100, special(srv, "end_of_text"): -100}}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {srv.api_key}"}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) > 3
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "caught fire" in error["message"]
    monkeypatch.undo()
    # the SDK raises it too, after the chunks that came before
    calls.clear()
    monkeypatch.setattr(srv.engine.model, "forward_batch", failing)
    got = []
    with pytest.raises(openai.APIError, match="caught fire"):
        for chunk in chat(client, stream=True, max_tokens=50, logit_bias=body["logit_bias"]):
            got.append(chunk)
    assert got
    # without streaming it is a 500 in OpenAI's shape
    calls.clear()
    with pytest.raises(openai.InternalServerError) as e:
        chat(client, max_tokens=50, logit_bias=body["logit_bias"])
    err = error_of(e.value)
    assert e.value.status_code == 500 and err["type"] == "server_error" and "caught fire" in err["message"]


# --- clients that go away --------------------------------------------------------------------------------
def wait_idle(engine, timeout=10.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = engine.metrics()
        if m["running"] == 0 and m["queue_length"] == 0:
            return m
        time.sleep(0.02)
    raise AssertionError(f"the engine is still busy: {engine.metrics()}")


def endless(srv, **kw) -> dict:
    """A request that would run for 1500 tokens: the turn's end tokens are banned."""
    return {"model": MODEL, "messages": USER, "max_tokens": 1500, **kw,
            "logit_bias": {special(srv, "assistant_end"): -100, special(srv, "end_of_text"): -100}}


def test_disconnecting_mid_stream_frees_the_cache(srv):
    wait_idle(srv.engine)
    before = srv.engine.metrics()
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=endless(srv, stream=True),
                      headers={"Authorization": f"Bearer {srv.api_key}"}) as r:
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
        assert len(got) >= 3
    m = wait_idle(srv.engine)
    assert m["tokens_generated"] - before["tokens_generated"] < 1000  # cancelled, not run to the end
    assert m["blocks_used"] == m["blocks_prefix_cache"] and m["slots_free"] == before["slots_free"]
    assert m["prefix_entries"] == before["prefix_entries"]  # a cancelled turn is not kept for reuse


def test_disconnecting_from_a_non_streaming_request_frees_the_cache(srv):
    wait_idle(srv.engine)
    before = srv.engine.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json=endless(srv), timeout=0.5,
                   headers={"Authorization": f"Bearer {srv.api_key}"})
    m = wait_idle(srv.engine)
    assert m["tokens_generated"] - before["tokens_generated"] < 1000
    assert m["blocks_used"] == m["blocks_prefix_cache"] and m["slots_free"] == before["slots_free"]
