"""The image domain: generated pictures (Pillow, in memory) with a verifiable integer answer.

Two kinds, chosen by the seed's random stream (about half each):
  * number: a 1-4 digit number drawn as block seven-segment digits (filled rectangles, so no font file
    is needed and the digits stay legible at small sizes) on a plain or noisy background. Each digit
    is one 4-connected blob of ink and digits are at least 2 px apart. Answer: the number.
  * count: 1-9 target shapes plus 1-5 distractors (other colours and/or other shapes), circles,
    squares and triangles in six flat colours on a plain light background, none overlapping or
    touching (2+ px apart). Question "How many <colour> <shape>s are there?". Answer: the count.
Image sides are drawn from 64-256 px independently (count scenes with more than 6 shapes use
96-256), so the number of image tokens varies. The user message is the image (a PNG data URL part)
followed by the question.

Split rule (the held-out value space, never drawn for train):
  * number: values whose digit sum is a multiple of 5 (0, 5, 14, 19, 23, ..., 1234, ...) are held
    out; about 20% of every length, and every digit and last digit still occurs in both splits;
  * count: a (colour, shape, count) question triple is held out when
    ``colour_index + shape_index + count`` is a multiple of 5 (about 20% of the 162 triples; every
    colour, shape and count occurs in both splits).
Seeds are disjoint too: the random stream is keyed by the split (``Domain.rng``).

Key (de-duplication): number tasks by value ("number:1234": the same number at another size or style
is the same question); count tasks by the question triple and the scene's composition
("count:red:circle:3|blue square x2,red triangle x1"), positions and sizes aside.

Reward: 1.0 if the first integer in the completion (``base.first_int``: "Answer: 1,234." reads 1234,
a number glued to letters such as "2nd" is skipped, "2.5" is not an integer) equals the answer,
else 0.0. Number words ("seven") are not read.
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

from PIL import Image, ImageChops, ImageDraw

from horizon.tasks.base import Domain, Task, assistant_message, int_reward

MIN_SIDE, MAX_SIDE = 64, 256
CROWDED = 6  # count scenes with more shapes than this get at least CROWDED_MIN_SIDE px per side
CROWDED_MIN_SIDE = 96
MAX_DISTRACTORS = 5

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
    "orange": (240, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
# Light backgrounds for count scenes: none equals a shape colour, so shapes are exact-colour regions.
COUNT_BACKGROUNDS = ((255, 255, 255), (240, 240, 240), (250, 245, 230), (230, 240, 250))

# Block seven-segment digits: which of the segments a (top), b (top right), c (bottom right),
# d (bottom), e (bottom left), f (top left), g (middle) are lit.
SEGMENTS = {
    "0": "abcdef",
    "1": "bc",
    "2": "abdeg",
    "3": "abcdg",
    "4": "bcfg",
    "5": "acdfg",
    "6": "acdefg",
    "7": "abc",
    "8": "abcdefg",
    "9": "abcdfg",
}


def number_heldout(value: int) -> bool:
    return sum(int(c) for c in str(value)) % 5 == 0


def count_heldout(colour: str, shape: str, count: int) -> bool:
    return (list(COLOURS).index(colour) + SHAPES.index(shape) + count) % 5 == 0


def _png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _plural(n: int, colour: str, shape: str) -> str:
    return f"{n} {colour} {shape}{'' if n == 1 else 's'}"


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# Number images


def digit_boxes(cell_w: int, cell_h: int, thick: int) -> dict[str, tuple[int, int, int, int]]:
    """Segment rectangles (x0, y0, x1, y1, inclusive) inside one digit cell. Segments overlap at the
    corners, so every digit's lit segments form one connected blob."""
    w, h, t = cell_w, cell_h, thick
    mid0 = (h - t) // 2
    mid1 = mid0 + t - 1
    return {
        "a": (0, 0, w - 1, t - 1),
        "b": (w - t, 0, w - 1, mid1),
        "c": (w - t, mid0, w - 1, h - 1),
        "d": (0, h - t, w - 1, h - 1),
        "e": (0, mid0, t - 1, h - 1),
        "f": (0, 0, t - 1, mid1),
        "g": (0, mid0, w - 1, mid1),
    }


