"""Kimi K3 (`model_type: kimi_k3`) checkpoints as released, read onto and written from the Horizon model.

K3's architecture is Horizon's (ModelConfig's K3 fields; the `k3` preset holds the released shapes), so
this module is only the released layout: the nested config and the tensor names. One table
(`tensor_table`) lists every tensor both ways, so import (`convert_tensors`) and export (`export`) cannot
drift apart.

config.json: `KimiK3ForConditionalGeneration` with the text model under `text_config` (`kimi_linear`
fields, plus K3's: `attn_res_block_size`, `hidden_act: situ` and its betas, `linear_attn_config.
{use_full_rank_gate, gate_lower_bound}`, `mla_use_output_gate`, `routed_expert_hidden_size`,
`latent_moe_use_norm`) and `quantization_config` (compressed-tensors, `mxfp4-pack-quantized`: only the
routed experts) in `text_config`, copied to the top level as vLLM and mlx-lm read it. A field both levels
hold must agree.

Tensors (p = language_model.model.layers.i.; q = layers.i. in Horizon):

    p.input_layernorm / post_attention_layernorm          q.attn_norm / q.mlp_norm
    p.self_attention_res_{norm,proj} / mlp_res_{norm,proj} q.attn_res.{norm,proj} / q.mlp_res.{norm,proj}
    KDA  p.self_attn.{q,k,v,g,f_a,f_b,b,o}_proj           q.attn.{same}
         p.self_attn.{q,k,v}_conv1d.weight [P, 1, K] F32   q.attn.conv_weight [3P, K] (q | k | v)
         p.self_attn.A_log [H or padded, e.g. 128] F32     q.attn.A_log [H]  (padding must be zeros)
         p.self_attn.dt_bias F32, o_norm.weight F32        q.attn.dt_bias, o_norm_weight
    MLA  p.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
         g_proj, o_proj}                                   q.attn.{wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, gate, wo}
    MoE  p.block_sparse_moe.gate.{weight, e_score_correction_bias F32}       q.mlp.gate.*
         p.block_sparse_moe.routed_expert_{down_proj, norm, up_proj}         q.mlp.latent_{down_proj, norm, up_proj}
         p.block_sparse_moe.shared_experts.{gate,up,down}_proj               q.mlp.shared_experts.*
         p.block_sparse_moe.experts.e.{w1,w3}.weight_packed [f, n/2] U8 + weight_scale [f, n/32] U8,
           w2 likewise [n, f/2] / [n, f/32]    q.mlp.experts.{gate_up,down}_proj_{blocks,scales} (MXFP4: the same
           bytes, element 2i in the low nibble, viewed as [rows, n/32, 16]; written expert by expert)
         or experts.e.w{1,2,3}.weight (unquantised)        q.mlp.experts.gate_up_proj / down_proj
    dense p.mlp.{gate,up,down}_proj                        q.mlp.*
    language_model.model.{embed_tokens, norm, output_attn_res_{norm,proj}}, language_model.lm_head
                                                           embed, norm, output_res.{norm,proj}, lm_head

A checkpoint's vision tensors (`vision_tower.*`, `mm_projector.*`) are skipped with a note: Horizon runs
K3's text model (the vision tower is its own work). The `language_model.` prefix may be absent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from horizon.config import DTYPES, ModelConfig
from horizon.interop.common import (
    RawConfig,
    Source,
    build_config,
    finish,
    layer_index,
    mla_fields,
    mlp_pattern,
    moe_fields,
)
from horizon.interop.kimi_linear import _layer_types
from horizon.parallel.shard import Split, shard_tensor
from horizon.quant.mxfp4 import BLOCK, BLOCK_BYTES

log = logging.getLogger("horizon.interop")

FAMILY = "kimi_k3"
PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.")
# The released model's values for the fields a config may omit (NeMo AutoModel's K3 defaults, which
# reproduce the release); sizes have none.
DEFAULTS = dict(rms_norm_eps=1e-5, routed_scaling_factor=1.0, num_expert_group=1, topk_group=1,
                moe_renormalize=True, first_k_dense_replace=1, max_position_embeddings=1048576,
                activation_situ_beta=4.0, activation_situ_linear_beta=25.0, mla_use_output_gate=True,
                latent_moe_use_norm=True, num_shared_experts=0)
# Fields both config levels may hold; where both do they must agree.
SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings", "quantization_config",
                 "rms_norm_eps", "max_position_embeddings")
MXFP4_FORMAT = "mxfp4-pack-quantized"
F32 = "F32"  # tensors K3 stores in fp32 whatever the trunk's dtype


# --- config ------------------------------------------------------------------------------------------
def text_config(raw: dict) -> dict:
    """The text model's fields of a K3 config.json (`text_config`, checked against the top level)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{FAMILY} config.json: 'text_config' must be an object holding the text model's "
                         f"fields (KimiK3ForConditionalGeneration), found {type(text).__name__}")
    inner = text.get("model_type", "kimi_linear")
    if inner not in ("kimi_linear", "kimi_k3_text"):
        raise ValueError(f"{FAMILY} config.json: text_config.model_type={inner!r}, expected 'kimi_linear'")
    for key in SHARED_FIELDS:
        if key in raw and key in text and raw[key] != text[key]:
            raise ValueError(f"{FAMILY} config.json: {key!r} is {raw[key]!r} at the top level but "
                             f"{text[key]!r} in text_config; they must agree")
    merged = dict(text)
    if "quantization_config" not in merged and "quantization_config" in raw:
        merged["quantization_config"] = raw["quantization_config"]
    return merged


