"""The seeds' 1M-token context at small scale: the bundled model's shape (`mini`) with its window raised
to 1,048,576 tokens (its attention has no positional limit: KDA carries position, the DSA layers rotate
by absolute position), prefilled in chunks and then decoded.

Measures, in one process, through horizon.engine.runner.ModelRunner (eager, and compiled for decode):
- prefill: a real chunked prefill (--chunk tokens a forward) of random ordinary tokens at each of
  --prefill-lengths, its seconds and the process's peak RSS growth; then a least-squares fit
  t(L) = a L + b L^2 over those runs, and what it predicts for 1,048,576 tokens (the lightning
  indexer scores every past position for every query: O(L^2) work, bounded memory);
- decode ms/token at each of --decode-lengths with a cache already holding that many tokens. Up to
  the longest prefill the cache is the real prefill's; past it (1M) the latent and indexer rows are
  written directly (random rows of the right scale: a decode step's cost does not depend on their
  values), since the real 1M prefill does not fit a benchmark run on 2 cores (see the prediction);
- the same decode steps with the DSA layers' cached rows gathered into new tensors first (the PyTorch
  references, `*_gathered_ms`: the indexer's keys, then the selected latent rows): the baseline, in the same
  run, for the kernels that read them in place from the paged pool (horizon/quant/kernels/indexer.cpp and
  attention.cpp), which decode uses;
- the cache's bytes at 1M: DSA rows per token times tokens, plus the constant KDA state.

    python bench/million.py                    # ~10 minutes on 2 cores
    python bench/million.py --quick            # smaller lengths (a smoke run)
    python bench/million.py --preset small --prefill-lengths 1024 --decode-lengths 1024 65536
                                               # another preset's shape (random fp32 weights): its 64K decode
    python bench/million.py --preset small --prefill-lengths 1024 --decode-lengths 1024 65536 --interleave
                                               # and 64K against 1K step by step, in one run

Prints progress on stderr and one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
from common import fill_synthetic, gathered_rows

from horizon import ModelConfig
from horizon.checkpoint import open_model
from horizon.engine.runner import ModelRunner, StepInputs
from horizon.model import HorizonCache, HorizonForCausalLM

MILLION = 1 << 20


def log(msg: str) -> None:
    print(f"[bench/million {time.strftime('%H:%M:%S')}] {msg}", flush=True, file=__import__("sys").stderr)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prefill(runner: ModelRunner, tokens: list[int], chunk: int, slot: int = 0) -> float:
    runner.cache.reset([slot])
    t0 = time.perf_counter()
    for s in range(0, len(tokens), chunk):
        runner.run(StepInputs([tokens[s: s + chunk]], [s], [slot]))
    return time.perf_counter() - t0


def step_times(runner: ModelRunner, length: int, steps: int, slot: int = 0) -> list[float]:
    """Seconds of `steps` decode steps at a context of `length` tokens (the cache is put back after)."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        runner.run(StepInputs([[1000 + i]], [length + i], [slot]))
        times.append(time.perf_counter() - t0)
    runner.cache.lens[slot] = length
    return times


