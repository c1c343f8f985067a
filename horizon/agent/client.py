"""How the agent talks to a model: one small client interface over either wire format.

`Wire` knows one API's shapes: the request body for a step (messages, tools, thinking tier, tool
choice, max tokens), how a streamed or whole response becomes a `Turn`, and how tool results go
back into the history. `HTTPClient` sends those bodies to any endpoint that speaks the API (ours by
default; httpx, streaming with server-sent events). `ReplayClient` answers from a saved transcript.

The full-history rule lives here: `Turn.message` is the assistant message exactly as the server
returned it (OpenAI: the choice's `message` object, or the deltas of a stream accumulated into that
shape; Anthropic: `role` + the `content` blocks, thinking blocks with their signatures), and the
loop appends it unchanged. Nothing is re-serialised, dropped or reordered, so the next request
renders to the tokens the model generated and the server can resume from its cache.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from horizon.agent.tool import Tool, ToolResult

# OpenAI's reasoning_effort per tier (our server maps xhigh|max -> max) and Anthropic's adaptive effort
OPENAI_EFFORT = {"low": "low", "high": "high", "max": "xhigh"}
ANTHROPIC_EFFORT = {"low": "low", "high": "high", "max": "max"}
ANTHROPIC_VERSION = "2023-06-01"

OnEvent = Callable[[str, dict[str, Any]], None]  # ("thinking" | "text" | "tool_call" | "tool_args", data)


class ClientError(Exception):
    """The endpoint refused the request or could not be reached (the message says which and why)."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status, self.body = status, body


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text as generated (it may be invalid: the tool then reports the error)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    def add(self, other: Usage) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class Turn:
    message: dict[str, Any]  # the assistant message to append to the history, exactly as returned
    calls: list[ToolCall]
    text: str
    thinking: str | None
    finish_reason: str  # stop | tool_calls | length | other (the API's own word is in `response`)
    usage: Usage
    response: Any = None  # the raw response: the JSON body, or the list of stream events
    ttft_s: float | None = None  # time to the first streamed byte of output
    elapsed_s: float = 0.0


@dataclass
class StepRequest:
    """What the loop asks for one step."""

    messages: list[dict[str, Any]]
    tools: list[Tool]
    tier: str | None = None  # None: thinking off
    tool_choice: str | None = None  # None/"auto" | "required" | "none" | a tool's name (force that one)
    max_tokens: int = 4096
    system: str | None = None
    temperature: float | None = None
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the body (API-specific options)
    response_schema: dict[str, Any] | None = None  # the answer must be JSON of this schema (tools may still be called)


