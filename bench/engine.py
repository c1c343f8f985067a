"""Horizon's engine against same-size `transformers` models: decode speed, long-context decode, prefix reuse.

Everything is measured in one process and reported as ratios against baselines from the same run
(these machines are shared and noisy: measurements are interleaved and repeated, medians reported).

1. decode: tokens/s of `Engine.generate`-style serving of the `small` preset (all 12 layers) in fp32 and
   bf16, at batch 1 and 16 concurrent sequences (greedy, ignore_eos, a fixed prompt and output length),
   against transformers' `kimi_linear` (KDA + MLA + MoE) and `glm5_next` (KDA + DSA + MoE) built with
   the same sizes (fp32, CPU, pure-PyTorch paths: fla / triton / causal_conv1d imports are blocked),
   run through `model.generate(do_sample=False, min_new_tokens=max_new_tokens=N)` with their own cache.
   Decode speed excludes prefill: tokens after each sequence's first one, divided by the time from the
   moment every sequence has its first token to the last token. Rounds cycle through the models, so
   every model sees the same machine load. Keys `ratio_vs_<family>_batch<B>` compare our fp32 engine
   with theirs (fp32), `..._bf16` our bf16 engine. The weight-streaming floor (active weight bytes /
   measured matrix-vector bandwidth) puts batch-1 numbers in perspective.
2. context: decode ms/token of the engine at growing contexts with sparse selection (index_topk 2048)
   against dense attention over the same weights and cache (every indexer's topk raised above the
   context). The prompt is prefilled once per context (densely, which is faster; a decode step's cost
   depends on the context length, not on the cached values), then decode steps alternate
   sparse / dense / dense / sparse ... on that sequence.
3. ttft: time to first token of a second turn after a long history: turn 1 is a long prompt plus a
   few generated tokens; turn 2's prompt extends it by ~32 tokens. Measured on the engine that served
   turn 1 (prefix cache hit, usage.cached_tokens checked) and on a second engine whose prefix cache is
   cleared before each request (everything recomputed); interleaved, repeated.
4. constrained: ms per generated token with a JSON-schema constraint (llguidance masks) against the same
   prompts, sampling and token counts without it, at each batch size; keys
   `constrained_overhead_ms_per_token_batch<B>` and `constrained_ratio_batch<B>`.
5. profile: where a decode step of ours goes (per component, from module hooks, and the top aten ops
   from torch.profiler), beside transformers' kimi_linear per component. Runs by default when
   ratio_vs_kimi_linear_batch1 is below the issue's goal (4x).

    python bench/engine.py                    # default run, ~5-8 minutes on 2 CPU cores
    python bench/engine.py --quick --json     # tiny sizes, under a minute (a smoke run)
    python bench/engine.py --long             # adds 32K and 64K contexts
    python bench/engine.py --sections decode --repeats 5 --batches 1 4 16

Prints progress on stderr; on stdout a readable summary (unless --json) and, on the last line, one
JSON object with everything.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.abc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

from horizon import ModelConfig
from horizon.chat import load_tokenizer
from horizon.engine import ConstraintSpec, Engine, EngineConfig, FinishEvent, Request, SamplingParams, TokenEvent
from horizon.model import HorizonForCausalLM
from horizon.model.dsa import GatedDSA
from horizon.model.moe import Experts

GOAL_BATCH1 = 4.0  # the target: ours / transformers decode tokens/s at batch 1
HF_FAMILIES = ("kimi_linear", "glm5_next")
_request_ids = itertools.count()


def log(msg: str) -> None:
    print(f"[bench/engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs):
    return statistics.median(xs) if xs else None


# --- the machine -------------------------------------------------------------------------------------
def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), cpu)
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()}


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall s, CPU s every process used, CPU s this process used); None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait (steal included: also not ours)
    t = os.times()
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), t.user + t.system


def others_cores(start) -> float | None:
    """Cores that other processes (and the hypervisor) kept busy since `start`. The counters tick in
    jiffies (10 ms): two ticks are forgiven, so a short window does not read one stray tick as contention."""
    end = cpu_snapshot()
    if start is None or end is None:
        return None
    others = (end[1] - start[1]) - (end[2] - start[2]) - 2 / os.sysconf("SC_CLK_TCK")
    return max(0.0, others) / max(end[0] - start[0], 1e-9)


class Quiet:
    """Measurements on a shared machine. Each one records the cores other processes took meanwhile; one that
    shared the machine (our threads then wait for descheduled OpenMP workers: steps get many times slower)
    is measured again once the others are idle, up to `retries` times and `max_wait` seconds in all."""

    def __init__(self, threshold: float, retries: int, max_wait: float):
        self.threshold, self.retries, self.max_wait = threshold, retries, max_wait
        self.waited = 0.0
        self.remeasured = 0
        self.contended: list[str] = []  # measurements kept although others were busy

    def run(self, what: str, fn):
        """fn() -> dict; returns it with "others_cores" added."""
        for attempt in range(self.retries + 1):
            start = cpu_snapshot()
            out = fn()
            others = others_cores(start)
            out["others_cores"] = others
            if others is None or others <= self.threshold:
                return out
            if attempt == self.retries or not self.wait():
                self.contended.append(f"{what} (others used {others:.2f} cores)")
                return out
            self.remeasured += 1
            log(f"{what}: other processes used {others:.2f} cores meanwhile; measured again")
        raise AssertionError("unreachable")

    def wait(self) -> bool:
        """Sleep until other processes leave the cores idle for 2 s; False when the waiting budget is spent."""
        if self.waited >= self.max_wait:
            return False
        log(f"waiting for other processes to go idle (budget left {self.max_wait - self.waited:.0f} s)")
        while self.waited < self.max_wait:
            start = cpu_snapshot()
            time.sleep(2.0)
            self.waited += 2.0
            others = others_cores(start)
            if others is None or others <= self.threshold:
                return True
        return False

    def report(self) -> dict:
        return {"threshold_cores": self.threshold, "remeasured": self.remeasured, "waited_s": self.waited,
                "kept_contended": self.contended}


def linear_times(x: torch.Tensor, w: torch.Tensor, runs: int, warmup: int = 2) -> list[float]:
    """Seconds of each of `runs` F.linear(x, w) calls after `warmup` untimed ones."""
    times = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def gemv_bandwidth(dtype: torch.dtype, mbytes: int = 256) -> float:
    """GB/s that a [1, K] x [K, N] product streams weights at (a batch-1 decode step's main cost)."""
    k = 4096
    w = torch.randn(mbytes * 2**20 // (4 * k), k).to(dtype)
    x = torch.randn(1, k).to(dtype)
    return w.nbytes / min(linear_times(x, w, 6)) / 1e9


def active_weight_bytes(model: HorizonForCausalLM) -> int:
    """Weight bytes a batch-1 decode step reads: everything but the embedding table (one row) and the
    routed experts, plus num_experts_per_tok / n_routed_experts of each routed-expert stack."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if (name == "embed.weight" and not cfg.tie_word_embeddings) or name.startswith("vision."):
            continue  # one embedding row per step; the vision encoder runs per image, not per token
        frac = cfg.num_experts_per_tok / cfg.n_routed_experts if ".experts." in name else 1.0
        total += int(p.numel() * p.element_size() * frac)
    return total


# --- our model and engine ----------------------------------------------------------------------------
def build_ours(cfg: ModelConfig, dtype: str, seed: int, like: HorizonForCausalLM | None = None) -> HorizonForCausalLM:
    """The model in `dtype`; with `like`, the same weights as that model (rounded to dtype)."""
    cfg = cfg.replace(dtype=dtype)
    if like is None:
        torch.manual_seed(seed)
        return HorizonForCausalLM(cfg).eval()
    model = HorizonForCausalLM(cfg, init=False)
    model.load_state_dict(like.state_dict())
    model.reset_runtime_state()
    return model.eval()


def set_topk(model: HorizonForCausalLM, k: int) -> None:
    for m in model.modules():
        if isinstance(m, GatedDSA) and m.indexer is not None:
            m.indexer.topk = k


class Recorder:
    """Collects an engine's events: a timestamp per generated token, the finish event per request."""

    def __init__(self):
        self.stamps: dict[str, list[float]] = defaultdict(list)
        self.ids: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, FinishEvent] = {}

    def __call__(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.stamps[event.request_id].append(time.perf_counter())
            self.ids[event.request_id].append(event.token_id)
        elif isinstance(event, FinishEvent):
            self.finish[event.request_id] = event


def submit(engine: Engine, prompt: list[int], max_tokens: int, rec: Recorder) -> str:
    rid = f"bench-{next(_request_ids)}"
    engine.submit(Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                          request_id=rid), rec)
    return rid


def decode_rate(t_start: float, stamps: list[list[float]]) -> dict:
    """Decode speed from per-token timestamps: the window opens when every sequence has its first token."""
    first = max(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    tokens = sum(sum(t > first for t in s) for s in stamps)
    window = max(last - first, 1e-9)
    return {"prefill_s": first - t_start, "decode_s": window, "decode_tokens": tokens,
            "tok_per_s": tokens / window, "ms_per_step": 1000 * window / max(1, max(len(s) for s in stamps) - 1)}


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    rec = Recorder()
    t0 = time.perf_counter()
    rids = [submit(engine, p, new_tokens, rec) for p in prompts]
    engine.run_until_idle()
    assert all(rec.finish[r].reason == "length" and len(rec.stamps[r]) == new_tokens for r in rids), rec.finish
    engine.clear_prefix_cache()  # the next run must not resume from these
    return decode_rate(t0, [rec.stamps[r] for r in rids])


# --- transformers ------------------------------------------------------------------------------------
class BlockImports(importlib.abc.MetaPathFinder):
    """Imports of these top-level packages fail (transformers then runs its pure-PyTorch code)."""

    def __init__(self, *names: str):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ImportError(f"blocked by bench/engine.py: {name}")
        return None


def import_transformers():
    """transformers with flash-linear-attention, triton and causal_conv1d blocked for the rest of the process."""
    sys.meta_path.insert(0, BlockImports("fla", "triton", "causal_conv1d"))
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def hf_common(c: ModelConfig) -> dict:
    """transformers config fields shared by kimi_linear and glm5_next, from our config."""
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_heads, kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank or None, v_head_dim=c.v_head_dim, n_shared_experts=c.n_shared_experts,
        num_experts_per_tok=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
        routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob,
        mlp_layer_types=["dense" if i in (c.dense_layers or range(c.first_k_dense)) else "sparse"
                         for i in range(c.num_layers)],
        linear_head_dim=c.kda_head_dim, linear_num_heads=c.kda_num_heads, linear_conv_kernel_dim=c.kda_conv_size,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def build_hf(tf, family: str, c: ModelConfig, attn: str, hc_mult: int, seed: int):
    torch.manual_seed(seed)
    if family == "kimi_linear":
        config = tf.KimiLinearConfig(
            **hf_common(c), qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
            num_local_experts=c.n_routed_experts,
            layer_types=["linear_attention" if t == "kda" else "full_attention" for t in c.layer_types])
        cls = tf.KimiLinearForCausalLM
    else:
        # glm5_next's DSA is NoPE-only (qk_rope_head_dim must be 0): the whole q.k width goes to the nope part
        text = dict(**hf_common(c), qk_nope_head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim, qk_rope_head_dim=0,
                    n_routed_experts=c.n_routed_experts, index_topk=c.index_topk, index_head_dim=c.index_head_dim,
                    index_n_heads=c.index_n_heads, indexer_types=["full"] * c.num_layers, hc_mult=hc_mult,
                    layer_types=["linear_attention" if t == "kda" else "indexed_attention" for t in c.layer_types])
        # the smallest vision tower it accepts: it is built but never runs (text-only prompts)
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=c.hidden_size,
                      projection_intermediate_size=32)
        config = tf.Glm5NextConfig(text_config=text, vision_config=vision)
        cls = tf.Glm5NextForConditionalGeneration
    model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    text_cfg = getattr(model.config, "text_config", model.config)
    vision_params = sum(p.numel() for n, p in model.named_parameters() if ".visual." in n)
    info = {"class": cls.__name__, "attn_implementation": model.config._attn_implementation,
            "experts_implementation": text_cfg._experts_implementation,
            "parameters": sum(p.numel() for p in model.parameters()) - vision_params,
            "vision_parameters_unused": vision_params}
    return model, info


class Stamps:
    """A generate() streamer that only records when each put() happens (the prompt, then each new token)."""

    def __init__(self, on_put=None):
        self.times: list[float] = []
        self.on_put = on_put

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if self.on_put:
            self.on_put(len(self.times))

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], new_tokens: int, on_put=None) -> dict:
    ids = torch.tensor(prompts)
    streamer = Stamps(on_put)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, streamer=streamer, pad_token_id=0)
    assert out.shape == (len(prompts), ids.shape[1] + new_tokens), out.shape
    t = streamer.times  # t[0]: the prompt is put before prefill; t[i]: token i
    return decode_rate(t0, [t[1:]] * len(prompts))


