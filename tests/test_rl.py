"""Joint RL: per-domain reward normalisation, and a tiny GRPO run end to end (rollouts, loss, resume)."""

from __future__ import annotations

import json
import random

import torch

from horizon.chat import load_tokenizer
from horizon.checkpoint import save
from horizon.cli import main
from horizon.train.rl import RewardNormalizer

from .conftest import tiny_model


def test_per_domain_normalisation_equalises_a_domain_with_100x_rewards():
    rng = random.Random(0)
    small = [float(rng.random() < 0.3) for _ in range(400)]  # accuracy-like rewards in {0, 1}
    large = [100.0 * float(rng.random() < 0.7) for _ in range(400)]  # the same kind, 100x the scale
    norm = RewardNormalizer()
    for i in range(0, 400, 8):  # as RL sees them: a batch per step
        norm.update("small", small[i: i + 8])
        norm.update("large", large[i: i + 8])
    a = torch.tensor([norm.normalize("small", r) for r in small])
    b = torch.tensor([norm.normalize("large", r) for r in large])
    assert abs(float(a.mean())) < 1e-6 and abs(float(b.mean())) < 1e-6
    assert abs(float(a.std()) - 1) < 0.01 and abs(float(b.std()) - 1) < 0.01
    # raw, the large domain's spread is ~100x the small one's; normalised, the same
    assert float(torch.tensor(large).std()) > 50 * float(torch.tensor(small).std())
    assert abs(float(a.abs().mean()) - float(b.abs().mean())) < 0.2


def test_a_tiny_rl_run_rolls_out_updates_and_resumes(tmp_path):
    init = tmp_path / "init"
    save(tiny_model(), init, tokenizer=load_tokenizer(),
         generation_config={"thinking_budgets": {"low": 4, "high": 8, "max": 16}})
    out = tmp_path / "rl"
    args = ["rl", "--init", str(init), "--out", str(out), "--domains", "arithmetic,convert", "--prompts", "2",
            "--group", "2", "--tiers", "none,low", "--max-tokens", "12", "--episode-steps", "2", "--kl", "0.1",
            "--thinking-cost", "0.1", "--lr", "1e-3", "--save-every", "1", "--no-progress"]
    assert main([*args, "--steps", "1"]) == 0
    assert main([*args, "--steps", "2", "--resume"]) == 0
    state = json.loads((out / "checkpoint" / "trainer_state" / "state.json").read_text())
    assert state["step"] == 2 and len(state["log"]) == 2
    assert state["extra"]["next_seed"] == 4  # two tasks per step, counted across the resume
    for entry in state["log"]:
        assert entry["kl"] >= 0 and set(entry["domains"]) <= {"arithmetic", "convert"}
        assert sum(d["rollouts"] for d in entry["domains"].values()) == 4
    assert (out / "rl_curves.png").exists() and (out / "rl_log.jsonl").exists()
