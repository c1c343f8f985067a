"""Thinking tiers: API values to tiers, budgets to tiers, and the chat package's import boundary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from horizon.chat import (
    DEFAULT_THINKING_BUDGETS,
    TIERS,
    tier_from_budget_tokens,
    tier_from_effort,
    tier_from_reasoning_effort,
)


def test_openai_reasoning_effort():
    expected = {
        "none": None,
        "minimal": "low",
        "low": "low",
        "medium": "high",
        "high": "high",
        "xhigh": "max",
        "max": "max",
    }
    assert {e: tier_from_reasoning_effort(e) for e in expected} == expected
    with pytest.raises(ValueError, match="reasoning_effort 'extreme' is not one of"):
        tier_from_reasoning_effort("extreme")


def test_anthropic_adaptive_effort():
    assert [tier_from_effort(e) for e in ["low", "medium", "high", "xhigh", "max"]] == [
        "low",
        "high",
        "high",
        "max",
        "max",
    ]
    with pytest.raises(ValueError, match="effort 'none'"):
        tier_from_effort("none")


def test_budget_tokens_pick_the_smallest_tier_that_covers_them():
    assert TIERS == ("low", "high", "max") and DEFAULT_THINKING_BUDGETS == {
        "low": 512,
        "high": 4096,
        "max": 32768,
    }
    cases = {
        1: "low",
        512: "low",
        513: "high",
        1024: "high",
        4096: "high",
        4097: "max",
        32768: "max",
        10**6: "max",
    }
    assert {n: tier_from_budget_tokens(n) for n in cases} == cases
    assert (
        tier_from_budget_tokens(100, {"low": 50, "high": 200, "max": 100}) == "max"
    )  # by budget, not by name
    for bad in (0, -3, 1.5, True, "1024"):
        with pytest.raises(ValueError, match="positive integer"):
            tier_from_budget_tokens(bad)
    with pytest.raises(ValueError, match="lack the tiers"):
        tier_from_budget_tokens(10, {"low": 1})


def test_chat_package_needs_no_torch_and_no_model():
    """horizon.chat must work where torch is absent: import it with torch and horizon.model blocked
    (and without running horizon/__init__, which belongs to the model side)."""
    root = Path(__file__).resolve().parents[2]
    code = f"""
import importlib.abc, sys, types
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy") or name.startswith("horizon.model"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
pkg = types.ModuleType("horizon"); pkg.__path__ = [{str(root / "horizon")!r}]; sys.modules["horizon"] = pkg
import horizon.chat, horizon.chat.train_tokenizer
tok = horizon.chat.load_tokenizer()
print(tok.decode(horizon.chat.ChatTemplate(tok).render([{{"role": "user", "content": "hi"}}]).ids))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "<｜user｜>hi<｜/user｜>"
