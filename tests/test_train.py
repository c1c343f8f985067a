"""Training: the loss mask, the schedule, a user's JSONL fine-tune, and stop-and-resume equality."""

from __future__ import annotations

import json

import pytest
import torch

from horizon.chat import load_tokenizer
from horizon.checkpoint import load
from horizon.cli import main
from horizon.tasks import make_split
from horizon.train import Mixture, TrainConfig, Trainer, collate, read_jsonl, render_chat, task_example

from .conftest import K3_PIECES, tiny_model

TOK = load_tokenizer()


def chats(n: int = 6) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(n)]


def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_the_loss_is_on_assistant_tokens_only():
    model = tiny_model()
    ex = render_chat(TOK, model.config, chats(1)[0]["messages"])
    answer = TOK.encode("It is 0.")
    generated = [t for t, m in zip(ex.ids, ex.mask, strict=True) if m]
    assert generated[: len(answer)] == answer and generated[-1] == TOK.special.assistant_end
    batch = collate([ex], 512, model.config, TOK.special.image)
    targets = batch["targets"][0]
    assert targets[targets != -100].tolist() == generated  # each generated token is predicted once


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(0.1) and cfg.lr_at(9) == pytest.approx(1.0)
    lrs = [cfg.lr_at(s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)) and lrs[-1] >= 0.1
    with pytest.raises(ValueError, match="stage"):
        TrainConfig(stage="nope").validate()


