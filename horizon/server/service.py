"""ModelService: the one seam between the HTTP adapters and the model.

Both API adapters (OpenAI, Anthropic) translate a request into the same three things: a
`Conversation` (OpenAI-style messages, tools, thinking tier), `SamplingParams`, and an optional
`ConstraintSpec`; they get back the engine's event stream. Everything in between — history
validation under the server's policy, rendering with the chat template, the context-window and
queue checks, submitting to the engine — happens here, once.

    prepared = service.prepare(Conversation(messages, tools, tier), params)   # may raise ServiceError
    events = service.start(prepared, params, constraint)                      # may raise ServiceError
    try:
        async for event in events: ...
    finally:
        events.cancel()                                                       # client gone: free the cache
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from horizon.chat import ChatTemplate, HistoryIssue, validate_history
from horizon.chat.images import ImageError, ImageLimits, decode_conversation, image_parts, render_with_images
from horizon.engine import ConstraintSpec, Engine, Request, SamplingParams
from horizon.engine.engine import EventStream
from horizon.model.vision import num_image_tokens


class ServiceError(Exception):
    """A request the service refuses. `kind` picks the status and error type in each API's shape."""

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param


# kind -> (HTTP status, OpenAI error type, Anthropic error type)
ERROR_KINDS = {
    "invalid_request": (400, "invalid_request_error", "invalid_request_error"),
    "authentication": (401, "authentication_error", "authentication_error"),
    "not_found": (404, "not_found_error", "not_found_error"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    "overloaded": (429, "rate_limit_error", "overloaded_error"),  # Anthropic answers 529
    "internal": (500, "server_error", "api_error"),
}


@dataclass
class Conversation:
    messages: list[dict[str, Any]]  # horizon.chat's message format (OpenAI style, reasoning_content)
    tools: list[dict[str, Any]] | None = None  # OpenAI style: [{"type": "function", "function": {...}}]
    tier: str | None = None  # thinking tier; None: off


@dataclass
class Prepared:
    prompt_ids: list[int]
    conversation: Conversation
    warnings: list[HistoryIssue] = field(default_factory=list)  # served anyway (policy "warn" and warnings)
    images: list[Any] = field(default_factory=list)  # RGB uint8 [H, W, 3] per image, in prompt order


class ModelService:
    def __init__(self, engine: Engine, tokenizer, model_id: str, history_policy: str = "reject",
                 max_queue: int = 64, image_limits: ImageLimits | None = None):
        if history_policy not in ("reject", "strict", "warn"):
            raise ValueError(f"history_policy={history_policy!r}; allowed: reject, strict, warn")
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.template = ChatTemplate(tokenizer)
        self.history_policy, self.max_queue = history_policy, max_queue
        self.image_limits = image_limits or ImageLimits()

    @property
    def context_window(self) -> int:
        return self.engine.max_model_len

    def check_history(self, conv: Conversation) -> list[HistoryIssue]:
        """Errors raise ServiceError naming the message; warnings are returned."""
        try:
            issues = validate_history(conv.messages, tier=conv.tier, policy=self.history_policy, tools=conv.tools)
        except ValueError as e:  # malformed tool definitions (duplicate names, bad schemas)
            raise ServiceError("invalid_request", str(e), param="tools") from None
        errors = [i for i in issues if i.severity == "error"]
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ServiceError("invalid_request", f"messages[{first.index}]: {first.message} [{first.code}]{more}",
                               param=f"messages[{first.index}]")
        return issues

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
        cfg = self.engine.model.config
        try:
            out, images = render_with_images(self.tokenizer, conv.messages, pixels or {},
                                             lambda h, w: num_image_tokens(cfg, h, w), tools=conv.tools,
                                             tier=conv.tier, add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise ServiceError("invalid_request", str(e), param="messages") from None
        return out.ids, images

    def prepare(self, conv: Conversation, params: SamplingParams) -> Prepared:
        """Validate the history, render the prompt, check it fits the context window with max_tokens."""
        warnings = self.check_history(conv)
        ids, images = self.render(conv, pixels=self.decode_images(conv))
        total = len(ids) + params.max_tokens
        if total > self.context_window:
            raise ServiceError("invalid_request",
                               f"the prompt is {len(ids)} tokens and max_tokens is {params.max_tokens}: {total} "
                               f"exceeds the context window of {self.context_window} tokens",
                               param="max_tokens")
        return Prepared(ids, conv, warnings, images)

    def count_tokens(self, conv: Conversation) -> int:
        return len(self.render(conv, pixels=self.decode_images(conv))[0])

    def start(self, prepared: Prepared, params: SamplingParams, constraint: ConstraintSpec | None = None,
              request_id: str | None = None) -> EventStream:
        """Submit to the engine now and return the event stream (an async iterator with `cancel()`).

        Refusals (queue full, parameters the engine rejects, a schema that does not compile) raise
        ServiceError here, before any response byte is sent. Whoever consumes the stream must call
        `cancel()` when the client goes away (a `finally:` around the iteration).
        """
        queued = self.engine.metrics()["queue_length"]
        if queued >= self.max_queue:
            raise ServiceError("overloaded", f"the server is busy: {queued} requests are waiting "
                                             f"(limit {self.max_queue}); retry shortly")
        request = Request(prepared.prompt_ids, params, tools=prepared.conversation.tools, constraint=constraint,
                          images=prepared.images or None)
        if request_id:
            request.request_id = request_id
        try:
            return self.engine.open_stream(request)
        except ValueError as e:  # bad sampling values, a schema that does not compile, too long
            raise ServiceError("invalid_request", str(e)) from None
