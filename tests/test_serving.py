"""The serving seam (`horizon.serving`): one request path for both HTTP APIs and the in-process `EngineClient`.

Seeded property checks at temperature 1 (random weights sample all over the vocabulary, so a guarantee that
holds here is held by the masks, not by the model's taste): schema-valid answers with thinking on, no tool call
without tools, forced arguments that follow a non-strict schema, exact thinking caps, in both APIs and through
`EngineClient`; the in-process client and the OpenAI route sample the same tokens; thinking the client dropped
is restored only for the conversation and tenant it was generated in.
"""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from horizon.agent.client import StepRequest
from horizon.agent.local import EngineClient
from horizon.agent.tool import Tool as AgentTool
from horizon.engine import Engine, EngineConfig
from horizon.serving import ChatRequest, Conversation, ModelService, Tool, ToolPolicy, TurnStore
from horizon.serving.turns import restored, turn_form

from .live import LiveServer, engine_requests

MODEL = "horizon-test"
BUDGETS = {"low": 8, "high": 16, "max": 32}
SEEDS = range(12)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
USER = [{"role": "user", "content": "Tell me about the weather."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("keys"), api_key=None, api_keys={"key-a": "tenant-a", "key-b": "tenant-b"},
                    generation_config={"thinking_budgets": BUDGETS}) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="key-a", max_retries=0)


@pytest.fixture(scope="module")
def ant(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="key-a", max_retries=0)


@pytest.fixture(scope="module")
def local(srv):
    """An EngineClient over its own engine on the same model (the server's engine runs on its own thread)."""
    engine = Engine(srv.engine.model, srv.service.tokenizer, EngineConfig(max_num_seqs=4, max_model_len=2048,
                                                                          max_batch_tokens=256),
                    generation_config={"thinking_budgets": BUDGETS})
    return EngineClient(engine, srv.service.tokenizer, MODEL)


class Weather(AgentTool):
    name, description, parameters = "get_weather", "weather in a city", WEATHER

    def call(self, arguments):
        return "sunny"


# --- the guarantees, in every path ---------------------------------------------------------------------------
def test_schema_valid_answers_with_thinking_on_in_every_path(oai, ant, local):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in SEEDS:
        r = oai.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, reasoning_effort="low",
                                        max_tokens=60, seed=seed, temperature=1.0)
        c = r.choices[0]
        assert c.finish_reason == "stop" and c.message.model_extra["reasoning_content"] is not None
        jsonschema.validate(json.loads(c.message.content), PERSON)
        assert r.usage.completion_tokens_details.reasoning_tokens <= BUDGETS["low"]
    for seed in SEEDS[:4]:  # Anthropic has no seed: temperature 1 draws differ anyway
        m = ant.messages.create(model=MODEL, max_tokens=60, messages=USER, thinking={"type": "adaptive"},
                                output_config={"effort": "low", "format": {"type": "json_schema", "schema": PERSON}})
        assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn", seed
        jsonschema.validate(json.loads(m.content[1].text), PERSON)
    turns = local.complete_many([StepRequest(USER, [], tier="low", max_tokens=60, temperature=1.0, seed=seed,
                                             response_schema=PERSON) for seed in SEEDS])
    for _, turn in turns:
        assert turn.finish_reason == "stop" and turn.thinking is not None
        jsonschema.validate(json.loads(turn.text), PERSON)


def test_a_small_max_tokens_closes_thinking_early_to_leave_room_for_the_schema(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in SEEDS[:6]:  # the tier allows 32 thinking tokens; 48 in all leaves 16 for the answer at least
        r = oai.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, reasoning_effort="max",
                                        max_tokens=48, seed=seed)
        assert r.usage.completion_tokens_details.reasoning_tokens <= 48 - 16
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_no_tool_call_without_tools_in_every_path(srv, oai, ant, local):
    call = srv.service.tokenizer.special.tool_call
    push = {str(call): 100}  # the client itself pushes the model toward a call: the ban holds anyway
    for seed in SEEDS:
        r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, seed=seed, logit_bias=push,
                                        reasoning_effort="low" if seed % 2 else None)
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    for _ in range(3):
        m = ant.messages.create(model=MODEL, max_tokens=12, messages=USER)
        assert all(b.type != "tool_use" for b in m.content) and m.stop_reason != "tool_use"
    for _, turn in local.complete_many([StepRequest(USER, [], max_tokens=12, temperature=1.0, seed=seed)
                                        for seed in SEEDS]):
        assert not turn.calls and call not in turn.response["token_ids"]


