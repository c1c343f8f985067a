"""Tiny random checkpoints in Kimi K3's released layout, written from the reference sheet (shared/K3.md §B),
not from Horizon's importer: names, shapes, dtypes, the nested config and compressed-tensors MXFP4 experts
(random packed bytes and E8M0 scales), so that a reading of the layout that differs from the references'
shows up as different logits.

    write_k3(folder, seed=0, **overrides) -> the text_config dict written
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# The parity recipe of shared/K3.md: hidden 64, 5 layers (KDA 1-3, MLA 4-5, 1-based), attention residuals in
# blocks of 2, 8 experts top-2 on a 32-wide latent, 2 shared experts, a dense first layer.
TEXT = dict(
    model_type="kimi_linear", vocab_size=4096, hidden_size=64, num_hidden_layers=5, intermediate_size=96,
    num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=False, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    attn_res_block_size=2,
    linear_attn_config=dict(head_dim=32, num_heads=2, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                            full_attn_layers=[4, 5], use_full_rank_gate=True, gate_lower_bound=-5.0),
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    mla_use_nope=True, mla_use_output_gate=True,
    num_experts=8, num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=32,
    moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=1.0,
    first_k_dense_replace=1, moe_layer_freq=1, use_grouped_topk=True, num_expert_group=1, topk_group=1,
    routed_expert_hidden_size=32, latent_moe_use_norm=True, torch_dtype="float32",
)
QUANT = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "input_activations": None,
                                  "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                                              "symmetric": True, "scale_dtype": "torch.uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "lm_head"],
}


def k3_tensors(text: dict, gen: torch.Generator, dtype=torch.float32, packed: bool = True,
               a_log_pad: int = 8) -> dict[str, torch.Tensor]:
    def w(*shape, std=0.08):
        return (torch.randn(shape, generator=gen) * std).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    d, V, L = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    lin = text["linear_attn_config"]
    H, dk = lin["num_heads"], lin["head_dim"]
    P = H * dk
    nh, nope, vd = text["num_attention_heads"], text["qk_nope_head_dim"], text["v_head_dim"]
    rope = text["qk_rope_head_dim"]
    E, f, lat = text["num_experts"], text["moe_intermediate_size"], text["routed_expert_hidden_size"]
    s = f * text["num_shared_experts"]
    t: dict[str, torch.Tensor] = {}
    m = "language_model.model."
    t[m + "embed_tokens.weight"] = w(V, d, std=1.0)
    t[m + "norm.weight"] = norm(d)
    t["language_model.lm_head.weight"] = w(V, d)
    t[m + "output_attn_res_norm.weight"] = norm(d)
    t[m + "output_attn_res_proj.weight"] = w(1, d, std=0.2)
    for i in range(L):
        p = f"{m}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + n + ".weight"] = norm(d)
        t[p + "self_attention_res_proj.weight"] = w(1, d, std=0.2)
        t[p + "mlp_res_proj.weight"] = w(1, d, std=0.2)
        a = p + "self_attn."
        if (i + 1) in lin["kda_layers"]:
            for x in "qkvg":
                t[a + f"{x}_proj.weight"] = w(P, d)
            t[a + "f_a_proj.weight"] = w(dk, d)
            t[a + "f_b_proj.weight"] = w(P, dk, std=0.3)
            t[a + "b_proj.weight"] = w(H, d)
            t[a + "o_proj.weight"] = w(d, P)
            for x in "qkv":
                t[a + f"{x}_conv1d.weight"] = torch.randn(P, 1, 4, generator=gen) * 0.5  # F32, as released
            t[a + "dt_bias"] = torch.randn(P, generator=gen) * 0.5
            t[a + "o_norm.weight"] = 1 + 0.1 * torch.randn(dk, generator=gen)
            a_log = torch.zeros(a_log_pad)  # per head, zero-padded as the release pads 96 to 128
            a_log[:H] = torch.rand(H, generator=gen) * 2 - 1
            t[a + "A_log"] = a_log
        else:
            t[a + "q_a_proj.weight"] = w(text["q_lora_rank"], d)
            t[a + "q_a_layernorm.weight"] = norm(text["q_lora_rank"])
            t[a + "q_b_proj.weight"] = w(nh * (nope + rope), text["q_lora_rank"], std=0.2)
            t[a + "kv_a_proj_with_mqa.weight"] = w(text["kv_lora_rank"] + rope, d)
            t[a + "kv_a_layernorm.weight"] = norm(text["kv_lora_rank"])
            t[a + "kv_b_proj.weight"] = w(nh * (nope + vd), text["kv_lora_rank"], std=0.2)
            t[a + "g_proj.weight"] = w(nh * vd, d)
            t[a + "o_proj.weight"] = w(d, nh * vd)
        if i < text["first_k_dense_replace"]:
            wd = text["intermediate_size"]
            t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(wd, d), w(wd, d)
            t[p + "mlp.down_proj.weight"] = w(d, wd)
            continue
        b = p + "block_sparse_moe."
        t[b + "gate.weight"] = w(E, d, std=0.3)
        t[b + "gate.e_score_correction_bias"] = torch.randn(E, generator=gen) * 0.1
        t[b + "routed_expert_down_proj.weight"] = w(lat, d)
        t[b + "routed_expert_up_proj.weight"] = w(d, lat)
        t[b + "routed_expert_norm.weight"] = norm(lat)
        t[b + "shared_experts.gate_proj.weight"], t[b + "shared_experts.up_proj.weight"] = w(s, d), w(s, d)
        t[b + "shared_experts.down_proj.weight"] = w(d, s)
        for e in range(E):
            for x, (rows, cols) in (("w1", (f, lat)), ("w3", (f, lat)), ("w2", (lat, f))):
                name = f"{b}experts.{e}.{x}."
                if packed:
                    t[name + "weight_packed"] = torch.randint(0, 256, (rows, cols // 2), generator=gen,
                                                              dtype=torch.uint8)
                    t[name + "weight_scale"] = torch.randint(115, 119, (rows, cols // 32), generator=gen,
                                                             dtype=torch.uint8)
                else:
                    t[name + "weight"] = w(rows, cols, std=0.2)
    return t


def write_k3(folder: str | Path, seed: int = 0, packed: bool = True, shards: int = 3, dtype=torch.float32,
             **overrides) -> dict:
    """A random K3-layout checkpoint in `folder`: config.json, `shards` safetensors files and their index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = dict(TEXT, **overrides)
    text["torch_dtype"] = str(dtype).removeprefix("torch.")
    if packed:
        text["quantization_config"] = QUANT
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
              "torch_dtype": text["torch_dtype"]}
    if packed:
        config["quantization_config"] = QUANT
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = k3_tensors(text, torch.Generator().manual_seed(seed), dtype, packed)
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return text
