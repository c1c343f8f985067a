"""The DSA indexer's exact top-k (horizon/quant/kernels/topk.cpp) against the PyTorch paths beside it, on the
score rows a decode step gives it.

Each case is rows x length scores with k picks. `random` rows are Gaussian; `mixed` rows are a batched step's:
the first row spans the whole length, the others are -inf past 1,024 positions (short sequences in a batch
whose scores span the longest context). Three selections, rounds interleaved, medians:
- `kernel`: `topk_recent_first` with the CPU kernels built (exact: score, then the later position);
- `integer_compiled`: the exact (score, position) integer top-k that compiled graphs take without the kernels
  (`_topk_by_score_then_position` under torch.compile; compile seconds reported);
- `float`: torch.topk of the float scores, which is not exact on ties: what an unordered selection costs.
The limit is the bytes of scores read once at the run's cold read bandwidth (in a step the scores were just
written, so they are usually in cache, and the limit is looser than that). Every case checks that the kernel
and the integer path select the same positions.

    python bench/topk.py [--threads 2] [--repeats 7] [--quick] [--json]

Prints a table (unless --json) and, on the last line, one JSON object. `ratio_vs_*` > 1: the kernel is faster.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from common import kernel_args, kernel_parser, log, read_bandwidth, timed

from horizon.model.dsa import _topk_by_score_then_position, topk_recent_first

# (rows, length, k, kind)
GRID = [(1, 65536, 2048, "random"), (1, 1 << 20, 2048, "random"), (16, 8192, 2048, "random"),
        (64, 256, 64, "random"), (16, 65536, 2048, "mixed")]
QUICK_GRID = [(1, 65536, 2048, "random"), (4, 8192, 2048, "mixed")]
SHORT = 1024  # visible positions of the short rows of a `mixed` case


def scores_for(R: int, L: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    s = torch.randn(R, L, generator=gen)
    if kind == "mixed":
        s[1:, SHORT:] = float("-inf")
    return s


def as_sets(idx: torch.Tensor) -> list[set[int]]:
    return [set(row) for row in idx.tolist()]


def measure(s: torch.Tensor, k: int, kind: str, repeats: int, bandwidths: list[float]) -> dict:
    R, L = s.shape
    calls = max(3, min(200, (1 << 22) // (R * L)))
    integer = torch.compile(_topk_by_score_then_position, dynamic=False)
    t0 = time.perf_counter()
    want = integer(s, k)
    compile_s = time.perf_counter() - t0
    same = as_sets(topk_recent_first(s, k)) == as_sets(want)
    kt, it, ft = [], [], []
    for _ in range(repeats):
        kt.append(timed(lambda: topk_recent_first(s, k), calls))
        it.append(timed(lambda: integer(s, k), calls))
        ft.append(timed(lambda: s.topk(k, dim=-1, sorted=False), calls))
        bandwidths.append(read_bandwidth(3))
    kernel_us, integer_us, float_us = (statistics.median(x) for x in (kt, it, ft))
    log(f"{R} x {L} ({kind}, k {k}): kernel {kernel_us:.0f} us, integer compiled {integer_us:.0f}, "
        f"float {float_us:.0f}{'' if same else ', SELECTIONS DIFFER'}")
    return {
        "rows": R, "length": L, "k": k, "kind": kind, "same_selection": same,
        "kernel_us": round(kernel_us, 1), "integer_compiled_us": round(integer_us, 1),
        "integer_compiled_first_call_s": round(compile_s, 1), "float_topk_us": round(float_us, 1),
        "ratio_vs_integer_compiled": round(integer_us / kernel_us, 2),
        "ratio_vs_float": round(float_us / kernel_us, 2),
        "paired_ratios_vs_integer_compiled": [round(b / a, 2) for a, b in zip(kt, it, strict=True)]}


def main() -> None:
    args = kernel_args(kernel_parser(__doc__, 7, "a smaller grid, one round"))
    grid, repeats = (QUICK_GRID, 1) if args.quick else (GRID, args.repeats)
    gen = torch.Generator().manual_seed(0)
    rows, bandwidths = [], []
    for R, L, k, kind in grid:
        rows.append(measure(scores_for(R, L, kind, gen), k, kind, repeats, bandwidths))
        torch._dynamo.reset()
    read = statistics.median(bandwidths)
    for r in rows:
        r["limit_cold_read_us"] = round(r["rows"] * r["length"] * 4 / read / 1e3, 1)
    res = {"bench": "topk", "threads": args.threads, "repeats": repeats, "read_GBps": round(read, 2), "cases": rows}
    if not args.json:
        print(f"bench/topk.py, {args.threads} threads, cold fp32 read bandwidth {res['read_GBps']} GB/s")
        print(f"{'rows':>4} {'length':>8} {'k':>5} {'kind':6} {'kernel us':>10} {'integer us':>11} {'float us':>9} "
              f"{'limit us':>9} {'same':>5}")
        for r in rows:
            print(f"{r['rows']:>4} {r['length']:>8} {r['k']:>5} {r['kind']:6} {r['kernel_us']:>10} "
                  f"{r['integer_compiled_us']:>11} {r['float_topk_us']:>9} {r['limit_cold_read_us']:>9} "
                  f"{str(r['same_selection']):>5}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