def test_forced_non_strict_arguments_follow_the_schema_in_every_path(oai, ant, local):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]  # strict not set
    for seed in SEEDS:
        # one call: with parallel calls the random model may start another that max_tokens cuts off
        r = oai.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=40, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather" and r.choices[0].finish_reason != "length"
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), WEATHER)
    for _ in range(3):
        m = ant.messages.create(model=MODEL, max_tokens=40, messages=USER,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                tools=[{"name": "get_weather", "input_schema": WEATHER}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and m.stop_reason == "tool_use"
        for b in uses:
            jsonschema.validate(b.input, WEATHER)
    for _, turn in local.complete_many([StepRequest(USER, [Weather()], tool_choice="get_weather", max_tokens=40,
                                                    temperature=1.0, seed=seed) for seed in SEEDS]):
        assert len(turn.calls) == 1
        jsonschema.validate(json.loads(turn.calls[0].arguments), WEATHER)


def test_under_auto_only_declared_tools_can_be_called(srv, oai):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    push = {str(srv.service.tokenizer.special.tool_call): 100}
    names = set()
    for seed in SEEDS:
        r = oai.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=40, seed=seed,
                                        logit_bias=push)
        for c in r.choices[0].message.tool_calls or ():
            names.add(c.function.name)
            assert isinstance(json.loads(c.function.arguments), dict)
    assert names == {"get_weather"}


def test_thinking_caps_are_exact_in_every_path(oai, ant, local):
    for tier, effort in (("low", "low"), ("high", "high"), ("max", "xhigh")):
        for seed in SEEDS[:4]:  # a draw may end thinking early; none may pass the cap, the closing token counted
            r = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort=effort, max_tokens=48,
                                            seed=seed)
            assert r.usage.completion_tokens_details.reasoning_tokens <= BUDGETS[tier]
        r = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort=effort, max_tokens=48,
                                        temperature=0)
        assert r.usage.completion_tokens_details.reasoning_tokens == BUDGETS[tier]  # greedy thinks to the cap
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=48, temperature=0,
                                    extra_body={"thinking_budget": 5})
    assert r.usage.completion_tokens_details.reasoning_tokens == 5 and r.choices[0].message.model_extra[
        "thinking_tier"] == "low"  # the smallest tier whose budget covers 5
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=48, temperature=0,
                                    extra_body={"thinking_budget": "max"})
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGETS["max"]
    m = ant.messages.create(model=MODEL, max_tokens=48, messages=USER, thinking={"type": "adaptive"},
                            output_config={"effort": "low"}, extra_body={"temperature": 0})
    assert m.content[0].type == "thinking" and m.content[0].thinking  # Anthropic's usage does not split thinking
    for _, turn in local.complete_many([StepRequest(USER, [], tier=t, max_tokens=48, temperature=0) for t in BUDGETS]):
        assert turn.usage.reasoning_tokens == BUDGETS[turn.message["thinking_tier"]]


def test_engine_client_samples_exactly_what_the_openai_route_samples(srv, oai, local):
    tools = [Weather()]
    for seed, tier, choice in ((3, "low", "auto"), (4, None, "get_weather"), (5, "high", None)):
        req = StepRequest(USER, tools, tier=tier, tool_choice=choice, max_tokens=30, temperature=1.0, seed=seed)
        body, turn = local.complete(req)
        over_http = oai.chat.completions.create(**body, logprobs=True)
        choice0 = over_http.choices[0]
        streamed = [e["token"] for e in choice0.logprobs.model_extra["reasoning_content"]]
        streamed += [e.token for e in choice0.logprobs.content]
        ids = turn.response["token_ids"]
        assert len(streamed) == len(ids) == over_http.usage.completion_tokens
        tok = srv.service.tokenizer
        assert streamed == [tok.special_text.get(t) or tok.token_bytes(t).decode("utf-8", "replace") for t in ids]
        message = choice0.message.to_dict()
        assert message["reasoning_content"] == turn.message["reasoning_content"]
        assert message.get("content") == turn.message["content"]
        assert [c["function"] for c in message.get("tool_calls", [])] == \
            [c["function"] for c in turn.message.get("tool_calls", [])]


