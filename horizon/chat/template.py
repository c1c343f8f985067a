"""The chat template: messages, tool definitions and a thinking tier to token ids.

Layout (special tokens are ``<｜...｜>``; nothing else is added, not even newlines, so every text
field round-trips exactly through render and parse):

    <｜system｜>{system text}<｜/system｜>                 (each system message, in place)
    <｜tools｜>{function JSON}\\n{function JSON}<｜/tools｜>  (after the leading system messages)
    <｜user｜>{text, <｜image｜> x n per image}<｜/user｜>
    <｜assistant｜><｜tier_T｜><｜think｜>{reasoning}<｜/think｜>{content}
        <｜tool_call｜>{"name": NAME, "arguments": ARGS}<｜/tool_call｜> ... <｜/assistant｜>
    <｜tool｜>{result}<｜/tool｜>                          (right after the turn that made the call)
    generation prompt: <｜assistant｜><｜tier_T｜><｜think｜>   (<｜assistant｜><｜tier_off｜> when off)

The model generates everything after the generation prompt, ending with ``<｜/assistant｜>``.

Prefix stability. The tier is stated next to the generation prompt, never in the system preamble,
and a historic assistant turn renders exactly the prompt it was generated from followed by what
was generated, so ``render(history + [reply]) == render(history, add_generation_prompt=True) +
reply_ids``; the engine can resume from the cached prefix. This holds when the model's tokens are
the canonical encoding of its text; when a model emits another segmentation of the same text, a
re-render differs from that point of the turn on and only the prefix before it is reusable.

Which tier a historic turn states (the OpenAI message does not carry it):
  * ``reasoning_content`` null: the turn was made with thinking off: ``<｜tier_off｜>``, no think
    block (whatever ``thinking_tier`` says; the history validator reports turns that lost their
    thinking);
  * otherwise the Horizon extension field ``thinking_tier`` on the message, if present;
  * otherwise the request's tier, or ``high`` when the request has thinking off.
So when a client changes tier between turns without echoing ``thinking_tier`` back, the earlier
turns re-render under the new tier; the cached prefix then ends at the first such turn's tier token
and the engine re-prefills from there. Servers return ``thinking_tier`` on every assistant message so
that clients sending messages back verbatim keep exact prefixes.

Tool calls: the model writes ``{"name": NAME, "arguments": ARGS}`` with NAME as
``json.dumps(name, ensure_ascii=False)`` and ARGS the arguments JSON (see
``messages.canonical_arguments``: a client's arguments string is re-rendered byte for byte).
Tool results follow the turn that made the calls, in the order of the calls they answer (results
whose id matches no call of that turn keep their place after them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from horizon.chat.messages import Image, Message, normalize_messages, normalize_tools
from horizon.chat.thinking import Tier, check_tier
from horizon.chat.tokenizer import HorizonTokenizer

# The tier a historic thinking turn states when neither it nor the request says one (request off).
HISTORY_TIER_WHEN_OFF: Tier = "high"


def tool_call_text(name: str, arguments: str) -> str:
    """The JSON text of one call, exactly as the model is trained to write it."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + arguments + "}"


def one_image_token(part: Mapping[str, Any]) -> int:
    return 1


@dataclass
class Rendered:
    ids: list[int] = field(default_factory=list)
    # True where the model generated the token (assistant turns after their prompt): the SFT loss mask.
    assistant_mask: list[bool] = field(default_factory=list)
    # The image parts, in the order of their placeholder runs in ``ids``.
    images: list[Mapping[str, Any]] = field(default_factory=list)
    # Where the leading system prompts and tool definitions end, and where each later block ends (a turn, a
    # reply, a tool result): positions a prefix cache can resume from when histories branch.
    preamble_end: int = 0
    block_ends: list[int] = field(default_factory=list)

    def add(self, ids: Sequence[int], generated: bool = False) -> None:
        self.ids.extend(ids)
        self.assistant_mask.extend([generated] * len(ids))


