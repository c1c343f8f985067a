"""Constrained decoding: a random-weight model's outputs always match their schemas; forced calls; batching."""

import json

import jsonschema
import pytest

from horizon.chat import ReasoningDelta, StreamParser, TextDelta, load_tokenizer
from horizon.engine import ConstraintError, ConstraintSpec, Engine, EngineConfig, Request, SamplingParams

from .conftest import tiny_model

TOK = load_tokenizer()

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -1.5, "maximum": 2.5}, "y": {"type": "number"}},
        "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": "string", "maxLength": 12}}, "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "exclusiveMinimum": 3, "maximum": 9}, "minItems": 1,
     "maxItems": 5},
    {"type": "object", "properties": {"color": {"enum": ["red", "gr\"een", "bl\\ue", "ünï", "tab\there"]},
                                      "ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array",
                                                                            "items": {"type": "string"}}},
     "required": ["text", "tags"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "qty": {"type": "number", "minimum": 0}},
        "required": ["id"], "additionalProperties": False}, "maxItems": 3}}, "required": ["items"],
     "additionalProperties": False},
    {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "object", "properties": {"v": {"type": "integer"}},
                                                    "required": ["v"], "additionalProperties": False}]},
    {"type": "object"},  # json_object
]
TOOLS = [
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                      "unit": {"enum": ["c", "f"]}},
                     "required": ["city", "unit"], "additionalProperties": False}),
    ("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}),
    ("search", {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20},
                                                 "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["query"], "additionalProperties": False}),
]


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model(), TOK, EngineConfig(max_num_seqs=16, max_batch_tokens=128, max_model_len=256))


def answer_text(result) -> str:
    return "".join(d.text for ev in result.events for d in ev.deltas if isinstance(d, TextDelta))


def test_200_random_weight_generations_all_match_their_schemas(engine):
    requests, schemas = [], []
    for i in range(200):
        schema = SCHEMAS[i % len(SCHEMAS)]
        schemas.append(schema)
        params = SamplingParams(max_tokens=64, temperature=1.0, seed=i)
        requests.append(Request(TOK.encode(f"request {i}"), params, constraint=ConstraintSpec.for_json(schema)))
    results = engine.generate(requests)
    for i, (res, schema) in enumerate(zip(results, schemas, strict=True)):
        text = answer_text(res)
        assert res.finish.reason == "stop", (i, res.finish, text)
        jsonschema.validate(json.loads(text), schema)
    assert engine.grammars.compiled <= len(SCHEMAS)  # compiled once per schema, then copied


def parsed(result, tools):
    parser = StreamParser(TOK, tools=[{"type": "function", "function": {"name": n, "parameters": s}}
                                      for n, s in tools])
    parser.feed(result.token_ids)
    parser.finish()
    return parser.result()


@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_names_an_offered_tool_with_valid_arguments(engine, parallel):
    spec = ConstraintSpec.for_tools(TOOLS, required=True, parallel=parallel)
    results = engine.generate([Request(TOK.encode(f"call {i}"), SamplingParams(max_tokens=80, temperature=1.0,
                                                                                 seed=i), constraint=spec)
                               for i in range(24)])
    schemas = dict(TOOLS)
    for res in results:
        turn = parsed(res, TOOLS)
        assert res.finish.reason == "stop" and not turn.errors and turn.tool_calls
        assert turn.content == ""  # forced: no text before the call
        assert parallel or len(turn.tool_calls) == 1
        for call in turn.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_named_tool_choice_calls_exactly_that_tool(engine):
    spec = ConstraintSpec.for_tools([TOOLS[1]], required=True, parallel=False)
    for res in engine.generate([Request(TOK.encode(f"n{i}"), SamplingParams(max_tokens=40, temperature=1.0, seed=i),
                                        constraint=spec) for i in range(8)]):
        (call,) = parsed(res, TOOLS).tool_calls
        assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}


def test_batches_mixing_constrained_and_free_requests_equal_each_alone():
    model = tiny_model()
    greedy = SamplingParams(max_tokens=24, temperature=0)
    requests = [Request(TOK.encode(f"mixed {i}"), greedy,
                        constraint=ConstraintSpec.for_json(SCHEMAS[i]) if i % 2 else None) for i in range(6)]

    def fresh():
        return Engine(model, TOK, EngineConfig(max_num_seqs=8, max_batch_tokens=64, max_model_len=128))

    together = fresh().generate(requests)
    for req, res in zip(requests, together, strict=True):
        alone = fresh().generate([Request(req.prompt_ids, greedy, constraint=req.constraint)])[0]
        assert res.token_ids == alone.token_ids


def test_thinking_stays_free_and_the_constraint_starts_with_the_answer(engine):
    schema = SCHEMAS[0]
    think_end = TOK.special.think_end
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, tier="low", thinking_budget=6,
                            logit_bias={think_end: -100.0})
    res = engine.generate([Request(TOK.encode("think first"), params, constraint=ConstraintSpec.for_json(schema))])[0]
    assert res.token_ids[5] == think_end  # the budget of 6 counts the end of thinking
    reasoning = "".join(d.text for ev in res.events for d in ev.deltas if isinstance(d, ReasoningDelta))
    assert reasoning and not reasoning.lstrip().startswith("{")  # not bent toward the schema
    jsonschema.validate(json.loads(answer_text(res)), schema)


@pytest.mark.parametrize("schema,reason", [
    ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "Invalid type: strnig"),
    ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
    ({"$ref": "#/nowhere"}, "does not exist"),
])
def test_invalid_or_unsupported_schemas_are_clear_client_errors(engine, schema, reason):
    with pytest.raises(ConstraintError) as err:
        engine.submit(Request([1, 2], SamplingParams(max_tokens=8), constraint=ConstraintSpec.for_json(schema)), print)
    assert reason in str(err.value) and "start:" not in str(err.value)
    assert isinstance(err.value, ValueError)
