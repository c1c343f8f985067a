"""The bundled model: the trained horizon-tiny ships in the package, MXFP4 experts, under 30 MB, is
what `horizon serve` serves by default, and does its tasks."""

from __future__ import annotations

from horizon.checkpoint import BUNDLED_DIR, open_model
from horizon.cli import _build_app
from horizon.config import ModelConfig
from horizon.quant.layers import MXFP4Experts


def test_the_bundled_model_is_the_trained_horizon_tiny_with_mxfp4_experts():
    files = [f for f in BUNDLED_DIR.iterdir() if f.is_file()]
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) <= 30 * 2**20
    bundle = open_model()
    assert bundle.source == "bundled:horizon-tiny"
    mini = ModelConfig.preset("mini")
    cfg = bundle.model.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.index_topk, cfg.vision_layers) == (
        mini.hidden_size, mini.num_layers, mini.index_topk, mini.vision_layers)
    experts = [m for m in bundle.model.modules() if isinstance(m, MXFP4Experts)]
    assert len(experts) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert bundle.generation_config["thinking_budgets"]["low"] >= 1
    assert open_model("tiny-random").source == "bundled:tiny-random"


def test_serve_defaults_to_it(tmp_path):
    _, model_id, source = _build_app(None, signature_key_file=str(tmp_path / "key"))
    assert (model_id, source) == ("horizon-tiny", "bundled:horizon-tiny")


def test_it_does_its_tasks():
    """The shipped weights answer held-out tasks through the whole stack (engine, agent loop, tools):
    the margins sit well under what `horizon eval --n 100` measures (README), so only a broken model,
    engine or quantizer fails this, not a different CPU's rounding."""
    from horizon.engine import Engine, EngineConfig
    from horizon.eval import evaluate

    bundle = open_model()
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(max_num_seqs=16, max_batch_tokens=2048),
                    generation_config=bundle.generation_config)
    res = evaluate(engine, bundle.tokenizer, ["passkey-short", "arithmetic"], n=16, tier="low", max_steps=3)
    assert res["passkey-short"]["accuracy"] >= 0.75, res
    assert res["arithmetic"]["accuracy"] >= 0.4 and res["arithmetic"]["tool_call_validity"] >= 0.9, res