class Wire:
    """One API's message and body shapes. Subclasses: OpenAIWire, AnthropicWire."""

    api = ""
    path = ""

    def __init__(self, model: str):
        self.model = model

    def user_message(self, text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    def body(self, req: StepRequest, stream: bool) -> dict[str, Any]:
        raise NotImplementedError

    def headers(self, api_key: str | None) -> dict[str, str]:
        raise NotImplementedError

    def turn(self, response: dict[str, Any]) -> Turn:
        """A whole (non-streamed) response."""
        raise NotImplementedError

    def stream(self, events: Iterable[dict[str, Any]], on_event: OnEvent | None) -> Turn:
        """Accumulate streamed events (parsed `data:` objects) into the same Turn a whole response gives."""
        raise NotImplementedError

    def result_messages(self, calls: list[ToolCall], results: list[ToolResult]) -> list[dict[str, Any]]:
        """The history entries that carry a step's tool results back, in call order."""
        raise NotImplementedError


class OpenAIWire(Wire):
    api = "openai"
    path = "/v1/chat/completions"

    def body(self, req: StepRequest, stream: bool) -> dict[str, Any]:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + req.messages
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_completion_tokens": req.max_tokens,
                                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if req.tools:
            body["tools"] = [{"type": "function", "function": {**t.spec(), **({"strict": True} if t.strict else {})}}
                             for t in req.tools]
            choice = req.tool_choice or "auto"
            body["tool_choice"] = (choice if choice in ("auto", "required", "none")
                                   else {"type": "function", "function": {"name": choice}})
        if req.tier is not None:
            body["reasoning_effort"] = OPENAI_EFFORT[req.tier]
        if req.response_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer",
                                                                              "schema": req.response_schema}}
        if req.temperature is not None:
            body["temperature"] = req.temperature
        if req.seed is not None:
            body["seed"] = req.seed
        return {**body, **req.extra}

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def turn(self, response: dict[str, Any]) -> Turn:
        try:
            choice = response["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ClientError(f"not a chat.completion: {json.dumps(response)[:300]}") from None
        return self._turn(message, choice.get("finish_reason"), response.get("usage"), response)

    def _turn(self, message: dict, finish: str | None, usage: dict | None, raw: Any) -> Turn:
        calls = [ToolCall(c.get("id", ""), c.get("function", {}).get("name", ""),
                          c.get("function", {}).get("arguments", ""))
                 for c in message.get("tool_calls") or []]
        thinking = message.get("reasoning_content", message.get("reasoning"))
        return Turn(message, calls, message.get("content") or "", thinking, finish or "stop",
                    _openai_usage(usage), raw)

    def stream(self, events: Iterable[dict[str, Any]], on_event: OnEvent | None) -> Turn:
        # accumulate the deltas into the shape of a whole response's message: strings concatenate,
        # tool calls merge by index (id, type and name on the first fragment, then argument pieces)
        message: dict[str, Any] = {}
        calls: dict[int, dict[str, Any]] = {}
        finish, usage, raw = None, None, []
        for ev in events:
            raw.append(ev)
            usage = ev.get("usage") or usage
            for choice in ev.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                finish = choice.get("finish_reason") or finish
                for key, value in (choice.get("delta") or {}).items():
                    if key == "tool_calls":
                        for piece in value or []:
                            self._merge_call(calls, piece, on_event)
                    elif key == "role":
                        message["role"] = value
                    elif isinstance(value, str):
                        message[key] = message.get(key, "") + value
                        if on_event and value and key in ("reasoning_content", "reasoning"):
                            on_event("thinking", {"text": value})
                        elif on_event and value and key == "content":
                            on_event("text", {"text": value})
                    elif value is not None and key not in message:
                        message[key] = value
        message.setdefault("role", "assistant")
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
            if not message.get("content"):
                message["content"] = None  # as a whole response has it
        message.setdefault("content", None if calls else "")
        return self._turn(message, finish, usage, raw)

    @staticmethod
    def _merge_call(calls: dict[int, dict], piece: dict, on_event: OnEvent | None) -> None:
        i = piece.get("index", len(calls))
        call = calls.setdefault(i, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if piece.get("id"):
            call["id"] = piece["id"]
        if piece.get("type"):
            call["type"] = piece["type"]
        fn = piece.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] += fn["name"]
            if on_event:
                on_event("tool_call", {"id": call["id"], "name": fn["name"]})
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]
            if on_event:
                on_event("tool_args", {"text": fn["arguments"]})

    def result_messages(self, calls: list[ToolCall], results: list[ToolResult]) -> list[dict[str, Any]]:
        return [{"role": "tool", "tool_call_id": c.id, "content": r.content}
                for c, r in zip(calls, results, strict=True)]


