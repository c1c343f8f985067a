"""Sequence: one request's state inside the engine (its tokens, cache slot and blocks, thinking budget, output)."""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Callable

import torch

from horizon.chat.parser import StreamParser, TextDelta
from horizon.engine.constraints import JsonScan
from horizon.engine.params import Event, FinishEvent, Request, TokenEvent, Usage
from horizon.engine.sampler import StopMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, tokenizer, thinking_budget: int | None, stop_ids: set[int],
                 emit: Callable[[Event], None], matcher=None, image_layout: list[tuple[int, int, str]] | None = None):
        self.request, self.params = request, request.params
        self.id = request.request_id
        self.tokens = list(request.prompt_ids)  # prompt, then generated tokens
        self.prompt_len = len(self.tokens)
        self.num_cached = 0  # tokens whose state is in the cache (processed by the model)
        self.slot: int | None = None
        self.blocks: list[int] = []
        self.status = Status.WAITING
        self.cached_prompt_tokens = 0
        self.emit = emit
        # a generator of its own for every request, an unseeded one seeded from the OS: never torch's global one,
        # which anything else in the process may draw from or rewind (dynamo restores it when a trace ends, and
        # the runner's background compile traces while steps sample: draws would repeat across requests)
        self.generator = torch.Generator().manual_seed(
            self.params.seed if self.params.seed is not None else secrets.randbits(63))
        self.stop_ids = set() if self.params.ignore_eos else set(stop_ids)
        self.stop_ids |= set(self.params.stop_token_ids)
        # thinking: the prompt of a thinking request ends inside the think block
        self.think_end = tokenizer.special.think_end
        self.thinking = self.params.tier is not None
        self.thinking_budget = thinking_budget
        self.thinking_tokens = 0
        self.parser = StreamParser(tokenizer, tier=self.params.tier, tools=request.tools)
        self.stopper = StopMatcher(self.params.stop)
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.matcher = matcher  # llguidance matcher of the request's constraint (applies after thinking)
        self.json_scan = JsonScan()  # are we inside a JSON string (constrained output only)
        self.images = ImageRuns(request.images or [], image_layout or [])
        # where prefill leaves a prefix-cache snapshot (inside the prompt; the prompt's end has its own)
        self.snapshot_at = sorted({p for p in request.snapshot_at if 0 < p < self.prompt_len})

    # --- progress ------------------------------------------------------------------------------------
    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def tokens_to_compute(self) -> int:
        """Tokens not yet in the cache: the prompt (or what remains of it), then each sampled token once.

        After a preemption the cache is gone and everything is computed again; the step that
        brings num_cached up to len(tokens) yields the logits for the next token.
        """
        return len(self.tokens) - self.num_cached

    def chunk(self, budget: int) -> int:
        """Tokens to compute in the next forward, at most `budget`: a prefill chunk ends at the next snapshot
        point, since KDA state can only be saved where a forward stops."""
        n = min(self.tokens_to_compute(), budget)
        nxt = next((p for p in self.snapshot_at if p > self.num_cached), None)
        return min(n, nxt - self.num_cached) if nxt is not None else n

    def forced_token(self) -> int | None:
        """The end of thinking when only its own place is left in the thinking budget (the budget counts the
        end-of-thinking token, as `reasoning_tokens` does): the answer must follow."""
        if self.thinking and self.thinking_budget is not None and self.thinking_tokens + 1 >= self.thinking_budget:
            return self.think_end
        return None

    # --- output ---------------------------------------------------------------------------------------
    def append(self, token: int, logprob=None, top=None, forced: bool = False) -> str | None:
        """Record a generated token and emit its event; returns a finish reason or None."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.tokens.append(token)
        if self.thinking:
            if token == self.think_end:
                self.thinking = False
            else:
                self.thinking_tokens += 1
        deltas, stopped = self._filter(self.parser.feed(token))
        self.emit(TokenEvent(self.id, token, deltas, logprob, top, forced))
        if stopped:
            return "stop"
        if token in self.stop_ids:
            return "stop"
        if self.num_generated >= self.params.max_tokens:
            return "length"
        return None

    def _filter(self, deltas):
        """Apply stop strings to the answer text; everything after a stop string is dropped."""
        if not self.params.stop:
            return deltas, False
        out = []
        for d in deltas:
            if isinstance(d, TextDelta):
                text, stopped = self.stopper.feed(d.text)
                if text:
                    out.append(TextDelta(text))
                if stopped:
                    return out, True
            else:
                out.append(d)
        return out, False

    def finish(self, reason: str, error: str | None = None, error_kind: str | None = None) -> None:
        if self.status is Status.FINISHED:
            return
        self.status = Status.FINISHED
        deltas = list(self.parser.finish())
        if reason != "stop" or not self.params.stop:
            tail = self.stopper.flush()
            if tail:
                deltas.insert(0, TextDelta(tail))
        self.emit(FinishEvent(self.id, reason, self.usage(), error, deltas=deltas, error_kind=error_kind))

    def usage(self) -> Usage:
        reasoning = self.thinking_tokens + (1 if self.params.tier is not None and not self.thinking else 0)
        return Usage(prompt_tokens=self.prompt_len, completion_tokens=self.num_generated,
                     reasoning_tokens=min(reasoning, self.num_generated), cached_tokens=self.cached_prompt_tokens,
                     image_tokens=self.images.num_tokens)

    def key(self, n: int | None = None) -> list:
        """The first n tokens as the prefix cache compares them: an image placeholder stands for its
        image's pixels (a digest and the position in the image), so two images never share a prefix."""
        tokens = self.tokens if n is None else self.tokens[:n]
        return self.images.key(tokens)


class ImageRuns:
    """A prompt's images: where their embeddings go, encoded once, on the first chunk that needs them.

    layout[j] = (first prompt position, token count, pixel digest) of image j's placeholder run.
    """

    def __init__(self, images: list[torch.Tensor], layout: list[tuple[int, int, str]]):
        self.images, self.layout = images, layout
        self.num_tokens = sum(n for _, n, _ in layout)
        self.embeds: dict[int, torch.Tensor] = {}  # image index -> [tokens, hidden]
        self._keys = {start + i: ("image", digest, i) for start, n, digest in layout for i in range(n)}

    def key(self, tokens: list[int]) -> list:
        if not self._keys:
            return tokens
        return [self._keys.get(i, t) for i, t in enumerate(tokens)]

    def chunk(self, start: int, n: int, encode: Callable[[torch.Tensor], torch.Tensor]):
        """(mask [n] bool or None, embeddings [mask.sum(), hidden] or None) for prompt positions start..start+n."""
        end = start + n
        parts, mask = [], None
        for j, (first, count, _) in enumerate(self.layout):
            lo, hi = max(first, start), min(first + count, end)
            if lo >= hi:
                continue
            if j not in self.embeds:
                self.embeds[j] = encode(self.images[j])
            if mask is None:
                mask = torch.zeros(n, dtype=torch.bool)
            mask[lo - start: hi - start] = True
            parts.append(self.embeds[j][lo - first: hi - first])
        return (mask, torch.cat(parts)) if parts else (None, None)

    def release(self) -> None:
        self.embeds.clear()
