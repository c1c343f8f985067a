"""Int8 dense weights (horizon/quant/int8.py) on the `small` preset: bytes, logits error, GEMV speed.

Builds the preset in fp32 (random weights, fixed seed) and four variants of it:
  fp32          the model as built (the reference for every error below)
  mxfp4         routed experts in MXFP4 (`horizon.quant.quantize_model`)
  mxfp4+int8    MXFP4 experts and every dense projection in int8 (`quantize_dense_int8`)
  int8          int8 dense projections on the fp32 model, experts left fp32
and reports for each
- resident weight bytes (every parameter and buffer, a shared tensor once), and the bytes a batch-1
  decode step reads: everything except the embedding table and (1 - k/E) of the routed experts
  (`decode_bytes`; `decode_bytes_text` also leaves out the vision encoder, which a text step never reads);
- logits error against fp32 on a few random prompts: max |error| / max |logit|, relative RMS
  (||error|| / ||logits||), mean cosine and argmax (greedy token) agreement. The random-weight model is
  very sensitive (a small weight change flips router choices, and errors grow through the layers), so two
  calibrations sit beside int8's: Gaussian noise of the same relative RMS as int8's rounding on the same
  tensors (`int8_noise_baseline`), and int8 on the LM head alone (`int8_lm_head_only`: one layer's error,
  with nothing downstream to amplify it);
- per-shape GEMV time at batch 1 (M=1) for each distinct dense shape of the preset: fp32 F.linear,
  Int8Linear (its fast path: bf16 activation into aten._weight_int8pack_mm), and the same op fed fp32
  activations (the slow variant Int8Linear avoids); medians of interleaved runs, re-measured when other
  processes take the cores (bench/common.py `Quiet`), and the per-step sum over all dense layers.

    python bench/int8.py [--preset small] [--threads 2] [--runs 30] [--seed 0]

Logs go to stderr; one JSON object per section on stdout, the summary on the last line.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections import Counter

import torch
import torch.nn.functional as F
from common import Quiet, log, machine_info
from mxfp4 import resident_bytes

from horizon import ModelConfig
from horizon.model import HorizonForCausalLM
from horizon.model.moe import Experts
from horizon.quant import Int8Linear, MXFP4Experts, quantize_dense_int8, quantize_model


def _module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def byte_counts(model: HorizonForCausalLM) -> dict:
    cfg = model.config
    routed = sum(_module_bytes(m) for m in model.modules() if isinstance(m, (Experts, MXFP4Experts)))
    vision = _module_bytes(model.vision) if model.vision is not None else 0
    embed = model.embed.weight.numel() * model.embed.weight.element_size()
    total = resident_bytes(model)
    decode = total - embed - routed * (1 - cfg.num_experts_per_tok / cfg.n_routed_experts)
    dense = [m for m in model.modules() if isinstance(m, Int8Linear)]
    return {"resident_bytes": total, "decode_bytes": int(decode), "decode_bytes_text": int(decode - vision),
            "embedding_bytes": embed, "routed_expert_bytes": routed, "vision_bytes": vision,
            "int8_modules": len(dense), "int8_module_bytes": sum(_module_bytes(m) for m in dense)}


@torch.inference_mode()
def logits_of(model: HorizonForCausalLM, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [model(ids[None])[0] for ids in prompts]  # fp32 logits [T, V]


def logits_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    rel_max, rms, cos, agree = [], [], [], []
    for a, b in zip(ref, got, strict=True):
        rel_max.append(float((a - b).abs().max() / a.abs().max()))
        rms.append(float((a - b).norm() / a.norm()))
        cos.append(float(F.cosine_similarity(a, b, dim=-1).mean()))
        agree.append(float((a.argmax(-1) == b.argmax(-1)).float().mean()))
    return {"max_abs_err_over_max_abs_logit": round(max(rel_max), 5), "rms_rel_err": round(statistics.mean(rms), 5),
            "rms_rel_err_per_prompt": [round(r, 5) for r in rms], "mean_cosine": round(statistics.mean(cos), 6),
            "argmax_agreement": round(statistics.mean(agree), 4)}


@torch.no_grad()
def dense_weight_error(full: torch.nn.Module, quant: torch.nn.Module) -> float:
    """Relative RMS rounding error over all int8 matrices (sum of squares over all of them)."""
    err = ref = 0.0
    exact = dict(full.named_modules())
    for name, m in quant.named_modules():
        if isinstance(m, Int8Linear):
            w = exact[name].weight.float()
            err += float((m.weight - w).pow(2).sum())
            ref += float(w.pow(2).sum())
    return (err / ref) ** 0.5


@torch.no_grad()
def with_dense_noise(full: HorizonForCausalLM, names: list[str], rel: float, seed: int) -> HorizonForCausalLM:
    """A copy whose `names` linears get Gaussian noise of `rel` times each weight's RMS (a calibration)."""
    noisy = copy.deepcopy(full)
    gen = torch.Generator().manual_seed(seed)
    modules = dict(noisy.named_modules())
    for name in names:
        w = modules[name].weight
        w.add_(torch.randn(w.shape, generator=gen) * w.float().pow(2).mean().sqrt() * rel)
    return noisy


def _timed(fn, runs: int) -> list[float]:
    fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


