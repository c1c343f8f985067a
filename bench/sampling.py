"""What choosing a token at temperature > 0 costs: the engine's sampler (horizon/engine/sampler.py) against the
textbook route it replaced, alone per row and inside compiled decode steps.

- `rows`: one sequence's logits, V tokens, per setting (temperature, top_k, top_p). `textbook` is softmax, a
  sort of the vocabulary for top_p and `torch.multinomial` (an exponential drawn per token); `ours` is
  `sample()` through the CPU kernel (`sample.cpp`), `torch` its PyTorch route (`candidates`, `draw`). Each is
  timed warm (the same few rows again and again) and `cold`: after streaming 200 MB, as a decode step leaves
  the caches. Microseconds a row, medians of the rounds, paired ratios.
- `engine`: a compiled `small` engine with MXFP4 experts stepping 1 and 16 sequences, greedy, sampled as the
  engine does (one kernel call for a step's sampled rows), sampled one `sample()` call a row (`rowwise`) and
  sampled with the textbook route (patched into the engine), rounds interleaved; ms a step and what sampling
  adds to a greedy step. Its random weights give nearly flat logits (`flat`: the hardest case
  for top_p, whose nucleus is then most of the vocabulary); `peaked` scales the LM head to a trained model's
  spread. No physical limit applies here: the floor is the greedy step.

    python bench/sampling.py [--threads 2] [--repeats 5] [--quick] [--json]

Prints a table (unless --json) and, on the last line, one JSON object. `ratio_*` > 1: ours is faster.
"""

from __future__ import annotations

import json
import statistics
import time
import types

import torch
from common import Recorder, build_ours_pair, decode_rate, kernel_parser, log, new_request_id, random_tokens

import horizon.engine.engine as engine_module
from horizon import ModelConfig
from horizon.chat import load_tokenizer
from horizon.engine import Engine, EngineConfig, Request, SamplingParams
from horizon.engine.sampler import adjust_logits, sample, sample_rows
from horizon.quant import kernels
from horizon.quant.kernels import kernel_available

SETTINGS = {  # what clients send: OpenAI's default (1, 1), common chat settings, llama.cpp-style top_k
    "t1": dict(temperature=1.0),
    "t0.7_p0.9": dict(temperature=0.7, top_p=0.9),
    "t1_p0.95": dict(temperature=1.0, top_p=0.95),
    "t0.8_k40": dict(temperature=0.8, top_k=40),
    "t0.8_k40_p0.9": dict(temperature=0.8, top_k=40, top_p=0.9),
}
ENGINE_SETTING = "t0.7_p0.9"
VOCABS = (32768, 151936)  # `small`'s vocabulary, and one of today's large ones
SWEEP_MB = 200  # about what a batch-1 `small` step with MXFP4 experts reads
PEAKED = 8.0  # engine section: the LM head scaled by this for logits spread as a trained model's


