"""DeepSeek-V3.2 (`model_type: deepseek_v32`) checkpoints on the Horizon model: MLA + DSA indexer + MoE.

Every DeepSeek-V3.2 layer is a DSA layer without an output gate, so the translation is config
options of Horizon's Gated DSA:

    layer_types     all "dsa" (transformers writes "indexed_attention" for each layer)
    MLA             q_lora_rank > 0, mla_rope="interleaved" (pairs x0,x1 | x2,x3 ... as DeepSeek's
                    reference; transformers' de-interleaved output ordering gives the same dot products),
                    dsa_gate_rank=0, mla_norm_eps=1e-6 (the latent norms' default eps)
    indexer         index_n_heads / index_head_dim / index_topk as given; index_rope_dim = qk_rope_head_dim
                    (half-split RoPE on the first dims, the indexer's query read from the query latent)
    RoPE            rope_parameters / rope_scaling: default, or YaRN -> ModelConfig.rope_scaling
    MLP             mlp_layer_types (dense | sparse) or first_k_dense_replace
    MTP             num_nextn_predict_layers' layers (model.layers.{num_hidden_layers}...) are skipped:
                    they predict a second token and do not change the next-token logits

Tensors, per layer i (p = model.layers.i.), besides the norms and embeddings (see common.py):

    p.self_attn.q_a_proj / q_a_layernorm / q_b_proj      layers.i.attn.wq_a / q_norm / wq_b
    p.self_attn.kv_a_proj_with_mqa / kv_a_layernorm      layers.i.attn.wkv_a / kv_norm
    p.self_attn.kv_b_proj / o_proj                       layers.i.attn.wkv_b / wo
    p.self_attn.indexer.wq_b / wk / weights_proj         layers.i.attn.indexer.wq / wk / weights_proj
    p.self_attn.indexer.k_norm.{weight,bias}             layers.i.attn.indexer.k_norm.{weight,bias}
    p.mlp.{gate_proj,up_proj,down_proj}                  layers.i.mlp.* (dense layers)
    p.mlp.gate.{weight,e_score_correction_bias}          layers.i.mlp.gate.*
    p.mlp.experts.N.{gate,up,down}_proj.weight (or stacked experts.gate_up_proj / down_proj)
                                                         layers.i.mlp.experts.gate_up_proj [E, 2f, d], down_proj
    p.mlp.shared_experts.{gate,up,down}_proj             layers.i.mlp.shared_experts.*

Linear weights may be FP8 with `weight_scale_inv` (the release) or MXFP4 blocks/scales; both are
dequantised at load (common.Source).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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

FAMILY = "deepseek_v32"
# transformers 5.23's DeepseekV32Config defaults for the fields that are not sizes
DEFAULTS = dict(rms_norm_eps=1e-6, routed_scaling_factor=2.5, n_group=8, topk_group=4, n_shared_experts=1,
                norm_topk_prob=True, first_k_dense_replace=3, max_position_embeddings=163840)
YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def _rope(raw: RawConfig, max_pos: int) -> dict[str, Any]:
    """rope_theta and rope_scaling from transformers' `rope_parameters` or the release's `rope_scaling`."""
    field = "rope_parameters" if raw.has("rope_parameters") else "rope_scaling"
    params = raw.get(field, default={})
    if not isinstance(params, dict):
        raise ValueError(f"{raw.where(field)} must be an object, found {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", default=10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default=1.0)) != 1.0:
        raise ValueError(f"{raw.where('partial_rotary_factor')}: only 1.0 (the whole rope slice rotates) is supported")
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "yarn":
        raise ValueError(f"{raw.where(field)}: rope_type {kind!r} is not supported; supported: 'default', 'yarn'")
    # as transformers: a top-level original_max_position_embeddings wins; factor defaults to the ratio
    orig = raw.get("original_max_position_embeddings", default=params.get("original_max_position_embeddings",
                                                                             max_pos))
    factor = params.get("factor")
    scaling = {"type": "yarn", "factor": float(factor if factor is not None else max_pos / orig),
               "original_max_position_embeddings": orig}
    scaling.update({k: params[k] for k in YARN_KEYS if params.get(k) is not None})
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def config_from_hf(raw: dict) -> ModelConfig:
    raw = RawConfig(raw, FAMILY, DEFAULTS)
    stack = stack_fields(raw)
    n = stack["num_layers"]
    types = raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n or set(types) != {"indexed_attention"}):
        raise ValueError(f"{raw.where('layer_types')} must be 'indexed_attention' for each of the {n} layers, "
                         f"found {types!r}")
    mla_part = mla_fields(raw)
    if not mla_part["q_lora_rank"]:
        raise ValueError(f"{FAMILY} config.json: required field 'q_lora_rank' is missing or 0 (the indexer reads "
                         f"the query latent)")
    raw.expect("rope_interleave", (True,), default=True)
    max_pos = raw.integer("max_position_embeddings")
    return build_config(
        raw, **stack, **mla_part, **moe_fields(raw), **mlp_pattern(raw, n), **_rope(raw, max_pos),
        layer_types=["dsa"] * n,
        max_position_embeddings=max_pos,
        mla_rope="interleaved",
        dsa_gate_rank=0,
        index_n_heads=raw.integer("index_n_heads"),
        index_head_dim=raw.integer("index_head_dim"),
        index_topk=raw.integer("index_topk"),
        index_rope_dim=mla_part["qk_rope_head_dim"],
        extra={"imported_from": FAMILY},
    )


def _indexer(src: Source, cfg: ModelConfig, i: int) -> Iterator[Triple]:
    p, q = f"model.layers.{i}.self_attn.indexer.", f"layers.{i}.attn.indexer."
    d, HI, dI = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    yield from renamed(src, [
        (p + "wq_b.weight", q + "wq.weight", (HI * dI, cfg.q_lora_rank)),
        (p + "wk.weight", q + "wk.weight", (dI, d)),
        (p + "k_norm.weight", q + "k_norm.weight", (dI,)),
        (p + "k_norm.bias", q + "k_norm.bias", (dI,)),
        (p + "weights_proj.weight", q + "weights_proj.weight", (HI, d)),
    ])


def convert_tensors(store, config: ModelConfig) -> Iterator[Triple]:
    src = Source(store, config.torch_dtype)
    yield from norms_and_embeddings(src, config)
    for i in range(config.num_layers):
        yield from mla(src, config, i)
        yield from _indexer(src, config, i)
        yield from mlp(src, config, i)
    finish(src, config)
