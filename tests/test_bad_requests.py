"""Bad requests get a 4xx in the route's own API shape: never a 5xx, a traceback or a hang.

Hypothesis starts from a valid request for each body-taking route (Chat Completions, Responses, Messages,
count_tokens, /tokenize) and breaks it one way: a wrong JSON type at any level, a number out of range (NaN and
Infinity as Python's JSON extensions), nasty unicode (lone surrogates sent as `\\ud800` escapes, NUL, zero-width
and RTL marks, emoji, long strings), a broken shape, a size (thousands of messages, a 200 KB string, a body over
the limit: 413), an unknown field, a missing required field, a malformed body.

Every answer has a status < 500 and no traceback in it; a 4xx is JSON in the route's shape with a message (OpenAI:
`{"error": {"message", "type", "param", "code"}}`; under /v1/messages Anthropic's `{"type": "error", "error":
{"type", "message"}}`). A case marked `invalid` must be a 4xx: it is unambiguously invalid per the OpenAI /
Anthropic specs (a string for a bool or a number, a bool for an int, an unknown role, a missing required field, a
body that is not a JSON object, ...); types are strict, so `"stream": "yes"` is a 400. Anything else may be
served (a request the server is lenient about, an unknown field) as long as it is not a server error.
"""

from __future__ import annotations

import base64
import copy
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from horizon.engine import EngineConfig

from .live import LiveServer

MODEL = "horizon-test"
TIMEOUT = 30.0  # far above any answer here (a whole 256-token window takes ~3 s): longer is a hang
LIMIT = 1 << 20  # LiveServer's default max_body_bytes
TRACEBACK = "Traceback (most recent call last)"
CHAT, RESPONSES, MESSAGES, COUNT, TOKENIZE = ("/v1/chat/completions", "/v1/responses", "/v1/messages",
                                              "/v1/messages/count_tokens", "/tokenize")
