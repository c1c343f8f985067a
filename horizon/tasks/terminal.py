"""The terminal domain: multi-step tasks over a simulated project folder, worked through the ``terminal`` tool.

Each task has its own initial tree, ``seeded_tree(tree_seed, n_files)`` (12-24 files: src/, tests/, logs/,
data/, notes/, config/), stored as ``task.meta["files"]`` ({path: text}), so a rollout rebuilds the exact
file system with ``task_fs(task)`` and gives the model ``Terminal(task_fs(task))``. (The registry's
``make_tools(["terminal"], seed=...)`` builds a different, fixed-size tree: use it for the tool's spec only.)

Kinds, drawn in a random order from those the tree allows (a tree without src/ has no "define" task):
  question kinds, scored on the final answer by ``reward``:
    * count: "How many lines in logs/X.log contain ERROR?" (ERROR, WARN, INFO or DEBUG). Answer: the count.
    * define: "Which file under src/ defines the function Y?" (Y defined in exactly one file). Answer: the path.
  state kinds, scored on the end state of the file system by ``reward_state(task, fs)``:
    * create: create DIR/NAME.txt holding one given line (DIR made when missing).
    * move: rename a file, move it into a new folder, or both.
    * report: count the lines of a log with a level and write just that number to reports/NAME.txt.

Target trajectory: several assistant turns, each with short reasoning and one ``terminal`` call (``ls``,
``wc -l``, ``grep -c``, ``find``, ``mkdir -p``, ``echo ... >``, ``mv``, ``cat``), each followed by the tool
message holding what that command really prints when the calls run in order on a fresh
``SimFS.from_dict(meta["files"])`` (checked at generation: no call fails, and a state task's calls reach
``reward_state == 1.0``), then a final assistant turn with the answer (question kinds) or a one-line report
of what was done (state kinds).

Split rule: a tree seed (0-999999) is held out when it is a multiple of 5, so train and held-out tasks never
share a file tree; the key holds the tree seed, so the splits never share a key. The names and text that
state tasks invent (file names, folder names, rename suffixes, the line to write) come from vocabularies
that differ per split (``VOCAB``), so held-out state tasks also ask for names train never wrote. Seeds are
disjoint too (``Domain.rng`` is keyed by the split).

Key (de-duplication): kind, tree seed, tree size and the task's target ("count:1234:17:logs/db.log:ERROR").

Rewards:
  * ``reward(task, completion)``: count tasks: 1.0 if the first integer (``base.first_int``) equals the
    count; define tasks: 1.0 if the first path-like word (one holding a "/"), compared case-insensitively
    without surrounding quotes, backticks, a leading "./" or "/" and trailing punctuation, is the path.
    State tasks always get 0.0 from ``reward``: a completion's text cannot show that the files changed.
  * ``reward_state(task, fs)``: state tasks only (ValueError for a question kind): 1.0 if the end state
    holds the change asked for (the new file's text equal after stripping surrounding whitespace; a moved
    file's text unchanged at the destination and gone from the source) and every other original file is
    still there unchanged (extra new files and folders are allowed), else 0.0.
  * ``score(task, completion, fs)`` picks the right one.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from horizon.simfs import SimFS, Terminal, seeded_tree
from horizon.tasks.base import Domain, Task, assistant_message, first_int, tool_call, tool_message

HELDOUT_MOD = 5
TREE_SEEDS = 1_000_000
MIN_FILES, MAX_FILES = 12, 24
LEVELS = ("ERROR", "WARN", "INFO", "DEBUG")
QUESTION_KINDS = ("count", "define")
STATE_KINDS = ("create", "move", "report")
PREAMBLE = "You have a terminal in a project folder (the current directory). "

# Names and text invented by state tasks, disjoint between the splits (see the module docstring).
VOCAB: dict[str, dict[str, list[str]]] = {
    "train": {
        "stem": ["summary", "status", "digest", "overview", "plan", "checklist"],
        "dir": ["archive", "backup", "old", "done"],
        "suffix": ["-old", "-v1", "-2023", "-copy"],
        "verb": ["Review", "Update", "Document", "Test", "Deploy", "Clean up"],
        "object": ["parser", "cache", "router", "schema", "worker", "login page"],
    },
    "heldout": {
        "stem": ["recap", "brief", "memo", "synopsis", "agenda"],
        "dir": ["attic", "vault", "retired", "shelf"],
        "suffix": ["-prev", "-orig", "-2022", "-bak"],
        "verb": ["Audit", "Refactor", "Benchmark", "Migrate", "Profile"],
        "object": ["indexer", "scheduler", "gateway", "billing job", "search API"],
    },
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


def tree_heldout(tree_seed: int) -> bool:
    return tree_seed % HELDOUT_MOD == 0


def task_fs(task: Task) -> SimFS:
    """The task's initial file system (a fresh copy each call)."""
    return SimFS.from_dict(task.meta["files"])