# --- 1. decode ---------------------------------------------------------------------------------------
def decode_section(args, cfg: ModelConfig, ours: dict, tok, hf: dict, quiet: Quiet) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, min(cfg.vocab_size, tok.vocab_size), (max(args.batches), args.prompt),
                            generator=gen).tolist()
    runners = {}
    for name, model in ours.items():
        engine = Engine(model, tok, EngineConfig(
            max_num_seqs=max(args.batches), max_model_len=args.prompt + args.new_tokens,
            # every prompt prefills in one forward, so the sequences decode in lockstep (as generate does)
            max_batch_tokens=max(512, max(args.batches) * args.prompt)))
        runners[name] = (engine, run_ours)
    hf_info = {}
    for family, (model, info) in hf.items():
        runners[family], hf_info[family] = (model, run_hf), info
    log("warm-up: one short run per model")
    for obj, run in runners.values():
        run(obj, prompts[:2], 3)
    runs: dict[str, dict[int, list[dict]]] = {name: defaultdict(list) for name in runners}
    for r in range(args.repeats):
        for batch in args.batches:
            for name, (obj, run) in runners.items():
                res = quiet.run(f"round {r + 1} batch {batch} {name}",
                                lambda obj=obj, run=run, batch=batch: run(obj, prompts[:batch], args.new_tokens))
                runs[name][batch].append(res)
                log(f"round {r + 1}/{args.repeats} batch {batch:>2} {name:<12} {res['tok_per_s']:8.1f} tok/s "
                    f"({res['ms_per_step']:.1f} ms/step, prefill {res['prefill_s']:.2f} s)")
    table = {name: {str(b): {"tok_per_s": median([x["tok_per_s"] for x in rs]),
                             "ms_per_step": median([x["ms_per_step"] for x in rs]),
                             "prefill_s": median([x["prefill_s"] for x in rs]),
                             "tok_per_s_runs": [x["tok_per_s"] for x in rs],
                             "others_cores_runs": [x["others_cores"] for x in rs]}
                     for b, rs in by_batch.items()}
             for name, by_batch in runs.items()}
    ratios = {}
    for family in hf_info:
        for b in args.batches:
            for ours_name, suffix in (("ours_fp32", ""), ("ours_bf16", "_bf16")):
                theirs = table[family][str(b)]["tok_per_s"]
                ratios[f"ratio_vs_{family}_batch{b}{suffix}"] = table[ours_name][str(b)]["tok_per_s"] / theirs
                paired = [o["tok_per_s"] / t["tok_per_s"] for o, t in zip(runs[ours_name][b], runs[family][b],
                                                                          strict=True)]
                ratios[f"paired_ratios_vs_{family}_batch{b}{suffix}"] = [round(x, 3) for x in paired]
    floors = {}
    for name, model in ours.items():
        nbytes = active_weight_bytes(model)
        bw = gemv_bandwidth(model.embed.weight.dtype)
        floors[name] = {"active_weight_bytes": nbytes, "gemv_GBps": round(bw, 2),
                        "weight_stream_floor_ms": 1000 * nbytes / (bw * 1e9),
                        "ceiling_tok_per_s_batch1": bw * 1e9 / nbytes}
    return {"table": table, "ratios": ratios, "transformers_models": hf_info,
            "batch1_floor": floors, "prompt": args.prompt, "new_tokens": args.new_tokens}


