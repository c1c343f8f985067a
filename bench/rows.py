"""The few-rows matmul kernel (horizon/quant/kernels/rows.cpp) against PyTorch's own, on cold weights.

For the weight shapes of the `small` preset's decode step (a [512 -> 1024] expert gate_up, a [512 -> 512]
projection, the [512 -> 32768] LM head) and 1-64 rows of activations (the rows a batched decode step
multiplies), in one process, rounds interleaved, medians:
- fp32 and bf16 weights: `rows_matmul` against `F.linear` in the weights' dtype (MKL sgemm / oneDNN), x in
  that dtype for bf16 as in a bf16 model (the kernel's AMX path where the CPU has AMX, `HORIZON_AMX=0` for its
  AVX-512 one; the JSON says which ran);
- int8 weights: against `aten._weight_int8pack_mm` (what horizon.quant.int8.Int8Linear calls);
- every dtype: against the kernel's own portable C++ path (`portable_us`, `vs_portable` = its time / the
  kernel's), which is what a CPU without the vector path (AVX-512, else AVX2; `path` says which ran) gets;
- a baseline for the physical limit: the read bandwidth of a cold fp32 reduction (`torch.sum`) measured in
  the same run, and each call's weight bytes / time as a fraction of it.
The weights are cycled through copies that together exceed the last-level cache, so every call reads them
from memory, as a decode step does. `ratio` > 1: the kernel is faster.

    python bench/rows.py [--threads 2] [--repeats 5] [--rows 1 2 4 8 16 64] [--quick] [--json]

Prints a table (unless --json) and, on the last line, one JSON object.
"""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F
from common import kernel_args, kernel_parser, read_bandwidth, timed

from horizon.quant.kernels import has_amx, rows_matmul, vector_path

SHAPES = {"expert_gate_up": (1024, 512), "projection": (512, 512), "lm_head": (32768, 512)}
COLD_BYTES = 192 << 20  # the copies of one weight together: several times a server CPU's L3


def weights(dtype: torch.dtype, N: int, K: int) -> list[torch.Tensor]:
    count = max(2, COLD_BYTES // (N * K * (1 if dtype == torch.int8 else dtype.itemsize)))
    if dtype == torch.int8:
        return [torch.randint(-127, 128, (N, K), dtype=torch.int8) for _ in range(count)]
    return [torch.randn(N, K).to(dtype) for _ in range(count)]


def cycling(fn, ws):
    i = [0]

    def run():
        i[0] = (i[0] + 1) % len(ws)
        return fn(ws[i[0]])

    return run


def main() -> None:
    ap = kernel_parser(__doc__, 5, "one round, fewer calls, no LM head (a smoke run)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = kernel_args(ap)
    shapes = [s for s in args.shapes if not (args.quick and s == "lm_head")]
    repeats, calls = (1, 5) if args.quick else (args.repeats, 20)
    res = {"bench": "rows", "threads": args.threads, "torch": torch.__version__, "repeats": repeats,
           "path": vector_path(), "bf16_path": "amx" if has_amx() else vector_path(),
           "results": []}
    bandwidths = []
    for shape in shapes:
        N, K = SHAPES[shape]
        for dtype in (torch.float32, torch.bfloat16, torch.int8):
            ws = weights(dtype, N, K)
            ones = torch.ones(N, dtype=torch.bfloat16)
            for M in args.rows:
                x = torch.randn(M, K)
                xd = x.to(torch.bfloat16 if dtype == torch.int8 else dtype)
                # bf16 weights take bf16 x, as a bf16 model's projections do (the AMX path where the CPU has it)
                xk = xd if dtype == torch.bfloat16 else x
                ours = cycling(lambda w, xk=xk: rows_matmul(xk, w), ws)
                portable = cycling(lambda w, xk=xk: torch.ops.horizon_kernels.rows_matmul(xk, w, None, True), ws)
                if dtype == torch.int8:
                    theirs = cycling(lambda w, xd=xd, ones=ones: torch.ops.aten._weight_int8pack_mm(xd, w, ones), ws)
                else:
                    theirs = cycling(lambda w, xd=xd: F.linear(xd, w), ws)
                a, b, c = [], [], []
                for _ in range(repeats):  # interleaved: all see the same machine load
                    a.append(timed(ours, calls))
                    b.append(timed(theirs, calls))
                    c.append(timed(portable, calls))
                    bandwidths.append(read_bandwidth(3))
                kernel_us, baseline_us, portable_us = statistics.median(a), statistics.median(b), statistics.median(c)
                nbytes = N * K * ws[0].element_size()
                res["results"].append({
                    "shape": shape, "N": N, "K": K, "weights": str(dtype).removeprefix("torch."), "rows": M,
                    "kernel_us": round(kernel_us, 1), "baseline_us": round(baseline_us, 1),
                    "baseline": "_weight_int8pack_mm" if dtype == torch.int8 else "F.linear",
                    "ratio": round(baseline_us / kernel_us, 3), "portable_us": round(portable_us, 1),
                    "vs_portable": round(portable_us / kernel_us, 3), "kernel_GBps": round(nbytes / kernel_us / 1e3, 2),
                    "baseline_GBps": round(nbytes / baseline_us / 1e3, 2),
                    "paired_ratios": [round(y / x, 3) for x, y in zip(a, b, strict=True)]})
            del ws
    res["read_GBps"] = round(statistics.median(bandwidths), 2)
    for r in res["results"]:
        r["kernel_fraction_of_read_bandwidth"] = round(r["kernel_GBps"] / res["read_GBps"], 3)
    if not args.json:
        print(f"bench/rows.py, {args.threads} threads, cold fp32 read bandwidth {res['read_GBps']} GB/s")
        print(f"{'shape':16} {'weights':9} {'rows':>4} {'kernel us':>10} {'baseline us':>12} {'ratio':>6} {'GB/s':>6} "
              f"{'portable us':>12} {'vs portable':>11}")
        for r in res["results"]:
            print(f"{r['shape']:16} {r['weights']:9} {r['rows']:>4} {r['kernel_us']:>10} {r['baseline_us']:>12} "
                  f"{r['ratio']:>6} {r['kernel_GBps']:>6} {r['portable_us']:>12} {r['vs_portable']:>11}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
