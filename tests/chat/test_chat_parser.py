"""The output parser: documented deltas for malformed output, and streaming == whole-turn parsing
for every way a turn can be split (into feed() calls, and into tokens that cut characters)."""

from __future__ import annotations

import itertools
import re

import pytest
from chat_strategies import byte_tokens, chat_settings, retokenize, text
from hypothesis import given
from hypothesis import strategies as st

from horizon.chat import (
    ErrorDelta,
    ParsedTurn,
    ReasoningDelta,
    SpecialIds,
    StreamParser,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    parse_turn,
)
from horizon.chat import parser as parser_module

F = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]


def is_special(piece) -> bool:
    return isinstance(piece, str) and piece[:1] == "@" and piece[1:] in SpecialIds.__dataclass_fields__


def ids(tok, *pieces):
    """Token ids from text (encoded) and special-token names (e.g. "think_end") or raw ints."""
    out = []
    for p in pieces:
        if isinstance(p, int):
            out.append(p)
        elif is_special(p):
            out.append(getattr(tok.special, p[1:]))
        else:
            out += tok.encode(p)
    return out


def stream(tok, token_ids, finish=True, **kw):
    parser = StreamParser(tok, seed=0, **kw)
    deltas = []
    for t in token_ids:
        deltas += parser.feed(t)
    if finish:
        deltas += parser.finish()
    return deltas, parser


def codes(deltas):
    return [(d.code, d.index) for d in deltas if isinstance(d, ErrorDelta)]


def kinds(deltas):
    """The delta types in order, runs of the same text kind collapsed."""
    out = []
    for d in deltas:
        name = type(d).__name__
        if not (out and out[-1] == name and name in ("ReasoningDelta", "TextDelta", "ToolCallArgs")):
            out.append(name)
    return out


CALL = '{"name": "f", "arguments": {"a": 1}}'

