"""Deployment arithmetic for a config: parameters, weight bytes, cache bytes, GPUs needed.

Everything is counted from a model and a cache built on the meta device (no memory is allocated,
so the 2.8T configuration is planned in a second): the counts are sums of the built modules'
numel, not formulas kept beside them.

- active parameters: what one text token runs through: every parameter except the routed experts
  it does not choose (they count k/E of their size; embeddings and LM head in full) and the vision
  encoder, which runs once per image, not per token;
- vision parameters: the image encoder's (part of the total);
- MXFP4 weights: routed experts in MXFP4 (blocks of 32 values: 16 bytes of nibbles + 1 scale
  byte = 4.25 bits per weight), everything else bf16 (docs/design.md §2);
- cache per token: the latent row and the indexer key of every DSA layer, in the model dtype;
- KDA state per sequence: fp32 states plus the convolution tails, constant in the context; a prefix-cache
  snapshot is one such copy (the DSA rows it resumes are shared blocks, not copied), and a request may
  leave up to k + 3 of them (`horizon serve --prefix-snapshot-turns k`: the end of the system prompt,
  k turn ends, the prompt's end, where it finished), all within `--prefix-cache-mb`;
- GPUs: the fewest 141 GB GPUs whose memory holds the MXFP4 weights plus one sequence at the given
  context (weights + cache only: no activations or workspace, so a lower bound).

`parallel_plan` does the same per rank for a tensor-parallel layout (horizon.parallel.shard: the
tensors it splits count 1/N on each rank, the rest in full): weights per rank, the KDA state per
sequence per rank (sharded with the heads), the DSA latent + indexer-key cache per token (replicated:
every rank holds all of it), how many sequences at the context fit in one GPU's memory, and the smallest
layout (N, with or without whole experts per rank) that holds the model with one such sequence.
"""

from __future__ import annotations

import math

import torch

from horizon.config import ModelConfig
from horizon.model.cache import HorizonCache
from horizon.model.model import HorizonForCausalLM
from horizon.model.moe import Experts
from horizon.parallel.shard import Layout, model_splits

GPU_BYTES = 141e9
MXFP4_BLOCK = 32
MXFP4_BLOCK_BYTES = MXFP4_BLOCK // 2 + 1  # 16 bytes of packed nibbles + 1 E8M0 scale


def mxfp4_nbytes(shape: torch.Size) -> int:
    """Bytes of a tensor stored as MXFP4 along its last dim (padded to whole 32-value blocks)."""
    rows = math.prod(shape[:-1])
    return rows * math.ceil(shape[-1] / MXFP4_BLOCK) * MXFP4_BLOCK_BYTES


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """total, routed (expert) and active parameter counts of a built, unquantised model.

    (A quantised model holds its experts as uint8 buffers, which are not parameters: plan() always
    counts a fresh meta-device model instead.)
    """
    total = routed = active_routed = 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        total += p.numel()
    for module in model.modules():
        if isinstance(module, Experts):
            n = sum(p.numel() for p in module.parameters())
            routed += n
    cfg = getattr(model, "config", None)
    if routed:
        k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
        active_routed = routed * k // E  # each expert holds exactly 1/E of the stacked tensors
    vision = getattr(model, "vision", None)
    n_vision = sum(p.numel() for p in vision.parameters()) if vision is not None else 0
    return {"total": total, "routed": routed, "vision": n_vision, "active": total - routed + active_routed - n_vision}


