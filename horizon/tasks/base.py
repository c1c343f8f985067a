"""The task framework every training domain uses: the Task record, the Domain interface, the registry,
split generation with de-duplication, and the train/held-out disjointness check.

A domain generates verifiable tasks deterministically from ``(seed, split)``, renders them as chat
messages (the shape ``horizon.chat`` accepts), gives a reference trajectory for supervised training,
and scores a model's final answer with a reward in [0, 1].

Splits. Train and held-out tasks never share a question:
  * disjoint seeds: a domain's random stream is keyed by ``(name, split, seed)`` (see ``Domain.rng``),
    so seed 5 of "train" and seed 5 of "heldout" are unrelated draws, and task ids carry the split;
  * disjoint values: each domain partitions its value space (documented in its module) and draws
    held-out tasks only from the held-out part, so no amount of training seeds reaches them.
``check_disjoint`` verifies the second property on concrete task lists by ``Domain.key``.
"""

from __future__ import annotations

import json
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

SPLITS = ("train", "heldout")


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    return split


@dataclass
class Task:
    """One verifiable task. ``messages`` is the prompt; ``messages + target`` is a full training chat."""

    domain: str
    id: str  # stable: f"{domain}-{split}-{seed}"
    split: str  # "train" | "heldout"
    seed: int
    messages: list[dict[str, Any]]  # system? + user, chat format (user content may hold image parts)
    answer: str  # the reference final answer
    # A reference assistant trajectory: assistant message(s) with reasoning_content and content, and
    # optionally tool calls followed by their tool results, ending with the final answer.
    target: list[dict[str, Any]]
    tools: list[str] = field(default_factory=list)  # toolset names (horizon.agent.registry.TOOLSETS)
    meta: dict[str, Any] = field(default_factory=dict)  # the values used, for de-duplication and analysis

    def __post_init__(self) -> None:
        check_split(self.split)

    def chat(self) -> list[dict[str, Any]]:
        """The prompt followed by the reference trajectory (what supervised training renders)."""
        return [*self.messages, *self.target]


class Domain(ABC):
    """A task domain. Subclasses set ``name`` and ``tools`` and implement generate, reward and key.

    ``generate`` must be a pure function of ``(seed, split)``: draw every value from ``self.rng``.
    ``reward`` reads the model's final answer text tolerantly (each domain documents how).
    ``key`` says what makes two tasks the same question: tasks with equal keys are duplicates within
    a split, and must never occur in both splits.
    """

    name: str = ""
    tools: Sequence[str] = ()

    def rng(self, seed: int, split: str) -> random.Random:
        # A string seed is hashed (SHA-512) by random.Random: stable across processes and Python runs.
        return random.Random(f"{self.name}:{check_split(split)}:{seed}")

    def task_id(self, seed: int, split: str) -> str:
        return f"{self.name}-{split}-{seed}"

    def task(self, seed: int, split: str, content: Any, answer: str, target: list[dict[str, Any]],
             meta: dict[str, Any]) -> Task:
        """A task whose prompt is one user message with `content` (text or content parts)."""
        return Task(domain=self.name, id=self.task_id(seed, split), split=split, seed=seed,
                    messages=[{"role": "user", "content": content}], answer=answer, target=target,
                    tools=list(self.tools), meta=meta)

    @abstractmethod
    def generate(self, seed: int, split: str) -> Task: ...

    @abstractmethod
    def reward(self, task: Task, completion: str) -> float: ...

    @abstractmethod
    def key(self, task: Task) -> str: ...

    def brief_reasoning(self, task: Task) -> str | None:
        """The shortest thought that still carries the answer, for a domain where thinking does not help
        beyond that (``horizon train --brief``: references of varied thinking length, so RL with a thinking
        cost has shorter thoughts to choose); None where the domain has none."""
        return None

    def brief(self, task: Task) -> Task | None:
        """``task`` with its reference's thought replaced by ``brief_reasoning`` (None where there is none)."""
        reasoning = self.brief_reasoning(task)
        if reasoning is None:
            return None
        *before, last = task.target
        return replace(task, target=[*before, {**last, "reasoning_content": reasoning}])