# (name, tier, tools, pieces, expected error codes, checks on the result). A turn without an end
# token is stopped with finish(), as the engine does at max_tokens.
CASES = [
    (
        "well_formed",
        "high",
        F,
        ["hmm", "@think_end", "hi", "@tool_call", CALL, "@tool_call_end", "@assistant_end"],
        [],
        dict(reasoning="hmm", content="hi", calls=[("f", '{"a": 1}', None)]),
    ),
    (
        "thinking_never_closed_by_end_token",
        "low",
        None,
        ["still thinking", "@assistant_end"],
        [("thinking_not_closed", None)],
        dict(reasoning="still thinking", content=""),
    ),
    (
        "thinking_never_closed_when_stopped",
        "max",
        None,
        ["budget ran out mid-"],
        [("thinking_not_closed", None)],
        dict(reasoning="budget ran out mid-", content=""),
    ),
    (
        "tool_call_in_thinking",
        "high",
        F,
        ["plan", "@tool_call", CALL, "@tool_call_end", "@assistant_end"],
        [("tool_call_in_thinking", None)],
        dict(reasoning="plan", content="", calls=[("f", '{"a": 1}', None)]),
    ),
    (
        "invalid_json_arguments",
        None,
        F,
        ["@tool_call", '{"name": "f", "arguments": {"a": }}', "@tool_call_end"],
        [("invalid_tool_call", 0)],
        dict(calls=[("f", '{"a": }', "invalid_tool_call")]),
    ),
    (
        "call_not_json_at_all",
        None,
        F,
        ["@tool_call", "call f with a=1", "@tool_call_end"],
        [("invalid_tool_call", 0)],
        dict(calls=[("", "call f with a=1", "invalid_tool_call")]),
    ),
    (
        "arguments_not_an_object",
        None,
        F,
        ["@tool_call", '{"name": "f", "arguments": "{}"}', "@tool_call_end"],
        [("invalid_tool_call", 0)],
        dict(calls=[("f", '"{}"', "invalid_tool_call")]),
    ),
    (
        "text_after_the_arguments",
        None,
        F,
        ["@tool_call", '{"name": "f", "arguments": {}, "x": 1}', "@tool_call_end"],
        [("invalid_tool_call", 0)],
        dict(calls=[("f", "{}", "invalid_tool_call")]),
    ),
    (
        "empty_name",
        None,
        None,
        ["@tool_call", '{"name": "", "arguments": {}}', "@tool_call_end"],
        [("invalid_tool_call", 0)],
        dict(calls=[("", "{}", "invalid_tool_call")]),
    ),
    (
        "unknown_tool",
        None,
        F,
        ["@tool_call", '{"name": "h", "arguments": {}}', "@tool_call_end"],
        [("unknown_tool", 0)],
        dict(calls=[("h", "{}", "unknown_tool")]),
    ),
    (
        "unknown_names_unchecked_without_tools",
        None,
        None,
        ["@tool_call", '{"name": "h", "arguments": {}}', "@tool_call_end"],
        [],
        dict(calls=[("h", "{}", None)]),
    ),
    (
        "several_calls",
        None,
        F,
        [
            "@tool_call",
            CALL,
            "@tool_call_end",
            "@tool_call",
            '{"name": "g", "arguments": {"b": [1, "}"]}}',
            "@tool_call_end",
            "@assistant_end",
        ],
        [],
        dict(calls=[("f", '{"a": 1}', None), ("g", '{"b": [1, "}"]}', None)]),
    ),
    (
        "keys_in_the_other_order",
        None,
        F,
        ["@tool_call", '{"arguments": {"a":1}, "name": "f"}', "@tool_call_end"],
        [],
        dict(calls=[("f", '{"a": 1}', None)]),
    ),
    (
        "call_not_closed_at_end",
        None,
        F,
        ["@tool_call", '{"name": "f", "arguments": {"a": 1', "@assistant_end"],
        [("tool_call_not_closed", 0)],
        dict(calls=[("f", '{"a": 1', "tool_call_not_closed")]),
    ),
    (
        "call_not_closed_when_stopped",
        None,
        F,
        ["@tool_call", '{"name": "f", "argu'],
        [("tool_call_not_closed", 0)],
        dict(calls=[("", '{"name": "f", "argu', "tool_call_not_closed")]),
    ),
    (
        "new_call_before_close",
        None,
        F,
        [
            "@tool_call",
            '{"name": "f", "arguments": {',
            "@tool_call",
            '{"name": "g", "arguments": {}}',
            "@tool_call_end",
        ],
        [("tool_call_not_closed", 0)],
        dict(calls=[("f", "{", "tool_call_not_closed"), ("g", "{}", None)]),
    ),
    (
        "text_after_tool_call",
        None,
        F,
        ["@tool_call", CALL, "@tool_call_end", "\n", "oops", "@assistant_end"],
        [("text_after_tool_call", None)],
        dict(content="\noops", calls=[("f", '{"a": 1}', None)]),
    ),
    (
        "blank_after_tool_call_is_dropped",
        None,
        F,
        ["@tool_call", CALL, "@tool_call_end", " \n", "@assistant_end"],
        [],
        dict(content="", calls=[("f", '{"a": 1}', None)]),
    ),
    (
        "unexpected_role_token",
        None,
        None,
        ["a", "@user", "b", "@think_end", "c", "@assistant_end"],
        [("unexpected_token", None), ("unexpected_token", None)],
        dict(content="abc"),
    ),
    (
        "think_when_thinking_is_off",
        None,
        None,
        ["@think", "x", "@assistant_end"],
        [("unexpected_token", None)],
        dict(reasoning=None, content="x"),
    ),
    (
        "tokens_after_end",
        None,
        None,
        ["done", "@assistant_end", "more", "@user", "x"],
        [("token_after_end", None)],
        dict(content="done"),
    ),
    ("end_of_text_ends_the_turn", None, None, ["ok", "@end_of_text"], [], dict(content="ok")),
    (
        "invalid_token_ids",
        None,
        None,
        ["a", -1, 4096, 10**9, "b"],
        [("invalid_token_id", None)] * 3,
        dict(content="ab"),
    ),
]


@pytest.mark.parametrize(
    ("name", "tier", "tools", "pieces", "errors", "expect"), CASES, ids=[c[0] for c in CASES]
)
def test_documented_deltas(tok, name, tier, tools, pieces, errors, expect):
    token_ids = ids(tok, *pieces)
    finish = not any(p in ("@assistant_end", "@end_of_text") for p in pieces)
    deltas, parser = stream(tok, token_ids, finish=finish, tier=tier, tools=tools)
    assert codes(deltas) == errors
    turn = parser.result()
    assert turn == parse_turn(tok, token_ids, tier=tier, tools=tools, seed=0)
    if "reasoning" in expect:
        assert turn.reasoning == expect["reasoning"]
    if "content" in expect:
        assert turn.content == expect["content"]
    if "calls" in expect:
        assert [(c.name, c.arguments, c.error) for c in turn.tool_calls] == expect["calls"]
        assert [c.index for c in turn.tool_calls] == list(range(len(expect["calls"])))
    check_delta_grammar(deltas)


