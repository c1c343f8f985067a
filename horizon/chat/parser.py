"""Parse one generated assistant turn into reasoning, answer text and tool calls.

``StreamParser`` takes generated ids as they come (one or a few at a time) and returns typed deltas
for a server to forward at once; ``parse_turn`` parses a finished turn in one go. Both drive the
same state machine: the stream decodes UTF-8 incrementally and never emits part of a character,
the whole-turn parse decodes each run of ordinary tokens at once, and the tests check that the two
agree for every way of splitting a turn.

The ids are what follows the generation prompt (see ``template``): with thinking on the turn starts
inside ``<｜think｜>``; it ends at ``<｜/assistant｜>`` or ``<｜end_of_text｜>``, or when the engine
stops (``finish()``).

Deltas: ``ReasoningDelta(text)``, ``TextDelta(text)``, ``ToolCallStart(index, id, name)``,
``ToolCallArgs(index, text)`` (fragments of the arguments JSON; joined they are the call's
``arguments`` string), ``ToolCallEnd(index)``, ``ErrorDelta(code, message, index)``. Every call that
starts also ends. Nothing here raises on model output; problems become ``ErrorDelta``s:

  thinking_not_closed    the turn ended (or stopped) inside thinking; the text is the reasoning
  tool_call_in_thinking  ``<｜tool_call｜>`` inside thinking: thinking ends there, the call is parsed
  tool_call_not_closed   the turn ended, or a new call began, before ``<｜/tool_call｜>``; the call
                         is kept with what arrived
  invalid_tool_call      the call is not ``{"name": <string>, "arguments": <object>}`` JSON; it is
                         kept (name if one could be read, else ""; the arguments or the raw text)
  unknown_tool           the name is not among the request's tools (only checked when tools given)
  text_after_tool_call   non-blank text after a call; kept in the content (whitespace there is
                         dropped without a report)
  unexpected_token       a special token with no meaning at that point; ignored
  token_after_end        tokens after the end of the turn; ignored (reported once)
  invalid_token_id       an id outside the vocabulary; ignored

A call streams early: ``ToolCallStart`` as soon as ``{"name": "...", "arguments": `` has arrived,
then argument fragments while the arguments object is open. A call written another way (e.g. keys
in the other order) is read when it closes, and its arguments are re-serialised.
Malformed UTF-8 becomes U+FFFD.
"""

from __future__ import annotations

import codecs
import json
import operator
import random
import re
import secrets
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from horizon.chat.messages import loads_strict, normalize_tools
from horizon.chat.thinking import Tier, check_tier
from horizon.chat.tokenizer import HorizonTokenizer


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


@dataclass(frozen=True)
class ErrorDelta:
    code: str
    message: str
    index: int | None = None  # the tool call it concerns, if any


Delta = ReasoningDelta | TextDelta | ToolCallStart | ToolCallArgs | ToolCallEnd | ErrorDelta


@dataclass
class ParsedToolCall:
    index: int
    id: str
    name: str
    arguments: str
    error: str | None = None  # the code of the first problem with this call; None if it is sound

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedTurn:
    reasoning: str | None  # None when the turn was generated with thinking off
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    errors: list[ErrorDelta] = field(default_factory=list)
    tier: Tier | None = None

    @classmethod
    def from_deltas(cls, deltas: Iterable[Delta], tier: Tier | None) -> ParsedTurn:
        """Accumulate deltas (a server streaming a turn can keep its result this way)."""
        reasoning, content, calls, errors = [], [], {}, []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                reasoning.append(d.text)
            elif isinstance(d, TextDelta):
                content.append(d.text)
            elif isinstance(d, ToolCallStart):
                calls[d.index] = ParsedToolCall(d.index, d.id, d.name, "")
            elif isinstance(d, ToolCallArgs):
                calls[d.index].arguments += d.text
            elif isinstance(d, ErrorDelta):
                errors.append(d)
                if d.index in calls and calls[d.index].error is None:
                    calls[d.index].error = d.code
        return cls(
            reasoning="".join(reasoning) if tier is not None else None,
            content="".join(content),
            tool_calls=[calls[i] for i in sorted(calls)],
            errors=errors,
            tier=tier,
        )

    def to_message(self) -> dict[str, Any]:
        """The OpenAI assistant message, with ``thinking_tier`` so that it re-renders exactly.

        Broken calls are included as generated (their ``error`` is in ``tool_calls`` / ``errors``
        here); what to tell the client about them is the server's decision.
        """
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not self.tool_calls else None,
            "reasoning_content": self.reasoning,
            "thinking_tier": self.tier or "off",
        }
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def call_id_factory(seed: int | None = None) -> Callable[[], str]:
    """Tool call ids ``call_<24 letters/digits>``: random, or reproducible from ``seed``."""
    alphabet = string.ascii_letters + string.digits
    rng = random.Random(seed) if seed is not None else secrets.SystemRandom()
    return lambda: "call_" + "".join(rng.choice(alphabet) for _ in range(24))


