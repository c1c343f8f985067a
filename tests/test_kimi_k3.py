"""Kimi K3 as released: tiny random checkpoints in its exact layout (tests/k3_layout.py, written from the
reference sheet) loaded by Horizon and by mlx-lm's `kimi_k3` (an independent implementation, on the CPU),
with the same fp32 logits; K3's new ops against mlx-lm's; export back to the layout; bad checkpoints refused
with errors that name the file, the tensor or key, and what was expected; and the checkpoint served."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import horizon
from horizon.interop import kimi_k3
from horizon.model.attn_res import attn_res_mix
from horizon.model.layers import situ
from horizon.quant.layers import MXFP4Experts

from .k3_layout import write_k3

mx = pytest.importorskip("mlx.core")
mlx_utils = pytest.importorskip("mlx_lm.utils")
mlx_k3 = pytest.importorskip("mlx_lm.models.kimi_k3")

TOL = 1e-4  # fp32 logits, |Horizon - mlx-lm|


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("k3") / "tiny-k3"
    write_k3(folder, seed=0)
    return folder


@pytest.fixture(scope="module")
def mlx_model(k3_dir):
    model, _ = mlx_utils.load_model(k3_dir)
    return model


def mlx_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(model(mx.array(ids.numpy()))[0].astype(mx.float32)))


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 4096, (1, n), generator=torch.Generator().manual_seed(seed))


def test_k3_checkpoint_loads_with_packed_experts_and_the_released_config(k3_dir):
    model = horizon.load(k3_dir, dtype=torch.float32)
    cfg = model.config
    assert cfg.layer_types == ["kda", "kda", "kda", "dsa", "dsa"] and cfg.index_n_heads == 0
    assert (cfg.hidden_act, cfg.attn_res_block_size, cfg.kda_gate_lower_bound) == ("situ", 2, -5.0)
    assert cfg.kda_gate_full_rank and cfg.dsa_gate_full_rank
    assert (cfg.moe_latent_size, cfg.moe_latent_norm) == (32, True)
    experts = model.layers[1].mlp.experts
    assert isinstance(experts, MXFP4Experts)  # the packed bytes as stored, never expanded
    stored = horizon.checkpoint.TensorStore(k3_dir).get("language_model.model.layers.1.block_sparse_moe.experts.5.w3"
                                                        ".weight_packed")
    assert torch.equal(experts.gate_up_proj_blocks[5, 32:].reshape(32, 16), stored)


def test_logits_match_mlx_lm_full_forward(k3_dir, mlx_model):
    model = horizon.load(k3_dir, dtype=torch.float32)
    for n, seed in ((1, 3), (40, 1), (97, 2)):
        ids = prompt(n, seed)
        with torch.no_grad():
            ours = model(ids)[0]
        ref = mlx_logits(mlx_model, ids)
        assert (ours - ref).abs().max() < TOL, n


def test_chunked_prefill_and_cached_decode_match_mlx_lm(k3_dir, mlx_model):
    model = horizon.load(k3_dir, dtype=torch.float32)
    ids = prompt(60, seed=4)
    ref = mlx_logits(mlx_model, ids)
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        parts = [model(ids[:, :17], cache=cache), model(ids[:, 17:40], cache=cache)]
        parts += [model(ids[:, t:t + 1], cache=cache) for t in range(40, 60)]  # one token a step, cached
    assert (torch.cat(parts, 1)[0] - ref).abs().max() < TOL


def test_the_engine_matches_mlx_lm_greedy_continuation(k3_dir, mlx_model):
    from horizon.engine import Engine, EngineConfig, Request, SamplingParams

    bundle = horizon.checkpoint.open_model(k3_dir, dtype=torch.float32)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=256,
                                                                 compile=False))
    ids = prompt(30, seed=5)[0].tolist()
    out = engine.generate([Request(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])[0]
    seq = list(ids)
    for _ in range(8):  # mlx-lm's greedy continuation, one full forward per token
        seq.append(int(mlx_logits(mlx_model, torch.tensor([seq]))[-1].argmax()))
    assert out.token_ids == seq[30:]


def test_situ_attn_res_and_k3_decay_equal_mlx_lms_ops():
    gen = torch.Generator().manual_seed(0)
    g, u = torch.randn(64, 96, generator=gen) * 8, torch.randn(64, 96, generator=gen) * 40
    ref = np.array(mlx_k3._situ(mx.array(u.numpy()), mx.array(g.numpy()), 4.0, 25.0))
    np.testing.assert_allclose(situ(g, u, 4.0, 25.0).numpy(), ref, rtol=1e-6, atol=1e-6)  # values up to ~100
    # attention residuals: 3 banked sources and the partial sum, 10 tokens
    bank = [torch.randn(10, 48, generator=gen) * s for s in (1.0, 3.0, 0.5)]
    partial = torch.randn(10, 48, generator=gen)
    nw, pw = 1 + 0.1 * torch.randn(48, generator=gen), torch.randn(48, generator=gen)
    blocks = mlx_k3.ResidualBlocks(1e-5)
    for b in bank:
        blocks.append(mx.array(b.numpy()))
    ref = np.array(mlx_k3._attn_res_mix(blocks, mx.array(partial.numpy()), mx.array((nw * pw).numpy()), 1e-5,
                                        use_kernel=False))
    assert np.abs(attn_res_mix(bank, partial, nw, pw, 1e-5).numpy() - ref).max() < 1e-5
    assert attn_res_mix([], partial, nw, pw, 1e-5) is partial  # no bank yet: the partial sum itself
    # K3's decay: lb * sigmoid(exp(A_log) * (f + dt_bias)), a log-decay in (lb, 0) per channel
    from mlx_lm.models.gated_delta import compute_lower_bound_g

    from horizon.config import ModelConfig
    from horizon.model.kda import KimiDeltaAttention

    cfg = ModelConfig.preset("tiny").replace(kda_gate_lower_bound=-5.0)
    kda = KimiDeltaAttention(cfg, 0)
    with torch.no_grad():
        for t in (kda.f_a_proj.weight, kda.f_b_proj.weight, kda.A_log, kda.dt_bias):
            t.copy_(torch.randn(t.shape, generator=gen))
        x = torch.randn(7, cfg.hidden_size, generator=gen)
        ours = kda.decay(x)
        f = kda.f_b_proj(kda.f_a_proj(x)).view(7, 2, 32)
    ref = compute_lower_bound_g(mx.array(kda.A_log.detach().numpy()[:, None]), mx.array(f.numpy()),
                                mx.array(kda.dt_bias.detach().view(2, 32).numpy()), -5.0)
    assert np.abs(ours.exp().numpy() - np.array(ref)).max() < 1e-6  # mlx returns alpha = exp(log alpha)
    assert bool((ours <= 0).all()) and bool((ours >= -5).all())  # (lb, 0), closed where fp32 saturates


def test_unquantised_experts_load_as_full_precision_and_match_mlx_lm(tmp_path):
    write_k3(tmp_path / "bf16-experts", seed=3, packed=False)
    model = horizon.load(tmp_path / "bf16-experts", dtype=torch.float32)
    assert not isinstance(model.layers[1].mlp.experts, MXFP4Experts)
    ref_model, _ = mlx_utils.load_model(tmp_path / "bf16-experts")
    ids = prompt(25, seed=6)
    with torch.no_grad():
        assert (model(ids)[0] - mlx_logits(ref_model, ids)).abs().max() < TOL


# --- export ----------------------------------------------------------------------------------------------
def test_export_round_trip_is_exact_and_mlx_lm_reads_the_export(k3_dir, tmp_path, mlx_model):
    model = horizon.load(k3_dir, dtype=torch.float32)
    out = kimi_k3.export(model, tmp_path / "export", max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists()  # sharded, with the index, as released
    again = horizon.load(out, dtype=torch.float32)
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert names.keys() == json.loads((k3_dir / "model.safetensors.index.json").read_text())["weight_map"].keys()
    exported, _ = mlx_utils.load_model(out)
    ids = prompt(33, seed=7)
    assert (mlx_logits(exported, ids) - mlx_logits(mlx_model, ids)).abs().max() < TOL


def test_a_horizon_trained_k3_model_exports_quantised_and_mlx_lm_agrees(tmp_path):
    from horizon.model.model import HorizonForCausalLM

    write_k3(tmp_path / "shape")
    cfg = kimi_k3.config_from_hf(json.loads((tmp_path / "shape" / "config.json").read_text()))
    torch.manual_seed(0)
    model = HorizonForCausalLM(cfg.replace(extra={})).eval()  # full precision, random: as training leaves it
    out = kimi_k3.export(model, tmp_path / "out")
    loaded = horizon.load(out, dtype=torch.float32)
    assert isinstance(loaded.layers[1].mlp.experts, MXFP4Experts)  # quantised on the way, as K3 ships
    ids = prompt(20, seed=8)
    ref_model, _ = mlx_utils.load_model(out)
    with torch.no_grad():
        assert (loaded(ids)[0] - mlx_logits(ref_model, ids)).abs().max() < TOL


def test_models_k3_cannot_express_are_refused_on_export(tmp_path):
    from .conftest import tiny_model

    with pytest.raises(ValueError, match="cannot be written in Kimi K3's format: hidden_act='silu'.*indexer"):
        kimi_k3.export(tiny_model(), tmp_path / "x")


# --- bad checkpoints ---------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_missing_or_truncated_shard_is_named(k3_dir, tmp_path):
    missing = _copy(k3_dir, tmp_path / "missing")
    (missing / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-00003.safetensors: shard listed in .* is missing"):
        horizon.load(missing)
    truncated = _copy(k3_dir, tmp_path / "truncated")
    shard = truncated / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5000])
    with pytest.raises(ValueError, match="model-00001-of-00003.safetensors"):
        horizon.load(truncated)


def _rewrite_tensor(folder: Path, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    path = folder / index[name]
    tensors = load_file(str(path))
    tensors[name] = tensor
    save_file(tensors, str(path))


def test_wrong_shapes_and_dtypes_are_named(k3_dir, tmp_path):
    bad = _copy(k3_dir, tmp_path / "shape")
    name = "language_model.model.layers.3.self_attn.g_proj.weight"
    _rewrite_tensor(bad, name, torch.zeros(32, 64))
    with pytest.raises(ValueError, match=rf"{name} has shape \[32, 64\], expected \[64, 64\]"):
        horizon.load(bad)
    packed = _copy(k3_dir, tmp_path / "dtype")
    name = "language_model.model.layers.2.block_sparse_moe.experts.0.w2.weight_packed"
    _rewrite_tensor(packed, name, torch.zeros(32, 16))  # float where the packed bytes belong
    with pytest.raises(ValueError, match=rf"{name} has dtype torch.float32, expected uint8"):
        horizon.load(packed)
    float_as_int = _copy(k3_dir, tmp_path / "int")
    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    _rewrite_tensor(float_as_int, name, torch.zeros(64, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"{name} has dtype torch.int32, expected a float tensor"):
        horizon.load(float_as_int)
    padded = _copy(k3_dir, tmp_path / "alog")
    name = "language_model.model.layers.1.self_attn.A_log"
    _rewrite_tensor(padded, name, torch.ones(8))  # padding that is not zeros: not the released layout
    with pytest.raises(ValueError, match=rf"{name} has shape \[8\], expected \[2\] or \[2\] zero-padded"):
        horizon.load(padded)


def test_missing_and_unexpected_tensors_are_named(k3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    extra = _copy(k3_dir, tmp_path / "extra")
    path = extra / "model-00001-of-00003.safetensors"
    tensors = load_file(str(path))
    tensors["language_model.model.layers.0.self_attn.indexer.wk.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(path))
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.model.layers.0.self_attn.indexer.wk.weight"] = path.name
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="indexer.wk.weight is not used by the conversion"):
        horizon.load(extra)
    gone = _copy(k3_dir, tmp_path / "gone")
    name = "language_model.model.layers.4.block_sparse_moe.routed_expert_norm.weight"
    index = json.loads((gone / "model.safetensors.index.json").read_text())
    path = gone / index["weight_map"].pop(name)
    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path))
    (gone / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor {name} is missing"):
        horizon.load(gone)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(quantization_config={"quant_method": "gptq"}) or c["text_config"].pop("quantization_config"),
     "quant_method='gptq' is not supported; supported: 'compressed-tensors'"),
    (lambda c: [g.update(format="nvfp4-pack-quantized") for q in (c, c["text_config"])
                for g in (q["quantization_config"], q["quantization_config"]["config_groups"]["group_0"])],
     "format \\['nvfp4-pack-quantized'\\] is not supported"),
    (lambda c: c.update(hidden_size=128), "'hidden_size' is 128 at the top level but 64 in text_config"),
    (lambda c: c.pop("text_config"), "'text_config' must be an object"),
    (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act'='gelu' is not supported"),
    (lambda c: c["text_config"]["linear_attn_config"].update(gate_lower_bound=2.0),
     "kda_gate_lower_bound=2.0 is invalid"),
    (lambda c: c["text_config"].update(mla_use_nope=False), "mla_use_nope'=False is not supported"),
])
def test_bad_configs_are_one_clear_error(k3_dir, tmp_path, change, message):
    bad = _copy(k3_dir, tmp_path / "bad")
    _edit_config(bad, change)
    with pytest.raises(ValueError, match=message):
        horizon.load(bad)


# --- served ------------------------------------------------------------------------------------------------
def test_generate_and_serve_a_k3_checkpoint(k3_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "horizon.cli", "generate", "--model", str(k3_dir), "--prompt",
                          "What is 2 + 2?", "--max-tokens", "6"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[length; 6 tokens" in out.stdout
    from openai import OpenAI

    from .test_serve_process import start

    proc, url = start(tmp_path, "--max-model-len", "512", model=str(k3_dir))
    try:
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(model="tiny-k3", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
        assert client.models.list().data[0].id
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# --- inspect, the command line, convert --to-dsa -------------------------------------------------------------
def test_inspect_checks_the_full_size_released_layout_from_headers_alone(tmp_path):
    from horizon.inspect import inspect_checkpoint

    from .k3_layout import write_sparse_k3

    n = write_sparse_k3(tmp_path / "k3-full")  # 96 shards declaring 1.6 TB, sparse on disk
    report = inspect_checkpoint(tmp_path / "k3-full")
    assert (report["tensors"], report["shards"], report["format"], report["checked"]) == (n, 96, "kimi_k3", True)
    assert round(report["plan"]["total_params"] / 1e9) == 2779 and round(report["plan"]["active_params"] / 1e8) == 1054
    assert round(report["bytes_by_dtype"]["U8"] / 1e9) == round(
        report["plan"]["routed_expert_bytes_mxfp4"] / 1e9)  # the packed experts and their scales, as planned
    # a shape that differs from the config is named, without reading any data
    index = json.loads((tmp_path / "k3-full" / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.7.self_attn.o_proj.weight"
    path = tmp_path / "k3-full" / index[name]
    raw = path.read_bytes()[:200_000_000]
    assert b'"' + name.encode() + b'"' in raw
    with open(path, "r+b") as fh:  # patch the header in place: [7168, 12288] -> [7168, 12289]
        data = fh.read(8 + int.from_bytes(raw[:8], "little"))
        at = data.index(name.encode())
        at = data.index(b"[7168,12288]", at) if b"[7168,12288]" in data[at:] else data.index(b"[7168, 12288]", at)
        fh.seek(at)
        fh.write(data[at:at + 13].replace(b"12288", b"12289"))
    with pytest.raises(ValueError, match=rf"tensor {name} has shape \[7168, 12289\], expected \[7168, 12288\]"):
        inspect_checkpoint(tmp_path / "k3-full")


def test_export_and_inspect_commands(k3_dir, tmp_path, capsys):
    from horizon.cli import main

    assert main(["export", "--format", "kimi-k3", str(k3_dir), str(tmp_path / "out")]) == 0
    assert "in Kimi K3's layout" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "kimi_k3" and report["experts"] == "mxfp4" and report["checked"]
    bad = subprocess.run([sys.executable, "-m", "horizon.cli", "inspect", str(tmp_path)], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "config.json" in bad.stderr and "Traceback" not in bad.stderr


def test_to_dsa_on_a_k3_checkpoint_keeps_its_gate_and_its_logits(k3_dir):
    from horizon.interop.convert import to_dsa

    model = horizon.load(k3_dir, dtype=torch.float32)
    sparse = to_dsa(model, index_topk=16)
    assert sparse.config.index_n_heads >= 8 and sparse.config.dsa_gate_full_rank and not sparse.config.dsa_gate_rank
    assert isinstance(sparse.layers[1].mlp.experts, MXFP4Experts)
    ids = prompt(16, seed=9)  # within index_topk: every position selected, so the same logits
    with torch.no_grad():
        assert (sparse(ids) - model(ids)).abs().max() < 1e-5
        longer = prompt(40, seed=9)
        assert not torch.allclose(sparse(longer), model(longer))  # beyond it the (untrained) indexer selects


@pytest.mark.parametrize("which", ["checkpoint", "six-layers"])
def test_the_compiled_decode_step_runs_k3_without_graph_breaks_and_matches_eager(k3_dir, which):
    """The runner's decode step compiles a K3 model (attention residuals, latent experts, K3's KDA) as one graph
    (fullgraph: a break would raise) and gives the eager step's logits: the K3 checkpoint (MXFP4 experts, two
    sequences), and tiny's six layers with K3's pieces at one sequence, where the mix over a stacked
    [sources, N, d] tensor came out wrong from inductor's small-matmul decomposition (attn_res.py)."""
    from horizon.engine.runner import ModelRunner, StepInputs
    from horizon.model import HorizonCache

    from .conftest import K3_PIECES, tiny_model

    model = horizon.load(k3_dir, dtype=torch.float32) if which == "checkpoint" else tiny_model(**K3_PIECES)
    n = 2 if which == "checkpoint" else 1
    runners = [ModelRunner(model, HorizonCache(model.config, 2, 96, dtype=torch.float32, block_size=16),
                           compile=c, buckets=(n,)) for c in (True, False)]
    ps = [prompt(9, seed=10)[0].tolist(), prompt(14, seed=11)[0].tolist()][:n]
    for r in runners:
        for slot, p in enumerate(ps):
            r.cache.reset([slot])
            r.run(StepInputs([p], [0], [slot]))
    pos, nxt = [len(p) for p in ps], [[p[-1]] for p in ps]
    for _ in range(5):
        step = StepInputs(nxt, list(pos), list(range(n)))
        a, b = (r.run(step) for r in runners)
        assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max()))
        nxt, pos = [[int(t)] for t in b.argmax(-1)], [x + 1 for x in pos]
    assert runners[0].graphs_seen  # it did run compiled
