"""Decode tokens/s of Horizon's engine against same-size `transformers` models, batch 1 and 16.

`Engine.generate`-style serving of the `small` preset (all 12 layers) in fp32 and bf16, at batch 1 and 16
concurrent sequences (greedy, ignore_eos, a fixed prompt of ordinary tokens and output length).
Baseline, in the same process: transformers' `kimi_linear` (KDA + MLA + MoE) and `glm5_next` (KDA + DSA +
MoE) built with the same sizes (fp32, CPU, pure-PyTorch paths: fla / triton / causal_conv1d imports are
blocked), run through `model.generate(do_sample=False, min_new_tokens=max_new_tokens=N)` with their own
cache. Decode speed excludes prefill: tokens after each sequence's first one, divided by the time from the
moment every sequence has its first token to the last token. Rounds cycle through the models, so every
model sees the same machine load (the machine is shared and noisy: repeated, medians reported). Keys
`ratio_vs_<family>_batch<B>` compare our fp32 engine with theirs (fp32), `..._bf16` our bf16 engine;
`paired_ratios_...` the same per round (and `paired_aggregate_...`, each round's largest batch against its
batch 1). The weight-streaming floor (active weight bytes / measured
matrix-vector bandwidth) puts batch-1 numbers in perspective; `aggregate_cap_...` is the physical limit of the
aggregate ratio: the largest batch's tokens/s against batch 1's if both steps ran at the same fraction of their
floors (more sequences touch more routed experts: for `small` with MXFP4 experts over bf16 dense weights it is
6.0x at 16 sequences, with fp32 dense weights 8.4x).

    python bench/decode.py                    # the small preset, 2 threads
    python bench/decode.py --quick --json     # tiny sizes (a smoke run)
    python bench/decode.py --repeats 5 --batches 1 4 16 [--no-transformers]

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one JSON
object: the ratio keys, `decode` (per-model table, floors, transformers models), `differences`.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import torch
from common import (
    GOAL_BATCH1,
    Quiet,
    Recorder,
    build_hf_models,
    build_ours_pair,
    decode_rate,
    finish,
    finish_args,
    fmt,
    linear_times,
    load_transformers,
    log,
    median,
    parser,
    random_tokens,
    rounded,
    run_hf,
    setup,
    submit,
)

from horizon import ModelConfig
from horizon.engine import Engine, EngineConfig
from horizon.engine.memory import arena
from horizon.engine.memory import unavailable as huge_pages_unavailable
from horizon.model import HorizonForCausalLM

OPTIONS = ("repeats", "batches", "prompt", "new_tokens", "hf_attn", "glm5_hc_mult", "no_transformers", "formats",
           "enforce_eager")


def suffix(name: str) -> str:
    """The JSON keys' suffix for one of our models: "" for ours_fp32 (the issue's baseline), else "_<format>"."""
    return "" if name == "ours_fp32" else name[len("ours"):]


DIFFERENCES = {
    "common": [
        "same hidden size, layer count and KDA / attention schedule, heads, MLA ranks, dense and expert widths, "
        "experts (routed, per token, shared, groups), vocabulary; random weights (not the same values: speed does "
        "not depend on them, and routing is near-uniform on both sides)",
        "transformers runs its pure-PyTorch paths (fla, triton, causal_conv1d blocked), fp32, through generate() "
        "with its own cache (DynamicCache); ours runs through the engine (scheduler, sampler, stream parser, "
        "events), which generate() does not have to do",
        "their MLA decode re-expands every cached latent with kv_b_proj each step; ours attends to the latent "
        "directly (absorbed)",
    ],
    "kimi_linear": [
        "full-attention layers are plain MLA: no lightning indexer and no output gate (ours: Gated DSA; at these "
        "contexts, below index_topk, ours skips the indexer's selection but still computes and caches its keys)",
    ],
    "glm5_next": [
        "DSA is NoPE-only: qk_rope_head_dim 0, so qk_nope_head_dim = ours nope + rope (same q.k width and "
        "softmax scale; its latent row is kv_lora_rank wide, ours kv_lora_rank + rope)",
        "hyper-connections (hc_mult streams, Sinkhorn-normalised mixing, 2 per layer); hc_mult as --glm5-hc-mult "
        "(default 1: one residual stream of our width; the real model uses 4)",
        "its indexer scores pools of index_kpool=16 tokens and always runs (also below index_topk), then attends "
        "through a dense [q, kv] mask; ours scores single tokens and skips selection below index_topk",
        "SwiGLU clamp (swiglu_limit 10) and a lower-bounded KDA forget gate",
        "a vision tower (1 block, ~0.4M parameters) is built by Glm5NextForConditionalGeneration but never runs",
    ],
}


def gemv_bandwidth(dtype: torch.dtype, mbytes: int = 256, huge_pages: bool = False) -> float:
    """GB/s that a [1, K] x [K, N] product streams weights at (a batch-1 decode step's main cost); with
    `huge_pages`, its matrix on 2 MB pages as a compiled CPU runner places the model's weights."""
    k = 4096
    w = torch.randn(mbytes * 2**20 // (4 * k), k).to(dtype)
    if huge_pages:
        w = arena(w.nbytes).view(dtype).view(w.shape).copy_(w)
    x = torch.randn(1, k).to(dtype)
    return w.nbytes / min(linear_times(x, w, 6)) / 1e9


def step_weight_bytes(model: HorizonForCausalLM, batch: int) -> int:
    """Weight bytes a decode step of `batch` sequences reads: every weight tensor (parameters and the
    packed MXFP4 / int8 buffers) but the embedding table (one row a token) and the vision encoder (it runs
    per image), with each routed-expert stack counted for the share of experts the step is expected to
    touch, 1 - (1 - k/E)^batch under uniform routing (random weights route near-uniformly)."""
    cfg = model.config
    touched = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch
    total, seen = 0, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or not (t.is_floating_point() or t.dtype in (torch.uint8, torch.int8)):
            continue  # a tied tensor once; integer bookkeeping (the MoE load counts) is not a weight
        seen.add(id(t))
        if (name == "embed.weight" and not cfg.tie_word_embeddings) or name.startswith("vision."):
            continue
        total += int(t.numel() * t.element_size() * (touched if ".experts." in name else 1.0))
    return total


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    rec = Recorder()
    t0 = time.perf_counter()
    rids = [submit(engine, p, new_tokens, rec) for p in prompts]
    engine.run_until_idle()
    assert all(rec.finish[r].reason == "length" and len(rec.stamps[r]) == new_tokens for r in rids), rec.finish
    engine.clear_prefix_cache()  # the next run must not resume from these
    return decode_rate(t0, [rec.stamps[r] for r in rids])


def section(args, cfg: ModelConfig, ours: dict, tok, hf: dict, quiet: Quiet) -> dict:
    """The top-level keys: ratio_vs_* / paired_ratios_vs_*, "decode" and "differences"."""
    gen = torch.Generator().manual_seed(args.seed)
    prompts = random_tokens(tok, cfg.vocab_size, (max(args.batches), args.prompt), gen)
    runners = {}
    for name, model in ours.items():
        engine = Engine(model, tok, EngineConfig(
            max_num_seqs=max(args.batches), max_model_len=args.prompt + args.new_tokens,
            # every prompt prefills in one forward, so the sequences decode in lockstep (as generate does)
            max_batch_tokens=max(512, max(args.batches) * args.prompt), compile=not args.enforce_eager))
        runners[name] = (engine, run_ours)
    hf_info = {}
    for family, (model, info) in hf.items():
        runners[family], hf_info[family] = (model, run_hf), info
    log("warm-up: a short run per model and batch size (our compiled decode graphs are built here)")
    for obj, run in runners.values():
        for batch in args.batches:
            run(obj, prompts[:batch], 3)
    compile_s = {name: round(obj.runner.compile_seconds, 1) for name, (obj, run) in runners.items()
                 if isinstance(obj, Engine)}
    log(f"compile seconds: {compile_s}")
    placement = {name: obj.runner.weight_placement.describe() for name, (obj, run) in runners.items()
                 if isinstance(obj, Engine)}
    log(f"weight placement: {placement}")
    runs: dict[str, dict[int, list[dict]]] = {name: defaultdict(list) for name in runners}
    for r in range(args.repeats):
        for batch in args.batches:
            for name, (obj, run) in runners.items():
                res = quiet.run(f"round {r + 1} batch {batch} {name}",
                                lambda obj=obj, run=run, batch=batch: run(obj, prompts[:batch], args.new_tokens))
                runs[name][batch].append(res)
                log(f"round {r + 1}/{args.repeats} batch {batch:>2} {name:<12} {res['tok_per_s']:8.1f} tok/s "
                    f"({res['ms_per_step']:.1f} ms/step, prefill {res['prefill_s']:.2f} s)")
    table = {name: {str(b): {"tok_per_s": median([x["tok_per_s"] for x in rs]),
                             "ms_per_step": median([x["ms_per_step"] for x in rs]),
                             "prefill_s": median([x["prefill_s"] for x in rs]),
                             "tok_per_s_runs": [x["tok_per_s"] for x in rs],
                             "others_cores_runs": [x["others_cores"] for x in rs]}
                     for b, rs in by_batch.items()}
             for name, by_batch in runs.items()}
    ratios = {}
    for family in hf_info:
        for b in args.batches:
            for ours_name in ours:
                tail = suffix(ours_name)
                theirs = table[family][str(b)]["tok_per_s"]
                ratios[f"ratio_vs_{family}_batch{b}{tail}"] = table[ours_name][str(b)]["tok_per_s"] / theirs
                paired = [o["tok_per_s"] / t["tok_per_s"] for o, t in zip(runs[ours_name][b], runs[family][b],
                                                                          strict=True)]
                ratios[f"paired_ratios_vs_{family}_batch{b}{tail}"] = [round(x, 3) for x in paired]
    # memory bandwidth a weight-streaming matrix-vector product reaches, its matrix placed as our weights are
    # (engine/memory.py: on 2 MB pages where a compiled runner can put them), and on 4 KB pages for reference
    huge = not args.enforce_eager and huge_pages_unavailable() is None
    bw = gemv_bandwidth(torch.float32, huge_pages=huge)
    bw_4k = gemv_bandwidth(torch.float32) if huge else bw
    floors = {}
    for name, model in ours.items():
        floors[name] = {"gemv_GBps": round(bw, 2), "gemv_huge_pages": huge, "gemv_GBps_4k_pages": round(bw_4k, 2)}
        for b in args.batches:
            nbytes = step_weight_bytes(model, b)
            floor_ms = 1000 * nbytes / (bw * 1e9)
            ms = table[name][str(b)]["ms_per_step"]
            floors[name][str(b)] = {"step_weight_bytes": nbytes, "floor_ms_per_step": floor_ms,
                                    "ms_per_step": ms, "fraction_of_floor": floor_ms / ms}
            ratios[f"fraction_of_floor_{name}_batch{b}"] = floor_ms / ms
        b1, bmax = str(min(args.batches)), str(max(args.batches))
        if b1 != bmax:
            ratios[f"aggregate_batch{bmax}_vs_batch{b1}_{name}"] = (table[name][bmax]["tok_per_s"]
                                                                   / table[name][b1]["tok_per_s"])
            # per round (its batch-1 and batch-16 runs a few seconds apart): batch 1 is memory-bound and the
            # host's bandwidth drifts, so a ratio of medians taken over different minutes moves with it
            ratios[f"paired_aggregate_batch{bmax}_vs_batch{b1}_{name}"] = [
                round(hi["tok_per_s"] / lo["tok_per_s"], 3)
                for lo, hi in zip(runs[name][int(b1)], runs[name][int(bmax)], strict=True)]
            # the physical limit of that ratio: what it would be with both steps at the same fraction of their
            # weight-streaming floors (a step of more sequences touches more experts, so it reads more bytes)
            ratios[f"aggregate_cap_batch{bmax}_vs_batch{b1}_{name}"] = (
                int(bmax) * floors[name][b1]["step_weight_bytes"] / (int(b1) * floors[name][bmax]["step_weight_bytes"]))
    if "ours_bf16" in ours:
        for name in ours:
            if name not in ("ours_bf16", "ours_fp32"):
                for b in args.batches:
                    ratios[f"ratio_{name}_vs_ours_bf16_batch{b}"] = (table[name][str(b)]["tok_per_s"]
                                                                     / table["ours_bf16"][str(b)]["tok_per_s"])
    log(f"decode: {json.dumps(rounded(ratios))}")
    dec = {"table": table, "transformers_models": hf_info, "floors": floors, "prompt": args.prompt,
           "new_tokens": args.new_tokens, "compiled": not args.enforce_eager, "compile_seconds": compile_s,
           "weight_placement": placement}
    return {**ratios, "decode": dec, "differences": DIFFERENCES if hf else None}


def summary_lines(res: dict) -> list[str]:
    dec = res.get("decode")
    if not dec:
        return []
    lines = ["", f"decode tokens/s (prompt {dec['prompt']}, {dec['new_tokens']} new tokens, median of "
                 f"{res['settings']['repeats']}; prefill excluded)"]
    batches = list(next(iter(dec["table"].values())).keys())
    lines.append(f"  {'model':<14}" + "".join(f"{'batch ' + b:>14}" for b in batches))
    for name, row in dec["table"].items():
        lines.append(f"  {name:<14}" + "".join(f"{fmt(row[b]['tok_per_s']):>14}" for b in batches))
    for k, v in res.items():
        if k.startswith("ratio_vs_"):
            lines.append(f"  {k:<40} {v:.2f}")
    for name, f in dec["floors"].items():
        for b, x in f.items():
            if b != "gemv_GBps":
                lines.append(f"  {name} batch {b}: weight-streaming floor {x['floor_ms_per_step']:.1f} ms/step "
                             f"({x['step_weight_bytes'] / 1e6:.0f} MB at {f['gemv_GBps']} GB/s), measured "
                             f"{x['ms_per_step']:.1f} ms = {100 * x['fraction_of_floor']:.0f}% of the floor")
    for k, v in res.items():
        if k.startswith(("aggregate_batch", "aggregate_cap_batch")):
            lines.append(f"  {k:<40} {v:.2f}")
    return lines


def main(argv=None) -> None:
    args = finish_args(parser(__doc__, OPTIONS).parse_args(argv))
    res, cfg, tok, quiet = setup(args, "decode", goal_batch1=GOAL_BATCH1)
    tf = load_transformers(args, res)
    t0 = time.perf_counter()
    ours = build_ours_pair(cfg, args)
    hf = build_hf_models(tf, cfg, args)
    log(f"built in {time.perf_counter() - t0:.1f} s")
    res.update(section(args, cfg, ours, tok, hf, quiet))
    finish(res, args, quiet, [summary_lines])


if __name__ == "__main__":
    main()