def textbook(logits: torch.Tensor, params: SamplingParams, generated: list[int], generator, allowed=None,
             finite: bool = False) -> int:
    """The route `sample()` replaced (its signature, temperature > 0): softmax, a full sort for top_p,
    torch.multinomial."""
    logits = adjust_logits(logits.float(), params, generated)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if params.temperature == 0:
        return int(logits.argmax())
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.shape[0]:
        logits = logits.masked_fill(logits < logits.topk(params.top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        ranked, order = probs.sort(descending=True)
        drop = ranked.cumsum(0) - ranked >= params.top_p
        drop[0] = False
        probs = torch.zeros_like(probs).scatter_(0, order, ranked.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


def textbook_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """The textbook route in place of the engine's one call for a step's plainly sampled rows: row by row."""
    return [textbook(row, p, [], g) for row, p, g in zip(logits, params, generators, strict=True)]


def rowwise(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """The engine's sampler one call per row instead of one for the step's rows (the same tokens)."""
    return [sample(row, p, [], g, finite=True) for row, p, g in zip(logits, params, generators, strict=True)]


def torch_route(*args, **kw) -> int:
    """sample() with the kernel switched off: its PyTorch route."""
    saved, kernels.sample_row = kernels.sample_row, lambda *a: None
    try:
        return sample(*args, **kw)
    finally:
        kernels.sample_row = saved


def row_times(fn, rows: list[torch.Tensor], params: SamplingParams, sweep: torch.Tensor | None, n: int) -> float:
    """Median microseconds a call over n calls (rows cycled); with `sweep`, 200 MB streamed before each."""
    g = torch.Generator().manual_seed(0)
    ts = []
    for i in range(n):
        if sweep is not None:
            sweep.add_(1.0)
        t0 = time.perf_counter()
        fn(rows[i % len(rows)], params, [], g, finite=True)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def rows_section(repeats: int, n: int, vocabs) -> list[dict]:
    sweep = torch.empty(SWEEP_MB * 2**20 // 4)
    out = []
    for v in vocabs:
        gen = torch.Generator().manual_seed(v)
        rows = [torch.randn(v, generator=gen) * 6 for _ in range(8)]  # peaked rows, as a trained model's mostly are
        for name, kw in SETTINGS.items():
            p = SamplingParams(**kw)
            for cache, sw in (("warm", None), ("cold", sweep)):
                ours, tor, base = [], [], []
                for _ in range(repeats):
                    ours.append(row_times(sample, rows, p, sw, n))
                    tor.append(row_times(torch_route, rows, p, sw, n))
                    base.append(row_times(textbook, rows, p, sw, n))
                o, t, b = statistics.median(ours), statistics.median(tor), statistics.median(base)
                log(f"V {v} {name:14s} {cache}: ours {o:7.1f} us, torch route {t:7.1f}, textbook {b:7.1f} "
                    f"({b / o:.2f}x)")
                out.append({"vocab": v, "setting": name, "caches": cache, "ours_us": round(o, 1),
                            "torch_route_us": round(t, 1), "textbook_us": round(b, 1),
                            "ratio_vs_textbook": round(b / o, 2), "ratio_torch_route_vs_textbook": round(b / t, 2),
                            "paired_ratios_vs_textbook": [round(y / x, 2) for x, y in zip(ours, base, strict=True)]})
    return out


def engine_section(repeats: int, new_tokens: int, batches) -> dict:
    cfg = ModelConfig.preset("small")
    tok = load_tokenizer()
    model = build_ours_pair(cfg, types.SimpleNamespace(formats=["mxfp4"], preset="small", seed=0))["ours_mxfp4"]
    prompt = 64
    eng = Engine(model, tok, EngineConfig(max_num_seqs=max(batches), max_model_len=prompt + new_tokens,
                                          max_batch_tokens=max(512, max(batches) * prompt), compile=True))
    prompts = random_tokens(tok, cfg.vocab_size, (max(batches), prompt), torch.Generator().manual_seed(0))
    sampled = SETTINGS[ENGINE_SETTING]

    def run(batch: int, mode: str, n: int) -> float:
        """ms a decode step, from when every sequence has its first token to the last token."""
        engine_module.sample = textbook if mode == "textbook" else sample
        engine_module.sample_rows = {"textbook": textbook_rows, "rowwise": rowwise}.get(mode, sample_rows)
        rec, rids = Recorder(), []
        for i, p in enumerate(prompts[:batch]):
            kw = {"temperature": 0} if mode == "greedy" else dict(sampled, seed=i)
            rids.append(new_request_id())
            eng.submit(Request(p, SamplingParams(max_tokens=n, ignore_eos=True, **kw), request_id=rids[-1]), rec)
        eng.run_until_idle()
        eng.clear_prefix_cache()
        engine_module.sample, engine_module.sample_rows = sample, sample_rows
        return decode_rate(0.0, [rec.stamps[r] for r in rids])["ms_per_step"]

    log("warm-up (compiles the decode graphs, or loads them from inductor's cache)")
    for b in batches:
        run(b, "greedy", 4)
    head = model.lm_head.weight
    res = {"setting": ENGINE_SETTING, "format": "mxfp4", "new_tokens": new_tokens,
           "spreads": {"flat": "the random weights' logits (std ~0.45: top_p 0.9 keeps ~3/4 of the vocabulary)",
                       "peaked": f"the LM head x {PEAKED} (logits std ~3.6, a trained model's order)"}}
    for b in batches:
        times = {m: [] for m in ("greedy", *(f"{s}_{m}" for s in ("flat", "peaked")
                                             for m in ("ours", "rowwise", "textbook")))}
        for _ in range(repeats):
            times["greedy"].append(run(b, "greedy", new_tokens))
            for spread in ("flat", "peaked"):
                with torch.no_grad():
                    head.mul_(PEAKED if spread == "peaked" else 1.0)  # a power of two: exact both ways
                    for m in ("ours", "rowwise", "textbook"):
                        times[f"{spread}_{m}"].append(run(b, m, new_tokens))
                    head.div_(PEAKED if spread == "peaked" else 1.0)
        med = {m: statistics.median(t) for m, t in times.items()}
        log(f"batch {b}: greedy {med['greedy']:.2f} ms a step; sampled, flat logits {med['flat_ours']:.2f} "
            f"(textbook {med['flat_textbook']:.2f}), peaked {med['peaked_ours']:.2f} (textbook "
            f"{med['peaked_textbook']:.2f})")
        row = {"greedy_ms_per_step": round(med["greedy"], 2)}
        for spread in ("flat", "peaked"):
            o, t, r = times[f"{spread}_ours"], times[f"{spread}_textbook"], times[f"{spread}_rowwise"]
            row[spread] = {"ours_ms_per_step": round(statistics.median(o), 2),
                           "rowwise_ms_per_step": round(statistics.median(r), 2),
                           "paired_ratios_vs_rowwise": [round(y / x, 3) for x, y in zip(o, r, strict=True)],
                           "textbook_ms_per_step": round(statistics.median(t), 2),
                           "ours_added_ms": round(statistics.median(o) - med["greedy"], 2),
                           "textbook_added_ms": round(statistics.median(t) - med["greedy"], 2),
                           "ratio_vs_textbook": round(statistics.median(t) / statistics.median(o), 2),
                           "paired_ratios_vs_textbook": [round(y / x, 2) for x, y in zip(o, t, strict=True)]}
        res[str(b)] = row
    return res


def main() -> None:
    ap = kernel_parser(__doc__, 5, "one vocabulary, two rounds, 16 new tokens")
    ap.add_argument("--sections", nargs="+", default=["rows", "engine"], choices=["rows", "engine"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res_kernel = kernel_available()  # `ours` takes the kernel only once this process has built it
    repeats = 2 if args.quick else args.repeats
    res = {"bench": "sampling", "quick": args.quick, "threads": args.threads, "kernel": res_kernel}
    if "rows" in args.sections:
        res["rows"] = rows_section(repeats, 20 if args.quick else 40, VOCABS[:1] if args.quick else VOCABS)
    if "engine" in args.sections:
        res["engine"] = engine_section(repeats, 16 if args.quick else 48, (1, 16))
    if not args.json:
        for r in res.get("rows", []):
            print(f"V {r['vocab']:6d} {r['setting']:14s} {r['caches']}: ours {r['ours_us']:8.1f} us, torch route "
                  f"{r['torch_route_us']:8.1f} us, textbook {r['textbook_us']:8.1f} us, {r['ratio_vs_textbook']:.2f}x")
        for b in ("1", "16"):
            if b in res.get("engine", {}):
                e = res["engine"][b]
                print(f"engine batch {b}: greedy {e['greedy_ms_per_step']} ms a step; sampling adds "
                      + ", ".join(f"{s}: {e[s]['ours_added_ms']} ms (textbook {e[s]['textbook_added_ms']})"
                                  for s in ("flat", "peaked")))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