@torch.inference_mode()
def gemv_times(shape: tuple[int, int], runs: int, seed: int) -> dict:
    """ms per [1, in] x [out, in]^T product: fp32 F.linear, Int8Linear, and the int8 op on fp32 input."""
    out_f, in_f = shape
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * 0.02)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(1, in_f, generator=gen)
    w, scale32 = lin.weight, q.weight_scale
    fns = {"fp32_linear": lambda: F.linear(x, w), "int8_linear": lambda: q(x),
           "int8pack_fp32_input": lambda: torch.ops.aten._weight_int8pack_mm(x, q.weight_int8, scale32)}
    times = {k: [] for k in fns}
    for r in range(3):  # interleaved rounds: a burst of contention hits every variant alike
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[k] += _timed(fns[k], runs)
    ms = {k: round(1000 * statistics.median(v), 4) for k, v in times.items()}
    ms["speedup_int8_vs_fp32"] = round(ms["fp32_linear"] / ms["int8_linear"], 2)
    ms["fast_path"] = q.uses_fast_path("cpu")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30, help="timed GEMV calls per variant per round")
    ap.add_argument("--prompts", default="16,64,128", help="lengths of the random prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = ModelConfig.preset(args.preset).replace(dtype="float32")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    full = HorizonForCausalLM(cfg).eval()
    log(f"built {args.preset} in fp32 ({time.perf_counter() - t0:.1f} s)")
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=gen) for n in args.prompts.split(",")]
    ref = logits_of(full, prompts)

    bytes_, errors = {"fp32": byte_counts(full)}, {}
    # one copy at a time beside the fp32 model, so peak memory stays ~2x the fp32 weights
    mx = quantize_model(copy.deepcopy(full))
    bytes_["mxfp4"], errors["mxfp4"] = byte_counts(mx), logits_error(ref, logits_of(mx, prompts))
    log("mxfp4 measured")
    both = quantize_dense_int8(mx)  # in place: the MXFP4 copy becomes MXFP4 + int8
    bytes_["mxfp4+int8"], errors["mxfp4+int8"] = byte_counts(both), logits_error(ref, logits_of(both, prompts))
    del mx, both
    log("mxfp4+int8 measured")
    i8 = quantize_dense_int8(copy.deepcopy(full))
    bytes_["int8"], errors["int8"] = byte_counts(i8), logits_error(ref, logits_of(i8, prompts))
    shapes = Counter((m.out_features, m.in_features) for m in i8.modules() if isinstance(m, Int8Linear))
    int8_names = [n for n, m in i8.named_modules() if isinstance(m, Int8Linear)]
    weight_err = dense_weight_error(full, i8)
    vision_shapes = Counter((m.out_features, m.in_features) for m in full.vision.modules()
                            if isinstance(m, torch.nn.Linear)) if full.vision is not None else Counter()
    del i8
    log("int8 measured")
    noisy = with_dense_noise(full, int8_names, weight_err, args.seed)
    errors["int8_noise_baseline"] = logits_error(ref, logits_of(noisy, prompts))
    del noisy
    fp32_head, full.lm_head = full.lm_head, Int8Linear.from_linear(full.lm_head)  # swapped in, then back
    errors["int8_lm_head_only"] = logits_error(ref, logits_of(full, prompts))
    full.lm_head = fp32_head
    log("calibrations measured")
    for b in bytes_.values():
        for key in ("resident_bytes", "decode_bytes", "decode_bytes_text"):
            b[f"{key}_ratio_to_fp32"] = round(b[key] / bytes_["fp32"][key], 4)
    print(json.dumps({"bytes": bytes_}), flush=True)
    print(json.dumps({"logits_error_vs_fp32": errors, "int8_weights_rms_rel_err": round(weight_err, 5)}), flush=True)

    quiet = Quiet(threshold=0.5, retries=2, max_wait=120)
    gemv = {}
    for (out_f, in_f), count in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
        key = f"{in_f}->{out_f}"
        gemv[key] = quiet.run(key, lambda s=(out_f, in_f): gemv_times(s, args.runs, args.seed))
        gemv[key]["layers"] = count
        log(f"gemv {key} x{count}: {gemv[key]}")
    step = {k: round(sum(g[k] * g["layers"] for g in gemv.values()), 3)
            for k in ("fp32_linear", "int8_linear", "int8pack_fp32_input")}
    print(json.dumps({"gemv_ms_batch1": gemv, "dense_ms_per_decode_step": step}), flush=True)

    pick = {k: gemv[k] for k in ("512->2048", "2048->512", "512->32768") if k in gemv}
    print(json.dumps({
        "bench": "int8", "preset": args.preset, "dtype": "float32", "threads": torch.get_num_threads(),
        "machine": machine_info(), "quiet": quiet.report(), "prompts": [len(p) for p in prompts],
        "int8_layer_shapes": {f"{i}->{o}": c for (o, i), c in shapes.items()},
        "vision_linear_shapes_untouched": sum(vision_shapes.values()),
        "summary": {
            "resident_gb": {k: round(b["resident_bytes"] / 1e9, 4) for k, b in bytes_.items()},
            "resident_ratio_to_fp32": {k: b["resident_bytes_ratio_to_fp32"] for k, b in bytes_.items()},
            "decode_bytes_mb": {k: round(b["decode_bytes"] / 1e6, 2) for k, b in bytes_.items()},
            "decode_bytes_ratio_to_fp32": {k: b["decode_bytes_ratio_to_fp32"] for k, b in bytes_.items()},
            "decode_bytes_text_ratio_to_fp32": {k: b["decode_bytes_text_ratio_to_fp32"] for k, b in bytes_.items()},
            "int8_weights_rms_rel_err": round(weight_err, 5),
            "logits_rms_rel_err": {k: e["rms_rel_err"] for k, e in errors.items()},
            "logits_max_rel_err": {k: e["max_abs_err_over_max_abs_logit"] for k, e in errors.items()},
            "argmax_agreement": {k: e["argmax_agreement"] for k, e in errors.items()},
            "gemv_ms": {k: {v: g[v] for v in ("fp32_linear", "int8_linear", "int8pack_fp32_input")}
                        for k, g in pick.items()},
            "dense_ms_per_decode_step": step,
        },
    }))


if __name__ == "__main__":
    main()