@pytest.mark.parametrize("arch", ["tiny", "k3"])
def test_a_user_jsonl_fine_tune_learns_it(tmp_path, arch):
    model = tiny_model(**(K3_PIECES if arch == "k3" else {}))  # k3: gradients through K3's pieces
    data = read_jsonl(write_jsonl(tmp_path / "chats.jsonl", chats()), TOK, model.config)
    config = TrainConfig(steps=40, batch_size=4, lr=1e-2, warmup_steps=4, save_every=40, max_len=128)
    log = Trainer(model, TOK, Mixture({"data": data}), config, tmp_path / "run").train(progress=False)
    first, last = log[0]["loss"], sum(e["loss"] for e in log[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert (tmp_path / "run" / "train_log.jsonl").exists() and (tmp_path / "run" / "train_curves.png").exists()
    reloaded = load(tmp_path / "run" / "checkpoint")
    ids = torch.tensor([data[0].ids])
    assert torch.equal(reloaded(ids), model.eval()(ids))


def test_bad_jsonl_lines_name_the_line(tmp_path):
    cfg = tiny_model().config
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(chats(1)[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(path, TOK, cfg)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant turn"):
        read_jsonl(path, TOK, cfg)


def run(tmp_path, name, steps, resume_from=None, image_tasks=None):
    model = tiny_model(seed=1)
    sources = {"data": read_jsonl(write_jsonl(tmp_path / "chats.jsonl", chats()), TOK, model.config)}
    if image_tasks:
        sources["image"] = image_tasks
    config = TrainConfig(steps=8, batch_size=3, lr=5e-3, warmup_steps=2, save_every=4, max_len=200, seed=3)
    if resume_from is not None:
        model = load(resume_from / "checkpoint", dtype=torch.float32)
    trainer = Trainer(model, TOK, Mixture(sources, seed=3), config, tmp_path / name)
    if resume_from is not None:
        trainer.restore(resume_from / "checkpoint")
    while trainer.step_idx < steps:
        trainer.step()
        if trainer.step_idx % config.save_every == 0:
            trainer.save()
    return trainer


def test_stop_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    model = tiny_model()
    images = [task_example(TOK, model.config, t) for t in make_split("image", "train", 4)]
    straight = run(tmp_path, "straight", 8, image_tasks=images)
    stopped = run(tmp_path, "stopped", 4, image_tasks=images)  # saved at step 4
    resumed = run(tmp_path, "resumed", 8, resume_from=tmp_path / "stopped", image_tasks=images)
    assert [e["loss"] for e in resumed.log] == [e["loss"] for e in straight.log]
    assert [e["loss"] for e in stopped.log] == [e["loss"] for e in straight.log[:4]]
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_train_command_runs_and_resumes(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", chats())
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--data", data, "--batch-size", "2", "--max-len", "64", "--save-every", "2",
            "--no-progress"]
    assert main([*args, "--steps", "2"]) == 0
    assert main([*args, "--steps", "4", "--resume"]) == 0
    state = json.loads((out / "checkpoint" / "trainer_state" / "state.json").read_text())
    assert state["step"] == 4 and len(state["log"]) == 4
    # without data options a resume takes the run's own; different ones are refused, naming the saved ones
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 0
    assert json.loads((out / "checkpoint" / "trainer_state" / "state.json").read_text())["step"] == 6
    other = write_jsonl(tmp_path / "other.jsonl", chats(3))
    assert main(["train", "--out", str(out), "--resume", "--data", other, "--steps", "8", "--no-progress"]) == 2
    assert "data options differ" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "nothing to train on" in capsys.readouterr().err


def test_validation_during_a_run_measures_what_horizon_eval_measures(tmp_path, capsys):
    """--eval-every: held-out accuracy before the first step and after each; the last is the number
    `horizon eval` gives for the checkpoint the run wrote."""
    out = tmp_path / "run"
    assert main(["train", "--init", "bundled", "--out", str(out), "--domains", "arithmetic", "--per-domain", "4",
                 "--batch-size", "2", "--steps", "1", "--lr", "1e-3", "--warmup", "0", "--eval-every", "1",
                 "--eval-n", "2", "--eval-seed", "7", "--no-progress"]) == 0
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert [e["step"] for e in heldout] == [0, 1]
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "checkpoint"), "--domains", "arithmetic", "--n", "2", "--seed", "7",
                 "--dtype", "float32", "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)["domains"]["arithmetic"]
    got = heldout[-1]["domains"]["arithmetic"]
    assert got["n"] == 2 and got["thinking_tokens"] > 0  # the bundled model thinks before it answers
    assert (got["accuracy"], got["thinking_tokens"]) == (direct["accuracy"], direct["thinking_tokens"])
    # a run on chats alone has no held-out split to validate on: a clear error, not a traceback
    data = write_jsonl(tmp_path / "chats.jsonl", chats())
    assert main(["train", "--out", str(tmp_path / "chats"), "--data", data, "--batch-size", "2", "--max-len", "64",
                 "--steps", "1", "--eval-every", "1", "--no-progress"]) == 2
    assert "no task domain to validate on" in capsys.readouterr().err


def test_indexer_warmup_trains_only_the_indexer_toward_the_dense_attention(tmp_path):
    from horizon.model.dsa import GatedDSA

    model = tiny_model()
    with torch.no_grad():  # sharpen attention (a random model attends almost uniformly: nothing to learn)
        for m in model.modules():
            if isinstance(m, GatedDSA):
                m.wq_b.weight.mul_(8)
                m.wkv_b.weight.mul_(8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    examples = [task_example(TOK, model.config, t) for t in make_split("passkey", "train", 12)]
    config = TrainConfig(steps=16, batch_size=3, max_len=160, lr=1e-2, warmup_steps=2, stage="indexer-warmup")
    log = Trainer(model, TOK, Mixture({"passkey": examples}), config, tmp_path).train(progress=False)
    assert all(torch.equal(p, before[n]) != (".indexer." in n) for n, p in model.named_parameters()
               if p.numel() > 1), "warm-up must change the indexers and nothing else"
    first, last = log[:3], log[-3:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    assert mean(last, "indexer_kl") < 0.8 * mean(first, "indexer_kl")
    assert mean(last, "indexer_recall") > mean(first, "indexer_recall") + 0.01
    assert mean(last, "indexer_recall") > mean(last, "recent_recall")

    sparse = Trainer(model, TOK, Mixture({"passkey": examples}),
                     TrainConfig(steps=2, batch_size=2, max_len=160, stage="sparse"), tmp_path / "s")
    entry = sparse.step()
    assert entry["loss"] == pytest.approx(entry["lm_loss"] + entry["indexer_kl"], rel=1e-5)
    assert all(p.requires_grad for p in model.parameters())


def test_dense_stage_trains_everything_with_dense_attention(tmp_path):
    from horizon.model import ForwardOptions
    from horizon.model.dsa import GatedDSA
    from horizon.train.trainer import stage_options

    model = tiny_model()
    examples = [task_example(TOK, model.config, t) for t in make_split("passkey-short", "train", 4)]
    trainer = Trainer(model, TOK, Mixture({"passkey": examples}),
                      TrainConfig(steps=1, batch_size=4, max_len=512, stage="dense"), tmp_path)
    dsa = [m for m in model.modules() if isinstance(m, GatedDSA)]
    # the stage is how each training forward is called, not a state of the layers
    assert dsa and stage_options("dense") == ForwardOptions(selection="dense")
    assert stage_options("indexer-warmup") == ForwardOptions(selection="dense", indexer_inputs=True)
    assert stage_options("sparse") == ForwardOptions(indexer_inputs=True) and stage_options("sft") == ForwardOptions()
    assert all(p.requires_grad for p in model.parameters())
    batch = collate(examples, 512, model.config, TOK.special.image)
    assert batch["lengths"].max() > model.config.index_topk  # long enough that sparse attention would differ
    with torch.no_grad():
        dense = trainer.loss(batch)[0].item()
        trainer.config.stage = "sft"  # the same prompts under the configured (sparse) attention give another loss
        sparse = trainer.loss(batch)[0].item()
        for m in dsa:
            m.indexer.topk = 10**6  # every position selected: dense by construction
        assert trainer.loss(batch)[0].item() == pytest.approx(dense, rel=1e-5)
    assert sparse != pytest.approx(dense, rel=1e-5)


def test_train_renders_the_domains_references_under_each_listed_tier(tmp_path, monkeypatch, capsys):
    import horizon.train

    seen = []
    real = horizon.train.task_example

    def spy(tokenizer, cfg, task, tier="low"):
        seen.append((task.domain, tier))
        return real(tokenizer, cfg, task, tier)

    monkeypatch.setattr(horizon.train, "task_example", spy)
    assert main(["train", "--out", str(tmp_path / "run"), "--domains", "recall", "--per-domain", "6", "--tier",
                 "low,high,max", "--batch-size", "2", "--max-len", "64", "--steps", "1", "--no-progress"]) == 0
    assert seen == [("recall", t) for t in ("low", "high", "max") * 2]  # task k under tier k mod 3
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "bad"), "--domains", "recall", "--tier", "low,medium"]) == 2
    assert "--tier 'low,medium': ['medium'] not allowed" in capsys.readouterr().err


def test_train_brief_renders_that_share_of_references_with_the_domains_brief_thought(tmp_path, monkeypatch, capsys):
    import horizon.train

    thoughts: dict[str, list[str]] = {}
    real = horizon.train.task_example

    def spy(tokenizer, cfg, task, tier="low"):
        thoughts.setdefault(task.domain, []).append(task.target[-1]["reasoning_content"])
        return real(tokenizer, cfg, task, tier)

    monkeypatch.setattr(horizon.train, "task_example", spy)
    args = ["train", "--domains", "recall,arithmetic", "--per-domain", "40", "--batch-size", "2", "--max-len", "64",
            "--steps", "1", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "half"), "--brief", "0.5"]) == 0
    brief = [t for t in thoughts["recall"] if t == "In order." or t.startswith("It is ")]
    assert 8 <= len(brief) <= 32  # about half, by a fixed draw per task
    assert not any(t == "In order." or t.startswith("It is ") for t in thoughts["arithmetic"])  # none offered
    first = list(brief)
    thoughts.clear()
    assert main([*args, "--out", str(tmp_path / "again"), "--brief", "0.5"]) == 0
    assert [t for t in thoughts["recall"] if t == "In order." or t.startswith("It is ")] == first
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "bad"), "--brief", "2"]) == 2
    assert "--brief is a share of the references, between 0 and 1; got 2.0" in capsys.readouterr().err
