"""Hugging Face kimi_linear / deepseek_v32 folders load onto the Horizon model with transformers' logits.

Each reference is a tiny random transformers model (fp32, eager attention, its pure-PyTorch paths:
flash-linear-attention, causal_conv1d and triton are blocked while transformers is imported), saved
with `save_pretrained` and read back with `horizon.load`. Also: FP8 block-scaled and MXFP4 tensors
load dequantised, `to_dsa` keeps the logits up to index_topk tokens, and broken folders raise
ValueErrors that name the file or field.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import horizon
from horizon.interop.convert import to_dsa

PROMPT, NEW = 20, 16  # prompt tokens, greedy decode steps
VOCAB = 128
TOL = 1e-4


@contextlib.contextmanager
def blocked(*names: str):
    """Imports of these top-level packages fail inside the block (transformers then uses its torch code)."""

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in names:
                raise ImportError(f"blocked in tests: {name}")
            return None

    finder = Block()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def hf_classes():
    pytest.importorskip("transformers")
    with blocked("fla", "triton", "causal_conv1d"):
        import transformers

        return {name: getattr(transformers, name) for name in (
            "KimiLinearConfig", "KimiLinearForCausalLM", "DeepseekV32Config", "DeepseekV32ForCausalLM")}


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Non-degenerate weights: unit-scale activations, norms away from 1, a nonzero routing bias.

    KDA's A_log / dt_bias keep transformers' initialisation (decay rates in a sensible range).
    """
    gen = torch.Generator().manual_seed(seed)
    biases = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, t in [*model.named_parameters(), *biases]:  # not the rotary inv_freq buffers
        if name.endswith(("A_log", "dt_bias")):
            continue
        noise = torch.randn(t.shape, generator=gen)
        if name.endswith("e_score_correction_bias"):
            t.copy_(0.05 * noise)
        elif "norm" in name and name.endswith("weight"):
            t.copy_(1 + 0.2 * noise)
        elif t.dim() == 1:
            t.copy_(0.2 * noise)
        elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_a_proj.weight")):
            # small latents (rms ~0.01) so the latent norms' eps (1e-6, not rms_norm_eps) shows in the logits
            t.copy_(0.01 * noise * t.shape[-1] ** -0.5)
        else:
            t.copy_(noise * t.shape[-1] ** -0.5)


def moe_sizes() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_experts_per_tok=2,
                n_group=2, topk_group=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, pad_token_id=None, bos_token_id=None,
                eos_token_id=None, attn_implementation="eager")


def make_kimi(path, seed=0, **save):
    c = hf_classes()
    config = c["KimiLinearConfig"](
        **moe_sizes(), intermediate_size=96, num_hidden_layers=5, num_local_experts=8, q_lora_rank=None,
        linear_head_dim=16, linear_num_heads=2, rms_norm_eps=1e-5,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "dense", "sparse"])  # dense layers that are not a prefix
    torch.manual_seed(seed)
    model = c["KimiLinearForCausalLM"](config).eval()
    randomize(model, seed)
    model.save_pretrained(path, **save)
    return model


def make_deepseek(path, seed=0, rope=None, intermediate_size=96, **save):
    c = hf_classes()
    config = c["DeepseekV32Config"](
        **moe_sizes(), intermediate_size=intermediate_size, num_hidden_layers=3, n_routed_experts=8,
        q_lora_rank=24, first_k_dense_replace=1, index_n_heads=16, index_head_dim=32, index_topk=8,
        max_position_embeddings=256, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = c["DeepseekV32ForCausalLM"](config).eval()
    randomize(model, seed)
    model.save_pretrained(path, **save)
    return model


YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}


@torch.no_grad()
def greedy_horizon(model, ids, n):
    """Prefill, then n - 1 single-token steps from the cache: (tokens [n], logits [n, V])."""
    cache = model.new_cache(1, ids.shape[1] + n)
    logits = model(ids, cache=cache)[:, -1]
    tokens, steps = [], []
    for _ in range(n):
        steps.append(logits[0])
        tokens.append(logits.argmax(-1))
        if len(tokens) < n:
            logits = model(tokens[-1][:, None], cache=cache)[:, -1]
    return torch.cat(tokens), torch.stack(steps)


