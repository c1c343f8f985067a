"""OpenAI-compatible routes: `GET /v1/models` and `POST /v1/chat/completions` (streaming and not).

A thin adapter over the serving seam: the body becomes a `ChatRequest` (conversation, tool policy,
sampling; `horizon.serving` validates, renders, sizes, constrains and submits it, and restores
thinking the client dropped); the engine's parser deltas become a `chat.completion` (or
`chat.completion.chunk` events). Choices made where OpenAI leaves room or Horizon differs:

* `model` must be the served id; another id is a 404 `model_not_found`, as OpenAI answers.
* `reasoning_effort`: minimal|low -> low, medium|high -> high, xhigh|max -> max, none -> off. Absent:
  thinking off (what a client that never asked for reasoning expects, and cheapest). The seeds'
  `thinking_budget` says the same: `"none" | "low" | "high" | "max"`, or an integer cap on thinking
  tokens (the prompt states the smallest tier whose budget covers it); it must agree with
  `reasoning_effort` when both are sent.
* `max_completion_tokens` (or `max_tokens`) counts thinking. Absent: 4096 answer tokens plus the
  thinking budget, capped by what the context window leaves after the prompt. A prompt that does not
  fit is a 400 with `code: context_length_exceeded` and OpenAI's wording.
* Tools (`horizon.serving.policy` has the rules): no tools or `tool_choice: none` bans the tool-call
  token; under `auto` a grammar allows text and/or calls to the declared tools only (a `strict` tool's
  arguments follow its schema, others' any JSON object); `required` and a named function force calls
  whose arguments follow the schema, strict or not (a named function: exactly one call).
  `parallel_tool_calls: false` allows one call.
* `response_format` `json_schema` is always enforced (strict or not), thinking on or off; `json_object`
  is any object. With tools under `auto` the answer is that JSON or tool calls.
* Thinking turns sent back without `reasoning_content` (which Chat Completions has no request field
  for) are restored from the server's memory when they match what it generated; the
  `x-horizon-restored` header counts them.
* `n`: n engine requests with seeds seed+i; usage counts the prompt once (as OpenAI does).
* The assistant message carries `reasoning_content` ("" when thinking was on and empty, null when
  off) and the Horizon field `thinking_tier`, and call `arguments` exactly as generated, so a client
  that appends it verbatim renders the exact tokens of this turn and the next turn reuses the cache.
* Malformed model output never fails a request. Every call the parser read is returned in
  `tool_calls` with its arguments as generated; a call whose name could not be read (no client could
  run it) is returned as text in `content`. Each problem is listed in the choice's `parse_errors`
  ([{code, message, tool_call_index}]), a Horizon extension.
* `logprobs.content` covers the answer tokens (text, tool calls, the end token); thinking tokens are
  in `logprobs.reasoning_content` (extension). Special tokens appear as their text.
* History warnings (policy `warn`, calls with invalid arguments, unknown tools, schemas held to any
  object) are listed in the `x-horizon-warning` response header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from horizon.chat import (
    ErrorDelta,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
    tier_from_budget_tokens,
    tier_from_reasoning_effort,
)
from horizon.engine import FinishEvent, SamplingParams, TokenEvent, Usage
from horizon.server.http import (
    ParsedBody,
    off_loop,
    request_tenant,
    response_headers,
    run_until_done,
    stream_error,
)
from horizon.server.openai_types import ChatCompletionRequest
from horizon.serving import (
    ANONYMOUS,
    ChatRequest,
    Conversation,
    ModelService,
    ServiceError,
    Tool,
    ToolPolicy,
    failure,
    finish_reason,
)
from horizon.serving.turns import NamelessCallsAsText

STARTED = int(time.time())


class OpenAIRoute(ParsedBody):
    """Bodies parsed off the event loop (`ParsedBody`); validation errors answer in OpenAI's shape, with
    `param` naming the field."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return validation_error(exc)

        return route


router = APIRouter(route_class=OpenAIRoute)


@router.get("/v1/models")
async def list_models(request: Request):
    service = request.app.state.service
    return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": STARTED,
                                        "owned_by": "horizon", "max_model_len": service.context_window}]}


# --- errors ------------------------------------------------------------------------------------------
def openai_error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


