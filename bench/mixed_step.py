"""A mixed engine step (many decode rows plus one prompt chunk): split mixers against the padded layout.

Under load the engine's steps are mostly mixed: while B-1 sequences decode, a newly admitted one
prefills a chunk of T tokens. The sequence mixers (KDA, Gated DSA) work on [B, T] views; padded,
each decode row would be computed T times over. `Batch.split_decode` runs decode rows and prompt
chunks through the mixers as two groups. This measures one such forward both ways on the same model,
cache state and tokens (the padded way by turning the split off), interleaved and repeated, and
prints one JSON object: median ms per forward each way and `speedup` (padded / split, > 1: the split
is faster), per chunk length.

    python bench/mixed_step.py [--preset mini] [--batch 64] [--context 300] [--chunks 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from horizon import ModelConfig
from horizon.model import Batch, HorizonForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--batch", type=int, default=64, help="sequences in the step (one of them prefills)")
    ap.add_argument("--context", type=int, default=300, help="tokens already cached per decoding sequence")
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256], help="prompt chunk lengths T")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig.preset(args.preset)
    model = HorizonForCausalLM(cfg).eval()
    B, L = args.batch, args.context
    max_len = L + max(args.chunks) + 1
    results = []
    with torch.inference_mode():
        cache = model.new_cache(B, max_len)
        ids = torch.randint(0, cfg.vocab_size, (B, L))
        model(ids, cache=cache)  # every slot holds L tokens
        base = cache.lens.clone()
        for T in args.chunks:
            lens = [1] * (B - 1) + [T]
            tokens = torch.randint(0, cfg.vocab_size, (sum(lens),))
            batch_args = dict(lens=lens, start=base.tolist(), slots=list(range(B)))
            times = {"split": [], "padded": []}
            for _ in range(args.repeats):
                for way in ("split", "padded"):
                    batch = Batch.build(**batch_args)
                    if way == "padded":
                        batch._parts = [(batch, None)]  # what split_decode answers for a one-part batch
                    cache.lens.copy_(base)  # the same positions each time (the KDA state drifts; the work does not)
                    t0 = time.perf_counter()
                    model.forward_batch(tokens, batch, cache, last_only=True)
                    times[way].append(time.perf_counter() - t0)
            split, padded = statistics.median(times["split"]), statistics.median(times["padded"])
            results.append({"chunk": T, "split_ms": round(split * 1e3, 2), "padded_ms": round(padded * 1e3, 2),
                            "speedup": round(padded / split, 2)})
    print(json.dumps({"bench": "mixed_step", "preset": args.preset, "batch": B, "context": L,
                      "threads": torch.get_num_threads(), "machine": platform.machine(), "results": results}))


if __name__ == "__main__":
    main()
