"""OpenAI-style chat messages and tool definitions, checked and normalised into one internal shape.

The template (which renders) and the history validator (which reports) both read messages through
``normalize_message``, so a message is malformed for one exactly when it is for the other.

Accepted input (OpenAI Chat Completions shape, plus two Horizon choices):
  * roles ``system`` (``developer`` is read as system), ``user``, ``assistant``, ``tool``;
  * ``content``: a string, or a list of parts ``{"type": "text", "text"}`` and, for user and tool
    messages, images ``{"type": "image_url", "image_url": {"url"}}`` (``{"type": "image"}`` too);
    assistant content may be null;
  * assistant ``reasoning_content`` (``reasoning`` is accepted as another name for it): null means
    the turn was made with thinking off;
  * assistant ``tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``,
    arguments a JSON string (the usual form) or an object;
  * assistant ``thinking_tier`` (Horizon extension): ``"off" | "low" | "high" | "max"``, the tier the
    turn was generated under, so that it re-renders exactly (see ``template``);
  * tool ``tool_call_id``: the id of the call this result answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
TURN_TIERS = ("off", "low", "high", "max")  # values of the assistant `thinking_tier` extension
JSON_WHITESPACE = " \t\n\r"


class MessageError(ValueError):
    """A message that cannot be read; ``code`` is ``unknown_role`` or ``malformed_message``."""

    def __init__(self, index: int, code: str, detail: str):
        self.index, self.code, self.detail = index, code, detail
        super().__init__(f"messages[{index}]: {detail}")


@dataclass(frozen=True)
class Image:
    """An image content part, kept as the client sent it (the vision layer reads it)."""

    part: Mapping[str, Any]


@dataclass(frozen=True)
class ToolCall:
    id: str | None
    name: str
    arguments: str  # the JSON text rendered for the arguments (see canonical_arguments)
    arguments_ok: bool  # the arguments are a valid JSON object


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    parts: tuple[str | Image, ...]  # text (adjacent text parts joined) and images, in order
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    thinking_tier: str | None = None  # the assistant extension field as sent, or None if absent

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """json.loads without Python's NaN / Infinity extensions (they are not JSON)."""
    return json.loads(text, parse_constant=_reject_constant)


def canonical_arguments(arguments: Any) -> tuple[str, bool]:
    """The arguments text to render for a tool call, and whether it is a valid JSON object.

    The model generates the exact bytes, so a JSON string sent back by a client is rendered as it
    is (surrounding whitespace aside, which the model never generates there); that keeps a
    re-rendered history identical to the generated tokens. An object (a client that parsed the
    arguments, or Anthropic ``input``) is serialised the way the model is trained to write JSON:
    ``json.dumps(obj, ensure_ascii=False)``, keys in the given order. Null or an empty string is
    ``{}``. Invalid JSON is rendered as sent and reported (``arguments_ok`` False).
    """
    if arguments is None:
        return "{}", True
    if isinstance(arguments, Mapping):
        try:
            return json.dumps(arguments, ensure_ascii=False, allow_nan=False), True
        except (TypeError, ValueError) as e:
            raise ValueError(f"arguments object is not JSON-serialisable: {e}") from None
    if not isinstance(arguments, str):
        raise ValueError(f"arguments must be a JSON string or an object, got {type(arguments).__name__}")
    text = arguments.strip(JSON_WHITESPACE)
    if not text:
        return "{}", True
    try:
        return text, isinstance(loads_strict(text), dict)
    except ValueError:
        return text, False


def _content(raw: Any, index: int, role: str, *, images: bool, required: bool) -> tuple[str | Image, ...]:
    if raw is None:
        if required:
            raise MessageError(
                index, "malformed_message", f"a {role} message needs content (a string or parts)"
            )
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if not isinstance(raw, list):
        raise MessageError(
            index,
            "malformed_message",
            f"content must be a string or a list of parts, got {type(raw).__name__}",
        )
    allowed = ["text", "image_url", "image"] if images else ["text"]
    parts: list[str | Image] = []
    for j, part in enumerate(raw):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in allowed:
            raise MessageError(
                index,
                "malformed_message",
                f"content[{j}] must be a part with type in {allowed} for a {role} message, got {part!r:.80}",
            )
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise MessageError(index, "malformed_message", f"content[{j}].text must be a string")
            if parts and isinstance(parts[-1], str):
                parts[-1] += text
            elif text:
                parts.append(text)
            continue
        if kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, Mapping) else url
            if not isinstance(url, str) or not url:
                raise MessageError(index, "malformed_message", f"content[{j}].image_url.url must be a string")
        parts.append(Image(part))
    return tuple(p for p in parts if p != "")


