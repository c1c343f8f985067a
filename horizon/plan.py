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
"""

from __future__ import annotations

import math

import torch

from horizon.config import ModelConfig
from horizon.model.cache import HorizonCache
from horizon.model.model import HorizonForCausalLM
from horizon.model.moe import Experts

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
    """The plan as a dict; `context` defaults to the model's window (1,048,576 tokens for 2.8t)."""
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
    weight_bytes_mxfp4 = (counts["total"] - counts["routed"]) * bf16 + sum(mxfp4_nbytes(p.shape) for p in experts)
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
        "weight_bytes_bf16": counts["total"] * bf16,
        "weight_bytes_mxfp4": weight_bytes_mxfp4,
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
    table.add_row("layers", f"{p['num_layers']} = {p['num_dsa_layers']} Gated DSA + {p['num_kda_layers']} KDA")
    table.add_row("vision encoder (runs once per image)",
                  f"{p['vision_params']:,}  ({_human(p['vision_params'], '')})" if p["vision_params"] else "none")
    table.add_row("weights, bf16", _human(p["weight_bytes_bf16"]))
    table.add_row("weights, MXFP4 experts + bf16 rest", _human(p["weight_bytes_mxfp4"]))
    table.add_row("DSA cache per token", _human(p["cache_bytes_per_token"]))
    table.add_row("KDA state per sequence (constant)", _human(p["kda_state_bytes"]))
    table.add_row("prefix-cache snapshot (k + 3 per request at most)", _human(p["kda_state_bytes"]))
    table.add_row(f"cache at {p['context']:,} tokens", _human(p["cache_bytes_at_context"]))
    table.add_row("141 GB GPUs for weights + 1 sequence", f"{p['min_gpus_141gb']} (lower bound)")
    Console().print(table)