def _openai_usage(u: dict | None) -> Usage:
    u = u or {}
    return Usage(u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0,
                 (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0,
                 (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class AnthropicWire(Wire):
    api = "anthropic"
    path = "/v1/messages"

    def body(self, req: StepRequest, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": req.messages, "max_tokens": req.max_tokens,
                                "stream": stream}
        if req.system:
            body["system"] = req.system
        if req.tools:
            body["tools"] = [{"name": t.name, "description": t.description, "input_schema": t.parameters,
                              **({"strict": True} if t.strict else {})} for t in req.tools]
            choice = req.tool_choice or "auto"
            body["tool_choice"] = ({"type": {"required": "any"}.get(choice, choice)}
                                   if choice in ("auto", "required", "none") else {"type": "tool", "name": choice})
        if req.tier is not None:
            body["thinking"] = {"type": "adaptive"}
            body["output_config"] = {"effort": ANTHROPIC_EFFORT[req.tier]}
        if req.response_schema is not None:
            body.setdefault("output_config", {})["format"] = {"type": "json_schema", "schema": req.response_schema}
        if req.temperature is not None:
            body["temperature"] = req.temperature
        return {**body, **req.extra}

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": api_key} if api_key else {})}

    def turn(self, response: dict[str, Any]) -> Turn:
        if not isinstance(response, dict) or not isinstance(response.get("content"), list):
            raise ClientError(f"not a message: {json.dumps(response)[:300]}")
        message = {"role": "assistant", "content": response["content"]}
        return self._turn(message, response.get("stop_reason"), response.get("usage"), response)

    def _turn(self, message: dict, stop_reason: str | None, usage: dict | None, raw: Any) -> Turn:
        blocks = message["content"]
        calls = [ToolCall(b.get("id", ""), b.get("name", ""), json.dumps(b.get("input", {}), ensure_ascii=False))
                 for b in blocks if b.get("type") == "tool_use"]
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        thinking = [b.get("thinking", "") for b in blocks if b.get("type") == "thinking"]
        finish = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
                  "max_tokens": "length"}.get(stop_reason or "", stop_reason or "stop")
        u = usage or {}
        cached = u.get("cache_read_input_tokens") or 0
        # Anthropic's input_tokens excludes what was read from cache; Usage.prompt_tokens is the whole prompt
        return Turn(message, calls, text, "".join(thinking) if thinking else None, finish,
                    Usage((u.get("input_tokens") or 0) + cached, u.get("output_tokens") or 0, 0, cached), raw)

    def stream(self, events: Iterable[dict[str, Any]], on_event: OnEvent | None) -> Turn:
        blocks: dict[int, dict[str, Any]] = {}
        partial: dict[int, str] = {}
        usage: dict[str, Any] = {}
        stop_reason, raw = None, []
        for ev in events:
            raw.append(ev)
            kind = ev.get("type")
            if kind == "message_start":
                usage.update((ev.get("message") or {}).get("usage") or {})
            elif kind == "content_block_start":
                block = dict(ev.get("content_block") or {})
                blocks[ev.get("index", len(blocks))] = block
                if block.get("type") == "tool_use":
                    partial[ev.get("index", 0)] = ""
                    if on_event:
                        on_event("tool_call", {"id": block.get("id", ""), "name": block.get("name", "")})
            elif kind == "content_block_delta":
                i, d = ev.get("index", 0), ev.get("delta") or {}
                block = blocks.setdefault(i, {})
                if d.get("type") == "text_delta":
                    block["text"] = block.get("text", "") + d.get("text", "")
                    if on_event:
                        on_event("text", {"text": d.get("text", "")})
                elif d.get("type") == "thinking_delta":
                    block["thinking"] = block.get("thinking", "") + d.get("thinking", "")
                    if on_event:
                        on_event("thinking", {"text": d.get("thinking", "")})
                elif d.get("type") == "signature_delta":
                    block["signature"] = block.get("signature", "") + d.get("signature", "")
                elif d.get("type") == "input_json_delta":
                    partial[i] = partial.get(i, "") + d.get("partial_json", "")
                    if on_event:
                        on_event("tool_args", {"text": d.get("partial_json", "")})
            elif kind == "content_block_stop":
                i = ev.get("index", 0)
                if i in partial:
                    try:
                        blocks[i]["input"] = json.loads(partial.pop(i) or "{}")
                    except ValueError as e:
                        raise ClientError(f"tool_use block {i} streamed invalid input JSON: {e}") from None
            elif kind == "message_delta":
                stop_reason = (ev.get("delta") or {}).get("stop_reason") or stop_reason
                usage.update(ev.get("usage") or {})
            elif kind == "error":
                err = ev.get("error") or {}
                raise ClientError(f"the stream ended with an error: {err.get('type')}: {err.get('message')}",
                                  body=ev)
        message = {"role": "assistant", "content": [blocks[i] for i in sorted(blocks)]}
        return self._turn(message, stop_reason, usage, raw)

    def result_messages(self, calls: list[ToolCall], results: list[ToolResult]) -> list[dict[str, Any]]:
        blocks = [{"type": "tool_result", "tool_use_id": c.id, "content": r.content, **({"is_error": True}
                                                                                        if r.is_error else {})}
                  for c, r in zip(calls, results, strict=True)]
        return [{"role": "user", "content": blocks}] if blocks else []


WIRES = {"openai": OpenAIWire, "anthropic": AnthropicWire}


def error_text(status: int, body: Any) -> str:
    """The API's own error message (either shape), else the body's start."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"{status} {err.get('type') or ''}: {err['message']}".replace(" :", ":")
    return f"{status}: {str(body)[:300]}"


class HTTPClient:
    """Any endpoint that speaks the wire's API. `base_url` is the server root (a trailing /v1 is allowed)."""

    def __init__(self, base_url: str, api: str = "openai", model: str | None = None, api_key: str | None = None,
                 stream: bool = True, timeout: float = 600.0):
        import httpx

        if api not in WIRES:
            raise ValueError(f"api={api!r}: allowed {', '.join(WIRES)}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key, self.stream_mode = api_key, stream
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))
        self.wire = WIRES[api](model or self._first_model(api))

    def _first_model(self, api: str) -> str:
        """The served model id from GET /v1/models (both APIs list models there)."""
        headers = WIRES[api]("").headers(self.api_key)
        if self.api_key and api == "anthropic":
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = self._json("GET", "/v1/models", headers=headers)
        try:
            return data["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise ClientError(f"{self.base_url}/v1/models lists no model; pass one explicitly") from None

    def _json(self, method: str, path: str, **kw) -> Any:
        import httpx

        try:
            r = self.http.request(method, self.base_url + path, **kw)
        except httpx.HTTPError as e:
            raise ClientError(f"{method} {self.base_url}{path} failed: {type(e).__name__}: {e}") from None
        body = _body(r.content)
        if r.status_code >= 400:
            raise ClientError(error_text(r.status_code, body), r.status_code, body)
        return body

    def complete(self, req: StepRequest, on_event: OnEvent | None = None) -> tuple[dict[str, Any], Turn]:
        """(the request body sent, the turn that came back)."""
        import httpx

        body = self.wire.body(req, self.stream_mode)
        headers = {"Content-Type": "application/json", **self.wire.headers(self.api_key)}
        data = json.dumps(body, ensure_ascii=False).encode()
        t0 = time.perf_counter()
        if not self.stream_mode:
            turn = self.wire.turn(self._json("POST", self.wire.path, content=data, headers=headers))
            turn.elapsed_s = time.perf_counter() - t0
            emit_turn(turn, on_event)
            return body, turn
        first: list[float] = []
        try:
            with self.http.stream("POST", self.base_url + self.wire.path, content=data, headers=headers) as r:
                if r.status_code >= 400:
                    r.read()
                    content = _body(r.content)
                    raise ClientError(error_text(r.status_code, content), r.status_code, content)
                turn = self.wire.stream(_sse(r.iter_lines(), first), on_event)
        except httpx.HTTPError as e:
            raise ClientError(f"POST {self.base_url}{self.wire.path} failed: {type(e).__name__}: {e}") from None
        turn.elapsed_s = time.perf_counter() - t0
        turn.ttft_s = first[0] - t0 if first else None
        return body, turn

    def close(self) -> None:
        self.http.close()


def emit_turn(turn: Turn, on_event: OnEvent | None) -> None:
    """The events a stream of this whole turn would have produced, at once (for non-streamed replies)."""
    if on_event is None:
        return
    if turn.thinking:
        on_event("thinking", {"text": turn.thinking})
    if turn.text:
        on_event("text", {"text": turn.text})
    for c in turn.calls:
        on_event("tool_call", {"id": c.id, "name": c.name})
        on_event("tool_args", {"text": c.arguments})


def _body(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")


def _sse(lines: Iterable[str], first: list[float]) -> Iterator[dict[str, Any]]:
    """The JSON objects of an event stream's `data:` lines, up to OpenAI's `[DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # event names, comments, blank separators: the data carries the type
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if not first:
            first.append(time.perf_counter())
        try:
            yield json.loads(data)
        except ValueError:
            raise ClientError(f"the stream sent a data line that is not JSON: {data[:200]!r}") from None


class ReplayClient:
    """Answers each step with the turn a transcript recorded, after checking the request body is the one
    recorded then (a changed tool result or loop setting shows up as the first differing step)."""

    def __init__(self, api: str, model: str, steps: list[tuple[dict[str, Any], dict[str, Any]]],
                 stream: bool = True):
        self.wire = WIRES[api](model)
        self.steps, self.stream_mode, self.i = steps, stream, 0

    def complete(self, req: StepRequest, on_event: OnEvent | None = None) -> tuple[dict[str, Any], Turn]:
        if self.i >= len(self.steps):
            raise ClientError(f"the transcript has {len(self.steps)} model steps; the replay asked for more")
        recorded_body, response = self.steps[self.i]
        body = self.wire.body(req, self.stream_mode)
        if body != recorded_body:
            raise ClientError(f"replay diverged at step {self.i}: {first_difference(recorded_body, body)}")
        self.i += 1
        turn = self.wire.stream(response, on_event) if isinstance(response, list) else self.wire.turn(response)
        return body, turn

    def close(self) -> None:
        pass


def first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where two JSON values first differ, as a path (for replay and history checks)."""
    if type(a) is not type(b):
        return f"{where or 'the body'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{where}.{k}: only in the {'recorded' if k in a else 'new'} request"
            if a[k] != b[k]:
                return first_difference(a[k], b[k], f"{where}.{k}")
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
    return f"{where}: {json.dumps(a)[:120]} vs {json.dumps(b)[:120]}"