@torch.no_grad()
def greedy_hf(model, ids, n):
    out = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, ids.shape[1]:], torch.cat(out.logits).float()


def check_parity(hf, ours, seed=0):
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    hf_tokens, hf_steps = greedy_hf(hf, ids, NEW)
    tokens, steps = greedy_horizon(ours, ids, NEW)
    assert torch.equal(tokens, hf_tokens)
    step_diff = (steps - hf_steps).abs().max().item()
    full_ids = torch.cat((ids, tokens[None]), dim=1)
    with torch.no_grad():
        full_diff = (ours(full_ids) - hf(full_ids).logits).abs().max().item()
    assert step_diff <= TOL and full_diff <= TOL, (step_diff, full_diff)
    return full_ids


# --- parity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("original_format", [True, False])  # per-expert release names / transformers' stacked
def test_kimi_linear_matches_transformers_in_forward_and_cached_greedy_decode(tmp_path, original_format):
    hf = make_kimi(tmp_path, save_original_format=original_format)
    ours = horizon.load(tmp_path)
    cfg = ours.config
    assert cfg.layer_types == ["kda", "dsa", "kda", "kda", "dsa"] and cfg.dense_layers == [1, 3]
    assert cfg.index_n_heads == 0 and cfg.dsa_gate_rank == 0 and cfg.q_lora_rank == 0
    assert cfg.mla_norm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5  # why mla_norm_eps exists
    check_parity(hf, ours)