ROUTES = (CHAT, RESPONSES, MESSAGES, COUNT, TOKENIZE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a small window keeps every completion short, even one whose max_tokens was mutated away
    config = EngineConfig(max_num_seqs=4, max_model_len=256, max_batch_tokens=128)
    with LiveServer(tmp_path_factory.mktemp("keys"), api_key=None, engine_config=config) as srv:
        assert srv.service.model_id == MODEL
        yield srv


def _png(size: int = 16) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


PNG = _png()
DATA_URL = "data:image/png;base64," + PNG
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
ARGS = json.dumps({"a": 1, "b": 2})


# --- valid requests: every mutation starts from one of these --------------------------------------------------------
def _user(text: str = "hi") -> dict:
    return {"role": "user", "content": text}


BASES: dict[str, list[dict]] = {
    CHAT: [
        {"model": MODEL, "messages": [{"role": "system", "content": "be brief"}, _user()], "max_tokens": 4,
         "temperature": 0},
        {"model": MODEL, "max_completion_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
         "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                   {"type": "image_url", "image_url": {"url": DATA_URL}}]}],
         "n": 2, "seed": 1, "stop": ["\n\n"], "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.5,
         "logprobs": True, "top_logprobs": 2, "logit_bias": {"5": 1}, "user": "u-1", "reasoning_effort": "low"},
        {"model": MODEL, "max_tokens": 4,
         "messages": [_user("add 1 and 2"),
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": ARGS}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "3"}],
         "tools": [{"type": "function", "function": {"name": "add", "description": "add", "parameters": ADD}}],
         "tool_choice": "auto", "parallel_tool_calls": True,
         "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}},
    ],
    RESPONSES: [
        {"model": MODEL, "input": "hi", "instructions": "be brief", "max_output_tokens": 4, "store": False,
         "temperature": 0},
        {"model": MODEL, "max_output_tokens": 4, "store": False, "stream": True,
         "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                                {"type": "input_image", "image_url": DATA_URL}]}],
         "top_p": 0.9, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"], "truncation": "disabled",
         "reasoning": {"effort": "low"}, "user": "u-1"},
        {"model": MODEL, "max_output_tokens": 4, "store": True,
         "input": [_user("add 1 and 2"),
                   {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": ARGS},
                   {"type": "function_call_output", "call_id": "call_1", "output": "3"}],
         "tools": [{"type": "function", "name": "add", "description": "add", "parameters": ADD, "strict": True}],
         "tool_choice": "auto", "parallel_tool_calls": False,
         "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}}}},
    ],
    MESSAGES: [
        {"model": MODEL, "max_tokens": 4, "messages": [_user()], "system": "be brief", "temperature": 0},
        {"model": MODEL, "max_tokens": 4, "stream": True, "system": [{"type": "text", "text": "be brief"}],
         "messages": [{"role": "user", "content": [
             {"type": "text", "text": "what is this?"},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}],
         "top_p": 0.9, "top_k": 5, "stop_sequences": ["\n\n"], "metadata": {"user_id": "u-1"},
         "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}},
        {"model": MODEL, "max_tokens": 4,
         "messages": [_user("add 1 and 2"),
                      {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {
                          "type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3", "is_error": False}]}],
         "tools": [{"name": "add", "description": "add", "input_schema": ADD}],
         "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
         "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    ],
    TOKENIZE: [
        {"text": "hi"},
        {"prompt": "hi"},
        {"messages": [_user()], "add_generation_prompt": True,
         "tools": [{"type": "function", "function": {"name": "add", "parameters": ADD}}]},
    ],
}
_NOT_COUNTED = ("max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences", "metadata")
BASES[COUNT] = [{k: v for k, v in b.items() if k not in _NOT_COUNTED} for b in BASES[MESSAGES]]


# --- the request case and its checks --------------------------------------------------------------------------------
@dataclass
class Case:
    path: str
    body: Any = None  # sent as json.dumps(body): non-ASCII as \u escapes (lone surrogates too), NaN as NaN
    raw: bytes | None = None  # sent exactly, instead of body
    content_type: str | None = "application/json"
    why: str = ""  # the mutation, for failure messages
    invalid: bool = False  # unambiguously invalid per the API's spec: must be a 4xx
    status: int | None = None  # the exact status it must get
    chunked: bool = False  # send without Content-Length

    def content(self) -> bytes:
        return self.raw if self.raw is not None else json.dumps(self.body).encode()

    def __repr__(self) -> str:
        body = self.content()
        shown = body[:300] + (b"...(%d bytes)" % len(body) if len(body) > 300 else b"")
        return f"POST {self.path} [{self.why}] {shown!r}"


def send(server: LiveServer, case: Case) -> httpx.Response:
    body = case.content()
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    content: Any = body
    if case.chunked:
        content = iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
    try:
        return httpx.post(server.url + case.path, content=content, headers=headers, timeout=TIMEOUT)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {TIMEOUT} s (a hang): {case!r}")
    except httpx.TransportError as e:  # a stream cut off mid-way, a connection dropped
        pytest.fail(f"{type(e).__name__}: {e}: {case!r}")


def openai_shape(body: Any) -> str | None:
    """What is wrong with an OpenAI error body, or None."""
    err = body.get("error") if isinstance(body, dict) else None
    if set(body if isinstance(body, dict) else ()) != {"error"} or not isinstance(err, dict):
        return "not {'error': {...}}"
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}, not message, type, param, code"
    if not isinstance(err["type"], str) or not err["type"]:
        return "error.type is not a non-empty string"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return "error.param / error.code are not strings or null"
    return None if isinstance(err["message"], str) else "error.message is not a string"


def anthropic_shape(body: Any) -> str | None:
    """What is wrong with an Anthropic error body, or None."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(err, dict) \
            or not set(body) <= {"type", "error", "request_id"}:
        return "not {'type': 'error', 'error': {...}}"
    if set(err) != {"type", "message"}:
        return f"error keys {sorted(err)}, not type, message"
    if not isinstance(err["type"], str) or not err["type"]:
        return "error.type is not a non-empty string"
    return None if isinstance(err["message"], str) else "error.message is not a string"


SERVER_ERRORS_IN_STREAMS = ('"type":"server_error"', '"type":"api_error"', '"code":"server_error"',
                            '"type":"response.failed"')
STREAM_ENDS = {CHAT: ["data: [DONE]"], RESPONSES: ["event: response.completed", "event: response.incomplete"],
               MESSAGES: ["event: message_stop"]}


def problems(case: Case, r: httpx.Response) -> list[str]:
    """Every way the answer breaks the contract (empty: it keeps it)."""
    out, text = [], r.text
    if r.status_code >= 500:
        out.append(f"server error {r.status_code}")
    if TRACEBACK in text:
        out.append("a traceback in the answer")
    if case.status is not None and r.status_code != case.status:
        out.append(f"status {r.status_code}, expected {case.status}")
    elif case.invalid and not 400 <= r.status_code < 500:
        out.append(f"status {r.status_code} for an invalid request (a 4xx expected)")
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            out.append("the error body is not JSON")
        else:
            shape = anthropic_shape(body) if case.path.startswith("/v1/messages") else openai_shape(body)
            if shape:
                out.append(f"the error is not in the API's shape: {shape}")
            else:
                message = body["error"]["message"]
                if not message.strip():
                    out.append("an empty error message")
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        hit = next((s for s in SERVER_ERRORS_IN_STREAMS if s in text), None)
        if hit:
            out.append(f"a server error inside the 200 stream ({hit})")
        elif not any(end in text for end in STREAM_ENDS.get(case.path, ())):
            out.append("the 200 stream stops before its last event (cut off)")
    elif r.status_code == 200:
        try:
            r.json()
        except ValueError:
            out.append("the 200 body is not JSON")
    return out


def check(server: LiveServer, case: Case) -> None:
    r = send(server, case)
    found = problems(case, r)
    assert not found, f"{'; '.join(found)}: {case!r} -> {r.status_code} {r.text[:400]!r}"


# --- JSON paths -----------------------------------------------------------------------------------------------------
Path = tuple[str | int, ...]


def paths(value: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every path into a JSON value (the root too)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


def pattern(path: Path) -> str:
    """`messages.*.content` for ("messages", 1, "content")."""
    return ".".join("*" if isinstance(p, int) else p for p in path)


def get(value: Any, path: Path) -> Any:
    for p in path:
        value = value[p]
    return value


def replaced(body: Any, path: Path, new: Any) -> Any:
    if not path:
        return new
    out = copy.deepcopy(body)
    get(out, path[:-1])[path[-1]] = new
    return out


def deleted(body: Any, path: Path) -> Any:
    out = copy.deepcopy(body)
    del get(out, path[:-1])[path[-1]]
    return out


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "int"
    return {float: "float", str: "str", list: "list", dict: "obj"}[type(value)]


# --- wrong types ----------------------------------------------------------------------------------------------------
# The JSON types each field takes per the API's spec, and whether null is allowed (or the spec is unclear about
# it: null is then not counted as invalid). A field not listed is still mutated, but nothing is expected of it.
NUM = {"int", "float"}
WRONG = {"str": ["yes", "10", "0.5", "true", ""], "bool": [True, False], "int": [0, 1, 10], "float": [0.5, 10.5],
         "list": [[], ["x"], [1]], "obj": [{}, {"x": 1}], "null": [None]}
_MESSAGE_TYPES = {"messages": ({"list"}, False), "messages.*": ({"obj"}, False),
                  "messages.*.role": ({"str"}, False), "messages.*.content.*": ({"obj"}, False),
                  "messages.*.content.*.type": ({"str"}, False), "messages.*.content.*.text": ({"str"}, False)}
OPENAI_CHAT_TYPES = {
    **_MESSAGE_TYPES, "": ({"obj"}, False), "model": ({"str"}, False),
    "messages.*.content": ({"str", "list"}, True), "messages.*.content.*.image_url": ({"obj"}, False),
    "messages.*.content.*.image_url.url": ({"str"}, False), "messages.*.tool_calls": ({"list"}, True),
    "messages.*.tool_calls.*": ({"obj"}, False), "messages.*.tool_calls.*.id": ({"str"}, False),
    "messages.*.tool_calls.*.function": ({"obj"}, False), "messages.*.tool_calls.*.function.name": ({"str"}, False),
    "messages.*.tool_calls.*.function.arguments": ({"str"}, False), "messages.*.tool_call_id": ({"str"}, False),
    "stream": ({"bool"}, True), "stream_options": ({"obj"}, True), "stream_options.include_usage": ({"bool"}, True),
    "max_tokens": ({"int"}, True), "max_completion_tokens": ({"int"}, True), "n": ({"int"}, True),
    "seed": ({"int"}, True), "top_logprobs": ({"int"}, True), "temperature": (NUM, True), "top_p": (NUM, True),
    "presence_penalty": (NUM, True), "frequency_penalty": (NUM, True), "logprobs": ({"bool"}, True),
    "parallel_tool_calls": ({"bool"}, True), "stop": ({"str", "list"}, True), "stop.*": ({"str"}, False),
    "user": ({"str"}, True), "logit_bias": ({"obj"}, True), "logit_bias.*": (NUM, False),
    "reasoning_effort": ({"str"}, True), "tools": ({"list"}, True), "tools.*": ({"obj"}, False),
    "tools.*.type": ({"str"}, False), "tools.*.function": ({"obj"}, False), "tools.*.function.name": ({"str"}, False),
    "tools.*.function.description": ({"str"}, True), "tools.*.function.parameters": ({"obj"}, True),
    "tool_choice": ({"str", "obj"}, True), "response_format": ({"obj"}, True),
    "response_format.type": ({"str"}, False), "response_format.json_schema": ({"obj"}, False),
    "response_format.json_schema.name": ({"str"}, True), "response_format.json_schema.schema": ({"obj"}, True),
}
RESPONSES_TYPES = {
    "": ({"obj"}, False), "model": ({"str"}, False), "input": ({"str", "list"}, False), "input.*": ({"obj"}, False),
    "input.*.role": ({"str"}, False), "input.*.type": ({"str"}, False), "input.*.content": ({"str", "list"}, False),
    "input.*.content.*": ({"obj"}, False), "input.*.content.*.type": ({"str"}, False),
    "input.*.content.*.text": ({"str"}, False), "input.*.content.*.image_url": ({"str"}, True),
    "input.*.call_id": ({"str"}, False), "input.*.name": ({"str"}, False), "input.*.arguments": ({"str"}, False),
    "input.*.output": ({"str", "list"}, False), "instructions": ({"str", "list"}, True),
    "max_output_tokens": ({"int"}, True), "temperature": (NUM, True), "top_p": (NUM, True),
    "stream": ({"bool"}, True), "store": ({"bool"}, True), "parallel_tool_calls": ({"bool"}, True),
    "tools": ({"list"}, True), "tools.*": ({"obj"}, False), "tools.*.type": ({"str"}, False),
    "tools.*.name": ({"str"}, False), "tools.*.description": ({"str"}, True), "tools.*.parameters": ({"obj"}, True),
    "tools.*.strict": ({"bool"}, True), "tool_choice": ({"str", "obj"}, True), "reasoning": ({"obj"}, True),
    "reasoning.effort": ({"str"}, True), "text": ({"obj"}, True), "text.format": ({"obj"}, True),
    "text.format.type": ({"str"}, False), "text.format.name": ({"str"}, True), "text.format.schema": ({"obj"}, False),
    "metadata": ({"obj"}, True), "metadata.*": ({"str"}, False), "include": ({"list"}, True),
    "include.*": ({"str"}, False), "truncation": ({"str"}, True), "user": ({"str"}, True),
}
COUNT_TYPES = {
    **_MESSAGE_TYPES, "": ({"obj"}, False), "model": ({"str"}, False),
    "messages.*.content": ({"str", "list"}, False), "messages.*.content.*.source": ({"obj"}, False),
    "messages.*.content.*.source.type": ({"str"}, False), "messages.*.content.*.source.media_type": ({"str"}, False),
    "messages.*.content.*.source.data": ({"str"}, False), "messages.*.content.*.id": ({"str"}, False),
    "messages.*.content.*.name": ({"str"}, False), "messages.*.content.*.input": ({"obj"}, False),
    "messages.*.content.*.tool_use_id": ({"str"}, False), "messages.*.content.*.content": ({"str", "list"}, True),
    "messages.*.content.*.is_error": ({"bool"}, True), "system": ({"str", "list"}, True),
    "system.*": ({"obj"}, False), "system.*.type": ({"str"}, False), "system.*.text": ({"str"}, False),
    "tools": ({"list"}, True), "tools.*": ({"obj"}, False), "tools.*.name": ({"str"}, False),
    "tools.*.description": ({"str"}, True), "tools.*.input_schema": ({"obj"}, False), "tool_choice": ({"obj"}, True),
    "tool_choice.type": ({"str"}, False), "tool_choice.disable_parallel_tool_use": ({"bool"}, True),
    "thinking": ({"obj"}, True), "thinking.type": ({"str"}, False), "output_config": ({"obj"}, True),
    "output_config.effort": ({"str"}, True), "output_config.format": ({"obj"}, True),
    "output_config.format.type": ({"str"}, False), "output_config.format.schema": ({"obj"}, False),
}
MESSAGES_TYPES = {
    **COUNT_TYPES, "max_tokens": ({"int"}, False), "stream": ({"bool"}, True), "temperature": (NUM, True),
    "top_p": (NUM, True), "top_k": ({"int"}, True), "stop_sequences": ({"list"}, True),
    "stop_sequences.*": ({"str"}, False), "metadata": ({"obj"}, True), "metadata.user_id": ({"str"}, True),
}
TOKENIZE_TYPES = {  # the server's own route (vLLM's shape): its model is the spec
    **_MESSAGE_TYPES, "": ({"obj"}, False), "text": ({"str"}, True), "prompt": ({"str"}, True),
    "messages": ({"list"}, True), "messages.*.content": ({"str", "list"}, True), "tools": ({"list"}, True),
    "tools.*": ({"obj"}, False), "add_generation_prompt": ({"bool"}, True), "tier": ({"str"}, True),
}
TYPES = {CHAT: OPENAI_CHAT_TYPES, RESPONSES: RESPONSES_TYPES, MESSAGES: MESSAGES_TYPES, COUNT: COUNT_TYPES,
         TOKENIZE: TOKENIZE_TYPES}


def wrong_type_invalid(route: str, path: Path, value: Any) -> bool:
    spec = TYPES[route].get(pattern(path))
    if spec is None:
        return False
    allowed, nullable = spec
    k = kind(value)
    return k not in allowed and not (k == "null" and nullable)


@st.composite
def wrong_types(draw, route: str) -> Case:
    base = draw(st.sampled_from(BASES[route]))
    everywhere = list(paths(base))
    # half the draws go to the flags and numbers (what strict types are about), half anywhere
    scalars = [p for p in everywhere if kind(get(base, p)) in ("bool", "int", "float")] or everywhere
    path = draw(st.sampled_from(scalars) | st.sampled_from(everywhere))
    value = draw(st.sampled_from([v for vs in WRONG.values() for v in vs if kind(v) != kind(get(base, path))]))
    return Case(route, replaced(base, path, value), why=f"{pattern(path) or 'body'} = {value!r}",
                invalid=wrong_type_invalid(route, path, value))


# --- numbers out of range -------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
HUGE = [10**30, 2**63, 2**64, 10**400]  # valid JSON integers; not out of range per the specs, but never a 5xx
# pattern -> (values out of the spec's range, values whose handling is the server's choice)
_SAMPLING = {"temperature": ([-0.1, 2.5, NAN, INF, -INF, 10**30], [10**400]),
             "top_p": ([-0.5, 1.5, NAN, INF], [0, 10**400]),
             "presence_penalty": ([2.5, -3, NAN, INF], []), "frequency_penalty": ([2.5, -3, NAN, -INF], [])}
RANGES = {
    CHAT: {**_SAMPLING, "max_tokens": ([0, -1, -10**30, 4.5, NAN, INF], HUGE),
           "max_completion_tokens": ([0, -1, 4.5, NAN, INF], HUGE), "n": ([0, -1, 129, 1.5, NAN], [17, *HUGE]),
           "top_logprobs": ([-1, 21, NAN], HUGE), "seed": ([1.5, NAN, INF], [-1, *HUGE]),
           "logit_bias.5": ([101, -101, NAN, INF], []), "messages.*.content": ([NAN, INF, 5], [])},
    RESPONSES: {"temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
                "max_output_tokens": ([0, -1, 4.5, NAN, INF], HUGE)},
    MESSAGES: {"max_tokens": ([0, -1, 4.5, NAN, INF, -10**30], HUGE),
               "temperature": ([-0.1, 1.5, NAN, INF, 10**30], [10**400]), "top_p": ([-0.5, 1.5, NAN], [0]),
               "top_k": ([-1, 1.5, NAN, INF], [0, *HUGE])},
    COUNT: {},
    TOKENIZE: {"text": ([NAN, INF, 10**30], []), "prompt": ([NAN], [])},
}


@st.composite
def out_of_range(draw, route: str) -> Case:
    fields = RANGES[route]
    name = draw(st.sampled_from(sorted(fields)))
    bad, odd = fields[name]
    value = draw(st.sampled_from(bad + odd))
    base = draw(st.sampled_from([b for b in BASES[route] if any(pattern(p) == name for p in paths(b))]))
    path = draw(st.sampled_from([p for p in paths(base) if pattern(p) == name]))
    return Case(route, replaced(base, path, value), why=f"{name} = {value!r}", invalid=value in bad)


# --- unicode --------------------------------------------------------------------------------------------------------
NASTY = ["\ud800", "\udfff", "a\ud83dz", "\udc00\ud800", "\u0000", "nul\u0000byte", "\u200b\u200c\u200d\u2060",
         "\u200f\u202e\u2066rtl\u2069", "\ufeff", "\uffff\ufffe", "\U0010ffff", "👩‍👩‍👧‍👦🙂", "\u0301\u0301",
         "\r\n\t\x1b[31m", "<|im_start|>", "</s>", "x" * 5000]
nasty_text = st.one_of(st.sampled_from(NASTY), st.text(st.one_of(
    st.characters(codec=None), st.sampled_from([c for c in NASTY if len(c) == 1])), max_size=12))


def has_surrogate(s: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in s)


@st.composite
def nasty_strings(draw, route: str) -> Case:
    """A string anywhere replaced by (or spliced with) nasty unicode."""
    base = draw(st.sampled_from(BASES[route]))
    path = draw(st.sampled_from([p for p in paths(base) if isinstance(get(base, p), str)]))
    text = draw(nasty_text)
    old = get(base, path)
    value = draw(st.sampled_from([text, old + text, text + old]))
    # a model id other than the served one is a 404; a lone surrogate is no text to tokenize
    invalid = (path == ("model",) and value != MODEL) or (route == TOKENIZE and path in (("text",), ("prompt",))
                                                           and has_surrogate(value))
    return Case(route, replaced(base, path, value), why=f"{pattern(path)} = {value[:40]!r}", invalid=invalid)


# --- shapes, sizes, missing and unknown fields ----------------------------------------------------------------------
def _tool_history(tool_msg: dict) -> list[dict]:
    return [_user("add"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": ARGS}}]}, tool_msg]


def _image_part(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def _anthropic_image(source: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "source": source}]}]


def _tool_use_turns(use: dict, result: dict) -> list[dict]:
    return [_user("add"), {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]


NOT_BASE64 = "!!!not base64!!!"
NOT_AN_IMAGE = base64.b64encode(b"hello, not an image").decode()
USE = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}
MANY = [m for _ in range(1500) for m in (_user(), {"role": "assistant", "content": "ok"})] + [_user()]
BIG = "word " * 40_000  # 200 KB
OVER = "x" * (LIMIT + 100_000)

# (description, field changes to the route's first base (None deletes), invalid per the spec)
SHAPES: dict[str, list[tuple[str, dict, bool]]] = {
    CHAT: [
        ("no messages", {"messages": []}, True),
        ("messages a string", {"messages": "hi"}, True),
        ("messages an object", {"messages": _user()}, True),
        ("a message a string", {"messages": ["hi"]}, True),
        ("an unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, True),
        ("no role", {"messages": [{"content": "hi"}]}, True),
        ("a user message without content", {"messages": [{"role": "user"}]}, True),
        ("a tool message without tool_call_id", {"messages": _tool_history({"role": "tool", "content": "3"})}, True),
        ("a tool message first", {"messages": [{"role": "tool", "tool_call_id": "c", "content": "3"}, _user()]},
         False),
        ("tool_calls with non-JSON arguments", {"messages": [_user("add"), {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "3"}]}, False),
        # horizon.chat takes the arguments as an object too (re-serialised as the model writes JSON)
        ("tool_calls arguments an object", {"messages": [_user("add"), {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
            {"role": "tool", "tool_call_id": "c", "content": "3"}]}, False),
        ("a tool call without function", {"messages": [_user("add"), {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function"}]}, {"role": "tool", "tool_call_id": "c", "content": "3"}]}, True),
        ("a content part of an unknown type", {"messages": [{"role": "user", "content": [
            {"type": "wizard", "text": "hi"}]}]}, True),
        ("a text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, True),
        ("a content part a string", {"messages": [{"role": "user", "content": ["hi"]}]}, True),
        ("an image that is not base64", {"messages": _image_part("data:image/png;base64," + NOT_BASE64)}, True),
        ("an empty data URL", {"messages": _image_part("data:image/png;base64,")}, True),
        ("base64 that is not an image", {"messages": _image_part("data:image/png;base64," + NOT_AN_IMAGE)}, True),
        ("a data URL of text", {"messages": _image_part("data:text/plain;base64," + NOT_AN_IMAGE)}, True),
        ("an image URL that is no URL", {"messages": _image_part("not a url")}, True),
        ("an http image URL", {"messages": _image_part("http://127.0.0.1:1/x.png")}, False),
        ("an image part without image_url", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         True),
        ("duplicate tool names", {"tools": [BASES[CHAT][2]["tools"][0]] * 2}, False),
        ("a tool without function", {"tools": [{"type": "function"}]}, True),
        ("a function without name", {"tools": [{"type": "function", "function": {"parameters": ADD}}]}, True),
        ("tool parameters with NaN", {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "number", "maximum": NAN}}}}}]},
         True),
        ("tool_choice an unknown mode", {"tool_choice": "sometimes"}, True),
        ("tool_choice names no declared tool", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         False),
        ("response_format of an unknown type", {"response_format": {"type": "xml"}}, True),
        ("a json_schema format without json_schema", {"response_format": {"type": "json_schema"}}, True),
        ("an unknown reasoning_effort", {"reasoning_effort": "extreme"}, True),
        ("an empty stop string", {"stop": [""]}, False),
        ("a few thousand messages", {"messages": MANY}, False),
        ("a 200 KB message", {"messages": [_user(BIG)]}, False),
        ("no model", {"model": None}, True),
        ("no messages field", {"messages": None}, True),
        ("another model", {"model": "gpt-4o"}, True),
        ("an empty model", {"model": ""}, True),
    ],
    RESPONSES: [
        ("input a number", {"input": 5}, True),
        ("input an object", {"input": _user()}, True),
        ("an input item a string", {"input": ["hi"]}, True),
        ("an unknown role", {"input": [{"role": "wizard", "content": "hi"}]}, True),
        ("an unknown item type", {"input": [{"type": "wizard"}]}, True),
        ("an item without type or role", {"input": [{"content": "hi"}]}, True),
        ("a content part of an unknown type", {"input": [{"role": "user", "content": [{"type": "wizard"}]}]}, True),
        ("an input_text without text", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, True),
        ("an image that is not base64", {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + NOT_BASE64}]}]}, True),
        ("base64 that is not an image", {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + NOT_AN_IMAGE}]}]}, True),
        ("function_call_output without call_id", {"input": [_user(), {"type": "function_call_output",
                                                                      "output": "3"}]}, True),
        ("function_call_output for no call", {"input": [_user(), {"type": "function_call_output", "call_id": "c",
                                                                  "output": "3"}]}, False),
        ("function_call arguments a number", {"input": [_user(), {"type": "function_call", "call_id": "c",
                                                                  "name": "add", "arguments": 5}]}, True),
        ("function_call arguments an object", {"input": [_user(), {"type": "function_call", "call_id": "c",
                                                                   "name": "add", "arguments": {"a": 1}}]}, True),
        ("a reasoning item with a forged blob", {"input": [_user(), {"type": "reasoning", "id": "rs_1",
                                                                     "encrypted_content": "Zm9yZ2Vk", "summary": []},
                                                           _user()]}, True),
        ("an item_reference to nothing", {"input": [{"type": "item_reference", "id": "msg_nope"}]}, True),
        ("an assistant item with a bad tier", {"input": [_user(), {"role": "assistant", "tier": 5, "content": [
            {"type": "output_text", "text": "ok"}]}, _user()]}, False),
        ("a function tool without name", {"tools": [{"type": "function", "parameters": ADD}]}, True),
        ("tool parameters a number", {"tools": [{"type": "function", "name": "f", "parameters": 5}]}, True),
        ("tool parameters with NaN", {"tools": [{"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "number", "maximum": NAN}}}}]}, True),
        ("duplicate tool names", {"tools": [BASES[RESPONSES][2]["tools"][0]] * 2}, False),
        ("a hosted tool", {"tools": [{"type": "web_search"}]}, False),
        ("tool_choice an unknown mode", {"tool_choice": "sometimes"}, True),
        ("an unknown text format", {"text": {"format": {"type": "xml"}}}, True),
        ("an unknown reasoning effort", {"reasoning": {"effort": "extreme"}}, True),
        ("an unknown include", {"include": ["nope"]}, True),
        ("metadata with a number", {"metadata": {"k": 5}}, True),
        ("an unknown truncation", {"truncation": "sometimes"}, True),
        ("a previous response that does not exist", {"previous_response_id": "resp_nope"}, True),
        ("a few thousand items", {"input": MANY}, False),
        ("a 200 KB input", {"input": BIG}, False),
        ("no model", {"model": None}, True),
        ("another model", {"model": "gpt-4o"}, True),
    ],
    MESSAGES: [
        ("no messages", {"messages": []}, True),
        ("messages a string", {"messages": "hi"}, True),
        ("a system role in messages", {"messages": [{"role": "system", "content": "x"}, _user()]}, True),
        ("an unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, True),
        ("a message without content", {"messages": [{"role": "user"}]}, True),
        ("a block of an unknown type", {"messages": [{"role": "user", "content": [{"type": "wizard"}]}]}, True),
        ("a text block without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, True),
        ("an image that is not base64", {"messages": _anthropic_image(
            {"type": "base64", "media_type": "image/png", "data": NOT_BASE64})}, True),
        ("base64 that is not an image", {"messages": _anthropic_image(
            {"type": "base64", "media_type": "image/png", "data": NOT_AN_IMAGE})}, True),
        ("an unsupported media type", {"messages": _anthropic_image(
            {"type": "base64", "media_type": "image/tiff", "data": PNG})}, True),
        ("an image source of an unknown type", {"messages": _anthropic_image({"type": "wizard"})}, True),
        ("tool_use without id", {"messages": _tool_use_turns({**USE, "id": None}, RESULT)}, True),
        ("tool_use input a string", {"messages": _tool_use_turns({**USE, "input": ARGS}, RESULT)}, True),
        ("tool_result without tool_use_id", {"messages": _tool_use_turns(USE, {**RESULT, "tool_use_id": None})},
         True),
        ("tool_result for no tool_use", {"messages": [_user(), {"role": "user", "content": [RESULT]}]}, True),
        ("a tool_result with an unknown part", {"messages": _tool_use_turns(USE, {**RESULT, "content": [
            {"type": "wizard"}]})}, True),
        ("duplicate tool names", {"tools": [{"name": "f", "input_schema": ADD}] * 2}, True),
        ("a tool without input_schema", {"tools": [{"name": "f"}]}, True),
        ("a tool without name", {"tools": [{"input_schema": ADD}]}, True),
        ("input_schema with NaN", {"tools": [{"name": "f", "input_schema": {
            "type": "object", "properties": {"x": {"type": "number", "maximum": NAN}}}}]}, True),
        ("tool_choice a string", {"tool_choice": "auto"}, True),
        ("tool_choice of an unknown type", {"tool_choice": {"type": "sometimes"}}, True),
        ("tool_choice tool without name", {"tools": [{"name": "f", "input_schema": ADD}],
                                           "tool_choice": {"type": "tool"}}, True),
        ("thinking enabled without budget", {"thinking": {"type": "enabled"}}, True),
        ("a thinking budget above max_tokens", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, True),
        ("a thinking budget below 1024", {"thinking": {"type": "enabled", "budget_tokens": 1}, "max_tokens": 8},
         True),
        ("a huge thinking budget", {"thinking": {"type": "enabled", "budget_tokens": 10**30},
                                    "max_tokens": 10**31}, False),
        ("thinking of an unknown type", {"thinking": {"type": "sometimes"}}, True),
        ("system a number", {"system": 5}, True),
        ("an image block in system", {"system": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": PNG}}]}, True),
        ("stop_sequences a string", {"stop_sequences": "x"}, True),
        ("an assistant prefill", {"messages": [_user(), {"role": "assistant", "content": "ok"}]}, False),
        ("a few thousand messages", {"messages": MANY}, False),
        ("a 200 KB message", {"messages": [_user(BIG)]}, False),
        ("no model", {"model": None}, True),
        ("no max_tokens", {"max_tokens": None}, True),
        ("another model", {"model": "claude-opus-4"}, True),
    ],
    TOKENIZE: [
        ("nothing to tokenize", {"text": None}, True),
        ("text and messages", {"messages": [_user()]}, True),
        ("an unknown role", {"text": None, "messages": [{"role": "wizard", "content": "hi"}]}, True),
        ("messages a string", {"text": None, "messages": "hi"}, True),
        ("a tool without function", {"text": None, "messages": [_user()], "tools": [{"type": "function"}]}, True),
        ("tools of strings", {"text": None, "messages": [_user()], "tools": ["add"]}, True),
        ("an unknown tier", {"text": None, "messages": [_user()], "tier": "wizard"}, False),
        ("a bad image", {"text": None, "messages": _image_part("data:image/png;base64," + NOT_BASE64)}, True),
        ("a 200 KB text", {"text": BIG}, False),
        ("a few thousand messages", {"text": None, "messages": MANY}, False),
    ],
}
SHAPES[COUNT] = [(why, {k: v for k, v in change.items() if k not in _NOT_COUNTED}, invalid)
                 for why, change, invalid in SHAPES[MESSAGES]
                 if why not in ("no max_tokens", "stop_sequences a string", "a thinking budget above max_tokens")]


def shape_case(route: str, why: str, change: dict, invalid: bool) -> Case:
    body = copy.deepcopy(BASES[route][0])
    for k, v in change.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return Case(route, body, why=why, invalid=invalid)


def oversized(route: str, chunked: bool) -> Case:
    body = replaced(BASES[route][0], ("text",) if route == TOKENIZE else ("model",), OVER)
    return Case(route, body, why="a body over the limit" + (" (chunked)" if chunked else ""), status=413,
                chunked=chunked)


# required fields (pattern -> does its parent need it); deleting one is invalid
def _role(*roles):
    return lambda parent: parent.get("role") in roles


def _type(*types):
    return lambda parent: parent.get("type") in types


_ALWAYS = lambda parent: True
_REQUIRED_MESSAGES = {"messages.*.role": _ALWAYS, "messages.*.content.*.type": _ALWAYS,
                      "messages.*.content.*.text": _type("text")}
REQUIRED = {
    CHAT: {**_REQUIRED_MESSAGES, "model": _ALWAYS, "messages": _ALWAYS,
           "messages.*.content": _role("user", "system", "developer", "tool"), "messages.*.tool_call_id": _ALWAYS,
           "messages.*.tool_calls.*.id": _ALWAYS, "messages.*.tool_calls.*.function": _ALWAYS,
           "messages.*.tool_calls.*.function.name": _ALWAYS, "messages.*.tool_calls.*.function.arguments": _ALWAYS,
           "messages.*.content.*.image_url": _ALWAYS, "messages.*.content.*.image_url.url": _ALWAYS,
           "tools.*.function": _ALWAYS, "tools.*.function.name": _ALWAYS, "tools.*.type": _ALWAYS,
           "response_format.type": _ALWAYS, "response_format.json_schema": _type("json_schema")},
    RESPONSES: {"model": _ALWAYS, "input.*.content": lambda parent: "role" in parent,
                "input.*.call_id": _ALWAYS, "input.*.name": _type("function_call"),
                "input.*.arguments": _type("function_call"),
                "input.*.output": _type("function_call_output"), "input.*.content.*.type": _ALWAYS,
                "input.*.content.*.text": _type("input_text"), "tools.*.type": _ALWAYS,
                "tools.*.name": _type("function"), "text.format.type": _ALWAYS,
                "text.format.schema": _type("json_schema")},
    COUNT: {**_REQUIRED_MESSAGES, "model": _ALWAYS, "messages": _ALWAYS, "messages.*.content": _ALWAYS,
            "messages.*.content.*.source": _type("image"), "messages.*.content.*.source.type": _ALWAYS,
            "messages.*.content.*.source.media_type": _ALWAYS, "messages.*.content.*.source.data": _ALWAYS,
            "messages.*.content.*.id": _type("tool_use"), "messages.*.content.*.name": _type("tool_use"),
            "messages.*.content.*.input": _type("tool_use"), "messages.*.content.*.tool_use_id": _ALWAYS,
            "system.*.type": _ALWAYS, "system.*.text": _ALWAYS, "tools.*.name": _ALWAYS,
            "tools.*.input_schema": _ALWAYS, "tool_choice.type": _ALWAYS, "thinking.type": _ALWAYS,
            "output_config.format.type": _ALWAYS, "output_config.format.schema": _ALWAYS},
    TOKENIZE: {**_REQUIRED_MESSAGES, "text": _ALWAYS, "prompt": _ALWAYS, "messages": _ALWAYS,
               "messages.*.content": _ALWAYS},
}
REQUIRED[MESSAGES] = {**REQUIRED[COUNT], "max_tokens": _ALWAYS}


def deletable(body: Any) -> list[Path]:
    return [p for p in paths(body) if p and isinstance(p[-1], str)]


def missing_invalid(route: str, base: Any, path: Path) -> bool:
    needs = REQUIRED[route].get(pattern(path))
    return needs is not None and needs(get(base, path[:-1]))


@st.composite
def missing_fields(draw, route: str) -> Case:
    base = draw(st.sampled_from(BASES[route]))
    path = draw(st.sampled_from(deletable(base)))
    return Case(route, deleted(base, path), why=f"without {pattern(path)}", invalid=missing_invalid(route, base, path))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from(HUGE) | st.floats() | nasty_text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(nasty_text, kids, max_size=3), max_leaves=8)


@st.composite
def unknown_fields(draw, route: str) -> Case:
    """A field no spec names, at any object in the request: ignored or refused, never a server error."""
    base = draw(st.sampled_from(BASES[route]))
    path = draw(st.sampled_from([p for p in paths(base) if isinstance(get(base, p), dict)]))
    key = draw(nasty_text.filter(lambda k: k not in get(base, path)))
    return Case(route, replaced(base, (*path, key), draw(json_values)), why=f"unknown {pattern((*path, key))!r}")


@st.composite
def junk(draw, route: str) -> Case:
    """Any JSON value (big numbers, NaN, nasty strings, nesting) anywhere: never a server error."""
    base = draw(st.sampled_from(BASES[route]))
    path = draw(st.sampled_from(list(paths(base))))
    value = draw(json_values)
    return Case(route, replaced(base, path, value), why=f"{pattern(path) or 'body'} = {value!r:.60}",
                invalid=wrong_type_invalid(route, path, value))


# --- deep nesting (sent raw: json.dumps itself stops at Python's recursion limit) -----------------------------------
# (base index, path) of a JSON schema or a free JSON value in each route's bases
DEEP_SPOTS = {
    CHAT: [(0, ("x",)), (2, ("tools", 0, "function", "parameters")), (2, ("response_format", "json_schema", "schema"))],
    RESPONSES: [(0, ("x",)), (2, ("tools", 0, "parameters")), (2, ("text", "format", "schema"))],
    MESSAGES: [(0, ("x",)), (2, ("tools", 0, "input_schema")), (2, ("output_config", "format", "schema")),
               (2, ("messages", 1, "content", 1, "input"))],
    COUNT: [(0, ("x",)), (2, ("tools", 0, "input_schema")), (2, ("messages", 1, "content", 1, "input"))],
    TOKENIZE: [(0, ("x",)), (2, ("tools", 0, "function", "parameters"))],
}
NESTINGS = {"schema": ('{"type": "object", "properties": {"a": ', "{}", "}}"), "object": ('{"a": ', "1", "}"),
            "list": ("[", "1", "]")}


@st.composite
def deep(draw, route: str) -> Case:
    """A schema or value nested hundreds to thousands deep: parsed or refused, never a recursion error."""
    i, path = draw(st.sampled_from(DEEP_SPOTS[route]))
    name = draw(st.sampled_from(sorted(NESTINGS)))
    depth = draw(st.sampled_from([100, 300, 600, 900, 3000]))
    opening, leaf, closing = NESTINGS[name]
    raw = json.dumps(replaced(BASES[route][i], path, "__DEEP__"))
    raw = raw.replace('"__DEEP__"', opening * depth + leaf + closing * depth)
    return Case(route, raw=raw.encode(), why=f"{pattern(path)} a {name} {depth} deep")


# --- malformed bodies -----------------------------------------------------------------------------------------------
def malformed(route: str) -> list[Case]:
    good = json.dumps(BASES[route][0])
    cases = [  # (why, raw, content type, invalid)
        ("an empty body", b"", "application/json", True),
        ("a truncated body", good[: len(good) // 2].encode(), "application/json", True),
        ("trailing garbage", (good + " garbage").encode(), "application/json", True),
        ("an extra brace", (good + "}").encode(), "application/json", True),
        ("two objects", (good + good).encode(), "application/json", True),
        ("a JSON array", f"[{good}]".encode(), "application/json", True),
        ("an empty array", b"[]", "application/json", True),
        ("a bare string", b'"hi"', "application/json", True),
        ("null", b"null", "application/json", True),
        ("a number", b"42", "application/json", True),
        ("true", b"true", "application/json", True),
        ("single quotes", good.replace('"', "'").encode(), "application/json", True),
        ("a trailing comma", (good[:-1] + ",}").encode(), "application/json", True),
        ("a comment", ("/* hi */" + good).encode(), "application/json", True),
        ("invalid UTF-8", good.encode().replace(b'"hi"', b'"h\xff\xfei"').replace(b'"horizon-test"', b'"\xc3"'),
         "application/json", True),
        ("a form body", b"model=horizon-test&text=hi", "application/x-www-form-urlencoded", True),
        ("a form body labelled JSON", b"model=horizon-test&text=hi", "application/json", True),
        ("a NUL byte", b"\x00" + good.encode(), "application/json", True),
        ("a UTF-8 BOM", b"\xef\xbb\xbf" + good.encode(), "application/json", False),
        ("UTF-16", good.encode("utf-16"), "application/json", False),
        ("JSON as text/plain", good.encode(), "text/plain", False),
        ("no content type", good.encode(), None, False),
        ("a NaN in an unknown field", (good[:-1] + ', "x": NaN}').encode(), "application/json", False),
        ("a duplicate key", (good[:-1] + ', "x": 1, "x": 2}').encode(), "application/json", False),
        ("a 5000-digit number", (good[:-1] + ', "x": 1' + "0" * 5000 + "}").encode(), "application/json", False),
        ("nesting 100000 deep", (good[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(),
         "application/json", False),
        ("unclosed nesting", (good[:-1] + ', "x": ' + "[" * 100_000).encode(), "application/json", True),
    ]
    return [Case(route, raw=raw, content_type=ct, why=why, invalid=invalid) for why, raw, ct, invalid in cases]


# --- the tests ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_every_base_request_is_served(server, route):
    """The mutations start from requests the server serves; otherwise they would test nothing."""
    for base in BASES[route]:
        r = send(server, Case(route, base, why="base"))
        assert r.status_code == 200 and not problems(Case(route, base), r), (base, r.status_code, r.text[:400])


def mutations(route: str) -> st.SearchStrategy[Case]:
    shapes = [shape_case(route, *s) for s in SHAPES[route]]
    return st.one_of(wrong_types(route), wrong_types(route), wrong_types(route),  # the most common bug: weighed x3
                     out_of_range(route) if RANGES[route] else st.nothing(),
                     nasty_strings(route), missing_fields(route), unknown_fields(route), junk(route), deep(route),
                     st.sampled_from(shapes), st.sampled_from(malformed(route)),
                     st.sampled_from([oversized(route, False), oversized(route, True)]))


SETTINGS = settings(max_examples=60, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.mark.parametrize("route", ROUTES)
def test_bad_requests_get_a_4xx_in_the_api_shape(server, route):
    @SETTINGS
    @given(case=mutations(route))
    def bad_request(case):
        check(server, case)

    bad_request()


# the known bugs, each on its own: (id, path, raw body)
HI = b'"messages": [{"role": "user", "content": "hi"}]'
KNOWN = [
    ("tokenize-text-lone-surrogate", TOKENIZE, b'{"text": "\\ud800"}'),
    ("chat-stream-yes", CHAT, b'{"model": "horizon-test", ' + HI + b', "max_tokens": 4, "stream": "yes"}'),
    ("chat-max_tokens-string", CHAT, b'{"model": "horizon-test", ' + HI + b', "max_tokens": "10"}'),
    ("chat-max_tokens-true", CHAT, b'{"model": "horizon-test", ' + HI + b', "max_tokens": true}'),
    ("chat-n-string", CHAT, b'{"model": "horizon-test", ' + HI + b', "max_tokens": 4, "n": "2"}'),
    ("chat-temperature-string", CHAT, b'{"model": "horizon-test", ' + HI + b', "max_tokens": 4, "temperature": "0.5"}'),
    ("responses-stream-yes", RESPONSES, b'{"model": "horizon-test", "input": "hi", "max_output_tokens": 4, '
                                        b'"stream": "yes"}'),
    ("responses-max_output_tokens-string", RESPONSES, b'{"model": "horizon-test", "input": "hi", '
                                                      b'"max_output_tokens": "10"}'),
    ("messages-stream-yes", MESSAGES, b'{"model": "horizon-test", ' + HI + b', "max_tokens": 4, "stream": "yes"}'),
    ("messages-max_tokens-string", MESSAGES, b'{"model": "horizon-test", ' + HI + b', "max_tokens": "10"}'),
    ("messages-max_tokens-true", MESSAGES, b'{"model": "horizon-test", ' + HI + b', "max_tokens": true}'),
    ("messages-temperature-string", MESSAGES, b'{"model": "horizon-test", ' + HI + b', "max_tokens": 4, '
                                              b'"temperature": "0.5"}'),
]


@pytest.mark.parametrize(("path", "raw"), [k[1:] for k in KNOWN], ids=[k[0] for k in KNOWN])
def test_known_bad_requests_are_400(server, path, raw):
    check(server, Case(path, raw=raw, why="known bug", status=400))


# what the corpus found (server errors, and invalid requests served), each on its own:
# (id, path, raw body, invalid per the spec)
def _with_turn(head: bytes, turn: bytes) -> bytes:
    """A raw request: the fields `head`, and a history with `turn` between two user messages."""
    return b'{"model": "horizon-test", %s: [{"role": "user", "content": "hi"}, %s, ' \
           b'{"role": "user", "content": "hi"}]}' % (head, turn)


CHAT_HEAD, RESPONSES_HEAD = b'"max_tokens": 4, "messages"', b'"max_output_tokens": 4, "store": false, "input"'
SURROGATE_TURN = b'{"role": "assistant", "content": "\\ud800"}'
FOUND = [
    ("chat-assistant-text-lone-surrogate", CHAT, _with_turn(CHAT_HEAD, SURROGATE_TURN), False),
    ("chat-tool-call-name-lone-surrogate", CHAT, _with_turn(CHAT_HEAD, (
        b'{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", '
        b'"function": {"name": "\\ud800", "arguments": "{}"}}]}')), False),
    ("chat-tool_calls-a-number", CHAT, _with_turn(CHAT_HEAD, b'{"role": "assistant", "content": "ok", '
                                                             b'"tool_calls": 1}'), True),
    ("chat-tool-call-function-a-string", CHAT, _with_turn(CHAT_HEAD, (
        b'{"role": "assistant", "content": "ok", "tool_calls": [{"id": "c", "type": "function", '
        b'"function": "add"}]}')), True),
    ("messages-assistant-text-lone-surrogate", MESSAGES, _with_turn(CHAT_HEAD, SURROGATE_TURN), False),
    ("count_tokens-assistant-text-lone-surrogate", COUNT, _with_turn(b'"messages"', SURROGATE_TURN), False),
    ("responses-assistant-text-lone-surrogate", RESPONSES, _with_turn(RESPONSES_HEAD, SURROGATE_TURN), False),
    ("responses-function_call-name-lone-surrogate", RESPONSES, _with_turn(RESPONSES_HEAD, (
        b'{"type": "function_call", "call_id": "c", "name": "\\ud800", "arguments": "{}"}, '
        b'{"type": "function_call_output", "call_id": "c", "output": "3"}')), False),
    ("responses-metadata-lone-surrogate", RESPONSES,
     b'{"model": "horizon-test", "max_output_tokens": 4, "store": false, "input": "hi", "metadata": {"k": "\\ud800"}}',
     False),
    ("responses-stream-metadata-lone-surrogate", RESPONSES,
     b'{"model": "horizon-test", "max_output_tokens": 4, "store": false, "stream": true, "input": "hi", '
     b'"metadata": {"k": "\\ud800"}}', False),
    ("responses-stored-format-name-lone-surrogate", RESPONSES,
     b'{"model": "horizon-test", "max_output_tokens": 4, "store": true, "input": "hi", "text": {"format": '
     b'{"type": "json_schema", "name": "\\ud800", "schema": {"type": "object"}}}}', False),
    ("chat-tool-call-arguments-an-object", CHAT, _with_turn(CHAT_HEAD, (
        b'{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", '
        b'"function": {"name": "add", "arguments": {"a": 1}}}]}, '
        b'{"role": "tool", "tool_call_id": "c", "content": "3"}')), False),  # accepted (see above)
    ("responses-function_call-arguments-an-object", RESPONSES, _with_turn(RESPONSES_HEAD, (
        b'{"type": "function_call", "call_id": "c", "name": "add", "arguments": {"a": 1}}, '
        b'{"type": "function_call_output", "call_id": "c", "output": "3"}')), True),
    ("chat-user-a-number", CHAT, b'{"model": "horizon-test", "max_tokens": 4, ' + HI + b', "user": 5}', True),
    ("responses-user-a-number", RESPONSES, b'{"model": "horizon-test", "max_output_tokens": 4, "store": false, '
                                           b'"input": "hi", "user": 5}', True),
    ("messages-metadata-user_id-a-number", MESSAGES, b'{"model": "horizon-test", "max_tokens": 4, ' + HI +
     b', "metadata": {"user_id": 5}}', True),
    ("responses-tool-strict-a-string", RESPONSES, b'{"model": "horizon-test", "max_output_tokens": 4, "store": false, '
     b'"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": "yes"}]}',
     True),
]


@pytest.mark.parametrize(("path", "raw", "invalid"), [f[1:] for f in FOUND], ids=[f[0] for f in FOUND])
def test_found_bad_requests(server, path, raw, invalid):
    check(server, Case(path, raw=raw, why="found by the corpus", invalid=invalid))


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_in_the_api_shape(server, path, chunked):
    check(server, oversized(path, chunked))
