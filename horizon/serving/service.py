"""ModelService: the one request path below the HTTP adapters and the in-process agent client.

Adapters (OpenAI, Anthropic, `EngineClient`) translate their request into a neutral `ChatRequest` —
a `Conversation` (horizon.chat's OpenAI-style messages, `Tool`s, the thinking tier), a `ToolPolicy`,
`SamplingParams` and `max_tokens` (None: the default) — and get back engine events. In between, once
and the same for every caller, so serving, eval and RL sample identically:

  1. restore the thinking of turns the server generated and the client sent back without it
     (`TurnStore`, per tenant), then check the history under the server's policy;
  2. render the prompt with the chat template (images decoded, placeholders sized);
  3. the context window: `max_tokens` given must fit beside the prompt; unset, it is 4096 answer
     tokens plus the thinking budget, capped by what the window leaves;
  4. the tool policy becomes a grammar and banned tokens (`policy.constraint_for`); when the grammar
     owes a structured answer (a response schema, a forced call), thinking closes early enough to leave
     `answer_reserve(max_tokens)` tokens for it;
  5. submit, with queue limits; a thinking turn is recorded in the `TurnStore` when it finishes.

The request carries the prompt's message boundaries (the end of the system prompt and tool definitions,
the last `prefix_snapshot_turns` block ends), where the engine keeps prefix-cache snapshots: every branch
of one history resumes from the deepest boundary they share. A prompt whose text alone cannot fit the
window (bytes / the longest token's bytes) is refused before it is tokenized.

    prepared = service.prepare(ChatRequest(conversation, policy, params, max_tokens, tenant))  # ServiceError
    stream = service.start(prepared)                                                         # ServiceError
    try:
        async for event in stream: ...
    finally:
        stream.cancel()                                                   # client gone: free the cache
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from horizon.chat import ChatTemplate, HistoryIssue, validate_history
from horizon.chat.images import (
    ImageError,
    ImageLimits,
    decode_conversation,
    image_digest,
    image_parts,
    render_with_images,
)
from horizon.chat.template import Rendered
from horizon.engine import Engine, EngineClosed, FinishEvent, QueueFull, Request, SamplingParams, TokenEvent
from horizon.engine.engine import EventStream, Result
from horizon.model.vision import num_image_tokens
from horizon.serving.policy import PolicyError, Tool, ToolPolicy, answer_reserve, constraint_for
from horizon.serving.turns import TurnStore, needs_thinking, restored, returned_message

DEFAULT_ANSWER_TOKENS = 4096  # default room for the answer when max_tokens is unset, on top of the thinking budget
ANONYMOUS = "anonymous"  # the tenant of a server without API keys


class ServiceError(Exception):
    """A request the service refuses. `kind` picks the status and error type in each API's shape; `code` is
    OpenAI's machine-readable code (e.g. `context_length_exceeded`, `missing_thinking`)."""

    def __init__(self, kind: str, message: str, param: str | None = None, code: str | None = None,
                 anthropic_message: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code
        self.anthropic_message = anthropic_message or message  # Anthropic's own wording, where it has one


# kind -> (HTTP status, OpenAI error type, Anthropic error type)
ERROR_KINDS = {
    "invalid_request": (400, "invalid_request_error", "invalid_request_error"),
    "authentication": (401, "authentication_error", "authentication_error"),
    "not_found": (404, "not_found_error", "not_found_error"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    "timeout": (408, "invalid_request_error", "invalid_request_error"),  # the client stalled
    "overloaded": (429, "rate_limit_error", "overloaded_error"),  # Anthropic answers 529
    "permission": (403, "permission_error", "permission_error"),
    "unavailable": (503, "server_error", "overloaded_error"),  # shutting down: retry elsewhere or later
    "internal": (500, "server_error", "api_error"),
}
RETRY_AFTER_S = 1  # the Retry-After of a refusal that a retry may fix (queue full, draining)


@dataclass
class Conversation:
    messages: list[dict[str, Any]]  # horizon.chat's message format (OpenAI style, reasoning_content)
    tools: list[Tool] = field(default_factory=list)
    tier: str | None = None  # thinking tier; None: off
    origins: list[str] | None = None  # where each message came from in the request (default `messages[i]`)
    # the API's own words for a history issue (None: horizon.chat's message)
    describe: Callable[[HistoryIssue, list[dict]], str | None] | None = None

    @property
    def rendered_tools(self) -> list[dict[str, Any]] | None:
        return [t.rendered() for t in self.tools] or None

    def where(self, index: int) -> str:
        return self.origins[index] if self.origins else f"messages[{index}]"


@dataclass
class ChatRequest:
    conversation: Conversation
    policy: ToolPolicy = field(default_factory=ToolPolicy)
    params: SamplingParams = field(default_factory=SamplingParams)  # its max_tokens is replaced (below)
    max_tokens: int | None = None  # thinking included; None: the default (module docstring)
    tenant: str = ANONYMOUS
    request_id: str | None = None
    record: bool = True  # keep its thinking turn for restoration (HTTP clients; not in-process callers)


@dataclass
class Prepared:
    request: Request  # for the engine: prompt ids, final sampling params, constraint, images
    conversation: Conversation  # after restoration
    prefix: bytes  # hash of the rendered prompt before the generation prompt, and its images (TurnStore)
    tenant: str
    record: bool
    warnings: list[str] = field(default_factory=list)  # served anyway: `where: message [code]`
    restored: int = 0  # assistant turns given back their thinking

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params


class TurnStream:
    """One request's engine events (an async iterator with `cancel()`); records the turn when it finishes."""

    def __init__(self, service: ModelService, prepared: Prepared, events: EventStream):
        self.service, self.prepared, self.events = service, prepared, events
        self.deltas: list = []
        self.token_ids: list[int] = []

    def __aiter__(self) -> TurnStream:
        return self

    async def __anext__(self):
        event = await self.events.__anext__()
        if isinstance(event, TokenEvent):
            self.deltas += event.deltas
            self.token_ids.append(event.token_id)
        elif isinstance(event, FinishEvent):
            self.service.record(self.prepared, self.deltas + event.deltas, self.token_ids, event.reason)
        return event

    def cancel(self) -> None:
        self.events.cancel()


class ModelService:
    def __init__(self, engine: Engine, tokenizer, model_id: str, history_policy: str = "reject",
                 max_queue: int = 64, image_limits: ImageLimits | None = None, turn_store_bytes: int = 64 * 1024**2,
                 prefix_snapshot_turns: int = 2):
        if history_policy not in ("reject", "strict", "warn"):
            raise ValueError(f"history_policy={history_policy!r}; allowed: reject, strict, warn")
        if prefix_snapshot_turns < 0:
            raise ValueError(f"prefix_snapshot_turns={prefix_snapshot_turns} must be >= 0")
        self.prefix_snapshot_turns = prefix_snapshot_turns
        # the most text bytes one token stands for: bytes / this is a lower bound on a text's token count
        # (text never encodes to a special token, so the ordinary tokens' bytes are all that count)
        self.max_token_bytes = max(map(len, engine.grammars.token_bytes))
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.template = ChatTemplate(tokenizer)
        self.history_policy, self.max_queue = history_policy, max_queue
        self.image_limits = image_limits or ImageLimits()
        self.turns = TurnStore(turn_store_bytes)

    @property
    def context_window(self) -> int:
        return self.engine.max_model_len

    @property
    def budgets(self) -> dict[str, int]:
        """Thinking-token caps per tier (the model's generation config)."""
        return self.engine.budgets

    # --- the conversation ------------------------------------------------------------------------------
    def check_history(self, conv: Conversation) -> list[str]:
        """Errors raise ServiceError naming the message (its `code` the issue's); warnings are returned."""
        try:
            issues = validate_history(conv.messages, tier=conv.tier, policy=self.history_policy,
                                      tools=conv.rendered_tools)
        except ValueError as e:  # malformed tool definitions (duplicate names, bad schemas)
            raise ServiceError("invalid_request", str(e), param="tools") from None

        def line(issue: HistoryIssue) -> str:
            text = (conv.describe(issue, conv.messages) if conv.describe else None) or issue.message
            return f"{conv.where(issue.index)}: {text} [{issue.code}]"

        errors = [i for i in issues if i.severity == "error"]
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ServiceError("invalid_request", line(first) + more, param=conv.where(first.index), code=first.code)
        return [line(i) for i in issues]

    def decode_images(self, conv: Conversation) -> dict[int, Any]:
        """Every image part's pixels (id of the part -> RGB uint8 [H, W, 3]); a bad image is a 400 naming it."""
        if self.engine.model.vision is None:
            for where, _ in image_parts(conv.messages):
                raise ServiceError("invalid_request", f"{where}: this model takes text only (it has no vision "
                                                      f"encoder)", param=where)
            return {}
        try:
            return decode_conversation(conv.messages, self.image_limits)
        except ImageError as e:
            raise ServiceError("invalid_request", str(e), param=getattr(e, "where", None)) from None

    def render(self, conv: Conversation, add_generation_prompt: bool = True,
               pixels: dict[int, Any] | None = None) -> tuple[list[int], list[Any]]:
        """(prompt ids, the images in placeholder order); each image takes the tokens its size gives."""
        out, images = self.render_full(conv, add_generation_prompt, pixels)
        return out.ids, images

    def render_full(self, conv: Conversation, add_generation_prompt: bool = True,
                    pixels: dict[int, Any] | None = None) -> tuple[Rendered, list[Any]]:
        """`render`, with the template's whole output (message boundaries included)."""
        cfg = self.engine.model.config
        try:
            return render_with_images(self.tokenizer, conv.messages, pixels or {},
                                      lambda h, w: num_image_tokens(cfg, h, w), tools=conv.rendered_tools,
                                      tier=conv.tier, add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise ServiceError("invalid_request", str(e), param="messages") from None

    def check_text_size(self, conv: Conversation) -> None:
        """A context error, before any tokenizing, when the text alone needs more tokens than the window (each
        message also takes at least two special tokens: its start and its end)."""
        at_least = -(-text_bytes(conv) // self.max_token_bytes) + 2 * len(conv.messages)
        if at_least > self.context_window:
            raise context_error(at_least, None, self.context_window, exact=False)

    def restore_thinking(self, conv: Conversation, tenant: str, pixels: dict[int, Any],
                         digests: dict[int, str] | None = None) -> tuple[Conversation, int]:
        """The conversation with the thinking of this server's own turns put back where the client dropped it
        (only where the whole conversation before the turn, and the turn, match what it was generated from)."""
        messages, count = list(conv.messages), 0
        for i, m in enumerate(messages):
            if not needs_thinking(m) or not self.turns.may_hold(tenant, m):
                continue
            before = dataclasses.replace(conv, messages=messages[:i])
            try:
                ids, images = self.render(before, add_generation_prompt=False, pixels=pixels)
            except ServiceError:
                break  # an unreadable history: the history check reports it
            stored = self.turns.find(tenant, TurnStore.prefix_hash(ids, self._digests(images, digests)), m)
            if stored is not None:
                messages[i] = restored(m, stored)
                count += 1
        self.turns.restored += count
        return dataclasses.replace(conv, messages=messages), count

    @staticmethod
    def _digests(images: list[Any], memo: dict[int, str] | None) -> list[str]:
        memo = {} if memo is None else memo
        for x in images:
            if id(x) not in memo:
                memo[id(x)] = image_digest(x)
        return [memo[id(x)] for x in images]

    # --- the request -----------------------------------------------------------------------------------
    def prepare(self, req: ChatRequest) -> Prepared:
        """Restore, validate, render, size and constrain a request (module docstring); ServiceError if refused."""
        conv = req.conversation
        self.check_text_size(conv)
        pixels = self.decode_images(conv)
        digests: dict[int, str] = {}  # each image's pixels are hashed once, however many prefixes hold it
        conv, restored_turns = self.restore_thinking(conv, req.tenant, pixels, digests)
        warnings = self.check_history(conv)
        if conv.tier is not None:  # tool-call turns still without thinking: left to the history policy
            self.turns.unknown += sum(needs_thinking(m) and bool(m.get("tool_calls")) for m in conv.messages)
        rendered, images = self.render_full(conv, pixels=pixels)
        ids = rendered.ids
        max_tokens = self.size(len(ids), req.max_tokens, conv.tier, req.params.thinking_budget)
        try:
            constraint, banned, policy_warnings = constraint_for(conv.tools, req.policy, self.engine.grammars,
                                                                 self.tokenizer.special.tool_call)
        except PolicyError as e:
            raise ServiceError("invalid_request", str(e), param=e.param) from None
        budget = req.params.thinking_budget
        if conv.tier is not None:
            budget = int(self.budgets[conv.tier]) if budget is None else budget
            if constraint is not None and not constraint.free_text:  # leave room for the JSON or call that is owed
                budget = max(1, min(budget, max_tokens - answer_reserve(max_tokens)))
        params = dataclasses.replace(req.params, max_tokens=max_tokens, tier=conv.tier, thinking_budget=budget,
                                     banned_token_ids=sorted({*req.params.banned_token_ids, *banned}))
        turns = rendered.block_ends[-self.prefix_snapshot_turns:] if self.prefix_snapshot_turns else []
        request = Request(ids, params, tools=conv.rendered_tools, constraint=constraint, images=images or None,
                          snapshot_at=(rendered.preamble_end, *turns))
        if req.request_id:
            request.request_id = req.request_id
        gen_prompt = len(self.template.generation_prompt(conv.tier))
        prefix = TurnStore.prefix_hash(ids[:-gen_prompt], self._digests(images, digests))
        return Prepared(request, conv, prefix, req.tenant, req.record and conv.tier is not None,
                        warnings + policy_warnings, restored_turns)

    def size(self, prompt_tokens: int, max_tokens: int | None, tier: str | None, thinking_budget: int | None) -> int:
        """max_tokens for the engine: the client's if it fits beside the prompt, else a context-length error;
        unset, the default answer room plus the thinking budget, capped by what the window leaves."""
        window = self.context_window
        if max_tokens is None:
            room = window - prompt_tokens
            if room < 1:
                raise context_error(prompt_tokens, None, window)
            thinking = (thinking_budget or int(self.budgets[tier])) if tier else 0
            return min(room, DEFAULT_ANSWER_TOKENS + thinking)
        if prompt_tokens + max_tokens > window:
            raise context_error(prompt_tokens, max_tokens, window)
        return max_tokens

    def count_tokens(self, req: ChatRequest) -> tuple[int, list[str]]:
        """(prompt tokens, history warnings): the prompt `prepare` would render, without generating."""
        self.check_text_size(req.conversation)
        pixels = self.decode_images(req.conversation)
        conv, _ = self.restore_thinking(req.conversation, req.tenant, pixels)
        warnings = self.check_history(conv)
        return len(self.render(conv, pixels=pixels)[0]), warnings

    def start(self, prepared: Prepared, seed_offset: int = 0, request_id: str | None = None) -> TurnStream:
        """Submit to the engine now and return the event stream (an async iterator with `cancel()`).

        Refusals (queue full, parameters the engine rejects) raise ServiceError here, before any response
        byte is sent. Whoever consumes the stream must call `cancel()` when the client goes away (a
        `finally:` around the iteration). `seed_offset` i gives choice i of n the seed seed + i.
        """
        request = self._request(prepared, seed_offset, request_id)
        with self._admitting():
            return TurnStream(self, prepared, self.engine.open_stream(request, max_queued=self.max_queue))

    def submit(self, prepared: Prepared, on_event: Callable, request_id: str | None = None) -> str:
        """`start` for a caller on a plain thread: `on_event` gets the engine events on the engine's thread (the
        turn is not recorded). Returns the engine request id (for `engine.cancel`)."""
        request = self._request(prepared, request_id=request_id)
        with self._admitting():
            self.engine.submit(request, on_event, max_queued=self.max_queue)
        return request.request_id

    @contextlib.contextmanager
    def _admitting(self):
        """The engine's refusals as ServiceErrors."""
        try:
            yield
        except QueueFull as e:
            raise ServiceError("overloaded", f"the server is busy: {e.queued} requests are waiting "
                                             f"(limit {e.limit}); retry shortly") from None
        except EngineClosed as e:
            raise ServiceError("unavailable", f"{e}: it takes no new requests; retry on another server or "
                                              "once it is back") from None
        except ValueError as e:  # bad sampling values, too long
            raise ServiceError("invalid_request", str(e)) from None

    def drain(self, timeout_s: float, message: str = "the server is shutting down") -> threading.Thread:
        """Stop taking requests now; let running ones finish for up to `timeout_s`, then end what is left
        with an "unavailable" error (each API turns it into a proper ending of its stream). Returns the
        thread that waits; it ends when the engine is idle."""
        self.engine.close(message)

        def wait() -> None:
            deadline = time.monotonic() + timeout_s
            while self.engine.sequences and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.engine.sequences:
                self.engine.abort_all(message)
            while self.engine.sequences:  # the engine thread ends them within a step
                time.sleep(0.01)

        thread = threading.Thread(target=wait, name="horizon-drain", daemon=True)
        thread.start()
        return thread

    def run(self, prepared: list[Prepared]) -> list[Result]:
        """Run prepared requests to completion on the calling thread, as one engine batch (in-process callers:
        eval, RL rollouts). The engine's own thread must not be running."""
        try:
            return self.engine.generate([self._request(p) for p in prepared])
        except ValueError as e:
            raise ServiceError("invalid_request", str(e)) from None

    def _request(self, prepared: Prepared, seed_offset: int = 0, request_id: str | None = None) -> Request:
        request = prepared.request
        seed = request.params.seed
        params = dataclasses.replace(request.params, seed=seed + seed_offset if seed is not None else None)
        rid = request_id or (f"{request.request_id}-{seed_offset}" if seed_offset else request.request_id)
        return dataclasses.replace(request, params=params, request_id=rid)

    def record(self, prepared: Prepared, deltas: list, token_ids: list[int], reason: str) -> None:
        """Keep a finished thinking turn, so a client that drops its thinking gets it restored."""
        if not prepared.record or reason not in ("stop", "length"):
            return
        message, _ = returned_message(deltas, prepared.conversation.tier)
        self.turns.record(prepared.tenant, prepared.prefix, message, token_ids)


def failure(finish: FinishEvent) -> ServiceError:
    """The error a request that ended without an answer (reason "error") gets before its status line is sent."""
    kind = {"invalid_request": "invalid_request", "unavailable": "unavailable"}.get(finish.error_kind, "internal")
    return ServiceError(kind, f"generation failed: {finish.error or finish.reason}")


def text_bytes(conv: Conversation) -> int:
    """UTF-8 bytes of the text the prompt encodes (contents, reasoning, call names and arguments, tool
    definitions): every one of them is in the rendered prompt, so this never overstates it."""
    n = 0

    def add(x: Any) -> None:
        nonlocal n
        if isinstance(x, str):
            n += len(x.encode("utf-8", "surrogatepass"))

    for m in conv.messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        add(content)
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    add(part.get("text"))
        add(m.get("reasoning_content"))
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                add(fn.get("name"))
                add(fn.get("arguments"))
    for t in conv.tools:
        add(t.description)
    return n


def context_error(prompt: int, max_tokens: int | None, window: int, exact: bool = True) -> ServiceError:
    """OpenAI's and Anthropic's wording, which clients match (litellm's ContextWindowExceededError, ...).
    Not `exact`: `prompt` is a lower bound (the text's size, before tokenizing)."""
    if max_tokens is None:
        count = f"{prompt}" if exact else f"at least {prompt}"
        message = (f"This model's maximum context length is {window} tokens. However, your messages resulted in "
                   f"{count} tokens. Please reduce the length of the messages.")
        anthropic = f"prompt is too long: {count} tokens > {window} maximum"
    else:
        message = (f"This model's maximum context length is {window} tokens. However, you requested "
                   f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion). "
                   "Please reduce the length of the messages or completion.")
        anthropic = (f"prompt is too long: {prompt} tokens > {window} maximum" if prompt >= window else
                     f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {window}, "
                     "decrease input length or `max_tokens` and try again")
    return ServiceError("invalid_request", message, param="messages" if max_tokens is None else "max_tokens",
                        code="context_length_exceeded", anthropic_message=anthropic)
