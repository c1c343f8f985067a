"""MXFP4 against bf16 weights on the same model: resident bytes, logits error, and decode speed.

Builds the `small` preset in bf16, copies it, and quantises the copy's routed experts (and with
--attention its attention projections) with `horizon.quant.quantize_model`. In the same process it
measures
- resident weight bytes of both models, and of the quantised tensors alone (MXFP4 should be 4.25/16);
- the rounding error of the expert weights, and the logits error of the MXFP4 model against the bf16
  one on a few random prompts, beside the error that Gaussian noise of the same size on the expert
  weights causes (the model is randomly initialised: this calibrates how sensitive it is);
- decode speed: prefill a prompt into a cache, then decode one token at a time through
  `model.forward_batch`, alternating the two models for --repeats rounds (the machine is shared,
  so medians of interleaved runs); plus the time the per-step dequantisation alone takes.
Prints one JSON object per measurement and a summary: byte ratios are MXFP4 / bf16 (smaller is better),
decode_speedup is bf16 time / MXFP4 time (> 1: MXFP4 decodes faster). The logits error of int8 activations
(`set_int8_activations`, against the same MXFP4 model with fp32 activations) is reported beside.

--kernel measures the fused kernel alone instead: `mxfp4_expert_matmul` with fp32 against int8 activations,
and against bf16 ones (x rounded to bf16, as a bf16 model passes it: the AMX path where the CPU has it, from 3
rows an expert; `bf16_path` says which ran), on the preset's expert shapes (gate_up and down), with the rows a
step of 1, 4, 16 and 64 sequences routes (tokens x experts per token, each token to distinct experts, as the
router picks them) and of 256 tokens (a prefill chunk), weights cycled through copies larger than the
last-level cache (cold, as in a step), rounds interleaved, medians; speedup = fp32 time / int8 time
(speedup_bf16: fp32 time / bf16 time; speedup_vs_portable: the kernel's portable C++ path's time with fp32
activations / fp32 time, the vector path's gain), and the packed bytes of the experts a call touches per second against
a cold read measured in the same run (the limit).

    python bench/mxfp4.py [--preset small] [--prompt 64] [--decode-steps 16] [--repeats 5] [--attention]
                          [--threads N]
    python bench/mxfp4.py --kernel [--preset small] [--repeats 5] [--threads N]

--eager-experts measures an eager `MXFP4Experts` call in its two forms on the same quantised model (the
preset in --dtype, default fp32 here): grouped (`MXFP4Experts.forward`: two fused-kernel calls over every routed
row, what eager steps run) against the loop over routed experts (`Experts.forward`: a host sync, then a gather
and two kernel calls per expert; what they ran before), on eager decode steps of 1 and 16 sequences and one
prefill of --prefill tokens; rounds interleaved (the order alternates), medians; speedup = loop / grouped, and
the logits' largest difference between the forms relative to their largest magnitude. --device cuda runs it on
a GPU (the Triton kernel).

    python bench/mxfp4.py --eager-experts [--preset small] [--dtype float32] [--repeats 5] [--threads N]
                          [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from horizon import ModelConfig
from horizon.model import Batch, HorizonForCausalLM
from horizon.model.moe import Experts
from horizon.quant import MXFP4Experts, MXFP4Linear, dequantize, quantize, quantize_model, set_int8_activations


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (a tied tensor once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def quantised_bytes(full: torch.nn.Module, quant: torch.nn.Module) -> tuple[int, int]:
    """(bytes in `full` of the tensors `quant` holds as MXFP4, bytes of their packed form)."""
    packed = dict(quant.named_modules())
    before = after = 0
    for name, m in full.named_modules():
        q = packed.get(name)
        if isinstance(q, (MXFP4Experts, MXFP4Linear)):
            before += sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n != "bias")
            after += sum(b.numel() * b.element_size() for b in q.buffers())
    return before, after


@torch.inference_mode()
def weight_error(full: torch.nn.Module, quant: torch.nn.Module) -> float:
    """Relative RMS rounding error of the quantised routed-expert weights (one layer's stack at a time)."""
    err = ref = 0.0
    packed = dict(quant.named_modules())
    for name, m in full.named_modules():
        if isinstance(m, Experts):
            q = packed[name]
            for w in ("gate_up_proj", "down_proj"):
                exact = getattr(m, w).float()
                rounded = dequantize(getattr(q, f"{w}_blocks"), getattr(q, f"{w}_scales"), torch.float32,
                                     exact.shape[-1])
                err += float((rounded - exact).pow(2).sum())
                ref += float(exact.pow(2).sum())
    return (err / ref) ** 0.5


@torch.inference_mode()
def with_expert_noise(full: HorizonForCausalLM, rel: float, seed: int) -> HorizonForCausalLM:
    """A copy whose routed-expert weights get Gaussian noise of `rel` times each tensor's RMS: what an
    unstructured error as large as MXFP4's rounding does to this model's logits (a calibration)."""
    noisy = copy.deepcopy(full)
    gen = torch.Generator().manual_seed(seed)
    for m in noisy.modules():
        if isinstance(m, Experts):
            for w in (m.gate_up_proj, m.down_proj):
                rms = w.float().pow(2).mean().sqrt()
                w.add_((torch.randn(w.shape, generator=gen) * rms * rel).to(w.dtype))
    return noisy


@torch.inference_mode()
def logits_error(full: HorizonForCausalLM, quant: HorizonForCausalLM, prompts: list[torch.Tensor]) -> dict:
    rel, rms, cos, agree = [], [], [], []
    for ids in prompts:
        a, b = full(ids[None])[0], quant(ids[None])[0]  # fp32 logits [T, V]
        rel.append(float((a - b).abs().max() / a.abs().max()))
        rms.append(float((a - b).norm() / a.norm()))
        cos.append(float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()))
        agree.append(float((a.argmax(-1) == b.argmax(-1)).float().mean()))
    return {"max_abs_err_over_max_abs_logit": max(rel), "rms_err_over_rms_logit": statistics.mean(rms),
            "mean_cosine": statistics.mean(cos),
            "top1_agreement": statistics.mean(agree)}