# --- thinking kept server-side -----------------------------------------------------------------------------------
def first_turn(oai, seed=0):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required",
                                    reasoning_effort="low", max_tokens=48, seed=seed)
    return tools, r.choices[0].message.to_dict()


def second_turn(oai, tools, assistant, user=USER, **kw):
    history = user + [assistant] + [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"}
                                    for c in assistant["tool_calls"]]
    return oai.chat.completions.with_raw_response.create(model=MODEL, messages=history, tools=tools,
                                                         reasoning_effort="low", max_tokens=4, seed=1, **kw)


def test_turn_two_prompt_is_the_same_token_for_token_whether_or_not_the_client_sent_thinking(srv, oai):
    tools, assistant = first_turn(oai)
    assert assistant["reasoning_content"]
    dropped = {k: v for k, v in assistant.items() if k not in ("reasoning_content", "thinking_tier")}
    dropped["tool_calls"] = [{**c, "function": {**c["function"],  # re-serialised, as langchain-openai does
                                                "arguments": json.dumps(json.loads(c["function"]["arguments"]))}}
                             for c in assistant["tool_calls"]]
    with engine_requests(srv) as seen:
        kept = second_turn(oai, tools, assistant)
        restored_raw = second_turn(oai, tools, dropped)
    assert "x-horizon-restored" not in kept.headers and restored_raw.headers["x-horizon-restored"] == "1"
    assert seen[0].prompt_ids == seen[1].prompt_ids  # token for token


