"""`horizon serve` as a process: it serves, and SIGTERM drains the request in flight before exiting."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from horizon.server.background import free_port


def test_sigterm_lets_the_running_stream_finish_then_exits(tmp_path):
    port = free_port()
    # the random model: it never ends a turn by itself, so the stream is still running when SIGTERM lands
    proc = subprocess.Popen([sys.executable, "-m", "horizon.cli", "serve", "--model", "tiny-random",
                             "--port", str(port), "--max-model-len", "512", "--signature-key-file",
                             str(tmp_path / "key"), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
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
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit status -SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 150
    finally:
        if proc.poll() is None:
            proc.kill()
