"""Choosing the next token from a sequence's logits: bias, penalties, temperature, top-k, top-p, seed.

`sample(logits, params, generated, generator)` works on one sequence's fp32 logits [V]; the
engine calls it per sequence after one batched forward (sampling is cheap next to the forward,
and a per-request generator keeps seeded requests reproducible whatever else is in the batch).
"""

from __future__ import annotations

import torch

from horizon.engine.params import SamplingParams
from horizon.quant.kernels import argmax_rows

BAN = -100.0  # a logit_bias of -100 bans the token outright (OpenAI: "should result in a ban")


class NothingToSample(ValueError):
    """The request's own bans, biases and grammar left no token with a finite logit."""


def plain_greedy(params: SamplingParams) -> bool:
    """Whether sample() would return the row's plain argmax (no grammar mask given): temperature 0 and
    nothing that adjust_logits changes. The engine takes these rows' tokens from one batched argmax."""
    return params.temperature == 0 and not _adjusts(params)


def _adjusts(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.presence_penalty or params.frequency_penalty or params.banned_token_ids)


def adjust_logits(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """logit_bias (-100: banned, whatever the logit), OpenAI's presence / frequency penalties over the
    tokens generated so far, then the banned tokens."""
    if not _adjusts(params):
        return logits
    logits = logits.clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        logits[ids] += bias.masked_fill(bias <= BAN, float("-inf"))
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=logits.shape[0])
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.banned_token_ids:
        logits[torch.tensor(params.banned_token_ids, device=logits.device)] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generated: list[int],
           generator: torch.Generator | None, allowed: torch.Tensor | None = None, finite: bool = False) -> int:
    """One token id; `allowed` (bool [V]) is a grammar's mask: other tokens get probability 0.
    `finite`: the caller already knows every logit is finite (the engine checks a step's rows at once), so
    only bans, biases or a mask can leave nothing to sample, and without them the per-row check is skipped
    (a max over the vocabulary and a host read per row: ~50 us a row of a 32K vocabulary here)."""
    plain = logits.float()
    logits = adjust_logits(plain, params, generated)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if not (finite and logits is plain) and not bool(torch.isfinite(logits.max())):
        raise NothingToSample("no token can be sampled: logit_bias, the banned tokens and the output format "
                              "together rule out every token of the vocabulary")
    if params.temperature == 0:
        return int(argmax_rows(logits[None])[0])
    # the best logit is 0 before dividing, so any temperature > 0 stays finite (a tiny one acts as greedy)
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.shape[0]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        drop[0] = False  # the most likely token always stays (a top_p below fp32's resolution reads as 0)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its n most likely alternatives (raw logits, no sampling tweaks)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(n) if n else None
    alternatives = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
    return float(lp[token]), alternatives


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting any part of one.

    Text that could still be the start of a stop string is held back until the next piece decides.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at = min(i for i, _ in hits)
            out, self.pending = self.pending[:at], ""
            return out, True
        hold = 0
        for s in self.stops:  # the longest tail of pending that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if s.startswith(self.pending[-n:]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
