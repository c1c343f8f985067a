"""A live `horizon serve --tensor-parallel-size 2` against a single-process server, driven by the official
SDKs: the same answers on both APIs; and killing one rank ends the whole server with a clear error."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from horizon.server.background import free_port


def start(tmp_path: Path, name: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "horizon", "serve", "--port", str(port), "--no-playground",
                             "--signature-key-file", str(tmp_path / f"{name}.key"), "--responses-db", ":memory:",
                             "--log-level", "warning", "--enforce-eager", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{name} server did not start:\n{proc.communicate()[0][-3000:]}")


def answers(url: str) -> list:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    out = []
    for content in ("What is 12 + 30?", "Name a colour."):
        r = oa.chat.completions.create(model="horizon-tiny", messages=[{"role": "user", "content": content}],
                                       max_tokens=40, temperature=0)
        out.append(r.choices[0].message.content)
    stream = oa.chat.completions.create(model="horizon-tiny", messages=[{"role": "user", "content": "Say hello."}],
                                        max_tokens=30, temperature=0.8, seed=3, stream=True,
                                        extra_body={"reasoning_effort": "low"})
    out.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    m = an.messages.create(model="horizon-tiny", max_tokens=40, extra_body={"temperature": 0},
                           messages=[{"role": "user", "content": "What is 7 * 6?"}])
    out.append([b.model_dump() for b in m.content])
    return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-serve")
    single = start(tmp, "single")
    try:
        tp = start(tmp, "tp", "--tensor-parallel-size", "2")
    except BaseException:
        single[0].kill()
        raise
    yield single, tp
    for proc, _ in (single, tp):
        if proc.poll() is None:
            proc.kill()


def test_two_ranks_answer_both_apis_like_one_process(servers):
    (_, single_url), (_, tp_url) = servers
    want, got = answers(single_url), answers(tp_url)
    assert got == want
    assert all(want)


def _rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    pids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, pids):
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        ranks[int(env["RANK"])] = pid
    return ranks


def test_killing_one_rank_ends_the_server_with_a_clear_error(servers):
    _, (launcher, url) = servers
    ranks = _rank_pids(launcher)
    assert sorted(ranks) == [0, 1]
    subprocess.run(["kill", "-9", str(ranks[1])], check=True)
    code = launcher.wait(timeout=60)  # not a hang
    output = launcher.communicate()[0]
    assert code == 1
    assert "rank 1 of 2 was killed by SIGKILL; stopping the other ranks" in output
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
    assert not Path(f"/proc/{ranks[0]}").exists() or _zombie(ranks[0])


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_sigterm_to_the_launcher_drains_and_stops_every_rank(tmp_path):
    proc, url = start(tmp_path, "tp-term", "--tensor-parallel-size", "2", "--model", "tiny-random")
    ranks = _rank_pids(proc)
    r = httpx.post(url + "/v1/chat/completions", json={"model": "horizon-tiny-random", "max_tokens": 5,
                                                        "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code == 0, proc.communicate()[0][-3000:]
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in ranks.values())


def _horizon(*argv: str, torchrun: int = 0) -> str:
    """stdout of `python -m horizon *argv`, or of it run as `torchrun` ranks (what a multi-node run does)."""
    run = ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port())] if torchrun else []
    proc = subprocess.run([sys.executable, *run, "-m", "horizon", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_generate_and_eval_on_two_ranks_print_what_one_process_prints():
    gen = ("generate", "--prompt", "What is 12 + 30?", "--tier", "low", "--max-tokens", "24", "--temperature", "0.8",
           "--seed", "5")
    one = _horizon(*gen)
    assert one.strip() and _horizon(*gen, "--tensor-parallel-size", "2") == one
    assert _horizon(*gen, "--tensor-parallel-size", "2", torchrun=2) == one
    ev = ("eval", "--n", "4", "--domains", "arithmetic,image", "--json")
    assert _horizon(*ev, "-tp", "2") == _horizon(*ev)


def test_a_launcher_killed_outright_takes_its_ranks_with_it(tmp_path):
    proc, url = start(tmp_path, "tp-kill", "--tensor-parallel-size", "2", "--model", "tiny-random")
    ranks = _rank_pids(proc)
    proc.kill()  # SIGKILL: nothing to forward, no teardown of its own
    proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() and not _zombie(pid)
                                              for pid in ranks.values()):
        time.sleep(0.2)
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in ranks.values()), "orphaned ranks"
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
