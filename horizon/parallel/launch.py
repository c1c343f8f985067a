"""Start the ranks of a tensor-parallel command on this machine, and end them all when one fails.

`horizon serve --tensor-parallel-size N` without torchrun's variables re-runs itself as N processes
(`python -m horizon ...` with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, the
contract torchrun uses, so `torchrun --nnodes K --nproc-per-node P -m horizon serve ...` runs the very
same code across machines). The launcher then watches them:
- a rank that exits non-zero (a crash, an out-of-memory kill, a broken group) ends every other rank
  and the launcher exits with an error naming it: never a server that hangs on a dead peer;
- SIGINT / SIGTERM go to rank 0 only, which drains its requests and stops the others through the
  engine (horizon.engine.Engine.stop); whatever is still running a few seconds after it exits is killed;
- if the launcher itself is killed outright (SIGKILL, which it cannot forward), the kernel ends the
  ranks too (Linux's parent-death signal), so no orphaned rank keeps a port or a GPU.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

from horizon.parallel.group import GROUP_FAILED_EXIT

GRACE_S = 10.0  # how long the other ranks may take to stop after rank 0 has


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL this rank when the launcher dies (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own teardown is all there is
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _end(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(argv: list[str], nprocs: int, command: str) -> int:
    """Run `python -m horizon *argv` as nprocs ranks; returns the exit status for the whole group."""
    threads = max(1, (os.cpu_count() or 1) // nprocs)  # ranks share the cores; oversubscribed OpenMP collapses
    base = {**os.environ, "WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    procs = [subprocess.Popen([sys.executable, "-m", "horizon", *argv],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              preexec_fn=_die_with_parent if sys.platform == "linux" else None)
             for r in range(nprocs)]

    def forward(sig, _frame):  # rank 0 drains, then stops the others itself
        if procs[0].poll() is None:
            procs[0].send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                time.sleep(0.5)  # the peers of a dead rank fail at their next collective: name the cause
                codes = [p.poll() for p in procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                cause = [(r, c) for r, c in failed if c != GROUP_FAILED_EXIT] or failed
                print(f"horizon {command}: " + "; ".join(f"rank {r} of {nprocs} {_describe(c)}" for r, c in cause)
                      + "; stopping the other ranks", file=sys.stderr, flush=True)
                _end(procs, grace_s=5.0)
                return 1
            if codes[0] == 0:  # rank 0 finished (and told the others to): give them a moment, then end them
                deadline = time.monotonic() + GRACE_S
                for p in procs[1:]:
                    try:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
                _end(procs, grace_s=5.0)
                late = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
                if late:
                    print(f"horizon {command}: rank 0 stopped, but " + "; ".join(
                        f"rank {r} {_describe(c)}" for r, c in late), file=sys.stderr, flush=True)
                return 1 if late else 0
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