def check_delta_grammar(deltas):
    """Every started call ends; its argument fragments and errors come between; texts are non-empty."""
    open_call, seen = None, []
    for d in deltas:
        if isinstance(d, ToolCallStart):
            assert open_call is None and d.index == len(seen) and d.id.startswith("call_")
            open_call = d.index
            seen.append(d.id)
        elif isinstance(d, ToolCallArgs):
            assert d.index == open_call and d.text
        elif isinstance(d, ToolCallEnd):
            assert d.index == open_call
            open_call = None
        elif isinstance(d, ErrorDelta):
            assert d.index is None or d.index == open_call
        else:
            assert d.text and open_call is None
    assert open_call is None and len(set(seen)) == len(seen)


def test_every_documented_error_code_is_produced():
    documented = set(re.findall(r"^  ([a-z_]+) ", parser_module.__doc__, re.M))
    produced = {code for case in CASES for code, _ in case[4]}
    assert documented == produced


def test_a_call_streams_before_it_closes(tok):
    parser = StreamParser(tok, tools=F, seed=0)
    head = parser.feed(ids(tok, "@tool_call", '{"name": "f", "arguments": {"path": "/tmp/x'))
    assert head[0] == ToolCallStart(0, head[0].id, "f")
    assert "".join(d.text for d in head if isinstance(d, ToolCallArgs)) == '{"path": "/tmp/x'
    tail = parser.feed(ids(tok, '"}}', "@tool_call_end"))
    assert "".join(d.text for d in tail if isinstance(d, ToolCallArgs)) == '"}'  # the last } is the call's
    assert tail[-1] == ToolCallEnd(0)


def test_split_multibyte_characters_are_never_emitted_broken(tok):
    table = byte_tokens(tok)
    s = "é😀你"
    token_ids = [table[bytes([b])] for b in s.encode()]  # one token per byte
    parser = StreamParser(tok)
    out = [parser.feed(t) for t in token_ids]
    texts = ["".join(d.text for d in ds) for ds in out]
    assert "".join(texts) == s and "\ufffd" not in "".join(texts)
    # The text appears only when the character's last byte arrives.
    assert [i for i, t in enumerate(texts) if t] == [1, 5, 8]


def test_invalid_utf8_becomes_replacement_characters(tok):
    table = byte_tokens(tok)
    token_ids = [table[b"a"], table[b"\xe4"], table[b"\xbd"], tok.special.assistant_end]  # "你" cut short
    deltas, parser = stream(tok, token_ids, finish=False)
    assert parser.result().content == "a\ufffd"
    assert parser.result() == parse_turn(tok, token_ids, seed=0)


