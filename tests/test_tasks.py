"""The task framework and the image domain: determinism, split disjointness, rewards, what the images
really show (checked by flood fill), and rendering through the chat template."""

from __future__ import annotations

import base64
import dataclasses
import io
import random

import pytest
from PIL import Image

from horizon.chat import ChatTemplate, load_tokenizer, validate_history
from horizon.tasks import DOMAINS, Domain, Task, check_disjoint, first_int, get_domain, make_split
from horizon.tasks.base import assistant_message, tool_call, tool_message
from horizon.tasks.image import COLOURS, ImageDomain, count_heldout, draw_number, number_heldout

N = 300
IMAGE = get_domain("image")


@pytest.fixture(scope="module")
def splits() -> dict[str, list[Task]]:
    return {split: make_split("image", split, N) for split in ("train", "heldout")}


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(load_tokenizer())


def decode(task: Task) -> Image.Image:
    url = task.messages[0]["content"][0]["image_url"]["url"]
    head, data = url.split(",", 1)
    assert head == "data:image/png;base64"
    img = Image.open(io.BytesIO(base64.b64decode(data)))
    assert img.format == "PNG"
    return img.convert("RGB")


def components(img: Image.Image, is_on) -> list[tuple[int, tuple[int, int, int, int]]]:
    """4-connected components of the pixels where is_on(rgb): (pixel count, (x0, y0, x1, y1)) each."""
    w, h = img.size
    data = list(img.getdata())
    on = {i for i, p in enumerate(data) if is_on(p)}
    found = []
    while on:
        stack = [on.pop()]
        n, x0, y0, x1, y1 = 0, w, h, -1, -1
        while stack:
            i = stack.pop()
            x, y = i % w, i // w
            n += 1
            x0, y0, x1, y1 = min(x0, x), min(y0, y), max(x1, x), max(y1, y)
            for j, ok in ((i - 1, x > 0), (i + 1, x < w - 1), (i - w, y > 0), (i + w, y < h - 1)):
                if ok and j in on:
                    on.remove(j)
                    stack.append(j)
        found.append((n, (x0, y0, x1, y1)))
    return found


def shape_of(n: int, box: tuple[int, int, int, int]) -> str:
    """Classify a blob by how much of its bounding box it fills: square 1, circle ~pi/4, triangle ~1/2."""
    fill = n / ((box[2] - box[0] + 1) * (box[3] - box[1] + 1))
    return "square" if fill > 0.93 else "circle" if fill > 0.68 else "triangle"


# Determinism and splits


def test_generate_is_deterministic_per_seed_and_split():
    for seed in range(20):
        a, b = IMAGE.generate(seed, "train"), ImageDomain().generate(seed, "train")
        assert a == b and a.id == f"image-train-{seed}"
        assert IMAGE.generate(seed, "heldout").id == f"image-heldout-{seed}"
    assert IMAGE.generate(0, "train") != IMAGE.generate(1, "train")
    # The split is part of the random stream: the same seed draws unrelated tasks.
    assert [IMAGE.generate(s, "train").messages for s in range(10)] != [
        IMAGE.generate(s, "heldout").messages for s in range(10)
    ]
    with pytest.raises(ValueError, match="allowed: train, heldout"):
        IMAGE.generate(0, "test")


def test_splits_are_disjoint_and_follow_the_documented_partition(splits):
    check_disjoint(splits["train"], splits["heldout"])
    for split, tasks in splits.items():
        assert len(tasks) == N
        assert len({IMAGE.key(t) for t in tasks}) == N  # de-duplicated within the split
        assert len({t.id for t in tasks}) == N
        kinds = {t.meta["kind"] for t in tasks}
        assert kinds == {"number", "count"}
        for t in tasks:
            m = t.meta
            held = number_heldout(m["value"]) if m["kind"] == "number" else count_heldout(
                m["colour"], m["shape"], m["count"]
            )
            assert held == (split == "heldout"), t.id
            assert t.split == split and t.domain == "image" and t.tools == []


