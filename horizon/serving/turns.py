"""Generated turns in the APIs' terms, and the server-side memory that gives clients back their thinking.

`returned_message`, `NamelessCallsAsText` and `finish_reason` say once what a finished generation is as an OpenAI-style
assistant message (a call whose name could not be read becomes text: no client could run it, and the
history must still say what the model wrote) and why it ended; every adapter and the in-process
client use them.

`TurnStore`: Chat Completions has no request field for an assistant message's reasoning, so many
clients (langchain-openai; the OpenAI Agents SDK unless told to replay it) send a thinking turn back
without its thinking. The seeds' rule is that the model sees its full history, so the server keeps
each thinking turn it generated (thinking, text, the exact argument text, the token ids), bounded in
bytes (least recently used out first), and restores it when it comes back without its thinking.

A stored turn is found by an HMAC, under a per-process secret, of the tenant, a hash of the exact
rendered conversation before the turn (token ids and the pixels of its images), and the turn itself
as the client sees it (its text, and each call's name and arguments compared as parsed JSON, since
clients re-serialise arguments). So a turn is restored only when the whole preceding conversation and
the turn match what it was generated from, within the same tenant; another conversation's tool-call
ids and arguments, or an edited earlier message, find nothing (ids are not part of the rendered
prompt and prove nothing: they are reproducible from `seed`). The client's ids are kept; the
thinking, the tier and the exact argument text are put back.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from horizon.chat.messages import loads_strict
from horizon.chat.parser import ParsedTurn, TextDelta, ToolCallArgs, ToolCallStart


class NamelessCallsAsText:
    """A call whose name could not be read goes to the text: its argument pieces become text deltas.
    Stateful, so a stream can be fed event by event."""

    def __init__(self):
        self.dropped: set[int] = set()

    def __call__(self, deltas: Iterable) -> list:
        out = []
        for d in deltas:
            if isinstance(d, ToolCallStart) and not d.name:
                self.dropped.add(d.index)
            elif isinstance(d, ToolCallArgs) and d.index in self.dropped:
                out.append(TextDelta(d.text))
            else:
                out.append(d)
        return out


def returned_message(deltas: Iterable, tier: str | None) -> tuple[dict[str, Any], ParsedTurn]:
    """The assistant message a finished generation returns (OpenAI shape, `thinking_tier` included)."""
    parsed = ParsedTurn.from_deltas(NamelessCallsAsText()(deltas), tier)
    return parsed.to_message(), parsed


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's finish_reason for an engine finish reason: length | tool_calls | stop (error | cancelled
    pass through: adapters report them as failures)."""
    if reason in ("error", "cancelled", "length"):
        return reason
    return "tool_calls" if calls else "stop"


def _arguments(arguments: Any) -> Any:
    """A call's arguments as parsed JSON when they are JSON (a string or an object), else the text as sent."""
    if isinstance(arguments, str):
        try:
            return loads_strict(arguments.strip() or "{}")
        except ValueError:
            return ["<not JSON>", arguments.strip()]
    return {} if arguments is None else arguments


def turn_form(message: dict[str, Any]) -> str:
    """What identifies an assistant turn as a client sends it back: its text and its calls (name, parsed
    arguments), not its ids or its formatting."""
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    given = message.get("tool_calls")
    for call in given if isinstance(given, list) else ():  # a malformed history is the history check's to report
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        calls.append([fn.get("name"), _arguments(fn.get("arguments"))])
    return json.dumps([content or "", calls], sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def needs_thinking(message: Any) -> bool:
    """An assistant turn that came back without its thinking and does not say it was made with it off."""
    return (isinstance(message, dict) and message.get("role") == "assistant"
            and message.get("reasoning_content") is None and message.get("reasoning") is None
            and message.get("thinking_tier") != "off")


@dataclass
class StoredTurn:
    message: dict[str, Any]  # as generated: reasoning_content, content, tool_calls (exact arguments), thinking_tier
    token_ids: list[int]
    nbytes: int
    form_key: bytes  # the index entry it counts in


class TurnStore:
    """Thinking turns this server generated, per tenant, for restoring them (see the module docstring)."""

    def __init__(self, max_bytes: int = 64 * 1024**2, secret: bytes | None = None):
        self.max_bytes = max_bytes
        self._secret = secret or os.urandom(32)
        self._turns: OrderedDict[bytes, StoredTurn] = OrderedDict()
        self._forms: dict[bytes, int] = {}  # HMAC of (tenant, turn form) -> stored turns with it
        self._lock = threading.Lock()  # recorded from the event loop, read from request handlers
        self.nbytes = 0
        self.restored = 0  # turns given back their thinking
        self.unknown = 0  # turns without thinking that matched nothing stored (left to the history policy)

    def _mac(self, *parts: str | bytes) -> bytes:
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for p in parts:
            data = p.encode() if isinstance(p, str) else p
            h.update(len(data).to_bytes(8, "little") + data)
        return h.digest()

    @staticmethod
    def prefix_hash(prefix_ids: list[int], image_digests: list[str]) -> bytes:
        h = hashlib.sha256(json.dumps([prefix_ids, image_digests], separators=(",", ":")).encode())
        return h.digest()

    def form_key(self, tenant: str, form: str) -> bytes:
        return self._mac("form", tenant, form)

    def key(self, tenant: str, prefix: bytes, form: str) -> bytes:
        return self._mac("turn", tenant, prefix, form)

    def __len__(self) -> int:
        return len(self._turns)

    def record(self, tenant: str, prefix: bytes, message: dict[str, Any], token_ids: list[int]) -> None:
        if self.max_bytes <= 0:
            return
        form = turn_form(message)
        nbytes = 256 + len(json.dumps(message, ensure_ascii=False).encode()) + 4 * len(token_ids)
        key, fkey = self.key(tenant, prefix, form), self.form_key(tenant, form)
        with self._lock:
            if key in self._turns:
                self._turns.move_to_end(key)
                return
            self._turns[key] = StoredTurn(message, list(token_ids), nbytes, fkey)
            self._forms[fkey] = self._forms.get(fkey, 0) + 1
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes and self._turns:
                _, old = self._turns.popitem(last=False)
                self.nbytes -= old.nbytes
                left = self._forms[old.form_key] - 1
                if left:
                    self._forms[old.form_key] = left
                else:
                    del self._forms[old.form_key]

    def may_hold(self, tenant: str, message: dict[str, Any]) -> bool:
        """Cheap pre-check (no rendering): is any turn of this form stored for this tenant?"""
        with self._lock:
            return self.form_key(tenant, turn_form(message)) in self._forms

    def find(self, tenant: str, prefix: bytes, message: dict[str, Any]) -> StoredTurn | None:
        key = self.key(tenant, prefix, turn_form(message))
        with self._lock:
            stored = self._turns.get(key)
            if stored is not None:
                self._turns.move_to_end(key)
            return stored


def restored(sent: dict[str, Any], stored: StoredTurn) -> dict[str, Any]:
    """The client's turn with its thinking, tier, text and exact argument text put back; its ids kept."""
    gen = stored.message
    out = {**sent, "reasoning_content": gen["reasoning_content"], "thinking_tier": gen["thinking_tier"],
           "content": gen.get("content")}
    out.pop("reasoning", None)
    if sent.get("tool_calls"):
        out["tool_calls"] = [{**call, "function": {**call["function"], "arguments": g["function"]["arguments"]}}
                             for call, g in zip(sent["tool_calls"], gen.get("tool_calls") or (), strict=True)]
    return out