# `{"name": "<string>", "arguments": ` followed by the first character of the arguments.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)', re.DOTALL)
_HEADER_LIMIT = 1024  # the header must end within this many characters (bounds the re-matching)
_TAIL = re.compile(r"\s*\}\s*")  # what may follow the arguments object: the call's closing brace
_DECODER = json.JSONDecoder()


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(loads_strict(text), dict)
    except ValueError:
        return False


_IN_STRING = re.compile(r'[^"\\]*')  # runs the scanner can skip inside a JSON string
_OUTSIDE = re.compile(r'[^"{}\[\]]*')  # ... and outside one


class _Call:
    """One tool call being read. Chunks are kept in lists (arguments can be long: a whole file), and
    the arguments object is scanned once, chunk by chunk, to know where it ends."""

    def __init__(self, index: int):
        self.index = index
        self.name = ""
        self.chunks: list[str] = []  # the whole body, for a call that is read only at its end
        self.head = ""  # the body while the header `{"name": ..., "arguments": ` is awaited
        self.started = False  # ToolCallStart emitted
        self.header_dead = False  # the header can no longer be read; wait for the end
        self.streaming = False  # the arguments are an object, streamed as it arrives
        self.args: list[str] = []  # the streamed arguments text
        self.rest: list[str] = []  # text after the header that is not streamed arguments
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.args_closed = False  # the arguments object's final brace has arrived

    def scan(self, s: str) -> int:
        """Follow the arguments object through ``s``; return how many characters belong to it."""
        i = 0
        while i < len(s) and not self.args_closed:
            if self.escape:
                self.escape = False
                i += 1
            elif self.in_string:
                i = _IN_STRING.match(s, i).end()
                if i < len(s):  # at a backslash (an escape follows) or the closing quote
                    self.escape = s[i] == "\\"
                    self.in_string = self.escape
                    i += 1
            else:
                i = _OUTSIDE.match(s, i).end()
                if i < len(s):
                    ch = s[i]
                    i += 1
                    if ch == '"':
                        self.in_string = True
                    elif ch in "{[":
                        self.depth += 1
                    else:
                        self.depth -= 1
                        self.args_closed = self.depth == 0
        return i


