"""Tensor / expert-parallel decode on this machine: 2 gloo ranks against one process, same cores.

Each round runs the same work twice, interleaved: one process with all the cores (the baseline), and
`--tp` ranks (started with torch.distributed.run, the cores split between them: OMP threads = cores /
ranks), tensor-parallel (`--ep`: experts whole per rank) over the `small` preset's random weights
(seed-fixed, so every run builds the same model), per weight format and batch size: greedy,
ignore_eos, a fixed prompt of ordinary tokens, decode tokens/s measured as bench/decode.py does.
Beside each number, measured in the same run on the same ranks:
- the weight-streaming floor: the bytes of weights a step reads on the busiest rank (bench/decode.py's
  `step_weight_bytes` of the rank's shard) over the fp32 matrix-vector bandwidth a rank gets while every
  rank streams at once;
- the all-reduce cost: a step makes two all-reduces per layer of [batch, hidden] fp32; their median
  latency on this group times that count, as a share of the measured step;
- `tokens_equal`: whether the parallel run produced the same greedy tokens as the one process (fp32:
  the sums differ only in order, ~1e-6; in bf16 they would differ by bf16's own noise).
On a 2-core CPU the ranks split two cores, so parallel can only lose (collectives on top of the same
bandwidth); the script exists to measure that overhead here and the speed-up where ranks have their own
memory (GPUs, sockets, machines): run it there with `--tp N`.

    python bench/parallel.py                      # small preset, fp32 + mxfp4, batch 1 and 8 (~5 minutes)
    python bench/parallel.py --quick --json       # the tiny preset (experts whole per rank), a smoke run
    python bench/parallel.py --ep --compile       # whole experts per rank; compiled decode graphs

Prints progress on stderr; on stdout a summary (unless --json) and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Recorder, decode_rate, log, machine_info, random_tokens, rounded, submit
from decode import gemv_bandwidth, step_weight_bytes

from horizon import ModelConfig
from horizon.chat import load_tokenizer
from horizon.engine import Engine, EngineConfig
from horizon.engine.memory import unavailable as huge_pages_unavailable
from horizon.model import HorizonForCausalLM
from horizon.parallel.group import destroy_group, init_group
from horizon.parallel.shard import Layout, shard_model
from horizon.quant import quantize_model


def build(cfg: ModelConfig, fmt: str, seed: int, layout: Layout) -> HorizonForCausalLM:
    """The preset in fp32 (its own dtype may be bf16), or that with MXFP4 experts; this rank's shard."""
    torch.manual_seed(seed)
    model = HorizonForCausalLM(cfg.replace(dtype="float32")).eval()
    if fmt == "mxfp4":
        model = quantize_model(model)
    return shard_model(model, layout) if layout.sharded else model


