"""The agent's in-process client: the same interface as HTTPClient, over the serving seam without HTTP.

Evaluation and RL rollouts run thousands of episodes; going through HTTP would cost a server, JSON
and SSE per step for nothing. `EngineClient` turns a step into the seam's `ChatRequest` and runs it
through the same `ModelService` the HTTP adapters use (history check, rendering, context window,
tool policy and grammars, thinking budget), so a step samples exactly as `/v1/chat/completions`
would for the same body and seed; it returns the assistant message in the OpenAI shape
(`OpenAIWire`), what the server would have returned. `complete_many` runs several episodes' steps as
one engine batch.
"""

from __future__ import annotations

import time
from typing import Any

from horizon.agent.client import OnEvent, OpenAIWire, StepRequest, ToolCall, Turn, Usage, emit_turn
from horizon.engine import SamplingParams
from horizon.serving import ChatRequest, Conversation, ModelService, Tool, ToolPolicy, finish_reason, returned_message


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
        out = []
        for req, p, res in zip(reqs, prepared, results, strict=True):
            message, parsed = returned_message((d for ev in res.events for d in ev.deltas), p.conversation.tier)
            calls = [ToolCall(c.id, c.name, c.arguments) for c in parsed.tool_calls]
            u = res.finish.usage
            turn = Turn(message, calls, parsed.content, parsed.reasoning, finish_reason(res.finish.reason, len(calls)),
                        Usage(u.prompt_tokens, u.completion_tokens, u.reasoning_tokens, u.cached_tokens),
                        # the engine's raw answer: the exact tokens in and out (RL trains on these)
                        response={"finish": res.finish.reason, "error": res.finish.error,
                                  "prompt_ids": list(p.prompt_ids), "token_ids": list(res.token_ids),
                                  # positions the engine forced (the end of thinking at the budget): not
                                  # the model's choice, so RL does not train on them
                                  "forced": list(res.forced)},
                        elapsed_s=elapsed)
            out.append((self.wire.body(req, stream=False), turn))  # what an HTTP client would have sent
        return out

    def complete(self, req: StepRequest, on_event: OnEvent | None = None) -> tuple[dict[str, Any], Turn]:
        body, turn = self.complete_many([req])[0]
        emit_turn(turn, on_event)
        return body, turn

    def close(self) -> None:
        pass
