"""History validation: what is wrong with a chat history, reported per message, before rendering.

``validate_history`` never raises on message content; it returns ``HistoryIssue``s (message index,
code, message, severity) and the server decides (errors become a 400, warnings a header).

Codes (severity):
  unknown_role, malformed_message (error)  the message cannot be read; see ``messages``
  invalid_tool_arguments (warning)         a call's arguments are not a JSON object; rendered as sent
  unknown_tool (warning)                   a historic call names a tool the request does not offer
  missing_tool_call_id (error)             a call without an id: no result can refer to it
  duplicate_tool_call_id (error)           two calls in the history share an id
  orphan_tool_result (error)               a tool result that answers no call of the assistant turn
                                           right before it (only tool results may come between)
  duplicate_tool_result (error)            a second result for the same call
  unanswered_tool_call (error)             a call with no result before the next non-tool message
                                           or the end of the history (reported at the call's turn)
  missing_thinking (error; warning under ``warn``)
      With thinking on (a request tier), an assistant turn that made tool calls arrives without its
      thinking (``reasoning_content`` null) although it does not say it was made with thinking off
      (``thinking_tier: "off"``). Policies:
        reject (default)  checked for turns in the current, unfinished tool loop: after the last
                          user message (the whole history if there is none);
        strict            checked for every tool-call turn in the history (the DeepSeek/Kimi rule);
        warn              as reject, reported as warnings.
      With thinking off nothing is checked: the model is not thinking, old turns render as they are.
      An empty ``reasoning_content`` ("") counts as present: the model closed its thinking at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from horizon.chat.messages import MessageError, normalize_message, normalize_tools
from horizon.chat.thinking import Tier, check_tier

POLICIES = ("reject", "strict", "warn")
Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class HistoryIssue:
    index: int  # the message it concerns
    code: str
    message: str
    severity: Severity


def validate_history(
    messages: Sequence[Any],
    *,
    tier: Tier | None,
    policy: str = "reject",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[HistoryIssue]:
    """All issues in ``messages`` (ordered by message index); an empty list means the history is sound.

    ``tier`` is the request's thinking tier (None: thinking off). ``tools`` (OpenAI shape), when
    given, lets historic calls to unknown tools be reported.
    """
    check_tier(tier)
    if policy not in POLICIES:
        raise ValueError(f"history policy {policy!r} is not one of {list(POLICIES)}")
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    tool_names = {fn["name"] for fn in normalize_tools(tools)} if tools is not None else None
    issues: list[HistoryIssue] = []

    def report(index: int, code: str, message: str, severity: Severity = "error") -> None:
        issues.append(HistoryIssue(index, code, message, severity))

    msgs = []
    for i, raw in enumerate(messages):
        try:
            msgs.append(normalize_message(raw, i))
        except MessageError as e:
            report(i, e.code, e.detail)
            msgs.append(None)

    # Tool linkage: each assistant turn's calls are answered by the tool messages right after it.
    seen_ids: set[str] = set()
    pending: dict[str, str] = {}  # call id -> function name, for the current group
    answered: set[str] = set()
    group_at = -1  # index of the assistant turn the current group belongs to
    group_unreadable = False  # that turn was malformed: its calls are unknown, so are orphans

    def close_group() -> None:
        for call_id, name in pending.items():
            report(group_at, "unanswered_tool_call", f"tool call {call_id!r} ({name}) has no tool result")
        pending.clear()
        answered.clear()

    for i, m in enumerate(msgs):
        raw = messages[i]
        role = m.role if m is not None else (raw.get("role") if isinstance(raw, Mapping) else None)
        if role == "tool":
            call_id = m.tool_call_id if m is not None else raw.get("tool_call_id")
            if not isinstance(call_id, str):
                continue  # already reported as malformed
            if call_id in pending:
                answered.add(call_id)
                del pending[call_id]
            elif call_id in answered:
                report(i, "duplicate_tool_result", f"a second tool result for call {call_id!r}")
            elif m is not None and not group_unreadable:
                report(
                    i, "orphan_tool_result", f"tool_call_id {call_id!r} answers no call of the turn before it"
                )
            continue
        close_group()
        group_unreadable = m is None and role == "assistant"
        if m is None or m.role != "assistant":
            continue
        group_at = i
        for j, call in enumerate(m.tool_calls):
            if not call.arguments_ok:
                report(
                    i, "invalid_tool_arguments", f"tool_calls[{j}] arguments are not a JSON object", "warning"
                )
            if tool_names is not None and call.name not in tool_names:
                report(
                    i, "unknown_tool", f"tool_calls[{j}] calls {call.name!r}, which is not offered", "warning"
                )
            if call.id is None:
                report(i, "missing_tool_call_id", f"tool_calls[{j}] has no id")
            elif call.id in seen_ids:
                report(i, "duplicate_tool_call_id", f"tool_calls[{j}] reuses the id {call.id!r}")
            else:
                seen_ids.add(call.id)
                pending[call.id] = call.name
    close_group()

    if tier is not None:
        last_user = max((i for i, m in enumerate(msgs) if m is not None and m.role == "user"), default=-1)
        for i, m in enumerate(msgs):
            if m is None or m.role != "assistant" or not m.tool_calls:
                continue
            if m.reasoning is not None or m.thinking_tier == "off":
                continue
            if policy == "strict" or i > last_user:
                where = "in the current tool loop" if i > last_user else "in the history"
                report(
                    i,
                    "missing_thinking",
                    f"an assistant turn with tool calls {where} arrived without its reasoning_content; "
                    "send every assistant message back as it was returned (thinking included)",
                    "warning" if policy == "warn" else "error",
                )
    issues.sort(key=lambda issue: issue.index)
    return issues
