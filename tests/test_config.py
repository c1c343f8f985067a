"""ModelConfig: validation, JSON round trip, presets and the layer schedule."""

import json

import pytest

from horizon import ModelConfig
from horizon.config import default_layer_types


@pytest.mark.parametrize("name", ["tiny", "small", "k3", "2.8t-articles"])
def test_presets_round_trip_through_config_json(tmp_path, name):
    cfg = ModelConfig.preset(name)
    cfg.save(tmp_path / "config.json")
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "horizon" and data["architectures"] == ["HorizonForCausalLM"]
    assert ModelConfig.load(tmp_path) == cfg


def test_schedule_every_fourth_and_last_layer_is_dsa():
    types = default_layer_types(93)
    assert types.count("dsa") == 24 and types.count("kda") == 69
    assert [i + 1 for i, t in enumerate(types) if t == "dsa"] == [*range(4, 93, 4), 93]
    cfg = ModelConfig.preset("k3")  # Kimi K3 as released: plain MLA (no indexer) on that schedule
    assert cfg.layer_types == types and cfg.index_n_heads == 0 and cfg.max_position_embeddings == 1_048_576
    assert ModelConfig.preset("2.8t") == cfg
    articles = ModelConfig.preset("2.8t-articles")  # the articles' Gated DSA guess, kept as an option
    assert articles.layer_types == types and articles.index_topk == 2048


def test_tiny_has_enough_index_heads_and_a_sparse_topk():
    cfg = ModelConfig.preset("tiny")
    assert cfg.index_n_heads >= 8
    assert len(cfg.dsa_layers) >= 2 and cfg.index_topk < 64


@pytest.mark.parametrize("field,value,allowed", [
    ("hidden_size", 0, "integer >= 1"),
    ("hidden_size", 2.5, "integer >= 1"),
    ("dtype", "fp8", "float32, bfloat16, float16"),
    ("layer_types", ["kda"] * 5, "one type per layer"),
    ("layer_types", ["kda"] * 5 + ["mamba"], "mamba"),
    ("num_experts_per_tok", 9, "n_routed_experts"),
    ("n_group", 3, "divide n_routed_experts"),
    ("topk_group", 3, "n_group"),
    ("mla_rope", "yes", "none, interleaved, half"),
    ("index_rope_dim", 3, "even"),
    ("rms_norm_eps", -1.0, "> 0"),
    ("first_k_dense", 7, "num_layers"),
])
def test_invalid_values_name_field_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        ModelConfig.preset("tiny").replace(**{field: value})
    msg = str(err.value)
    assert f"ModelConfig.{field}={value!r}" in msg and allowed in msg


def test_unknown_fields_and_foreign_model_types_are_refused():
    data = ModelConfig.preset("tiny").to_dict()
    with pytest.raises(ValueError, match="hiden_size"):
        ModelConfig.from_dict({**data, "hiden_size": 3})
    with pytest.raises(ValueError, match="kimi_linear"):
        ModelConfig.from_dict({**data, "model_type": "kimi_linear"})
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: tiny, mini, small, k3, 2.8t-articles, 2.8t"):
        ModelConfig.preset("huge")


def test_replacing_num_layers_recomputes_the_schedule():
    cfg = ModelConfig.preset("tiny").replace(num_layers=8)
    assert cfg.layer_types == default_layer_types(8)
