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


# The released model's text config (shared/K3.md §A), for the full-size layout of `write_sparse_k3`.
K3_TEXT = dict(
    TEXT, vocab_size=163840, hidden_size=7168, num_hidden_layers=93, intermediate_size=33792,
    num_attention_heads=96, num_key_value_heads=96, max_position_embeddings=1048576, attn_res_block_size=12,
    linear_attn_config=dict(head_dim=128, num_heads=96, short_conv_kernel_size=4,
                            kda_layers=[i for i in range(1, 94) if i % 4 and i != 93],
                            full_attn_layers=[*range(4, 93, 4), 93], use_full_rank_gate=True, gate_lower_bound=-5.0),
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
    routed_expert_hidden_size=3584, torch_dtype="bfloat16",
)


def k3_spec(text: dict, packed: bool = True, a_log_pad: int = 8):
    """(name, shape, stored dtype, how to fill it) of every tensor of a K3 checkpoint with this text config.
    how: ("w", std) random normal, "norm" around 1, "conv" / "f32" fp32 randoms, "a_log" per head + zero
    padding, "packed" random bytes, "scale" E8M0 bytes near 2^-10, "bias" the router's correction bias."""
    d, V, L = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    lin = text["linear_attn_config"]
    H, dk = lin["num_heads"], lin["head_dim"]
    P = H * dk
    nh, nope, vd = text["num_attention_heads"], text["qk_nope_head_dim"], text["v_head_dim"]
    rope = text["qk_rope_head_dim"]
    E, f, lat = text["num_experts"], text["moe_intermediate_size"], text["routed_expert_hidden_size"]
    s, ql, kl = f * text["num_shared_experts"], text["q_lora_rank"], text["kv_lora_rank"]
    m, T, F32 = "language_model.model.", "trunk", torch.float32
    yield m + "embed_tokens.weight", (V, d), T, ("w", 1.0)
    yield m + "norm.weight", (d,), T, "norm"
    yield "language_model.lm_head.weight", (V, d), T, ("w", 0.08)
    yield m + "output_attn_res_norm.weight", (d,), T, "norm"
    yield m + "output_attn_res_proj.weight", (1, d), T, ("w", 0.2)
    for i in range(L):
        p = f"{m}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            yield p + n + ".weight", (d,), T, "norm"
        yield p + "self_attention_res_proj.weight", (1, d), T, ("w", 0.2)
        yield p + "mlp_res_proj.weight", (1, d), T, ("w", 0.2)
        a = p + "self_attn."
        if (i + 1) in lin["kda_layers"]:
            for x in "qkvg":
                yield a + f"{x}_proj.weight", (P, d), T, ("w", 0.08)
            yield a + "f_a_proj.weight", (dk, d), T, ("w", 0.08)
            yield a + "f_b_proj.weight", (P, dk), T, ("w", 0.3)
            yield a + "b_proj.weight", (H, d), T, ("w", 0.08)
            yield a + "o_proj.weight", (d, P), T, ("w", 0.08)
            for x in "qkv":
                yield a + f"{x}_conv1d.weight", (P, 1, 4), F32, "conv"  # F32, as released
            yield a + "dt_bias", (P,), F32, "f32"
            yield a + "o_norm.weight", (dk,), F32, "norm"
            yield a + "A_log", (max(a_log_pad, H),), F32, ("a_log", H)  # per head, zero-padded (96 -> 128)
        else:
            yield a + "q_a_proj.weight", (ql, d), T, ("w", 0.08)
            yield a + "q_a_layernorm.weight", (ql,), T, "norm"
            yield a + "q_b_proj.weight", (nh * (nope + rope), ql), T, ("w", 0.2)
            yield a + "kv_a_proj_with_mqa.weight", (kl + rope, d), T, ("w", 0.08)
            yield a + "kv_a_layernorm.weight", (kl,), T, "norm"
            yield a + "kv_b_proj.weight", (nh * (nope + vd), kl), T, ("w", 0.2)
            yield a + "g_proj.weight", (nh * vd, d), T, ("w", 0.08)
            yield a + "o_proj.weight", (d, nh * vd), T, ("w", 0.08)
        if i < text["first_k_dense_replace"]:
            wd = text["intermediate_size"]
            yield p + "mlp.gate_proj.weight", (wd, d), T, ("w", 0.08)
            yield p + "mlp.up_proj.weight", (wd, d), T, ("w", 0.08)
            yield p + "mlp.down_proj.weight", (d, wd), T, ("w", 0.08)
            continue
        b = p + "block_sparse_moe."
        yield b + "gate.weight", (E, d), T, ("w", 0.3)
        yield b + "gate.e_score_correction_bias", (E,), F32, "bias"
        yield b + "routed_expert_down_proj.weight", (lat, d), T, ("w", 0.08)
        yield b + "routed_expert_up_proj.weight", (d, lat), T, ("w", 0.08)
        yield b + "routed_expert_norm.weight", (lat,), T, "norm"
        yield b + "shared_experts.gate_proj.weight", (s, d), T, ("w", 0.08)
        yield b + "shared_experts.up_proj.weight", (s, d), T, ("w", 0.08)
        yield b + "shared_experts.down_proj.weight", (d, s), T, ("w", 0.08)
        for e in range(E):
            for x, (rows, cols) in (("w1", (f, lat)), ("w3", (f, lat)), ("w2", (lat, f))):
                name = f"{b}experts.{e}.{x}."
                if packed:
                    yield name + "weight_packed", (rows, cols // 2), torch.uint8, "packed"
                    yield name + "weight_scale", (rows, cols // 32), torch.uint8, "scale"
                else:
                    yield name + "weight", (rows, cols), T, ("w", 0.2)


def k3_tensors(text: dict, gen: torch.Generator, dtype=torch.float32, packed: bool = True,
               a_log_pad: int = 8) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {}
    for name, shape, stored, how in k3_spec(text, packed, a_log_pad):
        kind = how[0] if isinstance(how, tuple) else how
        if kind == "w":
            x = torch.randn(shape, generator=gen) * how[1]
        elif kind == "norm":
            x = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif kind == "conv" or kind == "f32":
            x = torch.randn(shape, generator=gen) * 0.5
        elif kind == "bias":
            x = torch.randn(shape, generator=gen) * 0.1
        elif kind == "a_log":
            x = torch.zeros(shape)
            x[:how[1]] = torch.rand(how[1], generator=gen) * 2 - 1
        elif kind == "packed":
            x = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        else:  # E8M0 scales 2^-12 .. 2^-9: experts' weights of the size the trunk's have
            x = torch.randint(115, 119, shape, generator=gen, dtype=torch.uint8)
        t[name] = x.to(dtype if stored == "trunk" else stored)
    return t


def write_sparse_k3(folder: str | Path, shards: int = 96, text: dict = K3_TEXT) -> int:
    """The full-size released layout with no data: `shards` safetensors files whose headers declare every
    tensor's shape and dtype, each file extended to its size as a sparse file (no 1.4 TB on disk), plus the
    config and the index. Returns the number of tensors."""
    import struct

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = dict(text, quantization_config=QUANT)
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
              "quantization_config": QUANT, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    codes = {torch.bfloat16: ("BF16", 2), torch.float32: ("F32", 4), torch.uint8: ("U8", 1)}
    spec = list(k3_spec(text, packed=True, a_log_pad=128))
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, stored, _how in spec[k::shards]:
            code, size = codes[torch.bfloat16 if stored == "trunk" else stored]
            n = size
            for s in shape:
                n *= s
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / file, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + offset)  # the data region: a hole, read by nobody
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return len(spec)


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