# The registry: name -> domain instance. ``horizon/tasks/__init__.py`` registers the built-in domains.
DOMAINS: dict[str, Domain] = {}


def register(domain: Domain) -> Domain:
    if not domain.name:
        raise ValueError(f"{type(domain).__name__} has no name")
    if domain.name in DOMAINS and DOMAINS[domain.name] is not domain:
        raise ValueError(f"a domain named {domain.name!r} is already registered")
    DOMAINS[domain.name] = domain
    return domain


def get_domain(name: str | Domain) -> Domain:
    if isinstance(name, Domain):
        return name
    if name not in DOMAINS:
        raise ValueError(f"unknown task domain {name!r}; allowed: {', '.join(sorted(DOMAINS)) or '(none registered)'}")
    return DOMAINS[name]


def make_split(
    domain: str | Domain, split: str, n: int, start_seed: int = 0, *, max_tries: int | None = None
) -> list[Task]:
    """``n`` tasks of one split from seeds ``start_seed, start_seed + 1, ...``, skipping any whose key
    repeats an earlier one. Raises ValueError when ``max_tries`` seeds (default ``20 * n + 1000``) do
    not give ``n`` distinct tasks: the domain's value space for that split is (nearly) exhausted."""
    dom = get_domain(domain)
    check_split(split)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    limit = 20 * n + 1000 if max_tries is None else max_tries
    tasks: list[Task] = []
    seen: set[str] = set()
    seed = start_seed
    while len(tasks) < n:
        if seed - start_seed >= limit:
            raise ValueError(
                f"{dom.name}/{split}: only {len(tasks)} distinct tasks of {n} in {limit} seeds from {start_seed}"
            )
        task = dom.generate(seed, split)
        k = dom.key(task)
        if k not in seen:
            seen.add(k)
            tasks.append(task)
        seed += 1
    return tasks


def check_disjoint(train_tasks: Iterable[Task], heldout_tasks: Iterable[Task]) -> None:
    """Raise ValueError if a train task and a held-out task are the same question (equal domain and
    key; the message names the keys), or if a task sits in the list of the other split."""
    keys: dict[str, set[str]] = {}
    for split, tasks in (("train", train_tasks), ("heldout", heldout_tasks)):
        found = keys.setdefault(split, set())
        for task in tasks:
            if task.split != split:
                raise ValueError(f"task {task.id} is labelled {task.split!r} but was given as {split}")
            found.add(f"{task.domain}:{get_domain(task.domain).key(task)}")
    overlap = sorted(keys["train"] & keys["heldout"])
    if overlap:
        shown = ", ".join(overlap[:10]) + (f" and {len(overlap) - 10} more" if len(overlap) > 10 else "")
        raise ValueError(f"{len(overlap)} key(s) occur in both train and heldout: {shown}")


# Chat-format builders for targets, so every domain writes the same message shapes.


def assistant_message(
    content: str, reasoning: str | None, tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "reasoning_content": reasoning, "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    # Arguments as JSON text, serialised the way the model is trained to write JSON (see chat.messages).
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def tool_message(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# Answer parsing shared by numeric domains.

# A number as people write it: optional sign, digits with optional thousands commas, optional decimals.
# The lookarounds keep digits glued to letters ("v2", "3rd" aside) from being read as a number.
_NUMBER = re.compile(r"(?<![\w.])([-+]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w])")


def first_int(text: str) -> int | None:
    """The first number in ``text`` if it is an integer ("1,234" -> 1234, "12.0" -> 12), else None
    (no number, or the first number is "2.5"). A number glued to letters ("x2", "2nd") is skipped."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    sign, whole, frac = m.groups()
    if frac and frac.strip("0"):
        return None
    value = int(whole.replace(",", ""))
    return -value if sign == "-" else value


def int_reward(task: Task, completion: str) -> float:
    """The reward of domains whose answer is one integer: 1.0 if the completion's first integer
    (``first_int``) is the task's answer, else 0.0."""
    got = first_int(completion)
    return 1.0 if got is not None and str(got) == task.answer else 0.0
