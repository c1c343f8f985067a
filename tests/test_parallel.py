"""Tensor and expert parallelism on 2 gloo ranks against one process (horizon.parallel).

The ranks are started once for the module (torchrun over tests/_parallel_ranks.py, a 60 s collective
timeout so a bug fails instead of hanging); each runs every check and both ranks' results come back
here. Single-process checks (the divisibility errors, sliced checkpoint reads) run in this process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from horizon.checkpoint import BUNDLED_DIR, RANDOM, load, open_model
from horizon.engine import Engine
from horizon.parallel.shard import Layout, model_splits, shard_model
from tests import _parallel_ranks as ranks
from tests.conftest import tiny

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "results.json"
    env = {**os.environ, "HORIZON_TEST_OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "-m", "tests._parallel_ranks"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for r, rank in enumerate(data["ranks"]):
        assert rank["error"] is None, f"rank {r} failed:\n{rank['error']}"
    return [rank["results"] for rank in data["ranks"]]


PARITY = ["kda", "dsa_dense_expanded", "dsa_sparse_expanded", "dsa_dense_absorbed", "dsa_sparse_absorbed",
          "dense_mlp", "moe_tp", "moe_ep", "moe_tp_mxfp4", "moe_ep_mxfp4", "kda_mxfp4_attention_tp",
          "kda_mxfp4_attention_ep", "model_logits", "k3_fp32_tp", "k3_fp32_ep", "k3_mxfp4_tp", "k3_mxfp4_ep"]
EXACT = ["round_trip_fp32_tp", "round_trip_fp32_ep", "round_trip_mxfp4_tp", "round_trip_mxfp4_ep", "model_argmax",
         "selections_identical"]


@pytest.mark.parametrize("check", PARITY)
def test_sharded_matches_one_process(rank_results, check):
    """Modules (sharded, then all-reduced) and the full model through chunked prefill + cached decode: fp32
    outputs within 1e-4 of the unsharded ones, on both ranks."""
    for results in rank_results:
        assert results[check] <= ranks.TOL, (check, results[check])


@pytest.mark.parametrize("check", EXACT)
def test_exact_properties(rank_results, check):
    """Shard -> gather gives back the full state dict bit for bit (MXFP4 included); argmax equal; indexer
    selections identical on every rank."""
    for results in rank_results:
        assert results[check] == 0.0, check


def test_engine_on_two_ranks_matches_one_process(rank_results):
    """Greedy, seeded, mixed prefill/decode, prefix reuse and cancellation: the same tokens as one process."""
    bundle = open_model(RANDOM)
    single = ranks.engine_scenario(Engine(bundle.model, bundle.tokenizer, ranks.ENGINE, bundle.generation_config))
    got = rank_results[0]["engine"]
    assert got == single
    assert single["prefix_hits"] >= 1 and single["cancelled"][-1] == "cancelled" and len(single["cancelled"]) == 4


def test_sliced_checkpoint_read_equals_sharding_the_full_model():
    """load(layout=...) reads only a rank's slices; they equal cutting the fully loaded model."""
    full = load(BUNDLED_DIR)
    for layout in (Layout(2, 1), Layout(2, 0, ep=True)):
        part = load(BUNDLED_DIR, layout=layout)
        want = shard_model(load(BUNDLED_DIR), layout).state_dict()
        got = part.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        # really a part: the split tensors are smaller than the full ones
        splits = model_splits(part, layout)
        assert splits and all(got[k].numel() * 2 == full.state_dict()[k].numel() for k in splits
                              if not k.endswith("bias"))


@pytest.mark.parametrize("ep", [False, True])
def test_a_k3_checkpoint_read_for_a_rank_equals_sharding_the_loaded_model(tmp_path, ep):
    """Kimi K3's layout read for one rank (experts placed part by part: whole experts under expert
    parallelism, each expert's slice otherwise) equals cutting the fully loaded model."""
    from tests.k3_layout import write_k3

    write_k3(tmp_path / "k3", seed=1, moe_intermediate_size=64)  # two MXFP4 blocks a row: TP=2 can split them
    for rank in (0, 1):
        layout = Layout(2, rank, ep=ep)
        got = load(tmp_path / "k3", layout=layout).state_dict()
        want = shard_model(load(tmp_path / "k3"), layout).state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_sizes_that_do_not_divide_are_refused_before_loading():
    with pytest.raises(ValueError, match=r"size 4 must divide every sharded size, and does not divide: "
                                         r"kda_num_heads=2$"):
        Layout(4).check(tiny())
    # tiny's experts are 32 wide: one MXFP4 block, which 2 ranks cannot split; EP can take whole experts
    with pytest.raises(ValueError, match=r"moe_intermediate_size=32 \(32-value MXFP4 blocks: 1\).*expert-parallel"):
        Layout(2).check(tiny(), mxfp4_experts=True)
    Layout(2, ep=True).check(tiny(), mxfp4_experts=True)
    with pytest.raises(ValueError, match="n_routed_experts=8"):
        Layout(3, ep=True).check(tiny(kda_num_heads=3, num_heads=3, intermediate_size=129, n_shared_experts=0))
    with pytest.raises(ValueError, match="0 <= rank < tp"):
        Layout(2, 2)
