"""Hypothesis strategies and helpers shared by the chat tests: adversarial text, JSON, histories."""

from __future__ import annotations

import json
import os
import re

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from horizon.chat import SPECIAL_TOKENS, HorizonTokenizer

# Settings for every property test here: CPU-bound string work, so no per-example deadline (CI
# machines vary); HORIZON_CHAT_EXAMPLES=2000 runs a longer search.
chat_settings = settings(
    deadline=None,
    max_examples=int(os.environ.get("HORIZON_CHAT_EXAMPLES", "100")),
    suppress_health_check=[HealthCheck.too_slow],
)

# Text that looks like the format itself: special-token text, lookalikes, JSON and call syntax.
TRICKY = [
    *SPECIAL_TOKENS.values(),
    "<|user|>",
    "<｜",
    "｜>",
    "<｜/think",
    "{",
    "}",
    '"',
    "\\",
    '{"name": "x", "arguments": {}}',
    '"arguments": ',
    "\n",
    " ",
    "\r\n",
    "\t",
    "\x00",
    "é",
    "😀",
    "你好",
    "\u2028",
    "\ufeff",
    "\ufffd",
]
any_char = st.characters(codec="utf-8")  # every code point except surrogates
text = st.lists(st.one_of(st.text(any_char, max_size=12), st.sampled_from(TRICKY)), max_size=6).map("".join)
name = st.one_of(
    st.text(any_char, min_size=1, max_size=12),
    st.sampled_from(["get_weather", "search", "run_shell", "f", 'a"b', "x\\y", "<｜tool_call｜>"]),
)
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
arguments_dict = st.dictionaries(text, json_value, max_size=4)


@st.composite
def arguments(draw):
    """A call's arguments as a client may send them: an object, or JSON text in some layout."""
    obj = draw(arguments_dict)
    layout = draw(st.sampled_from(["object", "canonical", "compact", "indented", "ascii"]))
    if layout == "object":
        return obj
    if layout == "compact":
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    if layout == "indented":
        return json.dumps(obj, indent=2, ensure_ascii=False)
    return json.dumps(obj, ensure_ascii=layout == "ascii")


@st.composite
def assistant(draw, thinking: bool | None = None, names=name):
    """An assistant message; ``thinking`` True/False forces reasoning present/absent."""
    if thinking is None:
        thinking = draw(st.booleans())
    msg = {"role": "assistant", "content": draw(st.one_of(st.none(), text))}
    if thinking:
        msg["reasoning_content"] = draw(text)
    n = draw(st.integers(0, 3))
    if n:
        msg["tool_calls"] = [
            {
                "id": f"call_{draw(st.uuids()).hex}",
                "type": "function",
                "function": {"name": draw(names), "arguments": draw(arguments())},
            }
            for _ in range(n)
        ]
    return msg


@st.composite
def history(draw):
    """A well-formed history: an optional system message, then user turns with tool loops."""
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(text)})
    for _ in range(draw(st.integers(0, 3))):
        msgs.append({"role": "user", "content": draw(text)})
        for _ in range(draw(st.integers(0, 2))):
            turn = draw(assistant())
            if draw(st.booleans()) and "reasoning_content" in turn:
                turn["thinking_tier"] = draw(st.sampled_from(["low", "high", "max"]))
            msgs.append(turn)
            for call in turn.get("tool_calls", []):
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": draw(text)})
    return msgs


def tools_for(names) -> list[dict]:
    return [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in dict.fromkeys(names)
    ]


def byte_tokens(tok: HorizonTokenizer) -> dict[bytes, int]:
    """bytes -> id for every ordinary token (each single byte has one)."""
    table = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if b is not None:
            table[b] = i
    return table


def retokenize(tok: HorizonTokenizer, table: dict[bytes, int], data: bytes, cuts: list[int]) -> list[int]:
    """Ids for ``data`` cut at byte offsets ``cuts``: each piece is encoded on its own (bytes that are
    not valid UTF-8 there get one token each), so tokens may end inside a character, as a model's can."""
    ids, start = [], 0
    for end in [*sorted(set(c for c in cuts if 0 < c < len(data))), len(data)]:
        # surrogateescape turns each undecodable byte into U+DC80..U+DCFF, which split() isolates.
        for run in re.split("([\udc80-\udcff]+)", data[start:end].decode("utf-8", "surrogateescape")):
            if run and "\udc80" <= run[0] <= "\udcff":
                ids += [table[bytes([ord(c) - 0xDC00])] for c in run]
            elif run:
                ids += tok.encode(run)
        start = end
    return ids
