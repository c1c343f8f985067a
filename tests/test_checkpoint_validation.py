"""Validation at the checkpoint edge: config.json keys and types, generation_config.json values, and the
optional NaN/Inf weight check. Every broken file is a ValueError naming the file and the key."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import horizon
from horizon.chat.thinking import DEFAULT_THINKING_BUDGETS, check_thinking_budgets
from horizon.checkpoint import (
    BUNDLED_DIR,
    GENERATION_CONFIG,
    WEIGHTS,
    load_generation_config,
    open_model,
    validate_generation_config,
)
from horizon.config import ModelConfig

from .conftest import tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint written by `save` from the tiny preset; tests copy its files, never change them."""
    path = tmp_path_factory.mktemp("tiny")
    horizon.save(tiny_model(), path)
    return path


def copy_of(saved: Path, dst: Path) -> Path:
    for f in saved.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def load_error(path: Path) -> str:
    with pytest.raises(ValueError) as err:
        horizon.load(path)
    return str(err.value)


# --- config.json ---------------------------------------------------------------------------------------
def test_valid_checkpoints_still_load(saved):
    assert horizon.load(saved).config == tiny_model().config
    assert horizon.load(BUNDLED_DIR, check_finite=True).config.vision_layers > 0
    # every field save writes is one from_dict needs: a fresh save lists them all
    written = json.loads((saved / "config.json").read_text())
    assert set(ModelConfig.__dataclass_fields__) <= set(written)


@pytest.mark.parametrize("key,expected", [
    ("hidden_size", "an integer >= 1"),  # changes every shape: used to fail later as a shape mismatch
    ("rms_norm_eps", "a number > 0"),  # changes no shape: used to load silently with the default
    ("tie_word_embeddings", "true or false"),
    ("layer_types", "kda, dsa"),
])
def test_a_missing_key_names_file_key_and_what_is_expected(saved, tmp_path, key, expected):
    ckpt = copy_of(saved, tmp_path)
    edit_json(ckpt / "config.json", lambda d: d.pop(key))
    msg = load_error(ckpt)
    assert str(ckpt / "config.json") in msg and f"missing key(s) ['{key}']" in msg and expected in msg


def test_several_missing_keys_are_named_together(saved):
    data = json.loads((saved / "config.json").read_text())
    for key in ("num_heads", "extra"):
        del data[key]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['num_heads', 'extra'\].*extra: a JSON object"):
        ModelConfig.from_dict(data)


@pytest.mark.parametrize("key,value,got", [
    ("hidden_size", "64", "got a string"),
    ("num_layers", True, "got a boolean"),
    ("hidden_size", 64.0, "got a float"),
    ("tie_word_embeddings", "false", "got a string"),  # a truthy string would have tied the embeddings
    ("layer_types", ["kda", 4, "dsa", "kda", "kda", "dsa"], "got a list holding a string, an integer"),
    ("dense_layers", [0, True], "got a list holding a boolean, an integer"),
    ("vision_patch_size", "8", "got a string"),  # not range-checked by validate() while vision_layers=0
    ("extra", [], "got an empty list"),
])
def test_a_value_of_the_wrong_type_names_file_key_value_and_what_is_allowed(saved, tmp_path, key, value, got):
    ckpt = copy_of(saved, tmp_path)
    edit_json(ckpt / "config.json", lambda d: d.update({key: value}))
    msg = load_error(ckpt)
    assert str(ckpt / "config.json") in msg and f"ModelConfig.{key}={value!r} is invalid" in msg and got in msg


def test_model_config_load_names_the_file_too(saved, tmp_path):
    path = tmp_path / "config.json"
    path.write_text((saved / "config.json").read_text())
    edit_json(path, lambda d: d.pop("hidden_size"))
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: missing key(s) ['hidden_size']")):
        ModelConfig.load(path)


def test_unknown_keys_stay_refused_and_metadata_keys_ignored(saved):
    data = json.loads((saved / "config.json").read_text())
    data.pop("quantization_config", None)
    assert ModelConfig.from_dict({**data, "transformers_version": "4.57.0", "torch_dtype": "float32"})
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['hiden_size'\]"):
        ModelConfig.from_dict({**data, "hiden_size": 64})


# --- generation_config.json ------------------------------------------------------------------------------
@pytest.mark.parametrize("gen,key,allowed", [
    ({"thinking_budgets": "lots"}, 'thinking_budgets="lots"', "a JSON object mapping some of low, high, max"),
    ({"thinking_budgets": None}, "thinking_budgets=null", "a JSON object"),
    ({"thinking_budgets": {"low": None}}, "thinking_budgets.low=null", "allowed: an integer >= 1"),
    ({"thinking_budgets": {"low": -5}}, "thinking_budgets.low=-5", "allowed: an integer >= 1"),
    ({"thinking_budgets": {"high": 1.5}}, "thinking_budgets.high=1.5", "allowed: an integer >= 1"),
    ({"thinking_budgets": {"max": True}}, "thinking_budgets.max=true", "allowed: an integer >= 1"),
    ({"thinking_budgets": {"low": 5000, "high": 10}}, "low=5000, high=10, max=32768", "low <= high <= max"),
    ({"thinking_budgets": {"low": 5000}}, "low=5000, high=4096", "defaults"),  # ordered after the merge
    ({"thinking_budgets": {"medium": 3}}, "unknown tier(s) ['medium']", "allowed keys: low, high, max"),
    ({"temperature": -1}, "temperature=-1", "allowed: a finite number >= 0"),
    ({"temperature": "hot"}, 'temperature="hot"', "allowed: a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature=Infinity", "allowed: a finite number >= 0"),
    ({"top_p": 0}, "top_p=0", "allowed: a number in (0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5", "allowed: a number in (0, 1]"),
    ({"top_p": None}, "top_p=null", "allowed: a number in (0, 1]"),
])
def test_a_bad_generation_config_names_file_key_and_allowed_values(saved, tmp_path, gen, key, allowed):
    ckpt = copy_of(saved, tmp_path)
    (ckpt / GENERATION_CONFIG).write_text(json.dumps(gen))
    for call in (load_generation_config, open_model):  # open_model is what `horizon serve` calls
        with pytest.raises(ValueError) as err:
            call(ckpt)
        msg = str(err.value)
        assert msg.startswith(f"{ckpt / GENERATION_CONFIG}: ") and key in msg and allowed in msg, msg


