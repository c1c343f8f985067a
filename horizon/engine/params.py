"""What a caller asks the engine for: sampling parameters, requests, and what comes back (events, usage)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from horizon.chat.parser import Delta
from horizon.chat.thinking import TIERS
from horizon.engine.constraints import ConstraintSpec

_ids = itertools.count()


@dataclass
class SamplingParams:
    max_tokens: int = 256  # new tokens, thinking included
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # reproducible sampling per request
    stop: list[str] = field(default_factory=list)  # stop strings (on the answer text)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the template's end-of-turn tokens
    ignore_eos: bool = False  # do not stop at end-of-turn (benchmarks)
    logprobs: int | None = None  # None: off; n >= 0: the chosen token's logprob and the n most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # -100 bans the token
    banned_token_ids: list[int] = field(default_factory=list)  # never sampled, whatever the bias (tool policy)
    tier: str | None = None  # thinking tier: the prompt ends inside thinking; None: thinking off
    thinking_budget: int | None = None  # hard cap on thinking tokens, the closing one included; None: the tier's

    def validate(self, vocab_size: int) -> None:
        def fail(name: str, allowed: str) -> None:
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", "must be an integer >= 1")
        if not 0 <= self.temperature <= 100:
            fail("temperature", "must be in [0, 100]")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 turns it off)")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail("logprobs", "must be null or an integer in [0, 20]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(name, "must be in [-2, 2]")
        if any(not 0 <= t < vocab_size for t in [*self.stop_token_ids, *self.logit_bias, *self.banned_token_ids]):
            raise ValueError(f"stop_token_ids, banned_token_ids and logit_bias keys must be token ids in "
                             f"[0, {vocab_size})")
        if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            fail("logit_bias", "values must be in [-100, 100]")
        if any(not isinstance(s, str) or not s for s in self.stop) or len(self.stop) > 16:
            fail("stop", "must be at most 16 non-empty strings")
        if self.tier is not None and self.tier not in TIERS:
            fail("tier", f"allowed: {', '.join(TIERS)} or null (thinking off)")
        if self.thinking_budget is not None and (not isinstance(self.thinking_budget, int) or self.thinking_budget < 1):
            fail("thinking_budget", "must be null or an integer >= 1 (it counts the end-of-thinking token)")


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    tools: list[dict[str, Any]] | None = None  # offered tools: the parser reports calls to others
    constraint: ConstraintSpec | None = None  # what the answer must be (JSON schema, forced tool call, ...)
    # RGB uint8 [H, W, 3] images, one per run of image placeholders in prompt_ids, in order
    images: list[Any] | None = None
    # prompt positions (token counts) where the prefix cache should keep a snapshot when prefill passes them:
    # message boundaries the serving layer knows (the end of the system prompt, the last turn ends), so
    # branches of one history resume from the deepest shared one. Prefill chunks end there.
    snapshot_at: tuple[int, ...] = ()


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # thinking tokens (part of completion_tokens)
    cached_tokens: int = 0  # prompt tokens resumed from cache instead of computed
    image_tokens: int = 0  # prompt tokens that are image placeholders (part of prompt_tokens)


@dataclass
class TokenEvent:
    request_id: str
    token_id: int
    deltas: list[Delta]  # what the streaming parser made of it (reasoning, text, tool-call pieces)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    forced: bool = False  # the engine forced this token (end of thinking at the budget)


@dataclass
class FinishEvent:
    request_id: str
    reason: str  # stop | length | cancelled | error
    usage: Usage
    error: str | None = None
    # with reason "error", whose failure it was: "invalid_request" (the request's own settings left nothing
    # to sample), "unavailable" (the server stopped it: shutting down), None: computing it failed
    error_kind: str | None = None
    deltas: list[Delta] = field(default_factory=list)  # what the parser flushed at the end


Event = TokenEvent | FinishEvent