class _TurnMachine:
    """The parser's state: reasoning -> content -> calls, reacting to text and special tokens."""

    def __init__(self, tokenizer: HorizonTokenizer, tier: Tier | None, tools: set[str] | None, new_id):
        self.sp = tokenizer.special
        self.special_text = tokenizer.special_text
        self.tools = tools
        self.new_id = new_id
        self.mode = "reasoning" if tier is not None else "content"  # | "call" | "after_call"
        self.out: list[Delta] = []
        self.call: _Call | None = None
        self.n_calls = 0
        self.blank = ""  # whitespace after a call, held back until we know what follows
        self.done = False
        self._reported_after_end = False

    def drain(self) -> list[Delta]:
        out, self.out = self.out, []
        return out

    def error(self, code: str, message: str, index: int | None = None) -> None:
        self.out.append(ErrorDelta(code, message, index))

    # --- events -------------------------------------------------------------------------------
    def text(self, s: str) -> None:
        if not s:
            return
        if self.mode == "reasoning":
            self.out.append(ReasoningDelta(s))
        elif self.mode == "content":
            self.out.append(TextDelta(s))
        elif self.mode == "call":
            self._call_text(s)
        elif (self.blank + s).isspace():
            self.blank += s
        else:
            self.error("text_after_tool_call", "text after a tool call; kept in the content")
            self.out.append(TextDelta(self.blank + s))
            self.blank, self.mode = "", "content"

    def special(self, tid: int) -> None:
        sp = self.sp
        if tid == sp.think_end and self.mode == "reasoning":
            self.mode = "content"
        elif tid == sp.tool_call:
            if self.mode == "reasoning":
                self.error(
                    "tool_call_in_thinking", "a tool call began before thinking ended; thinking ends there"
                )
            elif self.mode == "call":
                self._end_call(closed=False)
            self.call, self.mode, self.blank = _Call(self.n_calls), "call", ""
            self.n_calls += 1
        elif tid == sp.tool_call_end and self.mode == "call":
            self._end_call(closed=True)
            self.mode = "after_call"
        elif tid in (sp.assistant_end, sp.end_of_text):
            self.finish()
        else:
            self.error(
                "unexpected_token", f"{self.special_text[tid]} (id {tid}) has no meaning here; ignored"
            )

    def invalid_id(self, tid: Any) -> None:
        self.error("invalid_token_id", f"token id {tid!r} is not in the vocabulary; ignored")

    def after_end(self) -> None:
        if not self._reported_after_end:
            self._reported_after_end = True
            self.error("token_after_end", "tokens after the end of the turn; ignored")

    def finish(self) -> None:
        if self.done:
            return
        if self.mode == "reasoning":
            self.error("thinking_not_closed", "the turn ended inside thinking")
        elif self.mode == "call":
            self._end_call(closed=False)
        self.done = True

    # --- tool calls ---------------------------------------------------------------------------
    def _call_text(self, s: str) -> None:
        c = self.call
        if not c.started:
            c.chunks.append(s)
            if c.header_dead:
                return
            c.head += s
            m = _HEADER.match(c.head, 0, _HEADER_LIMIT + 1)
            if m is None:
                c.header_dead = len(c.head) > _HEADER_LIMIT
                return
            try:
                name = loads_strict(m.group(1))
            except ValueError:  # an escape JSON does not have: this header will never read
                c.header_dead = True
                return
            self._start(c, name)
            s, c.head, c.chunks = c.head[m.end() :], "", []
            c.streaming = s[0] == "{"
        if c.streaming and not c.args_closed:
            k = c.scan(s)
            if k:
                c.args.append(s[:k])
                self.out.append(ToolCallArgs(c.index, s[:k]))
            s = s[k:]
        if s:
            c.rest.append(s)

    def _start(self, c: _Call, name: str) -> None:
        c.started, c.name = True, name
        self.out.append(ToolCallStart(c.index, self.new_id(), name))

    def _end_call(self, closed: bool) -> None:
        c, problems = self.call, []
        rest = "".join(c.rest)
        if c.started and c.streaming:
            if not c.args_closed:
                if closed:
                    problems.append("the arguments object is not complete")
            elif not _is_json_object("".join(c.args)):
                problems.append("the arguments are not valid JSON")
            elif not _TAIL.fullmatch(rest):
                problems.append(f"unexpected text after the arguments: {rest[:60]!r}")
        elif c.started:  # the arguments value is not an object; it was not streamed
            try:
                end = _DECODER.raw_decode(rest)[1]
            except ValueError:
                end = len(rest)
            self.out.append(ToolCallArgs(c.index, rest[:end]))
            problems.append("arguments must be a JSON object")
        else:
            name, arguments, problem = self._whole_call("".join(c.chunks))
            self._start(c, name)
            if arguments:
                self.out.append(ToolCallArgs(c.index, arguments))
            if problem:
                problems.append(problem)
        if not closed:
            self.error("tool_call_not_closed", "the tool call ended before <｜/tool_call｜>", c.index)
        elif problems:
            self.error("invalid_tool_call", "; ".join(problems), c.index)
        elif not c.name:
            self.error("invalid_tool_call", "the tool name is empty", c.index)
        if c.name and self.tools is not None and c.name not in self.tools:
            self.error("unknown_tool", f"no tool named {c.name!r} was offered", c.index)
        self.out.append(ToolCallEnd(c.index))
        self.call = None

    @staticmethod
    def _whole_call(body: str) -> tuple[str, str, str | None]:
        """Read a call that did not start with the usual header: (name, arguments, problem)."""
        try:
            obj = loads_strict(body)
        except ValueError:
            return "", body, "the tool call is not valid JSON"
        name = obj.get("name") if isinstance(obj, dict) else None
        name = name if isinstance(name, str) else ""
        if isinstance(obj, dict) and set(obj) == {"name", "arguments"} and isinstance(obj["arguments"], dict):
            return name, json.dumps(obj["arguments"], ensure_ascii=False), None
        return name, body, 'a tool call must be {"name": <string>, "arguments": <object>}'