# --- 2. decode vs context ----------------------------------------------------------------------------
def context_section(args, model: HorizonForCausalLM, tok, quiet: Quiet) -> list[dict]:
    cfg = model.config
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    steps = args.context_steps
    for L in args.contexts:
        profile = L == max(args.contexts) and args.profile != "never"
        max_tokens = 2 * (steps + 1) * (quiet.retries + 1) + (2 * args.profile_steps if profile else 0) + 1
        engine = Engine(model, tok, EngineConfig(max_num_seqs=1, max_model_len=L + max_tokens,
                                                 max_batch_tokens=L))  # the prompt in one forward
        prompt = torch.randint(0, min(cfg.vocab_size, tok.vocab_size), (L,), generator=gen).tolist()
        dense_k = L + max_tokens + 1
        set_topk(model, dense_k)
        rec = Recorder()
        rid = submit(engine, prompt, max_tokens, rec)
        t0 = time.perf_counter()
        while not rec.stamps[rid]:
            engine.step()
        prefill = time.perf_counter() - t0

        def timed_steps(engine=engine, dense_k=dense_k) -> dict:
            times = {"sparse": [], "dense": []}
            for i in range(steps + 1):  # the first pair warms up
                for mode in (("sparse", "dense") if i % 2 == 0 else ("dense", "sparse")):
                    set_topk(model, cfg.index_topk if mode == "sparse" else dense_k)
                    t0 = time.perf_counter()
                    engine.step()
                    if i:
                        times[mode].append(1000 * (time.perf_counter() - t0))
            return times

        times = quiet.run(f"context {L}", timed_steps)
        ops = {}
        if profile:  # where a long-context decode step goes, in each mode
            for mode, k in (("sparse", cfg.index_topk), ("dense", dense_k)):
                set_topk(model, k)
                ops[mode] = top_ops(engine.step, args.profile_steps, n=8)
        set_topk(model, cfg.index_topk)
        engine.cancel(rid)
        engine.run_until_idle()
        row = {"context": L, "index_topk": cfg.index_topk, "prefill_dense_s": prefill,
               "decode_ms_sparse": median(times["sparse"]), "decode_ms_dense": median(times["dense"]),
               "steps_ms_sparse": times["sparse"], "steps_ms_dense": times["dense"],
               "others_cores": times["others_cores"]}
        if ops:
            row["top_ops"] = ops
        row["decode_speedup"] = row["decode_ms_dense"] / row["decode_ms_sparse"]
        log(f"context {L:>6}: decode {row['decode_ms_sparse']:.1f} ms sparse / {row['decode_ms_dense']:.1f} ms dense "
            f"(prefill {prefill:.1f} s)")
        rows.append(row)
        del engine
        gc.collect()
    return rows