def test_check_disjoint_names_overlapping_keys(splits):
    leaked = dataclasses.replace(splits["train"][3], split="heldout", id="image-heldout-leak")
    with pytest.raises(ValueError, match="1 key.*both train and heldout") as err:
        check_disjoint(splits["train"], [*splits["heldout"], leaked])
    assert f"image:{IMAGE.key(leaked)}" in str(err.value)
    with pytest.raises(ValueError, match="labelled 'train' but was given as heldout"):
        check_disjoint([], [splits["train"][0]])


class _Tiny(Domain):
    """Three possible questions: make_split must give up rather than loop forever."""

    name = "tiny"

    def generate(self, seed: int, split: str) -> Task:
        v = self.rng(seed, split).randint(0, 2)
        msgs = [{"role": "user", "content": f"Say {v}."}]
        target = [assistant_message(str(v), "Easy.")]
        return Task(self.name, self.task_id(seed, split), split, seed, msgs, str(v), target, meta={"v": v})

    def reward(self, task: Task, completion: str) -> float:
        return float(first_int(completion) == int(task.answer))

    def key(self, task: Task) -> str:
        return str(task.meta["v"])


def test_make_split_dedups_and_gives_up_when_exhausted():
    tasks = make_split(_Tiny(), "train", 3)
    assert sorted(t.meta["v"] for t in tasks) == [0, 1, 2]
    with pytest.raises(ValueError, match="only 3 distinct tasks of 4 in 50 seeds"):
        make_split(_Tiny(), "train", 4, max_tries=50)
    assert make_split(IMAGE, "train", 5, start_seed=100)[0].seed == 100


def test_registry():
    assert DOMAINS["image"] is get_domain("image") is get_domain(IMAGE)
    with pytest.raises(ValueError, match="unknown task domain 'nope'; allowed: .*image"):
        get_domain("nope")


# Rewards


def test_reference_scores_one_and_wrong_scores_zero(splits):
    for t in splits["train"] + splits["heldout"]:
        assert IMAGE.reward(t, t.answer) == 1.0
        assert IMAGE.reward(t, t.target[-1]["content"]) == 1.0
        assert IMAGE.reward(t, str(int(t.answer) + 1)) == 0.0


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        ("  42\n", 42),
        ("The answer is 42.", 42),
        ("**42**", 42),
        ("There are 3 red circles.", 3),
        ("1,234", 1234),
        ("3, 4", 3),
        ("12.0", 12),
        ("2.5", None),
        ("the 2nd one: 7", 7),
        ("x9 y", None),
        ("-5", -5),
        ("seven", None),
        ("", None),
    ],
)
def test_first_int(text, value):
    assert first_int(text) == value


def test_reward_parsing_is_tolerant():
    task = next(t for t in make_split("image", "train", 40) if len(t.answer) == 4)
    a = task.answer
    for good in (f" {a} ", f"The number is {a}.", f"Answer: **{a}**", f"{int(a):,}"):
        assert IMAGE.reward(task, good) == 1.0, good
    for bad in ("", "I can't tell", f"{a}.5", f"{int(a) - 1} or {a}", f"v{a}"):
        assert IMAGE.reward(task, bad) == 0.0, bad


# What the images show


def test_images_decode_within_size_range(splits):
    sizes = set()
    for t in splits["train"][:100] + splits["heldout"][:100]:
        img = decode(t)
        assert 64 <= img.width <= 256 and 64 <= img.height <= 256
        assert img.size == (t.meta["width"], t.meta["height"])
        sizes.add(img.size)
    assert len(sizes) > 50  # sizes vary, so image token counts vary


