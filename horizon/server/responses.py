"""OpenAI Responses API: `POST /v1/responses` (streaming and not), `GET` / `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items`.

A thin adapter over the serving seam, like the Chat Completions one: the body becomes a `ChatRequest`
(input items -> horizon.chat messages, function tools, the tool policy, sampling) and the engine's
parser deltas become output items — `reasoning` (`content: [{type: "reasoning_text", text}]`, as gpt-oss
returns it; `summary: []`, since no summaries are produced), `message` (`output_text`), `function_call`.

Statefulness, with the full-history rule kept in each mode:
  * `store: true` (the default): the response, its input items and the conversation it closes are kept in
    an SQLite file (`--responses-db`, per tenant, 30 days by default), so `previous_response_id` chains
    survive restarts; an unknown or foreign id is a 400 `previous_response_not_found`. `instructions` are
    not carried along a chain (as in the reference).
  * Whole-history resends (the OpenAI Agents SDK's default): an item whose `id` the store knows is taken
    from the store, not from the resent text; a reasoning item with neither a known id nor valid
    `encrypted_content` counts as missing thinking (the seam's restoration runs first, then the history
    policy).
  * `store: false` with `include: ["reasoning.encrypted_content"]`: reasoning items carry the thinking
    sealed under the server's key (`horizon.serving.sealed`: AES-GCM, bound to tenant, model, tier and
    item id), opened and rendered when sent back; a tampered or foreign blob is a 400 naming `input[i]`.

Other choices: `reasoning.effort` maps as Chat Completions' `reasoning_effort` (absent: thinking off);
`max_output_tokens` counts thinking (absent: the seam's default); `truncation: "auto"` drops whole early
turns (from a user message to the next), never the current tool loop; `disabled` (the default) answers a
prompt that does not fit with `context_length_exceeded`. Streaming sends `response.created`,
`response.in_progress`, the item and part events with their deltas, then `response.completed` (or
`response.incomplete` / `response.failed`), each with a `sequence_number`, and no `[DONE]`.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from horizon.chat import ReasoningDelta, TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart, tier_from_reasoning_effort
from horizon.engine import FinishEvent, SamplingParams, TokenEvent, Usage
from horizon.server.http import off_loop, request_tenant, response_headers, run_until_done
from horizon.server.openai import OpenAIRoute, openai_error
from horizon.server.responses_types import ResponsesRequest
from horizon.serving import ChatRequest, Conversation, ModelService, ServiceError, Tool, ToolPolicy, failure
from horizon.serving.responses_store import ResponseStore
from horizon.serving.sealed import ReasoningSeal, SealError
from horizon.serving.turns import NamelessCallsAsText

router = APIRouter(route_class=OpenAIRoute)
ENCRYPTED = "reasoning.encrypted_content"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"  # 192 random bits


def bad(message: str, param: str | None = None, code: str | None = None) -> ServiceError:
    return ServiceError("invalid_request", message, param=param, code=code)


# --- input items -> horizon.chat messages --------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    tenant: str
    model: str
    store: ResponseStore
    seal: ReasoningSeal


def _text_parts(content: Any, where: str, kinds: tuple[str, ...]) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content: a string or a list of content parts", where)
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        at = f"{where}.content[{j}]"
        if kind in kinds and kind in ("input_text", "output_text"):
            if not isinstance(p.get("text"), str):
                raise bad(f"{at}.text: a string is needed", at)
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "refusal" and kind in kinds:
            parts.append({"type": "text", "text": str(p.get("refusal", ""))})
        elif kind == "input_image" and kind in kinds:
            url = p.get("image_url")
            if not isinstance(url, str):
                raise bad(f"{at}: only images given as `image_url` (a data URL) are supported here (no file_id)", at)
            parts.append({"type": "image_url", "image_url": {"url": url}, "_where": at})
        else:
            raise bad(f"{at}: a {kind!r} part cannot appear here; allowed: {', '.join(kinds)}", at)
    return parts


class Translator:
    """Input items (and the stored conversation of `previous_response_id`) -> messages; an assistant turn is a run
    of reasoning, assistant message and function_call items, in that order."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.messages: list[dict] = []
        self.origins: list[str] = []
        self.turn: dict | None = None
        self.turn_at = ""

    def _flush(self) -> None:
        if self.turn is not None:
            self.messages.append(self.turn)
            self.origins.append(self.turn_at)
            self.turn = None

    def _assistant(self, where: str, stage: int) -> dict:
        """The open assistant turn, or a new one if this item cannot continue it (stage: 0 reasoning, 1 text,
        2 calls)."""
        if self.turn is not None and (stage < self.turn["_stage"] or stage == self.turn["_stage"] == 0):
            self._flush()
        if self.turn is None:
            self.turn = {"role": "assistant", "content": None, "reasoning_content": None, "_stage": -1}
            self.turn_at = where
        self.turn["_stage"] = stage
        return self.turn

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise bad(f"{where}: an input item must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        known = self.ctx.store.item(self.ctx.tenant, item["id"]) if isinstance(item.get("id"), str) else None
        if kind == "item_reference":
            if known is None:
                raise bad(f"{where}: item {item.get('id')!r} is not stored here", where)
            return self.add(known, where)
        if known is not None and known.get("type") == kind:
            item = known  # a stored item: what the server generated, not what was resent
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                turn = self._assistant(where, 1)
                text = "".join(p["text"] for p in _text_parts(item.get("content"), where, ("output_text", "refusal")))
                turn["content"] = (turn["content"] or "") + text
                if "tier" in item:
                    turn["thinking_tier"] = item["tier"]
                return
            if role not in ("user", "system", "developer"):
                raise bad(f"{where}.role: {role!r}; allowed: user, system, developer, assistant", where)
            self._flush()
            kinds = ("input_text", "input_image") if role == "user" else ("input_text",)
            self.messages.append({"role": "system" if role == "developer" else role,
                                  "content": _text_parts(item.get("content"), where, kinds)})
            self.origins.append(where)
        elif kind == "reasoning":
            turn = self._assistant(where, 0)
            thinking = self._thinking(item, where, known)
            if thinking is not None:
                turn["reasoning_content"], turn["thinking_tier"] = thinking
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item.get(key):
                    raise bad(f"{where}.{key}: a non-empty string is needed", where)
            if not isinstance(item.get("arguments"), str):
                raise bad(f"{where}.arguments: the call's arguments as a JSON string are needed", where)
            turn = self._assistant(where, 2)
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
            if "tier" in item and "thinking_tier" not in turn:
                turn["thinking_tier"] = item["tier"]
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id: a string is needed", where)
            self._flush()
            output = item.get("output")
            content = output if isinstance(output, str) else _text_parts(output, where, ("input_text", "input_image"))
            self.messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
            self.origins.append(where)
        else:
            raise bad(f"{where}.type: {kind!r} is not supported; allowed: message, reasoning, function_call, "
                      "function_call_output, item_reference", where)

    def _thinking(self, item: dict, where: str, known: dict | None) -> tuple[str, str] | None:
        """(thinking, tier) from the store or from a sealed blob; None if neither vouches for it."""
        if known is not None and "thinking" in known:
            return known["thinking"], known["tier"]
        blob = item.get("encrypted_content")
        if isinstance(blob, str) and blob:
            try:
                tier, payload = self.ctx.seal.open(blob, tenant=self.ctx.tenant, model=self.ctx.model,
                                                   item_id=str(item.get("id")))
            except SealError as e:
                raise bad(f"{where}.encrypted_content: {e}; send reasoning items back exactly as returned",
                          f"{where}.encrypted_content") from None
            return payload["text"], tier
        return None  # resent text vouched for by nothing: the seam's restoration, then the history policy

    def result(self) -> tuple[list[dict], list[str]]:
        self._flush()
        for m in self.messages:
            m.pop("_stage", None)
        return self.messages, self.origins


def plan_request(body: ResponsesRequest, service: ModelService, ctx: Context) -> tuple[ChatRequest, list[dict]]:
    """(the seam's request, the input items as given with ids assigned)."""
    if body.model != service.model_id:
        raise ServiceError("not_found", f"The model {body.model!r} does not exist; this server serves "
                                        f"{service.model_id!r}", param="model", code="model_not_found")
    tier = tier_from_reasoning_effort(body.reasoning.effort) if body.reasoning and body.reasoning.effort else None
    tools = []
    for i, t in enumerate(body.tools or ()):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad(f"tools[{i}].type: {kind!r} tools are not served here; only function tools", f"tools[{i}]")
        name = t.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= 128:
            raise bad(f"tools[{i}].name: a string of 1 to 128 characters is needed", f"tools[{i}].name")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"tools[{i}].parameters: a JSON schema object is needed", f"tools[{i}].parameters")
        if not isinstance(t.get("description"), str | None):
            raise bad(f"tools[{i}].description: a string is needed", f"tools[{i}].description")
        if not isinstance(t.get("strict"), bool | None):
            raise bad(f"tools[{i}].strict: true or false is needed", f"tools[{i}].strict")
        tools.append(Tool(name, params, t.get("description"), t.get("strict") is not False))
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    fmt = body.text.format if body.text else None
    schema = None if fmt is None or fmt.type == "text" else (fmt.schema_ if fmt.type == "json_schema"
                                                             else {"type": "object"})
    policy = ToolPolicy(choice if isinstance(choice, str) else choice.name,
                        parallel=body.parallel_tool_calls and isinstance(choice, str), response_schema=schema,
                        response_param="text.format")

    translator = Translator(ctx)
    if body.previous_response_id is not None:
        previous = ctx.store.get(ctx.tenant, body.previous_response_id)
        if previous is None:
            raise bad(f"Previous response with id {body.previous_response_id!r} not found.", "previous_response_id",
                      "previous_response_not_found")
        translator.messages = [dict(m) for m in previous.messages]
        translator.origins = [f"previous_response_id ({body.previous_response_id})"] * len(previous.messages)
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    given = []
    for i, item in enumerate(items):
        translator.add(item, f"input[{i}]" if isinstance(body.input, list) else "input")
        if isinstance(item, dict):
            given.append(listed(item))
    messages, origins = translator.result()
    if body.instructions:
        messages, origins = [{"role": "system", "content": body.instructions}, *messages], ["instructions", *origins]
    extra = body.model_extra or {}
    params = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p,
                            seed=extra.get("seed") if isinstance(extra.get("seed"), int) else None)
    conv = Conversation(messages, tools, tier, origins)
    return ChatRequest(conv, policy, params, body.max_output_tokens, ctx.tenant), given


