"""The agent's built-in tools: the calculator never executes code, file tools stay inside their root, the shell's
limits hold (timeout kills the whole group, output cap, memory), and the simulated terminal behaves like a shell."""

from __future__ import annotations

import builtins
import math
import os
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from horizon.agent.calculator import Calculator, CalculatorError, evaluate
from horizon.agent.files import ListFiles, ReadFile, SearchFiles, WriteFile
from horizon.agent.registry import make_tools
from horizon.agent.shell import Shell
from horizon.simfs import SimFS, Terminal, seeded_tree

# ---------------------------------------------------------------- calculator

VALUES = [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("2 ** 3 ** 2", 512),  # right-associative
    ("2 ^ 3 ^ 2", 512),
    ("-2 ** 2", -4),  # power binds tighter than a unary minus on its left
    ("(-2) ** 2", 4),
    ("2 ** -1", 0.5),
    ("--3", 3),
    ("-+-3", 3),
    ("7 // 2", 3),
    ("-7 // 2", -4),
    ("-7 % 3", 2),
    ("7 / 2", 3.5),
    ("1e-3", 0.001),
    ("1.5e3 + .5", 1500.5),
    ("2 ** 100", 1267650600228229401496703205376),
    ("10 ** 50 + 1 - 10 ** 50", 1),
    ("factorial(25)", 15511210043330985984000000),
    ("sqrt(16)", 4),
    ("sqrt(10 ** 400)", 10**200),  # exact for perfect squares beyond float range
    ("abs(-3)", 3),
    ("round(2.567, 2)", 2.57),
    ("round(2.5)", 2),
    ("floor(-1.5) + ceil(1.2)", 0),
    ("log(8, 2)", 3.0),
    ("log10(1000)", 3.0),
    ("log2(1024)", 10.0),
    ("ln(e)", 1.0),
    ("exp(0)", 1.0),
    ("min(3, 1.5, 2)", 1.5),
    ("max(1, 2, 3) * 2", 6),
    ("cos(pi)", -1.0),
    ("tau / 2 - pi", 0.0),
    ("atan(1) * 4", math.pi),
    ("0 ** 0", 1),
]


@pytest.mark.parametrize("expr,want", VALUES)
def test_calculator_values(expr, want):
    got = evaluate(expr)
    assert got == pytest.approx(want) if isinstance(want, float) else got == want
    assert type(got) is type(want) or isinstance(want, float)


def test_calculator_output_format():
    calc = Calculator()
    assert calc.run({"expression": "6 / 3"}).content == "2"  # integral floats print without ".0"
    assert calc.run({"expression": "0.1 + 0.2"}).content == "0.30000000000000004"
    assert calc.run({"expression": "2 ** 64"}).content == "18446744073709551616"
    assert calc.run({"expression": "1e20 * 10"}).content == "1e+21"
    assert calc.run('{"expression": "1 +"}').is_error


