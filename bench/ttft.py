"""Time to first token of a next turn after a long history, with and without the engine's prefix cache.

Turn 1 is a long prompt (ordinary tokens) plus a few generated tokens; each later turn's prompt extends
everything so far by ~32 tokens. Measured on the engine that served the earlier turns (prefix cache hit,
usage.cached_tokens checked) against the baseline, in the same process and on the same model: a second
engine whose prefix cache is cleared before each request (everything recomputed); interleaved, repeated,
medians reported. `speedup` = recomputed / with prefix reuse. The `small` preset in its dtype (bf16)
unless --dtype.

    python bench/ttft.py                      # 8192-token history, 2 threads
    python bench/ttft.py --quick --json       # tiny sizes (a smoke run)
    python bench/ttft.py --history 16384 --turn2-new 32 --ttft-repeats 3

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one JSON
object whose `ttft` key holds the result.
"""

from __future__ import annotations

import time

import torch
from common import Quiet, Recorder, build_ours, finish, finish_args, log, median, parser, random_tokens, setup, submit

from horizon.engine import Engine, EngineConfig
from horizon.model import HorizonForCausalLM

OPTIONS = ("dtype", "history", "turn1_tokens", "turn2_new", "ttft_repeats")


def ttft(engine: Engine, prompt: list[int], banned: list[int]) -> tuple[float, int, list[int]]:
    """(seconds from submit to the first token, usage.cached_tokens, the reply) for a one-token reply."""
    rec = Recorder()
    t0 = time.perf_counter()
    rid = submit(engine, prompt, 1, rec, banned)
    engine.run_until_idle()
    return rec.stamps[rid][0] - t0, rec.finish[rid].usage.cached_tokens, rec.ids[rid]


def section(args, model: HorizonForCausalLM, tok, quiet: Quiet) -> dict:
    """A conversation: turn 1 = the history + a few generated tokens; each later turn is everything so far +
    the reply + `turn2_new` new tokens, timed on the engine that served the earlier turns (its prefix cache
    holds them) and on a second engine with its prefix cache cleared (everything recomputed)."""
    vocab = model.config.vocab_size
    # replies become part of the next prompt: they must be ordinary tokens too (the random model would
    # otherwise now and then pick a special one, e.g. an image placeholder the engine refuses in a prompt)
    banned = sorted(i for i in tok.special_ids if i < vocab)
    gen = torch.Generator().manual_seed(args.seed + 2)
    prompt = random_tokens(tok, vocab, (args.history,), gen)
    turns = args.ttft_repeats * (quiet.retries + 1)
    config = EngineConfig(max_model_len=args.history + args.turn1_tokens + turns * (args.turn2_new + 1) + 64)
    warm, cold = Engine(model, tok, config), Engine(model, tok, EngineConfig(**vars(config)))
    log(f"ttft: turn 1 ({args.history} prompt tokens + {args.turn1_tokens} generated)")
    rec = Recorder()
    t0 = time.perf_counter()
    rid = submit(warm, prompt, args.turn1_tokens, rec, banned)
    warm.run_until_idle()
    turn1_s = time.perf_counter() - t0
    talk = {"prompt": prompt, "reply": rec.ids[rid]}
    ttft(cold, random_tokens(tok, vocab, (min(args.history, 1024),), gen), banned)  # warm-up

    def next_turn() -> dict:  # a retry moves on to the turn after (the cache now holds this one)
        expected = len(talk["prompt"]) + len(talk["reply"]) - 1  # all but the reply's last token are cached
        talk["prompt"] = talk["prompt"] + talk["reply"] + random_tokens(tok, vocab, (args.turn2_new,), gen)
        s, n, talk["reply"] = ttft(warm, talk["prompt"], banned)
        return {"ms": 1000 * s, "cached": n, "expected": expected, "prompt_tokens": len(talk["prompt"])}

    def recompute() -> dict:
        cold.clear_prefix_cache()
        s, n, _ = ttft(cold, talk["prompt"], banned)
        assert n == 0, f"the engine without prefix cache resumed {n} cached tokens"
        return {"ms": 1000 * s}

    hits, misses = [], []
    for r in range(args.ttft_repeats):
        hits.append(quiet.run(f"ttft round {r + 1} with prefix reuse", next_turn))
        misses.append(quiet.run(f"ttft round {r + 1} recomputed", recompute))
        log(f"ttft round {r + 1}: {hits[-1]['ms']:.0f} ms with prefix reuse ({hits[-1]['cached']} tokens cached) "
            f"/ {misses[-1]['ms']:.0f} ms recomputed ({hits[-1]['prompt_tokens']} prompt tokens)")
    res = {"history_tokens": args.history, "turn1_generated": args.turn1_tokens, "new_tokens_per_turn": args.turn2_new,
           "turn1_s": turn1_s, "cached_tokens": [h["cached"] for h in hits],
           "cached_tokens_expected": [h["expected"] for h in hits],
           "prompt_tokens": [h["prompt_tokens"] for h in hits],
           "ttft_ms_prefix_reuse": median([h["ms"] for h in hits]),
           "ttft_ms_recompute": median([m["ms"] for m in misses]),
           "runs_ms_prefix_reuse": [h["ms"] for h in hits], "runs_ms_recompute": [m["ms"] for m in misses],
           "engine_config": {k: v for k, v in vars(config).items() if k != "prefix_cache_bytes"}}
    res["speedup"] = res["ttft_ms_recompute"] / res["ttft_ms_prefix_reuse"]
    return res


def summary_lines(res: dict) -> list[str]:
    t = res.get("ttft")
    if not t:
        return []
    return ["", f"next-turn TTFT after {t['history_tokens']} tokens (+{t['new_tokens_per_turn']} new): "
                f"{t['ttft_ms_prefix_reuse']:.0f} ms with prefix reuse (cached {t['cached_tokens']}) vs "
                f"{t['ttft_ms_recompute']:.0f} ms recomputed: {t['speedup']:.1f}x"]


def main(argv=None) -> None:
    args = finish_args(parser(__doc__, OPTIONS).parse_args(argv))
    res, cfg, tok, quiet = setup(args, "ttft")
    dtype = args.dtype or cfg.dtype
    log(f"building {args.preset} ({cfg.num_layers} layers) in {dtype}")
    res["ttft"] = section(args, build_ours(cfg, dtype, args.seed), tok, quiet)
    finish(res, args, quiet, [summary_lines])


if __name__ == "__main__":
    main()