def _param(loc: tuple) -> str | None:
    """`tools[0].function.name` from pydantic's location (union branch tags and 'body' left out)."""
    out, last = "", None
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == last:  # a discriminator tag named like the field it selects (`json_schema`)
            continue
        elif part.isidentifier() and part[:1].islower() and part not in ("str", "int", "float", "bool",
                                                                         "list", "dict", "literal"):
            out += f".{part}" if out else part
        last = part
    return out or None


def validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return openai_error(400, "invalid request body")
    param = _param(tuple(errors[0].get("loc", ())))
    messages = []
    for err in errors[:4]:
        where = _param(tuple(err.get("loc", ()))) or "body"
        text = f"{where}: {err.get('msg', 'invalid')}"
        if text not in messages:
            messages.append(text)
    return openai_error(400, "invalid request: " + "; ".join(messages), param=param)


# --- request -> the neutral request -------------------------------------------------------------------
def thinking_of(body: ChatCompletionRequest, budgets: dict[str, int]) -> tuple[str | None, int | None]:
    """(tier, thinking-token cap or None for the tier's) from `reasoning_effort` and/or `thinking_budget`."""
    tier = tier_from_reasoning_effort(body.reasoning_effort) if body.reasoning_effort else None
    budget, cap = body.thinking_budget, None
    if budget is None:
        return tier, None
    if isinstance(budget, int):
        cap, from_budget = budget, tier_from_budget_tokens(budget, budgets)
    else:
        from_budget = None if budget == "none" else budget
    if body.reasoning_effort is not None and from_budget != tier:
        raise ServiceError("invalid_request", f"thinking_budget {budget!r} (thinking {from_budget or 'off'}) "
                                              f"disagrees with reasoning_effort {body.reasoning_effort!r} (thinking "
                                              f"{tier or 'off'}); send one of them, or two that agree",
                           param="thinking_budget")
    return from_budget, cap


def plan_request(body: ChatCompletionRequest, service: ModelService, tenant: str = ANONYMOUS) -> ChatRequest:
    if body.top_logprobs is not None and not body.logprobs:
        raise ServiceError("invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")
    tier, budget = thinking_of(body, service.budgets)
    vocab = service.tokenizer.vocab_size
    bias = body.bias
    bad = [t for t in bias if not 0 <= t < vocab]
    if bad:
        raise ServiceError("invalid_request", f"logit_bias keys must be token ids in [0, {vocab}); got {bad[0]}",
                           param="logit_bias")
    tools = [Tool(t.function.name, t.function.parameters, t.function.description, bool(t.function.strict))
             for t in body.tools or ()]
    try:
        json.dumps([t.parameters for t in tools], allow_nan=False)
    except ValueError:
        raise ServiceError("invalid_request", "tool parameters must be JSON (NaN and Infinity are not)",
                           param="tools") from None
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    policy = ToolPolicy(choice if isinstance(choice, str) else choice.function.name,
                        parallel=body.parallel_tool_calls and isinstance(choice, str),
                        response_schema=response_schema(body))
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop_list,
                            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                            logit_bias=bias, thinking_budget=budget)
    return ChatRequest(Conversation(body.messages, tools, tier), policy, params, body.max_new_tokens, tenant)


def response_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema response_format asks for (json_object: any object); None for text or absent."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and fmt.json_schema.schema_ is not None:
        return fmt.json_schema.schema_
    return {"type": "object"}


