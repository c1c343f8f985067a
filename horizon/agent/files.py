"""File tools confined to a root folder: list_files, read_file, write_file, search_files.

Path rules (the same for every tool):
- A path is relative to the root (`src/a.py`, `.`); an absolute path is refused, not reinterpreted, so the
  model learns the convention instead of having `/etc/passwd` silently mean `<root>/etc/passwd`.
- The path is joined to the root and resolved with `os.path.realpath`, which follows every symlink along it;
  anything that does not resolve inside `realpath(root)` is refused. This covers `../` traversal, a symlink
  inside the root pointing outside (file or directory), a dangling symlink pointing outside, and writing
  through such a symlink (the write goes to the resolved path, which must be inside).
- Files are then opened by their resolved path, and writes use O_NOFOLLOW on the last component.

What remains (honestly): a time-of-check/time-of-use race. Between the realpath check and the open, another
process that can write inside the root could swap a directory on the resolved path for a symlink pointing
outside, and the open would follow it. Closing that needs openat2(RESOLVE_BENEATH) or a per-component
O_NOFOLLOW walk; this module does not do that. It confines a model's mistakes and mischief through these
tools, not a concurrent attacker with write access to the root.

Limits: read_file reads text files up to 16 MB and returns at most 256 000 characters per call (default
16 000; continue with `offset`); binary files (a NUL byte in the first 8 KB) and non-UTF-8 files are refused
with a clear error; write_file writes at most 1 MB per call; list_files shows at most 1000 entries and
search_files at most 200 matches, each saying so when cut.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from .tool import Tool, ToolError, nested_quantifier

MAX_FILE_BYTES = 16 * 1024 * 1024  # read_file refuses larger files; search_files skips them
MAX_READ_CHARS = 256_000  # per read_file call
DEFAULT_READ_CHARS = 16_000
MAX_WRITE_BYTES = 1024 * 1024
MAX_LIST_ENTRIES = 1000
MAX_SCAN_ENTRIES = 100_000  # list/search walks stop here on huge trees (and say so)
MAX_MATCHES = 200
MAX_SEARCH_FILE_BYTES = 4 * 1024 * 1024
MAX_REGEX_LINE = 2000  # regex mode skips longer lines (and counts them); substring mode searches every line
MAX_HIT_CHARS = 200
BINARY_PROBE = 8192


class _Rooted(Tool):
    """Shared path handling for tools confined to `root`."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise ValueError(f"root {os.fspath(root)!r} is not a directory")

    def resolve(self, path: Any, *, what: str = "path") -> str:
        """The real path of `path` (relative to the root), or ToolError naming it if it is not inside."""
        if not isinstance(path, str):
            raise ToolError(f"{what} must be a string")
        if "\x00" in path:
            raise ToolError(f"{what} {path!r} contains a NUL character")
        if path.strip() == "":
            raise ToolError(f"{what} is empty; give a path relative to the root, e.g. '.' or 'src/main.py'")
        if os.path.isabs(path):
            raise ToolError(f"{what} {path!r} is absolute; paths must be relative to the root folder (e.g. 'src/a.py')")
        real = os.path.realpath(os.path.join(self.root, path))
        if real != self.root and not real.startswith(self.root + os.sep):
            raise ToolError(
                f"{what} {path!r} is outside the root folder (it resolves outside it through '..' or a symlink); "
                "only paths inside the root are allowed")
        return real

    def rel(self, real: str) -> str:
        r = os.path.relpath(real, self.root)
        return "." if r == os.curdir else r

    def inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root + os.sep)


def _is_binary(head: bytes) -> bool:
    return b"\x00" in head[:BINARY_PROBE]


class ListFiles(_Rooted):
    name = "list_files"
    description = (
        "List a directory inside the workspace (paths relative to the workspace root). Directories end with '/'; "
        "symlinks show their target. recursive=true lists the whole subtree.")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "directory relative to the root; default '.'"},
            "recursive": {"type": "boolean", "description": "list the whole subtree; default false"},
        },
        "additionalProperties": False,
    }

    def entry(self, full: str) -> str:
        rel = self.rel(full)
        if os.path.islink(full):
            target = os.readlink(full)
            inside = self.inside(os.path.realpath(full))
            return f"{rel} -> {target}" + ("" if inside else " (points outside the root; not accessible)")
        return rel + "/" if os.path.isdir(full) else rel

    def call(self, arguments: dict[str, Any]) -> str:
        path = arguments.get("path", ".")
        real = self.resolve(path)
        if not os.path.exists(real):
            raise ToolError(f"path {path!r} does not exist")
        if not os.path.isdir(real):
            raise ToolError(f"path {path!r} is a file, not a directory; use read_file to read it")
        lines: list[str] = []
        notes: list[str] = []
        seen = 0
        if arguments.get("recursive", False):
            def unreadable(err: OSError) -> None:
                notes.append(f"[could not read directory {self.rel(err.filename or real)}: {err.strerror}]")

            # followlinks=False: a symlinked directory is listed (with its target) but not descended into
            for dirpath, dirnames, filenames in os.walk(real, onerror=unreadable):
                dirnames.sort()
                for name in sorted(dirnames + filenames):
                    seen += 1
                    if len(lines) < MAX_LIST_ENTRIES:
                        lines.append(self.entry(os.path.join(dirpath, name)))
                if seen >= MAX_SCAN_ENTRIES:
                    notes.append(f"[stopped scanning after {seen} entries]")
                    break
            lines.sort()  # walk order is per directory; a sorted listing groups each subtree together
        else:
            try:
                names = sorted(os.listdir(real))
            except OSError as e:
                raise ToolError(f"cannot list {path!r}: {e.strerror}") from None
            seen = len(names)
            lines = [self.entry(os.path.join(real, n)) for n in names[:MAX_LIST_ENTRIES]]
        if seen > len(lines):
            notes.insert(0, f"[listing cut: showing {len(lines)} of {seen} entries]")
        if not lines and not notes:
            return f"[{self.rel(real)} is an empty directory]"
        return "\n".join(lines + notes)


