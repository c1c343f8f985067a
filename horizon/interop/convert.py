"""Kimi Linear -> Horizon: turn plain-MLA full-attention layers into Gated DSA (`horizon convert --to-dsa`).

A Kimi-Linear-derived model's full-attention layers are MLA without an indexer (index_n_heads=0)
and without an output gate (dsa_gate_rank=0). `to_dsa` adds both, initialised so that nothing
changes where the selection keeps everything:

- the lightning indexer gets fresh random weights (normal(0, initializer_range), its key LayerNorm
  at identity). With no query latent (Kimi's MLA has none) the index queries read the layer's
  RMSNorm'd input. For a context of at most index_topk tokens the layer selects every visible
  position and runs exactly dense causal attention, so the indexer has no effect there; beyond
  that it selects, and docs/design.md §1.2's dense warm-up (a later step) teaches it what to keep.
- the output gate sigmoid(gate_b(gate_a(x))) starts with gate_b = 0, i.e. a gate of exactly 0.5 on
  every channel, and `wo`'s weight is doubled to compensate: (0.5 o)(2 W)^T = o W^T exactly,
  since scaling by powers of two is exact in floating point. gate_a is random so the gate can learn.
  A Kimi K3 model's MLA layers already have their full-rank output gate: they keep it, and only the
  indexer is added (the articles' sparse variant on top of the released model).

Default sizes (`default_indexer`), scaled to the model and documented with it: DeepSeek-V3.2's
indexer (64 heads x 128) sits on a 7168-wide model; here index heads = clamp(num_heads, 8, 64)
(the floor of 8 in docs/design.md §1.2), head dim 128 from hidden 2048 up and 64 below (capped at hidden_size),
index_topk 2048 (docs/design.md §1.2), no indexer RoPE (Horizon rotates nothing; the KDA layers carry
position), gate rank = kda_head_dim (the rank of KDA's own low-rank output gate).

    model = horizon.load("kimi-linear/"); model = to_dsa(model); horizon.save(model, "out/")
"""

from __future__ import annotations

import torch

from horizon.config import ModelConfig
from horizon.model.dsa import GatedDSA
from horizon.model.model import HorizonForCausalLM


def default_indexer(cfg: ModelConfig) -> dict[str, int]:
    """The indexer and gate sizes `to_dsa` uses unless told otherwise (see the module docstring)."""
    head_dim = min(128 if cfg.hidden_size >= 2048 else 64, cfg.hidden_size)
    return dict(index_n_heads=min(max(cfg.num_heads, 8), 64), index_head_dim=head_dim, index_topk=2048,
                index_rope_dim=0, dsa_gate_rank=cfg.kda_head_dim)


@torch.no_grad()
def to_dsa(model: HorizonForCausalLM, seed: int = 0, **sizes: int) -> HorizonForCausalLM:
    """A new model whose DSA layers have an indexer and an output gate; the same logits up to index_topk tokens.

    `sizes` overrides entries of `default_indexer` (index_n_heads, index_head_dim, index_topk,
    index_rope_dim, dsa_gate_rank). The input model is left unchanged.
    """
    from horizon.quant.layers import MXFP4Experts, empty_quantized_model

    cfg = model.config
    if not cfg.dsa_layers:
        raise ValueError("to_dsa: the model has no full-attention (dsa) layers to convert")
    # Kimi K3's MLA layers already have their (full-rank) output gate: only the indexer is added
    keep_gate = cfg.dsa_gate_full_rank
    if keep_gate:
        if sizes.get("dsa_gate_rank"):
            raise ValueError("to_dsa: this model's MLA layers have a full-rank output gate (Kimi K3's); "
                             "dsa_gate_rank cannot be set")
        sizes = {**sizes, "dsa_gate_rank": 0}
    if cfg.index_n_heads or cfg.dsa_gate_rank:
        raise ValueError(f"to_dsa converts plain MLA layers, but this model already has an indexer "
                         f"(index_n_heads={cfg.index_n_heads}) or an output gate (dsa_gate_rank={cfg.dsa_gate_rank})")
    unknown = sorted(set(sizes) - set(default_indexer(cfg)))
    if unknown:
        raise ValueError(f"to_dsa: unknown size(s) {unknown}; allowed: {sorted(default_indexer(cfg))}")
    choice = {**default_indexer(cfg), **sizes}
    if choice["index_n_heads"] < 1 or (choice["dsa_gate_rank"] < 1 and not keep_gate):
        raise ValueError(f"to_dsa: index_n_heads and dsa_gate_rank must be >= 1, got {choice}")
    extra = {**cfg.extra, "to_dsa": {"seed": seed, **choice}}
    new_cfg = cfg.replace(**choice, extra=extra)

    old = model.state_dict()
    param = next(model.parameters())
    with torch.device("meta"):
        new = HorizonForCausalLM(new_cfg, init=False)
        if any(isinstance(m, MXFP4Experts) for m in model.modules()):  # packed experts stay packed
            empty_quantized_model(new)
    new = new.to(param.dtype).to_empty(device=param.device)
    missing, unexpected = new.load_state_dict(old, strict=False)
    fresh = {n for n in missing if ".indexer." in n or ".gate_a." in n or ".gate_b." in n}
    if unexpected or set(missing) - fresh - {"lm_head.weight"}:
        raise ValueError(f"to_dsa: state dicts do not line up (missing {sorted(set(missing) - fresh)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
    if new_cfg.tie_word_embeddings:
        new.lm_head.weight = new.embed.weight
    new.reset_runtime_state()

    gen = torch.Generator().manual_seed(seed)
    std = new_cfg.initializer_range

    def normal_(t: torch.Tensor, s: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * s)

    for layer in new.layers:
        attn = layer.attn
        if not isinstance(attn, GatedDSA):
            continue
        idx = attn.indexer
        normal_(idx.wq.weight, std)
        normal_(idx.wk.weight, std)
        normal_(idx.weights_proj.weight, std)
        idx.k_norm.weight.fill_(1.0)
        idx.k_norm.bias.zero_()
        if keep_gate:
            continue
        normal_(attn.gate_a.weight, std)
        attn.gate_b.weight.zero_()  # sigmoid(0) = 0.5 on every channel ...
        attn.wo.weight.mul_(2.0)  # ... which the doubled output projection undoes exactly
    return new.train(model.training)
