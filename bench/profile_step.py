"""Where a decode step of Horizon's engine goes, beside transformers' `kimi_linear` per component.

Our `small` preset in fp32 and bf16, at batch 1 and 16 (prompts of ordinary tokens): ms per step per
component (KDA, DSA, MoE router / routed / shared experts, norms, embed, lm_head; module hooks, which add
~1 ms), the engine's time outside the model's forward, the top aten ops of a step (torch.profiler), and
what the batch-1 step's matrix products take when each runs alone (F.linear at this machine's small-GEMM
speed). The comparison, in the same process: transformers' same-size `kimi_linear` (fp32, pure-PyTorch
paths: fla / triton / causal_conv1d blocked) per component at batch 1, through `model.generate`.
bench/engine.py runs this by default when ratio_vs_kimi_linear_batch1 is below the issue's goal (4x).
(Named profile_step.py, not profile.py: a bench/profile.py would shadow the standard library's `profile`
module, which torch._dynamo imports through cProfile, for every script in bench/.)

    python bench/profile_step.py                     # the small preset, 2 threads
    python bench/profile_step.py --quick --json      # tiny sizes (a smoke run)
    python bench/profile_step.py --profile-batches 1 16 --profile-steps 8 [--no-transformers]

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one JSON
object whose `profile` key holds the result.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import torch
from common import (
    Recorder,
    build_hf_models,
    build_ours_pair,
    finish,
    finish_args,
    linear_times,
    load_transformers,
    log,
    median,
    parser,
    random_tokens,
    rounded,
    run_hf,
    setup,
    submit,
    top_ops,
)

from horizon import ModelConfig
from horizon.engine import Engine, EngineConfig
from horizon.model import HorizonForCausalLM
from horizon.model.moe import Experts

OPTIONS = ("prompt", "hf_attn", "no_transformers", "profile_batches", "profile_steps")


def our_label(name: str, module) -> str | None:
    kind = type(module).__name__
    if kind == "KimiDeltaAttention":
        return "kda_attention"
    if kind == "GatedDSA":
        return "dsa_attention"
    if kind == "Router":
        return "moe_router"
    if isinstance(module, Experts):
        return "moe_routed_experts"
    if kind == "MoE":
        return "moe_total"
    if kind == "MLP":
        return "moe_shared_expert" if name.endswith("shared_experts") else "dense_mlp"
    if name.endswith(("attn_norm", "mlp_norm")) or name == "norm":
        return "block_norms"
    if name in ("embed", "lm_head"):
        return name
    return None


HF_CLASSES = {  # transformers' module classes -> our component names
    "KimiLinearDeltaAttention": "kda_attention", "Glm5NextTextLinearAttention": "kda_attention",
    "KimiLinearAttention": "dsa_attention", "Glm5NextTextAttention": "dsa_attention",  # MLA / DSA
    "KimiLinearTopkRouter": "moe_router", "Glm5NextTextTopkRouter": "moe_router",
    "KimiLinearExperts": "moe_routed_experts", "Glm5NextTextExperts": "moe_routed_experts",
    "KimiLinearMoE": "moe_total", "Glm5NextTextMoE": "moe_total",
    "Glm5NextTextHyperConnection": "hyper_connections",
}


def hf_label(name: str, module) -> str | None:
    kind = type(module).__name__
    if kind in HF_CLASSES:
        return HF_CLASSES[kind]
    if kind in ("KimiLinearMLP", "Glm5NextTextMLP"):
        return "moe_shared_expert" if name.endswith("shared_experts") else "dense_mlp"
    if name.endswith(("input_layernorm", "post_attention_layernorm", "model.norm", "language_model.norm")):
        return "block_norms"
    if name.endswith("embed_tokens"):
        return "embed"
    if name == "lm_head":
        return "lm_head"
    return None


def linear_shapes(model: HorizonForCausalLM) -> dict[tuple[int, int], float]:
    """Weight shapes of the matrix products of a batch-1 decode step -> how many run per step (routed
    experts: num_experts_per_tok of each stack; the router's and the attention einsums are not included)."""
    cfg = model.config
    counts: dict[tuple[int, int], float] = defaultdict(float)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            counts[tuple(module.weight.shape)] += 1
        elif isinstance(module, Experts):
            _, two_f, d = module.gate_up_proj.shape
            counts[(two_f, d)] += cfg.num_experts_per_tok
            counts[(d, two_f // 2)] += cfg.num_experts_per_tok
    return dict(counts)


def linears_alone_ms(shapes: dict[tuple[int, int], float], dtype: torch.dtype, rows: int = 1) -> float:
    """ms per step the step's matrix products take when each runs alone (F.linear, `rows` input rows):
    what the step would cost with no other work, at this machine's small-GEMM speed in `dtype`."""
    total = 0.0
    for (n, k), count in shapes.items():
        w, x = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype)
        total += count * median(linear_times(x, w, 10))
    return 1000 * total


class ComponentTimer:
    """Wall time per labelled module (forward hooks), accumulated only while `on` is True."""

    def __init__(self, model, label):
        self.ms: dict[str, float] = defaultdict(float)
        self.on = False
        self._start: dict[int, float] = {}
        self._hooks = []
        for name, module in model.named_modules():
            lab = label(name, module)
            if lab is not None:
                self._hooks.append(module.register_forward_pre_hook(self._pre))
                self._hooks.append(module.register_forward_hook(lambda m, a, o, lab=lab: self._post(m, lab)))

    def _pre(self, module, args):
        self._start[id(module)] = time.perf_counter()

    def _post(self, module, lab):
        if self.on:
            self.ms[lab] += 1000 * (time.perf_counter() - self._start.pop(id(module)))

    def remove(self):
        for h in self._hooks:
            h.remove()


def per_step(ms: dict[str, float], steps: int, total_ms: float) -> dict:
    out = {k: ms[k] / steps for k in sorted(ms, key=ms.get, reverse=True)}
    moe = out.pop("moe_total", None)
    if moe is not None:
        out["moe_glue"] = moe - sum(out.get(k, 0.0) for k in ("moe_router", "moe_routed_experts",
                                                              "moe_shared_expert"))
    out["total_step"] = total_ms / steps
    return {k: round(v, 3) for k, v in out.items()}


def profile_ours(model: HorizonForCausalLM, tok, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    prompts = random_tokens(tok, model.config.vocab_size, (batch, prompt_len), torch.Generator().manual_seed(seed))
    engine = Engine(model, tok, EngineConfig(max_num_seqs=batch, max_model_len=prompt_len + 2 * steps + 8,
                                             max_batch_tokens=max(512, batch * prompt_len)))
    rec = Recorder()
    for p in prompts:
        submit(engine, p, 2 * steps + 4, rec)
    engine.step()  # prefill
    engine.step()  # warm-up
    forward_ms = [0.0]
    inner = engine.model.forward_batch

    def timed_forward(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            forward_ms[0] += 1000 * (time.perf_counter() - t0)

    timer = ComponentTimer(model, our_label)
    engine.model.forward_batch = timed_forward
    try:
        timer.on = True
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = 1000 * (time.perf_counter() - t0)
    finally:
        timer.remove()
        del engine.model.forward_batch
    comp = per_step(timer.ms, steps, total)
    counted = sum(v for k, v in comp.items() if k != "total_step")
    comp["other_in_forward"] = round(forward_ms[0] / steps - counted, 3)
    comp["engine_outside_forward"] = round((total - forward_ms[0]) / steps, 3)
    top = top_ops(engine.step, steps)
    engine.run_until_idle()
    return {"components_ms_per_step": comp, "top_ops": top}


def profile_hf(model, prompts: list[list[int]], steps: int) -> dict:
    timer = ComponentTimer(model, hf_label)

    def on_put(n):  # put 1 is the prompt, put 2 the first token: decode steps follow
        timer.on = n >= 2

    try:
        res = run_hf(model, prompts, steps + 1, on_put)
    finally:
        timer.remove()
    return {"components_ms_per_step": per_step(timer.ms, steps, res["decode_s"] * 1000)}


def section(args, cfg: ModelConfig, ours: dict, tok, hf: dict) -> dict:
    """The value of the "profile" key."""
    out = {}
    for name, model in ours.items():
        for batch in args.profile_batches:
            log(f"profile: {name} batch {batch}")
            out[f"{name}_batch{batch}"] = profile_ours(model, tok, batch, args.prompt, args.profile_steps, args.seed)
    shapes = linear_shapes(next(iter(ours.values())))
    out["linears_alone_ms_per_step_batch1"] = {
        name: linears_alone_ms(shapes, model.embed.weight.dtype) for name, model in ours.items()}
    if "kimi_linear" in hf:
        log("profile: transformers kimi_linear batch 1")
        model = hf["kimi_linear"][0]
        prompts = random_tokens(tok, cfg.vocab_size, (1, args.prompt), torch.Generator().manual_seed(args.seed))
        run_hf(model, prompts, 3)  # warm-up
        out["kimi_linear_batch1"] = profile_hf(model, prompts, args.profile_steps)
    log(f"profile: {json.dumps(rounded(out))}")
    return out


def summary_lines(res: dict) -> list[str]:
    prof = dict(res.get("profile") or {})
    alone = prof.pop("linears_alone_ms_per_step_batch1", None)
    lines = []
    if prof:
        lines += ["", "decode step, ms per component (module hooks; they add ~1 ms)"]
        for name, p in prof.items():
            comp = ", ".join(f"{k} {v:.1f}" for k, v in p["components_ms_per_step"].items())
            lines.append(f"  {name}: {comp}")
            if "top_ops" in p:
                lines.append("    top ops: " + ", ".join(f"{o['op']} {o['self_ms_per_step']:.1f}"
                                                       for o in p["top_ops"][:6]))
    if alone:
        lines.append("  the batch-1 step's matrix products run alone: " +
                     ", ".join(f"{name} {ms:.1f} ms" for name, ms in alone.items()))
    return lines


def main(argv=None) -> None:
    args = finish_args(parser(__doc__, OPTIONS).parse_args(argv))
    res, cfg, tok, quiet = setup(args, "profile_step")
    tf = load_transformers(args, res)
    ours = build_ours_pair(cfg, args)
    res["profile"] = section(args, cfg, ours, tok, build_hf_models(tf, cfg, args, ("kimi_linear",)))
    finish(res, args, quiet, [summary_lines])


if __name__ == "__main__":
    main()