class ReadFile(_Rooted):
    name = "read_file"
    description = (
        "Read a UTF-8 text file inside the workspace (path relative to the root). Optional offset (first line, "
        "1-based) and limit (number of lines); long files are cut at max_chars with a note saying how to continue.")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "offset": {"type": "integer", "description": "first line to return, 1-based; default 1"},
            "limit": {"type": "integer", "description": "how many lines to return; default all (up to max_chars)"},
            "max_chars": {"type": "integer", "description": f"default {DEFAULT_READ_CHARS}, at most {MAX_READ_CHARS}"},
        },
        "required": ["path"],
        "additionalProperties": False,
    }
    max_result_chars = MAX_READ_CHARS + 1000  # the call does its own line-aware cutting; leave room for the note

    def call(self, arguments: dict[str, Any]) -> str:
        path = arguments["path"]
        offset = arguments.get("offset", 1)
        limit = arguments.get("limit")
        max_chars = arguments.get("max_chars", DEFAULT_READ_CHARS)
        if offset < 1:
            raise ToolError(f"offset must be 1 or more (the first line is 1), got {offset}")
        if limit is not None and limit < 1:
            raise ToolError(f"limit must be 1 or more, got {limit}")
        if not 1 <= max_chars <= MAX_READ_CHARS:
            raise ToolError(f"max_chars must be between 1 and {MAX_READ_CHARS}, got {max_chars}")
        real = self.resolve(path)
        if not os.path.exists(real):
            raise ToolError(f"file {path!r} does not exist")
        if os.path.isdir(real):
            raise ToolError(f"{path!r} is a directory; use list_files to see what is in it")
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{path!r} is not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise ToolError(f"file {path!r} is {st.st_size} bytes; read_file reads files up to {MAX_FILE_BYTES} bytes")
        with open(real, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if _is_binary(data):
            raise ToolError(f"file {path!r} looks binary (it contains NUL bytes); read_file reads text files only")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ToolError(f"file {path!r} is not valid UTF-8 (byte {e.start}, line {line}); "
                            "read_file reads UTF-8 text only") from None
        if not text:
            return f"[{path} is empty]"
        lines = text.splitlines(keepends=True)
        total = len(lines)
        if offset > total:
            raise ToolError(f"offset {offset} is past the end of {path!r}, which has {total} lines")
        end = total if limit is None else min(total, offset - 1 + limit)
        out: list[str] = []
        size = 0
        last = offset - 1
        for i in range(offset - 1, end):
            if size + len(lines[i]) > max_chars:
                if not out:  # a single line longer than max_chars: give its start rather than nothing
                    out.append(lines[i][:max_chars])
                    return "".join(out) + (
                        f"\n[line {i + 1} cut at {max_chars} characters of {len(lines[i])}; "
                        f"raise max_chars (at most {MAX_READ_CHARS}) to see more]")
                break
            out.append(lines[i])
            size += len(lines[i])
            last = i + 1
        body = "".join(out)
        if offset == 1 and last == total:
            return body
        note = f"[lines {offset}-{last} of {total}"
        note += f"; continue with offset={last + 1}]" if last < total else "]"
        return body + ("" if body.endswith("\n") else "\n") + note


class WriteFile(_Rooted):
    name = "write_file"
    description = (
        "Write (or append to) a UTF-8 text file inside the workspace (path relative to the root); creates parent "
        f"directories as needed. At most {MAX_WRITE_BYTES} bytes per call.")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "content": {"type": "string"},
            "append": {"type": "boolean", "description": "append instead of replacing; default false"},
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    }

    def call(self, arguments: dict[str, Any]) -> str:
        path, content = arguments["path"], arguments["content"]
        append = arguments.get("append", False)
        data = content.encode("utf-8", errors="surrogatepass")
        if len(data) > MAX_WRITE_BYTES:
            raise ToolError(f"content is {len(data)} bytes; write_file writes at most {MAX_WRITE_BYTES} bytes per call "
                            "(write in parts with append=true)")
        real = self.resolve(path)
        if real == self.root or os.path.isdir(real):
            raise ToolError(f"{path!r} is a directory; give a file path")
        parent = os.path.dirname(real)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ToolError(f"cannot create {path!r}: {self.rel(parent)!r} is a file, not a directory")
        existed = os.path.exists(real)
        if existed and not os.path.isfile(real):  # a FIFO or device: opening it could block or do worse
            raise ToolError(f"{path!r} is not a regular file")
        try:
            os.makedirs(parent, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | os.O_NOFOLLOW
            fd = os.open(real, flags, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            size = os.path.getsize(real)
        except OSError as e:
            raise ToolError(f"cannot write {path!r}: {e.strerror}") from None
        verb = "appended" if append and existed else ("overwrote" if existed else "created")
        return f"{verb} {self.rel(real)} ({len(data)} bytes written; file is now {size} bytes)"


class SearchFiles(_Rooted):
    name = "search_files"
    description = (
        "Search text files under a directory inside the workspace for a pattern; returns 'path:line: text' for "
        "each matching line. The pattern is a plain substring unless regex=true (Python regular expression "
        f"syntax). At most {MAX_MATCHES} matches.")
    parameters = {
        "type": "object",
        "properties": {
            "pattern": {"type": "string"},
            "path": {"type": "string", "description": "file or directory relative to the root; default '.'"},
            "regex": {"type": "boolean", "description": "treat pattern as a regular expression; default false"},
            "ignore_case": {"type": "boolean", "description": "default false"},
        },
        "required": ["pattern"],
        "additionalProperties": False,
    }

    def call(self, arguments: dict[str, Any]) -> str:
        pattern: str = arguments["pattern"]
        path = arguments.get("path", ".")
        use_regex = arguments.get("regex", False)
        ignore_case = arguments.get("ignore_case", False)
        if pattern == "":
            raise ToolError("pattern is empty")
        if use_regex:
            if nested_quantifier(pattern):
                raise ToolError("pattern has a repeated group that contains a repeat (like (a+)+), which can take "
                                "exponential time; rewrite it without the nested repeat")
            try:
                rx = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
            except re.error as e:
                raise ToolError(f"invalid regular expression: {e}") from None

            def match(line: str) -> bool:
                return rx.search(line) is not None
        else:
            needle = pattern.casefold() if ignore_case else pattern

            def match(line: str) -> bool:
                return needle in (line.casefold() if ignore_case else line)

        real = self.resolve(path)
        if not os.path.exists(real):
            raise ToolError(f"path {path!r} does not exist")
        files: list[str] = []
        notes: list[str] = []
        skipped: dict[str, list[str]] = {}
        if os.path.isdir(real):
            scanned = 0
            for dirpath, dirnames, filenames in os.walk(real):
                dirnames.sort()
                for d in dirnames:  # os.walk does not follow directory symlinks; say which were not searched
                    if os.path.islink(os.path.join(dirpath, d)):
                        skipped.setdefault("symlinked directories (not followed)", []).append(
                            self.rel(os.path.join(dirpath, d)))
                files.extend(os.path.join(dirpath, f) for f in sorted(filenames))
                scanned += len(filenames) + len(dirnames)
                if scanned >= MAX_SCAN_ENTRIES:
                    notes.append(f"[stopped scanning after {scanned} entries]")
                    break
        else:
            files.append(real)

        hits: list[str] = []
        long_lines = 0
        cut = False
        for full in files:
            rel = self.rel(full)
            resolved = os.path.realpath(full)
            if not self.inside(resolved):
                skipped.setdefault("symlinks pointing outside the root", []).append(rel)
                continue
            try:
                if not os.path.isfile(resolved):
                    skipped.setdefault("not regular files", []).append(rel)
                    continue
                if os.path.getsize(resolved) > MAX_SEARCH_FILE_BYTES:
                    skipped.setdefault(f"larger than {MAX_SEARCH_FILE_BYTES} bytes", []).append(rel)
                    continue
                with open(resolved, "rb") as f:
                    data = f.read()
            except OSError:
                skipped.setdefault("unreadable", []).append(rel)
                continue
            if _is_binary(data):
                skipped.setdefault("binary", []).append(rel)
                continue
            for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                if use_regex and len(line) > MAX_REGEX_LINE:
                    long_lines += 1
                    continue
                if match(line):
                    if len(hits) >= MAX_MATCHES:
                        cut = True
                        break
                    text = line if len(line) <= MAX_HIT_CHARS else line[:MAX_HIT_CHARS] + "..."
                    hits.append(f"{rel}:{number}: {text}")
            if cut:
                break
        if cut:
            notes.append(f"[matches cut at {MAX_MATCHES}; narrow the pattern or the path]")
        if long_lines:
            notes.append(f"[{long_lines} lines longer than {MAX_REGEX_LINE} characters were not searched (regex mode)]")
        for why, names in skipped.items():
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            notes.append(f"[skipped {len(names)} file(s), {why}: {shown}]")
        if not hits:
            notes.insert(0, f"[no matches for {pattern!r} in {self.rel(real)}]")
        return "\n".join(hits + notes)

