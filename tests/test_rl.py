"""Joint RL: per-domain reward normalisation, and a tiny GRPO run end to end (rollouts, loss, resume)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from horizon.chat import load_tokenizer
from horizon.checkpoint import save
from horizon.cli import main
from horizon.train.data import Example, collate
from horizon.train.rl import RewardNormalizer, RLTrainer, advantages, rollout_examples, token_weights

from .conftest import tiny_model


def _simulated_steps(normalizer, steps=150, group=8, seed=0, clip=5.0):
    """Advantages as RL computes them, over steps of 4 groups of each of two domains: "small" scored in
    {0, 1} and "large" the same kind of task scored in {0, 100}. Each task has its own success rate."""
    rng = random.Random(seed)
    out = {"small": [], "large": []}
    for _ in range(steps):
        domains, groups, rewards = [], [], []
        for g in range(8):
            name, scale = ("small", 1.0) if g % 2 else ("large", 100.0)
            p = rng.random()  # this task's difficulty
            for _ in range(group):
                domains.append(name)
                groups.append(g)
                rewards.append(scale * float(rng.random() < p))
        if normalizer is not None:
            for name in out:
                normalizer.update(name, [r for d, r in zip(domains, rewards, strict=True) if d == name])
        for d, a in zip(domains, advantages(domains, groups, rewards, normalizer, clip=clip), strict=True):
            out[d].append(abs(a))
    return {name: sum(v) / len(v) for name, v in out.items()}


def _saved_tiny(tmp_path):
    """The tiny test model as a checkpoint with small thinking budgets, for runs through the CLI."""
    init = tmp_path / "init"
    save(tiny_model(), init, tokenizer=load_tokenizer(),
         generation_config={"thinking_budgets": {"low": 4, "high": 8, "max": 16}})
    return init


def test_per_domain_normalisation_equalises_a_domain_with_100x_rewards():
    # what the gradient sees: the mean |advantage| per domain, with and without the normaliser
    raw = _simulated_steps(None, clip=float("inf"))  # (unclipped: the clip would hide the raw scale)
    assert raw["large"] > 50 * raw["small"]  # unnormalised, the 100x domain drowns the other
    norm = _simulated_steps(RewardNormalizer())
    assert 0.8 < norm["large"] / norm["small"] < 1.25  # normalised, they weigh the same
    assert 0.2 < norm["small"] < 1.5  # and on a unit scale


def test_the_normaliser_keeps_running_statistics_per_domain():
    rng = random.Random(0)
    small = [float(rng.random() < 0.3) for _ in range(400)]
    large = [100.0 * float(rng.random() < 0.7) for _ in range(400)]
    norm = RewardNormalizer()
    for i in range(0, 400, 8):  # a batch per step, as RL feeds it
        norm.update("small", small[i: i + 8])
        norm.update("large", large[i: i + 8])
    for name, rewards in (("small", small), ("large", large)):
        z = torch.tensor([norm.normalize(name, r) for r in rewards])
        assert abs(float(z.mean())) < 1e-6 and abs(float(z.std()) - 1) < 0.01
    assert norm.normalize("unseen", 3.0) == pytest.approx(3.0)  # no statistics yet: mean 0, std 1


def test_advantages_are_centred_per_group_and_a_thinking_cost_stays_small():
    norm = RewardNormalizer()
    norm.update("d", [0.0, 1.0] * 50)  # std 0.5
    # a mixed group: centred, in units of the domain's std
    adv = advantages(["d"] * 4, [0] * 4, [1.0, 0.0, 0.0, 0.0], norm)
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-4)
    # an all-correct group that differs only in thinking: the cost is a small signal, not a unit one...
    costs = [0.02, 0.04, 0.06, 0.08]
    adv = advantages(["d"] * 4, [0] * 4, [1.0] * 4, norm, costs)
    assert adv == pytest.approx([0.03, 0.01, -0.01, -0.03], abs=1e-6)
    # ...unless each group is also divided by its own spread (the original GRPO): then it is full size
    adv = advantages(["d"] * 4, [0] * 4, [1.0] * 4, norm, costs, group_std=True)
    assert max(abs(a) for a in adv) > 1
    # equal values give 0; huge ones are clipped
    assert advantages(["d"] * 3, [0] * 3, [1.0] * 3, norm) == [0.0, 0.0, 0.0]
    assert max(advantages(["d"] * 8, [0] * 8, [1e6] + [0.0] * 7, norm, clip=5.0)) == 5.0


def test_shared_tokens_cancel_in_the_policy_loss_and_logprobs_are_at_the_sampling_temperature():
    model = tiny_model()
    # one group of two rollouts: the same prompt and opening, then one short and one long ending
    prompt, shared = [5, 6, 7, 8], [20, 21, 22, 23, 24, 25]
    short, long = shared + [30, 31], shared + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    examples = [Example(prompt + g, [False] * len(prompt) + [True] * len(g)) for g in (short, long)]
    batch = collate(examples, 64, model.config, image_token_id=3)
    with torch.no_grad():
        logp, mask = RLTrainer._token_logprobs(model, batch, 0.7)
        # at temperature 0.7: log_softmax(logits / 0.7) of the generated tokens
        logits = model(batch["ids"], lengths=batch["lengths"]).float() / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, batch["targets"].clamp_min(0)[..., None])[..., 0] * mask
    assert torch.allclose(logp, want, atol=1e-5)
    assert torch.allclose(logp[:, 3:9][0], logp[:, 3:9][1], atol=1e-5)  # the shared opening, same context

    # advantages +1 / -1: the shared opening's terms cancel exactly, whatever the two lengths
    n_tokens = mask.sum(-1)
    weight = token_weights([1.0, -1.0], n_tokens)
    assert weight[0] == -weight[1] == pytest.approx(1.0 / float(n_tokens.mean()) / 2)
    loss = -(weight * logp.sum(-1)).sum()
    tail = logp.clone()
    tail[:, : len(prompt) - 1 + len(shared)] = 0  # the endings' tokens only
    assert float(loss) == pytest.approx(float(-(weight * tail.sum(-1)).sum()), abs=1e-5)
    # dividing each rollout by its own length would not cancel them
    own = torch.tensor([1.0, -1.0]) / n_tokens / 2
    assert abs(float(-(own * logp.sum(-1)).sum() + (own * tail.sum(-1)).sum())) > 1e-3


def _turn(prompt, gen):
    return SimpleNamespace(response={"prompt_ids": prompt, "token_ids": gen})


def test_rollout_sequences_are_the_engines_own_tokens():
    # step 2's prompt extends step 1's prompt + reply (a tool result follows): one sequence
    one = rollout_examples([_turn([1, 2, 3], [4, 5]), _turn([1, 2, 3, 4, 5, 6, 7], [8, 9])], [])
    assert [(e.ids, e.mask) for e in one] == [([1, 2, 3, 4, 5, 6, 7, 8, 9],
                                               [False, False, False, True, True, False, False, True, True])]
    # the history was rendered differently from what the model sampled: two sequences, each exact
    two = rollout_examples([_turn([1, 2, 3], [4, 5]), _turn([1, 2, 3, 40, 6], [8])], [])
    assert [(e.ids, e.mask) for e in two] == [([1, 2, 3, 4, 5], [False] * 3 + [True] * 2),
                                              ([1, 2, 3, 40, 6, 8], [False] * 5 + [True])]
    # a token the engine forced (the end of thinking at the budget) is in the sequence but not trained on
    forced = rollout_examples([SimpleNamespace(response={"prompt_ids": [1, 2], "token_ids": [4, 5, 6],
                                                         "forced": [1]})], [])
    assert [(e.ids, e.mask) for e in forced] == [([1, 2, 4, 5, 6], [False, False, True, False, True])]
    with pytest.raises(ValueError, match="EngineClient"):
        rollout_examples([SimpleNamespace(response={"finish": "stop"})], [])


def test_a_tiny_rl_run_rolls_out_updates_and_resumes(tmp_path, capsys):
    init = _saved_tiny(tmp_path)
    out = tmp_path / "rl"
    args = ["rl", "--init", str(init), "--out", str(out), "--domains", "arithmetic,convert", "--prompts", "2",
            "--group", "2", "--tiers", "none,low", "--max-tokens", "12", "--episode-steps", "2", "--kl", "0.1",
            "--thinking-cost", "0.1", "--tier-per-group", "--lr", "1e-3", "--save-every", "1", "--no-progress"]
    validation = ["--eval-every", "1", "--eval-n", "2", "--eval-tier", "none"]
    assert main([*args, "--steps", "1", *validation]) == 0
    capsys.readouterr()
    # a resume with no other options: the run's own settings, validation included (and the engine is sized
    # from them, not from the command line's defaults)
    assert main(["rl", "--out", str(out), "--steps", "2", "--resume", "--no-progress"]) == 0
    assert "arithmetic,convert, 2 tasks x 2 rollouts per step, step 1 -> 2" in capsys.readouterr().out
    state = json.loads((out / "checkpoint" / "trainer_state" / "state.json").read_text())
    assert state["step"] == 2 and len(state["log"]) == 2
    assert state["extra"]["next_seed"] == 4  # two tasks per step, counted across the resume
    # held-out validation before the first step and after each, not repeated at the resume
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert [e["step"] for e in heldout] == [0, 1, 2] == [e["step"] for e in state["heldout"]]
    assert all(set(e["domains"]) == {"arithmetic", "convert"} and e["domains"]["convert"]["n"] == 2 for e in heldout)
    # a spent compute budget stops the run after the step in progress, with a checkpoint
    assert main([*args, "--steps", "50", "--resume", "--max-minutes", "1e-9"]) == 0
    assert json.loads((out / "checkpoint" / "trainer_state" / "state.json").read_text())["step"] == 3
    for entry in state["log"]:
        assert entry["kl"] >= 0 and set(entry["domains"]) <= {"arithmetic", "convert"}
        assert sum(d["rollouts"] for d in entry["domains"].values()) == 4
        for d in entry["domains"].values():  # per tier; one tier per group of 2 (--tier-per-group)
            assert set(d["tiers"]) <= {"none", "low"}
            assert sum(t["rollouts"] for t in d["tiers"].values()) == d["rollouts"]
            assert all(t["rollouts"] % 2 == 0 for t in d["tiers"].values())
            assert all(t["cost"] == pytest.approx(0.1 * t["thinking_tokens"] / 4) for k, t in d["tiers"].items()
                       if k == "low")  # the cost per whole budget of the tier (low: 4 tokens)
    config = json.loads((out / "rl_config.json").read_text())  # the settings fixed at the run's start
    assert config["rl"]["thinking_cost"] == 0.1 and config["rl"]["tier_per_group"]
    assert config["thinking_budgets"] == {"low": 4, "high": 8, "max": 16} and config["init"] == str(init)
    assert (out / "rl_curves.png").exists() and (out / "rl_log.jsonl").exists()


def test_a_stopped_and_resumed_rl_run_repeats_the_uninterrupted_one(tmp_path):
    """Same rollouts, same losses, same KL: the resumed run keeps its KL anchor at the initial policy (not
    the weights it resumes from) and its sampler, task counter and reward statistics where they were."""
    init = _saved_tiny(tmp_path)
    args = ["rl", "--init", str(init), "--domains", "arithmetic", "--prompts", "2", "--group", "2",
            "--max-tokens", "10", "--episode-steps", "1", "--kl", "1.0", "--lr", "3e-2", "--warmup", "0",
            "--train-flat", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "whole"), "--steps", "3"]) == 0
    # stopped after its first step by a spent compute budget (a shorter --steps would change the schedule)
    assert main([*args, "--out", str(tmp_path / "part"), "--steps", "3", "--max-minutes", "1e-9"]) == 0
    assert main([*args, "--out", str(tmp_path / "part"), "--steps", "3", "--resume"]) == 0
    logs = [json.loads((tmp_path / run / "checkpoint" / "trainer_state" / "state.json").read_text())["log"]
            for run in ("whole", "part")]
    assert logs[0][-1]["kl"] > 0  # the policy has moved from its anchor, so a moved anchor would show
    for a, b in zip(*logs, strict=True):
        for key in ("loss", "pg_loss", "kl", "tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (a["step"], key)


def test_rl_and_train_start_from_the_bundled_mxfp4_model_and_keep_its_experts_as_served(tmp_path):
    from safetensors.torch import load_file

    from horizon.checkpoint import BUNDLED_DIR

    shipped = load_file(BUNDLED_DIR / "model.safetensors")
    rl, sft = tmp_path / "rl", tmp_path / "sft"
    assert main(["rl", "--out", str(rl), "--domains", "arithmetic", "--prompts", "1", "--group", "2",
                 "--max-tokens", "24", "--episode-steps", "1", "--steps", "1", "--lr", "1e-3", "--train-flat",
                 "--no-progress"]) == 0
    assert main(["train", "--init", "bundled", "--out", str(sft), "--domains", "arithmetic", "--per-domain", "4",
                 "--batch-size", "2", "--steps", "1", "--lr", "1e-3", "--warmup", "0", "--no-progress"]) == 0
    for run in (rl, sft):
        config = json.loads((run / "checkpoint" / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "mxfp4"
        trained = load_file(run / "checkpoint" / "model.safetensors")
        experts = [k for k in shipped if "_blocks" in k or "_scales" in k]
        assert experts and all(torch.equal(trained[k], shipped[k]) for k in experts)  # frozen, byte for byte
        # the rest trains (in RL at least the DSA indexers: with --train-flat their sparse-stage loss runs on
        # every rollout, whatever the rewards)
        part = ".indexer." if run == rl else "embed."
        assert any(not torch.equal(trained[k], shipped[k]) for k in shipped if part in k)


def test_the_loss_scores_rollouts_with_the_log_probabilities_the_engine_sampled_them_from():
    """On-policy means the trainer's forward (padded batch, chunkwise KDA, sparse selection over the whole
    sequence) gives the probabilities the engine's batched decode (recurrent KDA, DSA over its cache) drew
    each token from; a mismatch would bias every update (the training-inference mismatch of RL systems).
    The bundled MXFP4 model, on prompts longer than its sparse top-k, sampled at temperature 1."""
    from horizon.chat.template import ChatTemplate
    from horizon.checkpoint import open_model
    from horizon.engine import Engine, EngineConfig
    from horizon.engine.params import Request, SamplingParams, TokenEvent
    from horizon.tasks import get_domain

    bundle = open_model("bundled", dtype=torch.float32)  # as horizon rl opens it
    model, tokenizer = bundle.model, bundle.tokenizer
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=8, max_batch_tokens=2048),
                    generation_config=bundle.generation_config)
    template = ChatTemplate(tokenizer)
    requests = []
    for domain in ("passkey-short", "recall"):
        for seed in range(3):
            prompt = template.render(get_domain(domain).generate(seed, "train").messages, tier="low",
                                     add_generation_prompt=True).ids
            requests.append(Request(list(prompt), SamplingParams(max_tokens=48, temperature=1.0, logprobs=0,
                                                                 tier="low", seed=seed)))
    assert max(len(r.prompt_ids) for r in requests) > model.config.index_topk  # the sparse selection is used
    results = engine.generate(requests)
    examples = [Example(q.prompt_ids + r.token_ids, [False] * len(q.prompt_ids) + [True] * len(r.token_ids))
                for q, r in zip(requests, results, strict=True)]
    model.train()  # as in the update
    with torch.no_grad():
        logp, mask = RLTrainer._token_logprobs(model, collate(examples, 4096, model.config, tokenizer.special.image))
    for row, (m, result) in enumerate(zip(mask.bool(), results, strict=True)):
        sampled = torch.tensor([e.logprob for e in result.events if isinstance(e, TokenEvent)])
        assert len(sampled) == len(result.token_ids) == int(m.sum())
        torch.testing.assert_close(logp[row][m], sampled, atol=1e-4, rtol=0)


def test_skipping_rollouts_with_no_advantage_leaves_the_policy_gradient_unchanged(tmp_path, monkeypatch):
    """Near the ceiling most groups score alike; the update skips their rollouts, which must change nothing
    in the policy gradient (their weight is 0 and the others' weights are computed over all rollouts)."""
    import horizon.train.rl as rl_module

    init = _saved_tiny(tmp_path)
    # 3 tasks x 2 rollouts: the first group disagrees, the other two are flat
    monkeypatch.setattr(rl_module, "advantages", lambda domains, *a, **k: [0.7, -0.7] + [0.0] * (len(domains) - 2))
    grads = {}

    def capture(self, loss):
        grads[self.rl.train_flat] = {n: p.grad.clone() for n, p in self.model.named_parameters()
                                     if p.grad is not None}
        self.step_idx += 1  # no optimiser step: the gradients are what is compared
        return 0.0

    monkeypatch.setattr(rl_module.RLTrainer, "apply_update", capture)
    logs = {}
    for flag in ([], ["--train-flat"]):
        out = tmp_path / f"rl{len(flag)}"
        assert main(["rl", "--init", str(init), "--out", str(out), "--domains", "arithmetic", "--prompts", "3",
                     "--group", "2", "--max-tokens", "8", "--episode-steps", "1", "--no-indexer-loss",
                     "--steps", "1", "--save-every", "1", "--no-progress", *flag]) == 0
        logs[bool(flag)] = json.loads((out / "rl_log.jsonl").read_text().splitlines()[0])
    assert logs[False]["trained_rollouts"] == 2 and logs[True]["trained_rollouts"] == 6
    assert logs[False]["sequences"] < logs[True]["sequences"]
    assert grads[False].keys() == grads[True].keys() and grads[False]
    for name, g in grads[True].items():
        torch.testing.assert_close(grads[False][name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_guidance_teaches_a_task_the_policy_fails_in_every_sample(tmp_path):
    """--guide adds the task's reference trajectory to its group: the untrained model fails every rollout
    (a flat group, nothing for plain GRPO to learn), yet the update raises the reference's probability."""
    from horizon.checkpoint import load
    from horizon.tasks import get_domain
    from horizon.train.data import task_example

    init = _saved_tiny(tmp_path)
    tokenizer = load_tokenizer()
    tasks = [get_domain("arithmetic").generate(seed, "train") for seed in (0, 1)]  # the run's tasks (--seed 0)

    def reference_logp(folder):
        model = load(folder).eval()
        batch = collate([task_example(tokenizer, model.config, t, "low") for t in tasks], 2048, model.config,
                        tokenizer.special.image)
        with torch.no_grad():
            return RLTrainer._token_logprobs(model, batch)[0].sum(-1)

    out = tmp_path / "rl"
    base = ["rl", "--init", str(init), "--out", str(out), "--domains", "arithmetic", "--prompts", "2", "--group",
            "2", "--max-tokens", "8", "--episode-steps", "1", "--lr", "1e-3", "--warmup", "0", "--steps", "1",
            "--save-every", "1", "--no-progress"]
    assert main([*base, "--guide"]) == 0
    entry = json.loads((out / "rl_log.jsonl").read_text().splitlines()[0])
    assert entry["domains"]["arithmetic"]["accuracy"] == 0.0 and entry["domains"]["arithmetic"]["rollouts"] == 4
    assert entry["guided_groups"] == 2 and entry["trained_rollouts"] == 6  # 2 x (2 failures + the reference)
    before, after = reference_logp(init), reference_logp(out / "checkpoint")
    assert (after > before).all(), (before, after)
    # without guidance the same all-failed groups are flat: no rollout is trained on
    assert main([*base[:4], str(tmp_path / "plain"), *base[5:]]) == 0
    assert json.loads((tmp_path / "plain" / "rl_log.jsonl").read_text())["trained_rollouts"] == 0