# --- 3. TTFT of a second turn ------------------------------------------------------------------------
def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds from submit to the first token, usage.cached_tokens, the reply) for a one-token reply."""
    rec = Recorder()
    t0 = time.perf_counter()
    rid = submit(engine, prompt, 1, rec)
    engine.run_until_idle()
    return rec.stamps[rid][0] - t0, rec.finish[rid].usage.cached_tokens, rec.ids[rid]


def ttft_section(args, model: HorizonForCausalLM, tok, quiet: Quiet) -> dict:
    """A conversation: turn 1 = the history + a few generated tokens; each later turn is everything so far +
    the reply + `turn2_new` new tokens, timed on the engine that served the earlier turns (its prefix cache
    holds them) and on a second engine with its prefix cache cleared (everything recomputed)."""
    vocab = min(model.config.vocab_size, tok.vocab_size)
    gen = torch.Generator().manual_seed(args.seed + 2)
    prompt = torch.randint(0, vocab, (args.history,), generator=gen).tolist()
    turns = args.ttft_repeats * (quiet.retries + 1)
    config = EngineConfig(max_model_len=args.history + args.turn1_tokens + turns * (args.turn2_new + 1) + 64)
    warm, cold = Engine(model, tok, config), Engine(model, tok, EngineConfig(**vars(config)))
    log(f"ttft: turn 1 ({args.history} prompt tokens + {args.turn1_tokens} generated)")
    rec = Recorder()
    t0 = time.perf_counter()
    rid = submit(warm, prompt, args.turn1_tokens, rec)
    warm.run_until_idle()
    turn1_s = time.perf_counter() - t0
    talk = {"prompt": prompt, "reply": rec.ids[rid]}
    ttft(cold, torch.randint(0, vocab, (min(args.history, 1024),), generator=gen).tolist())  # warm-up

    def next_turn() -> dict:  # a retry moves on to the turn after (the cache now holds this one)
        expected = len(talk["prompt"]) + len(talk["reply"]) - 1  # all but the reply's last token are cached
        talk["prompt"] = talk["prompt"] + talk["reply"] + torch.randint(0, vocab, (args.turn2_new,),
                                                                        generator=gen).tolist()
        s, n, talk["reply"] = ttft(warm, talk["prompt"])
        return {"ms": 1000 * s, "cached": n, "expected": expected, "prompt_tokens": len(talk["prompt"])}

    def recompute() -> dict:
        cold.clear_prefix_cache()
        s, n, _ = ttft(cold, talk["prompt"])
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


# --- 4. constrained decoding ------------------------------------------------------------------------
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


def constrained_section(args, model: HorizonForCausalLM, tok, quiet: Quiet) -> dict:
    """Per-token cost of a JSON-schema constraint: B requests under the constraint (seeded sampling, so the
    random model writes varied values until the grammar closes the object), then the same prompts and
    sampling without it, each request held to the token count its constrained twin produced (ignore_eos).
    Both runs then make the same forwards with the same batch composition at every step; what differs
    is the grammar (mask computation, matcher advance, closing preference)."""
    vocab = min(model.config.vocab_size, tok.vocab_size)
    gen = torch.Generator().manual_seed(args.seed + 3)
    prompts = torch.randint(0, vocab, (max(args.batches), args.prompt), generator=gen).tolist()
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
            rid = f"bench-{next(_request_ids)}"
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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# --- 5. profile --------------------------------------------------------------------------------------
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


def top_ops(step, steps: int, n: int = 12) -> list[dict]:
    """The n aten ops with the most self CPU time over `steps` calls of step() (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in ops)
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps, "calls_per_step": e.count / steps,
             "share": e.self_cpu_time_total / total_us} for e in ops[:n]]


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
    vocab = min(model.config.vocab_size, tok.vocab_size)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed)).tolist()
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