def quantization(raw: dict) -> str | None:
    """"mxfp4" when the routed experts are stored as compressed-tensors MXFP4, None when unquantised; any
    other format is an error naming it."""
    quant = text_config(raw).get("quantization_config")
    if quant is None:
        return None
    where = f"{FAMILY} config.json quantization_config"
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"{where}: quant_method={method!r} is not supported; supported: 'compressed-tensors' "
                         f"with format {MXFP4_FORMAT!r} (K3's routed experts as released)")
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if formats != {MXFP4_FORMAT}:
        raise ValueError(f"{where}: format {sorted(map(str, formats)) or None} is not supported; supported: "
                         f"{MXFP4_FORMAT!r}")
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if w is None:
            continue
        got = (w.get("num_bits"), w.get("type"), w.get("group_size"))
        if got != (4, "float", BLOCK):
            raise ValueError(f"{where}.config_groups.{name}.weights: num_bits/type/group_size {list(got)}, "
                             f"expected [4, 'float', {BLOCK}] (MXFP4)")
        if group.get("input_activations") is not None:
            raise ValueError(f"{where}.config_groups.{name}: input_activations must be null (weights-only "
                             f"MXFP4); found {group['input_activations']!r}")
    return "mxfp4"


def config_from_hf(raw: dict) -> ModelConfig:
    text = text_config(raw)
    method = quantization(raw)
    cfg = RawConfig(text, FAMILY, DEFAULTS)
    cfg.expect("hidden_act", ("situ",), default="situ")
    cfg.expect("mla_use_nope", (True,), default=True)
    n = cfg.integer("num_hidden_layers")
    linear = cfg.get("linear_attn_config", required=True)
    if not isinstance(linear, dict):
        raise ValueError(f"{cfg.where('linear_attn_config')} must be an object, found {linear!r}")
    layer_types = _layer_types(cfg, n)
    kda = dict(kda_num_heads=linear.get("num_heads"), kda_head_dim=linear.get("head_dim"),
               kda_conv_size=linear.get("short_conv_kernel_size", 4),
               kda_gate_full_rank=bool(linear.get("use_full_rank_gate", True)),
               kda_gate_lower_bound=linear.get("gate_lower_bound", -5.0))
    for key in ("kda_num_heads", "kda_head_dim"):
        if kda[key] is None:
            raise ValueError(f"{cfg.where('linear_attn_config')}: required field "
                             f"{'num_heads' if key == 'kda_num_heads' else 'head_dim'!r} is missing")
    res = cfg.get("attn_res_block_size")
    latent = cfg.get("routed_expert_hidden_size")
    gate = bool(cfg.get("mla_use_output_gate"))
    mla = mla_fields(cfg)
    if cfg.get("q_lora_rank") is None:
        mla["q_lora_rank"] = 0
    return build_config(
        cfg, vocab_size=cfg.integer("vocab_size"), hidden_size=cfg.integer("hidden_size"), num_layers=n,
        intermediate_size=cfg.integer("intermediate_size"), rms_norm_eps=float(cfg.get("rms_norm_eps")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", default=False)),
        max_position_embeddings=cfg.integer("max_position_embeddings"),
        dtype=_dtype(text, raw),
        hidden_act="situ", situ_beta=float(cfg.get("activation_situ_beta")),
        situ_linear_beta=float(cfg.get("activation_situ_linear_beta")),
        attn_res_block_size=0 if res is None else res, layer_types=layer_types, **kda, **mla,
        mla_rope="none", index_n_heads=0, index_head_dim=0, index_topk=0, index_rope_dim=0,
        dsa_gate_rank=0, dsa_gate_full_rank=gate, **moe_fields(cfg), **mlp_pattern(cfg, n),
        moe_latent_size=0 if latent is None else latent, moe_latent_norm=bool(cfg.get("latent_moe_use_norm")),
        extra={"imported_from": FAMILY, "experts": method or "unquantised"},
    )


def _dtype(text: dict, raw: dict) -> str:
    """The trunk's stored dtype as the config names it (text_config first), bf16 as released if neither does."""
    for where in (text, raw):
        for key in ("dtype", "torch_dtype"):
            if isinstance(where.get(key), str):
                return where[key] if where[key] in DTYPES else "float32"
    return "bfloat16"


def hf_config(config: ModelConfig, dtype: str, quantized: bool) -> dict[str, Any]:
    """The K3 config.json that describes `config` (the inverse of config_from_hf)."""
    one_based = [i + 1 for i in range(config.num_layers)]
    text: dict[str, Any] = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": dtype,
        "hidden_act": "situ", "activation_situ_beta": config.situ_beta,
        "activation_situ_linear_beta": config.situ_linear_beta,
        "attn_res_block_size": config.attn_res_block_size or None,
        "linear_attn_config": {
            "head_dim": config.kda_head_dim, "num_heads": config.kda_num_heads,
            "short_conv_kernel_size": config.kda_conv_size,
            "kda_layers": [i for i, t in zip(one_based, config.layer_types, strict=True) if t == "kda"],
            "full_attn_layers": [i for i, t in zip(one_based, config.layer_types, strict=True) if t == "dsa"],
            "use_full_rank_gate": config.kda_gate_full_rank, "gate_lower_bound": config.kda_gate_lower_bound},
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_heads,
        "q_lora_rank": config.q_lora_rank or None, "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim, "mla_use_nope": True, "mla_use_output_gate": config.dsa_gate_full_rank,
        "num_experts": config.n_routed_experts, "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": config.n_shared_experts, "moe_intermediate_size": config.moe_intermediate_size,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor, "first_k_dense_replace": config.first_k_dense,
        "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": config.n_group,
        "topk_group": config.topk_group, "routed_expert_hidden_size": config.moe_latent_size or None,
        "latent_moe_use_norm": config.moe_latent_norm, "num_nextn_predict_layers": 0,
    }
    if quantized:
        text["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": MXFP4_FORMAT,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": MXFP4_FORMAT, "input_activations": None,
                "weights": {"num_bits": 4, "type": "float", "group_size": BLOCK, "strategy": "group",
                            "symmetric": True, "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*_proj", "lm_head",
                       "re:.*routed_expert_(down|up)_proj", "re:.*block_sparse_moe.gate"]}
    top = {"model_type": FAMILY, "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
           "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": dtype}
    if quantized:
        top["quantization_config"] = text["quantization_config"]
    return top


