"""Properties over generated histories: render -> the model's tokens -> parse gives the message back,
and rendering is prefix-stable (history + reply == prompt + reply tokens)."""

from __future__ import annotations

from chat_strategies import assistant, chat_settings, history, tools_for
from hypothesis import given
from hypothesis import strategies as st

from horizon.chat import StreamParser, canonical_arguments, parse_turn

tiers = st.sampled_from([None, "low", "high", "max"])


@st.composite
def chat_and_reply(draw):
    tier = draw(tiers)
    msgs = draw(history())
    reply = draw(assistant(thinking=tier is not None))
    return msgs, tier, reply


@chat_settings
@given(chat_and_reply(), st.booleans())
def test_render_generate_parse_round_trip_and_prefix_stability(tok, template, case, offer_tools):
    msgs, tier, reply = case
    calls = reply.get("tool_calls", [])
    tools = tools_for([c["function"]["name"] for c in calls] + ["unused"]) if offer_tools else None

    prompt = template.render(msgs, tools=tools, tier=tier, add_generation_prompt=True).ids
    full = template.render([*msgs, reply], tools=tools, tier=tier)
    generated = template.reply_ids(reply)
    # Prefix stability: the history plus the reply is the prompt followed by the generated tokens.
    assert full.ids == prompt + generated
    assert full.assistant_mask[len(prompt) :] == [True] * len(generated)

    # The model "generates" exactly those tokens; parsing them gives the message back.
    turn = parse_turn(tok, generated, tier=tier, tools=tools, seed=7)
    assert turn.errors == []
    assert turn.reasoning == reply.get("reasoning_content")
    assert turn.content == (reply["content"] or "")
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        (c["function"]["name"], canonical_arguments(c["function"]["arguments"])[0]) for c in calls
    ]
    assert all(c.error is None for c in turn.tool_calls)
    assert len({c.id for c in turn.tool_calls}) == len(calls)

    # Streaming token by token gives the same turn.
    parser = StreamParser(tok, tier=tier, tools=tools, seed=7)
    for t in generated:
        parser.feed(t)
    parser.finish()
    assert parser.result() == turn

    # The parsed message sent back by a client re-renders to the same tokens (next-turn prefix reuse).
    assert template.render([*msgs, turn.to_message()], tools=tools, tier=tier).ids == full.ids


@chat_settings
@given(history(), tiers, st.data())
def test_each_turn_of_a_conversation_starts_with_the_prompt_that_generated_it(template, msgs, tier, data):
    """A conversation as the server returns it (every assistant turn carries ``thinking_tier``):
    whatever the current request's tier, each turn re-renders after exactly the prompt it was
    generated from, so every earlier prompt is a token prefix of the new one."""
    for m in msgs:
        if m["role"] == "assistant":
            on = m.get("reasoning_content") is not None
            m["thinking_tier"] = data.draw(st.sampled_from(["low", "high", "max"])) if on else "off"
    full = template.render(msgs, tier=tier).ids
    for k, m in enumerate(msgs):
        if m["role"] == "assistant":
            turn_tier = None if m["thinking_tier"] == "off" else m["thinking_tier"]
            head = template.render(msgs[:k], tier=turn_tier, add_generation_prompt=True).ids
            assert full[: len(head) + len(template.reply_ids(m))] == head + template.reply_ids(m)
