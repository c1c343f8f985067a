"""The arithmetic domain: multi-step integer arithmetic that the model should hand to the calculator.

Two kinds, chosen by the seed's random stream (about half each):
  * expression: "What is 347 * 29 - 1,204?" over seven expression shapes (products, sums and
    differences of products, a bracketed factor, an exact division), operands written with thousands
    commas in the question;
  * word: a short word problem (boxes of items shipped out, packs ordered, a bill split with a tip,
    a temperature dropping below zero, ...) that reduces to one such expression.
Every result is an exact integer (divisions are built to divide exactly); some are negative.

Target trajectory: an assistant turn with short reasoning and one ``calculator`` call on the plain
expression ("347 * 29 - 1204"), the tool message holding what ``Calculator().run`` really returns
for it (so training never shows a result the tool would not give), then a final assistant turn with
reasoning and the answer (the number alone).

Split rule (the held-out value space, never drawn for train): a problem is held out when the CRC-32 of
its calculator expression is a multiple of 5 (about 20% of (shape, operands) combinations, spread over
every shape and operand range). The expression is also the key, so the partition is by key and the
splits can never share a question. Seeds are disjoint too (``Domain.rng`` is keyed by the split).

Key (de-duplication): the expression ("expr:347 * 29 - 1204"); a word problem and a bare question
with the same expression are the same question.

Reward: 1.0 if the first integer in the completion (``base.first_int``, after reading a Unicode minus
sign as "-": "-1,204" reads -1204, "12.0" reads 12, "2.5" is not an integer) equals the answer, else
0.0. The answer should come first: "347 * 29 - 1204 = 8859" reads 347.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable

from horizon.agent.calculator import Calculator
from horizon.tasks.base import Domain, Task, assistant_message, int_reward, tool_call, tool_message

HELDOUT_MOD = 5
CALL_ID = "call_1"


def expression_heldout(expression: str) -> bool:
    return zlib.crc32(expression.encode()) % HELDOUT_MOD == 0


def _c(n: int) -> str:
    """A number as the question writes it: thousands commas (the calculator gets plain digits)."""
    return f"{n:,}"


# Expression shapes: (drawn operands -> (expression, value)). Python evaluates the same operator text, so
# the value is checked independently of the calculator (a mismatch is a bug, raised at generation).
def _shape_mul_sub(r: random.Random) -> tuple[str, int]:
    a, b, c = r.randint(12, 999), r.randint(3, 99), r.randint(100, 9999)
    return f"{a} * {b} - {c}", a * b - c


def _shape_mul_add(r: random.Random) -> tuple[str, int]:
    a, b, c = r.randint(12, 999), r.randint(3, 99), r.randint(100, 9999)
    return f"{a} * {b} + {c}", a * b + c


def _shape_sum_mul(r: random.Random) -> tuple[str, int]:
    a, b, c = r.randint(10, 999), r.randint(10, 999), r.randint(3, 99)
    return f"({a} + {b}) * {c}", (a + b) * c


def _shape_mul_diff(r: random.Random) -> tuple[str, int]:
    a, b, c = r.randint(3, 99), r.randint(10, 999), r.randint(10, 999)
    return f"{a} * ({b} - {c})", a * (b - c)


def _shape_two_products(r: random.Random) -> tuple[str, int]:
    a, b, c, d = r.randint(11, 499), r.randint(3, 99), r.randint(11, 499), r.randint(3, 99)
    op = r.choice("+-")
    return f"{a} * {b} {op} {c} * {d}", a * b + c * d if op == "+" else a * b - c * d


def _shape_diff_times_sum(r: random.Random) -> tuple[str, int]:
    a, b, c, d = r.randint(10, 999), r.randint(10, 999), r.randint(2, 99), r.randint(2, 99)
    return f"({a} - {b}) * ({c} + {d})", (a - b) * (c + d)


def _shape_div_add(r: random.Random) -> tuple[str, int]:
    b, q, c = r.randint(3, 99), r.randint(11, 999), r.randint(10, 9999)
    op = r.choice("+-")
    return f"{b * q} / {b} {op} {c}", q + c if op == "+" else q - c


SHAPES: list[Callable[[random.Random], tuple[str, int]]] = [
    _shape_mul_sub, _shape_mul_add, _shape_sum_mul, _shape_mul_diff, _shape_two_products, _shape_diff_times_sum,
    _shape_div_add,
]
QUESTIONS = [
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e}. Give the exact result.",
    "Evaluate {e} and give the answer as a whole number.",
]


# Word problems: (drawn values -> (question, expression, value, how the expression follows from the story)).
def _word_shipping(r: random.Random) -> tuple[str, str, int, str]:
    a, b = r.randint(12, 400), r.randint(6, 96)
    c = r.randint(10, a * b - 1)
    q = (f"A warehouse holds {_c(a)} boxes with {b} items in each box. Then {_c(c)} items are shipped out. "
         "How many items are left in the warehouse?")
    return q, f"{a} * {b} - {c}", a * b - c, f"{a} boxes of {b} items make {a} * {b}; {c} of them leave"


def _word_order(r: random.Random) -> tuple[str, str, int, str]:
    a, b, c, d = r.randint(11, 250), r.randint(6, 48), r.randint(11, 250), r.randint(6, 48)
    q = (f"A school orders {a} packs of {b} pencils and {c} packs of {d} pens. "
         "How many pencils and pens does it order altogether?")
    return q, f"{a} * {b} + {c} * {d}", a * b + c * d, f"the pencils are {a} * {b} and the pens {c} * {d}"


def _word_bill(r: random.Random) -> tuple[str, str, int, str]:
    n, share, tip = r.randint(3, 24), r.randint(15, 900), r.randint(2, 60)
    q = (f"{n} friends split a restaurant bill of {_c(n * share)} dollars equally, and each of them also adds a "
         f"{tip} dollar tip. How many dollars does each friend pay?")
    return q, f"{n * share} / {n} + {tip}", share + tip, f"each share is {n * share} / {n}, plus the {tip} tip"


def _word_trip(r: random.Random) -> tuple[str, str, int, str]:
    v, h, extra = r.randint(40, 180), r.randint(2, 19), r.randint(10, 900)
    q = (f"A train runs at {v} km per hour for {h} hours and then covers another {extra} km. "
         "How many kilometres does it travel in total?")
    return q, f"{v} * {h} + {extra}", v * h + extra, f"{h} hours at {v} km/h is {v} * {h}, plus {extra} km"


def _word_factory(r: random.Random) -> tuple[str, str, int, str]:
    made, bad, days = r.randint(50, 900), r.randint(1, 49), r.randint(3, 60)
    q = (f"A factory makes {made} parts a day, of which {bad} are defective. How many good parts does it make "
         f"in {days} days?")
    return q, f"({made} - {bad}) * {days}", (made - bad) * days, f"{made} - {bad} good parts a day for {days} days"


def _word_temperature(r: random.Random) -> tuple[str, str, int, str]:
    start, drop, hours = r.randint(-20, 35), r.randint(2, 9), r.randint(3, 30)
    q = (f"The temperature is {start} degrees. It falls by {drop} degrees every hour for {hours} hours. "
         "What is the temperature then, in degrees?")
    return q, f"{start} - {drop} * {hours}", start - drop * hours, f"it falls {drop} * {hours} degrees from {start}"


WORDS: list[Callable[[random.Random], tuple[str, str, int, str]]] = [
    _word_shipping, _word_order, _word_bill, _word_trip, _word_factory, _word_temperature,
]


def _display(expression: str) -> str:
    """The expression as the question shows it: numbers with thousands commas."""
    return re.sub(r"\d+", lambda m: _c(int(m.group())), expression)


class ArithmeticDomain(Domain):
    name = "arithmetic"
    tools = ("calculator",)

    def __init__(self) -> None:
        self.calculator = Calculator()

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        heldout = split == "heldout"
        while True:  # rejection: about one draw in five is held out, so this ends quickly
            if rng.random() < 0.5:
                kind = "expression"
                shape = rng.randrange(len(SHAPES))
                expression, value = SHAPES[shape](rng)
                question = rng.choice(QUESTIONS).format(e=_display(expression))
                setup = f"This is {expression}"
            else:
                kind = "word"
                shape = rng.randrange(len(WORDS))
                question, expression, value, how = WORDS[shape](rng)
                setup = f"In numbers: {how}, so the result is {expression}"
            if expression_heldout(expression) == heldout:
                break
        result = self.calculator.run({"expression": expression})
        if result.is_error or result.content != str(value):  # the target must be what the tool gives
            raise RuntimeError(f"calculator gave {result.content!r} for {expression!r}, expected {value}")
        answer = str(value)
        target = [
            assistant_message("", f"{setup}. I'll use the calculator so the result is exact.",
                              [tool_call(CALL_ID, "calculator", {"expression": expression})]),
            tool_message(CALL_ID, result.content),
            assistant_message(answer, f"The calculator returned {result.content} for {expression}, "
                                      f"so the answer is {answer}."),
        ]
        return self.task(seed, split, question, answer, target,
                         {"kind": kind, "shape": shape, "expression": expression, "value": value})

    def reward(self, task: Task, completion: str) -> float:
        return int_reward(task, completion.replace("\u2212", "-"))

    def key(self, task: Task) -> str:
        return f"expr:{task.meta['expression']}"
