"""The tool interface of the agent runtime: a name, a description, a JSON schema for the arguments,
and run(arguments) -> ToolResult.

A tool never raises into the loop: bad arguments, refused paths, timeouts and crashes all come back
to the model as an error result (`is_error=True`) with a message saying what was wrong and what is
allowed, the way the APIs' `tool_result.is_error` / OpenAI tool messages carry them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


class ToolError(Exception):
    """Raised inside a tool for a failure the model should read (becomes an error result)."""


@dataclass
class ToolResult:
    content: str
    is_error: bool = False


class Tool:
    """Subclasses set `name`, `description`, `parameters` (a JSON schema for an object) and implement call()."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    max_result_chars: int = 16_000  # what the model reads back; longer results are cut with a note
    strict: bool = False  # ask the server to hold the arguments to the schema (constrained decoding)

    def call(self, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    def run(self, arguments: dict[str, Any] | str) -> ToolResult:
        """Run with arguments as a dict or as the JSON text the model wrote; never raises."""
        try:
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError as e:
                    raise ToolError(f"arguments are not valid JSON ({e.msg} at character {e.pos})") from None
            if not isinstance(arguments, dict):
                raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__}")
            check_arguments(self.parameters, arguments)
            out = self.call(arguments)
        except ToolError as e:
            return ToolResult(f"error: {e}", is_error=True)
        except Exception as e:  # a bug in a tool is still the model's tool error, not the loop's crash
            return ToolResult(f"error: {self.name} failed: {type(e).__name__}: {e}", is_error=True)
        return ToolResult(cut(out, self.max_result_chars))

    def spec(self) -> dict[str, Any]:
        """Name, description and schema (what the APIs' tool definitions carry)."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[output cut: {len(text)} characters, the first {limit} shown]"


_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> None:
    """The checks a tool's flat argument schema needs (required fields, types, enums, no unknown
    fields), with messages the model can act on. Tools with nested schemas check the rest themselves."""
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise ToolError(f"missing required argument(s): {', '.join(missing)}; expected {sorted(props)}")
    unknown = [k for k in arguments if k not in props]
    if unknown and schema.get("additionalProperties", True) is False:
        raise ToolError(f"unknown argument(s): {', '.join(unknown)}; allowed: {', '.join(sorted(props))}")
    for key, value in arguments.items():
        p = props.get(key, {})
        want = _TYPES.get(p.get("type"))
        # bool is an int subclass in Python, not in JSON
        if want is not None and (not isinstance(value, want) or (isinstance(value, bool) and p["type"] != "boolean")):
            raise ToolError(f"argument {key!r} must be of type {p['type']}, got {json.dumps(value)[:80]}")
        if "enum" in p and value not in p["enum"]:
            raise ToolError(f"argument {key!r} must be one of {p['enum']}, got {json.dumps(value)[:80]}")


def nested_quantifier(pattern: str) -> bool:
    """A cheap check for the classic catastrophic-backtracking shape: a repeated group that itself contains
    a repeat, like (a+)+ or (\\w*x)*. Python's re has no timeout, so such patterns are refused up front.
    It does not catch every exponential pattern (e.g. overlapping alternatives like (a|a)*)."""
    stack: list[bool] = []  # per open group: does it contain a quantifier?
    i, n = 0, len(pattern)
    closed_had_repeat = False  # the token just before i was a group containing a repeat
    while i < n:
        c = pattern[i]
        quant = c in "*+" or (c == "{" and re.match(r"\{\d*,?\d*\}", pattern[i:]) is not None)
        if quant:
            if closed_had_repeat:
                return True
            if stack:
                stack[-1] = True
        closed_had_repeat = False
        if c == "\\":
            i += 2
            continue
        if c == "[":  # skip a character class: quantifier characters inside it are literal
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            stack.append(False)
        elif c == ")" and stack:
            had = stack.pop()
            closed_had_repeat = had
            if had and stack:
                stack[-1] = True
        i += 1
    return False
