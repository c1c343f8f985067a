"""The agent's in-process client: the same interface as HTTPClient, straight over an Engine.

Evaluation and RL rollouts run thousands of episodes; going through HTTP would cost a server, JSON
and SSE per step for nothing. `EngineClient` renders the conversation with the chat template, runs
it on the engine (forced tool choice through the same grammars the server uses), and returns the
assistant message in the OpenAI shape (`OpenAIWire`), exactly what the server would have returned.
`complete_many` runs several episodes' steps as one engine batch.
"""

from __future__ import annotations

import time
from typing import Any

from horizon.agent.client import OnEvent, OpenAIWire, StepRequest, ToolCall, Turn, Usage, emit_turn
from horizon.chat.images import decode_conversation, render_with_images
from horizon.chat.parser import ParsedTurn, TextDelta, ToolCallArgs, ToolCallStart
from horizon.engine import ConstraintSpec, Request, SamplingParams
from horizon.model.vision import num_image_tokens


class EngineClient:
    stream_mode = None
    base_url = None

    def __init__(self, engine, tokenizer, model_id: str = "local"):
        self.engine, self.tokenizer = engine, tokenizer
        self.wire = OpenAIWire(model_id)

    def _request(self, req: StepRequest) -> tuple[dict[str, Any], Request]:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + req.messages
        tools = [{"type": "function", "function": t.spec()} for t in req.tools] or None
        cfg = self.engine.model.config
        out, images = render_with_images(self.tokenizer, messages, decode_conversation(messages),
                                         lambda h, w: num_image_tokens(cfg, h, w), tools=tools, tier=req.tier,
                                         add_generation_prompt=True)
        ids = out.ids
        choice = req.tool_choice or "auto"
        constraint, bias = None, {}
        schemas = [(t.name, t.parameters if t.strict else None) for t in req.tools]
        if tools and choice == "required":
            constraint = ConstraintSpec.for_tools(schemas, required=True)
        elif tools and choice not in ("auto", "none"):
            constraint = ConstraintSpec.for_tools([s for s in schemas if s[0] == choice], required=True, parallel=False)
        elif choice == "none" or not tools:  # as the server: the tool-call token is banned
            bias = {self.tokenizer.special.tool_call: -100.0}
        elif any(t.strict for t in req.tools):
            constraint = ConstraintSpec.for_tools(schemas)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None
                                else req.temperature, seed=req.seed, tier=req.tier, logit_bias=bias)
        body = self.wire.body(req, stream=False)  # what an HTTP client would have sent (transcripts)
        return body, Request(ids, params, tools=tools, constraint=constraint, images=images or None)

    def complete_many(self, reqs: list[StepRequest]) -> list[tuple[dict[str, Any], Turn]]:
        """Every request in one engine run (continuous batching): (body, turn) each, in order."""
        built = [self._request(r) for r in reqs]
        t0 = time.perf_counter()
        results = self.engine.generate([request for _, request in built])
        elapsed = time.perf_counter() - t0
        out = []
        for req, (body, request), res in zip(reqs, built, results, strict=True):
            parsed = ParsedTurn.from_deltas(_nameless_calls_as_text(d for ev in res.events for d in ev.deltas),
                                            req.tier)
            message = parsed.to_message()
            calls = [ToolCall(c.id, c.name, c.arguments) for c in parsed.tool_calls]
            u = res.finish.usage
            finish = "length" if res.finish.reason == "length" else ("tool_calls" if calls else "stop")
            if res.finish.reason == "error":
                finish = "error"
            turn = Turn(message, calls, parsed.content, parsed.reasoning, finish,
                        Usage(u.prompt_tokens, u.completion_tokens, u.reasoning_tokens, u.cached_tokens),
                        # the engine's raw answer: the exact tokens in and out (RL trains on these)
                        response={"finish": res.finish.reason, "error": res.finish.error,
                                  "prompt_ids": list(request.prompt_ids), "token_ids": list(res.token_ids),
                                  # positions the engine forced (the end of thinking at the budget): not
                                  # the model's choice, so RL does not train on them
                                  "forced": list(res.forced)},
                        elapsed_s=elapsed)
            out.append((body, turn))
        return out

    def complete(self, req: StepRequest, on_event: OnEvent | None = None) -> tuple[dict[str, Any], Turn]:
        body, turn = self.complete_many([req])[0]
        emit_turn(turn, on_event)
        return body, turn

    def close(self) -> None:
        pass


def _nameless_calls_as_text(deltas) -> list:
    """A call whose name could not be read goes to the text, as the server returns it: no client could run
    it, and the history must still say what the model wrote."""
    dropped, out = set(), []
    for d in deltas:
        if isinstance(d, ToolCallStart) and not d.name:
            dropped.add(d.index)
        elif isinstance(d, ToolCallArgs) and d.index in dropped:
            out.append(TextDelta(d.text))
        else:
            out.append(d)
    return out
