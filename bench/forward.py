"""Prefill and decode speed of Gated DSA's sparse attention against dense attention, same weights.

For each context length L the `small` preset model prefills L tokens into a decode cache and then
decodes a few tokens; the same model is then run again with every DSA layer's `index_topk` raised
above L (the indexer then selects every position: dense attention) in the same process. Prints one
JSON object per context and a summary; ratios > 1 mean the sparse model is faster.

    python bench/forward.py [--preset small] [--contexts 1024 4096 16384] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from common import set_topk

from horizon import ModelConfig
from horizon.model import Batch, HorizonForCausalLM


@torch.inference_mode()
def measure(model: HorizonForCausalLM, ids: torch.Tensor, decode_steps: int) -> dict:
    L = ids.shape[0]
    cache = model.new_cache(1, L + decode_steps)
    t0 = time.perf_counter()
    logits = model.forward_batch(ids, Batch.build([L], slots=[0]), cache, last_only=True)
    prefill = time.perf_counter() - t0
    token = logits.argmax(-1)
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        logits = model.forward_batch(token, Batch.build([1], start=cache.lens, slots=[0]), cache, last_only=True)
        token = logits.argmax(-1)
    decode = (time.perf_counter() - t0) / decode_steps
    return {"prefill_s": prefill, "prefill_tok_per_s": L / prefill, "decode_ms_per_tok": 1000 * decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="override the preset's dtype (float32, bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cfg = ModelConfig.preset(args.preset)
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings,
                                                  max(args.contexts) + args.decode_steps))
    torch.manual_seed(args.seed)
    model = HorizonForCausalLM(cfg).eval()
    topk = cfg.index_topk
    gen = torch.Generator().manual_seed(args.seed)
    measure(model, torch.randint(0, cfg.vocab_size, (256,), generator=gen), 2)  # warm-up
    rows = []
    for L in args.contexts:
        ids = torch.randint(0, cfg.vocab_size, (L,), generator=gen)
        set_topk(model, topk)
        sparse = measure(model, ids, args.decode_steps)
        set_topk(model, L + args.decode_steps + 1)
        dense = measure(model, ids, args.decode_steps)
        set_topk(model, topk)
        row = {
            "context": L, "index_topk": topk, "sparse": sparse, "dense": dense,
            "prefill_speedup": dense["prefill_s"] / sparse["prefill_s"],
            "decode_speedup": dense["decode_ms_per_tok"] / sparse["decode_ms_per_tok"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({
        "bench": "forward", "preset": args.preset, "dtype": cfg.dtype, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "summary": {r["context"]: {"prefill_tok_per_s_sparse": round(r["sparse"]["prefill_tok_per_s"], 1),
                                   "prefill_tok_per_s_dense": round(r["dense"]["prefill_tok_per_s"], 1),
                                   "decode_ms_sparse": round(r["sparse"]["decode_ms_per_tok"], 2),
                                   "decode_ms_dense": round(r["dense"]["decode_ms_per_tok"], 2),
                                   "prefill_speedup": round(r["prefill_speedup"], 3),
                                   "decode_speedup": round(r["decode_speedup"], 3)} for r in rows},
    }))


if __name__ == "__main__":
    main()
