"""Choosing the next token from a sequence's logits: bias, penalties, temperature, top-k, top-p, seed.

`sample(logits, params, generated, generator)` works on one sequence's fp32 logits [V]; the
engine calls it per sequence after one batched forward (a per-request generator keeps seeded
requests reproducible whatever else is in the batch).

It must stay cheap next to the forward, and the textbook route is not: `torch.multinomial` draws
an exponential per token (0.6 ms for 32K tokens on a 2-core Xeon) and top_p sorts the vocabulary
(1.8 ms), per sequence per step, against a 10 ms batch-1 step. `candidates` narrows top_k / top_p
without a full sort and `draw` takes one uniform number through the cumulative weights.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from horizon.engine.params import SamplingParams
from horizon.quant import kernels
from horizon.quant.kernels import argmax_rows

BAN = -100.0  # a logit_bias of -100 bans the token outright (OpenAI: "should result in a ban")
NUCLEUS_SORT_MAX = 1024  # top_p: up to this many candidates are sorted as they are, more are binned first
BINS_PER_OCTAVE = 8  # the bins' width: the last one sorted holds tokens within 2^(1/8) (9%) of each other
TINY = torch.finfo(torch.float32).tiny  # the smallest temperature divided by: any below acts as it does (greedy)


class NothingToSample(ValueError):
    """The request's own bans, biases and grammar left no token with a finite logit."""


def plain_greedy(params: SamplingParams) -> bool:
    """Whether sample() would return the row's plain argmax (no grammar mask given): temperature 0 and
    nothing that adjust_logits changes. The engine takes these rows' tokens from one batched argmax."""
    return params.temperature == 0 and not _adjusts(params)


def plain_sampled(params: SamplingParams) -> bool:
    """Whether sample() would draw from the row as it is (no grammar mask given): temperature > 0 and nothing
    that adjust_logits changes. The engine draws these rows' tokens in one call (`sample_rows`)."""
    return params.temperature > 0 and not _adjusts(params)


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
    return _draw_row(logits, _usable(params), _uniform(generator))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """sample() for finite rows [B, V] whose settings are `plain_sampled`, each drawing one uniform from its own
    generator (as sample() would, so the tokens are sample()'s): one kernel call for all of them where it
    applies (at 16 sequences ~2 ms a step less than a call per row), else row by row."""
    logits, params = logits.float(), [_usable(p) for p in params]
    us = [_uniform(g) for g in generators]
    tokens = kernels.sample_rows(logits, [p.temperature for p in params], [p.top_k for p in params],
                                 [p.top_p for p in params], us)
    if tokens is not None:
        return tokens
    return [_draw_row(row, p, u) for row, p, u in zip(logits, params, us, strict=True)]


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator))  # a CPU generator, whatever the device


def _usable(params: SamplingParams) -> SamplingParams:
    if params.temperature < TINY:  # (the API allows any T > 0; in float32 a smaller one is 0, and 0 / 0 NaN)
        return dataclasses.replace(params, temperature=TINY)
    return params


def _draw_row(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The token u draws from one row at params.temperature > 0: through the kernel (`sample_row`) where it
    applies, else through its PyTorch reference, `candidates` and `draw`."""
    token = kernels.sample_row(logits, params.temperature, params.top_k, params.top_p, u)
    if token is not None:
        return token
    ids, weights = candidates(logits, params)
    i = draw(weights, u)
    return i if ids is None else int(ids[i])


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a draw at `params.temperature` > 0 may return and their weights, probabilities up to one
    factor: softmax(logits / temperature), cut to the top_k best logits (every token tied with the k-th
    stays) and then to the nucleus, the fewest most likely tokens whose probability reaches top_p (the one
    that crosses it included; the most likely always stays). `ids` None: every token, weights [V]; otherwise
    the kept tokens in vocabulary order (so `draw` walks them as the kernel, `sample_row`, does).

    Without sorting the vocabulary (1.8 ms for 32K logits on a 2-core Xeon): the weights are counted into bins
    an eighth of an octave wide; the bins before the one where the running mass reaches top_p are kept whole,
    and only that bin's tokens are sorted to find where the nucleus ends."""
    # the best logit is 0 before dividing, so any temperature > 0 stays finite (a tiny one acts as greedy)
    z = (logits - logits.max()) / params.temperature
    ids = None
    if params.top_k and params.top_k < z.shape[0]:
        kth = z.topk(params.top_k).values[-1]
        ids = torch.nonzero(z >= kth).squeeze(1)
        z = z[ids]
    weights = torch.exp(z)  # the best token 1, the others in [0, 1]
    if params.top_p >= 1.0:
        return ids, weights
    if z.shape[0] <= NUCLEUS_SORT_MAX:
        keep, edge, before = torch.zeros(z.shape, dtype=torch.bool, device=z.device), None, 0.0
        target = params.top_p * weights.sum(dtype=torch.float64)
    else:
        # bin b holds the weights in (2^-(b+1)/8, 2^-b/8]; the last bin everything below 2^-31 (and the -inf)
        bins = (z * (-BINS_PER_OCTAVE / math.log(2))).clamp_(max=255).to(torch.uint8)
        mass = torch.bincount(bins, weights=weights.double(), minlength=256).cumsum(0)
        target = params.top_p * mass[-1]
        last = int(torch.searchsorted(mass, target[None]))  # the first bin whose running mass reaches top_p
        keep = bins < last  # every token of the bins before: less than top_p together
        edge = torch.nonzero(bins == last).squeeze(1)
        before = mass[last - 1] if last else 0.0
    # (stable: equal weights at the nucleus' edge stay in vocabulary order, as the kernel ranks them)
    ranked, order = (weights if edge is None else weights[edge]).sort(descending=True, stable=True)
    # a token stays while the mass of the more likely tokens is below top_p: the first always does
    n = int((before + ranked.cumsum(0, dtype=torch.float64) - ranked < target).sum())
    keep[order[:n] if edge is None else edge[order[:n]]] = True
    order = torch.nonzero(keep).squeeze(1)  # in vocabulary order
    return (order if ids is None else ids[order]), weights[order]


def draw(weights: torch.Tensor, u: float) -> int:
    """The index drawn by u (uniform in [0, 1)) with probability weights[i] / weights.sum() (weights >= 0, one at
    least > 0): the first whose running sum exceeds u * sum. One random number and one pass, where
    torch.multinomial draws an exponential per entry (0.6 ms for 32K entries here)."""
    cum = weights.cumsum(0, dtype=torch.float64)
    i = int(torch.searchsorted(cum, cum[-1:] * u, right=True))
    if i == cum.shape[0]:  # u * sum rounded up to the sum: the last token with any weight
        i = int(torch.nonzero(weights).max())
    return i


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
