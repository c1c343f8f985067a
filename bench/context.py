"""Decode ms/token of Horizon's engine at growing contexts: Gated DSA's sparse selection against dense attention.

The `small` preset (its dtype, bf16, unless --dtype) with sparse selection (index_topk 2048). Baseline, on the
same weights and cache in the same process: dense attention (every indexer's topk raised above the
context). The prompt (ordinary tokens) is prefilled once per context (densely, which is faster; a decode
step's cost depends on the context length, not on the cached values), then decode steps alternate
sparse / dense / dense / sparse ... on that sequence; medians reported, `decode_speedup` = dense / sparse
(> 1: sparse is faster). At the largest context the top aten ops of a step in each mode are recorded too
(`--profile never` skips that).

    python bench/context.py                     # contexts 1024 4096 16384, 2 threads
    python bench/context.py --long              # adds 32K and 64K contexts
    python bench/context.py --quick --json      # tiny sizes (a smoke run)

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one JSON
object whose `context` key holds one row per context.
"""

from __future__ import annotations

import gc
import json
import time

import torch
from common import (
    Quiet,
    Recorder,
    build_ours,
    finish,
    finish_args,
    fmt,
    log,
    median,
    parser,
    random_tokens,
    rounded,
    set_topk,
    setup,
    submit,
    top_ops,
)

from horizon.engine import Engine, EngineConfig
from horizon.model import HorizonForCausalLM

OPTIONS = ("dtype", "contexts", "long", "context_steps", "profile", "profile_steps")


def section(args, model: HorizonForCausalLM, tok, quiet: Quiet) -> list[dict]:
    cfg = model.config
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    steps = args.context_steps
    for L in args.contexts:
        profile = L == max(args.contexts) and args.profile != "never"
        max_tokens = 2 * (steps + 1) * (quiet.retries + 1) + (2 * args.profile_steps if profile else 0) + 1
        engine = Engine(model, tok, EngineConfig(max_num_seqs=1, max_model_len=L + max_tokens,
                                                 max_batch_tokens=L))  # the prompt in one forward
        prompt = random_tokens(tok, cfg.vocab_size, (L,), gen)
        dense_k = L + max_tokens + 1
        set_topk(model, dense_k)
        rec = Recorder()
        rid = submit(engine, prompt, max_tokens, rec)
        t0 = time.perf_counter()
        while not rec.stamps[rid]:
            engine.step()
        prefill = time.perf_counter() - t0

        def timed_steps(engine=engine, dense_k=dense_k) -> dict:
            times = {"sparse": [], "dense": []}
            for i in range(steps + 1):  # the first pair warms up
                for mode in (("sparse", "dense") if i % 2 == 0 else ("dense", "sparse")):
                    set_topk(model, cfg.index_topk if mode == "sparse" else dense_k)
                    t0 = time.perf_counter()
                    engine.step()
                    if i:
                        times[mode].append(1000 * (time.perf_counter() - t0))
            return times

        times = quiet.run(f"context {L}", timed_steps)
        ops = {}
        if profile:  # where a long-context decode step goes, in each mode
            for mode, k in (("sparse", cfg.index_topk), ("dense", dense_k)):
                set_topk(model, k)
                ops[mode] = top_ops(engine.step, args.profile_steps, n=8)
        set_topk(model, cfg.index_topk)
        engine.cancel(rid)
        engine.run_until_idle()
        row = {"context": L, "index_topk": cfg.index_topk, "prefill_dense_s": prefill,
               "decode_ms_sparse": median(times["sparse"]), "decode_ms_dense": median(times["dense"]),
               "steps_ms_sparse": times["sparse"], "steps_ms_dense": times["dense"],
               "others_cores": times["others_cores"]}
        if ops:
            row["top_ops"] = ops
        row["decode_speedup"] = row["decode_ms_dense"] / row["decode_ms_sparse"]
        log(f"context {L:>6}: decode {row['decode_ms_sparse']:.1f} ms sparse / {row['decode_ms_dense']:.1f} ms dense "
            f"(prefill {prefill:.1f} s)")
        rows.append(row)
        del engine
        gc.collect()
    log(f"context: {json.dumps(rounded(rows))}")
    return rows


def summary_lines(res: dict) -> list[str]:
    if not res.get("context"):
        return []
    lines = ["", "decode ms/token vs context (sparse index_topk vs dense, same weights and cache)"]
    lines.append(f"  {'context':>8} {'sparse':>8} {'dense':>8} {'dense/sparse':>13}")
    for r in res["context"]:
        lines.append(f"  {r['context']:>8} {fmt(r['decode_ms_sparse']):>8} {fmt(r['decode_ms_dense']):>8} "
                     f"{fmt(r['decode_speedup'], 2):>13}")
    for r in res["context"]:
        for mode, ops in r.get("top_ops", {}).items():
            lines.append(f"  {mode} decode at {r['context']}: " +
                         ", ".join(f"{o['op']} {o['self_ms_per_step']:.1f}" for o in ops[:6]))
    return lines


def main(argv=None) -> None:
    args = finish_args(parser(__doc__, OPTIONS).parse_args(argv))
    res, cfg, tok, quiet = setup(args, "context", context=True)
    dtype = args.dtype or cfg.dtype
    log(f"building {args.preset} ({cfg.num_layers} layers) in {dtype}")
    res["context"] = section(args, build_ours(cfg, dtype, args.seed), tok, quiet)
    finish(res, args, quiet, [summary_lines])


if __name__ == "__main__":
    main()
