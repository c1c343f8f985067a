"""Named toolsets: what `make_tools(["files", "shell"], root)` builds for an agent run or a training task.

    calculator -> Calculator()
    files      -> ListFiles, ReadFile, WriteFile, SearchFiles confined to `root`   (needs a root; created if missing)
    shell      -> Shell(workdir=root)                                               (needs a root; created if missing)
    terminal   -> Terminal over a SimFS: seeded_tree(seed) when a seed is given, else empty
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from horizon.simfs.fs import SimFS  # the submodules, not horizon.simfs: see horizon/simfs/__init__.py
from horizon.simfs.shell import Terminal
from horizon.simfs.tree import seeded_tree

from .calculator import Calculator
from .files import ListFiles, ReadFile, SearchFiles, WriteFile
from .shell import Shell
from .tool import Tool

TERMINAL_FILES = 20  # files in a seeded terminal tree
FILE_TOOLS = (ListFiles, ReadFile, WriteFile, SearchFiles)


def _need_root(name: str, root: Path | None) -> Path:
    if root is None:
        raise ValueError(f"toolset {name!r} needs a root folder (root=...)")
    root.mkdir(parents=True, exist_ok=True)  # a fresh task folder may not exist yet
    return root


TOOLSETS: dict[str, Callable[[Path | None, int | None], list[Tool]]] = {
    "calculator": lambda root, seed: [Calculator()],
    "files": lambda root, seed: [cls(_need_root("files", root)) for cls in FILE_TOOLS],
    "shell": lambda root, seed: [Shell(workdir=_need_root("shell", root))],
    "terminal": lambda root, seed: [
        Terminal(SimFS.from_dict(seeded_tree(seed, TERMINAL_FILES)) if seed is not None else SimFS())],
}


def make_tools(names: list[str], root: str | Path | None = None, *, seed: int | None = None) -> list[Tool]:
    """The tools of the named toolsets, in order. ValueError for an unknown name, a toolset that needs a root
    without one, or two tools with the same name."""
    unknown = [n for n in names if n not in TOOLSETS]
    if unknown:
        raise ValueError(f"unknown toolset(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(TOOLSETS)}")
    path = Path(root) if root is not None else None
    tools: list[Tool] = []
    for name in names:
        tools.extend(TOOLSETS[name](path, seed))
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise ValueError(f"two tools are named {t.name!r} (is a toolset listed twice?); tool names must be unique")
        seen.add(t.name)
    return tools