def test_kimi_release_style_config_translates_like_the_transformers_one(tmp_path):
    from horizon.interop import kimi_linear

    make_kimi(tmp_path)
    hf_style = json.loads((tmp_path / "config.json").read_text())
    release = {k: v for k, v in hf_style.items() if k not in (
        "layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")}
    kinds = hf_style["layer_types"]
    release["linear_attn_config"] = {  # the original release's spelling: 1-based layer lists
        "kda_layers": [i + 1 for i, t in enumerate(kinds) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(kinds) if t == "full_attention"],
        "head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4}
    release.update(mla_use_nope=True, moe_router_activation_func="sigmoid", num_nextn_predict_layers=0)
    assert kimi_linear.config_from_hf(release) == kimi_linear.config_from_hf(hf_style)
    with pytest.raises(ValueError, match="mla_use_nope"):
        kimi_linear.config_from_hf({**release, "mla_use_nope": False})


def index_score_gap(model, ids) -> float:
    """Smallest gap, over queries that see more than index_topk positions, between the k-th and the
    (k+1)-th best indexer score: far above fp32 round-off means no (near-)ties decide the selection."""
    inputs = {}
    hooks = [layer.attn.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        gaps = []
        for i, (x, batch, _cache) in inputs.items():
            attn = model.layers[i].attn
            _, _, c_q, _ = attn.project(x, batch.positions)
            q, w = attn.indexer.queries(x, c_q, batch.positions)
            scores = attn.indexer.scores(q[None], w[None], attn.indexer.keys(x, batch.positions)[None])[0]
            k = attn.indexer.topk
            for t in range(k, scores.shape[0]):
                best = scores[t, : t + 1].sort(descending=True).values
                gaps.append((best[k - 1] - best[k]).item())
    return min(gaps)


@pytest.mark.parametrize("rope", [None, YARN], ids=["rope", "yarn"])
def test_deepseek_v32_matches_transformers_with_the_sparse_selection_active(tmp_path, rope):
    hf = make_deepseek(tmp_path, rope=rope)
    ours = horizon.load(tmp_path)
    cfg = ours.config
    assert cfg.index_topk == 8 < PROMPT and cfg.index_n_heads == 16 and cfg.mla_rope == "interleaved"
    assert (cfg.rope_scaling is not None) == (rope is not None)
    full_ids = check_parity(hf, ours)
    assert index_score_gap(ours, full_ids) > 1e-4
    horizon.save(ours, tmp_path / "horizon")  # the new config options survive config.json
    again = horizon.load(tmp_path / "horizon")
    assert again.config == cfg
    with torch.no_grad():
        assert torch.equal(again(full_ids), ours(full_ids))
    # the selection matters: with top-k above the length (dense attention) the logits move
    with torch.no_grad():
        sparse = ours(full_ids)
        for layer in ours.layers:
            layer.attn.indexer.topk = 10**6
        assert (ours(full_ids) - sparse).abs().max() > 1e-3


# --- quantised tensors ----------------------------------------------------------------------------
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_reference(blocks, scales):
    """OCP MXFP4 decoded element by element: low nibble first, times 2^(scale - 127)."""
    lo, hi = FP4[(blocks & 0xF).long()], FP4[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., nb, 32]
    return (values * torch.exp2(scales.float() - 127)[..., None]).flatten(-2)


def random_mxfp4(shape, gen):
    *lead, n = shape
    blocks = torch.randint(0, 256, (*lead, n // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 131, (*lead, n // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def fp8_quantize(w, block, gen):
    """Block-scaled e4m3 weight and its scale_inv, with random (not amax-derived) scales per block."""
    b0, b1 = block
    rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
    scale = torch.rand(rows, cols, generator=gen) * 0.01 + 0.001
    expanded = torch.zeros_like(w)
    for r in range(rows):
        for c in range(cols):
            expanded[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1] = scale[r, c]
    q = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


@pytest.mark.parametrize("block", [None, [16, 16]], ids=["default-128", "config-16x16"])
def test_fp8_and_mxfp4_tensors_load_to_their_dequantised_values(tmp_path, block):
    # intermediate 200: the dense MLP's [200, 64] weights span a full and a partial 128-row block
    make_deepseek(tmp_path, intermediate_size=200)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(1)
    expected = {}
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
                 "model.layers.1.self_attn.kv_b_proj.weight"):
        q, scale, expected[name] = fp8_quantize(tensors[name], block or (128, 128), gen)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
    E = 8
    # layer 1: transformers' stacked names, `<name>_blocks`; layer 2: the per-expert `<name>.blocks` style
    blocks, scales = random_mxfp4((E, 64, 64), gen)
    expected["gate_up"] = mxfp4_reference(blocks, scales)
    tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"] = blocks
    tensors["model.layers.1.mlp.experts.gate_up_proj_scales"] = scales
    blocks, scales = random_mxfp4((E, 64, 32), gen)
    expected["down"] = mxfp4_reference(blocks, scales)
    tensors["model.layers.1.mlp.experts.down_proj_blocks"] = blocks
    tensors["model.layers.1.mlp.experts.down_proj_scales"] = scales
    per_expert = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            name = f"model.layers.2.mlp.experts.{e}.{proj}.weight"
            del tensors[name]
            blocks, scales = random_mxfp4(shape, gen)
            tensors[name + ".blocks"], tensors[name + ".scales"] = blocks, scales
            per_expert[e, proj] = mxfp4_reference(blocks, scales)
    for e in range(E):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            tensors.pop(f"model.layers.1.mlp.experts.{e}.{proj}.weight")
    save_file(tensors, file)
    if block:
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}
        (tmp_path / "config.json").write_text(json.dumps(config))

    model = horizon.load(tmp_path)
    layers = model.layers
    assert torch.equal(layers[0].mlp.gate_proj.weight, expected["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(layers[0].attn.wq_b.weight, expected["model.layers.0.self_attn.q_b_proj.weight"])
    assert torch.equal(layers[1].attn.wkv_b.weight, expected["model.layers.1.self_attn.kv_b_proj.weight"])
    assert torch.equal(layers[1].mlp.experts.gate_up_proj, expected["gate_up"])
    assert torch.equal(layers[1].mlp.experts.down_proj, expected["down"])
    gate_up, down = layers[2].mlp.experts.gate_up_proj, layers[2].mlp.experts.down_proj
    for e in range(E):
        assert torch.equal(gate_up[e], torch.cat((per_expert[e, "gate_proj"], per_expert[e, "up_proj"])))
        assert torch.equal(down[e], per_expert[e, "down_proj"])
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(12)[None])).all()


# --- to_dsa ---------------------------------------------------------------------------------------
def test_to_dsa_keeps_the_logits_up_to_index_topk_then_selects_and_round_trips(tmp_path):
    make_kimi(tmp_path / "kimi")
    plain = horizon.load(tmp_path / "kimi")
    dsa = to_dsa(plain, index_topk=16)
    cfg = dsa.config
    assert cfg.index_n_heads >= 8 and cfg.dsa_gate_rank > 0 and cfg.index_topk == 16
    assert plain.config.index_n_heads == 0  # the input model is left as it was
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        short = (dsa(ids[:, :16]) - plain(ids[:, :16])).abs().max().item()
        assert short <= 1e-5
        tokens, steps = greedy_horizon(dsa, ids[:, :8], 8)  # cached decode up to 16 tokens: still dense
        ref_tokens, ref_steps = greedy_horizon(plain, ids[:, :8], 8)
        assert torch.equal(tokens, ref_tokens) and (steps - ref_steps).abs().max() <= 1e-5
        assert (dsa(ids) - plain(ids)).abs().max() > 1e-4  # 40 > 16 tokens: the indexer now selects
    horizon.save(dsa, tmp_path / "dsa")
    loaded = horizon.load(tmp_path / "dsa")
    assert loaded.config == cfg
    with torch.no_grad():
        assert torch.equal(loaded(ids), dsa(ids))


def test_to_dsa_refuses_a_model_that_already_has_an_indexer(tmp_path):
    make_deepseek(tmp_path)
    with pytest.raises(ValueError, match="already has an indexer"):
        to_dsa(horizon.load(tmp_path))


# --- bad input ------------------------------------------------------------------------------------
def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,field,allowed", [
    (dict(dense_layers=[1, 3]), "first_k_dense", "must be 0 when dense_layers"),
    (dict(first_k_dense=0, dense_layers=[1, 9]), "dense_layers", "distinct layer indices"),
    (dict(mla_norm_eps=0.0), "mla_norm_eps", "> 0"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling", '"type": "yarn"'),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling", "original_max_position_embeddings"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8, "x": 1}),
     "rope_scaling", "unknown key"),
])
def test_the_interop_config_options_are_validated(changes, field, allowed):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}=.*{allowed}"):
        horizon.ModelConfig.preset("tiny").replace(**changes)