def test_hf_keys_horizon_does_not_read_are_kept_and_ignored(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    hf = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "max_new_tokens": 256,
          "transformers_version": "4.57.0", "temperature": 0.7, "thinking_budgets": {"high": 1000}}
    (ckpt / GENERATION_CONFIG).write_text(json.dumps(hf))
    gen = open_model(ckpt).generation_config
    assert gen["eos_token_id"] == [2, 3] and gen["temperature"] == 0.7 and gen["top_p"] == 1.0
    assert gen["thinking_budgets"] == {**DEFAULT_THINKING_BUDGETS, "high": 1000}  # merged per tier


def test_the_validator_the_engine_calls_checks_a_dict(saved):
    where = "Engine(generation_config=...)"
    with pytest.raises(ValueError, match=r"^Engine\(generation_config=\.\.\.\): thinking_budgets\.low=null"):
        validate_generation_config({"thinking_budgets": {"low": None}}, where)
    assert validate_generation_config({}, where)["thinking_budgets"] == DEFAULT_THINKING_BUDGETS
    assert check_thinking_budgets({"max": 40000}, where) == {**DEFAULT_THINKING_BUDGETS, "max": 40000}


def test_save_refuses_a_generation_config_it_could_not_load(tmp_path):
    with pytest.raises(ValueError, match=r"generation_config\.json \(being written\): thinking_budgets\.low=0"):
        horizon.save(tiny_model(), tmp_path, generation_config={"thinking_budgets": {"low": 0}})
    assert not (tmp_path / "config.json").exists()


# --- non-finite weights ------------------------------------------------------------------------------------
def test_a_nan_weight_fails_the_check_naming_the_tensor_and_loads_without_it(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight[3, 5] = float("nan")
        model.norm.weight[0] = float("inf")
    horizon.save(model, tmp_path)
    with pytest.raises(ValueError) as err:
        horizon.load(tmp_path, check_finite=True)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path}: 2 non-finite weight value(s) (NaN/Inf) in 2 tensor(s)")
    assert "layers.0.attn.q_proj.weight (1)" in msg and "norm.weight (1)" in msg and "--no-weight-check" in msg
    with pytest.raises(ValueError, match="layers.0.attn.q_proj.weight"):
        open_model(tmp_path, check_finite=True)
    loaded = horizon.load(tmp_path)  # check_finite=False, the default: loads as before
    assert torch.isnan(loaded.layers[0].attn.q_proj.weight[3, 5])
    assert open_model(tmp_path).model is not None


def test_a_nan_scale_in_mxfp4_experts_fails_the_check(tmp_path):
    horizon.save(tiny_model(), tmp_path, quantize="mxfp4")
    horizon.load(tmp_path, check_finite=True)  # a clean quantised checkpoint passes
    tensors = load_file(tmp_path / WEIGHTS)
    name = "layers.1.mlp.experts.down_proj_scales"
    tensors[name][2, 0, 0] = 0xFF  # E8M0 NaN: expert 2's first block of 32 decodes to NaN
    save_file(tensors, tmp_path / WEIGHTS)
    with pytest.raises(ValueError) as err:
        horizon.load(tmp_path, check_finite=True)
    assert "layers.1.mlp.experts.down_proj (32)" in str(err.value)  # the whole block: 32 values
    horizon.load(tmp_path)


def test_an_mxfp4_scale_that_overflows_the_dtype_fails_the_check(tmp_path):
    horizon.save(tiny_model(), tmp_path, quantize="mxfp4")
    tensors = load_file(tmp_path / WEIGHTS)
    name = "layers.1.mlp.experts.gate_up_proj"
    tensors[f"{name}_scales"][0, 0, 0] = 254  # 2^127: magnitudes >= 2 overflow fp32, smaller ones do not
    save_file(tensors, tmp_path / WEIGHTS)
    codes = tensors[f"{name}_blocks"][0, 0, 0]
    nibbles = torch.stack((codes & 0xF, codes >> 4), -1).flatten() & 0x7  # magnitude codes; 4 = 2.0
    overflowing = int((nibbles >= 4).sum())
    assert overflowing  # every non-zero block has an element coded 4 or 6 (its amax over the scale is in [4, 8))
    with pytest.raises(ValueError, match=rf"{name} \({overflowing}\)"):
        horizon.load(tmp_path, check_finite=True)