ERRORS = [
    ("1 / 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("sqrt(-1)", "domain"),
    ("log(0)", "domain"),
    ("(-8) ** (1/3)", "domain"),
    ("asin(2)", "domain"),
    ("2 ** 100000", "too large"),
    ("9 ** 9 ** 9", "too large"),
    ("factorial(1001)", "factorial"),
    ("factorial(2.5)", "factorial"),
    ("exp(1000)", "overflow"),
    ("10.0 ** 400", "overflow"),
    ("1e999", "too large"),
    ("(" * 70 + "1" + ")" * 70, "nested too deeply"),
    ("-" * 80 + "1", "nested too deeply"),
    ("1" * 1001, "at most 1000"),
    ("", "empty"),
    ("1 +", "end of the expression"),
    ("(1 + 2", "expected ')'"),
    ("1 2", "missing operator"),
    ("foo(1)", "unknown name 'foo'"),
    ("sin", "call it as sin(...)"),
    ("pi(2)", "constant"),
    ("max()", "position"),
    ("round(1, 2, 3)", "takes 1 or 2"),
    ("2 $ 3", "unexpected character '$'"),
    ("x = 3", "unexpected character '='"),
    ("x + 3", "unknown name 'x'"),
    ("__import__(1)", "unknown name '__import__'"),
]


@pytest.mark.parametrize("expr,fragment", ERRORS)
def test_calculator_errors(expr, fragment):
    with pytest.raises(CalculatorError) as e:
        evaluate(expr)
    assert fragment in str(e.value)
    result = Calculator().run({"expression": expr})
    assert result.is_error and fragment in result.content


_TRAPPED = ("eval", "exec", "compile", "__import__")


def _evaluate_trapped(text: str) -> None:
    """evaluate() with eval/exec/compile/__import__ replaced by traps: it must return a number or raise
    CalculatorError, and must not touch any of them."""
    calls: list[str] = []
    saved = {name: getattr(builtins, name) for name in _TRAPPED}

    def trap(name):
        def f(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"calculator called {name}")
        return f

    try:
        for name in _TRAPPED:
            setattr(builtins, name, trap(name))
        try:
            value = evaluate(text)
        except CalculatorError:
            value = None
    finally:
        for name, f in saved.items():
            setattr(builtins, name, f)
    assert not calls, f"{text!r} made the calculator call {calls}"
    if value is not None:
        assert type(value) in (int, float)
        assert not isinstance(value, float) or math.isfinite(value)


_PY_TOKENS = ["__import__", "os", ".", "(", ")", "'", '"', "lambda", "[", "]", "system", "touch", "PWNED", "eval",
              "exec", ",", ":", "=", "x", "a", "_", " ", "**", "^", "*", "/", "//", "%", "+", "-", "e", "pi", "sqrt",
              "log", "round", "factorial", "min", "1e5", "1.5", "9" * 40, *"0123456789"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_calculator_fuzz_text(text):
    _evaluate_trapped(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_PY_TOKENS), max_size=40).map("".join))
def test_calculator_fuzz_tokens(text):
    _evaluate_trapped(text)


def test_calculator_does_not_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = "__import__('os').system('touch PWNED')"
    with pytest.raises(CalculatorError):
        evaluate(payload)
    assert Calculator().run({"expression": payload}).is_error
    _evaluate_trapped(payload)
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------- files

@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    outside = tmp_path / "outside"
    (r / "src").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("top secret\n")
    (r / "src" / "main.py").write_text("def main():\n    # TODO: more\n    return 1\n")
    (r / "notes.txt").write_text("".join(f"line {i}\n" for i in range(1, 101)))
    (r / "link_file").symlink_to(outside / "secret.txt")
    (r / "link_dir").symlink_to(outside)
    (r / "dangling").symlink_to(outside / "new.txt")
    (r / "inner_link").symlink_to(r / "src" / "main.py")  # a symlink that stays inside is fine
    return r


def _err(result, *fragments):
    assert result.is_error, result.content
    assert result.content.startswith("error: ")
    for f in fragments:
        assert f in result.content, result.content


@pytest.mark.parametrize("path", ["../outside/secret.txt", "a/../../outside/secret.txt", "src/../../outside/secret.txt",
                                  "link_file", "link_dir/secret.txt", "link_dir/../outside/secret.txt"])
def test_files_refuse_escapes(root, path):
    _err(ReadFile(root).run({"path": path}), repr(path), "outside the root")
    _err(WriteFile(root).run({"path": path, "content": "pwned"}), repr(path), "outside the root")
    assert (root.parent / "outside" / "secret.txt").read_text() == "top secret\n"


def test_files_refuse_absolute_and_directory_escapes(root):
    _err(ReadFile(root).run({"path": "/etc/passwd"}), "'/etc/passwd'", "absolute")
    _err(WriteFile(root).run({"path": str(root / "x.txt"), "content": "x"}), "absolute")
    _err(ListFiles(root).run({"path": "link_dir"}), "'link_dir'", "outside the root")
    _err(ListFiles(root).run({"path": ".."}), "'..'", "outside the root")
    _err(SearchFiles(root).run({"pattern": "secret", "path": "link_dir"}), "outside the root")
    _err(SearchFiles(root).run({"pattern": "secret", "path": "../outside"}), "outside the root")
    # writing through a directory symlink, or a dangling symlink, must not create anything outside
    _err(WriteFile(root).run({"path": "link_dir/new.txt", "content": "x"}), "outside the root")
    _err(WriteFile(root).run({"path": "dangling", "content": "x"}), "'dangling'", "outside the root")
    _err(WriteFile(root).run({"path": "link_dir/sub/deep.txt", "content": "x"}), "outside the root")
    assert sorted(os.listdir(root.parent / "outside")) == ["secret.txt"]