def draw_number(
    value: int,
    width: int,
    height: int,
    *,
    ink: tuple[int, int, int],
    background: tuple[int, int, int],
    noise: int,
    rng: random.Random,
    scale: float = 1.0,
) -> tuple[Image.Image, dict[str, Any]]:
    """``value`` in block digits on ``background`` with grey noise of +-``noise`` per pixel. ``scale``
    (0.6-1.0) picks the digit size between the smallest legible and the largest that fits. Returns the
    image and the layout (cell size, stroke, spacing, box of the digits)."""
    text = str(value)
    n = len(text)
    # The largest cell width that fits: n cells plus n-1 gaps of 0.3 cell in 85% of the width, and a
    # cell height of 1.8 widths in 80% of the height. Never below 8 px wide, where 2 px strokes leave
    # readable holes.
    w_max = max(8, min(int(0.8 * height / 1.8), int(0.85 * width / (n + 0.3 * (n - 1)))))
    cell_w = max(8, round(w_max * scale))
    cell_h = round(cell_w * 1.8)
    thick = max(2, round(cell_w / 5))
    gap = max(2, round(cell_w * 0.3))
    total_w = n * cell_w + (n - 1) * gap
    x0 = rng.randint(0, max(0, width - total_w))
    y0 = rng.randint(0, max(0, height - cell_h))

    if noise > 0:
        # Per-pixel grey noise in [-noise, +noise] around the background, from the seeded stream.
        grey = Image.frombytes("L", (width, height), rng.randbytes(width * height))
        grey = grey.point(lambda v: v * 2 * noise // 255)
        base = Image.new("RGB", (width, height), tuple(max(0, c - noise) for c in background))
        img = ImageChops.add(base, Image.merge("RGB", (grey, grey, grey)))
    else:
        img = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(img)
    boxes = digit_boxes(cell_w, cell_h, thick)
    for i, ch in enumerate(text):
        dx = x0 + i * (cell_w + gap)
        for seg in SEGMENTS[ch]:
            a, b, c, d = boxes[seg]
            draw.rectangle((dx + a, y0 + b, dx + c, y0 + d), fill=ink)
    layout = {"cell": [cell_w, cell_h], "stroke": thick, "gap": gap, "box": [x0, y0, x0 + total_w - 1, y0 + cell_h - 1]}
    return img, layout


# Count images


def _shape_box(
    rng: random.Random, width: int, height: int, size: int, placed: list[list[int]], sep: int
) -> list[int] | None:
    """A free square box of side ``size`` at least ``sep`` px from every placed box, or None."""
    for _ in range(200):
        x0 = rng.randint(1, width - size - 1)
        y0 = rng.randint(1, height - size - 1)
        box = [x0, y0, x0 + size - 1, y0 + size - 1]
        if all(
            box[2] + sep < p[0] or p[2] + sep < box[0] or box[3] + sep < p[1] or p[3] + sep < box[1] for p in placed
        ):
            return box
    return None


def layout_shapes(
    rng: random.Random, width: int, height: int, kinds: list[tuple[str, str]]
) -> list[list[Any]] | None:
    """Place each (colour, shape) in its own box; [[colour, shape, x0, y0, x1, y1], ...] or None when
    the scene does not fit after a few tries with smaller shapes."""
    side = min(width, height)
    hi = max(13, side // 5)
    for _attempt in range(8):
        lo = max(13, hi * 2 // 3)
        placed: list[list[int]] = []
        for _ in kinds:
            box = _shape_box(rng, width, height, rng.randint(lo, hi), placed, sep=2)
            if box is None:
                break
            placed.append(box)
        else:
            return [[c, s, *box] for (c, s), box in zip(kinds, placed, strict=True)]
        hi = max(13, hi * 3 // 4)  # crowded: try smaller shapes
    return None


def draw_shapes(width: int, height: int, shapes: list[list[Any]], background: tuple[int, int, int]) -> Image.Image:
    """Flat, non-antialiased shapes, so each is an exact-colour region of its box."""
    img = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(img)
    for colour, shape, x0, y0, x1, y1 in shapes:
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:  # an upright isosceles triangle filling its box
            draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
    return img


class ImageDomain(Domain):
    name = "image"
    tools = ()

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        if rng.random() < 0.5:
            return self._number(rng, seed, split)
        return self._count(rng, seed, split)

    def _task(
        self, seed: int, split: str, img: Image.Image, question: str, answer: int, reasoning: str, meta: dict
    ) -> Task:
        content = [{"type": "image_url", "image_url": {"url": _png_data_url(img)}}, {"type": "text", "text": question}]
        return self.task(seed, split, content, str(answer), [assistant_message(str(answer), reasoning)],
                         {"width": img.width, "height": img.height, **meta})

    def _number(self, rng: random.Random, seed: int, split: str) -> Task:
        digits = rng.randint(1, 4)
        lo, hi = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
        heldout = split == "heldout"
        while True:  # rejection: about one draw in five is held out, so this ends quickly
            value = rng.randint(lo, hi)
            if number_heldout(value) == heldout:
                break
        width, height = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
        dark = rng.randint(0, 40), rng.randint(0, 40), rng.randint(0, 60)
        light = rng.randint(200, 255), rng.randint(200, 255), rng.randint(190, 255)
        ink, background = (dark, light) if rng.random() < 0.7 else (light, dark)
        noise = 0 if rng.random() < 0.5 else rng.randint(10, 35)
        img, layout = draw_number(
            value, width, height, ink=ink, background=background, noise=noise, rng=rng, scale=rng.uniform(0.6, 1.0)
        )
        text = str(value)
        question = "What number is shown in the image? Answer with the number only."
        listed = _listing(list(text))
        reasoning = (
            f"The image shows {digits} digit{'s' if digits > 1 else ''} in a row: {listed}. "
            f"Read left to right, the number is {value}."
        )
        meta = {"kind": "number", "value": value, "digits": digits, "ink": list(ink),
                "background": list(background), "noise": noise, **layout}
        return self._task(seed, split, img, question, value, reasoning, meta)

    def _count(self, rng: random.Random, seed: int, split: str) -> Task:
        heldout = split == "heldout"
        while True:  # rejection over question triples (about 20% held out)
            colour, shape, count = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.randint(1, 9)
            if count_heldout(colour, shape, count) == heldout:
                break
        n_distract = rng.randint(1, MAX_DISTRACTORS)
        # The first distractor shares the colour or the shape, so the question needs both attributes.
        if rng.random() < 0.5:
            first = (colour, rng.choice([s for s in SHAPES if s != shape]))
        else:
            first = (rng.choice([c for c in COLOURS if c != colour]), shape)
        others = [(c, s) for c in COLOURS for s in SHAPES if (c, s) != (colour, shape)]
        distractors = [first] + [rng.choice(others) for _ in range(n_distract - 1)]
        kinds = [(colour, shape)] * count + distractors
        rng.shuffle(kinds)
        while True:
            lo = CROWDED_MIN_SIDE if len(kinds) > CROWDED else MIN_SIDE
            width, height = rng.randint(lo, MAX_SIDE), rng.randint(lo, MAX_SIDE)
            shapes = layout_shapes(rng, width, height, kinds)
            if shapes is not None:
                break
            # Did not fit at this size: draw another size (the question stays the same).
        background = rng.choice(COUNT_BACKGROUNDS)
        img = draw_shapes(width, height, shapes, background)

        tally: dict[tuple[str, str], int] = {}
        for c, s in distractors:
            tally[(c, s)] = tally.get((c, s), 0) + 1
        scene = ",".join(f"{c} {s} x{k}" for (c, s), k in sorted(tally.items()))
        others_text = _listing([_plural(k, c, s) for (c, s), k in sorted(tally.items())])
        question = f"How many {colour} {shape}s are there? Answer with a number."
        reasoning = (
            f"I need to count the {colour} {shape}s. Going over the image I find "
            f"{_plural(count, colour, shape)}. The other shapes are {others_text}, which don't match, "
            f"so the answer is {count}."
        )
        meta = {"kind": "count", "colour": colour, "shape": shape, "count": count, "scene": scene,
                "background": list(background), "shapes": shapes}
        return self._task(seed, split, img, question, count, reasoning, meta)

    def reward(self, task: Task, completion: str) -> float:
        return int_reward(task, completion)

    def key(self, task: Task) -> str:
        m = task.meta
        if m["kind"] == "number":
            return f"number:{m['value']}"
        return f"count:{m['colour']}:{m['shape']}:{m['count']}|{m['scene']}"
