"""FSDP2 training on 2 gloo ranks against one process (horizon.parallel.fsdp, `horizon train` under torchrun).

The ranks are started once for the module (torchrun over tests/_fsdp_ranks.py, a 60 s collective timeout so
a bug fails instead of hanging); each computes its one-process references before joining the group, runs
every check sharded, and runs `horizon train` (straight; stopped and resumed). Both ranks' records come
back here; the one-rank `horizon train` run and the file comparisons run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from horizon.checkpoint import load, save
from horizon.cli import main
from horizon.server.background import free_port
from tests import _fsdp_ranks as ranks
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    (root / "chats.jsonl").write_text("\n".join(json.dumps(c) for c in ranks.chats()) + "\n")
    save(tiny_model(seed=1), root / "tiny", tokenizer=ranks.TOK)  # where `horizon rl` starts
    env = {**os.environ, "HORIZON_TEST_DIR": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "-m", "tests._fsdp_ranks"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def rank_results(run_dir):
    data = json.loads((run_dir / "results.json").read_text())
    for r, rank in enumerate(data["ranks"]):
        assert rank["error"] is None, f"rank {r} failed:\n{rank['error']}"
    return [rank["results"] for rank in data["ranks"]]


def test_gradients_of_one_step_equal_one_process(rank_results):
    """fp64 against one process over the same row groups (only the order of the final sum differs), and fp32
    against one process on the whole batch; the vision encoder's gradient comes from one rank's image."""
    for results in rank_results:
        assert results["grads_fp64_same_rows"] <= ranks.FP64_GRAD_TOL
        assert results["grads_fp64_same_rows_k3"] <= ranks.FP64_GRAD_TOL  # Kimi K3's pieces
        assert results["grads_fp32_whole_batch"] <= ranks.FP32_GRAD_TOL


@pytest.mark.parametrize("stage", list(ranks.RUNS))
def test_a_few_steps_equal_one_process(rank_results, stage):
    """Logged numbers (loss, gradient norm, counts), parameters and the MoE balancing bias after a few AdamW
    steps equal one process's; the bias is identical on both ranks."""
    for results in rank_results:
        assert results[f"{stage}_log_keys_equal"] and results[f"{stage}_counts_equal"]
        assert results[f"{stage}_loss_rel"] <= ranks.FP32_LOSS_TOL
        assert results[f"{stage}_grad_norm_rel"] <= ranks.FP32_GRAD_NORM_TOL
        assert results[f"{stage}_params_rel"] <= ranks.FP32_PARAM_TOL
        assert results[f"{stage}_same_params_moved"]
        assert results[f"{stage}_bias_same_on_ranks"] and results[f"{stage}_bias_moved"]
        assert results[f"{stage}_bias_vs_one_process"] == 0.0


def test_validation_decodes_a_gathered_copy_like_one_process(rank_results):
    for results in rank_results:
        assert results["gathered_equals_model"] and results["heldout_equal"] and results["gathered_mxfp4_equal"]


def test_what_cannot_run_sharded_is_refused_on_every_rank(rank_results):
    for results in rank_results:
        assert "smaller than the 2 ranks" in results["refused_small_batch"]
        assert "--stage sparse does not run under FSDP" in results["refused_indexer_stage"]
        assert "the training data differs between the ranks" in results["refused_different_data"]


def _log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank(run_dir):
    """The same `horizon train` in one process (no torchrun), on one thread as each rank computes: a
    different thread count changes the matmuls' rounding, and a routing decision that flips with it moves
    a one-process run's own losses by 1e-4."""
    out = run_dir / "one"
    args = ["train", "--data", str(run_dir / "chats.jsonl"), "--domains", "image", "--per-domain", "3",
            "--batch-size", "4", "--max-len", "128", "--lr", "5e-3", "--warmup", "2", "--seed", "3",
            "--save-every", "3", "--no-progress", "--out", str(out), "--steps", "6"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_two_rank_train_resumes_exactly(rank_results, run_dir):
    assert all(results["cli_rc"] == [0, 0, 0, 0] for results in rank_results)
    straight, resumed = run_dir / "two-straight", run_dir / "two-resumed"
    assert _log(resumed) == [{**e, "tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"]}
                             for e, r in zip(_log(straight), _log(resumed), strict=True)]
    for name in ("model.safetensors", "trainer_state/state.safetensors"):
        a, b = load_file(straight / "checkpoint" / name), load_file(resumed / "checkpoint" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert sorted(p.name for p in straight.iterdir()) == ["checkpoint", "train_curves.png", "train_log.jsonl"]


def test_two_rank_train_matches_one_rank(run_dir, one_rank):
    """Losses within fp32 reduction-order tolerance of one process (the first step's tightly: the same weights;
    later ones as far as AdamW moves the two runs' weights apart); the checkpoint has the one-process layout
    (the same safetensors keys, shapes and dtypes, weights and trainer state) and loads like it."""
    two, one = _log(run_dir / "two-straight"), _log(one_rank)
    assert [e["step"] for e in two] == [e["step"] for e in one] == list(range(1, 7))
    for a, b in zip(two, one, strict=True):
        assert (a["tokens"], a["target_tokens"], a["lr"]) == (b["tokens"], b["target_tokens"], b["lr"])
        loss_tol = ranks.FP32_LOSS_TOL if a["step"] == 1 else ranks.FP32_LOSS_DRIFT_TOL
        for key, tol in (("loss", loss_tol), ("grad_norm", ranks.FP32_GRAD_NORM_TOL)):
            assert abs(a[key] - b[key]) <= tol * abs(b[key]), (key, a[key], b[key])
    for name in ("model.safetensors", "trainer_state/state.safetensors"):
        a = load_file(run_dir / "two-straight" / "checkpoint" / name)
        b = load_file(one_rank / "checkpoint" / name)
        assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}, name
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        two_file, one_file = run_dir / "two-straight" / "checkpoint" / name, one_rank / "checkpoint" / name
        assert two_file.read_bytes() == one_file.read_bytes(), name
    two_model, one_model = load(run_dir / "two-straight" / "checkpoint"), load(one_rank / "checkpoint")
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        # after 6 AdamW steps the runs' weights have drifted apart by reduction order (_fsdp_ranks,
        # FP32_LOSS_DRIFT_TOL), so this is loose; the first step's loss above is the tight check
        assert torch.allclose(two_model(ids), one_model(ids), rtol=0, atol=ranks.DRIFT_LOGITS_ATOL)