def test_files_normal_use(root):
    w, r = WriteFile(root), ReadFile(root)
    res = w.run({"path": "out/deep/a.txt", "content": "hello\n"})
    assert not res.is_error and "created" in res.content
    assert (root / "out" / "deep" / "a.txt").read_text() == "hello\n"
    assert not w.run({"path": "out/deep/a.txt", "content": "again\n", "append": True}).is_error
    assert r.run({"path": "out/deep/a.txt"}).content == "hello\nagain\n"
    assert r.run({"path": "inner_link"}).content.startswith("def main")
    part = r.run({"path": "notes.txt", "offset": 10, "limit": 3}).content
    assert part == "line 10\nline 11\nline 12\n[lines 10-12 of 100; continue with offset=13]"
    cut = r.run({"path": "notes.txt", "max_chars": 20}).content
    assert cut.startswith("line 1\nline 2\n") and "continue with offset=" in cut

    listing = ListFiles(root).run({}).content.splitlines()
    assert "src/" in listing and "notes.txt" in listing and "out/" in listing
    assert any(x.startswith("link_dir -> ") and "outside the root" in x for x in listing)
    deep = ListFiles(root).run({"path": "out", "recursive": True}).content.splitlines()
    assert deep == ["out/deep/", "out/deep/a.txt"]

    hits = SearchFiles(root).run({"pattern": "TODO"}).content
    assert "src/main.py:2:     # TODO: more" in hits
    assert "symlinks pointing outside the root" in hits or "link_file" in hits  # skipped, and said so
    assert "secret" not in hits.split("[skipped")[0]
    rx = SearchFiles(root).run({"pattern": r"^line 9\d$", "regex": True, "path": "notes.txt"}).content
    assert rx.splitlines() == [f"notes.txt:{i}: line {i}" for i in range(90, 100)]
    assert "no matches" in SearchFiles(root).run({"pattern": "zzz"}).content


def test_files_refuse_bad_content(root):
    (root / "blob.bin").write_bytes(b"abc\x00def")
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    _err(ReadFile(root).run({"path": "blob.bin"}), "binary")
    _err(ReadFile(root).run({"path": "latin1.txt"}), "not valid UTF-8")
    _err(ReadFile(root).run({"path": "src"}), "is a directory")
    _err(ReadFile(root).run({"path": "missing.txt"}), "does not exist")
    _err(WriteFile(root).run({"path": "big.txt", "content": "x" * (1024 * 1024 + 1)}), "at most")
    _err(WriteFile(root).run({"path": "src", "content": "x"}), "is a directory")
    _err(SearchFiles(root).run({"pattern": "(a+)+$", "regex": True}), "exponential")
    _err(SearchFiles(root).run({"pattern": "(", "regex": True}), "invalid regular expression")
    _err(ReadFile(root).run({"path": "notes.txt", "offset": 0}), "offset")
    _err(ReadFile(root).run({"path": "notes.txt", "extra": 1}), "unknown argument")


# ---------------------------------------------------------------- shell

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed process whose parent has not reaped it yet is a zombie: dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_dead(pids: list[int], within: float = 2.0) -> list[int]:
    end = time.monotonic() + within
    while time.monotonic() < end:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _pids(workdir, *names) -> list[int]:
    return [int((workdir / n).read_text()) for n in names]


def test_shell_runs_in_workdir(tmp_path):
    wd = tmp_path / "work"
    sh = Shell(workdir=wd)
    assert wd.is_dir()
    res = sh.run({"command": "pwd; echo $HOME; echo hi > f.txt"})
    assert not res.is_error
    assert res.content.splitlines() == [os.path.realpath(wd)] * 2
    assert (wd / "f.txt").read_text() == "hi\n"
    assert sh.run({"command": "true"}).content == "[no output; exit code 0]"


def test_shell_nonzero_exit(tmp_path):
    res = Shell(workdir=tmp_path).run({"command": "echo oops >&2; exit 3"})
    assert res.is_error and "exit code 3" in res.content and "oops" in res.content


