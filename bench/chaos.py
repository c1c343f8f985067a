"""Chaos load against a live in-process server: random disconnects, poisoned and malformed requests, a burst
against the queue limit. Prints one JSON object: requests, disconnects, poisons, refusals, leaks, mismatches.

    .venv/bin/python bench/chaos.py --streams 192 --concurrency 24

The baseline is measured in the same run: every prompt is first answered alone (greedy); a greedy
stream that completes under load must say exactly that (a mismatch otherwise). Leaks are counted once
the load has drained: unfinished engine sequences, KDA slots not free, DSA blocks held by anything but
the prefix cache. A correctness soak, not a speed benchmark: no timing is asserted or compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from horizon.checkpoint import open_model
from horizon.engine import Engine, EngineConfig
from horizon.server import ServerSettings, create_app
from horizon.server.background import BackgroundServer
from horizon.serving import ModelService

MODEL = "horizon-chaos"


def build(tmp: str, max_queue: int, max_num_seqs: int) -> tuple[BackgroundServer, Engine]:
    bundle = open_model("tiny-random")
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=1024,
                                                                 max_batch_tokens=256),
                    generation_config=bundle.generation_config)
    service = ModelService(engine, bundle.tokenizer, MODEL, max_queue=max_queue)
    app = create_app(service, ServerSettings(signature_key_file=f"{tmp}/sig.key", responses_db=":memory:",
                                             reasoning_key_file=f"{tmp}/reasoning.keys"))
    return BackgroundServer(app), engine


def body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0,
            **extra}


async def stream(client: httpx.AsyncClient, url: str, payload: dict, cut_after: int | None) -> dict:
    """One streamed chat; cut_after: disconnect after that many data lines."""
    text, lines, error = [], 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json={**payload, "stream": True}) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            lines += 1
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            elif event.get("choices"):
                text.append(event["choices"][0]["delta"].get("content") or "")
            if cut_after is not None and lines >= cut_after:
                return {"status": 200, "cut": True}
    return {"status": 200, "text": "".join(text), "error": error}


async def run(args) -> dict:
    import tempfile

    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp()
    srv, engine = build(tmp, max_queue=args.streams, max_num_seqs=16)
    with srv:
        url = srv.url
        prompts = [f"chaos prompt {i}: " + " ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(i % 9))
                   for i in range(args.prompts)]
        async with httpx.AsyncClient(timeout=300) as client:
            alone = {}
            for p in prompts:  # the baseline: each prompt answered alone
                r = await client.post(url + "/v1/chat/completions", json=body(p))
                alone[p] = r.json()["choices"][0]["message"]["content"]
            banned = {str(t): -100 for t in range(4096)}
            kinds = ["normal"] * 6 + ["cut"] * 3 + ["poison_banned", "poison_tiny_temperature", "malformed"]
            sem = asyncio.Semaphore(args.concurrency)
            counts = {"requests": 0, "completed": 0, "disconnects": 0, "poison_banned": 0, "poison_banned_errors": 0,
                      "poison_tiny_temperature": 0, "malformed": 0, "malformed_4xx": 0, "mismatches": 0,
                      "server_errors": 0}

            async def one(i: int) -> None:
                kind, prompt = rng.choice(kinds), rng.choice(prompts)
                async with sem:
                    counts["requests"] += 1
                    if kind == "malformed":
                        counts["malformed"] += 1
                        bad = rng.choice([json.dumps({"model": MODEL, "messages": "x"}), '{"stream": "yes"}', "[1, 2",
                                          json.dumps({"model": MODEL, "max_tokens": "10", "messages": []})])
                        r = await client.post(url + "/v1/chat/completions", content=bad,
                                              headers={"content-type": "application/json"})
                        counts["malformed_4xx"] += 400 <= r.status_code < 500
                        counts["server_errors"] += r.status_code >= 500
                        return
                    if kind.startswith("poison"):
                        counts[kind] += 1
                        extra = {"logit_bias": banned} if kind == "poison_banned" else {"temperature": 1e-40}
                        out = await stream(client, url, body(prompt, **extra), None)
                        if kind == "poison_banned":  # its own error event, nobody else's
                            counts["poison_banned_errors"] += out.get("error") is not None
                        else:  # a temperature that once overflowed: now greedy, so it must equal the baseline
                            counts["mismatches"] += out.get("text") != alone[prompt]
                        return
                    cut = rng.randrange(1, 12) if kind == "cut" else None
                    out = await stream(client, url, body(prompt), cut)
                    counts["server_errors"] += out["status"] >= 500
                    if out.get("cut"):
                        counts["disconnects"] += 1
                    else:
                        counts["completed"] += 1
                        counts["mismatches"] += out.get("text") != alone[prompt] or out.get("error") is not None

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.streams)))
            counts["seconds"] = round(time.perf_counter() - start, 1)
        for _ in range(200):  # cancellations are applied between steps
            if not engine.sequences:
                break
            await asyncio.sleep(0.05)
        sch = engine.scheduler
        prefix_blocks = {b for e in sch.prefix.entries.values() for b in e.blocks}
        counts["leaks"] = (len(engine.sequences) + (sch.slots.num_slots - sch.slots.num_free) +
                           (sch.blocks.num_blocks - sch.blocks.num_free - len(prefix_blocks)))
    burst = await burst_against_queue(tmp, args.burst)
    return {"chaos": counts, "burst": burst}


async def burst_against_queue(tmp: str, n: int) -> dict:
    """n concurrent requests against 2 slots and a queue of 2: how many got in, and were refused properly."""
    srv, engine = build(tmp, max_queue=2, max_num_seqs=2)
    accepted, submit = [], engine.submit

    def counted(request, on_event, max_queued=None):
        submit(request, on_event, max_queued)
        accepted.append(len(engine.sequences))

    engine.submit = counted
    with srv:
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(srv.url + "/v1/chat/completions", json=body(f"burst {i}"))
                                        for i in range(n)))
    codes = [r.status_code for r in rs]
    return {"requests": n, "ok": codes.count(200), "refused_429": codes.count(429),
            "refused_with_retry_after": sum(r.status_code == 429 and "retry-after" in r.headers for r in rs),
            "max_accepted_at_once": max(accepted, default=0), "limit_running_plus_queue": 4,
            "other": sorted(set(codes) - {200, 429})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--burst", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(run(p.parse_args())), indent=2))


if __name__ == "__main__":
    main()
