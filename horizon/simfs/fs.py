"""The simulated file system: `SimFS`, an in-memory tree with a current directory, and `SimFSError`.

`SimFS` is an in-memory tree (a directory is a dict of name -> node, a file is its text) with a current
directory. It is deterministic: listings are sorted, nothing reads the clock or the real disk. Training code
builds one with `SimFS.from_dict({path: content})` (or from `seeded_tree(seed, n_files)`), lets the model
work through `Terminal`, and checks the end state with `to_dict()` / `snapshot()` / `==`.

It is kept apart from the shell (`horizon.simfs.shell`) because it is plain data with no command language and
no tool interface: a grader can build, copy and compare trees without the terminal.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

Node = dict[str, Any] | str  # a directory (name -> Node) or a file's text

MAX_NODES = 100_000  # cp refuses to grow the tree past this (cp -r doubling a tree is otherwise unbounded)


class SimFSError(Exception):
    """A failed operation, with a bash-like message for the model."""


class SimFS:
    def __init__(self) -> None:
        self.tree: dict[str, Any] = {}
        self.cwd: tuple[str, ...] = ()

    # ---- building and comparing ----

    @classmethod
    def from_dict(cls, files: Mapping[str, str | None]) -> SimFS:
        """`{"src/a.py": "text", "empty/": None}`: a key ending in '/' (or a None value) is a directory.
        Leading '/' is optional; parents are created."""
        fs = cls()
        for path, content in sorted(files.items()):
            if path.endswith("/") or content is None:
                fs.mkdir("/" + path.strip("/"), parents=True, exist_ok=True)
            else:
                fs.write("/" + path.lstrip("/"), content, parents=True)
        return fs

    def to_dict(self) -> dict[str, str | None]:
        """Every file as `path: text` and every empty directory as `path/: None` (paths relative to the root,
        sorted); `from_dict(fs.to_dict()) == fs`."""
        out: dict[str, str | None] = {}

        def visit(node: dict[str, Any], prefix: str) -> None:
            for name in sorted(node):
                child = node[name]
                if isinstance(child, dict):
                    if child:
                        visit(child, prefix + name + "/")
                    else:
                        out[prefix + name + "/"] = None
                else:
                    out[prefix + name] = child

        visit(self.tree, "")
        return out

    def snapshot(self) -> tuple[tuple[str, str | None], ...]:
        """A hashable image of the tree (not the cwd), equal for equal trees."""
        return tuple(self.to_dict().items())

    def copy(self) -> SimFS:
        fs = SimFS()
        fs.tree = copy.deepcopy(self.tree)
        fs.cwd = self.cwd
        return fs

    def __eq__(self, other: object) -> bool:  # the trees, not the cwd
        return isinstance(other, SimFS) and self.tree == other.tree

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"SimFS({len(self.to_dict())} entries, cwd={self.pwd()!r})"

    # ---- paths ----

    def parts(self, path: str) -> tuple[str, ...]:
        """The normalized absolute components of `path` (relative paths start at the cwd; '..' at the root
        stays at the root, as in Unix)."""
        out = [] if path.startswith("/") else list(self.cwd)
        for p in path.split("/"):
            if p in ("", "."):
                continue
            if p == "..":
                if out:
                    out.pop()
            else:
                out.append(p)
        return tuple(out)

    def abspath(self, path: str) -> str:
        return "/" + "/".join(self.parts(path))

    def pwd(self) -> str:
        return "/" + "/".join(self.cwd)

    def _node(self, parts: tuple[str, ...]) -> Node | None:
        node: Node = self.tree
        for p in parts:
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    def _parent(self, parts: tuple[str, ...], path: str, cmd: str = "") -> dict[str, Any]:
        if not parts:
            raise SimFSError(f"{cmd}{path}: is the root directory")
        parent = self._node(parts[:-1])
        if parent is None:
            raise SimFSError(f"{cmd}{path}: No such file or directory")
        if not isinstance(parent, dict):
            raise SimFSError(f"{cmd}{path}: Not a directory")
        return parent

    def exists(self, path: str) -> bool:
        return self._node(self.parts(path)) is not None

    def is_dir(self, path: str) -> bool:
        return isinstance(self._node(self.parts(path)), dict)

    def is_file(self, path: str) -> bool:
        return isinstance(self._node(self.parts(path)), str)

    # ---- operations (messages are prefixed by the caller's command name when given) ----

    def read(self, path: str, cmd: str = "") -> str:
        node = self._node(self.parts(path))
        if node is None:
            raise SimFSError(f"{cmd}{path}: No such file or directory")
        if isinstance(node, dict):
            raise SimFSError(f"{cmd}{path}: Is a directory")
        return node

    def write(self, path: str, content: str, *, append: bool = False, parents: bool = True, cmd: str = "") -> None:
        """Create or replace (or append to) a file; `parents` creates missing directories (the shell commands
        pass False, as a real shell would fail)."""
        parts = self.parts(path)
        if parents and len(parts) > 1:
            self.mkdir("/" + "/".join(parts[:-1]), parents=True, exist_ok=True, cmd=cmd)
        parent = self._parent(parts, path, cmd)
        old = parent.get(parts[-1])
        if isinstance(old, dict):
            raise SimFSError(f"{cmd}{path}: Is a directory")
        parent[parts[-1]] = (old or "") + content if append else content

    def mkdir(self, path: str, *, parents: bool = False, exist_ok: bool = False, cmd: str = "") -> None:
        parts = self.parts(path)
        node: dict[str, Any] = self.tree
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            child = node.get(p)
            if child is None:
                if not (parents or last):
                    raise SimFSError(f"{cmd}cannot create directory '{path}': No such file or directory")
                child = node[p] = {}
            elif not isinstance(child, dict):
                raise SimFSError(f"{cmd}cannot create directory '{path}': "
                                 + ("File exists" if last else "Not a directory"))
            elif last and not (exist_ok or parents):
                raise SimFSError(f"{cmd}cannot create directory '{path}': File exists")
            node = child

    def remove(self, path: str, *, recursive: bool = False, cmd: str = "") -> None:
        parts = self.parts(path)
        if not parts:
            raise SimFSError(f"{cmd}refusing to remove '/'")
        node = self._node(parts)
        if node is None:
            raise SimFSError(f"{cmd}cannot remove '{path}': No such file or directory")
        if isinstance(node, dict) and not recursive:
            raise SimFSError(f"{cmd}cannot remove '{path}': Is a directory")
        del self._parent(parts, path, cmd)[parts[-1]]
        if self.cwd[: len(parts)] == parts:  # removed the cwd or one of its parents: fall back to what remains
            self.cwd = parts[:-1]

    def listdir(self, path: str = ".") -> list[str]:
        node = self._node(self.parts(path))
        if not isinstance(node, dict):
            raise SimFSError(f"{path}: Not a directory" if node is not None else f"{path}: No such file or directory")
        return sorted(node)

    def cd(self, path: str) -> None:
        parts = self.parts(path)
        node = self._node(parts)
        if node is None:
            raise SimFSError(f"cd: {path}: No such file or directory")
        if not isinstance(node, dict):
            raise SimFSError(f"cd: {path}: Not a directory")
        self.cwd = parts

    def walk(self, path: str = ".") -> Iterator[tuple[str, bool]]:
        """(absolute path, is_dir) for `path` and everything under it, pre-order, sorted."""
        parts = self.parts(path)
        node = self._node(parts)
        if node is None:
            raise SimFSError(f"{path}: No such file or directory")

        def visit(n: Node, p: str) -> Iterator[tuple[str, bool]]:
            yield p or "/", isinstance(n, dict)
            if isinstance(n, dict):
                for name in sorted(n):
                    yield from visit(n[name], p + "/" + name)

        yield from visit(node, "/" + "/".join(parts) if parts else "")

    def count_nodes(self) -> int:
        def count(n: Node) -> int:
            return 1 + (sum(count(c) for c in n.values()) if isinstance(n, dict) else 0)

        return count(self.tree)
