"""Grammar-constrained decoding: JSON-schema answers, json_object, strict tool arguments, forced tool calls.

A `ConstraintSpec` says what the answer must be; `Grammars.compile` turns it into an llguidance
grammar over our tokenizer (compiled once per distinct spec, LRU-cached); each request gets a
copy of the compiled matcher, which yields the set of allowed next tokens as a mask. The engine
applies it only once thinking has ended: thinking stays free, the constraint starts where the
answer or the call starts.

The grammar mirrors the chat format (`horizon.chat.template`): an answer is free text and/or
tool calls `<｜tool_call｜>{"name": NAME, "arguments": ARGS}<｜/tool_call｜>`, then
`<｜/assistant｜>`. JSON is emitted compactly (`", "` and `": "` separators, no other whitespace).

Finishing on time: a model is free to keep writing a string forever, and a truncated JSON is
useless to an agent. Inside JSON (a call's arguments, or an answer that must be JSON), in the last
`finish_margin` tokens of max_tokens the mask keeps, when the
grammar allows any of them: the end of a call or of the turn; else, inside a JSON string, its
closing quote; else a closing `}` or `]`; else a comma (the way on when required fields or items
are missing; it also ends a number); else a quote (a string value, rather than opening another
object or array). So outputs complete within the budget unless the schema itself needs more
(many required fields, long enums). Free text (under `auto` with tools, before any call) is not
steered: cutting it short would look like a finished answer, so it runs to max_tokens (`length`).

Why llguidance: it computes masks for our byte-level BPE vocabulary directly (the tokenizer.json
is all it needs), has no Python dependencies, and runs on CPU. xgrammar 0.2.8 needs triton and
transformers, and triton beside flash-linear-attention on a CPU-only machine breaks the CPU
reference tests.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from llguidance import LLMatcher, LLTokenizer

# compact JSON, like json.dumps's defaults: the model writes what the template renders
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """The schema or tool definition cannot be compiled (a client error: HTTP 400 with this message)."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What the answer (after thinking) must be.

    json_schema: the answer text is one JSON value of this schema ({"type": "object"} for json_object);
    tools: ((name, argument schema or None for any JSON object), ...) the calls allowed;
    min_calls: 1 forces a call; max_calls: 1 forbids parallel calls (None: no limit);
    text: free text may precede the calls (ignored with json_schema: then it is JSON or calls).
    """

    json_schema: str | None = None  # JSON text (hashable)
    tools: tuple[tuple[str, str | None], ...] = ()
    min_calls: int = 0
    max_calls: int | None = None
    text: bool = True

    @property
    def free_text(self) -> bool:
        """The answer may be plain text (calls optional): nothing structured is owed when the budget runs out."""
        return self.json_schema is None and self.text and self.min_calls == 0

    @classmethod
    def for_json(cls, schema: dict[str, Any] | None = None) -> ConstraintSpec:
        return cls(json_schema=json.dumps(schema if schema is not None else {"type": "object"}, sort_keys=True))

    @classmethod
    def for_tools(cls, tools: list[tuple[str, dict[str, Any] | None]], required: bool = False,
                  parallel: bool = True, text: bool = True, json_schema: dict[str, Any] | None = None
                  ) -> ConstraintSpec:
        return cls(json_schema=json.dumps(json_schema, sort_keys=True) if json_schema is not None else None,
                   tools=tuple((n, json.dumps(s, sort_keys=True) if s is not None else None) for n, s in tools),
                   min_calls=1 if required else 0, max_calls=None if parallel else 1, text=text and not required)


def _literal(text: str) -> str:
    """A Lark string literal (JSON escapes are valid Lark escapes)."""
    return json.dumps(text)


def _json_rule(schema_text: str | None) -> str:
    schema = json.loads(schema_text) if schema_text is not None else {"type": "object"}
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
    schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_STYLE}}
    return "%json" + json.dumps(schema)


class Grammars:
    """Compiles ConstraintSpecs for one tokenizer and hands out per-request matchers."""

    def __init__(self, tokenizer, cache_size: int = 256):
        sp = tokenizer.special
        self.vocab_size = tokenizer.vocab_size
        self.tool_call, self.tool_call_end, self.end = sp.tool_call, sp.tool_call_end, sp.assistant_end
        self.ll = LLTokenizer(tokenizer.to_str(), n_vocab=tokenizer.vocab_size, eos_token=sp.assistant_end)
        self._cache: OrderedDict[ConstraintSpec, LLMatcher] = OrderedDict()
        self.cache_size, self.compiled = cache_size, 0
        self._lock = threading.Lock()  # requests are prepared on worker threads; the engine thread copies too
        self.token_bytes = [tokenizer.token_bytes(t) or b"" for t in range(tokenizer.vocab_size)]

        def tokens_of(*texts: bytes) -> torch.Tensor:
            mask = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
            mask[[t for t, b in enumerate(self.token_bytes) if b in texts]] = True
            return mask

        ends = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
        ends[[sp.tool_call_end, sp.assistant_end]] = True
        # finishing preferences, strongest first (see the module docstring)
        self.closers = (ends, tokens_of(b'"'), tokens_of(b"}", b"]"), tokens_of(b",", b", "))

    def lark(self, spec: ConstraintSpec) -> str:
        """The grammar text (llguidance's Lark dialect; special tokens as <[id]>)."""
        rules = []
        calls = ""
        if spec.tools:
            bodies = []
            for i, (name, schema) in enumerate(spec.tools):
                head = _literal('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
                args = _json_rule(schema)
                rules.append(f'call_{i}: <[{self.tool_call}]> {head} {args} "}}" <[{self.tool_call_end}]>')
                bodies.append(f"call_{i}")
            rules.append("call: " + " | ".join(bodies))
            if spec.max_calls == 1:
                calls = "call" if spec.min_calls else "call?"
            else:
                calls = "call+" if spec.min_calls else "call*"
        if spec.json_schema is not None:
            rules.append(f"answer_json: {_json_rule(spec.json_schema)}")
            if spec.tools:
                many = "call" if spec.max_calls == 1 else "call+"
                body = f"(answer_json | {many})"
            else:
                body = "answer_json"
        elif spec.tools:
            body = f"TEXT? {calls}" if spec.text else calls
            rules.append("TEXT: /(?s:.+)/")
        else:
            raise ConstraintError("a constraint needs a JSON schema or tools")
        return "\n".join([f"start: {body} <[{self.end}]>", *rules]) + "\n"

    def matcher(self, spec: ConstraintSpec) -> LLMatcher:
        """A fresh matcher for one request (a copy of the cached, compiled one)."""
        with self._lock:
            compiled = self._cache.get(spec)
        if compiled is None:  # compiled outside the lock: a slow grammar holds up no other request
            try:
                grammar = LLMatcher.grammar_from_lark(self.lark(spec))
            except ValueError as e:
                raise ConstraintError(f"invalid schema: {e}") from None
            error = LLMatcher.validate_grammar(grammar, self.ll)
            compiled = None if error else LLMatcher(self.ll, grammar, log_level=0)
            if compiled is None or compiled.is_error():
                raise ConstraintError(f"unsupported or invalid schema: {_reason(error or compiled.get_error())}")
            with self._lock:
                self._cache[spec] = compiled
                self.compiled += 1
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
        return compiled.deep_copy()

    def allowed(self, matcher: LLMatcher, vocab_size: int, finishing: bool = False,
                in_string: bool = False) -> torch.Tensor:
        """Bool mask [vocab_size] of the tokens the grammar allows next (ids past the tokenizer: never)."""
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        mask = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[: self.vocab_size].bool()
        if finishing:
            ends, quote, brackets, comma = self.closers
            # outside a string a quote starts the shortest value (an empty string) instead of a nested one
            for prefer in (ends, quote) if in_string else (ends, brackets, comma, quote):
                closing = mask & prefer
                if bool(closing.any()):
                    mask = closing
                    break
        if vocab_size > self.vocab_size:
            mask = torch.cat((mask, torch.zeros(vocab_size - self.vocab_size, dtype=torch.bool)))
        return mask


def _reason(error: str) -> str:
    """llguidance's first line, without the grammar excerpt it appends (the client never wrote a grammar)."""
    line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return line.split("failed to compile JSON schema: ", 1)[-1]


class JsonScan:
    """Where the JSON written so far stands: inside a string or not, how deeply nested, past a call or not."""

    def __init__(self):
        self.reset()
        self.after_call = False

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == 0x5C:  # backslash
                    self.escaped = True
                elif byte == 0x22:  # quote
                    self.in_string = False
            elif byte == 0x22:
                self.in_string = True
            elif byte in (0x7B, 0x5B):  # { [
                self.depth += 1
            elif byte in (0x7D, 0x5D) and self.depth:  # } ]
                self.depth -= 1

    def reset(self) -> None:
        """A special token: outside any string (a call starts or ends)."""
        self.in_string = self.escaped = False
        self.depth = 0
        self.after_call = True  # only calls or the end may follow a call: a structured answer from here on


def finishing(tokens_left: int, max_tokens: int, scan: JsonScan) -> bool:
    """Time to steer toward closing: a third of the budget (at least 12, at most 64 tokens) plus two
    tokens per open bracket (its closer, and a separator or required key on the way out)."""
    return tokens_left <= max(12, min(64, max_tokens // 3)) + 2 * scan.depth