def test_shell_timeout_kills_the_group(tmp_path):
    sh = Shell(workdir=tmp_path)
    t0 = time.monotonic()
    res = sh.run({"command": "sleep 30 & echo $! > a.pid; sleep 30 & echo $! > b.pid; echo $$ > sh.pid; "
                             "echo started; wait", "timeout_s": 1})
    elapsed = time.monotonic() - t0
    assert elapsed < 1 + 2, elapsed
    assert res.is_error and "timed out after 1 s" in res.content and "started" in res.content
    assert _wait_dead(_pids(tmp_path, "a.pid", "b.pid", "sh.pid")) == []


def test_shell_kills_leftover_background_jobs(tmp_path):
    t0 = time.monotonic()
    res = Shell(workdir=tmp_path).run({"command": "sleep 30 & echo $! > bg.pid; echo done"})
    assert time.monotonic() - t0 < 3
    assert not res.is_error and res.content == "done"
    assert _wait_dead(_pids(tmp_path, "bg.pid")) == []


@pytest.mark.parametrize("command", ["yes", "yes | head -c 10000000"])
def test_shell_output_cap(tmp_path, command):
    sh = Shell(workdir=tmp_path, max_output_bytes=10_000)
    t0 = time.monotonic()
    res = sh.run({"command": command})
    assert time.monotonic() - t0 < 3
    assert res.is_error and "[output cut at 10000 bytes]" in res.content
    assert len(res.content) < 10_000 + 500


def test_shell_output_under_cap_is_whole(tmp_path):
    res = Shell(workdir=tmp_path, max_output_bytes=10_000).run({"command": "seq 1 1000"})
    assert not res.is_error and res.content.splitlines() == [str(i) for i in range(1, 1001)]


def test_shell_memory_limit(tmp_path):
    res = Shell(workdir=tmp_path).run({"command": f"{sys.executable} -c 'x = bytearray(4 * 1024 ** 3)'"})
    assert res.is_error and "MemoryError" in res.content


def test_shell_file_size_limit(tmp_path):
    res = Shell(workdir=tmp_path, file_bytes=1024 * 1024).run({"command": "head -c 3000000 /dev/zero > big"})
    assert res.is_error
    assert (tmp_path / "big").stat().st_size <= 1024 * 1024


def test_shell_rejects_bad_arguments(tmp_path):
    sh = Shell(workdir=tmp_path)
    _err(sh.run({"command": "true", "timeout_s": 1000}), "timeout_s")
    _err(sh.run({"command": "  "}), "empty")
    _err(sh.run({}), "missing required argument")


# ---------------------------------------------------------------- simulated terminal

FILES = {
    "README.md": "# demo\nhello world\n",
    "src/app.py": "import os\n# TODO: fix\nprint('hi')\n",
    "src/util.py": "def f():\n    return 1  # todo later\n",
    "logs/a.log": "INFO start\nERROR boom\nINFO done\nERROR again\n",
    "empty/": None,
}


@pytest.fixture
def term():
    return Terminal(SimFS.from_dict(FILES))


def _out(term, command):
    res = term.run({"command": command})
    assert not res.is_error, res.content
    return res.content


@pytest.mark.parametrize("command,want", [
    ("pwd", "/\n"),
    ("ls", "README.md\nempty/\nlogs/\nsrc/\n"),
    ("ls src", "app.py\nutil.py\n"),
    ("cat README.md", "# demo\nhello world\n"),
    ("head -n 1 logs/a.log", "INFO start\n"),
    ("tail -n 2 logs/a.log", "INFO done\nERROR again\n"),
    ("wc -l logs/a.log", "4 logs/a.log\n"),
    ("grep ERROR logs/a.log", "ERROR boom\nERROR again\n"),
    ("grep -n ERROR logs/a.log", "2:ERROR boom\n4:ERROR again\n"),
    ("grep -rin todo src", "src/app.py:2:# TODO: fix\nsrc/util.py:2:    return 1  # todo later\n"),
    ("grep -c INFO logs/a.log", "2\n"),
    ("find . -name '*.py'", "./src/app.py\n./src/util.py\n"),
    ("find src -type f", "src/app.py\nsrc/util.py\n"),
    ("cat logs/a.log | grep ERROR | wc -l", "2\n"),
    ("cut -f1 logs/a.log | sort", None),
    ("grep -o INFO logs/a.log | sort | uniq -c", None),
    ("grep INFO logs/a.log logs/a.log | sort | uniq -c",
     "      2 logs/a.log:INFO done\n      2 logs/a.log:INFO start\n"),
    ("echo 'a | b'", "a | b\n"),
    ('echo "x  y" z', "x  y z\n"),
    ("cat src/*.py | head -n 1", "import os\n"),
    ("cd src && pwd && cd .. && pwd", "/src\n/\n"),
])
def test_terminal_commands(term, command, want):
    if want is None:  # an unknown command or option: an error naming what is supported
        res = term.run({"command": command})
        assert res.is_error and ("command not found; supported commands: cat" in res.content
                                 or "invalid option -- 'o'; supported: -i" in res.content), res.content
        return
    assert _out(term, command) == want


