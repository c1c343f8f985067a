"""Horizon's engine against same-size `transformers` models, every benchmark in one process: runs the
sections of bench/decode.py, constrained.py, context.py, ttft.py and profile_step.py (see their docstrings
for what each measures and its baseline) on models built once, and prints one JSON object with all
their keys, as before they were split into scripts.

1. decode: tokens/s at batch 1 and 16, fp32 and bf16, against transformers' kimi_linear and glm5_next.
2. context: decode ms/token at growing contexts, sparse selection (index_topk) against dense attention.
3. ttft: next-turn time to first token after a long history, prefix reuse against recomputing it.
4. constrained: ms per generated token with a JSON-schema constraint against the same run without it.
5. profile: where a decode step goes, per component and top aten ops, beside transformers' kimi_linear.
   Runs by default when ratio_vs_kimi_linear_batch1 is below the issue's goal (4x).

    python bench/engine.py                    # default run, ~5-8 minutes on 2 CPU cores
    python bench/engine.py --quick --json     # tiny sizes (a smoke run)
    python bench/engine.py --long             # adds 32K and 64K contexts
    python bench/engine.py --sections decode --repeats 5 --batches 1 4 16

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one
JSON object with everything.
"""

from __future__ import annotations

import gc
import time

import constrained
import context
import decode
import profile_step
import ttft
from common import (
    GOAL_BATCH1,
    build_hf_models,
    build_ours,
    build_ours_pair,
    finish,
    finish_args,
    load_transformers,
    log,
    parser,
    setup,
)

SCRIPTS = {"decode": decode, "constrained": constrained, "context": context, "ttft": ttft, "profile": profile_step}


def main(argv=None) -> None:
    ap = parser(__doc__, {name for script in SCRIPTS.values() for name in script.OPTIONS})
    ap.add_argument("--sections", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    args = finish_args(ap.parse_args(argv))
    sections = set(args.sections)
    res, cfg, tok, quiet = setup(args, "engine", context="context" in sections, goal_batch1=GOAL_BATCH1)
    tf = load_transformers(args, res) if {"decode", "profile"} & sections else None
    t0 = time.perf_counter()
    ours = build_ours_pair(cfg, args)
    hf = build_hf_models(tf, cfg, args)
    log(f"built in {time.perf_counter() - t0:.1f} s")
    if "decode" in sections:
        res.update(decode.section(args, cfg, ours, tok, hf, quiet))
        gc.collect()
    if "constrained" in sections:
        res.update(constrained.section(args, ours["ours_fp32"], tok, quiet))
    below = res.get("ratio_vs_kimi_linear_batch1", 0.0) < GOAL_BATCH1
    if "profile" in sections and (args.profile == "always" or (args.profile == "auto" and below)):
        res["profile"] = profile_step.section(args, cfg, ours, tok, hf)
    del hf
    gc.collect()
    long_dtype = args.dtype or cfg.dtype
    long_model = ours["ours_bf16" if long_dtype == "bfloat16" else "ours_fp32"]
    if long_dtype not in ("bfloat16", "float32"):
        long_model = build_ours(cfg, long_dtype, args.seed, like=ours["ours_fp32"])
    ours.clear()  # only long_model stays
    gc.collect()
    if "context" in sections:
        res["context"] = context.section(args, long_model, tok, quiet)
    if "ttft" in sections:
        res["ttft"] = ttft.section(args, long_model, tok, quiet)
    finish(res, args, quiet, [m.summary_lines for m in (decode, context, ttft, constrained, profile_step)])


if __name__ == "__main__":
    main()
