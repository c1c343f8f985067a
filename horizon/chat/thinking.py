"""Thinking tiers: the names, the default budgets, and the mapping from API request values.

A tier is ``"low" | "high" | "max"``, or None for thinking off. The chat template states it to
the model; the engine enforces the tier's budget as a hard cap on thinking tokens (forcing the
end-of-thinking token when it is reached). The budgets actually used belong to a model's generation
config (``generation_config.json``); ``DEFAULT_THINKING_BUDGETS`` is the default it starts from.

    tier_from_reasoning_effort("medium") == "high"     # OpenAI reasoning_effort
    tier_from_budget_tokens(2000) == "high"            # Anthropic thinking.budget_tokens
    tier_from_effort("xhigh") == "max"                 # Anthropic adaptive output_config.effort
    check_thinking_budgets({"low": 64}, "ckpt/generation_config.json") == {"low": 64, "high": 4096, "max": 32768}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

Tier = Literal["low", "high", "max"]
TIERS: tuple[Tier, ...] = ("low", "high", "max")

# Thinking-token caps per tier (defaults for generation_config.json).
DEFAULT_THINKING_BUDGETS: dict[str, int] = {"low": 512, "high": 4096, "max": 32768}

# OpenAI `reasoning_effort`; "none" turns thinking off.
REASONING_EFFORT_TIERS: dict[str, Tier | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}
# Anthropic adaptive thinking, `output_config.effort`.
EFFORT_TIERS: dict[str, Tier] = {"low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


def check_tier(tier: str | None) -> Tier | None:
    """Return ``tier`` if it is a tier or None (thinking off); otherwise a ValueError."""
    if tier is not None and tier not in TIERS:
        raise ValueError(f"thinking tier {tier!r} is not one of {list(TIERS)} or None (thinking off)")
    return tier


def tier_from_reasoning_effort(effort: str) -> Tier | None:
    """OpenAI ``reasoning_effort``: minimal|low -> low, medium|high -> high, xhigh|max -> max, none -> off."""
    if effort not in REASONING_EFFORT_TIERS:
        raise ValueError(f"reasoning_effort {effort!r} is not one of {list(REASONING_EFFORT_TIERS)}")
    return REASONING_EFFORT_TIERS[effort]


def tier_from_effort(effort: str) -> Tier:
    """Anthropic adaptive thinking effort: low -> low, medium|high -> high, xhigh|max -> max."""
    if effort not in EFFORT_TIERS:
        raise ValueError(f"effort {effort!r} is not one of {list(EFFORT_TIERS)}")
    return EFFORT_TIERS[effort]


def tier_from_budget_tokens(
    budget_tokens: int, budgets: Mapping[str, int] = DEFAULT_THINKING_BUDGETS
) -> Tier:
    """Anthropic ``budget_tokens``: the smallest tier whose budget is at least N (the largest above all).

    The tier is only what the prompt states; the engine still caps thinking at N itself. The API's
    own limits (N >= 1024 and N < max_tokens) are checked by the server adapter, not here.
    """
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
        raise ValueError(f"budget_tokens must be a positive integer, got {budget_tokens!r}")
    missing = [t for t in TIERS if t not in budgets]
    if missing:
        raise ValueError(f"thinking budgets {dict(budgets)} lack the tiers {missing}")
    by_budget = sorted(TIERS, key=lambda t: budgets[t])
    return next((t for t in by_budget if budgets[t] >= budget_tokens), by_budget[-1])


def check_thinking_budgets(budgets: object, where: str) -> dict[str, int]:
    """A generation config's ``thinking_budgets`` merged over ``DEFAULT_THINKING_BUDGETS``, checked.

    ``budgets`` maps some of the tiers to a token cap, an integer >= 1 (not a bool, not null); tiers it
    leaves out keep their default, and the merged caps must be ordered low <= high <= max (a lower tier
    that may think longer than a higher one is a typo, and it would make ``tier_from_budget_tokens``
    pick tiers out of order). Anything else is a ValueError starting with ``where`` (the file, or
    whoever passed the dict) and naming the key and what is allowed.
    """
    allowed_keys = ", ".join(TIERS)
    if not isinstance(budgets, Mapping):
        raise ValueError(f"{where}: thinking_budgets={as_json(budgets)}; allowed: a JSON object mapping some of "
                         f"{allowed_keys} to integers >= 1")
    unknown = sorted(str(k) for k in budgets if k not in TIERS)
    if unknown:
        raise ValueError(f"{where}: thinking_budgets has unknown tier(s) {unknown}; allowed keys: {allowed_keys}")
    for tier in TIERS:
        if tier in budgets:
            value = budgets[tier]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: thinking_budgets.{tier}={as_json(value)}; allowed: an integer >= 1")
    merged = {**DEFAULT_THINKING_BUDGETS, **budgets}
    if not merged["low"] <= merged["high"] <= merged["max"]:
        raise ValueError(f"{where}: thinking_budgets must be ordered low <= high <= max, got "
                         f"{', '.join(f'{t}={merged[t]}' for t in TIERS)} (tiers left out take the defaults "
                         f"{DEFAULT_THINKING_BUDGETS})")
    return merged


def as_json(value: object) -> str:
    """A value as the JSON it came from (null, "lots"); repr for what JSON cannot hold."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
