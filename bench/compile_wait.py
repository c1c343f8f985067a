"""How long requests wait while the decode graphs compile: on first use (the baseline) against in the background.

The bundled model behind a started engine (as `horizon serve` runs it), once with `compile=True` alone (a
step whose graph does not exist yet compiles it, and every request in that step waits) and once with
`compile_in_background=True` (every graph compiles on a thread of its own; a step whose graph is not ready
runs eagerly). Each mode runs in a fresh process with an empty inductor cache: what a new machine sees.
The same schedule for both: one request, then bursts of 2, 3 and 5 concurrent requests (new batch buckets),
then one request a second for --seconds. Each request is greedy, --new-tokens long, its prompt 40-100
ordinary tokens (the bundled model's index_topk is 64: dense and sparse graphs both come into play).
A request's latency runs from submit to its last token.

    python bench/compile_wait.py                 # both modes, ~8 minutes on 2 cores
    python bench/compile_wait.py --json --seconds 30

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one JSON
object: per mode and phase the latencies, the graphs compiled and still pending at the end, and
`max_wait_ratio` (first-use's longest wait over background's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from common import log, machine_info, median, ordinary_ids, rounded

PHASES = ("first", "burst2", "burst3", "burst5", "steady")


def child(args) -> dict:
    """One mode's run, in this (fresh) process."""
    from horizon.checkpoint import open_model
    from horizon.engine import Engine, EngineConfig, FinishEvent, Request, SamplingParams

    torch.set_num_threads(args.threads)
    bundle = open_model(None)
    t_start = time.perf_counter()
    engine = Engine(bundle.model, bundle.tokenizer,
                    EngineConfig(max_num_seqs=16, compile=True, compile_in_background=args.child == "background"))
    engine.start()
    gen = torch.Generator().manual_seed(0)
    pool = ordinary_ids(bundle.tokenizer, bundle.model.config.vocab_size)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    def burst(n: int) -> list[float]:
        """n requests at once; each one's seconds from submit to finish."""
        done, ends, lock = threading.Event(), {}, threading.Lock()

        def on_event(event) -> None:
            if isinstance(event, FinishEvent):
                with lock:
                    ends[event.request_id] = time.perf_counter()
                    if len(ends) == n:
                        done.set()

        starts = {}
        for _ in range(n):
            length = int(torch.randint(40, 101, (1,), generator=gen))
            prompt = pool[torch.randint(len(pool), (length,), generator=gen)].tolist()
            request = Request(prompt, params)
            starts[request.request_id] = time.perf_counter()
            engine.submit(request, on_event)
        done.wait()
        return [ends[r] - s for r, s in starts.items()]

    out = {}
    for phase, n in (("first", 1), ("burst2", 2), ("burst3", 3), ("burst5", 5)):
        out[phase] = burst(n)
        log(f"{args.child}: {phase} {max(out[phase]):.1f} s")
    out["steady"] = []
    t_end = time.perf_counter() + args.seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        out["steady"] += burst(1)
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
    log(f"{args.child}: steady {len(out['steady'])} requests, longest {max(out['steady']):.1f} s")
    runner = engine.runner
    res = {"latency_s": out, "graphs_compiled": len(runner.graphs_seen), "graphs_pending": runner.graphs_pending,
           "compile_seconds": runner.compile_seconds, "wall_s": time.perf_counter() - t_start}
    engine.stop()
    return res


def run_mode(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="horizon-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        cmd = [sys.executable, __file__, "--child", mode, "--seconds", str(args.seconds),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
        log(f"{mode}: a fresh process, inductor cache {cache}")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(res: dict) -> list[str]:
    lines = [f"{'mode':<12}" + "".join(f"{p:>16}" for p in PHASES) + "   graphs (pending)"]
    for mode in ("first_use", "background"):
        r = res[mode]
        cells = "".join(f"{median(r['latency_s'][p]):>7.2f} / {max(r['latency_s'][p]):>6.1f}" for p in PHASES)
        lines.append(f"{mode:<12}{cells}   {r['graphs_compiled']} ({r['graphs_pending']})")
    lines.append("(seconds a request took, median / longest, per phase)")
    lines.append(f"longest wait, first use over background: {res['max_wait_ratio']:.1f}x")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60, help="length of the one-request-a-second phase")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    ap.add_argument("--child", choices=["first_use", "background"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        os._exit(0)  # not waiting at exit for the graph the background compile is on (horizon.engine.runner)
    res = {"bench": "compile_wait", "machine": machine_info(),
           "settings": {"model": "bundled", "max_num_seqs": 16, "new_tokens": args.new_tokens,
                        "seconds": args.seconds, "threads": args.threads, "prompt_tokens": [40, 100]}}
    for mode in ("first_use", "background"):
        res[mode] = run_mode(mode, args)
    longest = {m: max(max(v) for v in res[m]["latency_s"].values()) for m in ("first_use", "background")}
    res["max_wait_ratio"] = longest["first_use"] / longest["background"]
    if not args.json:
        print("\n".join(summary(res)))
    print(json.dumps(rounded(res)))


if __name__ == "__main__":
    main()
