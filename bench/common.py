"""What the bench/ scripts share: machine info and quiet-machine waiting, logging, medians, random prompts
of ordinary tokens, our model and engine runners, same-size `transformers` models (with fla / triton /
causal_conv1d blocked), the command-line options and the JSON / summary output. Not a benchmark itself.

The scripts run as `python bench/<name>.py` from the repository root; Python then puts bench/ first on
sys.path, so every script imports this module as `from common import ...` (bench/ is not a package).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from pathlib import Path

import torch

import horizon.model.dsa as dsa
from horizon import ModelConfig
from horizon.chat import load_tokenizer
from horizon.engine import Engine, FinishEvent, Request, SamplingParams, TokenEvent
from horizon.model import HorizonCache, HorizonForCausalLM
from horizon.model.dsa import GatedDSA
from horizon.quant.kernels import kernel_available

GOAL_BATCH1 = 4.0  # the target: ours / transformers decode tokens/s at batch 1
HF_FAMILIES = ("kimi_linear", "glm5_next")
_request_ids = itertools.count()


def log(msg: str) -> None:
    print(f"[bench/{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def top_ops(step, steps: int, n: int = 12) -> list[dict]:
    """The n aten ops with the most self CPU time over `steps` calls of step() (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in ops)
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps, "calls_per_step": e.count / steps,
             "share": e.self_cpu_time_total / total_us} for e in ops[:n]]


# --- prompts -----------------------------------------------------------------------------------------
@functools.cache
def ordinary_ids(tok, vocab_size: int) -> torch.Tensor:
    """The ids below `vocab_size` that stand for bytes: every special token (chat roles, the image
    placeholder, thinking tiers, reserved slots) left out, since the engine treats those in a prompt
    as what they mean (an image placeholder with no image is refused)."""
    ids = [i for i in range(min(vocab_size, tok.vocab_size)) if tok.token_bytes(i) is not None]
    return torch.tensor(ids)


def random_tokens(tok, vocab_size: int, shape: tuple[int, ...], gen: torch.Generator) -> list:
    """Random ordinary token ids of `shape` (nested lists, as torch.randint(...).tolist() gives)."""
    ids = ordinary_ids(tok, vocab_size)
    return ids[torch.randint(0, len(ids), shape, generator=gen)].tolist()


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


FORMATS = ("fp32", "bf16", "mxfp4", "mxfp4-bf16", "mxfp4-int8", "mxfp4-q8", "mxfp4-bf16-q8")


def build_ours_pair(cfg: ModelConfig, args) -> dict[str, HorizonForCausalLM]:
    """{"ours_fp32", "ours_bf16"}: the preset in float32, and the same weights rounded to bfloat16; with
    --formats also "ours_mxfp4" (the fp32 model's routed experts as MXFP4, the shipped format) and
    "ours_mxfp4_int8" (that, with every dense projection int8), "ours_mxfp4_q8" (MXFP4 experts that take int8
    activations, `mxfp4_activations="int8"`), "ours_mxfp4_bf16" (the bf16 model's routed experts as MXFP4:
    what quantising the `small` preset as configured, in bf16, gives) and "ours_mxfp4_bf16_q8" (that, with int8
    activations into the experts)."""
    from horizon.quant import quantize_dense_int8, quantize_model, set_int8_activations

    formats = getattr(args, "formats", None) or (list(FORMATS) if hasattr(args, "formats") else ["fp32", "bf16"])
    formats = ["fp32"] + [f for f in formats if f != "fp32"]  # the others are built from it (and bench/engine needs it)
    log(f"building {args.preset} ({cfg.num_layers} layers): {', '.join(formats)}")
    fp32 = build_ours(cfg, "float32", args.seed)
    ours = {}
    for name in formats:
        if name == "fp32":
            ours["ours_fp32"] = fp32
        elif name == "bf16":
            ours["ours_bf16"] = build_ours(cfg, "bfloat16", args.seed, like=fp32)
        else:
            dtype = "bfloat16" if name.startswith("mxfp4-bf16") else "float32"
            model = quantize_model(build_ours(cfg, dtype, args.seed, like=fp32))
            if name == "mxfp4-int8":
                quantize_dense_int8(model)
            if name.endswith("-q8"):
                set_int8_activations(model)
            ours["ours_" + name.replace("-", "_")] = model
    return ours


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


