"""Checkpoints: safetensors round trips, sharding, and clear errors for every broken folder."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import horizon
from horizon.chat import load_tokenizer
from horizon.checkpoint import INDEX, WEIGHTS, load_generation_config
from horizon.cli import main

from .conftest import tiny_model

IDS = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model(IDS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_gives_identical_logits(tmp_path, dtype):
    model = tiny_model().to(dtype)
    horizon.save(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    loaded = horizon.load(tmp_path)
    assert loaded.embed.weight.dtype == dtype
    assert torch.equal(logits(loaded), logits(model))
    bias = loaded.layers[2].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32


def test_sharded_round_trip_and_resave_leaves_no_stale_shards(tmp_path):
    model = tiny_model()
    horizon.save(model, tmp_path, max_shard_bytes=500_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / INDEX).exists()
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert torch.equal(logits(horizon.load(tmp_path)), logits(model))
    horizon.save(model, tmp_path)  # one file now: the old shards and index must go
    assert not list(tmp_path.glob("model-*")) and not (tmp_path / INDEX).exists()
    assert torch.equal(logits(horizon.load(tmp_path)), logits(model))


def test_tied_embeddings_are_stored_once_and_retied(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    horizon.save(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / WEIGHTS)
    loaded = horizon.load(tmp_path)
    assert loaded.lm_head.weight is loaded.embed.weight
    assert torch.equal(logits(loaded), logits(model))


def test_generation_config_and_tokenizer_travel_with_the_weights(tmp_path):
    horizon.save(tiny_model(), tmp_path, generation_config={"temperature": 0.6})
    gen = load_generation_config(tmp_path)
    assert gen["temperature"] == 0.6 and set(gen["thinking_budgets"]) == {"low", "high", "max"}
    tok = load_tokenizer(tmp_path)
    assert tok.decode(tok.encode("héllo 42")) == "héllo 42"


def test_convert_command_rewrites_a_checkpoint(tmp_path, capsys):
    model = tiny_model()
    horizon.save(model, tmp_path / "a")
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--dtype", "bfloat16"]) == 0
    assert horizon.load(tmp_path / "b").embed.weight.dtype == torch.bfloat16


# --- broken folders ----------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path) -> Path:
    horizon.save(tiny_model(), tmp_path, max_shard_bytes=500_000)
    return tmp_path


def test_missing_shard_names_the_file_and_its_tensors(saved):
    shard = sorted(saved.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=re.escape(shard.name) + ".*missing"):
        horizon.load(saved)


def test_truncated_shard_names_the_file(saved):
    shard = sorted(saved.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match=re.escape(shard.name)):
        horizon.load(saved)


def test_tensor_of_the_wrong_shape_names_file_tensor_and_shapes(saved):
    shard = sorted(saved.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(n for n in tensors if tensors[n].dim() == 2)
    want = list(tensors[name].shape)
    tensors[name] = torch.zeros(want[0] + 1, want[1])
    save_file(tensors, shard)
    with pytest.raises(ValueError) as err:
        horizon.load(saved)
    msg = str(err.value)
    assert shard.name in msg and name in msg and str([want[0] + 1, want[1]]) in msg and str(want) in msg


def test_missing_and_unexpected_tensors(tmp_path):
    horizon.save(tiny_model(), tmp_path)
    tensors = load_file(tmp_path / WEIGHTS)
    del tensors["norm.weight"]
    save_file(tensors, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=r"missing 1 tensor.*norm\.weight"):
        horizon.load(tmp_path)
    tensors["norm.weight"] = torch.ones(64)
    tensors["layers.0.extra"] = torch.ones(3)
    save_file(tensors, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor layers\.0\.extra is not part of this model"):
        horizon.load(tmp_path)


def test_unknown_model_type_and_bad_config(tmp_path):
    horizon.save(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type 'llama' is not supported; supported: horizon"):
        horizon.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": -1}))
    with pytest.raises(ValueError, match=r"config\.json: ModelConfig\.hidden_size=-1"):
        horizon.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        horizon.load(tmp_path)
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        horizon.load(tmp_path / "nowhere")


def test_nothing_in_horizon_uses_pickle():
    root = Path(horizon.__file__).parent
    offenders = [str(p) for p in root.rglob("*.py")
                 if re.search(r"\bimport pickle\b|\bpickle\.|torch\.load\(|torch\.save\(|weights_only",
                              p.read_text())]
    assert not offenders


def test_quantize_command_equals_saving_quantized(tmp_path, capsys):
    model = tiny_model()
    horizon.save(model, tmp_path / "full")
    horizon.save(model, tmp_path / "direct", quantize="mxfp4")
    assert main(["quantize", str(tmp_path / "full"), str(tmp_path / "q")]) == 0
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    stored = load_file(tmp_path / "q" / WEIGHTS)
    assert stored["layers.1.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert "layers.1.mlp.experts.gate_up_proj" not in stored
    quantized = horizon.load(tmp_path / "q")
    assert torch.equal(logits(quantized), logits(horizon.load(tmp_path / "direct")))
    # the loaded model holds its routed experts only as packed bytes: no full-precision copy
    expert_shapes = {tuple(t.shape) for n, t in model.state_dict().items() if ".experts." in n}
    floats = [t for t in list(quantized.parameters()) + list(quantized.buffers()) if t.is_floating_point()]
    assert not expert_shapes & {tuple(t.shape) for t in floats}
    assert main(["quantize", str(tmp_path / "full"), str(tmp_path / "full")]) == 2  # refuses to overwrite its source