def profile_section(args, cfg: ModelConfig, ours: dict, tok, hf: dict) -> dict:
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
        prompts = torch.randint(0, min(cfg.vocab_size, tok.vocab_size), (1, args.prompt),
                                generator=torch.Generator().manual_seed(args.seed)).tolist()
        run_hf(model, prompts, 3)  # warm-up
        out["kimi_linear_batch1"] = profile_hf(model, prompts, args.profile_steps)
    return out


# --- what differs ------------------------------------------------------------------------------------
DIFFERENCES = {
    "common": [
        "same hidden size, layer count and KDA / attention schedule, heads, MLA ranks, dense and expert widths, "
        "experts (routed, per token, shared, groups), vocabulary; random weights (not the same values: speed does "
        "not depend on them, and routing is near-uniform on both sides)",
        "transformers runs its pure-PyTorch paths (fla, triton, causal_conv1d blocked), fp32, through generate() "
        "with its own cache (DynamicCache); ours runs through the engine (scheduler, sampler, stream parser, "
        "events), which generate() does not have to do",
        "their MLA decode re-expands every cached latent with kv_b_proj each step; ours attends to the latent "
        "directly (absorbed)",
    ],
    "kimi_linear": [
        "full-attention layers are plain MLA: no lightning indexer and no output gate (ours: Gated DSA; at these "
        "contexts, below index_topk, ours skips the indexer's selection but still computes and caches its keys)",
    ],
    "glm5_next": [
        "DSA is NoPE-only: qk_rope_head_dim 0, so qk_nope_head_dim = ours nope + rope (same q.k width and "
        "softmax scale; its latent row is kv_lora_rank wide, ours kv_lora_rank + rope)",
        "hyper-connections (hc_mult streams, Sinkhorn-normalised mixing, 2 per layer); hc_mult as --glm5-hc-mult "
        "(default 1: one residual stream of our width; the real model uses 4)",
        "its indexer scores pools of index_kpool=16 tokens and always runs (also below index_topk), then attends "
        "through a dense [q, kv] mask; ours scores single tokens and skips selection below index_topk",
        "SwiGLU clamp (swiglu_limit 10) and a lower-bounded KDA forget gate",
        "a vision tower (1 block, ~0.4M parameters) is built by Glm5NextForConditionalGeneration but never runs",
    ],
}


