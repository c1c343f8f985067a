"""The serving seam: one request path from a neutral chat request to engine events.

The HTTP adapters (`horizon.server`: OpenAI, Anthropic) and the in-process agent client
(`horizon.agent.local.EngineClient`: eval, RL rollouts) translate their requests into a `ChatRequest`
and go through `ModelService`, so every caller is validated, rendered, sized, constrained and sampled
the same way. This package knows no HTTP (no FastAPI, nothing of `horizon.server`).

Files: `service` (ModelService, the request path and its errors), `policy` (tool choice, strict
schemas and response formats -> grammar and banned tokens), `turns` (what a generated turn returns,
and the TurnStore that restores thinking for clients that drop it), `responses_store` (the Responses
API's SQLite store, per tenant) and `sealed` (AES-GCM sealing of reasoning for stateless clients).
"""

from horizon.serving.policy import Tool, ToolPolicy, answer_reserve
from horizon.serving.service import (
    ANONYMOUS,
    ERROR_KINDS,
    RETRY_AFTER_S,
    ChatRequest,
    Conversation,
    ModelService,
    Prepared,
    ServiceError,
    TurnStream,
    failure,
)
from horizon.serving.turns import TurnStore, finish_reason, returned_message

__all__ = ["ANONYMOUS", "ERROR_KINDS", "RETRY_AFTER_S", "ChatRequest", "Conversation", "ModelService", "Prepared",
           "ServiceError", "Tool", "ToolPolicy", "TurnStore", "TurnStream", "answer_reserve", "failure",
           "finish_reason", "returned_message"]
