"""The chat template: layout, where the tier goes, full history, tool results, images, argument bytes."""

from __future__ import annotations

import json

import pytest

from horizon.chat import SPECIAL_TOKENS, ChatTemplate, MessageError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CHAT = [
    {"role": "system", "content": "You are Horizon."},
    {"role": "user", "content": "Weather in Beijing?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Call the tool.",
        "tool_calls": [call("call_1", "get_weather", '{"city": "Beijing"}')],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 25}'},
    {"role": "assistant", "content": "Sunny, 25°C.", "reasoning_content": "It is warm."},
]


def test_two_turn_tool_chat_renders_in_the_documented_layout(tok, template):
    rendered = template.render(CHAT, tools=TOOLS, tier="high")
    assert tok.decode(rendered.ids) == (
        "<｜system｜>You are Horizon.<｜/system｜>"
        '<｜tools｜>{"name": "get_weather", "description": "Weather for a city", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}<｜/tools｜>'
        "<｜user｜>Weather in Beijing?<｜/user｜>"
        "<｜assistant｜><｜tier_high｜><｜think｜>Call the tool.<｜/think｜>"
        '<｜tool_call｜>{"name": "get_weather", "arguments": {"city": "Beijing"}}<｜/tool_call｜>'
        "<｜/assistant｜>"
        '<｜tool｜>{"temp": 25}<｜/tool｜>'
        "<｜assistant｜><｜tier_high｜><｜think｜>It is warm.<｜/think｜>Sunny, 25°C.<｜/assistant｜>"
    )
    # Special tokens appear only as the template's ids, never from the text inside.
    specials = [i for i in rendered.ids if tok.is_special(i)]
    assert len(specials) == 20


@pytest.mark.parametrize("tier", [None, "low", "high", "max"])
def test_tier_is_stated_at_the_generation_prompt_not_in_the_preamble(tok, template, tier):
    sp = tok.special
    ids = template.render(CHAT[:2], tools=TOOLS, tier=tier, add_generation_prompt=True).ids
    expected_tail = [sp.assistant, sp.tier(tier)] + ([sp.think] if tier else [])
    assert ids[-len(expected_tail) :] == expected_tail
    tier_ids = {sp.tier_off, sp.tier_low, sp.tier_high, sp.tier_max}
    assert [i for i in ids if i in tier_ids] == [sp.tier(tier)]
    # The preamble is the same whatever the tier.
    assert template.render(CHAT[:2], tools=TOOLS, tier=tier).ids == template.render(CHAT[:2], tools=TOOLS).ids


def turn_tiers(tok, ids):
    sp = tok.special
    names = {sp.tier_off: None, sp.tier_low: "low", sp.tier_high: "high", sp.tier_max: "max"}
    return [names[b] for a, b in zip(ids, ids[1:], strict=False) if a == sp.assistant]


def test_historic_turn_tier_rules(tok, template):
    u = {"role": "user", "content": "hi"}
    with_ext = {"role": "assistant", "content": "a", "reasoning_content": "r", "thinking_tier": "max"}
    plain = {"role": "assistant", "content": "b", "reasoning_content": "r"}
    off = {"role": "assistant", "content": "c", "reasoning_content": None, "thinking_tier": "low"}
    ext_off = {"role": "assistant", "content": "d", "thinking_tier": "off"}
    msgs = [u, with_ext, u, plain, u, off, u, ext_off]
    # Extension wins; else the request's tier; no reasoning means thinking off (and no think block).
    assert turn_tiers(tok, template.render(msgs, tier="low").ids) == ["max", "low", None, None]
    # With the request off, a thinking turn of unknown tier states "high".
    assert turn_tiers(tok, template.render(msgs, tier=None).ids) == ["max", "high", None, None]
    ids = template.render([u, off], tier="high").ids
    assert tok.special.think not in ids and tok.special.think_end not in ids


def test_every_assistant_turn_keeps_its_thinking_text_and_calls(tok, template):
    turns = []
    for k in range(4):
        turns += [
            {"role": "user", "content": f"q{k}"},
            {
                "role": "assistant",
                "content": f"a{k}",
                "reasoning_content": f"thought {k}",
                "tool_calls": [call(f"c{k}", "get_weather", {"city": f"c{k}"})],
            },
            {"role": "tool", "tool_call_id": f"c{k}", "content": f"r{k}"},
        ]
    text_ = tok.decode(template.render(turns, tier="high").ids)
    for k in range(4):
        assert (
            f"<｜think｜>thought {k}<｜/think｜>a{k}<｜tool_call｜>"
            f'{{"name": "get_weather", "arguments": {{"city": "c{k}"}}}}<｜/tool_call｜><｜/assistant｜>'
            f"<｜tool｜>r{k}<｜/tool｜>"
        ) in text_


def test_tool_results_follow_their_turn_in_call_order(tok, template):
    msgs = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("A", "f", {}), call("B", "g", {}), call("C", "h", {})],
        },
        {"role": "tool", "tool_call_id": "C", "content": "rc"},
        {"role": "tool", "tool_call_id": "X", "content": "rx"},
        {"role": "tool", "tool_call_id": "A", "content": "ra"},
        {"role": "tool", "tool_call_id": "B", "content": "rb"},
    ]
    text_ = tok.decode(template.render(msgs).ids)
    assert text_.endswith(
        "<｜tool｜>ra<｜/tool｜><｜tool｜>rb<｜/tool｜><｜tool｜>rc<｜/tool｜><｜tool｜>rx<｜/tool｜>"
    )