def test_rl_step_on_two_ranks_equals_one_process(rank_results):
    """Each rank rolls out its own groups on an unsharded copy of the weights and trains on them under FSDP:
    the same rollouts, rewards and counts as one process; losses, gradients and parameters within fp32 sums;
    the rollout copy holds the weights the previous update left. The indexer loss is refused."""
    for results in rank_results:
        assert results["rl_exact_equal"]
        assert max(results["rl_loss_rel"]) <= ranks.FP32_LOSS_TOL  # loss, policy-gradient loss, gradient norm
        (first, first_ref), (later, later_ref) = results["rl_kl"]
        assert first == first_ref == 0.0 and abs(later - later_ref) <= ranks.KL_TOL * later_ref
        assert results["rl_grads_rel"] <= ranks.FP32_GRAD_TOL
        assert results["rl_params_rel"] <= ranks.FP32_PARAM_TOL
        assert results["rl_copy_rel"] <= ranks.FP32_PARAM_TOL
        assert "pass --no-indexer-loss" in results["refused_rl_indexer_loss"]


def test_two_rank_horizon_rl_matches_one_process(run_dir):
    """`horizon rl` on 2 ranks (the command joins the group) against the same command in one process: the same
    rollouts and counts, losses within fp32 sums, and a checkpoint in the one-process layout."""
    one = run_dir / "rl-one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*ranks.RL_CLI, "--init", str(run_dir / "tiny"), "--out", str(one)]) == 0
    finally:
        torch.set_num_threads(threads)
    logs = [[json.loads(line) for line in (run / "rl_log.jsonl").read_text().splitlines()]
            for run in (run_dir / "rl-two", one)]
    assert [e["step"] for e in logs[0]] == [e["step"] for e in logs[1]] == [1, 2]
    for a, b in zip(*logs, strict=True):
        assert {k: a[k] for k in ranks.RL_EXACT} == {k: b[k] for k in ranks.RL_EXACT}
        for key, tol in (("loss", ranks.FP32_LOSS_TOL), ("pg_loss", ranks.FP32_LOSS_TOL),
                         ("grad_norm", ranks.FP32_GRAD_NORM_TOL), ("kl", ranks.KL_TOL)):
            assert abs(a[key] - b[key]) <= tol * abs(b[key]), (key, a[key], b[key])
    a, b = (load_file(run / "checkpoint" / "model.safetensors") for run in (run_dir / "rl-two", one))
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}


def test_rl_under_torchrun_refuses_the_indexer_loss_before_loading(monkeypatch, capsys, tmp_path):
    import horizon.checkpoint

    def no_load(*args, **kwargs):
        raise AssertionError("horizon rl loaded weights before refusing")

    monkeypatch.setattr(horizon.checkpoint, "open_model", no_load)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["rl", "--out", str(tmp_path / "rl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("horizon rl: error: WORLD_SIZE=2: horizon rl under torchrun (FSDP) needs --no-indexer-loss")


def test_torchrun_horizon_train_with_validation(tmp_path):
    """`torchrun --nproc-per-node 2 -m horizon train` itself: the command joins and leaves the group, rank 0
    alone prints and writes, and --eval-every validates on gathered copies (rank 0 driving the engine)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "-m", "horizon", "train", "--out", str(out), "--domains", "arithmetic", "--per-domain", "2",
                           "--batch-size", "2", "--max-len", "64", "--steps", "1", "--eval-every", "1", "--eval-n", "1",
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("horizon train: ") == 1 and "on 2 ranks (FSDP)" in proc.stdout
    assert proc.stdout.count("done: step 1") == 1
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert [e["step"] for e in heldout] == [0, 1] and all(e["domains"]["arithmetic"]["n"] == 1 for e in heldout)
    state = json.loads((out / "checkpoint" / "trainer_state" / "state.json").read_text())
    assert state["step"] == 1 and state["heldout"] == heldout
    load(out / "checkpoint")