def _tool_names(tools: Sequence[Mapping[str, Any]] | None) -> set[str] | None:
    return None if tools is None else {fn["name"] for fn in normalize_tools(tools)}


def _as_id(tid: Any, vocab_size: int) -> int | None:
    try:
        i = operator.index(tid)
    except TypeError:
        return None
    return i if 0 <= i < vocab_size else None


class StreamParser:
    """Incremental parser for one assistant turn.

    parser = StreamParser(tok, tier="high", tools=tools)
    for token in generated:
        for delta in parser.feed(token): send(delta)
    for delta in parser.finish(): send(delta)
    message = parser.result().to_message()
    """

    def __init__(
        self,
        tokenizer: HorizonTokenizer,
        *,
        tier: Tier | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        seed: int | None = None,
    ):
        self.tier = check_tier(tier)
        self._tok = tokenizer
        self._m = _TurnMachine(tokenizer, self.tier, _tool_names(tools), call_id_factory(seed))
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._all: list[Delta] = []

    @property
    def done(self) -> bool:
        """The turn has ended (end token seen or finish() called)."""
        return self._m.done

    def feed(self, ids: int | Iterable[int]) -> list[Delta]:
        """Consume generated ids (one id or several); return the deltas they complete."""
        m = self._m
        for tid in ids if isinstance(ids, Iterable) else [ids]:
            if m.done:
                m.after_end()
                continue
            i = _as_id(tid, self._tok.vocab_size)
            piece = self._tok.token_bytes(i) if i is not None else None
            if piece is not None:
                m.text(self._utf8.decode(piece))
                continue
            self._flush()  # a special or invalid id ends the run of text: no character spans it
            if i is None:
                m.invalid_id(tid)
            else:
                m.special(i)
        return self._emit()

    def finish(self) -> list[Delta]:
        """The engine stopped: close whatever is open and return the last deltas."""
        if not self._m.done:
            self._flush()
            self._m.finish()
        return self._emit()

    def result(self) -> ParsedTurn:
        """Everything so far as one turn (complete after finish())."""
        return ParsedTurn.from_deltas(self._all, self.tier)

    def _flush(self) -> None:
        self._m.text(self._utf8.decode(b"", final=True))
        self._utf8.reset()

    def _emit(self) -> list[Delta]:
        out = self._m.drain()
        self._all.extend(out)
        return out


def parse_turn(
    tokenizer: HorizonTokenizer,
    ids: Iterable[int],
    *,
    tier: Tier | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    seed: int | None = None,
) -> ParsedTurn:
    """Parse a whole generated turn: each run of ordinary tokens is decoded at once."""
    tier = check_tier(tier)
    m = _TurnMachine(tokenizer, tier, _tool_names(tools), call_id_factory(seed))
    run = bytearray()
    for tid in ids:
        if m.done:
            m.after_end()
            continue
        i = _as_id(tid, tokenizer.vocab_size)
        piece = tokenizer.token_bytes(i) if i is not None else None
        if piece is not None:
            run += piece
            continue
        m.text(run.decode("utf-8", errors="replace"))
        run.clear()
        if i is None:
            m.invalid_id(tid)
        else:
            m.special(i)
    m.text(run.decode("utf-8", errors="replace"))
    m.finish()
    return ParsedTurn.from_deltas(m.drain(), tier)
