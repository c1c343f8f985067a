"""`horizon serve` as a process: it serves, and SIGTERM drains the requests in flight, then exits 0."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from horizon.server.background import free_port


def start(tmp_path, *flags: str, eager: bool = True, model: str = "tiny-random") -> tuple[subprocess.Popen, str]:
    """`horizon serve` on the random model (or `model`) at a free port, once /health answers: (process, url).
    Eager unless told otherwise: these tests are about the process, not compiling."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "horizon.cli", "serve", "--model", model, "--port",
                             str(port), "--signature-key-file", str(tmp_path / "key"), "--responses-db",
                             str(tmp_path / "responses.sqlite3"), "--log-level", "warning",
                             *(["--enforce-eager"] if eager else []), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc, url


def test_sigterm_lets_the_running_stream_finish_then_exits(tmp_path):
    # the random model: it never ends a turn by itself, so the stream is still running when SIGTERM lands
    proc, url = start(tmp_path, "--max-model-len", "512")
    try:
        chunks: list[dict] = []

        def stream():
            # the end-of-turn tokens banned: the random model runs to max_tokens, well past the SIGTERM
            ends = {str(t): -100 for t in (0, 6)}
            body = {"model": "horizon-tiny-random", "stream": True, "max_tokens": 200, "logit_bias": ends,
                    "messages": [{"role": "user", "content": "hello"}]}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))

        reader = threading.Thread(target=stream)
        reader.start()
        while not chunks:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)  # mid-stream
        reader.join(timeout=60)
        assert proc.wait(timeout=60) == 0  # a clean drain exits 0
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 150
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_drains_and_every_stream_ends_well_formed(tmp_path):
    proc, url = start(tmp_path, "--max-model-len", "4096", "--drain-timeout", "2")
    ends = {str(t): -100 for t in (0, 6)}  # the random model then runs to max_tokens: far past the deadline
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        long = {"model": model, "stream": True, "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}
        streams = {
            "openai": ("/v1/chat/completions", {**long, "logit_bias": ends}),
            # finishes within the drain, at its length: the end-of-turn tokens banned here too (sampled, the
            # random model once drew one within 8 tokens in a full `make test` run)
            "short": ("/v1/chat/completions", {**long, "max_tokens": 8, "logit_bias": ends}),
            "anthropic": ("/v1/messages", long),
            "responses": ("/v1/responses", {"model": model, "stream": True, "max_output_tokens": 4000,
                                            "input": "hi"}),
        }
        lines: dict[str, list[str]] = {k: [] for k in streams}
        started = threading.Barrier(len(streams) + 1, timeout=120)

        def read(name: str) -> None:
            path, body = streams[name]
            with httpx.stream("POST", url + path, json=body, timeout=120) as r:
                first = True
                for line in r.iter_lines():
                    lines[name].append(line)
                    if first and line.startswith("data: "):
                        first = False
                        started.wait()

        readers = [threading.Thread(target=read, args=(n,)) for n in streams]
        for t in readers:
            t.start()
        started.wait()
        proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(timeout=120)
        assert proc.wait(timeout=120) == 0

        def data(name):
            return [x[6:] for x in lines[name] if x.startswith("data: ")]

        openai = data("openai")
        assert openai[-1] == "[DONE]"
        error = json.loads(openai[-2])["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
        assert json.loads(data("short")[-2])["choices"][0]["finish_reason"] == "length"
        # these two cannot ban the end of the turn, so they may also have finished by themselves in time
        anthropic = [json.loads(x) for x in data("anthropic")]
        assert anthropic[0]["type"] == "message_start"
        assert anthropic[-1]["type"] == "message_stop" or (anthropic[-1]["type"] == "error" and anthropic[-1][
            "error"]["type"] == "overloaded_error")
        responses = [json.loads(x) for x in data("responses")]
        assert responses[-1]["type"] in ("response.completed", "response.failed")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_compiling_in_the_background_answers_at_once_and_exits_cleanly(tmp_path):
    """Without --enforce-eager the decode graphs compile on a thread from startup: the first request is
    answered without waiting for them (eagerly), the log and /metrics say how far they are, and SIGTERM still
    exits 0 at once, however far the compile has got (a thread left in torch's C++ code at exit can abort it)."""
    proc, url = start(tmp_path, "--max-model-len", "512", "--log-level", "info", eager=False)
    try:
        body = {"model": "horizon-tiny-random", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        gauges = {line.split()[0]: float(line.split()[1]) for line in httpx.get(url + "/metrics").text.splitlines()
                  if line.startswith("horizon_decode_graphs_")}
        # buckets 1, 2, 4, 8, 16 (16 slots), each dense and sparse (the window, 512, passes index_topk, 16)
        assert gauges["horizon_decode_graphs_compiled"] + gauges["horizon_decode_graphs_pending"] == 10
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "compiling 10 decode graphs in the background" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