def norm_path(text: str) -> str:
    """A path as compared by the reward: no surrounding quotes/backticks/punctuation, no leading ./ or /,
    lower case."""
    p = text.strip().strip("`'\"*").rstrip(".,;:!?)").strip("`'\"*")
    while p.startswith("./"):
        p = p[2:]
    return p.lstrip("/").lower()


_PATHLIKE = re.compile(r"[^\s]*/[^\s]*")


class _Script:
    """Runs the target's commands in order on the task's file system and records the trajectory."""

    def __init__(self, files: dict[str, str]):
        self.terminal = Terminal(SimFS.from_dict(files))
        self.target: list[dict[str, Any]] = []

    def run(self, reasoning: str, command: str) -> str:
        call_id = f"call_{len(self.target) // 2 + 1}"
        result = self.terminal.run({"command": command})
        if result.is_error:  # a target never shows a failing command
            raise RuntimeError(f"target command {command!r} failed: {result.content}")
        self.target += [
            assistant_message("", reasoning, [tool_call(call_id, "terminal", {"command": command})]),
            tool_message(call_id, result.content),
        ]
        return result.content

    def finish(self, content: str, reasoning: str) -> None:
        self.target.append(assistant_message(content, reasoning))


def _lines_with(text: str, word: str) -> int:
    return sum(word in line for line in text.splitlines())


def _dirs(files: dict[str, str]) -> set[str]:
    return {p.rsplit("/", 1)[0] for p in files if "/" in p}


# Kind builders: (rng, files, split) -> (question, script, answer, meta) or None when the tree does not allow it.
Built = tuple[str, _Script, str, dict[str, Any]] | None


def _log_and_level(rng: random.Random, files: dict[str, str]) -> tuple[str, str] | None:
    """A random log file and a log level to look for (None when the tree has no logs)."""
    logs = sorted(p for p in files if p.startswith("logs/"))
    if not logs:
        return None
    return rng.choice(logs), rng.choices(LEVELS, weights=[4, 3, 2, 2])[0]


def _count(rng: random.Random, files: dict[str, str], split: str) -> Built:
    picked = _log_and_level(rng, files)
    if picked is None:
        return None
    path, level = picked
    s = _Script(files)
    s.run("I'll list the log files to find the one asked about.", "ls logs")
    total = s.run(f"{path} is there. Let me see how long it is.", f"wc -l {path}").split()[0]
    count = int(s.run(f"Now I'll count the lines that contain {level}.", f"grep -c {level} {path}"))
    if count != _lines_with(files[path], level):
        raise RuntimeError(f"grep -c {level} {path} gave {count}")
    s.finish(str(count), f"grep -c found {count} of the {total} lines containing {level}, so the answer is {count}.")
    question = f"How many lines in {path} contain {level}? Answer with a number."
    return question, s, str(count), {"path": path, "level": level, "count": count}


