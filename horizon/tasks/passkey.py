"""The passkey domain: find one number (the "needle") in a long stretch of irrelevant text.

The prompt is an instruction, then filler text with the line "The pass key is NNNNN. Remember it."
inserted between two sentences at a random depth (0-100% of the way through), then the question.
The filler is generated here from sentence templates and word lists (no external data), so its content
varies from task to task; it holds no digits, so the key is the only number in the prompt and occurs
exactly once. Its length is drawn from ``[min_words, max_words]`` words (constructor arguments;
the defaults give prompts of about 350-1500 tokens with the bundled tokenizer, well past the tiny
model's ``index_topk`` of 16, so retrieval has to select the right keys).

No tools. Target: one assistant turn whose reasoning quotes the needle and whose content is the key.

Split rule (the held-out value space, never drawn for train): keys (10000-99999) that are multiples
of 7 are held out (about 14%). The filler comes from the seed's random stream, which is keyed by the
split (``Domain.rng``), so held-out prompts also have their own filler draws.

Key (de-duplication): the pass key ("key:12345"): the same key under other filler is the same answer
to learn, so it is one question; the splits never share a key.

Reward: 1.0 if the first integer in the completion (``base.first_int``) equals the key, else 0.0.
"""

from __future__ import annotations

import random

from horizon.tasks.base import Domain, Task, assistant_message, int_reward

HELDOUT_MOD = 7
KEY_MIN, KEY_MAX = 10_000, 99_999
MIN_WORDS, MAX_WORDS = 150, 800  # about 350-1500 tokens of prompt with the bundled tokenizer

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it afterwards.")
QUESTION = "What is the pass key? Answer with the number only."

# Filler vocabulary: sentences drawn from templates over these lists read as varied, harmless prose.
_ADJ = ["quiet", "green", "old", "bright", "narrow", "wide", "cold", "warm", "busy", "empty", "tall", "small",
        "golden", "grey", "wooden", "distant", "gentle", "heavy", "sunny", "misty"]
_NOUN = ["river", "village", "garden", "market", "mountain", "bridge", "library", "harbour", "forest", "road",
         "meadow", "tower", "orchard", "valley", "station", "lake", "field", "castle", "island", "square"]
_PERSON = ["the baker", "a traveller", "the farmer", "an old sailor", "the teacher", "a young painter",
           "the gardener", "a shepherd", "the innkeeper", "a musician", "the fisherman", "a child"]
_VERB = ["walks past", "looks at", "paints", "remembers", "visits", "sings about", "writes about", "crosses",
         "waits near", "dreams of", "talks about", "sketches"]
_TIME = ["in the morning", "at dusk", "every spring", "after the rain", "in late autumn", "on quiet evenings",
         "before sunrise", "during the winter", "at noon", "once a year"]
_THING = ["birds", "boats", "lanterns", "apples", "clouds", "bells", "flowers", "leaves", "stars", "sheep"]
_TEMPLATES = [
    "The {adj} {noun} is calm {time}.",
    "{Person} {verb} the {adj} {noun} {time}.",
    "The grass is green and the sky above the {noun} is blue.",
    "Many {thing} can be seen near the {adj} {noun} {time}.",
    "Nobody knows why the {noun} feels so {adj} {time}.",
    "{Person} once said that the {noun} was the most {adj} place in the region.",
    "There are {thing} everywhere around the {adj} {noun}.",
    "Here we go again, past the {noun} and back to the {adj} {noun2}.",
    "{Person} {verb} the {thing} by the {noun}.",
    "The path from the {noun} to the {noun2} is {adj} and long.",
]


def key_heldout(key: int) -> bool:
    return key % HELDOUT_MOD == 0


def needle(key: int) -> str:
    return f"The pass key is {key}. Remember it."


def _sentence(rng: random.Random) -> str:
    person = rng.choice(_PERSON)
    return rng.choice(_TEMPLATES).format(
        adj=rng.choice(_ADJ), noun=rng.choice(_NOUN), noun2=rng.choice(_NOUN), time=rng.choice(_TIME),
        Person=person[0].upper() + person[1:], verb=rng.choice(_VERB), thing=rng.choice(_THING))


class PasskeyDomain(Domain):
    name = "passkey"
    tools = ()

    def __init__(self, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS, name: str | None = None):
        if not 1 <= min_words <= max_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got {min_words} and {max_words}")
        self.min_words, self.max_words = min_words, max_words
        if name is not None:  # a registered variant (its random streams and task ids carry this name)
            self.name = name

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        heldout = split == "heldout"
        while True:  # rejection: one key in seven is held out
            key = rng.randint(KEY_MIN, KEY_MAX)
            if key_heldout(key) == heldout:
                break
        n_words = rng.randint(self.min_words, self.max_words)
        sentences: list[str] = []
        words = 0
        while words < n_words:
            sentences.append(_sentence(rng))
            words += len(sentences[-1].split())
        # The needle goes between two sentences; paragraphs of 3-8 sentences around it, one per line.
        at = rng.randint(0, len(sentences))
        lines: list[str] = []
        paragraph: list[str] = []
        size = rng.randint(3, 8)
        for i, s in enumerate([*sentences, None]):
            if i == at or s is None or len(paragraph) == size:
                if paragraph:
                    lines.append(" ".join(paragraph))
                paragraph, size = [], rng.randint(3, 8)
            if i == at:
                lines.append(needle(key))
            if s is not None:
                paragraph.append(s)
        depth = sum(len(s.split()) for s in sentences[:at]) / words
        prompt = f"{INSTRUCTION}\n\n" + "\n".join(lines) + f"\n\n{QUESTION}"
        answer = str(key)
        reasoning = (f"Somewhere about {round(depth * 100)}% of the way through the text there is the line "
                     f'"{needle(key)}" Everything else is filler, so the pass key is {key}.')
        return self.task(seed, split, prompt, answer, [assistant_message(answer, reasoning)],
                         {"key": key, "words": words, "sentences": len(sentences), "needle_at": at,
                  "depth": round(depth, 4)})

    def reward(self, task: Task, completion: str) -> float:
        return int_reward(task, completion)

    def key(self, task: Task) -> str:
        return f"key:{task.meta['key']}"

    def brief_reasoning(self, task: Task) -> str:
        return f"The pass key is {task.answer}."