def new_request_id() -> str:
    return f"bench-{next(_request_ids)}"


def submit(engine: Engine, prompt: list[int], max_tokens: int, rec: Recorder, banned: list[int] | None = None) -> str:
    """A greedy ignore_eos request of `max_tokens` tokens; `banned`: token ids it may not generate."""
    rid = new_request_id()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, banned_token_ids=banned or [])
    engine.submit(Request(prompt, params, request_id=rid), rec)
    return rid


def decode_rate(t_start: float, stamps: list[list[float]]) -> dict:
    """Decode speed from per-token timestamps: the window opens when every sequence has its first token."""
    first = max(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    tokens = sum(sum(t > first for t in s) for s in stamps)
    window = max(last - first, 1e-9)
    return {"prefill_s": first - t_start, "decode_s": window, "decode_tokens": tokens,
            "tok_per_s": tokens / window, "ms_per_step": 1000 * window / max(1, max(len(s) for s in stamps) - 1)}


# --- transformers ------------------------------------------------------------------------------------
class BlockImports(importlib.abc.MetaPathFinder):
    """Imports of these top-level packages fail (transformers then runs its pure-PyTorch code)."""

    def __init__(self, *names: str):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ImportError(f"blocked by bench/common.py: {name}")
        return None


def import_transformers():
    """transformers with flash-linear-attention, triton and causal_conv1d blocked for the rest of the process."""
    sys.meta_path.insert(0, BlockImports("fla", "triton", "causal_conv1d"))
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def load_transformers(args, res: dict):
    """transformers (its version into res["machine"]), or None with a note when --no-transformers or missing."""
    if args.no_transformers:
        return None
    try:
        tf = import_transformers()
    except ImportError as e:
        res["notes"].append(f"transformers unavailable ({e}): only our engine is measured")
        return None
    res["machine"]["transformers"] = tf.__version__
    return tf


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


def build_hf_models(tf, cfg: ModelConfig, args, families=HF_FAMILIES) -> dict:
    """family -> (model, info) for each family; {} without transformers."""
    hf = {}
    for family in families if tf is not None else ():
        log(f"building transformers {family}")
        hf[family] = build_hf(tf, family, cfg, args.hf_attn, getattr(args, "glm5_hc_mult", 1), args.seed)
    return hf


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


# --- options -----------------------------------------------------------------------------------------
# Every option of every script, by dest; a script names the ones it takes (its OPTIONS) beyond BASE.
# (flags, argparse keywords, (quick default, full default) or None: filled in by finish_args)
ARGS: dict[str, tuple[list[str], dict, tuple | None]] = {
    "quick": (["--quick"], dict(action="store_true", help="tiny sizes: a smoke run in under a minute"), None),
    "json": (["--json"], dict(action="store_true", help="print only the JSON object (progress still on stderr)"),
             None),
    "preset": (["--preset"], dict(default=None, help="model size (default: small; tiny with --quick)"),
               ("tiny", "small")),
    "layers": (["--layers"], dict(type=int, default=None, help="fewer layers than the preset (keeps its schedule "
                                                                "rule)"), None),
    "threads": (["--threads"], dict(type=int, default=2), None),
    "seed": (["--seed"], dict(type=int, default=0), None),
    "repeats": (["--repeats"], dict(type=int, default=None, help="decode rounds (default 3; 2 with --quick)"), (2, 3)),
    "batches": (["--batches"], dict(type=int, nargs="+", default=[1, 16]), None),
    "prompt": (["--prompt"], dict(type=int, default=None, help="prompt tokens (default 128; 16 with --quick)"),
               (16, 128)),
    "new_tokens": (["--new-tokens"], dict(type=int, default=None, help="generated tokens (default 128; 8 with "
                                                                         "--quick)"), (8, 128)),
    "hf_attn": (["--hf-attn"], dict(default="sdpa", choices=["sdpa", "eager"]), None),
    "glm5_hc_mult": (["--glm5-hc-mult"], dict(type=int, default=1, help="glm5_next hyper-connection streams (real "
                                                                          "model: 4)"), None),
    "no_transformers": (["--no-transformers"], dict(action="store_true", help="only our engine"), None),
    "formats": (["--formats"], dict(nargs="+", default=None, choices=list(FORMATS),
                                    help="our weight formats (default all): fp32, bf16, MXFP4 experts (rest "
                                         "fp32), MXFP4 experts (rest bf16), MXFP4 experts + int8 dense "
                                         "projections"), None),
    "enforce_eager": (["--enforce-eager"], dict(action="store_true", help="our engine without compiled decode "
                                                                           "graphs"), None),
    "dtype": (["--dtype"], dict(default=None, help="context / ttft dtype (default: the preset's)"), None),
    "contexts": (["--contexts"], dict(type=int, nargs="+", default=None, help="default 1024 4096 16384"),
                 ([64, 256], [1024, 4096, 16384])),
    "long": (["--long"], dict(action="store_true", help="add 32768 and 65536 to the contexts"), None),
    "context_steps": (["--context-steps"], dict(type=int, default=8, help="timed decode steps per mode and context"),
                      None),
    "history": (["--history"], dict(type=int, default=None, help="turn-1 prompt tokens (default 8192)"), (256, 8192)),
    "turn1_tokens": (["--turn1-tokens"], dict(type=int, default=4), None),
    "turn2_new": (["--turn2-new"], dict(type=int, default=32), None),
    "ttft_repeats": (["--ttft-repeats"], dict(type=int, default=2), None),
    "constrained_tokens": (["--constrained-tokens"], dict(type=int, default=None, help="max tokens of a "
                                                          "constrained reply (default 96; 48 with --quick)"), (48, 96)),
    "profile": (["--profile"], dict(default="auto", choices=["auto", "always", "never"],
                                    help=f"bench/engine.py's profile section: auto when ratio_vs_kimi_linear_batch1 < "
                                         f"{GOAL_BATCH1:g}; never also skips bench/context.py's top-ops profile at "
                                         f"the largest context"), None),
    "profile_batches": (["--profile-batches"], dict(type=int, nargs="+", default=[1, 16]), None),
    "profile_steps": (["--profile-steps"], dict(type=int, default=8), None),
    "quiet_threshold": (["--quiet-threshold"], dict(type=float, default=0.25, help="cores other processes may use "
                                                    "during a measurement before it is measured again"), None),
    "retries": (["--retries"], dict(type=int, default=None, help="re-measurements of one contended measurement "
                                                                  "(default 1; 0 with --quick)"), (0, 1)),
    "max_wait": (["--max-wait"], dict(type=float, default=300, help="seconds in all to wait for other processes"),
                 None),
}
BASE = ("quick", "json", "preset", "layers", "threads", "seed", "quiet_threshold", "retries", "max_wait")
QUICK_FIXED = {"context_steps": 3, "profile_steps": 3, "ttft_repeats": 2}  # --quick sets these whatever is given


def parser(doc: str, options) -> argparse.ArgumentParser:
    """An argument parser with BASE and `options` (dests in ARGS), in ARGS' order."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    wanted = {*BASE, *options}
    for dest, (flags, kw, _) in ARGS.items():
        if dest in wanted:
            ap.add_argument(*flags, **kw)
    return ap


def finish_args(args):
    """Fills in the defaults that depend on --quick (and --long) for the options this script has."""
    for dest, (_, _, defaults) in ARGS.items():
        if defaults is not None and hasattr(args, dest):
            value = getattr(args, dest)
            if dest == "retries":
                setattr(args, dest, value if value is not None else defaults[0 if args.quick else 1])
            else:
                setattr(args, dest, value or defaults[0 if args.quick else 1])
    if getattr(args, "long", False):
        args.contexts = sorted({*args.contexts, 32768, 65536})
    if args.quick:
        for dest, value in QUICK_FIXED.items():
            if hasattr(args, dest):
                setattr(args, dest, value)
    return args


# --- kernel timing ---------------------------------------------------------------------------------
def kernel_parser(doc: str, repeats: int, quick_help: str) -> argparse.ArgumentParser:
    """The options every kernel benchmark (rows, attention, topk) has; the script adds its own before parsing."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    return ap


def kernel_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses, sets the thread count, and stops with a clear message where the CPU kernels did not build."""
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernel_available():
        raise SystemExit("the CPU kernels did not build (see the warning above): nothing to measure")
    return args


def timed(fn, calls: int) -> float:
    """Microseconds per call (after two warm-up calls)."""
    fn(), fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def read_bandwidth(calls: int) -> float:
    """GB/s of a cold fp32 reduction: what streaming weights (or cached rows) from memory can reach here."""
    copies = [torch.randn(16 << 20) for _ in range(4)]  # 4 x 64 MB
    i = [0]

    def run():
        i[0] = (i[0] + 1) % len(copies)
        return copies[i[0]].sum()

    return copies[0].numel() * 4 / timed(run, calls) / 1e3


# --- decode over the paged cache ------------------------------------------------------------------
def fill_synthetic(cache: HorizonCache, length: int, gen: torch.Generator, slot: int = 0) -> None:
    """`slot` holds `length` tokens of random rows (a static cache: a slot's positions are consecutive rows)."""
    first = slot * cache.max_blocks * cache.block_size
    for layer in cache.latent_layers():
        for t in (layer.latent, layer.index):
            if t is not None:
                for s in range(0, length, 1 << 16):  # in slices: no full-length fp32 temporary beside the pool
                    n = min(1 << 16, length - s)
                    t[first + s: first + s + n] = torch.randn(n, t.shape[1], generator=gen, dtype=t.dtype)
    for layer in cache.kda_layers():
        layer.state[slot] = torch.randn(layer.state.shape[1:], generator=gen) * 0.1
    cache.lens[slot] = length


@contextlib.contextmanager
def gathered_rows():
    """Decode steps gather the DSA layers' cached rows before using them (the references: the indexer's keys,
    then the latent rows attention reads) instead of reading them in place (the kernels): the same-run
    baseline. The switch is the one the DSA layer consults when it runs (`dsa._kernel_takes`), so it holds for
    compiled graphs too (dynamo guards on it: each setting has its own graph)."""
    saved = dsa._kernel_takes
    dsa._kernel_takes = lambda pool: False
    try:
        yield
    finally:
        dsa._kernel_takes = saved


# --- a run -------------------------------------------------------------------------------------------
def setup(args, bench: str, context: bool = False, **first) -> tuple[dict, ModelConfig, object, Quiet]:
    """(result dict, model config, tokenizer, Quiet) for a run; `first`: keys to put right after the machine's.
    `context`: raise max_position_embeddings to fit the largest of --contexts."""
    torch.set_num_threads(args.threads)
    quiet = Quiet(args.quiet_threshold, args.retries, args.max_wait)
    res: dict = {"bench": bench, "quick": args.quick, "machine": machine_info(), **first}
    cfg = ModelConfig.preset(args.preset)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, layer_types=None)
    need = max(args.contexts) + 64 if context else 0
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, need))
    res["settings"] = settings(args, cfg)
    res["notes"] = []
    if args.layers:
        res["notes"].append(f"layers reduced to {cfg.num_layers} (the preset has more)")
    return res, cfg, load_tokenizer(), quiet


