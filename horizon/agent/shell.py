"""A shell tool: runs `bash -c COMMAND` in a scratch working directory with resource limits and a timeout.

Each command runs in a new session (its own process group) with stdin from /dev/null, a reduced environment
(PATH, HOME=workdir, LANG, TERM=dumb) and rlimits set before exec: address space (default 1 GiB), CPU
seconds, the largest file it may write (default 64 MB), and no core dumps. stdout and stderr are merged and
read as they come, up to a cap (default 64 KB). On a wall-clock timeout, or when the output passes the cap,
the whole process group is killed with SIGKILL; when the command finishes, whatever it left running in its
group (`sleep 100 &`) is killed too.

Results: exit code 0 -> the output (plus "[output cut at N bytes]" if the cap was reached just as it
finished). An error result (`is_error=True`) for a nonzero exit ("exit code N"), death by a signal, a
timeout ("timed out after N s", with the output so far), or output past the cap while the command was
still running ("output cut at N bytes", the command was killed).

What this does NOT isolate -- it is a resource limiter, not a sandbox:
- the command runs as the same user as this process, with the same network access;
- it can read any file that user can read, and write outside the workdir with absolute or `../` paths;
- a process that calls setsid() or double-forks into another process group escapes the group kill;
- rlimits are per process (a fork bomb is bounded only by the user's process limit and the timeout).
For untrusted work, run the whole agent inside a container or VM (no network, a throwaway filesystem,
a non-privileged user) and treat this tool's limits as a second line.
"""

from __future__ import annotations

import math
import os
import resource
import select
import shutil
import signal
import subprocess
import time
from typing import Any

from .tool import Tool, ToolError

DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 120.0
DEFAULT_OUTPUT_BYTES = 64 * 1024
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_FILE_BYTES = 64 * 1024 * 1024


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Shell(Tool):
    name = "shell"
    parameters = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "a bash command line, run in the working directory"},
            "timeout_s": {"type": "number", "description": f"wall-clock limit; default {DEFAULT_TIMEOUT_S:g}"},
        },
        "required": ["command"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_timeout_s: float = MAX_TIMEOUT_S,
        max_output_bytes: int = DEFAULT_OUTPUT_BYTES,
        memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
        cpu_seconds: int | None = None,
        file_bytes: int | None = DEFAULT_FILE_BYTES,
    ):
        """cpu_seconds None: the call's timeout rounded up plus one (a backstop; the wall clock rules).
        memory_bytes / file_bytes None: not limited."""
        if not 0 < timeout_s <= max_timeout_s:
            raise ValueError(f"timeout_s must be in (0, {max_timeout_s}], got {timeout_s}")
        os.makedirs(workdir, exist_ok=True)
        self.workdir = os.path.realpath(os.fspath(workdir))
        self.timeout_s = float(timeout_s)
        self.max_timeout_s = float(max_timeout_s)
        self.max_output_bytes = int(max_output_bytes)
        self.memory_bytes = memory_bytes
        self.cpu_seconds = cpu_seconds
        self.file_bytes = file_bytes
        self.max_result_chars = self.max_output_bytes + 1000  # output is capped in bytes here; room for notes
        self.argv0 = shutil.which("bash") or shutil.which("sh") or "/bin/sh"
        self.description = (
            f"Run a {os.path.basename(self.argv0)} command line in the working directory {self.workdir} "
            f"(stdout and stderr merged; no stdin). Default timeout {self.timeout_s:g} s, at most "
            f"{self.max_timeout_s:g} s; output is cut at {self.max_output_bytes} bytes; memory and file sizes "
            "are limited. Nonzero exit codes are reported as errors.")

    def environment(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": self.workdir,
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "TERM": "dumb",
        }

    def _limits(self, cpu_seconds: int) -> Any:
        limits: list[tuple[int, int]] = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, cpu_seconds)]
        if self.memory_bytes is not None:
            limits.append((resource.RLIMIT_AS, self.memory_bytes))
        if self.file_bytes is not None:
            limits.append((resource.RLIMIT_FSIZE, self.file_bytes))

        def preexec() -> None:  # runs in the child between fork and exec: only cheap, async-safe work
            for which, value in limits:
                _, hard = resource.getrlimit(which)
                # A limit can only be lowered without privileges; never ask for more than the hard limit.
                v = value if hard == resource.RLIM_INFINITY else min(value, hard)
                resource.setrlimit(which, (v, v))

        return preexec

    def call(self, arguments: dict[str, Any]) -> str:
        command: str = arguments["command"]
        timeout = arguments.get("timeout_s", self.timeout_s)
        if not (isinstance(timeout, int | float) and 0 < timeout <= self.max_timeout_s):
            raise ToolError(f"timeout_s must be more than 0 and at most {self.max_timeout_s:g}, got {timeout}")
        if not command.strip():
            raise ToolError("command is empty")
        if "\x00" in command:
            raise ToolError("command contains a NUL character")
        cpu = self.cpu_seconds if self.cpu_seconds is not None else math.ceil(timeout) + 1
        os.makedirs(self.workdir, exist_ok=True)
        try:
            proc = subprocess.Popen(
                [self.argv0, "-c", command], cwd=self.workdir, env=self.environment(),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=self._limits(cpu), close_fds=True)
        except OSError as e:
            raise ToolError(f"could not start the shell: {e}") from None
        pgid = proc.pid  # start_new_session: the child leads its own session and process group
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        chunks: list[bytes] = []
        size = 0
        cut = timed_out = False
        still_running_at_cut = False
        deadline = time.monotonic() + timeout
        exited_at: float | None = None
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                # The shell has exited but something it started still holds the pipe open (`sleep 100 &`):
                # give its output a moment, then stop waiting for an EOF that may never come.
                if exited_at is not None and now - exited_at > 0.2:
                    break
                ready, _, _ = select.select([fd], [], [], min(0.05, deadline - now))
                if not ready:
                    continue
                data = os.read(fd, 65536)
                if not data:  # EOF: every writer closed its end; the shell may still be on its way out
                    timed_out = not _exited(proc, deadline)
                    break
                if size + len(data) > self.max_output_bytes:
                    chunks.append(data[: self.max_output_bytes - size])
                    size = self.max_output_bytes
                    cut = True
                    still_running_at_cut = proc.poll() is None
                    break
                chunks.append(data)
                size += len(data)
        finally:
            # Kill the group before reaping the leader, so the pgid cannot be reused in between; this also
            # ends anything the command left running in the background.
            _kill_group(pgid)
            proc.stdout.close()
            code = proc.wait()
        output = b"".join(chunks).decode("utf-8", errors="replace")
        if output and not output.endswith("\n"):
            output += "\n"
        if timed_out:
            raise ToolError(f"timed out after {timeout:g} s (the command and its process group were killed)\n"
                            + (output or "[no output]\n").rstrip("\n"))
        if cut and still_running_at_cut:
            raise ToolError(f"output cut at {self.max_output_bytes} bytes: the command was still writing and was "
                            f"killed; redirect to a file and read parts (head, tail, grep)\n{output}"
                            f"[output cut at {self.max_output_bytes} bytes]")
        note = f"[output cut at {self.max_output_bytes} bytes]" if cut else ""
        if code < 0:
            try:
                signame = signal.Signals(-code).name
            except ValueError:
                signame = f"signal {-code}"
            hint = " (CPU time limit)" if signame == "SIGXCPU" else ""
            raise ToolError(f"killed by {signame}{hint}\n{output}{note}".rstrip("\n"))
        if code != 0:
            raise ToolError(f"exit code {code}\n{output}{note}".rstrip("\n"))
        if not output and not note:
            return "[no output; exit code 0]"
        return (output + note).rstrip("\n")


def _exited(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait until the shell has exited (without reaping it, so its group id stays ours to kill) or the
    deadline passes; True if it exited (or was already reaped by an earlier poll())."""
    while True:
        if proc.returncode is not None:
            return True
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