def interleaved_ms(runner: ModelRunner, short: int, long: int, steps: int, rounds: int = 6) -> tuple[float, float]:
    """(ms/token at `short` tokens in slot 0, at `long` in slot 1), alternating in `rounds` rounds: the ratio
    of two lengths measured apart moves with the machine's drift between the runs (1.3-1.8x for the same
    pair, measured), measured together it does not; medians."""
    step_times(runner, short, 2, 0)
    step_times(runner, long, 2, 1)
    a, b = [], []
    for _ in range(rounds):
        a += step_times(runner, short, max(2, steps // rounds), 0)
        b += step_times(runner, long, max(2, steps // rounds), 1)
    return 1000 * statistics.median(a), 1000 * statistics.median(b)


def paired_decode_ms(runner: ModelRunner, length: int, steps: int, rounds: int = 4,
                     slot: int = 0) -> tuple[float, float]:
    """(ms/token reading the cached rows in place, ms/token gathering them), interleaved in `rounds` rounds
    (this machine's speed drifts between runs: interleaving keeps the two comparable); medians."""
    step_times(runner, length, 2, slot)  # warm (and, compiled, the first graph of each kind)
    with gathered_rows():
        step_times(runner, length, 2, slot)
    kernel, gathered = [], []
    for _ in range(rounds):
        kernel += step_times(runner, length, max(2, steps // rounds), slot)
        with gathered_rows():
            gathered += step_times(runner, length, max(2, steps // rounds), slot)
    return 1000 * statistics.median(kernel), 1000 * statistics.median(gathered)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=None)
    ap.add_argument("--decode-lengths", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-compile", action="store_true", help="decode eagerly only")
    ap.add_argument("--interleave", action="store_true",
                    help="also time each decode length alternating with the first one (a second cache slot holds "
                         "the first length's context): a ratio to the first length free of the machine's drift")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--preset", default=None, help="a preset's shape with random fp32 weights (default: the bundled "
                                                   "model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prefill_lengths = args.prefill_lengths or ([1024, 4096] if args.quick else [1024, 8192, 32768])
    # the last: as close to 1M as leaves room for the decoded tokens inside the 1,048,576-token window
    decode_lengths = args.decode_lengths or ([1024, 4096, 65536] if args.quick else [1024, 32768, MILLION - 64])
    if args.preset:
        torch.manual_seed(0)
        model, source = HorizonForCausalLM(ModelConfig.preset(args.preset).replace(dtype="float32")).eval(), args.preset
    else:
        bundle = open_model(None)
        model, source = bundle.model, bundle.source
    model.config.max_position_embeddings = MILLION  # no positional limit in the attention: only the window
    cfg = model.config
    max_len = min(MILLION, max(decode_lengths) + args.steps + 1)
    cache = HorizonCache(cfg, 2 if args.interleave else 1, max_len, dtype=model.embed.weight.dtype)
    res = {"bench": "million", "model": source, "layers": cfg.layer_types, "index_topk": cfg.index_topk,
           "threads": args.threads, "chunk": args.chunk, "cache_max_len": max_len,
           "dsa_bytes_per_token": cache.bytes_per_token(), "kda_state_bytes": cache.state_bytes_per_slot(),
           "rss_mb_after_cache": round(rss_mb(), 1)}
    res["dsa_cache_bytes_at_1M"] = res["dsa_bytes_per_token"] * MILLION
    ids = torch.arange(40, 4000)
    gen = torch.Generator().manual_seed(0)
    tokens = ids[torch.randint(0, len(ids), (max(prefill_lengths),), generator=gen)].tolist()
    eager = ModelRunner(model, cache, compile=False)
    runs = []
    for L in sorted(prefill_lengths):
        before = rss_mb()
        s = prefill(eager, tokens[:L], args.chunk)
        runs.append({"tokens": L, "seconds": round(s, 2), "tok_per_s": round(L / s, 1),
                     "peak_rss_mb": round(rss_mb(), 1), "peak_rss_growth_mb": round(rss_mb() - before, 1)})
        log(f"prefill {L}: {s:.1f} s ({L / s:.0f} tok/s), peak RSS {rss_mb():.0f} MB")
    # t = a L + b L^2, least squares over the runs
    A = torch.tensor([[r["tokens"], r["tokens"] ** 2] for r in runs], dtype=torch.float64)
    y = torch.tensor([r["seconds"] for r in runs], dtype=torch.float64)
    a, b = torch.linalg.lstsq(A, y[:, None]).solution.flatten().tolist()
    res["prefill"] = {"runs": runs, "fit_seconds": {"linear_per_token": a, "quadratic_per_token2": b},
                      "predicted_seconds_at_1M": a * MILLION + b * MILLION**2,
                      "quadratic_share_at_1M": b * MILLION / (a + b * MILLION)}
    compiled = None if args.no_compile else ModelRunner(model, cache, compile=True)
    longest = max(prefill_lengths)
    first = min(decode_lengths)
    if args.interleave:  # the first length's context stays in slot 0 for the whole run
        if first > longest:
            fill_synthetic(cache, first, gen, slot=0)
        else:
            prefill(eager, tokens[:first], args.chunk, slot=0)
    decode = []
    for L in sorted(decode_lengths):
        slot = 1 if args.interleave else 0
        if L > longest:
            fill_synthetic(cache, L, gen, slot)
        else:
            prefill(eager, tokens[:L], args.chunk, slot)
        row = {"context": L, "cache": "synthetic" if L > longest else "prefilled"}
        for name, runner in (("eager", eager), ("compiled", compiled)):
            if runner is not None:  # compiled: one graph per kind (the context is a dynamic size)
                ms, gathered = paired_decode_ms(runner, L, args.steps, slot=slot)
                row[f"{name}_ms"], row[f"{name}_gathered_ms"] = round(ms, 2), round(gathered, 2)
                if args.interleave and L != first:
                    short, long = interleaved_ms(runner, first, L, 2 * args.steps)
                    row[f"{name}_interleaved_first_ms"], row[f"{name}_interleaved_ms"] = round(short, 2), round(long, 2)
                    row[f"{name}_interleaved_vs_first"] = round(long / short, 3)
        row["peak_rss_mb"] = round(rss_mb(), 1)
        decode.append(row)
        log(f"decode at {L}: {row}")
    res["decode"] = decode
    base = decode[0]
    for row in decode:
        for k in ("eager_ms", "compiled_ms", "eager_gathered_ms", "compiled_gathered_ms"):
            if k in row:
                row[k.replace("_ms", "_vs_first")] = round(row[k] / base[k], 2)
        for k in ("eager", "compiled"):
            if f"{k}_ms" in row:  # > 1: scoring in place is faster than gathering
                row[f"{k}_kernel_speedup"] = round(row[f"{k}_gathered_ms"] / row[f"{k}_ms"], 2)
    if compiled is not None:
        res["compile_seconds"] = round(compiled.compile_seconds, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
