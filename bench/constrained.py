"""Per-token cost of JSON-schema constrained decoding (llguidance masks) in Horizon's engine.

At each batch size, B requests under a JSON-schema constraint (seeded sampling, so the random model writes
varied values until the grammar closes the object) on the `small` preset in fp32. Baseline, in the same
run: the same prompts and sampling without the constraint, each request held to the token count its
constrained twin produced (ignore_eos), so both runs make the same forwards with the same batch
composition at every step; what differs is the grammar (mask computation, matcher advance, closing
preference). Constrained and unconstrained runs alternate, repeated; medians reported. Keys
`constrained_overhead_ms_per_token_batch<B>` and `constrained_ratio_batch<B>` (constrained / unconstrained
ms per generated token); the schema compiles once (compile_ms), as the server caches it.

    python bench/constrained.py                  # the small preset, 2 threads
    python bench/constrained.py --quick --json   # tiny sizes (a smoke run)
    python bench/constrained.py --batches 1 16 --repeats 3 --constrained-tokens 96

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one JSON
object: the keys above and `constrained` (per batch, every round).
"""

from __future__ import annotations

import json
import time

import torch
from common import (
    Quiet,
    Recorder,
    build_ours,
    finish,
    finish_args,
    log,
    median,
    new_request_id,
    parser,
    random_tokens,
    setup,
)

from horizon.engine import ConstraintSpec, Engine, EngineConfig, Request, SamplingParams
from horizon.model import HorizonForCausalLM

OPTIONS = ("repeats", "batches", "prompt", "constrained_tokens")

BENCH_SCHEMA = {  # nested objects, an array of enums, bounded numbers, strings: what tools ask for
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "where": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                  "required": ["x", "y"]},
    },
    "required": ["name", "count", "tags", "where"],
}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def measure(args, model: HorizonForCausalLM, tok, quiet: Quiet) -> dict:
    """Per-token cost of a JSON-schema constraint: B requests under the constraint (seeded sampling, so the
    random model writes varied values until the grammar closes the object), then the same prompts and
    sampling without it, each request held to the token count its constrained twin produced (ignore_eos).
    Both runs then make the same forwards with the same batch composition at every step; what differs
    is the grammar (mask computation, matcher advance, closing preference)."""
    gen = torch.Generator().manual_seed(args.seed + 3)
    prompts = random_tokens(tok, model.config.vocab_size, (max(args.batches), args.prompt), gen)
    max_tokens = args.constrained_tokens
    engine = Engine(model, tok, EngineConfig(max_num_seqs=max(args.batches), max_model_len=args.prompt + max_tokens,
                                             max_batch_tokens=max(512, max(args.batches) * args.prompt)))
    spec = ConstraintSpec.for_json(BENCH_SCHEMA)
    t0 = time.perf_counter()
    engine.grammars.matcher(spec)  # compile once (cached by schema, as the server does)
    compile_ms = 1000 * (time.perf_counter() - t0)

    def run(batch: int, counts: list[int] | None) -> dict:
        rec = Recorder()
        rids = []
        for i, p in enumerate(prompts[:batch]):
            n = counts[i] if counts else max_tokens
            params = SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=counts is not None)
            rid = new_request_id()
            engine.submit(Request(p, params, request_id=rid, constraint=None if counts else spec), rec)
            rids.append(rid)
        t = time.perf_counter()
        engine.run_until_idle()
        wall = time.perf_counter() - t
        engine.clear_prefix_cache()
        texts = [tok.decode([t for t in rec.ids[r] if not tok.is_special(t)]) for r in rids]
        return {"wall_s": wall, "counts": [len(rec.ids[r]) for r in rids], "texts": texts,
                "finish": [rec.finish[r].reason for r in rids]}

    run(1, None)  # warm-up
    out = {"schema": BENCH_SCHEMA, "max_tokens": max_tokens, "compile_ms": compile_ms}
    for batch in args.batches:
        rows = []
        for r in range(args.repeats):
            c = quiet.run(f"constrained batch {batch} round {r + 1}", lambda batch=batch: run(batch, None))
            u = quiet.run(f"unconstrained batch {batch} round {r + 1}",
                          lambda batch=batch, c=c: run(batch, c["counts"]))
            assert u["counts"] == c["counts"], (u["counts"], c["counts"])
            tokens = sum(c["counts"])
            rows.append({"tokens": tokens, "ms_per_token_constrained": 1000 * c["wall_s"] / tokens,
                         "ms_per_token_unconstrained": 1000 * u["wall_s"] / tokens,
                         "valid_json": sum(_is_json(t) for t in c["texts"]), "requests": batch})
            log(f"constrained batch {batch:>2} round {r + 1}: {rows[-1]['ms_per_token_constrained']:.2f} vs "
                f"{rows[-1]['ms_per_token_unconstrained']:.2f} ms/token unconstrained ({tokens} tokens, "
                f"{rows[-1]['valid_json']}/{batch} parse as JSON)")
        mc = median([x["ms_per_token_constrained"] for x in rows])
        mu = median([x["ms_per_token_unconstrained"] for x in rows])
        out[f"batch{batch}"] = {"ms_per_token_constrained": mc, "ms_per_token_unconstrained": mu,
                                "overhead_ms_per_token": mc - mu, "ratio": mc / mu, "runs": rows}
    return out


def section(args, model: HorizonForCausalLM, tok, quiet: Quiet) -> dict:
    """The top-level keys: constrained_overhead_ms_per_token_batch<B>, constrained_ratio_batch<B>, "constrained"."""
    con = measure(args, model, tok, quiet)
    res = {}
    for b in args.batches:
        res[f"constrained_overhead_ms_per_token_batch{b}"] = con[f"batch{b}"]["overhead_ms_per_token"]
        res[f"constrained_ratio_batch{b}"] = con[f"batch{b}"]["ratio"]
    res["constrained"] = con
    return res


def summary_lines(res: dict) -> list[str]:
    con = res.get("constrained")
    if not con:
        return []
    lines = ["", f"constrained decoding (JSON schema, llguidance; compile {con['compile_ms']:.0f} ms once per "
                 f"schema), ms per generated token, same tokens and batches without the constraint"]
    for k, v in con.items():
        if k.startswith("batch"):
            lines.append(f"  {k:<8} {v['ms_per_token_constrained']:.2f} vs {v['ms_per_token_unconstrained']:.2f}: "
                         f"+{v['overhead_ms_per_token']:.2f} ms/token ({v['ratio']:.3f}x)")
    return lines


def main(argv=None) -> None:
    args = finish_args(parser(__doc__, OPTIONS).parse_args(argv))
    res, cfg, tok, quiet = setup(args, "constrained")
    log(f"building {args.preset} ({cfg.num_layers} layers) in float32")
    res.update(section(args, build_ours(cfg, "float32", args.seed), tok, quiet))
    finish(res, args, quiet, [summary_lines])


if __name__ == "__main__":
    main()