def test_count_images_show_the_claimed_shapes(splits):
    tasks = [t for t in splits["train"] + splits["heldout"] if t.meta["kind"] == "count"][:50]
    assert len(tasks) == 50
    for t in tasks:
        m = t.meta
        img = decode(t)
        target = COLOURS[m["colour"]]
        blobs = components(img, lambda p, c=target: p == c)
        same_colour = [s for s in m["shapes"] if s[0] == m["colour"]]
        assert len(blobs) == len(same_colour), t.id
        assert sum(shape_of(n, box) == m["shape"] for n, box in blobs) == m["count"] == int(t.answer), t.id
        assert 1 <= m["count"] <= 9 and len(m["shapes"]) > m["count"]  # targets plus distractors
        # Every shape is its own blob: no overlaps, and all colours together give one blob per shape.
        everything = components(img, lambda p, bg=tuple(m["background"]): p != bg)
        assert len(everything) == len(m["shapes"]), t.id


def test_number_images_show_one_blob_per_digit(splits):
    tasks = [t for t in splits["train"] + splits["heldout"] if t.meta["kind"] == "number"][:50]
    assert len(tasks) == 50 and any(t.meta["noise"] for t in tasks) and any(not t.meta["noise"] for t in tasks)
    for t in tasks:
        m = t.meta
        ink, bg = tuple(m["ink"]), tuple(m["background"])

        def is_ink(p, ink=ink, bg=bg):
            return sum((a - b) ** 2 for a, b in zip(p, ink, strict=True)) < sum(
                (a - b) ** 2 for a, b in zip(p, bg, strict=True)
            )

        blobs = components(decode(t), is_ink)
        assert len(blobs) == len(t.answer) == m["digits"], t.id
        x0, y0, x1, y1 = m["box"]
        assert all(x0 <= b[0] and b[2] <= x1 and y0 <= b[1] and b[3] <= y1 for _, b in blobs), t.id


def test_different_numbers_draw_different_images():
    style = {"ink": (0, 0, 0), "background": (255, 255, 255), "noise": 20}
    images = {}
    for value in (1234, 1284, 7, 1):
        img, _ = draw_number(value, 120, 80, rng=random.Random(5), **style)
        images[value] = img.tobytes()
    assert len(set(images.values())) == 4
    again, _ = draw_number(1234, 120, 80, rng=random.Random(5), **style)
    assert again.tobytes() == images[1234]


# Chat format


def test_tasks_render_through_the_chat_template(splits, template):
    tok = template.tokenizer
    for t in splits["train"][:30] + splits["heldout"][:30]:
        assert validate_history(t.chat(), tier="high") == []
        prompt = template.render(t.messages, tier="high", add_generation_prompt=True)
        full = template.render(t.chat(), tier="high")
        assert full.ids[: len(prompt.ids)] == prompt.ids  # the prompt is a prefix of the training chat
        assert prompt.ids.count(tok.special.image) == 1 and full.images == [t.messages[0]["content"][0]]
        assert any(full.assistant_mask) and not any(full.assistant_mask[: len(prompt.ids)])
        text = tok.decode(full.ids)
        assert t.messages[0]["content"][1]["text"] in text and t.target[-1]["reasoning_content"] in text
        assert text.endswith(t.answer + "<｜/assistant｜>")


def test_a_tool_using_target_renders(template):
    """The Task shape holds tool-using trajectories too (what calculator and terminal domains will write)."""
    call = tool_call("call_1", "calculator", {"expression": "6*7"})
    target = [
        assistant_message("", "I should compute this.", [call]),
        tool_message("call_1", "42"),
        assistant_message("42", "The calculator says 42."),
    ]
    task = Task("calc", "calc-train-0", "train", 0, [{"role": "user", "content": "6*7?"}], "42", target, ["calculator"])
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    assert validate_history(task.chat(), tier="high", tools=tools) == []
    text = template.tokenizer.decode(template.render(task.chat(), tools=tools, tier="high").ids)
    assert '{"name": "calculator", "arguments": {"expression": "6*7"}}' in text and "<｜tool｜>42<｜/tool｜>" in text
    with pytest.raises(ValueError, match="unknown split"):
        dataclasses.replace(task, split="test")
