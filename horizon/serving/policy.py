"""The tool policy of a request, and the one place it becomes a grammar and a logit bias.

Every API says the same few things in its own words (OpenAI `tool_choice` / `parallel_tool_calls` /
`strict` / `response_format`; Anthropic `tool_choice` / `disable_parallel_tool_use` / `strict` /
`output_config.format`; the agent's `StepRequest`); adapters translate them into a `ToolPolicy`, and
`constraint_for` decides, the same way for every caller:

* no tools, or choice `none`: the tool-call token is banned (a hard ban, which no logit bias lifts); tools
  offered under `none` stay in the prompt, so its prefix matches turns that may call them;
* `auto` with tools: a grammar holds the answer to free text and/or calls to the declared tools
  only; a strict tool's arguments to its schema, other tools' to any JSON object; `parallel: false`
  allows one call;
* `required`: at least one call (one when not parallel); a tool's name: exactly one call to it.
  A forced call's arguments always follow the tool's schema, strict or not; a non-strict schema the
  grammar engine cannot compile falls back to any JSON object, with a warning (a strict one is a 400);
* a response schema (`json_object` is `{"type": "object"}`): the answer is that JSON, or (under
  `auto` with tools) calls.

The grammar starts where thinking ends; with a grammar the thinking must close first (the engine
rules the turn's end and the call tokens out while thinking, so no call escapes the grammar), and
when a structured answer is owed (a schema, a forced call) the service keeps a reserve of
`answer_reserve(max_tokens)` tokens for it by closing thinking early when needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from horizon.engine import ConstraintError, ConstraintSpec


class PolicyError(ValueError):
    """A tool policy or schema the request cannot have; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tool:
    name: str
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments; None: none described
    description: str | None = None
    strict: bool = False  # hold the arguments to the schema even when the call is not forced

    def rendered(self) -> dict[str, Any]:
        """The OpenAI-style definition the chat template renders (name, description, parameters)."""
        fn = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}

    @classmethod
    def from_openai(cls, tool: dict[str, Any]) -> Tool:
        fn = tool.get("function", tool)
        return cls(fn["name"], fn.get("parameters"), fn.get("description"), bool(fn.get("strict")))


@dataclass
class ToolPolicy:
    choice: str = "auto"  # auto | none | required | the name of a tool (force a call to it)
    parallel: bool = True  # more than one call in a turn
    response_schema: dict[str, Any] | None = None  # what the answer must be; {"type": "object"}: any object
    response_param: str = "response_format"  # the request field that set it (named in errors)
    tools_param: str = "tools"

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")


NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def answer_reserve(max_tokens: int) -> int:
    """Tokens kept for a constrained answer after thinking: a third of max_tokens, 16 to 256."""
    return max(16, min(256, max_tokens // 3))


def constraint_for(tools: list[Tool], policy: ToolPolicy, grammars, tool_call_token: int
                   ) -> tuple[ConstraintSpec | None, list[int], list[str]]:
    """(the grammar or None, token ids to ban, warnings). Raises PolicyError naming the field."""
    names = [t.name for t in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise PolicyError(f"the tool name {duplicate!r} is defined twice", policy.tools_param)
    if policy.forced and not tools:
        raise PolicyError("the tool choice forces a call, but no tools are offered", "tool_choice")
    if policy.forced and policy.choice != "required" and policy.choice not in names:
        raise PolicyError(f"the tool choice names {policy.choice!r}, which is not among the tools offered "
                          f"({', '.join(names)})", "tool_choice")
    warnings: list[str] = []
    schema = policy.response_schema
    if schema is not None:
        _compile(grammars, ConstraintSpec.for_json(schema), policy.response_param)
    callable_ = [] if policy.choice == "none" else [t for t in tools if policy.choice in ("auto", "required", t.name)]
    if not callable_:
        return (ConstraintSpec.for_json(schema) if schema is not None else None), [tool_call_token], warnings

    specs = []
    for i, t in enumerate(tools):
        if t not in callable_:
            continue
        args = t.parameters or NO_ARGUMENTS
        if not (t.strict or policy.forced):
            specs.append((t.name, None))
            continue
        try:
            _compile(grammars, ConstraintSpec.for_tools([(t.name, args)], required=True), f"{policy.tools_param}[{i}]")
        except PolicyError as e:
            if t.strict:
                raise
            warnings.append(f"{policy.tools_param}[{i}] ({t.name}): its parameters schema cannot be enforced while "
                            f"decoding ({e}); the call's arguments are held to any JSON object")
            args = None
        specs.append((t.name, args))
    if policy.forced:
        spec = ConstraintSpec.for_tools(specs, required=True, parallel=policy.parallel and policy.choice == "required")
    else:
        spec = ConstraintSpec.for_tools(specs, parallel=policy.parallel, json_schema=schema)
    _compile(grammars, spec, policy.tools_param)
    return spec, [], warnings


def _compile(grammars, spec: ConstraintSpec, param: str) -> None:
    try:
        grammars.matcher(spec)  # compiled once and cached for the engine
    except ConstraintError as e:
        raise PolicyError(f"{param}: {e}", param) from None
