"""The README and docs/ against the code: the two set-up commands exist, and every `horizon ...` command line
they show names a real subcommand with flags it accepts (and every subcommand is documented)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from horizon.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def command_lines() -> list[tuple[str, str]]:
    """(file, command line) for each `horizon SUB ...` line in a shell code block (continuations joined)."""
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0].strip()
                m = re.match(r"(?:\.venv/bin/)?horizon (\w[\w-]*)(.*)", line)
                if m:
                    out.append((doc.name, line))
    return out


def test_the_readme_starts_with_the_two_set_up_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split()[:2] for line in first.strip().splitlines()] == [["make", "serve"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^serve:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_every_documented_command_line_parses():
    subs = subparsers()
    lines = command_lines()
    assert len(lines) >= 10  # the README and docs do show commands
    for where, line in lines:
        words = shlex.split(line)
        sub = words[words.index(next(w for w in words if w.endswith("horizon"))) + 1]
        assert sub in subs, f"{where}: `{line}` names no subcommand (have: {', '.join(subs)})"
        known = {s for a in subs[sub]._actions for s in a.option_strings}
        for word in words:
            flag = word.split("=", 1)[0].strip("[]")  # `[--flag]`: an optional part of the usage
            if flag.startswith("--"):
                assert flag in known, f"{where}: `{line}`: horizon {sub} has no {flag}"


def test_every_subcommand_is_documented():
    shown = {shlex.split(line)[1] for _, line in command_lines()}
    text = " ".join(d.read_text(encoding="utf-8") for d in DOCS)
    for sub in subparsers():
        assert sub in shown or f"horizon {sub}" in text, f"`horizon {sub}` appears nowhere in README.md or docs/"
