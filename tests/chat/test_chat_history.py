"""History validation: each issue code at the right message index, and the three thinking policies."""

from __future__ import annotations

import pytest

from horizon.chat import HistoryIssue, validate_history

TOOLS = [{"type": "function", "function": {"name": "f"}}]


def call(call_id, name="f", arguments="{}"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def user(text="hi"):
    return {"role": "user", "content": text}


def turn(*calls, reasoning="thinking", **extra):
    msg = {"role": "assistant", "content": None, "tool_calls": list(calls), **extra}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def result(call_id, content="ok"):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def found(messages, tier="high", **kw):
    return [(i.index, i.code, i.severity) for i in validate_history(messages, tier=tier, **kw)]


def test_a_sound_tool_loop_has_no_issues():
    msgs = [
        user(),
        turn(call("a"), call("b")),
        result("b"),
        result("a"),
        {"role": "assistant", "content": "done"},
    ]
    assert validate_history(msgs, tier="high", tools=TOOLS) == []


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([user(), {"role": "robot", "content": "x"}], [(1, "unknown_role", "error")]),
        ([user(), {"role": "user"}], [(1, "malformed_message", "error")]),
        (
            [user(), turn(call("a")), {"role": "tool", "tool_call_id": 5, "content": "x"}],
            [(1, "unanswered_tool_call", "error"), (2, "malformed_message", "error")],
        ),
        (
            [user(), turn(call("a", arguments="{oops")), result("a")],
            [(1, "invalid_tool_arguments", "warning")],
        ),
        ([user(), turn(call("a", arguments="[1]")), result("a")], [(1, "invalid_tool_arguments", "warning")]),
        ([user(), turn(call("a", name="nope")), result("a")], [(1, "unknown_tool", "warning")]),
        (
            [user(), turn({"type": "function", "function": {"name": "f", "arguments": "{}"}})],
            [(1, "missing_tool_call_id", "error")],
        ),
        (
            [user(), turn(call("a")), result("a"), turn(call("a")), result("a")],
            [(3, "duplicate_tool_call_id", "error"), (4, "orphan_tool_result", "error")],
        ),
        ([user(), result("zz")], [(1, "orphan_tool_result", "error")]),
        ([user(), turn(call("a")), result("a"), result("a")], [(3, "duplicate_tool_result", "error")]),
        (
            [user(), turn(call("a"), call("b")), result("a"), user("next")],
            [(1, "unanswered_tool_call", "error")],
        ),
        ([user(), turn(call("a"))], [(1, "unanswered_tool_call", "error")]),
        (
            [user(), turn(call("a")), user(), result("a")],
            [(1, "unanswered_tool_call", "error"), (3, "orphan_tool_result", "error")],
        ),
        # A turn that cannot be read: its results are not reported again as orphans.
        (
            [user(), {"role": "assistant", "tool_calls": "x"}, result("a")],
            [(1, "malformed_message", "error")],
        ),
    ],
)
def test_issue_codes(messages, expected):
    assert found(messages, tools=TOOLS) == expected


def loop(reasoning_in_loop, reasoning_before):
    """An earlier finished loop (before the last user message) and the current one."""
    return [
        user("first"),
        turn(call("a"), reasoning=reasoning_before),
        result("a"),
        {"role": "assistant", "content": "answer", "reasoning_content": None},
        user("second"),
        turn(call("b"), reasoning=reasoning_in_loop),
        result("b"),
    ]


def test_reject_policy_checks_only_the_current_tool_loop():
    assert found(loop(None, "t")) == [(5, "missing_thinking", "error")]
    assert found(loop("t", None)) == []
    assert found(loop(None, None), policy="reject") == [(5, "missing_thinking", "error")]


def test_strict_policy_checks_every_tool_call_turn():
    assert found(loop(None, None), policy="strict") == [
        (1, "missing_thinking", "error"),
        (5, "missing_thinking", "error"),
    ]
    assert found(loop("t", None), policy="strict") == [(1, "missing_thinking", "error")]


def test_warn_policy_reports_warnings():
    assert found(loop(None, None), policy="warn") == [(5, "missing_thinking", "warning")]


def test_thinking_checks_need_thinking_on_and_respect_turns_made_without_it():
    assert found(loop(None, None), tier=None, policy="strict") == []
    made_off = loop(None, None)
    made_off[5]["thinking_tier"] = "off"  # the server said this turn was generated with thinking off
    assert found(made_off) == []
    assert found(loop("", None)) == []  # empty thinking is thinking that closed at once
    no_user = [turn(call("a"), reasoning=None), result("a")]
    assert found(no_user) == [(0, "missing_thinking", "error")]  # no user message: all of it is the loop


def test_issue_messages_say_what_to_do():
    (issue,) = validate_history(loop(None, "t"), tier="max")
    assert isinstance(issue, HistoryIssue)
    assert "reasoning_content" in issue.message and "current tool loop" in issue.message


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="policy 'lenient' is not one of"):
        validate_history([], tier="high", policy="lenient")
    with pytest.raises(ValueError, match="tier"):
        validate_history([], tier="medium")
    with pytest.raises(ValueError, match="messages must be a list"):
        validate_history("hello", tier=None)