def listed(item: dict) -> dict:
    """An input item as `input_items` lists it: with an id, and a message's string content as one text part."""
    out = {"id": item.get("id") or new_id("msg" if item.get("type", "message") == "message" else "item"), **item}
    if out.get("type", "message") == "message":
        out["type"] = "message"
        if isinstance(out.get("content"), str):
            kind = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": kind, "text": out["content"]}]
    return out


def truncated(req: ChatRequest) -> ChatRequest | None:
    """The request without its earliest whole turn (a user message up to the next one), or None when only the
    current tool loop is left (it is never dropped)."""
    messages, origins = req.conversation.messages, req.conversation.origins
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if len(users) < 2:
        return None
    lo, hi = users[0], users[1]
    conv = dataclasses.replace(req.conversation, messages=messages[:lo] + messages[hi:],
                               origins=(origins[:lo] + origins[hi:]) if origins else None)
    return dataclasses.replace(req, conversation=conv)


def prepare(service: ModelService, req: ChatRequest, truncation: str | None):
    while True:
        try:
            return service.prepare(req)
        except ServiceError as e:
            if e.code != "context_length_exceeded" or truncation != "auto" or (shorter := truncated(req)) is None:
                raise
            req = shorter


# --- engine events -> output items ---------------------------------------------------------------------------
class Output:
    """Builds the output items of one response from parser deltas; every method returns the stream events it adds
    (without sequence numbers), so the streamed and the whole response are the same by construction."""

    def __init__(self, tier: str | None, ctx: Context, encrypted: bool):
        self.tier, self.ctx, self.encrypted = tier, ctx, encrypted
        self.items: list[dict] = []
        self.private: list[dict] = []  # what the store keeps of each item (the thinking, the tier)
        self.open: dict | None = None
        self.open_index = -1
        self.thinking_ids: list[int] = []
        self.as_text = NamelessCallsAsText()
        self.calls: dict[int, dict] = {}

    def _added(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open, self.open_index = item, len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _part(self, part: dict) -> list[dict]:
        item = self.open
        item["content"].append(part)
        return [{"type": "response.content_part.added", "item_id": item["id"], "output_index": len(self.items) - 1,
                 "content_index": len(item["content"]) - 1, "part": dict(part)}]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def begin(self) -> list[dict]:
        if self.tier is None:
            return []
        return (self._added({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []})
                + self._part({"type": "reasoning_text", "text": ""}))

    def feed(self, event: TokenEvent | None, deltas) -> list[dict]:
        out: list[dict] = []
        if event is not None and self.open is not None and self.open["type"] == "reasoning":
            self.thinking_ids.append(event.token_id)
        for d in self.as_text(deltas):
            if isinstance(d, ReasoningDelta):
                if self.open is not None and self.open["type"] == "reasoning":
                    self.open["content"][0]["text"] += d.text
                    out.append({"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                                "delta": d.text})
            elif isinstance(d, TextDelta):
                if self.open is None or self.open["type"] != "message":
                    out += self._close()
                    out += self._added({"type": "message", "id": new_id("msg"), "role": "assistant",
                                        "status": "in_progress", "content": []})
                    out += self._part({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                self.open["content"][0]["text"] += d.text
                out.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                            "delta": d.text, "logprobs": []})
            elif isinstance(d, ToolCallStart):
                out += self._close()
                call = {"type": "function_call", "id": new_id("fc"), "call_id": d.id, "name": d.name,
                        "arguments": "", "status": "in_progress"}
                self.calls[d.index] = call
                out += self._added(call)
            elif isinstance(d, ToolCallArgs):
                call = self.calls[d.index]
                call["arguments"] += d.text
                out.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": d.text})
            elif isinstance(d, ToolCallEnd) and d.index in self.calls:
                out += self._close()
        return out

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": self.open_index}
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out += [{"type": "response.reasoning_text.done", **at, "content_index": 0, "text": text},
                    {"type": "response.content_part.done", **at, "content_index": 0, "part": dict(item["content"][0])}]
            self.private.append({"id": item["id"], "type": "reasoning", "thinking": text, "tier": self.tier})
            if self.encrypted:
                item["encrypted_content"] = self.ctx.seal.seal(
                    {"text": text, "token_ids": self.thinking_ids, "tier": self.tier}, tenant=self.ctx.tenant,
                    model=self.ctx.model, tier=self.tier, item_id=item["id"])
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            out += [{"type": "response.output_text.done", **at, "content_index": 0, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", **at, "content_index": 0, "part": dict(item["content"][0])}]
            item["status"] = "completed"
            self.private.append({"id": item["id"], "type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": text}], "tier": self.tier or "off"})
        else:
            out.append({"type": "response.function_call_arguments.done", **at, "name": item["name"],
                        "arguments": item["arguments"]})
            item["status"] = "completed"
            self.private.append({k: item[k] for k in ("id", "type", "call_id", "name", "arguments")}
                                | {"tier": self.tier or "off"})
        return out + [{"type": "response.output_item.done", "output_index": at["output_index"], "item": dict(item)}]

    def finish(self, deltas) -> list[dict]:
        return self.feed(None, deltas) + self._close()

    def assistant_message(self) -> dict:
        """This output as the next turn's history renders it (what the store keeps for `previous_response_id`)."""
        text = "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        reasoning = next((i["content"][0]["text"] for i in self.items if i["type"] == "reasoning"), None)
        msg = {"role": "assistant", "content": text or None, "reasoning_content": reasoning,
               "thinking_tier": self.tier or "off"}
        if calls:
            msg["tool_calls"] = calls
        return msg


def usage_json(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class Run:
    """One response: the object, its output as it grows, and what is stored when it ends."""

    def __init__(self, body: ResponsesRequest, prepared, given: list[dict], ctx: Context, service: ModelService):
        self.body, self.prepared, self.given, self.ctx = body, prepared, given, ctx
        self.failure: ServiceError | None = None  # why it ended without an answer
        tier = prepared.conversation.tier
        self.output = Output(tier, ctx, ENCRYPTED in (body.include or ()))
        fmt = body.text.format.model_dump(by_alias=True) if body.text and body.text.format else {"type": "text"}
        choice = body.tool_choice.model_dump() if body.tool_choice is not None and not isinstance(
            body.tool_choice, str) else (body.tool_choice or "auto")
        self.response = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": service.model_id, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": body.reasoning.summary if body.reasoning else None},
            "store": body.store, "temperature": prepared.params.temperature, "text": {"format": fmt},
            "tool_choice": choice, "top_p": prepared.params.top_p, "truncation": body.truncation or "disabled",
            "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                       "strict": t.strict} for t in prepared.conversation.tools],
            "usage": None, "metadata": body.metadata or {}}

    def end(self, finish: FinishEvent) -> str:
        """Fill in the final state and store it; returns the lifecycle event type that ends the stream."""
        r = self.response
        r["output"] = self.output.items
        r["usage"] = usage_json(finish.usage)
        if finish.reason in ("stop", "length"):
            r["status"] = "completed" if finish.reason == "stop" else "incomplete"
            if finish.reason == "length":
                r["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.failure = failure(finish)
            r["status"] = "failed"
            r["error"] = {"code": {"unavailable": "server_shutting_down"}.get(self.failure.kind, "server_error"),
                          "message": self.failure.message}
        if self.body.store and r["status"] != "failed":
            conversation = [m for m, at in zip(self.prepared.conversation.messages,
                                               self.prepared.conversation.origins or (), strict=False)
                            if at != "instructions"]
            messages = conversation + [self.output.assistant_message()]
            self.ctx.store.put(self.ctx.tenant, r, self.given, messages, self.output.private)
        return {"completed": "response.completed", "incomplete": "response.incomplete"}.get(r["status"],
                                                                                          "response.failed")


def context(request: Request, service: ModelService) -> Context:
    state = request.app.state
    return Context(request_tenant(request), service.model_id, state.responses_store, state.reasoning_seal)


# --- routes ------------------------------------------------------------------------------------------------------
@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    service: ModelService = request.app.state.service
    ctx = context(request, service)

    def planned():
        req, given = plan_request(body, service, ctx)
        return prepare(service, req, body.truncation), given

    prepared, given = await off_loop(planned)
    stream = service.start(prepared, request_id=getattr(request.state, "request_id", None))
    run = Run(body, prepared, given, ctx, service)
    headers = response_headers(prepared)
    metrics, arrived = request.app.state.metrics, time.perf_counter()
    if body.stream:
        return StreamingResponse(sse(run, stream, metrics, arrived), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})
    finished: list[FinishEvent] = []

    async def consume() -> None:
        run.output.begin()
        async for event in stream:
            if isinstance(event, TokenEvent):
                run.output.feed(event, event.deltas)
            else:
                run.output.finish(event.deltas)
                finished.append(event)

    if not await run_until_done(request, consume(), stream.cancel):
        return Response(status_code=499)  # the client went away (nginx's code); nobody reads this
    metrics.observe_usage(finished[0].usage)
    run.end(finished[0])
    if run.failure is not None:
        raise run.failure
    return JSONResponse(run.response, headers=headers)


async def sse(run: Run, stream, metrics, arrived: float) -> AsyncIterator[str]:
    """The event stream; Starlette cancels this generator when the client disconnects, and `finally` frees the
    engine request."""
    seq = 0

    def frame(event: dict) -> str:
        nonlocal seq
        event = {**event, "sequence_number": seq}
        seq += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

    first = True
    try:
        yield frame({"type": "response.created", "response": dict(run.response)})
        yield frame({"type": "response.in_progress", "response": dict(run.response)})
        for e in run.output.begin():
            yield frame(e)
        async for event in stream:
            if isinstance(event, TokenEvent):
                if first:
                    first = False
                    metrics.ttft.observe(time.perf_counter() - arrived)
                for e in run.output.feed(event, event.deltas):
                    yield frame(e)
                continue
            for e in run.output.finish(event.deltas):
                yield frame(e)
            metrics.observe_usage(event.usage)
            ending = run.end(event)
            yield frame({"type": ending, "response": run.response})
            return
    finally:
        stream.cancel()


def _stored(request: Request, response_id: str):
    ctx = context(request, request.app.state.service)
    return ctx, ctx.store.get(ctx.tenant, response_id)


def _not_found(response_id: str) -> JSONResponse:
    return openai_error(404, f"No response with id {response_id!r} is stored here (for this API key).",
                        type_="invalid_request_error", param="response_id", code="not_found")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    _, stored = _stored(request, response_id)
    return _not_found(response_id) if stored is None else JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    ctx = context(request, request.app.state.service)
    if not ctx.store.delete(ctx.tenant, response_id):
        return _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request, after: str | None = None, limit: int = 20,
                      order: str = "desc"):
    ctx = context(request, request.app.state.service)
    try:
        page = ctx.store.list_input_items(ctx.tenant, response_id, after=after, limit=limit, order=order)
    except ValueError as e:
        where = next((k for k in ("after", "limit") if k in str(e)), "order")
        raise RequestValidationError([{"loc": ("query", where), "msg": str(e), "type": "value_error"}]) from None
    if page is None:
        return _not_found(response_id)
    data, more = page
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
