"""Decode on a CUDA GPU: the engine's tokens/s with compiled decode steps (inductor + CUDA graphs) against the
same engine run eagerly, per weight format and batch size, and against the weight-streaming floor.

Formats: bf16 (the preset as configured) and mxfp4 (the same weights, routed experts MXFP4: the Triton kernel).
Baseline, in the same run: the eager engine (`compile=False`, the reference) over the same model. Floor: the
weight bytes a step reads (bench/decode.py's step_weight_bytes) / the matrix-vector bandwidth measured here (a
[1, K] x [K, N] bf16 product over 1 GiB of weights, CUDA events). Engines run as `horizon serve` drives them
(greedy, ignore_eos, every prompt prefilled in one step so the sequences decode in lockstep); rounds cycle
through the engines, medians. Compile seconds (first use, inductor's cache as found) are reported.

    python bench/cuda_decode.py [--preset small] [--batches 1 16 64] [--repeats 3] [--new-tokens 64] [--json]
"""

from __future__ import annotations

import copy
import json
import time
from collections import defaultdict

import torch
from common import finish_args, log, median, parser, random_tokens, rounded
from decode import run_ours, step_weight_bytes

from horizon import HorizonForCausalLM, ModelConfig
from horizon.chat import load_tokenizer
from horizon.engine import Engine, EngineConfig


def gemv_bandwidth(dtype=torch.bfloat16, nbytes: int = 2**30) -> float:
    """GB/s a one-row product streams its weights at on the GPU (a batch-1 decode step's main cost)."""
    k = 8192
    w = torch.randn(nbytes // (k * torch.finfo(dtype).bits // 8), k, device="cuda", dtype=dtype)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x @ w.T
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return w.nbytes / min(times) / 1e9


def main(argv=None) -> None:
    ap = parser(__doc__, {"repeats", "batches", "prompt", "new_tokens"})
    ap.add_argument("--formats", nargs="+", default=["bf16", "mxfp4"], choices=["bf16", "mxfp4"])
    args = finish_args(ap.parse_args(argv))
    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda_decode.py needs a CUDA GPU (bench/decode.py measures the CPU)")
    from horizon.quant import quantize_model

    cfg = ModelConfig.preset(args.preset).replace(dtype="bfloat16")
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, layer_types=None)
    torch.manual_seed(args.seed)
    base = HorizonForCausalLM(cfg).eval()
    models = {"bf16": base}
    if "mxfp4" in args.formats:
        models["mxfp4"] = quantize_model(copy.deepcopy(base))  # on the CPU, before .cuda() moves base
    models = {f: models[f].cuda() for f in args.formats}
    tok = load_tokenizer()
    prompts = random_tokens(tok, cfg.vocab_size, (max(args.batches), args.prompt), torch.Generator().manual_seed(0))
    engines = {}
    for fmt, model in models.items():
        for compiled in (False, True):
            engines[f"{fmt}_{'compiled' if compiled else 'eager'}"] = Engine(model, tok, EngineConfig(
                max_num_seqs=max(args.batches), max_model_len=args.prompt + args.new_tokens,
                max_batch_tokens=max(512, max(args.batches) * args.prompt), compile=compiled))
    log("warm-up: a short run per engine and batch size (the compiled engines' graphs are made here)")
    t0 = time.perf_counter()
    for engine in engines.values():
        for batch in args.batches:
            run_ours(engine, prompts[:batch], 3)
    compile_s = {name: round(e.runner.compile_seconds, 1) for name, e in engines.items() if e.runner.compile}
    log(f"warm-up {time.perf_counter() - t0:.0f} s; compile seconds: {compile_s}")
    runs: dict[str, dict[int, list[dict]]] = {name: defaultdict(list) for name in engines}
    for r in range(args.repeats):
        for batch in args.batches:
            for name, engine in engines.items():
                res = run_ours(engine, prompts[:batch], args.new_tokens)
                runs[name][batch].append(res)
                log(f"round {r + 1}/{args.repeats} batch {batch:>3} {name:<15} {res['tok_per_s']:9.1f} tok/s "
                    f"({res['ms_per_step']:.2f} ms/step)")
    bw = gemv_bandwidth()
    table, ratios = {}, {}
    for name, by_batch in runs.items():
        model = models[name.split("_")[0]]
        table[name] = {}
        for b, rs in by_batch.items():
            ms = median([x["ms_per_step"] for x in rs])
            floor_ms = 1000 * step_weight_bytes(model, b) / (bw * 1e9)
            table[name][str(b)] = {"tok_per_s": median([x["tok_per_s"] for x in rs]), "ms_per_step": ms,
                                   "tok_per_s_runs": [x["tok_per_s"] for x in rs], "floor_ms_per_step": floor_ms,
                                   "fraction_of_floor": floor_ms / ms}
    for fmt in models:
        for b in args.batches:
            c, e = table[f"{fmt}_compiled"][str(b)], table[f"{fmt}_eager"][str(b)]
            ratios[f"compiled_vs_eager_{fmt}_batch{b}"] = c["tok_per_s"] / e["tok_per_s"]
            ratios[f"fraction_of_floor_{fmt}_batch{b}"] = c["fraction_of_floor"]
        b1, bmax = str(min(args.batches)), str(max(args.batches))
        ratios[f"aggregate_batch{bmax}_vs_batch{b1}_{fmt}"] = (table[f"{fmt}_compiled"][bmax]["tok_per_s"]
                                                              / table[f"{fmt}_compiled"][b1]["tok_per_s"])
    if {"bf16", "mxfp4"} <= set(models):
        for b in args.batches:
            ratios[f"mxfp4_vs_bf16_batch{b}"] = (table["mxfp4_compiled"][str(b)]["tok_per_s"]
                                                 / table["bf16_compiled"][str(b)]["tok_per_s"])
    res = {"bench": "cuda_decode", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "preset": args.preset, "layers": cfg.num_layers, "prompt": args.prompt, "new_tokens": args.new_tokens,
           "gemv_GBps": bw, "compile_seconds": compile_s, **ratios, "table": table}
    if not args.json:
        print(f"bench/cuda_decode.py on {res['gpu']} (torch {res['torch']}), preset {args.preset}, "
              f"GEMV bandwidth {bw:.0f} GB/s")
        for name, rows in table.items():
            for b, row in rows.items():
                print(f"  {name:<15} batch {b:>3}: {row['tok_per_s']:9.1f} tok/s, {row['ms_per_step']:.2f} ms/step, "
                      f"floor {row['floor_ms_per_step']:.3f} ms ({100 * row['fraction_of_floor']:.0f}%)")
    print(json.dumps(rounded(res)))


if __name__ == "__main__":
    main()
