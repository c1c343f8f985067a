"""The chat layer: tokenizer, chat template, streaming output parser and history validation.

It knows no model (no torch): the engine and the servers build on it.

    from horizon.chat import ChatTemplate, StreamParser, load_tokenizer, validate_history

    tok = load_tokenizer()                       # bundled, or a checkpoint folder / tokenizer.json
    template = ChatTemplate(tok)
    issues = validate_history(messages, tier="high")
    prompt = template.render(messages, tools=tools, tier="high", add_generation_prompt=True).ids
    parser = StreamParser(tok, tier="high", tools=tools)
    for token in generated: deltas = parser.feed(token)
    parser.finish(); reply = parser.result().to_message()   # append to messages for the next turn

Files: ``tokenizer`` (vocabulary, special tokens, loader), ``train_tokenizer`` (makes the bundled
vocabulary), ``messages`` (the accepted message shape), ``template`` (rendering; the prefix-stability
and thinking-tier rules are in its docstring), ``parser`` (deltas and error codes), ``history``
(validation policies), ``thinking`` (tiers, default budgets, API mappings).
"""

from horizon.chat.history import POLICIES, HistoryIssue, validate_history
from horizon.chat.messages import MessageError, canonical_arguments
from horizon.chat.parser import (
    Delta,
    ErrorDelta,
    ParsedToolCall,
    ParsedTurn,
    ReasoningDelta,
    StreamParser,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    call_id_factory,
    parse_turn,
)
from horizon.chat.template import ChatTemplate, Rendered, tool_call_text
from horizon.chat.thinking import (
    DEFAULT_THINKING_BUDGETS,
    TIERS,
    Tier,
    check_tier,
    tier_from_budget_tokens,
    tier_from_effort,
    tier_from_reasoning_effort,
)
from horizon.chat.tokenizer import (
    BUNDLED_TOKENIZER,
    SPECIAL_TOKENS,
    HorizonTokenizer,
    SpecialIds,
    bundled_tokenizer,
    load_tokenizer,
)

__all__ = [
    "BUNDLED_TOKENIZER",
    "DEFAULT_THINKING_BUDGETS",
    "POLICIES",
    "SPECIAL_TOKENS",
    "TIERS",
    "ChatTemplate",
    "Delta",
    "ErrorDelta",
    "HistoryIssue",
    "HorizonTokenizer",
    "MessageError",
    "ParsedToolCall",
    "ParsedTurn",
    "ReasoningDelta",
    "Rendered",
    "SpecialIds",
    "StreamParser",
    "TextDelta",
    "Tier",
    "ToolCallArgs",
    "ToolCallEnd",
    "ToolCallStart",
    "bundled_tokenizer",
    "call_id_factory",
    "canonical_arguments",
    "check_tier",
    "load_tokenizer",
    "parse_turn",
    "tier_from_budget_tokens",
    "tier_from_effort",
    "tier_from_reasoning_effort",
    "tool_call_text",
    "validate_history",
]
