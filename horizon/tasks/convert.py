"""The convert domain: format conversion between a JSON list of records and CSV text (a header and rows).

Two directions, chosen by the seed's random stream (about half each):
  * json2csv: "Convert this JSON to CSV with columns a,b,c": the records (2-6 of them, 2-5 fields each)
    as JSON (indented or on one line), and the columns asked for, which may be a reordered subset of
    the fields. Answer: the header line then one line per record, in order, values joined by commas.
  * csv2json: "Convert this CSV to a JSON list of objects": keys from the header, in column order;
    digits-only values (with an optional minus) become JSON integers, every other value a string.
Values are ints (-50..9999) or single words (no commas, quotes or spaces; never digits), so no CSV
quoting is needed.

No tools. Target: one assistant turn whose reasoning says what to do and whose content is the converted
text (CSV lines, or JSON indented by two spaces).

Split rule (the held-out value space, never drawn for train): train and held-out tasks draw their field
names and their string values from disjoint vocabularies (``FIELDS`` and ``WORDS`` per split), so no
held-out record, header or value word ever occurs in train. Seeds are disjoint too (``Domain.rng``).

Key (de-duplication): direction, the records (canonical JSON) and the column list.

Reward (1.0 or 0.0, no partial credit), on the completion with a surrounding ```code fence``` removed
(the first fenced block when there is one):
  * json2csv: the non-empty lines, each split on commas with every cell trimmed, equal the expected
    header and rows (same order);
  * csv2json: the text (or, failing that, its span from the first "[" to the last "]") parses as JSON
    and equals the expected list of objects, types included: 7 must be the integer 7, not "7", 7.0 or
    true. Key order inside an object does not matter.
"""

from __future__ import annotations

import json
import re
from typing import Any

from horizon.tasks.base import Domain, Task, assistant_message

DIRECTIONS = ("json2csv", "csv2json")
# Field names: (name, kind), kind "int" or "word". Disjoint between the splits, like the words.
FIELDS: dict[str, list[tuple[str, str]]] = {
    "train": [("id", "int"), ("name", "word"), ("city", "word"), ("age", "int"), ("price", "int"),
              ("colour", "word"), ("qty", "int"), ("status", "word"), ("team", "word"), ("score", "int"),
              ("country", "word"), ("year", "int")],
    "heldout": [("code", "int"), ("label", "word"), ("region", "word"), ("weight", "int"), ("rank", "int"),
                ("species", "word"), ("stock", "int"), ("owner", "word"), ("grade", "word"), ("level", "int")],
}
WORDS: dict[str, list[str]] = {
    "train": ["alice", "bob", "carol", "oslo", "lima", "pune", "red", "blue", "green", "open", "closed", "lions",
              "tigers", "kenya", "peru", "nepal", "apple", "river", "stone", "maple"],
    "heldout": ["dmitri", "esther", "farid", "quito", "accra", "hanoi", "amber", "teal", "violet", "pending",
                "shipped", "falcons", "otters", "chile", "ghana", "laos", "cedar", "delta", "ember", "fjord"],
}
_FENCE = re.compile(r"```[\w-]*[ \t]*\n?(.*?)```", re.S)


def strip_fence(text: str) -> str:
    """The first fenced code block's body, or the text itself."""
    m = _FENCE.search(text)
    return (m.group(1) if m else text).strip()


def to_csv(records: list[dict[str, Any]], columns: list[str]) -> str:
    return "\n".join([",".join(columns), *(",".join(str(r[c]) for c in columns) for r in records)])


def to_json(records: list[dict[str, Any]]) -> str:
    return json.dumps(records, indent=2)


def csv_cells(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()]


def same_json(a: Any, b: Any) -> bool:
    """Equal with types: Python's == calls 1, 1.0 and True equal; JSON tasks must not."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class ConvertDomain(Domain):
    name = "convert"
    tools = ()

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        direction = rng.choice(DIRECTIONS)
        fields = rng.sample(FIELDS[split], rng.randint(2, 5))
        words = WORDS[split]
        records = [
            {name: rng.randint(-50, 9999) if kind == "int" else rng.choice(words) for name, kind in fields}
            for _ in range(rng.randint(2, 6))
        ]
        names = [name for name, _ in fields]
        if direction == "json2csv":
            # Ask for the columns in a new order, sometimes leaving some out: conversion, not copying.
            columns = rng.sample(names, rng.randint(min(2, len(names)), len(names)))
            source = json.dumps(records, indent=2) if rng.random() < 0.5 else json.dumps(records)
            answer = to_csv(records, columns)
            question = (f"Convert this JSON to CSV with columns {','.join(columns)} (a header line, then one line "
                        f"per record, values separated by commas):\n\n{source}")
            left_out = [n for n in names if n not in columns]
            reasoning = (f"{len(records)} records. The header is {','.join(columns)}"
                         + (f" ({', '.join(left_out)} left out)" if left_out else "")
                         + "; each record becomes one line with its values in that order.")
        else:
            columns = names
            source = to_csv(records, columns)
            answer = to_json(records)
            question = ("Convert this CSV to a JSON list of objects, one object per row, keys from the header; "
                        f"write whole numbers as JSON integers:\n\n{source}")
            ints = [name for name, kind in fields if kind == "int"]
            reasoning = (f"{len(records)} rows with columns {', '.join(columns)}. "
                         + (f"{', '.join(ints)} hold{'s' if len(ints) == 1 else ''} whole numbers, written as "
                            "integers; the rest are strings." if ints else "Every value is a word, so a string."))
        return self.task(seed, split, question, answer, [assistant_message(answer, reasoning)],
                         {"direction": direction, "records": records, "columns": columns})

    def reward(self, task: Task, completion: str) -> float:
        m = task.meta
        text = strip_fence(completion)
        if m["direction"] == "json2csv":
            return 1.0 if csv_cells(text) == csv_cells(to_csv(m["records"], m["columns"])) else 0.0
        for candidate in (text, text[text.find("[") : text.rfind("]") + 1]):
            try:
                got = json.loads(candidate)
            except ValueError:
                continue
            return 1.0 if same_json(got, m["records"]) else 0.0
        return 0.0

    def key(self, task: Task) -> str:
        m = task.meta
        return f"{m['direction']}:{json.dumps(m['records'], sort_keys=True)}:{','.join(m['columns'])}"