def test_terminal_changes_state(term):
    before = term.fs.snapshot()
    assert _out(term, "mkdir -p a/b && echo hi > a/b/x.txt && echo more >> a/b/x.txt && touch a/t") == ""
    assert term.fs.read("a/b/x.txt") == "hi\nmore\n"
    assert _out(term, "cp -r a c && mv c/b/x.txt c/y.txt && rm -r a && rm logs/a.log") == ""
    assert term.fs.to_dict() == {"README.md": "# demo\nhello world\n", "c/b/": None, "c/t": "", "c/y.txt": "hi\nmore\n",
                                 "empty/": None, "logs/": None, "src/app.py": "import os\n# TODO: fix\nprint('hi')\n",
                                 "src/util.py": "def f():\n    return 1  # todo later\n"}
    assert term.fs.snapshot() != before
    res = term.run({"command": "rm src"})
    assert res.is_error and "Is a directory" in res.content
    res = term.run({"command": "cat nope; echo after"})  # ';' goes on, and the last command succeeded
    assert not res.is_error and res.content == "cat: nope: No such file or directory\nafter\n"
    assert term.run({"command": "cat nope && echo never"}).is_error
    assert _out(term, "cat nope || echo fallback").endswith("fallback\n")
    assert term.run({"command": "ls `pwd`"}).is_error


def test_terminal_cd_stays_at_root(term):
    assert _out(term, "cd ../../.. && pwd") == "/\n"
    assert _out(term, "cd src/../../.. && pwd") == "/\n"
    assert _out(term, "cd /src && cd ../.. && pwd") == "/\n"
    res = term.run({"command": "cd README.md"})
    assert res.is_error and "Not a directory" in res.content


def test_simfs_round_trip_and_equality():
    fs = SimFS.from_dict(FILES)
    assert fs.to_dict() == {k.lstrip("/"): v for k, v in sorted(FILES.items())}
    again = SimFS.from_dict(fs.to_dict())
    assert again == fs and again.snapshot() == fs.snapshot()
    copy = fs.copy()
    copy.write("new/file.txt", "x")
    assert copy != fs and copy.exists("new/file.txt") and not fs.exists("new/file.txt")
    assert fs.read("/src/app.py").startswith("import os")


def test_seeded_tree_is_deterministic():
    a, b, c = seeded_tree(7, 25), seeded_tree(7, 25), seeded_tree(8, 25)
    assert a == b and a != c
    assert len(a) == 25 and len(seeded_tree(3, 1)) == 1
    assert any(p.startswith("src/") for p in a) and any(p.startswith("logs/") for p in a)
    fs = SimFS.from_dict(a)
    assert fs.to_dict() == a
    assert Terminal(fs).run({"command": "find . -type f | wc -l"}).content == "25\n"


# ---------------------------------------------------------------- registry

def test_make_tools(tmp_path):
    tools = make_tools(["calculator", "files", "shell", "terminal"], tmp_path / "ws", seed=1)
    assert [t.name for t in tools] == ["calculator", "list_files", "read_file", "write_file", "search_files", "shell",
                                       "terminal"]
    with pytest.raises(ValueError, match="'nope'.*allowed: calculator"):
        make_tools(["nope"], tmp_path)
    with pytest.raises(ValueError, match="needs a root"):
        make_tools(["files"], None)
    with pytest.raises(ValueError, match="unique"):
        make_tools(["calculator", "calculator"])