def check_exportable(config: ModelConfig) -> None:
    """Every feature of `config` that K3's released format cannot express, in one error."""
    bad = []
    if config.hidden_act != "situ":
        bad.append(f"hidden_act={config.hidden_act!r} (K3's MLPs and experts are SiTU)")
    if config.index_n_heads:
        bad.append("a DSA indexer (index_n_heads > 0; K3's MLA layers are dense)")
    if config.dsa_gate_rank:
        bad.append("a low-rank MLA output gate (dsa_gate_rank > 0; K3's is full rank or absent)")
    if config.mla_rope != "none":
        bad.append(f"mla_rope={config.mla_rope!r} (K3's MLA is NoPE)")
    if config.dense_layers is not None:
        bad.append("dense_layers (K3's dense layers are the first first_k_dense)")
    if config.vision_layers:
        bad.append("a vision encoder (Horizon's encoder is not K3's MoonViT)")
    if config.attention_bias:
        bad.append("attention_bias")
    if bad:
        raise ValueError(f"this model cannot be written in Kimi K3's format: {'; '.join(bad)}")


# --- the tensor table ----------------------------------------------------------------------------------
def tensor_table(cfg: ModelConfig) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
    """(K3 name without the language_model. prefix, Horizon name, how, shape in K3) for every tensor but
    the routed experts. how: "" (the same tensor), "f32" (stored fp32), "a_log" (Horizon's [H], K3's [H]
    possibly zero-padded), "conv0"/"conv1"/"conv2" (K3's q/k/v conv [P, 1, K]: that third of conv_weight)."""
    d, H, dk, P = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_num_heads * cfg.kda_head_dim
    yield "model.embed_tokens.weight", "embed.weight", "", (cfg.vocab_size, d)
    yield "model.norm.weight", "norm.weight", "", (d,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", "lm_head.weight", "", (cfg.vocab_size, d)
    if cfg.attn_res_block_size:
        yield "model.output_attn_res_norm.weight", "output_res.norm.weight", "", (d,)
        yield "model.output_attn_res_proj.weight", "output_res.proj.weight", "", (1, d)
    for i, kind in enumerate(cfg.layer_types):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        yield p + "input_layernorm.weight", q + "attn_norm.weight", "", (d,)
        yield p + "post_attention_layernorm.weight", q + "mlp_norm.weight", "", (d,)
        if cfg.attn_res_block_size:
            for theirs, ours in (("self_attention_res", "attn_res"), ("mlp_res", "mlp_res")):
                yield p + f"{theirs}_norm.weight", q + f"{ours}.norm.weight", "", (d,)
                yield p + f"{theirs}_proj.weight", q + f"{ours}.proj.weight", "", (1, d)
        a, b = p + "self_attn.", q + "attn."
        if kind == "kda":
            for x in "qkv":
                yield a + f"{x}_proj.weight", b + f"{x}_proj.weight", "", (P, d)
            for j, x in enumerate("qkv"):
                yield a + f"{x}_conv1d.weight", b + "conv_weight", f"conv{j}", (P, 1, cfg.kda_conv_size)
            yield a + "f_a_proj.weight", b + "f_a_proj.weight", "", (dk, d)
            yield a + "f_b_proj.weight", b + "f_b_proj.weight", "", (P, dk)
            yield a + "b_proj.weight", b + "b_proj.weight", "", (H, d)
            if cfg.kda_gate_full_rank:
                yield a + "g_proj.weight", b + "g_proj.weight", "", (P, d)
            else:
                yield a + "g_a_proj.weight", b + "g_a_proj.weight", "", (dk, d)
                yield a + "g_b_proj.weight", b + "g_b_proj.weight", "", (P, dk)
            yield a + "A_log", b + "A_log", "a_log", (H,)
            yield a + "dt_bias", b + "dt_bias", "f32", (P,)
            yield a + "o_norm.weight", b + "o_norm_weight", "f32", (dk,)
            yield a + "o_proj.weight", b + "o_proj.weight", "", (d, P)
        else:
            qk, Hv = cfg.qk_head_dim, cfg.num_heads * cfg.v_head_dim
            if cfg.q_lora_rank:
                yield a + "q_a_proj.weight", b + "wq_a.weight", "", (cfg.q_lora_rank, d)
                yield a + "q_a_layernorm.weight", b + "q_norm.weight", "", (cfg.q_lora_rank,)
                yield a + "q_b_proj.weight", b + "wq_b.weight", "", (cfg.num_heads * qk, cfg.q_lora_rank)
            else:
                yield a + "q_proj.weight", b + "wq.weight", "", (cfg.num_heads * qk, d)
            yield a + "kv_a_proj_with_mqa.weight", b + "wkv_a.weight", "", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
            yield a + "kv_a_layernorm.weight", b + "kv_norm.weight", "", (cfg.kv_lora_rank,)
            yield (a + "kv_b_proj.weight", b + "wkv_b.weight", "",
                   (cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
            if cfg.dsa_gate_full_rank:
                yield a + "g_proj.weight", b + "gate.weight", "", (Hv, d)
            yield a + "o_proj.weight", b + "wo.weight", "", (d, Hv)
        if not cfg.is_moe_layer(i):
            w = cfg.intermediate_size
            for x, shape in (("gate_proj", (w, d)), ("up_proj", (w, d)), ("down_proj", (d, w))):
                yield p + f"mlp.{x}.weight", q + f"mlp.{x}.weight", "", shape
            continue
        m, o, E, L = p + "block_sparse_moe.", q + "mlp.", cfg.n_routed_experts, cfg.moe_latent_size
        yield m + "gate.weight", o + "gate.weight", "", (E, d)
        yield m + "gate.e_score_correction_bias", o + "gate.e_score_correction_bias", "f32", (E,)
        if L:
            yield m + "routed_expert_down_proj.weight", o + "latent_down_proj.weight", "", (L, d)
            if cfg.moe_latent_norm:
                yield m + "routed_expert_norm.weight", o + "latent_norm.weight", "", (L,)
            yield m + "routed_expert_up_proj.weight", o + "latent_up_proj.weight", "", (d, L)
        if cfg.n_shared_experts:
            s = cfg.moe_intermediate_size * cfg.n_shared_experts
            for x, shape in (("gate_proj", (s, d)), ("up_proj", (s, d)), ("down_proj", (d, s))):
                yield m + f"shared_experts.{x}.weight", o + f"shared_experts.{x}.weight", "", shape


def expert_table(cfg: ModelConfig, i: int) -> Iterator[tuple[str, str, int, int, int]]:
    """Layer i's routed experts: (K3 name stem of expert e's matrix, Horizon stacked name, e, first row of it
    in the stacked matrix, rows) for w1 (gate), w3 (up) and w2 (down); matrices are [rows, cols] with cols
    the latent (or hidden) width for w1/w3 and the expert width for w2."""
    f = cfg.moe_intermediate_size
    n = cfg.moe_latent_size or cfg.hidden_size
    m, o = f"model.layers.{i}.block_sparse_moe.experts.", f"layers.{i}.mlp.experts."
    for e in range(cfg.n_routed_experts):
        yield f"{m}{e}.w1", o + "gate_up_proj", e, 0, f
        yield f"{m}{e}.w3", o + "gate_up_proj", e, f, f
        yield f"{m}{e}.w2", o + "down_proj", e, 0, n


def _expert_cols(cfg: ModelConfig, ours: str) -> int:
    return (cfg.moe_latent_size or cfg.hidden_size) if ours.endswith("gate_up_proj") else cfg.moe_intermediate_size


# --- import ----------------------------------------------------------------------------------------------
READS_RANK_PARTS = True  # convert_tensors reads a tensor / expert-parallel rank's slices itself


def convert_tensors(store, config: ModelConfig, layout=None, splits=None) -> Iterator[tuple]:
    """Horizon tensors from a K3 folder: (name, tensor, source file) triples, and (name, tensor, source, index)
    for the routed experts, which go into their stacked tensors one expert at a time (packed bytes as they are).
    With a layout (horizon.parallel.shard) and the model's `splits`, only this rank's part of each tensor is
    read: its slice of every split tensor, its own experts under expert parallelism."""
    src = Source(store, config.torch_dtype)
    names = store.names()
    prefix = PREFIX if any(n.startswith(PREFIX) for n in names) else ""
    packed = config.extra.get("experts") == "mxfp4"
    H = config.kda_num_heads
    splits = splits or {}
    conv_parts: dict[str, list[torch.Tensor]] = {}
    for theirs, ours, how, shape in tensor_table(config):
        name = prefix + theirs
        split = splits.get(ours)
        if how == "a_log":
            tensor = _a_log(src, name, H)
            tensor = tensor if split is None else shard_tensor(tensor, split, layout)
        elif how.startswith("conv"):  # conv_weight is Split(0, 3): each of K3's three parts is cut along its rows
            tensor = _read(src, name, shape, None if split is None else Split(0), layout)
        else:
            tensor = _read(src, name, shape, split, layout)
        if not tensor.is_floating_point():
            raise ValueError(f"{src.file(name)}: tensor {name} has dtype {tensor.dtype}, expected a float tensor")
        if how.startswith("conv"):
            parts = conv_parts.setdefault(ours, [])
            parts.append(tensor.reshape(tensor.shape[0], shape[2]))
            if len(parts) == 3:
                yield ours, torch.cat(parts), src.file(name)
            continue
        yield ours, tensor, src.file(name)
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            yield from _experts(src, config, i, prefix, packed, layout, splits)
    skipped = [n for n in names if n.startswith(VISION_PREFIXES)]
    if skipped:
        log.info("text only: skipped %d vision tensor(s) (%s...)", len(skipped), skipped[0])
    if prefix:  # finish() knows the unprefixed names (multi-token-prediction layers and the like)
        skipped += [n for n in names if n.startswith(PREFIX) and _skippable(n[len(PREFIX):], config)]
    if layout is not None and layout.ep:  # other ranks' experts: theirs to read
        skipped += [n for n in names if ".experts." in n and n not in src.used]
    src.used.update(skipped)
    finish(src, config)


def _read(src: Source, name: str, shape: tuple[int, ...], split, layout) -> torch.Tensor:
    """The tensor (shape checked against the full shape), or only this rank's slice of it."""
    if split is None:
        return src.get(name, shape)
    if not src.has(name):
        src.get(name)  # the missing-tensor error
    src.check_shape(name, shape)
    src.used.add(name)
    return src.store.get(name, split, layout)


def _skippable(name: str, cfg: ModelConfig) -> bool:
    i = layer_index(name)
    return i is not None and i >= cfg.num_layers


def _a_log(src: Source, name: str, H: int) -> torch.Tensor:
    """K3's A_log: [H] or [H] zero-padded (the release pads 96 heads to 128)."""
    stored = src.get(name)
    if stored.dim() != 1 or stored.shape[0] < H or bool((stored[H:] != 0).any()):
        raise ValueError(f"{src.file(name)}: tensor {name} has shape {list(stored.shape)}, expected [{H}] or "
                         f"[{H}] zero-padded (the heads' decay rates; kda_num_heads={H})")
    return stored[:H]


def _experts(src: Source, cfg: ModelConfig, i: int, prefix: str, packed: bool, layout, splits) -> Iterator[tuple]:
    """Layer i's routed experts, expert by expert. Under expert parallelism a rank reads its own experts (index
    renumbered from 0); under tensor parallelism each expert's slice: its rows of w1 / w3, its columns of w2."""
    E = cfg.n_routed_experts
    own = range(E) if layout is None or not layout.ep else range(layout.rank * E // layout.tp,
                                                                   (layout.rank + 1) * E // layout.tp)
    cut = layout is not None and not layout.ep and any(f"layers.{i}.mlp.experts." in k for k in splits)
    for stem, ours, e, row, rows in expert_table(cfg, i):
        if e not in own:
            continue
        cols = _expert_cols(cfg, ours)
        name = prefix + stem
        # under TP: w1 / w3 keep rows [r f/tp, (r+1) f/tp) (their place: row / tp), w2 its columns likewise
        part = (Split(0) if ours.endswith("gate_up_proj") else Split(1)) if cut else None
        lrow, lrows = (row // layout.tp, rows // layout.tp) if cut and ours.endswith("gate_up_proj") else (row, rows)
        index = (e - own.start, slice(lrow, lrow + lrows))
        if not packed:
            tensor = _read(src, name + ".weight", (rows, cols), part, layout)
            yield ours, tensor, src.file(name + ".weight"), index
            continue
        nb = cols // BLOCK
        blocks = _read(src, name + ".weight_packed", (rows, cols // 2), part, layout)
        scales = _read(src, name + ".weight_scale", (rows, nb), part, layout)
        for t, n in ((blocks, ".weight_packed"), (scales, ".weight_scale")):
            if t.dtype != torch.uint8:
                raise ValueError(f"{src.file(name + n)}: tensor {name + n} has dtype {t.dtype}, expected "
                                 f"uint8 (compressed-tensors MXFP4)")
        yield ours + "_blocks", blocks.view(blocks.shape[0], -1, BLOCK_BYTES), src.file(name + ".weight_packed"), index
        yield ours + "_scales", scales, src.file(name + ".weight_scale"), index


# --- export ----------------------------------------------------------------------------------------------
def export(model, out: str | Path, dtype: torch.dtype | None = None, max_shard_bytes: int | None = None,
           tokenizer=None) -> Path:
    """Write `model` in Kimi K3's released layout: config.json (nested text_config), safetensors shards with
    model.safetensors.index.json, the routed experts as compressed-tensors MXFP4 (already-packed experts
    byte for byte; full-precision ones quantised, as K3 ships them), the trunk in `dtype` (default: the
    model's), K3's fp32 tensors in fp32. Loading the result (`horizon.load`) gives the same model."""
    from horizon.checkpoint import DEFAULT_SHARD_BYTES, _save_tokenizer, write_weights
    from horizon.quant.layers import MXFP4Experts
    from horizon.quant.mxfp4 import quantize

    cfg: ModelConfig = model.config
    check_exportable(cfg)
    if getattr(model, "layout", None) is not None and model.layout.sharded:
        raise ValueError("export a whole model: this one is one rank's part (gather it first)")
    trunk = dtype or model.embed.weight.dtype
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    dtype_name = str(trunk).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype_name, quantized=True), indent=2) + "\n")
    if tokenizer is not None:
        _save_tokenizer(out, tokenizer)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for theirs, ours, how, shape in tensor_table(cfg):
            t = state[ours]
            if how.startswith("conv"):  # K3's q / k / v third of conv_weight
                j = int(how[-1])
                P = shape[0]
                t = t[j * P:(j + 1) * P].reshape(shape)
            yield PREFIX + theirs, t.to(torch.float32 if how in ("f32", "a_log") or how.startswith("conv")
                                        else trunk)
        for i in range(cfg.num_layers):
            if not cfg.is_moe_layer(i):
                continue
            experts = model.layers[i].mlp.experts
            for stem, ours, e, row, rows in expert_table(cfg, i):
                cols = _expert_cols(cfg, ours)
                if isinstance(experts, MXFP4Experts):
                    blocks = state[ours + "_blocks"][e, row:row + rows]
                    scales = state[ours + "_scales"][e, row:row + rows]
                else:
                    blocks, scales = quantize(state[ours][e, row:row + rows])
                yield PREFIX + stem + ".weight_packed", blocks.reshape(rows, cols // 2)
                yield PREFIX + stem + ".weight_scale", scales

    write_weights(out, tensors(), max_shard_bytes or DEFAULT_SHARD_BYTES)
    return out