def test_parse_turn_result_and_message(tok):
    turn = parse_turn(
        tok, ids(tok, "r", "@think_end", "@tool_call", CALL, "@tool_call_end"), tier="high", seed=3
    )
    msg = turn.to_message()
    assert msg["content"] is None and msg["reasoning_content"] == "r" and msg["thinking_tier"] == "high"
    assert msg["tool_calls"] == [
        {"id": turn.tool_calls[0].id, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert parse_turn(tok, ids(tok, "x"), seed=3).to_message()["thinking_tier"] == "off"
    # Ids are random without a seed and reproducible with one.
    again = parse_turn(
        tok, ids(tok, "r", "@think_end", "@tool_call", CALL, "@tool_call_end"), tier="high", seed=3
    )
    assert again.tool_calls[0].id == turn.tool_calls[0].id
    assert len(turn.tool_calls[0].id) == len("call_") + 24


def test_feeding_after_finish_and_bad_arguments(tok):
    parser = StreamParser(tok)
    parser.feed(ids(tok, "a"))
    parser.finish()
    assert parser.done and parser.finish() == []
    assert codes(parser.feed(ids(tok, "b"))) == [("token_after_end", None)]
    assert codes(parser.feed(["x", None])) == []  # after the end everything is ignored, reported once
    assert codes(StreamParser(tok).feed(["x", 1.5])) == [("invalid_token_id", None)] * 2
    with pytest.raises(ValueError, match="tier"):
        StreamParser(tok, tier="medium")


# A turn is a list of pieces: text, raw bytes (possibly invalid UTF-8), special tokens, odd ids.
SPECIAL_NAMES = ["@think", "@think_end", "@tool_call", "@tool_call_end", "@assistant_end", "@user", "@image"]
FRAGMENTS = [
    CALL,
    '{"name": "g", "arguments": {"s": "a\\"}{b", "n": [1, {"x": null}]}}',
    '{"name": "f", "arguments": ',
    '{"name": "\\u00e9", "arguments": {}}',
    '{"name": "f\\x", "arguments": {}}',
    '{"arguments": {}, "name": "g"}',
    "}",
    "{",
    " ",
    "\n",
    '"',
    "[",
    "]",
    '{"name": "h", "arguments": 5}',
]
piece = st.one_of(
    text,
    st.sampled_from(FRAGMENTS),
    st.sampled_from(SPECIAL_NAMES),
    st.binary(min_size=1, max_size=4),
    st.sampled_from([-5, 4096]),
)
# Runs of pieces shaped like a real turn, so that most generated turns hold sound calls too.
call_block = st.tuples(
    st.just("@tool_call"),
    st.one_of(st.sampled_from(FRAGMENTS[:5]), st.sampled_from(FRAGMENTS[:5]), text),
    st.sampled_from(["@tool_call_end", "@tool_call_end", "@tool_call_end", ""]),
).map(lambda t: [p for p in t if p])
segment = st.one_of(
    piece.map(lambda p: [p]),
    call_block,
    call_block,
    st.tuples(text, st.just("@think_end")).map(list),
)


def turn_ids(tok, table, pieces, cut_points):
    out = []
    for p, cuts in zip(pieces, cut_points, strict=True):
        if isinstance(p, bytes):
            out += retokenize(tok, table, p, cuts)
        elif isinstance(p, int):
            out.append(p)
        elif is_special(p):
            out.append(getattr(tok.special, p[1:]))
        else:
            out += retokenize(tok, table, p.encode(), cuts)
    return out


@st.composite
def turns(draw):
    pieces = [p for seg in draw(st.lists(segment, max_size=8)) for p in seg]
    cuts = [draw(st.lists(st.integers(0, 64), max_size=6)) for _ in pieces]
    return pieces, cuts


@chat_settings
@given(turns(), st.sampled_from([None, "high"]), st.booleans(), st.data())
def test_streaming_equals_whole_turn_parse_for_any_split(tok, case, tier, offer_tools, data):
    table = byte_tokens(tok)
    pieces, cuts = case
    token_ids = turn_ids(tok, table, pieces, cuts)
    tools = F if offer_tools else None
    whole = parse_turn(tok, token_ids, tier=tier, tools=tools, seed=1)
    # Feed in random chunks (one id, several, none).
    bounds = sorted(data.draw(st.lists(st.integers(0, len(token_ids)), max_size=len(token_ids) + 2)))
    parser, deltas = StreamParser(tok, tier=tier, tools=tools, seed=1), []
    for a, b in itertools.pairwise([0, *bounds, len(token_ids)]):
        deltas += parser.feed(token_ids[a:b])
    deltas += parser.finish()
    assert parser.result() == whole
    assert ParsedTurn.from_deltas(deltas, tier) == whole
    check_delta_grammar(deltas)
    # Replacement characters only where the input had invalid UTF-8.
    if not any(isinstance(p, bytes) for p in pieces):
        out = (
            (whole.reasoning or "") + whole.content + "".join(c.name + c.arguments for c in whole.tool_calls)
        )
        assert out.count("\ufffd") <= sum(p.count("\ufffd") for p in pieces if isinstance(p, str))


def test_streaming_equals_whole_turn_parse_for_every_split_of_a_short_turn(tok):
    """Exhaustive: a turn whose tokens cut characters in the reasoning and in a call's arguments;
    every way of grouping its ids into feed() calls (2^(n-1) of them) gives the whole-turn result."""
    table = byte_tokens(tok)
    call = '{"name":"f","arguments":{"é":1}}'
    cut = call.encode().index("é".encode()) + 1
    token_ids = turn_ids(tok, table, ["é", "@tool_call", call], [[1], [], [cut]])
    assert len(token_ids) == 15
    whole = parse_turn(tok, token_ids, tier="high", tools=F, seed=2)
    assert whole.reasoning == "é" and whole.tool_calls[0].arguments == '{"é":1}'
    assert [e.code for e in whole.errors] == ["tool_call_in_thinking", "tool_call_not_closed"]
    n = len(token_ids)
    for mask in range(2 ** (n - 1)):
        parser = StreamParser(tok, tier="high", tools=F, seed=2)
        start = 0
        for i in range(1, n):
            if mask >> (i - 1) & 1:
                parser.feed(token_ids[start:i])
                start = i
        parser.feed(token_ids[start:])
        parser.finish()
        assert parser.result() == whole, mask


def test_stream_emits_reasoning_and_text_deltas_as_they_come(tok):
    deltas, _ = stream(tok, ids(tok, "abc def", "@think_end", "ghi"), tier="low")
    assert kinds(deltas) == ["ReasoningDelta", "TextDelta"]
    assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == "abc def"
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "ghi"