# --- output ------------------------------------------------------------------------------------------
def fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def rounded(x):
    """Floats to 4 significant digits (timings are not more precise than that), recursively."""
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x


def summary(res: dict) -> str:
    lines = [f"bench/engine.py on {res['machine']['cpu']} ({res['machine']['threads']} threads, torch "
             f"{res['machine']['torch']}, transformers {res['machine'].get('transformers', '-')}), preset "
             f"{res['settings']['preset']}"]
    dec = res.get("decode")
    if dec:
        lines += ["", f"decode tokens/s (prompt {dec['prompt']}, {dec['new_tokens']} new tokens, median of "
                      f"{res['settings']['repeats']}; prefill excluded)"]
        batches = list(next(iter(dec["table"].values())).keys())
        lines.append(f"  {'model':<14}" + "".join(f"{'batch ' + b:>14}" for b in batches))
        for name, row in dec["table"].items():
            lines.append(f"  {name:<14}" + "".join(f"{fmt(row[b]['tok_per_s']):>14}" for b in batches))
        for k, v in res.items():
            if k.startswith("ratio_vs_"):
                lines.append(f"  {k:<40} {v:.2f}")
        for name, f in dec["batch1_floor"].items():
            lines.append(f"  {name}: batch-1 weight-streaming floor {f['weight_stream_floor_ms']:.1f} ms/token "
                         f"({f['active_weight_bytes'] / 1e6:.0f} MB at {f['gemv_GBps']} GB/s) = "
                         f"{f['ceiling_tok_per_s_batch1']:.1f} tok/s")
    if res.get("context"):
        lines += ["", "decode ms/token vs context (sparse index_topk vs dense, same weights and cache)"]
        lines.append(f"  {'context':>8} {'sparse':>8} {'dense':>8} {'dense/sparse':>13}")
        for r in res["context"]:
            lines.append(f"  {r['context']:>8} {fmt(r['decode_ms_sparse']):>8} {fmt(r['decode_ms_dense']):>8} "
                         f"{fmt(r['decode_speedup'], 2):>13}")
    t = res.get("ttft")
    if t:
        lines += ["", f"next-turn TTFT after {t['history_tokens']} tokens (+{t['new_tokens_per_turn']} new): "
                      f"{t['ttft_ms_prefix_reuse']:.0f} ms with prefix reuse (cached {t['cached_tokens']}) vs "
                      f"{t['ttft_ms_recompute']:.0f} ms recomputed: {t['speedup']:.1f}x"]
    con = res.get("constrained")
    if con:
        lines += ["", f"constrained decoding (JSON schema, llguidance; compile {con['compile_ms']:.0f} ms once per "
                      f"schema), ms per generated token, same tokens and batches without the constraint"]
        for k, v in con.items():
            if k.startswith("batch"):
                lines.append(f"  {k:<8} {v['ms_per_token_constrained']:.2f} vs {v['ms_per_token_unconstrained']:.2f}: "
                             f"+{v['overhead_ms_per_token']:.2f} ms/token ({v['ratio']:.3f}x)")
    prof = dict(res.get("profile") or {})
    alone = prof.pop("linears_alone_ms_per_step_batch1", None)
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
    for r in res.get("context") or []:
        for mode, ops in r.get("top_ops", {}).items():
            lines.append(f"  {mode} decode at {r['context']}: " +
                         ", ".join(f"{o['op']} {o['self_ms_per_step']:.1f}" for o in ops[:6]))
    if res.get("notes"):
        lines += ["", *("note: " + n for n in res["notes"])]
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in under a minute")
    ap.add_argument("--json", action="store_true", help="print only the JSON object (progress still on stderr)")
    ap.add_argument("--sections", nargs="+", default=["decode", "constrained", "context", "ttft", "profile"],
                    choices=["decode", "context", "ttft", "profile", "constrained"])
    ap.add_argument("--preset", default=None, help="model size (default: small; tiny with --quick)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (keeps its schedule rule)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="decode rounds (default 3; 2 with --quick)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; 16 with --quick)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 32; 8 with --quick)")
    ap.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--glm5-hc-mult", type=int, default=1, help="glm5_next hyper-connection streams (real model: 4)")
    ap.add_argument("--no-transformers", action="store_true", help="only our engine")
    ap.add_argument("--dtype", default=None, help="context / ttft dtype (default: the preset's)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 1024 4096 16384")
    ap.add_argument("--long", action="store_true", help="add 32768 and 65536 to the contexts")
    ap.add_argument("--context-steps", type=int, default=8, help="timed decode steps per mode and context")
    ap.add_argument("--history", type=int, default=None, help="turn-1 prompt tokens (default 8192)")
    ap.add_argument("--turn1-tokens", type=int, default=4)
    ap.add_argument("--turn2-new", type=int, default=32)
    ap.add_argument("--ttft-repeats", type=int, default=2)
    ap.add_argument("--constrained-tokens", type=int, default=None,
                    help="max tokens of a constrained reply (default 96; 48 with --quick)")
    ap.add_argument("--profile", default="auto", choices=["auto", "always", "never"],
                    help=f"auto: when ratio_vs_kimi_linear_batch1 < {GOAL_BATCH1:g}")
    ap.add_argument("--profile-batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--quiet-threshold", type=float, default=0.25,
                    help="cores other processes may use during a measurement before it is measured again")
    ap.add_argument("--retries", type=int, default=None,
                    help="re-measurements of one contended measurement (default 1; 0 with --quick)")
    ap.add_argument("--max-wait", type=float, default=300, help="seconds in all to wait for other processes")
    args = ap.parse_args(argv)
    q = args.quick
    args.preset = args.preset or ("tiny" if q else "small")
    args.repeats = args.repeats or (2 if q else 3)
    args.prompt = args.prompt or (16 if q else 128)
    args.new_tokens = args.new_tokens or (8 if q else 32)
    args.contexts = args.contexts or ([64, 256] if q else [1024, 4096, 16384])
    if args.long:
        args.contexts = sorted({*args.contexts, 32768, 65536})
    args.history = args.history or (256 if q else 8192)
    args.constrained_tokens = args.constrained_tokens or (48 if q else 96)
    args.retries = args.retries if args.retries is not None else (0 if q else 1)
    if q:
        args.context_steps, args.profile_steps, args.ttft_repeats = 3, 3, 2
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet = Quiet(args.quiet_threshold, args.retries, args.max_wait)
    res: dict = {"bench": "engine", "quick": args.quick, "machine": machine_info(), "goal_batch1": GOAL_BATCH1}
    cfg = ModelConfig.preset(args.preset)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, layer_types=None)
    need = max(args.contexts) + 64 if "context" in args.sections else 0
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, need))
    long_dtype = args.dtype or cfg.dtype
    res["settings"] = {"preset": args.preset, "layers": cfg.num_layers, "layer_types": cfg.layer_types,
                       "repeats": args.repeats, "batches": args.batches, "prompt": args.prompt,
                       "new_tokens": args.new_tokens, "decode_dtypes": {"ours": ["float32", "bfloat16"],
                                                                        "transformers": "float32"},
                       "context_and_ttft_dtype": long_dtype, "hf_attn": args.hf_attn,
                       "glm5_hc_mult": args.glm5_hc_mult, "greedy": True, "ignore_eos": True}
    res["notes"] = []
    if args.layers:
        res["notes"].append(f"layers reduced to {cfg.num_layers} (the preset has more)")
    tok = load_tokenizer()
    tf = None
    if not args.no_transformers and ({"decode", "profile"} & set(args.sections)):
        try:
            tf = import_transformers()
            res["machine"]["transformers"] = tf.__version__
        except ImportError as e:
            res["notes"].append(f"transformers unavailable ({e}): only our engine is measured")
    log(f"building {args.preset} ({cfg.num_layers} layers) in float32 and bfloat16")
    t0 = time.perf_counter()
    ours = {"ours_fp32": build_ours(cfg, "float32", args.seed)}
    ours["ours_bf16"] = build_ours(cfg, "bfloat16", args.seed, like=ours["ours_fp32"])
    hf = {}
    for family in HF_FAMILIES if tf is not None else ():
        log(f"building transformers {family}")
        hf[family] = build_hf(tf, family, cfg, args.hf_attn, args.glm5_hc_mult, args.seed)
    log(f"built in {time.perf_counter() - t0:.1f} s")
    if "decode" in args.sections:
        dec = decode_section(args, cfg, ours, tok, hf, quiet)
        log(f"decode: {json.dumps(rounded(dec['ratios']))}")
        res.update(dec.pop("ratios"))
        res["decode"] = dec
        res["differences"] = DIFFERENCES if tf is not None else None
        gc.collect()
    if "constrained" in args.sections:
        con = constrained_section(args, ours["ours_fp32"], tok, quiet)
        for b in args.batches:
            res[f"constrained_overhead_ms_per_token_batch{b}"] = con[f"batch{b}"]["overhead_ms_per_token"]
            res[f"constrained_ratio_batch{b}"] = con[f"batch{b}"]["ratio"]
        res["constrained"] = con
    below = res.get("ratio_vs_kimi_linear_batch1", 0.0) < GOAL_BATCH1
    if "profile" in args.sections and (args.profile == "always" or (args.profile == "auto" and below)):
        res["profile"] = profile_section(args, cfg, ours, tok, hf)
        log(f"profile: {json.dumps(rounded(res['profile']))}")
    del hf
    gc.collect()
    long_model = ours["ours_bf16" if long_dtype == "bfloat16" else "ours_fp32"]
    if long_dtype not in ("bfloat16", "float32"):
        long_model = build_ours(cfg, long_dtype, args.seed, like=ours["ours_fp32"])
    for name in [n for n in ours if ours[n] is not long_model]:
        del ours[name]
    gc.collect()
    if "context" in args.sections:
        res["context"] = context_section(args, long_model, tok, quiet)
        log(f"context: {json.dumps(rounded(res['context']))}")
    if "ttft" in args.sections:
        res["ttft"] = ttft_section(args, long_model, tok, quiet)
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["shared_machine"] = quiet.report()
    if quiet.contended:
        res["notes"].append(f"{len(quiet.contended)} measurement(s) ran while other processes took the cores "
                            f"(see shared_machine.kept_contended): compare the paired ratios per round")
    if not args.json:
        print(summary(res))
    print(json.dumps(rounded(res), default=str))


if __name__ == "__main__":
    main()