@torch.inference_mode()
def decode_ms(model: HorizonForCausalLM, ids: torch.Tensor, steps: int) -> float:
    """Milliseconds per decoded token after prefilling `ids` (greedy, batch of one)."""
    cache = model.new_cache(1, ids.shape[0] + steps)
    logits = model.forward_batch(ids, Batch.build([ids.shape[0]], slots=[0]), cache, last_only=True)
    token = logits.argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.forward_batch(token, Batch.build([1], start=cache.lens, slots=[0]), cache, last_only=True)
        token = logits.argmax(-1)
    return 1000 * (time.perf_counter() - t0) / steps


@torch.inference_mode()
def dequant_ms_per_step(model: HorizonForCausalLM, reps: int = 5) -> float:
    """Milliseconds to decode what one token's step reads: k experts' two matrices in every MoE layer."""
    experts = [m for m in model.modules() if isinstance(m, MXFP4Experts)]
    k, dtype = model.config.num_experts_per_tok, model.embed.weight.dtype
    t0 = time.perf_counter()
    for _ in range(reps):
        for m in experts:
            for e in range(k):
                m.weight("gate_up_proj", e, dtype)
                m.weight("down_proj", e, dtype)
    return 1000 * (time.perf_counter() - t0) / reps


def timed_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def call_us(op, x: torch.Tensor, copies: list, ids: list, portable: bool, q8: bool, calls: int) -> float:
    """Microseconds per kernel call, cycling through the weight copies (after one warm-up call)."""
    op(x, *copies[0], ids[0], portable, q8)
    t0 = time.perf_counter()
    for i in range(calls):
        op(x, *copies[i % len(copies)], ids[i % len(copies)], portable, q8)
    return (time.perf_counter() - t0) / calls * 1e6