def test_arguments_render_as_the_exact_bytes_the_client_sent(tok, template):
    def rendered_call(arguments):
        msg = {"role": "assistant", "content": None, "tool_calls": [call("c", "f", arguments)]}
        text_ = tok.decode(template.reply_ids(msg))
        return text_[
            text_.index('"arguments": ') + len('"arguments": ') : text_.index("<｜/tool_call｜>") - 1
        ]

    assert rendered_call('{"b":1,"a":[1.50, "x"]}') == '{"b":1,"a":[1.50, "x"]}'  # valid JSON: byte for byte
    assert rendered_call('\n {"a": 1} \t') == '{"a": 1}'  # JSON whitespace around it is not part of it
    assert rendered_call({"b": 1, "a": "é"}) == '{"b": 1, "a": "é"}'  # an object: json.dumps, order kept
    assert rendered_call("") == rendered_call(None) == "{}"
    assert rendered_call("{not json") == "{not json"  # rendered as sent (history validation reports it)


def test_images_become_placeholders_with_a_count_hook(tok):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    other = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "see"}, image, {"type": "text", "text": "and"}, other],
        }
    ]
    rendered = ChatTemplate(tok).render(msgs)
    assert tok.decode(rendered.ids) == "<｜user｜>see<｜image｜>and<｜image｜><｜/user｜>"
    counts = {"AAAA": 3, "BBBB": 2}
    rendered = ChatTemplate(tok, image_tokens=lambda p: counts[p["image_url"]["url"][-4:]]).render(msgs)
    assert rendered.ids.count(tok.special.image) == 5 and rendered.images == [image, other]
    with pytest.raises(ValueError, match="positive int"):
        ChatTemplate(tok, image_tokens=lambda p: 0).render(msgs)
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        ChatTemplate(tok).render([{"role": "assistant", "content": [image]}])


def test_content_cannot_inject_roles(tok, template):
    evil = "".join(SPECIAL_TOKENS.values())
    msgs = [
        {"role": "system", "content": evil},
        {"role": "user", "content": [{"type": "text", "text": evil}]},
        {
            "role": "assistant",
            "content": evil,
            "reasoning_content": evil,
            "tool_calls": [call("c", evil, {evil: evil})],
        },
        {"role": "tool", "tool_call_id": "c", "content": evil},
    ]
    plain = json.loads(json.dumps(msgs).replace(json.dumps(evil)[1:-1], "x"))
    specials = lambda m: [i for i in template.render(m, tier="high").ids if tok.is_special(i)]  # noqa: E731
    assert specials(msgs) == specials(plain)
    assert tok.decode(template.render(msgs, tier="high").ids).count(evil) == 8


def test_assistant_mask_marks_exactly_the_generated_tokens(template):
    rendered = template.render(CHAT, tools=TOOLS, tier="high")
    generated = [i for i, m in zip(rendered.ids, rendered.assistant_mask, strict=True) if m]
    assert generated == template.reply_ids(CHAT[2]) + template.reply_ids(CHAT[4])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "robot", "content": "x"}], r"messages\[0\]: unknown role 'robot'"),
        ([{"content": "x"}], r"messages\[0\]: role must be one of"),
        ([{"role": "user"}], r"messages\[0\]: a user message needs content"),
        ([{"role": "user", "content": 3}], "content must be a string or a list of parts"),
        ([{"role": "user", "content": [{"type": "audio"}]}], r"content\[0\] must be a part with type in"),
        ([{"role": "tool", "content": "x"}], "needs tool_call_id"),
        ([{"role": "assistant", "content": "x", "tool_calls": {}}], "tool_calls must be a list"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}],
            "name must be a non-empty string",
        ),
        (
            [{"role": "assistant", "tool_calls": [call("c", "f", 5)]}],
            "arguments must be a JSON string or an object",
        ),
        (
            [{"role": "assistant", "tool_calls": [call("c", "f", {"x": float("nan")})]}],
            "not JSON-serialisable",
        ),
        ([{"role": "assistant", "content": "x", "thinking_tier": "medium"}], "thinking_tier must be one of"),
        (
            [{"role": "assistant", "content": "x", "reasoning_content": "r", "thinking_tier": "off"}],
            "is 'off'",
        ),
        ([{"role": "assistant", "reasoning_content": "a", "reasoning": "b"}], "both set and differ"),
        ("not a list", "messages must be a list"),
    ],
)
def test_bad_messages_are_value_errors_naming_the_message(template, messages, match):
    with pytest.raises(ValueError, match=match):
        template.render(messages)


def test_bad_tools_and_tiers_are_value_errors(template):
    with pytest.raises(ValueError, match="tier 'medium' is not one of"):
        template.render([], tier="medium")
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        template.render([], tools=[{"name": "f"}])
    with pytest.raises(ValueError, match="defined twice"):
        template.render([], tools=TOOLS + TOOLS)
    assert isinstance(MessageError(0, "malformed_message", "x"), ValueError)


def test_developer_role_and_reasoning_alias(tok, template):
    a = template.render(
        [{"role": "developer", "content": "d"}, {"role": "assistant", "content": "x", "reasoning": "r"}],
        tier="low",
    ).ids
    b = template.render(
        [{"role": "system", "content": "d"}, {"role": "assistant", "content": "x", "reasoning_content": "r"}],
        tier="low",
    ).ids
    assert a == b
