"""The agent's in-process client: the same interface as HTTPClient, over the serving seam without HTTP.

Evaluation and RL rollouts run thousands of episodes; going through HTTP would cost a server, JSON
and SSE per step for nothing. `EngineClient` turns a step into the seam's `ChatRequest` and runs it
through the same `ModelService` the HTTP adapters use (history check, rendering, context window,
tool policy and grammars, thinking budget), so a step samples exactly as `/v1/chat/completions`
would for the same body and seed; it returns the assistant message in the OpenAI shape
(`OpenAIWire`), what the server would have returned. `complete_many` runs several episodes' steps as
one engine batch. `ServingClient` is the same over an engine whose thread is running (a live server: the
web playground), streaming each step's pieces as they are generated.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from horizon.agent.client import ClientError, OnEvent, OpenAIWire, StepRequest, ToolCall, Turn, Usage, emit_turn
from horizon.chat import ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from horizon.engine import FinishEvent, Result, SamplingParams
from horizon.serving import (
    ERROR_KINDS,
    ChatRequest,
    Conversation,
    ModelService,
    Prepared,
    ServiceError,
    Tool,
    ToolPolicy,
    failure,
    finish_reason,
    returned_message,
)


class EngineClient:
    stream_mode = None
    base_url = None

    def __init__(self, engine, tokenizer, model_id: str = "local", history_policy: str = "reject"):
        self.service = ModelService(engine, tokenizer, model_id, history_policy=history_policy, turn_store_bytes=0)
        self.wire = OpenAIWire(model_id)

    @property
    def engine(self):
        return self.service.engine

    def chat_request(self, req: StepRequest) -> ChatRequest:
        """The step as the seam's request: what `/v1/chat/completions` makes of `OpenAIWire.body(req)`."""
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + req.messages
        tools = [Tool(t.name, t.parameters, t.description, bool(t.strict)) for t in req.tools]
        params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature, seed=req.seed)
        policy = ToolPolicy(req.tool_choice or "auto", response_schema=req.response_schema)
        return ChatRequest(Conversation(messages, tools, req.tier), policy, params, req.max_tokens, record=False)

    def complete_many(self, reqs: list[StepRequest]) -> list[tuple[dict[str, Any], Turn]]:
        """Every request in one engine run (continuous batching): (body, turn) each, in order."""
        prepared = [self.service.prepare(self.chat_request(r)) for r in reqs]
        t0 = time.perf_counter()
        results = self.service.run(prepared)
        elapsed = time.perf_counter() - t0
        return [(self.wire.body(req, stream=False), turn_of(p, res, elapsed))  # what an HTTP client would send
                for req, p, res in zip(reqs, prepared, results, strict=True)]

    def complete(self, req: StepRequest, on_event: OnEvent | None = None) -> tuple[dict[str, Any], Turn]:
        body, turn = self.complete_many([req])[0]
        emit_turn(turn, on_event)
        return body, turn

    def close(self) -> None:
        pass


def turn_of(prepared: Prepared, res: Result, elapsed: float, ttft: float | None = None) -> Turn:
    """The assistant turn in the OpenAI shape from one engine run's events."""
    message, parsed = returned_message((d for ev in res.events for d in ev.deltas), prepared.conversation.tier)
    calls = [ToolCall(c.id, c.name, c.arguments) for c in parsed.tool_calls]
    u = res.finish.usage
    return Turn(message, calls, parsed.content, parsed.reasoning, finish_reason(res.finish.reason, len(calls)),
                Usage(u.prompt_tokens, u.completion_tokens, u.reasoning_tokens, u.cached_tokens),
                # the engine's raw answer: the exact tokens in and out (RL trains on these)
                response={"finish": res.finish.reason, "error": res.finish.error,
                          "prompt_ids": list(prepared.prompt_ids), "token_ids": list(res.token_ids),
                          # positions the engine forced (the end of thinking at the budget): not
                          # the model's choice, so RL does not train on them
                          "forced": list(res.forced)},
                ttft_s=ttft, elapsed_s=elapsed)


class ServingClient(EngineClient):
    """EngineClient for a server whose engine thread is running (the web playground): each step is submitted
    to the live engine and its pieces stream to `on_event` as they are generated (thinking, text, calls).
    `cancel()` (from any thread) stops the step in flight; the step then fails with a ClientError."""

    stream_mode = "live"

    def __init__(self, service: ModelService):
        self.service, self.wire = service, OpenAIWire(service.model_id)
        self._cancelled = threading.Event()
        self._running: str | None = None

    def cancel(self) -> None:
        self._cancelled.set()
        if self._running is not None:
            self.service.engine.cancel(self._running)

    def complete(self, req: StepRequest, on_event: OnEvent | None = None) -> tuple[dict[str, Any], Turn]:
        if self._cancelled.is_set():
            raise ClientError("the run was cancelled")
        try:
            prepared = self.service.prepare(self.chat_request(req))
            events: queue.SimpleQueue = queue.SimpleQueue()
            t0 = time.perf_counter()
            self._running = self.service.submit(prepared, events.put)
        except ServiceError as e:
            raise ClientError(e.message, status=ERROR_KINDS[e.kind][0]) from None
        if self._cancelled.is_set():  # cancelled between the check above and the submission
            self.service.engine.cancel(self._running)
        res, ttft, pieces = Result(self._running), None, _Pieces(on_event)
        while res.finish is None:
            event = events.get()
            res.events.append(event)
            if isinstance(event, FinishEvent):
                res.finish = event
            else:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                res.token_ids.append(event.token_id)
                if event.forced:
                    res.forced.append(len(res.token_ids) - 1)
            pieces(event.deltas)
        self._running = None
        if res.finish.reason not in ("stop", "length"):
            raise ClientError(failure(res.finish).message if res.finish.reason != "cancelled"
                              else "the run was cancelled")
        return self.wire.body(req, stream=True), turn_of(prepared, res, time.perf_counter() - t0, ttft)


class _Pieces:
    """Parser deltas -> the agent's streaming events (`thinking`, `text`, `tool_call`, `tool_args`), as
    HTTPClient emits them from SSE chunks."""

    def __init__(self, on_event: OnEvent | None):
        self.on_event = on_event or (lambda kind, data: None)

    def __call__(self, deltas) -> None:
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                self.on_event("thinking", {"text": d.text})
            elif isinstance(d, TextDelta):
                self.on_event("text", {"text": d.text})
            elif isinstance(d, ToolCallStart):
                self.on_event("tool_call", {"id": d.id, "name": d.name})
            elif isinstance(d, ToolCallArgs):
                self.on_event("tool_args", {"text": d.text})