class ChatTemplate:
    """Renders chats for one tokenizer. ``image_tokens(part)`` says how many placeholders an image takes."""

    def __init__(
        self, tokenizer: HorizonTokenizer, image_tokens: Callable[[Mapping[str, Any]], int] = one_image_token
    ):
        self.tokenizer = tokenizer
        self.special = tokenizer.special
        self.image_tokens = image_tokens
        # The model's turn ends at either; the engine stops on them.
        self.stop_ids = (self.special.assistant_end, self.special.end_of_text)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tier: Tier | None = None,
        add_generation_prompt: bool = False,
    ) -> Rendered:
        """Token ids for a chat. Raises ValueError (``MessageError``) naming the bad message."""
        tier = check_tier(tier)
        msgs = normalize_messages(messages)
        functions = normalize_tools(tools)
        out = Rendered()
        i = 0
        while i < len(msgs) and msgs[i].role == "system":
            self._block(out, self.special.system, msgs[i], self.special.system_end)
            i += 1
        if functions:
            text = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in functions)
            out.add([self.special.tools, *self._encode(text), self.special.tools_end])
        out.preamble_end = len(out.ids)
        while i < len(msgs):
            m = msgs[i]
            i += 1
            if m.role == "system":
                self._block(out, self.special.system, m, self.special.system_end)
            elif m.role == "user":
                self._block(out, self.special.user, m, self.special.user_end)
            elif m.role == "tool":  # a result with no call before it; rendered where it stands
                self._block(out, self.special.tool, m, self.special.tool_end)
            else:
                out.add(self.generation_prompt(self.history_tier(m, tier)))
                out.add(self.reply_ids(m), generated=True)
                out.block_ends.append(len(out.ids))
                j = i
                while j < len(msgs) and msgs[j].role == "tool":
                    j += 1
                for result in self._in_call_order(m, msgs[i:j]):
                    self._block(out, self.special.tool, result, self.special.tool_end)
                    out.block_ends.append(len(out.ids))
                i = j
                continue
            out.block_ends.append(len(out.ids))
        if add_generation_prompt:
            out.add(self.generation_prompt(tier))
        return out

    def generation_prompt(self, tier: Tier | None) -> list[int]:
        """What follows the history when the model is to answer under ``tier`` (None: thinking off).

        With thinking on, ``<｜think｜>`` is part of the prompt: the model always starts by thinking,
        and every generated token up to ``<｜/think｜>`` counts against the tier's budget.
        """
        ids = [self.special.assistant, self.special.tier(check_tier(tier))]
        return ids + [self.special.think] if tier is not None else ids

    def reply_ids(self, message: Message | Mapping[str, Any]) -> list[int]:
        """The tokens the model generates for an assistant message (after its generation prompt)."""
        m = message if isinstance(message, Message) else normalize_messages([message])[0]
        if m.role != "assistant":
            raise ValueError(f"reply_ids takes an assistant message, got role {m.role!r}")
        ids: list[int] = []
        if m.reasoning is not None:
            ids += [*self._encode(m.reasoning), self.special.think_end]
        ids += self._encode(m.text)
        for call in m.tool_calls:
            ids += [self.special.tool_call, *self._encode(tool_call_text(call.name, call.arguments))]
            ids.append(self.special.tool_call_end)
        ids.append(self.special.assistant_end)
        return ids

    @staticmethod
    def history_tier(m: Message, request_tier: Tier | None) -> Tier | None:
        """The tier a historic assistant turn states (see the module docstring)."""
        if m.reasoning is None:
            return None
        if m.thinking_tier is not None and m.thinking_tier != "off":
            return m.thinking_tier  # type: ignore[return-value]
        return request_tier if request_tier is not None else HISTORY_TIER_WHEN_OFF

    @staticmethod
    def _in_call_order(turn: Message, results: list[Message]) -> list[Message]:
        order = {c.id: k for k, c in enumerate(turn.tool_calls) if c.id is not None}
        # sorted() is stable: unmatched results (key len(order)) keep their relative order, last.
        return sorted(results, key=lambda r: order.get(r.tool_call_id, len(order)))

    def _block(self, out: Rendered, begin: int, m: Message, end: int) -> None:
        out.add([begin])
        for part in m.parts:
            if isinstance(part, Image):
                n = self.image_tokens(part.part)
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"image_tokens must return a positive int for each image, got {n!r}")
                out.add([self.special.image] * n)
                out.images.append(part.part)
            else:
                out.add(self._encode(part))
        out.add([end])

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text) if text else []
