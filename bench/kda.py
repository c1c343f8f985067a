"""KDA's chunkwise prefill through the CPU kernel (horizon/quant/kernels/kda.cpp, `kda_chunk_forward_`) against the
PyTorch reference (`kda_chunkwise_reference`), in one process, rounds interleaved.

Two measurements, each kernel against reference:
- `chunkwise`: a whole `kda_chunkwise` pass over T tokens of one sequence (`small`'s 8 heads of 64 x 64, chunks
  of 64), with the largest output difference between the two paths;
- `prefill` (unless --no-model): an eager prefill of one T-token prompt through the model runner, `small` in
  bf16 with MXFP4 routed experts (the preset quantised as configured); 512 tokens is the engine's default
  forward (`max_batch_tokens`: longer prompts are prefilled in chunks of it), 2,048 one forward as long.
The reference is put in the kernel's place by patching `horizon.model.kda.kda_chunkwise` inside this script;
the library has no switch for it beyond HORIZON_KERNELS=0 (every kernel off). The limit given is arithmetic,
not memory: the multiply-adds of the chunkwise form at the run's hot fp32 matmul rate (`torch.mm` of 1,024^3),
since a chunk's rows, scores and state sit in L1/L2.

    python bench/kda.py [--threads 2] [--repeats 5] [--quick] [--no-model] [--json]

Prints a table (unless --json) and, on the last line, one JSON object. `ratio` > 1: the kernel is faster.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F
from common import kernel_args, kernel_parser, log

import horizon.model.kda as kda_mod
from horizon import HorizonForCausalLM, ModelConfig
from horizon.model import HorizonCache
from horizon.quant.kernels import vector_path

LENGTHS, QUICK_LENGTHS = (512, 2048, 8192), (512, 2048)
MODEL_LENGTHS, QUICK_MODEL_LENGTHS = (512, 2048), (512,)


@contextlib.contextmanager
def reference_chunkwise(on: bool):
    """With on: the KDA layers' chunkwise form is the reference, as where the kernel does not run."""
    kernel = kda_mod.kda_chunkwise
    if on:
        kda_mod.kda_chunkwise = kda_mod.kda_chunkwise_reference
    try:
        yield
    finally:
        kda_mod.kda_chunkwise = kernel


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fn, repeats: int) -> tuple[float, float, list[float]]:
    """Median ms of fn with the kernel and with the reference, alternating (after one warm-up call of each),
    and the paired ratios."""
    kernel, reference = [], []
    for r in range(repeats + 1):
        for ref, out in ((False, kernel), (True, reference)):
            with reference_chunkwise(ref):
                t = seconds(fn) * 1e3
            if r:
                out.append(t)
    return statistics.median(kernel), statistics.median(reference), [round(b / a, 2) for a, b in zip(kernel, reference,
                                                                                                     strict=True)]


def kda_inputs(T: int, H: int, K: int, gen: torch.Generator):
    q, k = (F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, K, generator=gen)
    g = -torch.rand(1, T, H, K, generator=gen) * 0.5
    return q, k, v, g, torch.rand(1, T, H, generator=gen)


def row(name: str, case, kernel_ms: float, reference_ms: float, paired: list[float], **extra) -> dict:
    log(f"{name} {case}: kernel {kernel_ms:.1f} ms, reference {reference_ms:.1f} ms ({reference_ms / kernel_ms:.2f}x)")
    return {"name": name, "case": case, "kernel_ms": round(kernel_ms, 2), "reference_ms": round(reference_ms, 2),
            "ratio": round(reference_ms / kernel_ms, 2), "paired_ratios": paired, **extra}


def main() -> None:
    ap = kernel_parser(__doc__, 5, "two lengths, two rounds")
    ap.add_argument("--no-model", action="store_true", help="skip the whole-model prefill")
    args = kernel_args(ap)
    path = vector_path()
    if path == "portable":
        raise SystemExit("the kernel has no vector path on this CPU (AVX-512 or AVX2): kda_chunkwise takes the "
                         "reference here, nothing to compare")
    repeats = 2 if args.quick else args.repeats
    cfg = ModelConfig.preset("small")
    H, K, C = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_chunk_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        gfma = statistics.median(1024**3 / seconds(lambda: torch.mm(a, b)) / 1e9 for _ in range(repeats + 2))
        for T in QUICK_LENGTHS if args.quick else LENGTHS:
            x = kda_inputs(T, H, K, gen)
            got, want = kda_mod.kda_chunkwise(*x, chunk_size=C), kda_mod.kda_chunkwise_reference(*x, chunk_size=C)
            diff = max((got[i] - want[i]).abs().max().item() for i in (0, 1))
            # scores 2 C^2/2 K, substitution C^2/2 2K, v_new, o and the state C K^2 each, o's Aqk C^2/2 K
            fma = T * H * (C * K + C * K + 3 * K * K + C * K / 2)
            rows.append(row("chunkwise", T, *interleaved(lambda x=x: kda_mod.kda_chunkwise(*x, chunk_size=C), repeats),
                            max_abs_diff=float(f"{diff:.3g}"), limit_ms=round(fma / gfma / 1e6, 2)))
        if not args.no_model:
            from horizon.engine.runner import ModelRunner, StepInputs
            from horizon.quant import quantize_model

            lengths = QUICK_MODEL_LENGTHS if args.quick else MODEL_LENGTHS
            log(f"building small (bf16, MXFP4 experts) for eager prefills of {', '.join(map(str, lengths))} tokens")
            torch.manual_seed(0)
            model = quantize_model(HorizonForCausalLM(cfg.replace(dtype="bfloat16")).eval())
            runner = ModelRunner(model, HorizonCache(cfg, 1, max(lengths) + 16, dtype=cfg.torch_dtype), compile=False)
            for T in lengths:
                prompt = torch.randint(100, cfg.vocab_size, (T,), generator=gen).tolist()
                step = StepInputs(tokens=[prompt], starts=[0], slots=[0])
                rows.append(row("prefill", T, *interleaved(lambda step=step: runner.run(step), repeats)))
    res = {"bench": "kda", "threads": args.threads, "repeats": repeats, "path": path, "heads": H, "head_dim": K,
           "chunk": C, "mm_GFMAps": round(gfma, 1), "cases": rows}
    if not args.json:
        print(f"bench/kda.py ({path} path), {args.threads} threads, {H} heads x {K}, chunks of {C}; "
              f"medians of {repeats}; hot fp32 mm {res['mm_GFMAps']} GFMA/s")
        print(f"{'what':10} {'tokens':>7} {'kernel ms':>10} {'reference ms':>13} {'ratio':>6} {'limit ms':>9}")
        for r in rows:
            print(f"{r['name']:10} {r['case']:>7} {r['kernel_ms']:>10} {r['reference_ms']:>13} {r['ratio']:>6} "
                  f"{r.get('limit_ms', ''):>9}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