def allreduce_us(batch: int, hidden: int, runs: int = 200) -> float:
    """Median microseconds of one all-reduce of [batch, hidden] fp32 on the group (0 in one process)."""
    if not torch.distributed.is_initialized():
        return 0.0
    x = torch.randn(batch, hidden)
    times = []
    for _ in range(runs):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        torch.distributed.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def worker(args) -> None:
    """One measurement of every format and batch, in this process or as one rank of a group."""
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    group = init_group("cpu", timeout_s=900) if tp > 1 else None  # a compile on one rank may be slow
    rank = group.rank if group else 0
    layout = Layout(tp, rank, args.ep and tp > 1)
    cfg, tok = ModelConfig.preset(args.preset), load_tokenizer()
    prompts = random_tokens(tok, cfg.vocab_size, (max(args.batches), args.prompt), torch.Generator().manual_seed(0))
    # every rank at once: the bandwidth each gets while the others stream; its matrix on 2 MB pages where the
    # compiled runners put the weights there (engine/memory.py)
    bandwidth = gemv_bandwidth(torch.float32, huge_pages=args.compile and huge_pages_unavailable() is None)
    rows = []
    for fmt in args.formats:
        model = build(cfg, fmt, args.seed, layout)
        engine = Engine(model, tok, EngineConfig(
            max_num_seqs=max(args.batches), max_model_len=args.prompt + args.new_tokens,
            max_batch_tokens=max(512, max(args.batches) * args.prompt), compile=args.compile))
        if rank != 0:
            engine.follow()
        else:
            for batch in args.batches:
                for _ in ("warm-up", "measure"):
                    rec = Recorder()
                    t0 = time.perf_counter()
                    rids = [submit(engine, p, args.new_tokens, rec) for p in prompts[:batch]]
                    engine.run_until_idle()
                    engine.clear_prefix_cache()
                rate = decode_rate(t0, [rec.stamps[r] for r in rids])
                rows.append({"format": fmt, "batch": batch, **rate, "tokens": [rec.ids[r] for r in rids]})
            if tp > 1:
                engine.stop()
        for row in rows:
            if row["format"] == fmt:
                # bytes on this rank, then the busiest rank's: the step waits for it
                mine = torch.tensor([float(step_weight_bytes(model, row["batch"]))])
                if tp > 1:
                    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
                row["floor_ms"] = 1000 * float(mine) / (bandwidth * 1e9)
                row["allreduce_us"] = allreduce_us(row["batch"], cfg.hidden_size)
                row["allreduces_per_step"] = 2 * cfg.num_layers if tp > 1 else 0
        if tp > 1 and rank != 0:  # the other ranks measured nothing of their own, only joined the collectives
            for batch in args.batches:
                torch.distributed.all_reduce(torch.tensor([float(step_weight_bytes(model, batch))]),
                                             op=torch.distributed.ReduceOp.MAX)
                allreduce_us(batch, cfg.hidden_size)
        del engine, model
    if rank == 0:
        Path(args.out).write_text(json.dumps({"tp": tp, "ep": layout.ep, "gemv_gb_per_s": bandwidth, "rows": rows}))
    if group:
        destroy_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(args, tp: int, cores: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        flags = ["--worker", "--out", str(out), "--preset", args.preset, "--prompt", str(args.prompt),
                 "--new-tokens", str(args.new_tokens), "--seed", str(args.seed), "--formats", *args.formats,
                 "--batches", *map(str, args.batches)] + (["--ep"] if args.ep else []) + \
                (["--compile"] if args.compile else [])
        script = str(Path(__file__).resolve())
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // tp))}
        if tp == 1:
            cmd = [sys.executable, script, *flags]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), script, *flags]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"bench/parallel: the tp {tp} run failed:\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
        result["wall_s"] = time.perf_counter() - t0
        return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the parallel layout")
    ap.add_argument("--ep", action="store_true", help="routed experts whole per rank")
    ap.add_argument("--formats", nargs="+", default=["fp32", "mxfp4"], choices=["fp32", "mxfp4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="compiled decode graphs (default eager: minutes less)")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, one round, few tokens")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:  # tiny's experts are one MXFP4 block wide: whole experts per rank
        args.preset, args.repeats, args.new_tokens, args.prompt, args.batches = "tiny", 1, 8, 16, [1, 4]
        args.ep = True
    try:
        Layout(args.tp, 0, args.ep).check(ModelConfig.preset(args.preset), mxfp4_experts="mxfp4" in args.formats)
    except ValueError as e:
        raise SystemExit(f"bench/parallel: {e}") from None
    cores = os.cpu_count() or 1
    rounds = {1: [], args.tp: []}
    for r in range(args.repeats):
        for tp in rounds:  # interleaved: both layouts see the same machine load
            log(f"round {r + 1}/{args.repeats}: tp {tp}")
            rounds[tp].append(run_layout(args, tp, cores))
    table = []
    for i, base in enumerate(rounds[1][0]["rows"]):
        def med(tp, key, i=i):
            return statistics.median(run["rows"][i][key] for run in rounds[tp])

        one, par = med(1, "tok_per_s"), med(args.tp, "tok_per_s")
        par_step = med(args.tp, "ms_per_step")
        comm_ms = med(args.tp, "allreduce_us") * rounds[args.tp][0]["rows"][i]["allreduces_per_step"] / 1000
        table.append({
            "format": base["format"], "batch": base["batch"], "tok_per_s_tp1": one, f"tok_per_s_tp{args.tp}": par,
            f"ratio_tp{args.tp}_vs_tp1": par / one, "ms_per_step_tp1": med(1, "ms_per_step"),
            f"ms_per_step_tp{args.tp}": par_step, "floor_ms_tp1": med(1, "floor_ms"),
            f"floor_ms_tp{args.tp}": med(args.tp, "floor_ms"), f"allreduce_ms_per_step_tp{args.tp}": comm_ms,
            "allreduce_share": comm_ms / par_step,
            "tokens_equal": all(run["rows"][i]["tokens"] == rounds[1][0]["rows"][i]["tokens"]
                                for runs in rounds.values() for run in runs)})
    res = {"bench": "parallel", "machine": machine_info(), "settings": {
        "preset": args.preset, "tp": args.tp, "ep": args.ep, "formats": args.formats, "batches": args.batches,
        "prompt": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats, "compile": args.compile,
        "threads_tp1": cores, f"threads_per_rank_tp{args.tp}": max(1, cores // args.tp)},
        "gemv_gb_per_s": {"tp1": statistics.median(r["gemv_gb_per_s"] for r in rounds[1]),
                          f"tp{args.tp}_per_rank": statistics.median(r["gemv_gb_per_s"] for r in rounds[args.tp])},
        "rows": table}
    if not args.json:
        print(f"bench/parallel.py: {args.preset}, tp {args.tp}{' + EP' if args.ep else ''} against one process "
              f"on {cores} cores ({args.repeats} interleaved rounds, medians)")
        for row in table:
            print(f"  {row['format']:>5} batch {row['batch']:>2}: {row['tok_per_s_tp1']:7.1f} -> "
                  f"{row[f'tok_per_s_tp{args.tp}']:7.1f} tok/s ({row[f'ratio_tp{args.tp}_vs_tp1']:.2f}x); step "
                  f"{row[f'ms_per_step_tp{args.tp}']:.1f} ms, floor {row[f'floor_ms_tp{args.tp}']:.1f} ms, "
                  f"all-reduces {100 * row['allreduce_share']:.0f}%; tokens equal: {row['tokens_equal']}")
    print(json.dumps(rounded(res)))


if __name__ == "__main__":
    main()