def plan(config: ModelConfig, context: int | None = None) -> dict:
    """The plan as a dict; `context` defaults to the model's window (1,048,576 tokens for k3)."""
    context = config.max_position_embeddings if context is None else context
    if not 1 <= context <= config.max_position_embeddings:
        raise ValueError(f"context={context} is outside this model's window: allowed 1 to "
                         f"max_position_embeddings={config.max_position_embeddings}")
    with torch.device("meta"):
        model = HorizonForCausalLM(config, init=False)
        cache = HorizonCache(config, num_slots=1, max_len=1, dtype=config.torch_dtype, device="meta")
    counts = count_parameters(model)
    bf16 = 2
    experts = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    expert_bytes = sum(mxfp4_nbytes(p.shape) for p in experts)
    weight_bytes_mxfp4 = (counts["total"] - counts["routed"]) * bf16 + expert_bytes
    per_token = cache.bytes_per_token()
    at_context = per_token * context
    kda_state = cache.state_bytes_per_slot()
    need = weight_bytes_mxfp4 + at_context + kda_state
    return {
        "total_params": counts["total"],
        "active_params": counts["active"],
        "routed_expert_params": counts["routed"],
        "vision_params": counts["vision"],
        "num_layers": config.num_layers,
        "num_dsa_layers": len(config.dsa_layers),
        "num_kda_layers": len(config.kda_layers),
        # the full-attention layers: Gated DSA with an indexer, plain MLA without one (Kimi K3)
        "attention": "Gated DSA" if config.index_n_heads else "MLA",
        "weight_bytes_bf16": counts["total"] * bf16,
        "weight_bytes_mxfp4": weight_bytes_mxfp4,
        "routed_expert_bytes_mxfp4": expert_bytes,
        "cache_bytes_per_token": per_token,
        "kda_state_bytes": kda_state,
        "context": context,
        "cache_bytes_at_context": at_context,
        "min_gpus_141gb": max(1, math.ceil(need / GPU_BYTES)),
    }


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:,.1f} {prefix}{unit}" if prefix else f"{n:,.0f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def render_plan(name: str, p: dict) -> None:
    """The human-readable plan: a small table a deployer can read at a glance."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"horizon plan: {name}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("parameters (total)", f"{p['total_params']:,}  ({_human(p['total_params'], '')})")
    table.add_row("parameters (active per token)",
                  f"{p['active_params']:,}  ({_human(p['active_params'], '')}, "
                  f"{100 * p['active_params'] / p['total_params']:.1f}%)")
    table.add_row("layers", f"{p['num_layers']} = {p['num_dsa_layers']} {p['attention']} + {p['num_kda_layers']} KDA")
    table.add_row("vision encoder (runs once per image)",
                  f"{p['vision_params']:,}  ({_human(p['vision_params'], '')})" if p["vision_params"] else "none")
    table.add_row("weights, bf16", _human(p["weight_bytes_bf16"]))
    table.add_row("weights, MXFP4 experts + bf16 rest", _human(p["weight_bytes_mxfp4"]))
    table.add_row("routed experts, MXFP4", _human(p["routed_expert_bytes_mxfp4"]))
    table.add_row(f"{p['attention']} cache per token", _human(p["cache_bytes_per_token"]))
    table.add_row("KDA state per sequence (constant)", _human(p["kda_state_bytes"]))
    table.add_row("prefix-cache snapshot (k + 3 per request at most)", _human(p["kda_state_bytes"]))
    table.add_row(f"cache at {p['context']:,} tokens", _human(p["cache_bytes_at_context"]))
    table.add_row("141 GB GPUs for weights + 1 sequence", f"{p['min_gpus_141gb']} (lower bound)")
    Console().print(table)


def _rank_bytes(model: HorizonForCausalLM, ep: bool) -> tuple[int, int]:
    """(bytes every rank holds in full, bytes split N ways) of the model's MXFP4-experts storage."""
    split = model_splits(model, Layout(2, 0, ep))  # which tensors split does not depend on N
    experts = {f"{prefix}.{name}" for prefix, m in model.named_modules() if isinstance(m, Experts)
               for name, _ in m.named_parameters()}
    whole = parts = 0
    for name, p in model.named_parameters():
        n = mxfp4_nbytes(p.shape) if name in experts else 2 * p.numel()
        if name in split:
            parts += n
        else:
            whole += n
    return whole, parts


def parallel_plan(config: ModelConfig, tp: int, ep: bool = False, context: int | None = None,
                  gpu_bytes: float = GPU_BYTES) -> dict:
    """Per-rank memory of `config` over `tp` ranks (`ep`: whole experts per rank), the smallest layout
    that fits `gpu_bytes` with one sequence at `context`, and what tensor-parallel 8 would need per GPU."""
    context = config.max_position_embeddings if context is None else context
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if not gpu_bytes > 0:
        raise ValueError(f"--gpu-memory must be > 0, got {gpu_bytes}")
    with torch.device("meta"):
        model = HorizonForCausalLM(config, init=False)
    per_token = HorizonCache(config, num_slots=1, max_len=1, dtype=config.torch_dtype,
                             device="meta").bytes_per_token()
    # the KDA state is per head, and its heads are what the layout splits (the busiest rank holds the most)
    state_per_head = HorizonCache(config, num_slots=1, max_len=1, dtype=config.torch_dtype,
                                  device="meta").state_bytes_per_slot() // config.kda_num_heads
    sizes = {flag: _rank_bytes(model, flag) for flag in (False, True)}

    def layout(n: int, flag: bool) -> dict:
        whole, parts = sizes[flag]
        weights = whole + -(-parts // n)
        state = state_per_head * -(-config.kda_num_heads // n)
        seq = state + per_token * context
        try:
            Layout(n, 0, flag).check(config, mxfp4_experts=True)
            error = None
        except ValueError as e:
            error = str(e)
        free = gpu_bytes - weights
        return {"tp": n, "expert_parallel": flag, "weight_bytes_per_rank": weights,
                "kda_state_bytes_per_sequence_per_rank": state, "cache_bytes_per_token_per_rank": per_token,
                "bytes_per_sequence_at_context_per_rank": seq, "bytes_per_rank_with_one_sequence": weights + seq,
                "sequences_at_context_per_rank": max(0, int(free // seq)), "divides": error is None, "error": error,
                "fits": error is None and free >= seq}

    smallest = next((lay for n in range(1, 1025) for flag in (False, True)
                     if (lay := layout(n, flag))["fits"] and (n > 1 or not flag)), None)
    return {"context": context, "gpu_bytes": int(gpu_bytes), "requested": layout(tp, ep and tp > 1),
            "smallest": smallest, "tp8": [layout(8, False), layout(8, True)]}


def parse_bytes(text: str) -> float:
    """"141GB", "141 GB", "80GiB", "1.5TB", "141e9" -> bytes (GB = 1e9, GiB = 2**30)."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "tb": 1e12, "gb": 1e9, "mb": 1e6, "b": 1}
    t = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if t.endswith(unit):
            t, factor = t[: -len(unit)], scale
            break
    else:
        factor = 1e9  # a bare number is GB, as GPU memory is quoted
    try:
        value = float(t) * factor
    except ValueError:
        raise ValueError(f"--gpu-memory {text!r}: expected a size such as 141GB, 80GiB or 1.5TB") from None
    if not value > 0:
        raise ValueError(f"--gpu-memory {text!r}: must be more than zero")
    return value


def render_parallel(name: str, p: dict) -> None:
    """The per-rank table: the requested layout, the smallest that fits, and the seeds' tensor-parallel 8."""
    from rich.console import Console
    from rich.table import Table

    def label(lay: dict) -> str:
        return f"tp {lay['tp']}" + (" + EP" if lay["expert_parallel"] else "")

    # tp 8 with whole experts per rank holds the same bytes as split experts; show one unless they differ
    tp8 = p["tp8"][0] if p["tp8"][0]["fits"] == p["tp8"][1]["fits"] else p["tp8"][1]
    cols = {"requested": p["requested"], "smallest that fits": p["smallest"], "the seeds' tp 8": tp8}
    cols = {k: v for k, v in cols.items() if v is not None}
    gpu = _human(p["gpu_bytes"])
    table = Table(title=f"horizon plan: {name} per rank ({gpu} GPUs, {p['context']:,}-token sequences)",
                  title_justify="left")
    table.add_column("per rank", style="bold")
    for tag, lay in cols.items():
        table.add_column(f"{tag}\n{label(lay)}", justify="right")

    def row(what: str, key: str, human: bool = True) -> None:
        table.add_row(what, *(_human(lay[key]) if human else str(lay[key]) for lay in cols.values()))

    row("weights (MXFP4 experts)", "weight_bytes_per_rank")
    row("KDA state per sequence", "kda_state_bytes_per_sequence_per_rank")
    row("DSA cache per token (replicated)", "cache_bytes_per_token_per_rank")
    row("weights + one sequence", "bytes_per_rank_with_one_sequence")
    row("sequences at the context", "sequences_at_context_per_rank", human=False)
    table.add_row("fits", *("yes" if lay["fits"] else "no: sizes do not divide" if not lay["divides"]
                            else "no: memory" for lay in cols.values()))
    console = Console()
    console.print(table)
    if p["requested"]["error"]:
        console.print(f"requested layout: {p['requested']['error']}")
    if not p["smallest"]:
        console.print(f"no layout up to 1,024 ranks holds the model with one sequence in {gpu} per rank")
