"""Kimi Linear (`model_type: kimi_linear`) checkpoints on the Horizon model: KDA + MLA + MoE.

Kimi Linear is Horizon's previous generation: its KDA layers are Horizon's, its full-attention
layers are plain MLA (no query latent, a decoupled key slice that is never rotated, no indexer, no
output gate), its MoE is DeepSeek-V3's. So the translation is only config options:

    layer_types  linear_attention -> "kda", full_attention -> "dsa"   (or linear_attn_config's
                 1-based kda_layers / full_attn_layers, as the original release writes them)
    MLA          q_lora_rank=0, mla_rope="none", index_n_heads=0, dsa_gate_rank=0, mla_norm_eps=1e-6
    MLP          mlp_layer_types (dense | sparse) or first_k_dense_replace

Tensors, per layer i (p = model.layers.i.; the release's names, which transformers' save_pretrained
also writes, and transformers' in-memory names, both accepted):

    p.self_attn.{q,k,v}_proj.weight                  layers.i.attn.{q,k,v}_proj.weight
    p.self_attn.{q,k,v}_conv1d.weight [P, 1, K] x3   layers.i.attn.conv_weight [3P, K]  (q | k | v)
      or p.self_attn.conv1d.weight [3P, 1, K]
    p.self_attn[.forget_gate].{f_a_proj,f_b_proj}    layers.i.attn.{f_a_proj,f_b_proj}.weight
    p.self_attn[.forget_gate].A_log [1, 1, H, 1]     layers.i.attn.A_log [H]
    p.self_attn[.forget_gate].dt_bias                layers.i.attn.dt_bias
    p.self_attn.{b_proj,g_a_proj,g_b_proj,o_proj}    layers.i.attn.{same}.weight
    p.self_attn.o_norm.weight                        layers.i.attn.o_norm_weight
    MLA layers: p.self_attn.q_proj / kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj
                                                     layers.i.attn.wq / wkv_a / kv_norm / wkv_b / wo
    p.{block_sparse_moe|mlp}.{gate_proj,up_proj,down_proj}       layers.i.mlp.* (dense layers)
    p.{block_sparse_moe|mlp}.gate.{weight,e_score_correction_bias}  layers.i.mlp.gate.*
    p.{...}.experts.N.{w1,w3,w2}.weight (or gate/up/down_proj, or stacked experts.gate_up_proj /
      experts.down_proj)                             layers.i.mlp.experts.gate_up_proj [E, 2f, d], down_proj
    p.{...}.shared_experts.{gate,up,down}_proj       layers.i.mlp.shared_experts.*
    p.input_layernorm / p.post_attention_layernorm   layers.i.attn_norm / layers.i.mlp_norm
    model.embed_tokens / model.norm / lm_head        embed / norm / lm_head
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from horizon.config import ModelConfig
from horizon.interop.common import (
    RawConfig,
    Source,
    Triple,
    build_config,
    finish,
    mla,
    mla_fields,
    mlp,
    mlp_pattern,
    moe_fields,
    norms_and_embeddings,
    renamed,
    stack_fields,
)

FAMILY = "kimi_linear"
# transformers 5.23's KimiLinearConfig defaults for the fields that are not sizes
DEFAULTS = dict(rms_norm_eps=1e-5, routed_scaling_factor=2.446, n_group=1, topk_group=1, n_shared_experts=1,
                norm_topk_prob=True, first_k_dense_replace=1, model_max_length=1048576)
KINDS = {"linear_attention": "kda", "full_attention": "dsa"}


def _layer_types(raw: RawConfig, n: int) -> list[str]:
    types = raw.get("layer_types")
    linear = raw.get("linear_attn_config", default={})
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[key]:  # 1-based in the release's config
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ValueError(f"{raw.where('linear_attn_config')}.{key} holds {layer!r}, expected 1..{n}")
                types[layer - 1] = kind
    elif types is None:  # transformers' default for a config that names neither
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= set(KINDS):
        raise ValueError(f"{raw.where('layer_types')} must give one of {sorted(KINDS)} for each of the {n} layers, "
                         f"found {types!r}")
    return [KINDS[t] for t in types]


def config_from_hf(raw: dict) -> ModelConfig:
    raw = RawConfig(raw, FAMILY, DEFAULTS)
    stack = stack_fields(raw)
    n = stack["num_layers"]
    raw.expect("mla_use_nope", (True,), default=True)  # the MLA key slice is never rotated, as in transformers
    linear = raw.get("linear_attn_config", default={})
    if not isinstance(linear, dict):
        raise ValueError(f"{raw.where('linear_attn_config')} must be an object, found {linear!r}")
    layer_types = _layer_types(raw, n)
    kda: dict = {}
    if "kda" in layer_types:
        for ours, theirs, release in (("kda_num_heads", "linear_num_heads", "num_heads"),
                                      ("kda_head_dim", "linear_head_dim", "head_dim")):
            value = linear.get(release, raw.get(theirs))
            if value is None:
                raise ValueError(f"{FAMILY} config.json: required field {theirs!r} (or linear_attn_config."
                                 f"{release}) is missing")
            kda[ours] = value
        kda["kda_conv_size"] = linear.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", default=4))
    return build_config(
        raw, **stack, **kda, **mla_fields(raw), **moe_fields(raw), **mlp_pattern(raw, n),
        layer_types=layer_types,
        max_position_embeddings=raw.integer("model_max_length", "max_position_embeddings"),
        # plain MLA: no rotation, no indexer, no output gate (to_dsa adds the last two)
        mla_rope="none", index_n_heads=0, index_head_dim=0, index_topk=0, index_rope_dim=0, dsa_gate_rank=0,
        extra={"imported_from": FAMILY},
    )


def _kda(src: Source, cfg: ModelConfig, i: int) -> Iterator[Triple]:
    p, q = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
    d, H, dk = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    P, K = H * dk, cfg.kda_conv_size

    def gate_part(name: str) -> str:  # transformers keeps the decay parameters under .forget_gate
        return src.first(p + name, p + "forget_gate." + name) or p + name

    yield from renamed(src, [
        (p + "q_proj.weight", q + "q_proj.weight", (P, d)),
        (p + "k_proj.weight", q + "k_proj.weight", (P, d)),
        (p + "v_proj.weight", q + "v_proj.weight", (P, d)),
        (gate_part("f_a_proj.weight"), q + "f_a_proj.weight", (dk, d)),
        (gate_part("f_b_proj.weight"), q + "f_b_proj.weight", (P, dk)),
        (gate_part("dt_bias"), q + "dt_bias", (P,)),
        (p + "b_proj.weight", q + "b_proj.weight", (H, d)),
        (p + "g_a_proj.weight", q + "g_a_proj.weight", (dk, d)),
        (p + "g_b_proj.weight", q + "g_b_proj.weight", (P, dk)),
        (p + "o_norm.weight", q + "o_norm_weight", (dk,)),
        (p + "o_proj.weight", q + "o_proj.weight", (d, P)),
    ])
    a_log = gate_part("A_log")  # [1, 1, H, 1] in the release, [H] in flash-linear-attention
    flat = src.has(a_log) and src.shape(a_log) == (H,)
    yield q + "A_log", src.get(a_log, (H,) if flat else (1, 1, H, 1)).reshape(H), src.file(a_log)
    if src.has(p + "conv1d.weight"):  # transformers' in-memory layout: one depthwise conv over q | k | v
        conv = src.get(p + "conv1d.weight", (3 * P, 1, K))
        yield q + "conv_weight", conv.reshape(3 * P, K), src.file(p + "conv1d.weight")
    else:
        parts = [src.get(p + f"{x}_conv1d.weight", (P, 1, K)).reshape(P, K) for x in "qkv"]
        yield q + "conv_weight", torch.cat(parts), src.file(p + "q_conv1d.weight")


def convert_tensors(store, config: ModelConfig) -> Iterator[Triple]:
    src = Source(store, config.torch_dtype)
    yield from norms_and_embeddings(src, config)
    for i, kind in enumerate(config.layer_types):
        yield from (_kda(src, config, i) if kind == "kda" else mla(src, config, i))
        yield from mlp(src, config, i, prefixes=("block_sparse_moe", "mlp"))
    finish(src, config)