def test_unknown_model_type_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json.*'llama' is not supported"):
        horizon.load(tmp_path)


@pytest.mark.parametrize("family,field", [("kimi_linear", "kv_lora_rank"), ("deepseek_v32", "index_topk")])
def test_a_missing_required_field_is_named(tmp_path, family, field):
    (make_kimi if family == "kimi_linear" else make_deepseek)(tmp_path)
    edit_config(tmp_path, **{field: None})
    with pytest.raises(ValueError, match=rf"{family} config\.json: required field '{field}' is missing"):
        horizon.load(tmp_path)


def test_unsupported_config_values_are_named(tmp_path):
    make_deepseek(tmp_path)
    edit_config(tmp_path, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0})
    with pytest.raises(ValueError, match="rope_parameters.*'llama3' is not supported"):
        horizon.load(tmp_path)
    edit_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_key_value_heads=2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        horizon.load(tmp_path)


def test_a_tensor_of_the_wrong_shape_names_file_tensor_and_both_shapes(tmp_path):
    make_kimi(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(128, 31)
    save_file(tensors, file)
    with pytest.raises(ValueError) as err:
        horizon.load(tmp_path)
    msg = str(err.value)
    assert str(file) in msg and "model.layers.1.self_attn.kv_b_proj.weight" in msg
    assert "[128, 31]" in msg and "expected [128, 32]" in msg


def test_a_tensor_the_conversion_would_drop_is_an_error_but_mtp_layers_are_skipped(tmp_path):
    hf = make_deepseek(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP layer past num_hidden_layers
    save_file(tensors, file)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert (horizon.load(tmp_path)(ids) - hf(ids).logits).abs().max() <= TOL
    tensors["model.layers.0.self_attn.q_a_proj.bias"] = torch.ones(24)  # attention_bias is false
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.q_a_proj\.bias "
                                         r"is not used"):
        horizon.load(tmp_path)