def test_no_restoration_for_another_conversation_an_edited_history_or_another_tenant(srv, oai):
    tools, assistant = first_turn(oai, seed=2)
    dropped = {k: v for k, v in assistant.items() if k not in ("reasoning_content", "thinking_tier")}
    # another conversation carrying this turn's ids and arguments
    with pytest.raises(openai.BadRequestError) as e:
        second_turn(oai, tools, dropped, user=[{"role": "user", "content": "Tell me about the tides."}])
    assert e.value.body["code"] == "missing_thinking"
    # the same conversation with an earlier message edited (a system prompt added before it)
    with pytest.raises(openai.BadRequestError):
        second_turn(oai, tools, dropped, user=[{"role": "system", "content": "Be brief."}, *USER])
    # the same conversation from another tenant
    other = openai.OpenAI(base_url=srv.url + "/v1", api_key="key-b", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        second_turn(other, tools, dropped)
    # other tools offered: the rendered prompt differs
    with pytest.raises(openai.BadRequestError):
        second_turn(oai, tools + [{"type": "function", "function": {"name": "noop"}}], dropped)
    assert second_turn(oai, tools, dropped).headers["x-horizon-restored"] == "1"  # the real one still is
    metrics = httpx.get(srv.url + "/metrics").text
    assert "horizon_thinking_restored_turns" in metrics and "horizon_thinking_unknown_turns" in metrics


def test_turn_store_is_bounded_and_matches_parsed_arguments():
    store = TurnStore(max_bytes=4096)
    message = {"role": "assistant", "content": None, "reasoning_content": "hm", "thinking_tier": "low",
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": '{"a": 1.0, "b": [1, 2]}'}}]}
    prefix = TurnStore.prefix_hash([1, 2, 3], [])
    store.record("t", prefix, message, [5, 6, 7])
    sent = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"b":[1,2],"a":1.0}'}}]}
    stored = store.find("t", prefix, sent)
    assert stored is not None and store.find("u", prefix, sent) is None
    assert store.find("t", TurnStore.prefix_hash([1, 2, 4], []), sent) is None
    assert store.find("t", TurnStore.prefix_hash([1, 2, 3], ["an image"]), sent) is None
    other = {**sent, "tool_calls": [{**sent["tool_calls"][0], "function": {"name": "f", "arguments": '{"a": 2}'}}]}
    assert store.find("t", prefix, other) is None and turn_form(other) != turn_form(sent)
    back = restored(sent, stored)
    assert back["reasoning_content"] == "hm" and back["thinking_tier"] == "low"
    assert back["tool_calls"][0]["id"] == "call_x"  # the client's id is kept
    assert back["tool_calls"][0]["function"]["arguments"] == '{"a": 1.0, "b": [1, 2]}'  # the generated text
    for i in range(100):  # older turns go first once the bytes run out
        store.record("t", TurnStore.prefix_hash([i], []), message, list(range(50)))
    assert store.nbytes <= 4096 and store.find("t", prefix, sent) is None and len(store) >= 1


# --- the seam's other contracts ---------------------------------------------------------------------------------
def test_a_non_strict_schema_the_grammar_cannot_hold_falls_back_to_any_object_with_a_warning(oai):
    odd = {"type": "object", "not": {"required": ["x"]}}  # llguidance does not implement `not`
    tools = [{"type": "function", "function": {"name": "f", "parameters": odd}}]
    raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=USER, tools=tools,
                                                        tool_choice="required", max_tokens=30, seed=0)
    assert "held to any JSON object" in raw.headers["x-horizon-warning"]
    for c in raw.parse().choices[0].message.tool_calls:
        assert isinstance(json.loads(c.function.arguments), dict)
    strict = [{"type": "function", "function": {"name": "f", "parameters": odd, "strict": True}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=USER, tools=strict, tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools[0]"


def test_unknown_routes_name_the_path_and_the_supported_ones(srv):
    r = httpx.post(srv.url + "/v1/completions", json={}, headers={"authorization": "Bearer key-a"})
    err = r.json()["error"]
    assert r.status_code == 404 and "POST /v1/completions is not a route" in err["message"]
    assert "POST /v1/chat/completions" in err["message"] and "POST /v1/messages" in err["message"]
    r = httpx.post(srv.url + "/v1/messages/batches", json={}, headers={"x-api-key": "key-a"})
    assert r.status_code == 404 and r.json()["type"] == "error" and "/v1/messages/batches" in r.json()["error"][
        "message"]


def test_tokenize_accepts_vllms_prompt_field(srv):
    a = httpx.post(srv.url + "/tokenize", json={"prompt": "hello world"}).json()
    b = httpx.post(srv.url + "/tokenize", json={"text": "hello world"}).json()
    assert a["tokens"] == b["tokens"] and a["count"] > 0
    assert httpx.post(srv.url + "/tokenize", json={"prompt": "a", "text": "b"}).status_code == 400


def test_max_model_len_past_the_window_is_an_error_not_a_clamp(srv):
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        Engine(srv.engine.model, srv.service.tokenizer, EngineConfig(max_model_len=1_000_000))


def test_requests_through_the_seam_directly(srv):
    service = ModelService(srv.engine, srv.service.tokenizer, MODEL)
    req = ChatRequest(Conversation(USER, [Tool("get_weather", WEATHER)], "low"), ToolPolicy("none"))
    prepared = service.prepare(req)
    p = prepared.params
    assert p.banned_token_ids == [srv.service.tokenizer.special.tool_call] and prepared.request.constraint is None
    assert p.max_tokens == min(2048 - len(prepared.prompt_ids), 4096 + BUDGETS["low"])  # the default
    assert p.thinking_budget == BUDGETS["low"]
    forced = service.prepare(ChatRequest(Conversation(USER, [Tool("get_weather", WEATHER)], "max"),
                                         ToolPolicy("get_weather"), max_tokens=40))
    assert forced.request.constraint.max_calls == 1 and forced.params.thinking_budget == 40 - 16  # the reserve
