"""The `terminal` tool: a shell-like lexer and interpreter over a `SimFS`, as an agent `Tool`.

The command language (`Terminal`), quoted like a POSIX shell (single quotes, double quotes, backslashes):

    pwd, cd [dir], ls [-a] [-A] [-l] [path...], cat [-n] [file...], head/tail [-n N | -N] [file...],
    wc [-l] [-w] [-c] [file...], grep [-i] [-n] [-r] [-v] [-c] [-l] [-w] [-F] pattern [path...],
    find [path...] [-name GLOB] [-iname GLOB] [-type f|d] [-maxdepth N], mkdir [-p] dir...,
    touch file..., rm [-r] [-f] path..., mv src... dst, cp [-r] src... dst, echo [-n] text...,
    sort [-r] [-n] [-u] [file...], uniq [-c] [file...]

plus pipes (`a | b`: grep, head, tail, wc, sort, uniq and cat read stdin when given no file), output
redirection at the end of a pipeline (`> file`, `>> file`, `> /dev/null`), `;`, `&&` and `||` between pipelines,
`2>/dev/null` / `2>&1` (accepted and ignored), `~` for the root, and `*`, `?`, `[...]` globs in unquoted
words (a glob that matches nothing stays literal, as in bash). grep patterns are Python regular expressions
(-F: a fixed string). There are no variables (`$X` stays literal), subshells, `<` or background jobs.

Errors: a failing command prints a bash-like message (`cat: x.txt: No such file or directory`) where its
output would be, and the line goes on by bash's rules for `;`, `&&` and `||`; the tool's result is an
error result when the last command that ran failed (bash's `$?`). A failing stage ends its pipeline.
grep finding nothing is not a failure here (empty output), unlike grep's exit status 1.

It is kept apart from the file system (`horizon.simfs.fs`) because it is the one part that speaks the
agent's tool interface (`horizon.agent.tool`) and holds all the command-line parsing.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections.abc import Callable
from typing import Any

from horizon.agent.tool import Tool, ToolError, nested_quantifier
from horizon.simfs.fs import MAX_NODES, Node, SimFS, SimFSError

# ---- command line parsing ----

_GLOB_CHARS = "*?["
_UNSUPPORTED = {"&": "background jobs ('&')", "<": "input redirection ('<')", "`": "command substitution",
                "$(": "command substitution"}
_CONNECTORS = (";", "&&", "||")


class _Word:
    """A word with, for each character, whether it was quoted (quoted glob characters are literal)."""

    def __init__(self) -> None:
        self.chars: list[tuple[str, bool]] = []

    def add(self, c: str, quoted: bool) -> None:
        self.chars.append((c, quoted))

    @property
    def text(self) -> str:
        return "".join(c for c, _ in self.chars)

    @property
    def is_glob(self) -> bool:
        return any(c in _GLOB_CHARS and not q for c, q in self.chars)

    @property
    def pattern(self) -> str:
        return "".join(f"[{c}]" if q and c in _GLOB_CHARS else c for c, q in self.chars)


def _lex(line: str) -> list[_Word | str]:
    """Words and operators ('|', '>', '>>', '&&')."""
    out: list[_Word | str] = []
    i, n = 0, len(line)
    word: _Word | None = None

    def end_word() -> None:
        nonlocal word
        if word is not None:
            out.append(word)
            word = None

    while i < n:
        c = line[i]
        if c in " \t\n":
            end_word()
            i += 1
            continue
        if word is None:  # stderr redirections that change nothing here (errors stop the line anyway)
            for skip in ("2>&1", "2>/dev/null"):
                if line.startswith(skip, i) and (i + len(skip) == n or line[i + len(skip)] in " \t\n|&"):
                    i += len(skip)
                    break
            else:
                skip = ""
            if skip:
                continue
        if line.startswith("$(", i) or c == "`":
            raise SimFSError(f"unsupported: {_UNSUPPORTED['$(']}")
        if c in "|&;<>":
            end_word()
            op = line[i : i + 2] if line[i : i + 2] in ("||", "&&", ">>") else c
            if op in _UNSUPPORTED:
                raise SimFSError(f"unsupported: {_UNSUPPORTED[op]}; this terminal runs pipelines joined by ';', "
                                 "'&&' or '||', with optional '> file' or '>> file' at the end")
            out.append(op)
            i += len(op)
            continue
        if word is None:
            word = _Word()
        if c == "'":
            j = line.find("'", i + 1)
            if j < 0:
                raise SimFSError("syntax error: unterminated single quote")
            for ch in line[i + 1 : j]:
                word.add(ch, True)
            i = j + 1
        elif c == '"':
            i += 1
            while True:
                if i >= n:
                    raise SimFSError("syntax error: unterminated double quote")
                ch = line[i]
                if ch == '"':
                    i += 1
                    break
                if ch == "\\" and i + 1 < n and line[i + 1] in '"\\$`':
                    word.add(line[i + 1], True)
                    i += 2
                    continue
                word.add(ch, True)
                i += 1
        elif c == "\\":
            if i + 1 < n:
                word.add(line[i + 1], True)
            i += 2
        else:
            word.add(c, False)
            i += 1
    end_word()
    return out


# ---- the terminal ----

def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _ensure_nl(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def _count(value: str, cmd: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise SimFSError(f"{cmd}: invalid number of lines: '{value}'") from None
    return n


def _flags(args: list[str], cmd: str, allowed: str, with_value: str = "") -> tuple[set[str], dict[str, str], list[str]]:
    """Split `-abc` style flags (letters in `allowed`; those in `with_value` take the next word) from operands.
    Options may come after operands (GNU style); `--` ends them."""
    flags: set[str] = set()
    values: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            rest.extend(args[i + 1 :])
            break
        if a.startswith("-") and len(a) > 1:  # anywhere, as GNU tools permute options
            j = 1
            while j < len(a):
                f = a[j]
                if f in with_value:
                    v = a[j + 1 :] or (args[i + 1] if i + 1 < len(args) else None)
                    if v is None:
                        raise SimFSError(f"{cmd}: option requires an argument -- '{f}'")
                    if not a[j + 1 :]:
                        i += 1
                    values[f] = v
                    break
                if f not in allowed:
                    raise SimFSError(f"{cmd}: invalid option -- '{f}'; supported: "
                                     + " ".join("-" + x for x in allowed + with_value))
                flags.add(f)
                j += 1
        else:
            rest.append(a)
        i += 1
    return flags, values, rest


class Terminal(Tool):
    name = "terminal"
    description = (
        "Run a command in a simulated Unix terminal over the task's files: pwd, cd, ls, cat, head, tail, wc, "
        "grep, find, mkdir, touch, rm, mv, cp, echo, sort, uniq, with pipes (|), ';', '&&', '||', '> file', '>> file'.")
    parameters = {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "e.g. grep -rn TODO src | head -n 5"}},
        "required": ["command"],
        "additionalProperties": False,
    }

    def __init__(self, fs: SimFS | None = None):
        self.fs = fs if fs is not None else SimFS()
        self.commands: dict[str, Callable[[list[str], str | None], str]] = {
            name[4:]: getattr(self, name) for name in sorted(dir(self)) if name.startswith("cmd_")}

    def call(self, arguments: dict[str, Any]) -> str:
        try:
            return self.execute(arguments["command"])
        except SimFSError as e:
            raise ToolError(str(e)) from None

    # ---- running a command line ----

    def execute(self, line: str) -> str:
        """The output of a command line; raises SimFSError (whose message carries all the output, error
        messages included) when it fails."""
        out, ok = self.run_line(line)
        if not ok:
            raise SimFSError(out.rstrip("\n"))
        return out

    def run_line(self, line: str) -> tuple[str, bool]:
        """(output with error messages where they occurred, whether the last command that ran succeeded):
        bash's rules for ';', '&&' and '||' (equal precedence, left to right)."""
        tokens = _lex(line)
        seq: list[tuple[str, list[_Word | str]]] = [(";", [])]
        for t in tokens:
            if isinstance(t, str) and t in _CONNECTORS:
                if not seq[-1][1]:
                    raise SimFSError(f"syntax error near unexpected token '{t}'")
                seq.append((t, []))
            else:
                seq[-1][1].append(t)
        if not seq[-1][1]:
            if seq[-1][0] in ("&&", "||"):
                raise SimFSError(f"syntax error: '{seq[-1][0]}' at the end of the line")
            seq.pop()  # a trailing ';' (or an empty line)
        out: list[str] = []
        ok = True
        for connector, pipeline in seq:
            if (connector == "&&" and not ok) or (connector == "||" and ok):
                continue
            try:
                out.append(self._pipeline(pipeline))
                ok = True
            except SimFSError as e:
                out.append(_ensure_nl(str(e)))
                ok = False
        return "".join(out), ok

    def _pipeline(self, tokens: list[_Word | str]) -> str:
        stages: list[list[_Word]] = [[]]
        redirect: tuple[str, str] | None = None
        i = 0
        while i < len(tokens):
            t = tokens[i]
            if t == "|":
                if redirect is not None:
                    raise SimFSError("unsupported: redirection before '|'; put '> file' at the end")
                stages.append([])
            elif t in (">", ">>"):
                nxt = tokens[i + 1] if i + 1 < len(tokens) else None
                if not isinstance(nxt, _Word):
                    raise SimFSError(f"syntax error: '{t}' needs a file name")
                if redirect is not None:
                    raise SimFSError("unsupported: more than one output redirection")
                redirect = (str(t), self._expand(nxt)[0] if nxt.is_glob else self._tilde(nxt))
                i += 1
            else:
                assert isinstance(t, _Word)
                if redirect is not None:
                    raise SimFSError("unsupported: words after the redirection; put '> file' at the end")
                stages[-1].append(t)
            i += 1
        data: str | None = None
        for stage in stages:
            if not stage:
                raise SimFSError("syntax error: empty command around '|'")
            args = [a for w in stage for a in self._expand(w)]
            cmd, args = args[0], args[1:]
            fn = self.commands.get(cmd)
            if fn is None:
                raise SimFSError(f"{cmd}: command not found; supported commands: {', '.join(self.commands)}")
            data = fn(args, data)
        assert data is not None
        if redirect is not None:
            op, target = redirect
            if target != "/dev/null":
                self.fs.write(target, data, append=op == ">>", parents=False, cmd="bash: ")
            return ""
        return data

    def _tilde(self, w: _Word) -> str:
        text = w.text
        if w.chars and w.chars[0] == ("~", False) and (len(text) == 1 or text[1] == "/"):
            return "/" + text[1:].lstrip("/")
        return text

    def _expand(self, w: _Word) -> list[str]:
        """Glob expansion against the tree; a pattern matching nothing stays literal (bash's default)."""
        text = self._tilde(w)
        if not w.is_glob:
            return [text]
        pattern = w.pattern
        if text != w.text:  # a leading unquoted ~ became the root
            pattern = "/" + pattern[1:].lstrip("/")
        absolute = pattern.startswith("/")
        comps = [c for c in pattern.split("/") if c]
        found: list[str] = ["/" if absolute else ""]
        for k, comp in enumerate(comps):
            last = k == len(comps) - 1
            nxt: list[str] = []
            for base in found:
                if not any(ch in comp for ch in _GLOB_CHARS):
                    nxt.append(base + comp + ("" if last else "/"))
                    continue
                node = self.fs._node(self.fs.parts(base or "."))
                if not isinstance(node, dict):
                    continue
                for name in sorted(node):
                    if name.startswith(".") and not comp.startswith("."):
                        continue  # like bash, * does not match hidden names
                    if fnmatch.fnmatchcase(name, comp) and (last or isinstance(node[name], dict)):
                        nxt.append(base + name + ("" if last else "/"))
            found = nxt
        found = [f for f in found if self.fs.exists(f or ".")]
        return sorted(found) if found else [text]

    # ---- commands: each takes (operands, stdin or None) and returns its output ----

    def _inputs(self, cmd: str, files: list[str], stdin: str | None) -> list[tuple[str | None, str]]:
        if not files:
            return [(None, stdin or "")]
        return [(f, self.fs.read(f, cmd=f"{cmd}: ")) for f in files]

    def cmd_pwd(self, args: list[str], stdin: str | None) -> str:
        return self.fs.pwd() + "\n"

    def cmd_cd(self, args: list[str], stdin: str | None) -> str:
        if len(args) > 1:
            raise SimFSError("cd: too many arguments")
        self.fs.cd(args[0] if args else "/")
        return ""

    def cmd_ls(self, args: list[str], stdin: str | None) -> str:
        flags, _, paths = _flags(args, "ls", "aAl1")

        def show(name: str, node: Node) -> str:
            text = name + "/" if isinstance(node, dict) else name
            if "l" in flags:
                size = len(node) if isinstance(node, dict) else len(node.encode())
                return f"{'d' if isinstance(node, dict) else '-'} {size:>8} {text}"
            return text

        def listing(parts: tuple[str, ...], node: dict[str, Any]) -> list[str]:
            names = sorted(n for n in node if "a" in flags or "A" in flags or not n.startswith("."))
            rows = [show(n, node[n]) for n in names]
            if "a" in flags:
                parent = self.fs._node(parts[:-1]) if parts else node
                rows = [show(".", node), show("..", parent)] + rows
            return rows

        if not paths:
            paths = ["."]
        files: list[str] = []
        dirs: list[tuple[str, tuple[str, ...], dict[str, Any]]] = []
        for p in paths:
            parts = self.fs.parts(p)
            node = self.fs._node(parts)
            if node is None:
                raise SimFSError(f"ls: cannot access '{p}': No such file or directory")
            if isinstance(node, dict):
                dirs.append((p, parts, node))
            else:
                files.append(show(p, node))
        blocks: list[str] = ["".join(f + "\n" for f in files)] if files else []
        for p, parts, node in dirs:
            rows = listing(parts, node)
            head = f"{p}:\n" if len(paths) > 1 else ""
            blocks.append(head + "".join(r + "\n" for r in rows))
        return "\n".join(blocks)

    def cmd_cat(self, args: list[str], stdin: str | None) -> str:
        flags, _, files = _flags(args, "cat", "n")
        text = "".join(t for _, t in self._inputs("cat", files, stdin))
        if "n" in flags:
            text = "".join(f"{i:>6}\t{ln}" for i, ln in enumerate(_lines(text), 1))
        return text

    def _head_tail(self, cmd: str, args: list[str], stdin: str | None) -> str:
        # -N is the old form of -n N
        args = ["-n" + a[1:] if re.fullmatch(r"-\d+", a) else a for a in args]
        _, values, files = _flags(args, cmd, "", "n")
        raw = values.get("n", "10")
        from_start = cmd == "tail" and raw.startswith("+")
        n = _count(raw.lstrip("+"), cmd)
        if n < 0:
            raise SimFSError(f"{cmd}: invalid number of lines: '{raw}'")
        blocks = []
        inputs = self._inputs(cmd, files, stdin)
        for name, text in inputs:
            lines = _lines(text)
            if cmd == "head":
                part = lines[:n]
            elif from_start:
                part = lines[max(n - 1, 0):]
            else:
                part = lines[-n:] if n else []
            body = "".join(part)
            blocks.append((f"==> {name} <==\n" if len(inputs) > 1 else "") + body)
        return "\n".join(_ensure_nl(b) for b in blocks) if len(blocks) > 1 else blocks[0]

    def cmd_head(self, args: list[str], stdin: str | None) -> str:
        return self._head_tail("head", args, stdin)

    def cmd_tail(self, args: list[str], stdin: str | None) -> str:
        return self._head_tail("tail", args, stdin)

    def cmd_wc(self, args: list[str], stdin: str | None) -> str:
        flags, _, files = _flags(args, "wc", "lwc")
        which = [f for f in "lwc" if f in flags] or ["l", "w", "c"]
        rows = []
        totals = {"l": 0, "w": 0, "c": 0}
        for name, text in self._inputs("wc", files, stdin):
            counts = {"l": text.count("\n"), "w": len(text.split()), "c": len(text.encode())}
            for k in totals:
                totals[k] += counts[k]
            rows.append(" ".join(str(counts[k]) for k in which) + (f" {name}" if name is not None else ""))
        if len(files) > 1:
            rows.append(" ".join(str(totals[k]) for k in which) + " total")
        return "".join(r + "\n" for r in rows)

    def cmd_grep(self, args: list[str], stdin: str | None) -> str:
        flags, values, rest = _flags(args, "grep", "inrRvclwFEH", "e")
        if "e" in values:
            pattern = values["e"]
        elif rest:
            pattern, rest = rest[0], rest[1:]
        else:
            raise SimFSError("grep: no pattern; usage: grep [-i] [-n] [-r] [-v] [-c] [-l] [-w] [-F] pattern [path...]")
        recursive = bool(flags & {"r", "R"})
        source = re.escape(pattern) if "F" in flags else pattern
        if "w" in flags:
            source = rf"\b(?:{source})\b"
        if "F" not in flags and nested_quantifier(pattern):
            raise SimFSError("grep: pattern has a repeated group containing a repeat (like (a+)+), which can take "
                             "exponential time; rewrite it")
        try:
            rx = re.compile(source, re.IGNORECASE if "i" in flags else 0)
        except re.error as e:
            raise SimFSError(f"grep: invalid regular expression: {e}") from None
        inputs: list[tuple[str | None, str]] = []
        implicit_dot = not rest and recursive  # GNU grep -r with no path searches . and omits the './'
        if implicit_dot:
            rest = ["."]
        if not rest:
            inputs = [(None, stdin or "")]
        for p in rest:
            if self.fs.is_dir(p):
                if not recursive:
                    raise SimFSError(f"grep: {p}: Is a directory (use -r)")
                base = self.fs.abspath(p)
                for full, is_dir in self.fs.walk(p):
                    if not is_dir:
                        shown = p.rstrip("/") + full[len(base):] if base != "/" else p.rstrip("/") + full
                        if implicit_dot:
                            shown = shown[2:]
                        inputs.append((shown, self.fs.read(full)))
            else:
                inputs.append((p, self.fs.read(p, cmd="grep: ")))
        prefix = recursive or len(rest) > 1 or "H" in flags
        out: list[str] = []
        for name, text in inputs:
            invert = "v" in flags
            hits = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if (rx.search(ln) is not None) != invert]
            if "l" in flags:
                if hits and name is not None:
                    out.append(name + "\n")
                continue
            if "c" in flags:
                out.append((f"{name}:" if prefix and name else "") + f"{len(hits)}\n")
                continue
            for i, ln in hits:
                out.append((f"{name}:" if prefix and name else "") + (f"{i}:" if "n" in flags else "") + ln + "\n")
        return "".join(out)

    def cmd_find(self, args: list[str], stdin: str | None) -> str:
        paths: list[str] = []
        i = 0
        while i < len(args) and not args[i].startswith("-"):
            paths.append(args[i])
            i += 1
        name_rx: tuple[str, bool] | None = None
        kind: str | None = None
        maxdepth: int | None = None
        while i < len(args):
            opt = args[i]
            if i + 1 >= len(args) or opt not in ("-name", "-iname", "-type", "-maxdepth"):
                raise SimFSError(f"find: unsupported or incomplete expression '{opt}'; supported: -name GLOB, "
                                 "-iname GLOB, -type f|d, -maxdepth N")
            val = args[i + 1]
            if opt in ("-name", "-iname"):
                name_rx = (val, opt == "-iname")
            elif opt == "-type":
                if val not in ("f", "d"):
                    raise SimFSError(f"find: -type takes f or d, got '{val}'")
                kind = val
            else:
                if not val.isdigit():
                    raise SimFSError(f"find: -maxdepth takes a number, got '{val}'")
                maxdepth = int(val)
            i += 2
        out: list[str] = []
        for p in paths or ["."]:
            if not self.fs.exists(p):
                raise SimFSError(f"find: '{p}': No such file or directory")
            base = self.fs.abspath(p)
            for full, is_dir in self.fs.walk(p):
                rel = full[len(base):] if base != "/" else full
                rel = rel.lstrip("/")
                if maxdepth is not None and (rel.count("/") + 1 if rel else 0) > maxdepth:
                    continue
                shown = p if not rel else (p.rstrip("/") + "/" + rel if p != "/" else "/" + rel)
                if kind is not None and is_dir != (kind == "d"):
                    continue
                if name_rx is not None:
                    leaf = full.rsplit("/", 1)[-1] or "/"
                    glob, fold = name_rx
                    if fold:
                        leaf, glob = leaf.lower(), glob.lower()
                    if not fnmatch.fnmatchcase(leaf, glob):
                        continue
                out.append(shown + "\n")
        return "".join(out)

    def cmd_mkdir(self, args: list[str], stdin: str | None) -> str:
        flags, _, dirs = _flags(args, "mkdir", "p")
        if not dirs:
            raise SimFSError("mkdir: missing operand")
        for d in dirs:
            self.fs.mkdir(d, parents="p" in flags, cmd="mkdir: ")
        return ""

    def cmd_touch(self, args: list[str], stdin: str | None) -> str:
        _, _, files = _flags(args, "touch", "")
        if not files:
            raise SimFSError("touch: missing file operand")
        for f in files:
            if not self.fs.exists(f):
                self.fs.write(f, "", parents=False, cmd="touch: cannot touch: ")
        return ""

    def cmd_rm(self, args: list[str], stdin: str | None) -> str:
        flags, _, paths = _flags(args, "rm", "rRf")
        if not paths:
            raise SimFSError("rm: missing operand")
        for p in paths:
            if p.rstrip("/").split("/")[-1] in (".", ".."):
                raise SimFSError(f"rm: refusing to remove '.' or '..' directory: skipping '{p}'")
            if "f" in flags and not self.fs.exists(p):
                continue
            self.fs.remove(p, recursive=bool(flags & {"r", "R"}), cmd="rm: ")
        return ""

    def _targets(self, cmd: str, args: list[str]) -> tuple[list[str], str, bool]:
        if len(args) < 2:
            raise SimFSError(f"{cmd}: missing destination file operand" if args else f"{cmd}: missing file operand")
        srcs, dst = args[:-1], args[-1]
        into = self.fs.is_dir(dst)
        if len(srcs) > 1 and not into:
            raise SimFSError(f"{cmd}: target '{dst}' is not a directory")
        for s in srcs:
            if not self.fs.exists(s):
                raise SimFSError(f"{cmd}: cannot stat '{s}': No such file or directory")
        return srcs, dst, into

    def _place(self, cmd: str, src: str, dst: str, into: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        sp = self.fs.parts(src)
        if not sp:
            raise SimFSError(f"{cmd}: cannot {cmd} the root directory")
        dp = self.fs.parts(dst) + ((sp[-1],) if into else ())
        if dp == sp:
            raise SimFSError(f"{cmd}: '{src}' and '{dst}' are the same file")
        if isinstance(self.fs._node(sp), dict) and dp[: len(sp)] == sp:
            raise SimFSError(f"{cmd}: cannot {cmd} '{src}' into itself, '{dst}'")
        existing = self.fs._node(dp)
        if isinstance(existing, dict) and not isinstance(self.fs._node(sp), dict):
            raise SimFSError(f"{cmd}: cannot overwrite directory '{dst}' with non-directory")
        if existing is not None and isinstance(self.fs._node(sp), dict) and not isinstance(existing, dict):
            raise SimFSError(f"{cmd}: cannot overwrite non-directory '{dst}' with directory '{src}'")
        if isinstance(existing, dict) and existing:
            raise SimFSError(f"{cmd}: cannot {cmd} '{src}' to '{dst}': Directory not empty")
        return sp, dp

    def cmd_mv(self, args: list[str], stdin: str | None) -> str:
        _, _, ops = _flags(args, "mv", "f")
        srcs, dst, into = self._targets("mv", ops)
        for s in srcs:
            sp, dp = self._place("mv", s, dst, into)
            node = self.fs._node(sp)
            parent = self.fs._parent(dp, dst, "mv: cannot move: ")
            del self.fs._parent(sp, s)[sp[-1]]
            parent[dp[-1]] = node
            if self.fs.cwd[: len(sp)] == sp:  # moved the cwd: follow it, as a shell's cwd follows the inode
                self.fs.cwd = dp + self.fs.cwd[len(sp):]
        return ""

    def cmd_cp(self, args: list[str], stdin: str | None) -> str:
        flags, _, ops = _flags(args, "cp", "rRf")
        srcs, dst, into = self._targets("cp", ops)
        for s in srcs:
            node = self.fs._node(self.fs.parts(s))
            if isinstance(node, dict) and not flags & {"r", "R"}:
                raise SimFSError(f"cp: -r not specified; omitting directory '{s}'")
            sp, dp = self._place("cp", s, dst, into)
            new = copy.deepcopy(node)
            if isinstance(new, dict):
                size = SimFS()
                size.tree = new
                if self.fs.count_nodes() + size.count_nodes() > MAX_NODES:
                    raise SimFSError(f"cp: the file system would exceed {MAX_NODES} files and directories")
            self.fs._parent(dp, dst, "cp: cannot create: ")[dp[-1]] = new
        return ""

    def cmd_echo(self, args: list[str], stdin: str | None) -> str:
        newline = True
        if args and args[0] == "-n":
            newline, args = False, args[1:]
        return " ".join(args) + ("\n" if newline else "")

    def cmd_sort(self, args: list[str], stdin: str | None) -> str:
        flags, _, files = _flags(args, "sort", "rnu")
        lines = [ln.rstrip("\n") for _, t in self._inputs("sort", files, stdin) for ln in _lines(_ensure_nl(t))]
        if "n" in flags:
            def key(s: str) -> tuple[float, str]:
                m = re.match(r"\s*(-?\d+(?:\.\d+)?)", s)
                return (float(m.group(1)) if m else 0.0, s)

            lines.sort(key=key, reverse="r" in flags)
        else:
            lines.sort(reverse="r" in flags)
        if "u" in flags:
            lines = list(dict.fromkeys(lines))
        return "".join(ln + "\n" for ln in lines)

    def cmd_uniq(self, args: list[str], stdin: str | None) -> str:
        flags, _, files = _flags(args, "uniq", "c")
        if len(files) > 1:
            raise SimFSError("uniq: writing to an output file is not supported; give at most one input file")
        text = self._inputs("uniq", files, stdin)[0][1]
        groups: list[list[Any]] = []
        for ln in _lines(_ensure_nl(text)):
            ln = ln.rstrip("\n")
            if groups and groups[-1][0] == ln:
                groups[-1][1] += 1
            else:
                groups.append([ln, 1])
        if "c" in flags:
            return "".join(f"{c:>7} {ln}\n" for ln, c in groups)
        return "".join(ln + "\n" for ln, _ in groups)
