"""`seeded_tree(seed, n_files)`: deterministic, plausible small project trees for the terminal task domain.

README.md, src/<pkg>/*.py, tests/, logs/*.log, data/*.csv, notes/*.md, config/*.json and a .gitignore, as
`{path: text}`, the same for the same seed; `SimFS.from_dict(seeded_tree(seed))` turns one into a file system.

It is kept apart from the file system and the shell because it is task data, not machinery: its word lists
and generators change with the tasks, while `SimFS` and `Terminal` do not depend on it.
"""

from __future__ import annotations

import json
import random

# ---- deterministic project-like trees for task generators ----

_WORDS = ["alpha", "beta", "cache", "client", "config", "data", "engine", "event", "handler", "index", "loader",
          "metrics", "model", "parser", "queue", "report", "router", "schema", "server", "session", "store",
          "stream", "task", "token", "user", "utils", "worker"]
_SERVICES = ["api", "auth", "billing", "db", "gateway", "scheduler", "search", "web"]
_MESSAGES = {
    "INFO": ["request completed in {n} ms", "started worker {n}", "cache hit ratio {n}%", "user {n} logged in",
             "loaded {n} records", "health check ok"],
    "DEBUG": ["retrying connection (attempt {n})", "queue depth {n}", "flushed {n} bytes"],
    "WARN": ["slow query took {n} ms", "disk usage at {n}%", "deprecated endpoint called {n} times"],
    "ERROR": ["connection refused on port {n}", "timeout after {n} s", "failed to parse record {n}",
              "out of memory in worker {n}"],
}
_TOPICS = ["meeting", "roadmap", "design", "ideas", "todo", "release", "incident", "onboarding"]


def _py_module(rng: random.Random, name: str) -> str:
    out = [f'"""The {name} module."""\n', "\n"]
    if rng.random() < 0.5:
        out += [f"import {rng.choice(['os', 'json', 're', 'math', 'time'])}\n", "\n"]
    for _ in range(rng.randint(1, 4)):
        fn = f"{rng.choice(['get', 'load', 'parse', 'build', 'check', 'update'])}_{rng.choice(_WORDS)}"
        arg = rng.choice(["value", "items", "path", "count", "key"])
        out.append(f"\ndef {fn}({arg}):\n")
        if rng.random() < 0.3:
            out.append(f"    # TODO: handle empty {arg}\n")
        if rng.random() < 0.15:
            out.append("    # FIXME: this is slow\n")
        out.append(f"    return {arg}{rng.choice([' * 2', ' + 1', '', '[:10]'])}\n")
    return "".join(out)


def _log(rng: random.Random) -> str:
    day, secs = rng.randint(1, 28), rng.randint(0, 40000)
    lines = []
    for _ in range(rng.randint(5, 40)):
        secs += rng.randint(1, 600)
        level = rng.choices(["INFO", "DEBUG", "WARN", "ERROR"], weights=[60, 20, 12, 8])[0]
        msg = rng.choice(_MESSAGES[level]).format(n=rng.randint(1, 9999))
        h, m, s = secs // 3600 % 24, secs // 60 % 60, secs % 60
        lines.append(f"2024-03-{day:02d} {h:02d}:{m:02d}:{s:02d} {level} {rng.choice(_SERVICES)}: {msg}\n")
    return "".join(lines)


def _csv(rng: random.Random) -> str:
    cols = rng.sample(["id", "name", "price", "qty", "city", "score", "status"], k=rng.randint(2, 5))
    rows = [",".join(cols) + "\n"]
    for i in range(rng.randint(3, 20)):
        vals = []
        for c in cols:
            if c == "id":
                vals.append(str(i + 1))
            elif c in ("price", "score"):
                vals.append(f"{rng.uniform(0, 100):.2f}")
            elif c == "qty":
                vals.append(str(rng.randint(0, 50)))
            elif c == "status":
                vals.append(rng.choice(["ok", "pending", "failed"]))
            else:
                vals.append(rng.choice(["Oslo", "Lima", "Pune", "Kyiv", "Accra", "Quito", "ann", "bob", "chen"]))
        rows.append(",".join(vals) + "\n")
    return "".join(rows)


def _note(rng: random.Random, topic: str) -> str:
    out = [f"# {topic.capitalize()} notes\n", "\n"]
    for _ in range(rng.randint(2, 8)):
        mark = rng.choice(["- ", "- [ ] ", "- [x] ", "- TODO: "])
        out.append(f"{mark}{rng.choice(_WORDS)} {rng.choice(['needs review', 'is done', 'ask ann', 'move to v2'])}\n")
    return "".join(out)


def seeded_tree(seed: int, n_files: int = 20) -> dict[str, str]:
    """A plausible small project as `{path: text}` (exactly n_files files), the same for the same seed:
    README.md, src/<pkg>/*.py, tests/, logs/*.log, data/*.csv, notes/*.md, config/*.json, a .gitignore."""
    if n_files < 1:
        raise ValueError("n_files must be at least 1")
    rng = random.Random(seed)
    pkg = rng.choice(_WORDS)
    files: dict[str, str] = {"README.md": f"# {pkg}\n\nA small {rng.choice(_WORDS)} service.\n"
                                          f"Run `python -m {pkg}` to start.\n"}
    kinds = ["py", "py", "test", "log", "log", "csv", "note", "config", "hidden"]
    attempts = 0
    while len(files) < n_files:
        attempts += 1
        kind = rng.choice(kinds)
        word = rng.choice(_WORDS)
        suffix = "" if attempts < 4 * n_files else str(attempts)  # unique names even for large n_files
        if kind == "py":
            path, text = f"src/{pkg}/{word}{suffix}.py", _py_module(rng, word)
        elif kind == "test":
            path = f"tests/test_{word}{suffix}.py"
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            text = f"from {pkg}.{word} import *\n\n\ndef test_{word}():\n    assert {a} == {b}\n"
        elif kind == "log":
            path, text = f"logs/{rng.choice(_SERVICES)}-2024-03-{rng.randint(1, 28):02d}{suffix}.log", _log(rng)
        elif kind == "csv":
            path, text = f"data/{word}{suffix}.csv", _csv(rng)
        elif kind == "note":
            topic = rng.choice(_TOPICS)
            path, text = f"notes/{topic}{suffix}.md", _note(rng, topic)
        elif kind == "config":
            cfg = {"name": word, "port": rng.randint(1024, 9999), "debug": rng.random() < 0.3,
                   "workers": rng.randint(1, 16)}
            path, text = f"config/{word}{suffix}.json", json.dumps(cfg, indent=2) + "\n"
        else:
            path, text = f".gitignore{suffix}", "__pycache__/\n*.log\n.env\n"
        if path not in files:
            files[path] = text
    return dict(sorted(files.items()))
