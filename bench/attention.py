"""Gated DSA's decode attention read in place from the paged latent pool (horizon/quant/kernels/attention.cpp)
against gathering the rows first (the PyTorch reference), on cold rows.

Two sections, in one process, rounds interleaved, medians:
- `ops`: the attention alone at the `small` preset's shape (8 heads, rows of 160 = 128 + 32, block 64) for a
  grid of sequences x context (dense: every position; sparse: `index_topk` = 2,048 picks out of a longer
  context): the kernel (`paged_latent_attention`) against the reference eager and compiled
  (`torch.compile` of `paged_latent_attention_reference`, compile seconds reported), and the physical
  limit: the bytes of the rows attended / the cold read bandwidth of the same run. The pool is cycled over
  block ranges that together exceed the last-level cache, so every call reads its rows from memory, as a
  decode step does (the rows of three DSA layers and the weights pass through the cache between two
  reads of one layer's rows).
- `step`: a compiled decode step of the `small` model (fp32, MXFP4 experts, random weights) at
  --step-batch sequences of --step-context tokens (random cached rows), alternating steps that read the
  rows in place with steps that gather them (bench/common.py's `gathered_rows`: both DSA kernels off, each
  setting its own graph).

    python bench/attention.py [--threads 2] [--repeats 5] [--step-batch 16] [--step-context 1900] [--quick]
                              [--json]

Prints a table (unless --json) and, on the last line, one JSON object. `ratio` > 1: the kernel is faster.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from common import fill_synthetic, gathered_rows, kernel_args, kernel_parser, log, read_bandwidth, timed

from horizon import ModelConfig
from horizon.engine.runner import ModelRunner, StepInputs
from horizon.model import HorizonCache, HorizonForCausalLM
from horizon.model.dsa import paged_latent_attention, paged_latent_attention_reference
from horizon.quant import quantize_model

COLD_BYTES = 192 << 20  # the pool's rows together: several times a server CPU's L3
# (sequences, context, picks): picks 0 = dense (every position), else a sparse selection of that many
GRID = [(1, 256, 0), (1, 2048, 0), (16, 256, 0), (16, 1950, 0), (1, 16384, 0), (1, 65536, 2048), (16, 8192, 2048)]
QUICK_GRID = [(1, 256, 0), (16, 1950, 0), (4, 8192, 2048)]


class Problem:
    """A pool of at least COLD_BYTES and several block tables over disjoint, shuffled blocks of it; each call
    takes the next table, so the rows it reads were last touched many calls ago."""

    def __init__(self, cfg: ModelConfig, B: int, L: int, picks: int, gen: torch.Generator):
        self.B, self.L, self.bs = B, L, 64
        self.H, self.W, self.V = cfg.num_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5
        nb = -(-L // self.bs)
        tables = max(2, COLD_BYTES // (B * nb * self.bs * self.W * 4))
        self.pool = torch.randn(tables * B * nb * self.bs, self.W, generator=gen)
        self.tables = list(torch.randperm(tables * B * nb, generator=gen).view(tables, B, nb))
        self.q = torch.randn(B, self.H, self.W, generator=gen) * self.W**-0.5 * 4
        self.limit = torch.full((B,), L, dtype=torch.long)
        self.idx = None
        if picks:
            self.idx = torch.stack([torch.randperm(L, generator=gen)[:picks].sort().values for _ in range(B)])
        self.i = 0
        self.row_bytes = B * (picks or L) * self.W * 4

    def call(self, fn):
        def run():
            self.i = (self.i + 1) % len(self.tables)
            return self.once(fn, self.i)
        return run

    def once(self, fn, table: int):
        return fn(self.pool, self.tables[table], self.q, self.limit, self.L, self.bs, self.scale, self.V, self.idx)


def ops_section(cfg: ModelConfig, grid, repeats: int, calls: int) -> tuple[list[dict], float]:
    gen = torch.Generator().manual_seed(0)
    rows, bandwidths = [], []
    for B, L, picks in grid:
        p = Problem(cfg, B, L, picks, gen)
        compiled = torch.compile(paged_latent_attention_reference, dynamic=False)
        t0 = time.perf_counter()
        p.call(compiled)()
        compile_s = time.perf_counter() - t0
        err = float((p.once(paged_latent_attention, 0) - p.once(paged_latent_attention_reference, 0)).abs().max())
        k, e, c = [], [], []
        for _ in range(repeats):
            k.append(timed(p.call(paged_latent_attention), calls))
            e.append(timed(p.call(paged_latent_attention_reference), calls))
            c.append(timed(p.call(compiled), calls))
            bandwidths.append(read_bandwidth(3))
        kernel_us, eager_us, compiled_us = statistics.median(k), statistics.median(e), statistics.median(c)
        rows.append({
            "sequences": B, "context": L, "attended": picks or L, "form": "sparse" if picks else "dense",
            "kernel_us": round(kernel_us, 1), "reference_eager_us": round(eager_us, 1),
            "reference_compiled_us": round(compiled_us, 1), "reference_compiled_first_call_s": round(compile_s, 1),
            "ratio_vs_eager": round(eager_us / kernel_us, 3), "ratio_vs_compiled": round(compiled_us / kernel_us, 3),
            "paired_ratios_vs_compiled": [round(y / x, 3) for x, y in zip(k, c, strict=True)],
            "kernel_GBps": round(p.row_bytes / kernel_us / 1e3, 2), "max_abs_error": err})
        log(f"{B} x {L} ({rows[-1]['form']}): kernel {kernel_us:.0f} us, reference eager {eager_us:.0f}, "
            f"compiled {compiled_us:.0f}")
        del p
        torch._dynamo.reset()
    read = statistics.median(bandwidths)
    for r in rows:
        r["kernel_fraction_of_read_bandwidth"] = round(r["kernel_GBps"] / read, 3)
    return rows, round(read, 2)


def step_section(B: int, context: int, rounds: int, steps: int) -> dict:
    """ms per compiled decode step reading the rows in place against gathering them, alternating."""
    cfg = ModelConfig.preset("small").replace(dtype="float32", max_position_embeddings=max(4096, context + 256))
    torch.manual_seed(0)
    model = quantize_model(HorizonForCausalLM(cfg).eval())
    cache = HorizonCache(cfg, B + 1, context + 64, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    for slot in range(B):
        fill_synthetic(cache, context, gen, slot)
    runner = ModelRunner(model, cache, compile=True)

    def times(n: int) -> list[float]:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            runner.run(StepInputs([[1000 + s] for s in range(B)], [context + i] * B, list(range(B))))
            out.append((time.perf_counter() - t0) * 1e3)
        cache.lens[:B] = context
        return out

    with torch.inference_mode():
        t0 = time.perf_counter()
        times(2)
        compile_in_place = time.perf_counter() - t0
        with gathered_rows():
            t0 = time.perf_counter()
            times(2)
            compile_gathered = time.perf_counter() - t0
        a, b = [], []
        for _ in range(rounds):
            a.append(statistics.median(times(steps)))
            with gathered_rows():
                b.append(statistics.median(times(steps)))
    in_place, gathered = statistics.median(a), statistics.median(b)
    return {"sequences": B, "context": context, "format": "fp32 + MXFP4 experts", "in_place_ms": round(in_place, 2),
            "gathered_ms": round(gathered, 2), "ratio": round(gathered / in_place, 3),
            "paired_ratios": [round(y / x, 3) for x, y in zip(a, b, strict=True)],
            "first_steps_s": {"in_place": round(compile_in_place, 1), "gathered": round(compile_gathered, 1)}}


def main() -> None:
    ap = kernel_parser(__doc__, 5, "a smaller grid, one round, a short step section")
    ap.add_argument("--step-batch", type=int, default=16, help="sequences of the step section (0: skip it)")
    ap.add_argument("--step-context", type=int, default=1900)
    args = kernel_args(ap)
    repeats, calls = (1, 5) if args.quick else (args.repeats, 20)
    cfg = ModelConfig.preset("small")
    res = {"bench": "attention", "threads": args.threads, "torch": torch.__version__, "repeats": repeats}
    res["ops"], res["read_GBps"] = ops_section(cfg, QUICK_GRID if args.quick else GRID, repeats, calls)
    if args.step_batch:
        B, context = (4, 300) if args.quick else (args.step_batch, args.step_context)
        log(f"step section: {B} sequences x {context} tokens (compiles two graphs)")
        res["step"] = step_section(B, context, rounds=1 if args.quick else args.repeats, steps=5 if args.quick else 20)
    if not args.json:
        print(f"bench/attention.py, {args.threads} threads, cold fp32 read bandwidth {res['read_GBps']} GB/s")
        print(f"{'seqs':>4} {'context':>7} {'form':6} {'kernel us':>10} {'eager us':>9} {'compiled us':>12} "
              f"{'vs compiled':>11} {'of bandwidth':>12}")
        for r in res["ops"]:
            print(f"{r['sequences']:>4} {r['context']:>7} {r['form']:6} {r['kernel_us']:>10} "
                  f"{r['reference_eager_us']:>9} {r['reference_compiled_us']:>12} {r['ratio_vs_compiled']:>11} "
                  f"{r['kernel_fraction_of_read_bandwidth']:>12}")
        if "step" in res:
            s = res["step"]
            print(f"decode step, {s['sequences']} x {s['context']}: in place {s['in_place_ms']} ms, gathered "
                  f"{s['gathered_ms']} ms ({s['ratio']}x)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