# --- engine events -> OpenAI message pieces ----------------------------------------------------------
class Choice:
    """One choice: the parser's deltas in, OpenAI delta pieces out; also gathers the whole message."""

    def __init__(self, index: int, tier: str | None, tokenizer, logprobs: bool):
        self.index, self.tier, self.tok = index, tier, tokenizer
        self.special = tokenizer.special
        self.thinking = tier is not None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"}, in API order
        self.api_index: dict[int, int] = {}  # parser call index -> API index
        self.as_text = NamelessCallsAsText()
        self.errors: list[dict[str, Any]] = []
        self.logprobs = logprobs
        self.lp_content: list[dict] = []
        self.lp_reasoning: list[dict] = []
        self.finish: FinishEvent | None = None

    # logprobs -----------------------------------------------------------------------------------------
    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.tok.token_bytes(token_id) if 0 <= token_id < self.tok.vocab_size else None
        if raw is None:  # a special token (or an id past the tokenizer): its text
            text = self.tok.special_text.get(token_id, f"<id {token_id}>")
            raw = text.encode()
        else:
            text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(raw)}  # -inf is not JSON

    def on_token(self, event: TokenEvent) -> tuple[list[dict], dict | None]:
        """Delta pieces for one generated token, and its logprobs entry (for streaming)."""
        lp = None
        if self.logprobs and event.logprob is not None:
            entry = self._token(event.token_id, event.logprob)
            entry["top_logprobs"] = [self._token(t, v) for t, v in event.top_logprobs or []]
            in_thinking = self.thinking and event.token_id != self.special.tool_call
            (self.lp_reasoning if in_thinking else self.lp_content).append(entry)
            lp = {"content": [] if in_thinking else [entry], "reasoning_content": [entry] if in_thinking else []}
        if self.thinking and event.token_id in (self.special.think_end, self.special.tool_call):
            self.thinking = False  # the parser ends thinking at either
        return self.on_deltas(event.deltas), lp

    # deltas -------------------------------------------------------------------------------------------
    def on_deltas(self, deltas) -> list[dict]:
        pieces: list[dict] = []

        def text(key: str, s: str) -> None:
            (self.reasoning if key == "reasoning_content" else self.content).append(s)
            if pieces and list(pieces[-1]) == [key]:
                pieces[-1][key] += s
            else:
                pieces.append({key: s})

        for d in self.as_text(deltas):  # a call whose name could not be read: its text goes to the content
            if isinstance(d, ReasoningDelta):
                text("reasoning_content", d.text)
            elif isinstance(d, TextDelta):
                text("content", d.text)
            elif isinstance(d, ToolCallStart):
                i = self.api_index[d.index] = len(self.calls)
                self.calls.append({"id": d.id, "name": d.name, "arguments": ""})
                pieces.append({"tool_calls": [{"index": i, "id": d.id, "type": "function",
                                               "function": {"name": d.name, "arguments": ""}}]})
            elif isinstance(d, ToolCallArgs):
                i = self.api_index[d.index]
                self.calls[i]["arguments"] += d.text
                pieces.append({"tool_calls": [{"index": i, "function": {"arguments": d.text}}]})
            elif isinstance(d, ErrorDelta):
                error = {"code": d.code, "message": d.message}
                if d.index is not None:
                    i = self.api_index.get(d.index)
                    error["tool_call_index"] = i
                    if i is None:
                        error["message"] += " (the call's name could not be read: its text is in the content)"
                self.errors.append(error)
            # ToolCallEnd: nothing to send; the next call or the finish chunk follows
        return pieces

    def on_finish(self, event: FinishEvent) -> list[dict]:
        self.finish = event
        return self.on_deltas(event.deltas)

    # results ------------------------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.finish is not None and self.finish.reason not in ("stop", "length")

    @property
    def finish_reason(self) -> str:
        return finish_reason(self.finish.reason, len(self.calls))

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None,
                               "reasoning_content": "".join(self.reasoning) if self.tier else None,
                               "thinking_tier": self.tier or "off"}
        if self.calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        return msg

    def logprobs_object(self) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": self.lp_content, "refusal": None, "reasoning_content": self.lp_reasoning}

    def first_delta(self) -> dict[str, Any]:
        """Role and thinking tier; `reasoning_content: ""` so a client accumulating deltas has it even if empty."""
        delta = {"role": "assistant", "content": "", "thinking_tier": self.tier or "off"}
        if self.tier:
            delta["reasoning_content"] = ""
        return delta


def usage_object(choices: list[Choice]) -> dict[str, Any]:
    """OpenAI counts the prompt once for n choices; cached tokens: what every choice got from the cache."""
    usages = [c.finish.usage for c in choices if c.finish is not None] or [Usage()]
    prompt = usages[0].prompt_tokens
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(u.cached_tokens for u in usages),
                                      "image_tokens": usages[0].image_tokens},
            "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning_tokens for u in usages)}}


