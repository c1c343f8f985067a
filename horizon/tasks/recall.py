"""The recall domain: a curriculum for copying, the skill every other domain's answer depends on.

A small model trained only on the agent domains learns their formats quickly but not to copy: the
digits of a pass key, of a calculator expression or of a tool result are a few tokens in hundreds, and
the copy mechanism (an induction-style lookup: find where this token occurred before, emit what came
next) needs many dense examples to form. Here nearly every generated token is a copy.

Two kinds, chosen by the seed's random stream:
  * repeat: "Repeat these codes exactly: 4821 90 377 ..." -> the same codes (2-8 groups of 2-6 digits);
  * lookup: a list of "name: code" lines, then "What is the code of <name>?" -> that code (3-12 lines;
    names are drawn from a word list, so the model must find the line by its name, wherever it is).
No tools. The reference thought is long and meant to add nothing the answer needs (about 80 tokens: the
repeat's restates the rules and each code's length, the lookup's names the lines it reads past before quoting
the one it wants), so that RL with a thinking cost has something to drop; ``brief_reasoning`` is the 3-8 token
version. Then the answer as the whole content.

Split rule (the held-out value space, never drawn for train): a task is held out when the CRC-32 of its
answer is a multiple of 5. Seeds are disjoint as in every domain (``Domain.rng``).

Key (de-duplication): the kind and the whole prompt.

Reward: 1.0 if the completion, stripped, equals the answer exactly (repeat) or its first integer
token-for-token equals the code (lookup, codes can start with 0, so compared as text), else 0.0.
"""

from __future__ import annotations

import random
import re
import zlib

from horizon.tasks.base import Domain, Task, assistant_message

HELDOUT_MOD = 5
NAMES = ["apple", "river", "falcon", "copper", "maple", "harbor", "violet", "granite", "willow", "comet", "ember",
         "lantern", "meadow", "orbit", "pepper", "quartz", "saddle", "tundra", "walnut", "zephyr", "badger",
         "cedar", "dune", "fjord", "glacier", "hazel", "iris", "jasper", "kettle", "lotus", "marble", "nutmeg"]


def _code(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def answer_heldout(answer: str) -> bool:
    return zlib.crc32(answer.encode()) % HELDOUT_MOD == 0


class RecallDomain(Domain):
    name = "recall"
    tools = ()

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        heldout = split == "heldout"
        while True:  # rejection: about one draw in five is held out
            if rng.random() < 0.5:
                kind = "repeat"
                answer = " ".join(_code(rng, 2, 6) for _ in range(rng.randint(2, 8)))
                prompt = f"Repeat these codes exactly: {answer}"
                codes = answer.split()
                lengths = ", ".join(str(len(c)) for c in codes)
                reasoning = (f"I must repeat {len(codes)} codes exactly, in the order given, separated by single "
                             f"spaces and with nothing added. They have {lengths} digits. "
                             "Copying them as they are, I write them out in order.")
            else:
                kind = "lookup"
                names = rng.sample(NAMES, rng.randint(3, 12))
                codes = [_code(rng, 3, 6) for _ in names]
                pick = rng.randrange(len(names))
                name, answer = names[pick], codes[pick]
                lines = "\n".join(f"{n}: {c}" for n, c in zip(names, codes, strict=True))
                prompt = f"{lines}\nWhat is the code of {name}?"
                before = f"{', '.join(names[:pick])} come before it; " if pick else ""
                reasoning = (f"I need the code of {name}. The list has {len(names)} lines, and I read down it: "
                             f'{before}line {pick + 1} is the one, "{name}: {answer}". Nothing else matters, '
                             f"so the code of {name} is {answer}.")
            if answer_heldout(answer) == heldout:
                break
        return self.task(seed, split, prompt, answer, [assistant_message(answer, reasoning)], {"kind": kind})

    def reward(self, task: Task, completion: str) -> float:
        got = completion.strip()
        if task.meta["kind"] == "lookup":
            m = re.search(r"\d+", got)
            got = m.group() if m else ""
        return 1.0 if got == task.answer else 0.0

    def key(self, task: Task) -> str:
        return f"{task.meta['kind']}:{task.messages[0]['content']}"

    def brief_reasoning(self, task: Task) -> str:
        return f"It is {task.answer}." if task.meta["kind"] == "lookup" else "In order."
