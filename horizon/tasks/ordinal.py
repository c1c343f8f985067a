"""The ordinal domain: "which word is number n in this list?", where a longer thought really pays.

The prompt lists 4-100 distinct words (each one token of the bundled tokenizer) and asks for the n-th
(n uniform over the list). Answering in one step needs the model to count positions, which a small model
cannot; counting aloud turns it into copying: the reference thought walks the list with a running index
("1 boat, 2 river, 3 moon, ...") and stops at n, so its length grows with n (about 4 tokens an item).
A thought cut short by the tier's budget stops before n and leaves a guess. This is the domain where
thinking tokens should rise with the tier and accuracy with them (issue 32's "thinking helps" side).

Split rule (the held-out value space): a task is held out when the CRC-32 of its list and n is a multiple
of 5. Seeds are disjoint as in every domain (``Domain.rng``).

Key (de-duplication): the list and n.

Reward: 1.0 if the completion's first word (lower-cased, punctuation stripped) is the answer, else 0.0.
"""

from __future__ import annotations

import re
import zlib

from horizon.tasks.base import Domain, Task, assistant_message

HELDOUT_MOD = 5
MIN_ITEMS, MAX_ITEMS = 4, 100
# Concrete nouns, each a single token of the bundled tokenizer with its leading space (checked in the tests).
WORDS = ("animal", "area", "array", "batch", "beauty", "bird", "black", "blue", "boat", "body", "book", "branch",
         "cache", "center", "children", "city", "class", "client", "code", "color", "column", "country", "course",
         "data", "date", "door", "earth", "east", "example", "expert", "face", "family", "farm", "father", "field",
         "figure", "file", "fire", "fish", "food", "foot", "friend", "game", "girl", "gold", "green", "ground",
         "group", "hand", "head", "heat", "history", "home", "horse", "hour", "house", "idea", "image", "island",
         "king", "land", "language", "layer", "letter", "life", "light", "line", "list", "machine", "memory",
         "message", "mile", "mind", "minute", "model", "money", "moon", "morning", "mother", "mountain", "music",
         "night", "north", "ocean", "page", "paper", "people", "picture", "piece", "place", "plane", "plant",
         "pound", "power", "price", "problem", "product", "rain", "river", "road", "rock", "room", "school",
         "science", "sentence", "ship", "snow", "song", "sound", "south", "space", "star", "story",
         "street", "system", "table", "tree", "water", "weather", "week", "wheel", "wind", "wood", "world", "year")
QUESTIONS = ("Here is a list of {k} words: {items}.\nWhich word is number {n} in the list?",
             "Words: {items}.\nWhat is word number {n} of these {k}?")


def list_heldout(items: list[str], n: int) -> bool:
    return zlib.crc32(f"{' '.join(items)}|{n}".encode()) % HELDOUT_MOD == 0


class OrdinalDomain(Domain):
    name = "ordinal"
    tools = ()

    def __init__(self, min_items: int = MIN_ITEMS, max_items: int = MAX_ITEMS):
        if not 1 <= min_items <= max_items <= len(WORDS):
            raise ValueError(f"need 1 <= min_items <= max_items <= {len(WORDS)}, got {min_items} and {max_items}")
        self.min_items, self.max_items = min_items, max_items

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        heldout = split == "heldout"
        while True:  # rejection: about one draw in five is held out
            items = rng.sample(WORDS, rng.randint(self.min_items, self.max_items))
            n = rng.randint(1, len(items))
            if list_heldout(items, n) == heldout:
                break
        answer = items[n - 1]
        prompt = rng.choice(QUESTIONS).format(k=len(items), items=", ".join(items), n=n)
        counted = ", ".join(f"{i} {w}" for i, w in enumerate(items[:n], 1))
        reasoning = f"Counting: {counted}. Word number {n} is {answer}."
        return self.task(seed, split, prompt, answer, [assistant_message(answer, reasoning)],
                         {"items": len(items), "n": n, "words": ",".join(items)})

    def reward(self, task: Task, completion: str) -> float:
        m = re.search(r"[a-z]+", completion.strip().lower())
        return 1.0 if m is not None and m.group() == task.answer else 0.0

    def key(self, task: Task) -> str:
        return f"list:{task.meta['words']}|{task.meta['n']}"