def kernel_bench(cfg: ModelConfig, preset: str, repeats: int, seed: int) -> None:
    """fp32 against int8 and bf16 activations in the fused kernel (the module docstring's --kernel)."""
    from horizon.quant.kernels import has_amx, int8_path, kernel_available, vector_path

    if not kernel_available():
        raise SystemExit("bench/mxfp4.py --kernel: the C++ kernel did not build (see the warning above)")
    op = torch.ops.horizon_kernels.mxfp4_expert_matmul
    E, d, f, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    gen = torch.Generator().manual_seed(seed)
    big = torch.ones(64 << 20)  # the physical limit: a cold 256 MB read, the best of 5
    read = big.nbytes / min(timed_once(big.sum) for _ in range(5)) / 1e9
    del big
    print(json.dumps({"read_GBps": round(read, 2)}), flush=True)
    results = []
    for name, (N, K) in {"gate_up": (2 * f, d), "down": (d, f)}.items():
        one = E * N * (K // 32) * 17  # packed bytes of one stack of E experts
        copies = [quantize(torch.randn(E, N, K, generator=gen) * K ** -0.5) for _ in range(max(2, (256 << 20) // one))]
        for tokens in (1, 4, 16, 64, 256):  # a decode step of that many sequences (256: a prefill chunk)
            rows = tokens * k  # each token's row goes to k distinct experts
            x = torch.randn(rows, K, generator=gen)
            # (x, the portable path, int8 activations)
            inputs = {"fp32": (x, False, False), "int8": (x, False, True), "bf16": (x.bfloat16().float(), False, False),
                      "portable": (x, True, False)}
            ids = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).flatten()
                   for _ in range(len(copies))]
            touched = statistics.mean(len(i.unique()) for i in ids) * N * (K // 32) * 17  # packed bytes read
            calls = max(8, min(200, 4000 // rows))
            times = {name: [] for name in inputs}
            for r in range(repeats):
                for form in list(inputs)[r % len(inputs):] + list(inputs)[:r % len(inputs)]:  # each first in turn
                    xf, portable_path, q8 = inputs[form]
                    times[form].append(call_us(op, xf, copies, ids, portable_path, q8, calls))
            a, b, c, portable = (statistics.median(times[form]) for form in inputs)
            results.append({"matrix": name, "N": N, "K": K, "experts": E, "tokens": tokens, "rows": rows,
                            "fp32_us": round(a, 1), "int8_us": round(b, 1), "bf16_us": round(c, 1),
                            "portable_us": round(portable, 1),
                            "speedup": round(a / b, 3), "speedup_bf16": round(a / c, 3),
                            "speedup_vs_portable": round(portable / a, 3),
                            "weight_GBps_fp32": round(touched / a / 1e3, 2),
                            "weight_GBps_int8": round(touched / b / 1e3, 2),
                            "weight_GBps_bf16": round(touched / c / 1e3, 2),
                            "int8_fraction_of_read_bandwidth": round(touched / b / 1e3 / read, 3),
                            "paired": [round(x / y, 3) for x, y in zip(times["fp32"], times["int8"], strict=True)],
                            "paired_bf16": [round(x / y, 3)
                                            for x, y in zip(times["fp32"], times["bf16"], strict=True)]})
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"bench": "mxfp4-kernel", "preset": preset,
                      "path": vector_path(),
                      "int8_path": int8_path(), "bf16_path": "amx" if has_amx() else "fma",
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "repeats": repeats, "read_GBps": round(read, 2), "results": results}))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def eager_step_ms(model: HorizonForCausalLM, kind: str, n: int, prompt: int, steps: int,
                  gen: torch.Generator) -> tuple[float, torch.Tensor]:
    """(ms, last logits): one eager prefill of n tokens ("prefill"), or the mean of `steps` eager decode steps
    of n sequences after a `prompt`-token prefill each ("decode", untimed)."""
    device, V = model.embed.weight.device, model.config.vocab_size
    if kind == "prefill":
        cache = model.new_cache(1, n)
        ids = torch.randint(0, V, (n,), generator=gen).to(device)
        sync(device)
        t0 = time.perf_counter()
        logits = model.forward_batch(ids, Batch.build([n], slots=[0]), cache, last_only=True)
        sync(device)
        return 1000 * (time.perf_counter() - t0), logits
    cache = model.new_cache(n, prompt + steps)
    ids = torch.randint(0, V, (n * prompt,), generator=gen).to(device)
    logits = model.forward_batch(ids, Batch.build([prompt] * n, slots=list(range(n))), cache, last_only=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = Batch.build([1] * n, start=cache.lens.tolist(), slots=list(range(n)))
        logits = model.forward_batch(logits.argmax(-1), batch, cache, last_only=True)
    sync(device)
    return 1000 * (time.perf_counter() - t0) / steps, logits


def eager_experts_bench(args) -> None:
    device = torch.device(args.device)
    cfg = ModelConfig.preset(args.preset).replace(dtype=args.dtype)
    torch.manual_seed(args.seed)
    model = quantize_model(HorizonForCausalLM(cfg).eval()).to(device)
    forms = {"loop": Experts.forward, "grouped": MXFP4Experts.forward}
    shapes = [("decode", 1), ("decode", 16), ("prefill", args.prefill)]
    times = {(kind, n, form): [] for kind, n in shapes for form in forms}
    diff = {}
    try:
        for r in range(args.repeats + 1):  # round 0 warms up (the kernels build, caches fill)
            for kind, n in shapes:
                logits = {}
                for form in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
                    MXFP4Experts.forward = forms[form]
                    gen = torch.Generator().manual_seed(args.seed + r)  # the same tokens for both forms
                    ms, logits[form] = eager_step_ms(model, kind, n, args.prompt, args.decode_steps, gen)
                    if r:
                        times[(kind, n, form)].append(ms)
                a, b = logits["loop"].float(), logits["grouped"].float()
                diff[(kind, n)] = max(diff.get((kind, n), 0.0), ((a - b).abs().max() / a.abs().max()).item())
            if r:
                print(json.dumps({"round": r, **{f"{k}_{n}_{f}_ms": round(v[-1], 2)
                                                 for (k, n, f), v in times.items()}}), flush=True)
    finally:
        MXFP4Experts.forward = forms["grouped"]
    rows = {}
    for kind, n in shapes:
        loop, grouped = (statistics.median(times[(kind, n, f)]) for f in forms)
        rows[f"{kind}_{n}"] = {"loop_ms": round(loop, 2), "grouped_ms": round(grouped, 2),
                               "speedup": round(loop / grouped, 3),
                               "logits_max_rel_diff": float(f"{diff[(kind, n)]:.3g}")}
    print(json.dumps({"bench": "mxfp4_eager_experts", "preset": args.preset, "dtype": cfg.dtype,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                      (platform.processor() or platform.machine()), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "repeats": args.repeats, "rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default=None, help="default bfloat16; float32 with --eager-experts")
    ap.add_argument("--prompt", type=int, default=64, help="prompt length before decoding")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds of bf16 / MXFP4 decoding")
    ap.add_argument("--attention", action="store_true", help="also quantise the attention projections")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel", action="store_true", help="time the fused kernel alone, fp32 vs int8 activations")
    ap.add_argument("--eager-experts", action="store_true", help="eager MXFP4Experts calls: grouped vs the loop")
    ap.add_argument("--prefill", type=int, default=512, help="--eager-experts: prefill tokens")
    ap.add_argument("--device", default="cpu", help="--eager-experts: cpu or cuda")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eager_experts:
        # fp32: the CPU's fast path (bf16 compute is slow here); --dtype bfloat16 on a GPU
        args.dtype = args.dtype or "float32"
        eager_experts_bench(args)
        return
    if args.kernel:
        kernel_bench(ModelConfig.preset(args.preset), args.preset, args.repeats, args.seed)
        return

    cfg = ModelConfig.preset(args.preset).replace(dtype=args.dtype or "bfloat16")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    full = HorizonForCausalLM(cfg).eval()
    quant = quantize_model(copy.deepcopy(full), attention=args.attention)
    build_s = time.perf_counter() - t0
    n_experts = sum(1 for m in full.modules() if isinstance(m, Experts))

    before, after = quantised_bytes(full, quant)
    memory = {"resident_bytes_bf16": resident_bytes(full), "resident_bytes_mxfp4": resident_bytes(quant),
              "quantised_tensors_bytes_bf16": before, "quantised_tensors_bytes_mxfp4": after,
              "quantised_tensors_ratio": after / before, "expected_ratio": 4.25 / 16}
    memory["resident_ratio"] = memory["resident_bytes_mxfp4"] / memory["resident_bytes_bf16"]
    print(json.dumps({"memory": memory}), flush=True)

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (16, 64, 128)]
    error = logits_error(full, quant, prompts)
    error["expert_weights_rms_rel_err"] = weight_error(full, quant)
    noisy = with_expert_noise(full, error["expert_weights_rms_rel_err"], args.seed)
    error["noise_baseline"] = logits_error(full, noisy, prompts)
    del noisy
    q8 = copy.deepcopy(quant)
    set_int8_activations(q8)
    error["int8_activations_vs_fp32_activations"] = logits_error(quant, q8, prompts)
    del q8
    print(json.dumps({"logits": error}), flush=True)

    ids = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen)
    decode_ms(full, ids, 2), decode_ms(quant, ids, 2)  # warm-up
    times = {"bf16": [], "mxfp4": []}
    for r in range(args.repeats):
        order = (("bf16", full), ("mxfp4", quant)) if r % 2 == 0 else (("mxfp4", quant), ("bf16", full))
        for name, model in order:
            times[name].append(decode_ms(model, ids, args.decode_steps))
        print(json.dumps({"round": r, "decode_ms_bf16": round(times["bf16"][-1], 2),
                          "decode_ms_mxfp4": round(times["mxfp4"][-1], 2)}), flush=True)
    bf16_ms, mxfp4_ms = statistics.median(times["bf16"]), statistics.median(times["mxfp4"])
    dq_ms = statistics.median(dequant_ms_per_step(quant) for _ in range(3))

    print(json.dumps({
        "bench": "mxfp4", "preset": args.preset, "dtype": cfg.dtype, "attention_quantised": args.attention,
        "moe_layers": n_experts, "experts_per_token": cfg.num_experts_per_tok,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "build_s": round(build_s, 1),
        "summary": {
            "weights_ratio_quantised_tensors": round(memory["quantised_tensors_ratio"], 4),
            "weights_ratio_whole_model": round(memory["resident_ratio"], 4),
            "expert_weights_rms_rel_err": round(error["expert_weights_rms_rel_err"], 4),
            "logits_max_rel_err": round(error["max_abs_err_over_max_abs_logit"], 4),
            "logits_rms_rel_err": round(error["rms_err_over_rms_logit"], 4),
            "logits_rms_rel_err_same_size_noise": round(error["noise_baseline"]["rms_err_over_rms_logit"], 4),
            "logits_mean_cosine": round(error["mean_cosine"], 5),
            "int8_activations_logits_rms_rel_err": round(
                error["int8_activations_vs_fp32_activations"]["rms_err_over_rms_logit"], 4),
            "int8_activations_top1_agreement": round(
                error["int8_activations_vs_fp32_activations"]["top1_agreement"], 4),
            "top1_agreement": round(error["top1_agreement"], 4),
            "decode_ms_bf16": round(bf16_ms, 2), "decode_ms_mxfp4": round(mxfp4_ms, 2),
            "decode_tok_per_s_bf16": round(1000 / bf16_ms, 2), "decode_tok_per_s_mxfp4": round(1000 / mxfp4_ms, 2),
            "decode_speedup": round(bf16_ms / mxfp4_ms, 3),
            "dequant_ms_per_step": round(dq_ms, 2),
        },
    }))


if __name__ == "__main__":
    main()
