"""`horizon plan`: counts from the built modules, the 2.8t targets, and the CLI contract."""

import json
import subprocess
import sys

import pytest
import torch

from horizon import ModelConfig
from horizon.cli import main
from horizon.model.model import HorizonForCausalLM
from horizon.plan import plan

from .conftest import tiny, tiny_model


def test_k3_plan_gives_the_released_models_numbers(capsys):
    assert main(["plan", "--preset", "k3", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["num_layers"] == 93 and p["num_dsa_layers"] == 24 and p["num_kda_layers"] == 69
    assert p["attention"] == "MLA"
    # shared/K3.md, from the released shapes: 2.779T total, 105.4B active, experts 1.446 TB in MXFP4
    assert round(p["total_params"] / 1e9) == 2779 and round(p["active_params"] / 1e8) == 1054
    assert round(p["routed_expert_bytes_mxfp4"] / 1e9) == 1446
    assert p["routed_expert_bytes_mxfp4"] == p["routed_expert_params"] * 17 // 32
    # per sequence: the KDA states (fp32, 96 heads of 128 x 128 in 69 layers) plus the conv tails
    assert p["kda_state_bytes"] == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 12288 * 2)
    for key in ("weight_bytes_bf16", "weight_bytes_mxfp4", "cache_bytes_per_token", "kda_state_bytes",
                "cache_bytes_at_context", "min_gpus_141gb"):
        assert isinstance(p[key], int) and p[key] > 0
    assert p["weight_bytes_bf16"] == 2 * p["total_params"]
    cfg = ModelConfig.preset("k3")
    per_token = 24 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2  # the MLA latent row, bf16
    assert p["cache_bytes_per_token"] == per_token
    assert p["cache_bytes_at_context"] == per_token * 1_048_576
    need = p["weight_bytes_mxfp4"] + p["cache_bytes_at_context"] + p["kda_state_bytes"]
    assert (p["min_gpus_141gb"] - 1) * 141e9 < need <= p["min_gpus_141gb"] * 141e9


def test_tiny_plan_equals_a_real_models_parameter_count():
    model = tiny_model()
    p = plan(model.config)
    assert p["total_params"] == sum(t.numel() for t in model.parameters())
    cfg = model.config
    experts = sum(t.numel() for n, t in model.named_parameters() if ".experts." in n)
    vision = sum(t.numel() for n, t in model.named_parameters() if n.startswith("vision."))
    assert vision > 0 and p["vision_params"] == vision
    # the vision encoder runs once per image, not per token: in the total, not in the active count
    active_experts = experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    assert p["active_params"] == p["total_params"] - experts + active_experts - vision


def test_plan_counts_the_vision_encoder():
    base = plan(tiny())
    cfg = tiny()
    D, inner = cfg.vision_hidden_size, cfg.vision_intermediate_size
    per_block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (D * inner + inner) + (inner * D + D)
    deeper = plan(tiny(vision_layers=cfg.vision_layers + 1))
    assert deeper["vision_params"] - base["vision_params"] == per_block
    assert deeper["total_params"] - base["total_params"] == per_block
    assert deeper["active_params"] == base["active_params"]
    text_only = plan(tiny(vision_layers=0))
    assert text_only["vision_params"] == 0
    assert base["total_params"] - text_only["total_params"] == base["vision_params"]


def test_changing_one_dimension_moves_the_count_by_what_the_architecture_implies():
    base = plan(tiny())
    cfg = tiny()
    d, E, k, ns = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts
    n_moe = cfg.num_layers - cfg.first_k_dense
    wider = plan(tiny(moe_intermediate_size=cfg.moe_intermediate_size + 1))
    assert wider["total_params"] - base["total_params"] == n_moe * 3 * d * (E + ns)
    assert wider["active_params"] - base["active_params"] == n_moe * 3 * d * (k + ns)
    assert plan(tiny(vocab_size=cfg.vocab_size + 1))["total_params"] - base["total_params"] == 2 * d
    assert plan(tiny(tie_word_embeddings=True))["total_params"] == base["total_params"] - cfg.vocab_size * d
    dk, kernel = cfg.kda_head_dim, cfg.kda_conv_size
    per_kda_head = 4 * d * dk + 3 * dk * kernel + 2 * dk * dk + dk + 1 + d  # q k v o, conv, f_b g_b, dt, A, beta
    more_heads = plan(tiny(kda_num_heads=cfg.kda_num_heads + 1))
    assert more_heads["total_params"] - base["total_params"] == len(cfg.kda_layers) * per_kda_head


def test_plan_rejects_a_context_beyond_the_window():
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        plan(tiny(), context=10_000)


def test_plan_command_prints_a_table():
    out = subprocess.run([sys.executable, "-m", "horizon.cli", "plan", "--preset", "k3"],
                         capture_output=True, text=True, check=True).stdout
    assert "93 = 24 MLA + 69 KDA" in out and "141 GB GPUs" in out
    bad = subprocess.run([sys.executable, "-m", "horizon.cli", "plan", "--preset", "2.8t", "--context", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "context=0" in bad.stderr and "Traceback" not in bad.stderr


def test_per_rank_plan_for_2_8t_names_the_smallest_layout_and_what_tp_8_lacks(capsys):
    # the articles' layout (2304-wide experts) exercises the expert-parallel hint; K3's 3072 divide by 16
    assert main(["plan", "--preset", "2.8t-articles", "--tp", "16", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    par, whole = p["parallel"], p
    req = par["requested"]
    # 2304-wide experts are 72 MXFP4 blocks: 16 ranks cannot split each expert, but can hold 38 whole ones
    assert not req["divides"] and "moe_intermediate_size=2304" in req["error"]
    assert "--enable-expert-parallel" in req["error"]
    small = par["smallest"]
    assert (small["tp"], small["expert_parallel"], small["fits"]) == (16, True, True)
    assert small["kda_state_bytes_per_sequence_per_rank"] * 16 == whole["kda_state_bytes"]  # sharded with the heads
    assert small["cache_bytes_per_token_per_rank"] == whole["cache_bytes_per_token"]  # replicated
    one_seq = small["kda_state_bytes_per_sequence_per_rank"] + whole["cache_bytes_at_context"]
    assert small["bytes_per_sequence_at_context_per_rank"] == one_seq
    assert small["sequences_at_context_per_rank"] == int((141e9 - small["weight_bytes_per_rank"]) // one_seq) >= 1
    # more than 1/16 of the weights: the embeddings, LM head, indexers and routers are on every rank
    assert 16 * small["weight_bytes_per_rank"] > whole["weight_bytes_mxfp4"]
    for tp8 in par["tp8"]:
        assert tp8["tp"] == 8 and tp8["divides"] and not tp8["fits"] and tp8["sequences_at_context_per_rank"] == 0
        assert tp8["weight_bytes_per_rank"] > 141e9
    assert main(["plan", "--preset", "2.8t-articles", "--tp", "8", "--gpu-memory", "288GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallel"]["requested"]["fits"]


def test_per_rank_weights_are_what_a_sharded_model_holds():
    from horizon.parallel.shard import Layout, shard_model
    from horizon.plan import mxfp4_nbytes, parallel_plan

    cfg = tiny(moe_intermediate_size=64)  # two MXFP4 blocks per expert row: splittable over 2 ranks
    assert parallel_plan(cfg, 1)["requested"]["weight_bytes_per_rank"] == plan(cfg)["weight_bytes_mxfp4"]
    for ep in (False, True):
        with torch.device("meta"):
            model = HorizonForCausalLM(cfg, init=False)
        shard_model(model, Layout(2, 0, ep))
        held = sum(mxfp4_nbytes(p.shape) if ".experts." in n else 2 * p.numel() for n, p in model.named_parameters())
        lay = parallel_plan(cfg, 2, ep)["requested"]
        assert lay["divides"] and lay["weight_bytes_per_rank"] == held


def test_plan_rejects_bad_parallel_options(capsys):
    assert main(["plan", "--preset", "2.8t", "--gpu-memory", "lots"]) == 2
    assert "expected a size such as 141GB" in capsys.readouterr().err
    assert main(["plan", "--preset", "2.8t", "--enable-expert-parallel"]) == 2
    assert "needs --tp > 1" in capsys.readouterr().err
    assert main(["plan", "--preset", "2.8t", "--tp", "0"]) == 2
    from horizon.plan import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5 TB") == 1.5e12 and parse_bytes("141") == 141e9