def _define(rng: random.Random, files: dict[str, str], split: str) -> Built:
    where: dict[str, set[str]] = {}
    for p, text in files.items():
        if p.startswith("src/") and p.endswith(".py"):
            for name in re.findall(r"^def (\w+)\(", text, re.M):
                where.setdefault(name, set()).add(p)
    unique = sorted(name for name, paths in where.items() if len(paths) == 1)
    if not unique:
        return None
    name = rng.choice(unique)
    (path,) = where[name]
    s = _Script(files)
    s.run("I'll list the Python files under src/ first.", "find src -name '*.py'")
    found = s.run(f"Now I'll search them for the definition of {name}.", f"grep -rlF 'def {name}(' src")
    if found != path + "\n":
        raise RuntimeError(f"grep found {found!r} for {name}, expected {path}")
    line = s.run(f"Only {path} matches. Let me confirm the line.", f"grep -nF 'def {name}(' {path}")
    s.finish(path, f"{path} defines {name} (line {line.split(':')[0]}), and no other file under src/ does.")
    question = f"Which file under src/ defines the function {name}? Answer with the file's path."
    return question, s, path, {"function": name, "path": path}


def _create(rng: random.Random, files: dict[str, str], split: str) -> Built:
    v = VOCAB[split]
    folder = rng.choice(["notes", "docs", "reports"])
    path = f"{folder}/{rng.choice(v['stem'])}.txt"
    text = f"{rng.choice(v['verb'])} the {rng.choice(v['object'])} by {rng.choice(DAYS)}."
    s = _Script(files)
    s.run("Let me look at the project's top level first.", "ls")
    if folder in _dirs(files):
        s.run(f"{folder}/ exists; let me see what is in it.", f"ls {folder}")
    else:
        s.run(f"There is no {folder}/ folder yet, so I'll create it.", f"mkdir -p {folder}")
    s.run("Now I'll write the line to the file.", f"echo '{text}' > {path}")
    s.run("Let me check what the file holds.", f"cat {path}")
    s.finish(f"Created {path} containing: {text}", "The file holds exactly the requested line, so the task is done.")
    question = f"Create the file {path} containing exactly this line: {text}"
    return question, s, path, {"path": path, "text": text}


def _move(rng: random.Random, files: dict[str, str], split: str) -> Built:
    sources = sorted(p for p in files if p.split("/")[0] in ("data", "notes", "config", "logs"))
    if not sources:
        return None
    v = VOCAB[split]
    src = rng.choice(sources)
    parent, leaf = src.rsplit("/", 1)
    stem, dot, ext = leaf.rpartition(".")
    mode = rng.choice(["rename", "into", "both"])
    renamed = f"{stem}{rng.choice(v['suffix'])}{dot}{ext}" if mode != "into" else leaf
    folder = parent if mode == "rename" else rng.choice(v["dir"])
    dest = f"{folder}/{renamed}"
    s = _Script(files)
    s.run(f"Let me check that {src} is there.", f"ls {parent}")
    if folder not in _dirs(files):
        s.run(f"The folder {folder}/ does not exist yet, so I'll create it.", f"mkdir -p {folder}")
    s.run("Now I'll move the file.", f"mv {src} {dest}")
    s.run("Let me check the result.", f"ls {folder}")
    s.finish(f"Moved {src} to {dest}.", f"{renamed} is now in {folder}/, so the file has been moved.")
    verb = "Rename" if mode == "rename" else "Move"
    question = f"{verb} {src} to {dest}" + (" (create the folder if needed)." if mode != "rename" else ".")
    return question, s, dest, {"src": src, "dest": dest, "mode": mode}


def _report(rng: random.Random, files: dict[str, str], split: str) -> Built:
    picked = _log_and_level(rng, files)
    if picked is None:
        return None
    log, level = picked
    path = f"reports/{level.lower()}-{rng.choice(VOCAB[split]['stem'])}.txt"
    s = _Script(files)
    s.run("I'll list the log files first.", "ls logs")
    count = int(s.run(f"Now I'll count the {level} lines in {log}.", f"grep -c {level} {log}"))
    if count != _lines_with(files[log], level):
        raise RuntimeError(f"grep -c {level} {log} gave {count}")
    if "reports" not in _dirs(files):
        s.run("There is no reports/ folder yet, so I'll create it.", "mkdir -p reports")
    s.run("Now I'll write the count to the file.", f"grep -c {level} {log} > {path}")
    s.run("Let me check the file.", f"cat {path}")
    s.finish(f"Wrote {count} to {path}.", f"{path} holds {count}, the number of {level} lines in {log}.")
    question = (f"Count the lines in {log} that contain {level} and write just that number to {path} "
                "(create the folder if needed).")
    return question, s, path, {"log": log, "level": level, "count": count, "path": path}