def _tool_call(raw: Any, index: int, j: int) -> ToolCall:
    where = f"tool_calls[{j}]"
    if not isinstance(raw, Mapping):
        raise MessageError(index, "malformed_message", f"{where} must be an object, got {type(raw).__name__}")
    if raw.get("type", "function") != "function":
        raise MessageError(
            index, "malformed_message", f"{where}.type must be 'function', got {raw.get('type')!r}"
        )
    call_id = raw.get("id")
    if call_id is not None and (not isinstance(call_id, str) or not call_id):
        raise MessageError(index, "malformed_message", f"{where}.id must be a non-empty string")
    fn = raw.get("function")
    if not isinstance(fn, Mapping):
        raise MessageError(
            index, "malformed_message", f"{where}.function must be an object with name and arguments"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise MessageError(index, "malformed_message", f"{where}.function.name must be a non-empty string")
    try:
        arguments, ok = canonical_arguments(fn.get("arguments"))
    except ValueError as e:
        raise MessageError(index, "malformed_message", f"{where}.function: {e}") from None
    return ToolCall(call_id, name, arguments, ok)


def normalize_message(raw: Any, index: int) -> Message:
    """Check one message; raise MessageError (a ValueError) saying what is wrong and what is allowed."""
    if not isinstance(raw, Mapping):
        raise MessageError(
            index, "malformed_message", f"a message must be an object, got {type(raw).__name__}"
        )
    role = raw.get("role")
    if not isinstance(role, str):
        raise MessageError(index, "malformed_message", f"role must be one of {list(ROLES)}, got {role!r}")
    if role not in ROLES:
        raise MessageError(index, "unknown_role", f"unknown role {role!r}; allowed: {list(ROLES)}")
    content = raw.get("content")
    if role in ("system", "developer"):
        return Message("system", _content(content, index, role, images=False, required=True))
    if role == "user":
        return Message("user", _content(content, index, role, images=True, required=True))
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise MessageError(
                index, "malformed_message", "a tool message needs tool_call_id (a non-empty string)"
            )
        return Message(
            "tool", _content(content, index, role, images=True, required=True), tool_call_id=call_id
        )

    parts = _content(content, index, role, images=False, required=False)
    reasoning = raw.get("reasoning_content")
    alias = raw.get("reasoning")
    for key, value in (("reasoning_content", reasoning), ("reasoning", alias)):
        if value is not None and not isinstance(value, str):
            raise MessageError(index, "malformed_message", f"{key} must be a string or null")
    if reasoning is not None and alias is not None and reasoning != alias:
        raise MessageError(
            index, "malformed_message", "reasoning_content and reasoning are both set and differ"
        )
    reasoning = reasoning if reasoning is not None else alias
    calls = raw.get("tool_calls")
    if calls is None:
        calls = []
    if not isinstance(calls, list):
        raise MessageError(
            index, "malformed_message", f"tool_calls must be a list, got {type(calls).__name__}"
        )
    tier = raw.get("thinking_tier")
    if tier is not None and tier not in TURN_TIERS:
        raise MessageError(
            index, "malformed_message", f"thinking_tier must be one of {list(TURN_TIERS)}, got {tier!r}"
        )
    if tier == "off" and reasoning is not None:
        raise MessageError(
            index, "malformed_message", "thinking_tier is 'off' but the turn has reasoning_content"
        )
    return Message(
        "assistant",
        parts,
        reasoning=reasoning,
        tool_calls=tuple(_tool_call(c, index, j) for j, c in enumerate(calls)),
        thinking_tier=tier,
    )


def normalize_messages(messages: Sequence[Any]) -> list[Message]:
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def normalize_tools(tools: Sequence[Any] | None) -> list[Mapping[str, Any]]:
    """The function objects of an OpenAI ``tools`` list (``[{"type": "function", "function": {...}}]``)."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise ValueError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': <non-empty string>, ...}}}}"
                f", got {tool!r:.100}"
            )
        if name in names:
            raise ValueError(f"tools[{i}]: the tool name {name!r} is defined twice")
        try:
            json.dumps(fn, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tools[{i}] ({name}) is not JSON-serialisable: {e}") from None
        names.add(name)
        functions.append(fn)
    return functions