async def merged(streams) -> AsyncIterator[tuple[int, TokenEvent | FinishEvent]]:
    """(choice index, event) from n event streams as they arrive, until every one has finished."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        async for event in stream:
            queue.put_nowait((i, event))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, event = await queue.get()
            remaining -= isinstance(event, FinishEvent)
            yield i, event
    finally:
        for task in tasks:
            task.cancel()


# --- the route ---------------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    arrived = time.perf_counter()
    service: ModelService = request.app.state.service
    if body.model != service.model_id:
        return openai_error(404, f"The model {body.model!r} does not exist; this server serves "
                                 f"{service.model_id!r}", param="model", code="model_not_found")
    tenant = request_tenant(request)
    prepared = await off_loop(lambda: service.prepare(plan_request(body, service, tenant)))
    request_id = getattr(request.state, "request_id", None) or "req_" + secrets.token_hex(12)
    streams = []
    try:
        for i in range(body.n):
            streams.append(service.start(prepared, seed_offset=i, request_id=f"{request_id}-{i}"))
    except BaseException:
        for s in streams:
            s.cancel()
        raise

    head = {"id": "chatcmpl-" + request_id.removeprefix("req_"), "created": int(time.time()),
            "model": service.model_id}
    tier = prepared.conversation.tier
    run = Completion(head, [Choice(i, tier, service.tokenizer, body.logprobs) for i in range(body.n)], streams,
                     request.app.state.metrics, arrived)
    headers = response_headers(prepared)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(run.sse(include_usage), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})
    if not await run_until_done(request, run.consume(), run.cancel):
        return Response(status_code=499)  # the client went away (nginx's code); nobody reads this
    return JSONResponse(run.result(), headers=headers)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Completion:
    """One request's n choices over their event streams: chunks or the final object out, metrics recorded.

    Whoever drives it (`sse` or `gather`) cancels every stream when it stops, however it stops: a client
    that goes away frees its cache at once.
    """

    def __init__(self, head: dict, choices: list[Choice], streams, metrics, arrived: float):
        self.head, self.choices, self.streams = head, choices, streams
        self.metrics, self.arrived = metrics, arrived
        self.first_token = True

    def on_event(self, i: int, event) -> list[dict]:
        """Pieces {"delta", "logprobs"} to stream for one event of choice i."""
        c = self.choices[i]
        if isinstance(event, TokenEvent):
            if self.first_token:
                self.first_token = False
                self.metrics.ttft.observe(time.perf_counter() - self.arrived)
            pieces, lp = c.on_token(event)
            if not pieces:  # a token that completes nothing yet (part of a character): its logprobs alone
                return [{"delta": {}, "logprobs": lp}] if lp else []
            return [{"delta": p, "logprobs": lp if k == 0 else None} for k, p in enumerate(pieces)]
        self.metrics.observe_usage(event.usage)
        return [{"delta": p, "logprobs": None} for p in c.on_finish(event)]

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    # non-streaming ----------------------------------------------------------------------------------
    async def consume(self) -> None:
        """Run every choice to its end."""
        async with contextlib.aclosing(merged(self.streams)) as events:
            async for i, event in events:
                self.on_event(i, event)

    def result(self) -> dict[str, Any]:
        failed = next((c for c in self.choices if c.failed), None)
        if failed is not None:
            raise failure(failed.finish)
        choices = []
        for c in self.choices:
            choice = {"index": c.index, "message": c.message(), "finish_reason": c.finish_reason,
                      "logprobs": c.logprobs_object()}
            if c.errors:
                choice["parse_errors"] = c.errors
            choices.append(choice)
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": usage_object(self.choices)}

    # streaming --------------------------------------------------------------------------------------
    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        """The SSE body. Starlette cancels this generator when the client disconnects; `finally` frees the cache."""
        head = {**self.head, "object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict, finish_reason=None, logprobs=None, **extra) -> str:
            return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish_reason, **extra}]})

        try:
            for c in self.choices:
                yield chunk(c.index, c.first_delta())
            async with contextlib.aclosing(merged(self.streams)) as events:
                async for i, event in events:
                    for piece in self.on_event(i, event):
                        yield chunk(i, piece["delta"], logprobs=piece["logprobs"])
                    if isinstance(event, FinishEvent):
                        c = self.choices[i]
                        if c.failed:  # the status line is long gone: the error is the last event
                            yield sse(stream_error(failure(event)))
                            yield "data: [DONE]\n\n"
                            return
                        extra = {"parse_errors": c.errors} if c.errors else {}
                        yield chunk(i, {}, c.finish_reason, **extra)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_object(self.choices)})
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()