def settings(args, cfg: ModelConfig) -> dict:
    """The run's settings, for the options this script has."""
    s = {"preset": args.preset, "layers": cfg.num_layers, "layer_types": cfg.layer_types}
    s.update({k: getattr(args, k) for k in ("repeats", "batches", "prompt", "new_tokens") if hasattr(args, k)})
    if hasattr(args, "new_tokens"):
        s["decode_dtypes"] = {"ours": ["float32", "bfloat16"], "transformers": "float32"}
    if hasattr(args, "dtype"):
        s["context_and_ttft_dtype"] = args.dtype or cfg.dtype
    s.update({k: getattr(args, k) for k in ("hf_attn", "glm5_hc_mult") if hasattr(args, k)})
    s.update(greedy=True, ignore_eos=True)
    return s


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


def finish(res: dict, args, quiet: Quiet, summaries) -> None:
    """Adds the machine's end state and the quiet-machine report, then prints the summary (each of
    `summaries` turns res into lines; skipped with --json) and, on the last line, the JSON object."""
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["shared_machine"] = quiet.report()
    if quiet.contended:
        res["notes"].append(f"{len(quiet.contended)} measurement(s) ran while other processes took the cores "
                            f"(see shared_machine.kept_contended): compare the paired ratios per round")
    if not args.json:
        m = res["machine"]
        lines = [f"bench/{res['bench']}.py on {m['cpu']} ({m['threads']} threads, torch {m['torch']}, transformers "
                 f"{m.get('transformers', '-')}), preset {res['settings']['preset']}"]
        for lines_of in summaries:
            lines += lines_of(res)
        if res.get("notes"):
            lines += ["", *("note: " + n for n in res["notes"])]
        print("\n".join(lines))
    print(json.dumps(rounded(res), default=str))