BUILDERS: dict[str, Callable[[random.Random, dict[str, str], str], Built]] = {
    "count": _count, "define": _define, "create": _create, "move": _move, "report": _report,
}


class TerminalDomain(Domain):
    name = "terminal"
    tools = ("terminal",)

    def generate(self, seed: int, split: str) -> Task:
        rng = self.rng(seed, split)
        heldout = split == "heldout"
        while True:  # rejection: one tree seed in five is held out
            tree_seed = rng.randrange(TREE_SEEDS)
            if tree_heldout(tree_seed) == heldout:
                break
        n_files = rng.randint(MIN_FILES, MAX_FILES)
        files = seeded_tree(tree_seed, n_files)
        kinds = list(BUILDERS)
        rng.shuffle(kinds)
        for kind in kinds:  # the first kind this tree allows ("create" always works)
            built = BUILDERS[kind](rng, files, split)
            if built is not None:
                break
        assert built is not None
        question, script, answer, extra = built
        task = self.task(seed, split, PREAMBLE + question, answer, script.target,
                         {"kind": kind, "state": kind in STATE_KINDS, "tree_seed": tree_seed, "n_files": n_files,
                          **extra, "files": files})
        if task.meta["state"] and self.reward_state(task, script.terminal.fs) != 1.0:
            raise RuntimeError(f"{task.id}: the target does not reach the asked-for state")
        return task

    def reward(self, task: Task, completion: str) -> float:
        kind = task.meta["kind"]
        if kind == "count":
            got = first_int(completion)
            return 1.0 if got is not None and got == task.meta["count"] else 0.0
        if kind == "define":
            found = _PATHLIKE.search(completion)
            candidate = found.group() if found else completion
            return 1.0 if norm_path(candidate) == norm_path(task.answer) else 0.0
        return 0.0  # state kinds: see reward_state

    def reward_state(self, task: Task, fs: SimFS) -> float:
        """1.0 if ``fs`` (the end state of a rollout started from ``task_fs(task)``) holds what a state task
        asked for and keeps every other original file unchanged, else 0.0."""
        m = task.meta
        if not m["state"]:
            raise ValueError(f"{task.id} is a {m['kind']!r} question task: score it with reward(task, completion)")

        def text(path: str) -> str | None:
            return fs.read("/" + path) if fs.is_file("/" + path) else None

        moved = m["src"] if m["kind"] == "move" else None
        for path, content in m["files"].items():
            if content is None or path.endswith("/"):  # a folder of a custom tree: still a folder
                if not fs.is_dir("/" + path):
                    return 0.0
            elif path != moved and text(path) != content:
                return 0.0
        if m["kind"] == "create":
            got = text(m["path"])
            return 1.0 if got is not None and got.strip() == m["text"] else 0.0
        if m["kind"] == "move":
            return 1.0 if not fs.exists("/" + moved) and text(m["dest"]) == m["files"][moved] else 0.0
        got = text(m["path"])  # report
        return 1.0 if got is not None and got.strip() == str(m["count"]) else 0.0

    def score(self, task: Task, completion: str, fs: SimFS | None = None) -> float:
        """``reward`` for question kinds, ``reward_state`` on ``fs`` for state kinds (0.0 without one)."""
        if task.meta["state"]:
            return self.reward_state(task, fs) if fs is not None else 0.0
        return self.reward(task, completion)

    def key(self, task: Task) -> str:
        m = task.meta
        target = {"count": ("path", "level"), "define": ("function",), "create": ("path", "text"),
                  "move": ("src", "dest"), "report": ("log", "level", "path")}[m["kind"]]
        return ":".join([m["kind"], str(m["tree_seed"]), str(m["n_files"]), *(str(m[k]) for k in target)])
