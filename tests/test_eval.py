"""The in-process agent client and `horizon eval` (held-out tasks through the engine, per-domain metrics)."""

from __future__ import annotations

import json
import math

import pytest

from horizon.agent import Agent, AgentConfig, Calculator, StepPlan
from horizon.agent.client import StepRequest
from horizon.agent.local import EngineClient
from horizon.checkpoint import open_model
from horizon.cli import main
from horizon.engine import Engine, EngineConfig
from horizon.eval import check_selection, compare, eval_engine, tier_order, valid_call, wilson


def test_engine_client_runs_forced_calls_and_resumes_each_step_from_the_cache():
    bundle = open_model("tiny-random")
    budgets = {"thinking_budgets": {"low": 8, "high": 16, "max": 24}}  # the random model thinks to the cap
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=2048),
                    generation_config={**bundle.generation_config, **budgets})
    client = EngineClient(engine, bundle.tokenizer)
    calc = Calculator()
    calc.strict = True  # the server-side grammar holds the arguments to {"expression": string}
    policy = lambda step, history: StepPlan("low" if step else None, "calculator" if step < 2 else "none")
    result = Agent(client, [calc], policy, AgentConfig(max_steps=4, max_tokens_per_step=80, temperature=0.0)).run(
        "What is 2 + 2?")
    calls = [m for m in result.messages if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(calls) == 2 and all(c["tool_calls"][0]["function"]["name"] == "calculator" for c in calls)
    assert all(valid_call(c["tool_calls"][0], {"calculator": calc}) for c in calls)
    tool_results = [m for m in result.messages if m["role"] == "tool"]
    assert len(tool_results) == 2 and calls[1]["reasoning_content"] is not None  # the second step thought
    assert result.usage.cached_tokens > 0  # later steps resume the earlier ones' state


def test_engine_client_marks_the_tokens_the_engine_forced():
    bundle = open_model("tiny-random")
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(max_num_seqs=2, max_model_len=2048),
                    generation_config={**bundle.generation_config,
                                       "thinking_budgets": {"low": 8, "high": 16, "max": 24}})
    client = EngineClient(engine, bundle.tokenizer)
    _, turn = client.complete(StepRequest([{"role": "user", "content": "hi"}], [], tier="low", max_tokens=20,
                                          temperature=0.0))
    ids, forced = turn.response["token_ids"], turn.response["forced"]
    # the random model thinks to the cap: 7 tokens, then the end the engine forces (the budget of 8 counts it)
    assert forced == [7] and ids[7] == bundle.tokenizer.special.think_end and turn.usage.reasoning_tokens == 8
    _, turn = client.complete(StepRequest([{"role": "user", "content": "hi"}], [], max_tokens=6, temperature=0.0))
    assert turn.response["forced"] == []  # thinking off: nothing is forced


def test_wilson_interval():
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.404, abs=1e-3) and hi == pytest.approx(0.596, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0


def test_eval_command_reports_every_domain(capsys):
    assert main(["eval", "--n", "2", "--max-tokens", "40", "--max-steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["domains"]) == {"arithmetic", "passkey-short", "terminal", "convert", "image"}
    for r in report["domains"].values():
        assert r["n"] == 2 and 0 <= r["accuracy"] <= 1 and 0 <= r["ci95"][0] <= r["ci95"][1] <= 1
        assert r["tool_call_validity"] is None or 0 <= r["tool_call_validity"] <= 1
        assert r["thinking_tokens"] >= 0


def test_eval_runs_in_bf16_and_records_every_task(capsys, tmp_path):
    records = tmp_path / "records.jsonl"
    args = ["eval", "--model", "tiny-random", "--domains", "arithmetic,recall", "--n", "2", "--max-tokens", "16",
            "--max-steps", "1", "--json", "--records", str(records)]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16" and report["domains"]["arithmetic"]["n"] == 2
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["domain"] for r in rows] == ["arithmetic"] * 2 + ["recall"] * 2
    for r in rows:  # the conversation starts with the task's prompt; the reward is the one counted
        assert r["messages"][0]["role"] == "user" and r["id"].startswith(r["domain"] + "-heldout-")
        assert r["reward"] in (0.0, 1.0) and isinstance(r["reference"], str)
    assert sum(r["reward"] for r in rows[:2]) / 2 == report["domains"]["arithmetic"]["accuracy"]


def test_eval_tiers_runs_each_tier_on_the_same_tasks_in_one_command(capsys, tmp_path):
    records = tmp_path / "records.jsonl"
    assert main(["eval", "--model", "tiny-random", "--domains", "recall,passkey-short", "--n", "2", "--max-tokens",
                 "16", "--max-steps", "1", "--tiers", "low,high,max", "--json", "--records", str(records)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["tiers"]) == ["low", "high", "max"] and "domains" not in report
    budgets = report["thinking_budgets"]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2
    for tier, res in report["tiers"].items():
        for domain, r in res.items():
            mine = [x for x in rows if x["tier"] == tier and x["domain"] == domain]
            assert [x["thinking_budget"] for x in mine] == [budgets[tier]] * 2
            assert r["accuracy"] == sum(x["reward"] for x in mine) / 2
            assert r["thinking_tokens"] == sum(x["thinking_tokens"] for x in mine) / 2
            order = report["tier_order"][domain][tier]
            assert order["accuracy"] == r["accuracy"] and ("vs_low" in order) == (tier != "low")
    # every tier saw the same tasks (paired)
    assert len({tuple(x["id"] for x in rows if x["tier"] == t) for t in ("low", "high", "max")}) == 1
    assert main(["eval", "--model", "tiny-random", "--tiers", "low,huge"]) == 2
    assert "--tiers 'low,huge': give distinct tiers from none, low, high, max" in capsys.readouterr().err
    assert main(["eval", "--tier", "high", "--tiers", "low,high"]) == 2
    assert "not both" in capsys.readouterr().err


def _tiered(domain: str, tier: str, budget: int, rewards: list[float], thinking: list[int]) -> list[dict]:
    return [{"domain": domain, "id": f"{domain}-heldout-{i}", "tier": tier, "thinking_budget": budget, "reward": r,
             "thinking_tokens": t} for i, (r, t) in enumerate(zip(rewards, thinking, strict=True))]


def test_compare_pairs_each_tier_and_charges_thinking_per_budget_of_its_tier(tmp_path, capsys):
    # passkey: both always right; A thinks 20 tokens where B thinks 60, at low (budget 100) and max (budget 1000)
    a = _tiered("passkey", "low", 100, [1.0] * 4, [20] * 4) + _tiered("passkey", "max", 1000, [1.0] * 4, [20] * 4)
    b = _tiered("passkey", "low", 100, [1.0] * 4, [60] * 4) + _tiered("passkey", "max", 1000, [1.0] * 4, [60] * 4)
    # arithmetic at low: A right on 3 of 4, B on 1; A thinks 50, B 10
    a += _tiered("arithmetic", "low", 100, [1.0, 1.0, 1.0, 0.0], [50] * 4)
    b += _tiered("arithmetic", "low", 100, [1.0, 0.0, 0.0, 0.0], [10] * 4)
    free = compare(a, b)
    assert list(free["domains"]) == ["passkey@low", "passkey@max", "arithmetic@low"]
    assert free["domains"]["passkey@low"]["normalized_difference"] == 0.0  # no cost: equal rewards, no difference
    res = compare(a, b, thinking_cost=2.0)
    low, top, arith = (res["domains"][k] for k in ("passkey@low", "passkey@max", "arithmetic@low"))
    assert (low["tier"], low["thinking_tokens_a"], low["thinking_tokens_b"]) == ("low", 20, 60)
    assert low["thinking_difference"] == -40 and low["thinking_change"] == pytest.approx(-2 / 3)
    # the cost: 2.0 per whole budget, so 40 fewer tokens are worth 0.8 at low and 0.08 at max
    assert low["normalized_difference"] == pytest.approx(0.8) and top["normalized_difference"] == pytest.approx(0.08)
    assert (low["cost_a"], low["cost_b"]) == (pytest.approx(0.4), pytest.approx(1.2))
    std = math.sqrt(0.5 * 0.5)  # arithmetic's rewards over both models: 4 of 8 right
    assert arith["normalized_difference"] == pytest.approx(0.5 / std - 2.0 * 40 / 100)
    assert arith["difference"] == 0.5
    assert res["mean_normalized_difference"] == pytest.approx((0.8 + 0.08 + 0.5 / std - 0.8) / 3)
    # each model's tiers against its own low, on the same tasks
    assert res["tier_order_a"]["passkey"]["max"]["vs_low"] == 0.0
    pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    pa.write_text("".join(json.dumps(r) + "\n" for r in a))
    pb.write_text("".join(json.dumps(r) + "\n" for r in b))
    assert main(["compare", str(pa), str(pb), "--thinking-cost", "2"]) == 0
    out = capsys.readouterr().out
    assert "passkey@low" in out and "-67%" in out and "net of thinking" in out and "tier order of A" in out
    # records without budgets (written before --tiers) cannot be charged
    with pytest.raises(ValueError, match="thinking_budget"):
        compare([{**r, "thinking_budget": None} for r in a], b, thinking_cost=1.0)


def test_tier_order_flags_a_higher_tier_worse_than_low_beyond_its_interval():
    records = (_tiered("arithmetic", "low", 128, [1.0] * 40, [90] * 40)
               + _tiered("arithmetic", "high", 512, [1.0] * 20 + [0.0] * 20, [100] * 40)
               + _tiered("arithmetic", "max", 2048, [1.0] * 39 + [0.0], [120] * 40))
    order = tier_order(records)["arithmetic"]
    assert order["high"]["vs_low"] == -0.5 and order["high"]["lower_beyond_ci"]
    assert order["max"]["vs_low"] == pytest.approx(-0.025) and not order["max"]["lower_beyond_ci"]
    assert (order["low"]["thinking_tokens"], order["max"]["thinking_tokens"]) == (90, 120)
    assert "vs_low" not in order["low"]


def _records(domain: str, rewards: list[float]) -> list[dict]:
    return [{"domain": domain, "id": f"{domain}-heldout-{i}", "reward": r} for i, r in enumerate(rewards)]


def test_compare_pairs_the_tasks_and_normalises_each_domain_by_its_spread():
    # arithmetic: both solve 600, only A another 80, only B another 20 (A 0.68, B 0.62); passkey: all solved
    a_arith = [1.0] * 600 + [1.0] * 80 + [0.0] * 20 + [0.0] * 300
    b_arith = [1.0] * 600 + [0.0] * 80 + [1.0] * 20 + [0.0] * 300
    a = _records("arithmetic", a_arith) + _records("passkey", [1.0] * 1000)
    b = _records("arithmetic", b_arith) + _records("passkey", [1.0] * 1000)
    res = compare(list(reversed(a)), b)  # pairing is by task id, not by order
    d = res["domains"]["arithmetic"]
    assert (d["accuracy_a"], d["accuracy_b"], d["only_a"], d["only_b"]) == (0.68, 0.62, 80, 20)
    assert d["difference"] == pytest.approx(0.06)
    std = math.sqrt(0.65 * 0.35)  # both models' rewards pooled
    assert d["normalized_difference"] == pytest.approx(0.06 / std)
    # the paired interval: the per-task differences are +1 (80), -1 (20), 0 (900)
    half = 1.96 * math.sqrt((100 - 1000 * 0.06 ** 2) / 999 / 1000)
    assert d["difference_ci95"] == pytest.approx([0.06 - half, 0.06 + half])
    assert res["domains"]["passkey"]["normalized_difference"] == 0.0  # all equal: no spread, no difference
    assert res["mean_normalized_difference"] == pytest.approx(0.06 / std / 2)
    assert res["a_better"] and res["no_domain_lower"]
    # the other way round: B is lower beyond its interval, and not better
    back = compare(b, a)
    assert back["domains"]["arithmetic"]["lower_beyond_ci"] and not back["no_domain_lower"] and not back["a_better"]


def test_compare_refuses_records_of_different_tasks(tmp_path, capsys):
    a, b = _records("arithmetic", [1.0, 0.0, 1.0]), _records("arithmetic", [1.0, 0.0])
    with pytest.raises(ValueError, match="different tasks"):
        compare(a, b)
    with pytest.raises(ValueError, match="different domains"):
        compare(a, _records("recall", [1.0, 0.0, 1.0]))
    pa, pb, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "bad.jsonl"
    pa.write_text("".join(json.dumps(r) + "\n" for r in a))
    pb.write_text("".join(json.dumps(r) + "\n" for r in _records("arithmetic", [0.0, 0.0, 1.0])))
    bad.write_text('{"domain": "arithmetic"}\n')
    assert main(["compare", str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "arithmetic" in out and "+0.333" in out and "mean normalised reward" in out
    assert main(["compare", str(pa), str(bad)]) == 2
    assert "bad.jsonl:1: an eval record needs domain, id and reward" in capsys.readouterr().err
    # Models evaluated on different domain sets compare on the domains named in both.
    pc = tmp_path / "c.jsonl"
    pc.write_text("".join(json.dumps(r) + "\n" for r in [*_records("arithmetic", [0.0, 0.0, 1.0]),
                                                          *_records("recall", [1.0])]))
    assert main(["compare", str(pa), str(pc)]) == 2
    assert "different domains" in capsys.readouterr().err
    assert main(["compare", str(pa), str(pc), "--domains", "arithmetic"]) == 0
    out = capsys.readouterr().out
    assert "+0.333" in out and "recall" not in out
    assert main(["compare", str(pa), str(pc), "--domains", "arithmetic,recall"]) == 2
    assert "a.jsonl has no records of ['recall']" in capsys.readouterr().err


def test_the_dsa_selection_is_an_engine_setting_that_reaches_every_forward(monkeypatch):
    """`horizon eval --selection recent` sets the engine's selection (EngineConfig.selection), which goes down
    to the indexer with each forward; the model itself is left as it was."""
    import torch

    from horizon.chat import load_tokenizer
    from horizon.engine import Request, SamplingParams
    from horizon.model.dsa import LightningIndexer

    from .conftest import tiny_model

    model, tok = tiny_model(index_topk=4), load_tokenizer()
    seen = []
    real = LightningIndexer.select

    def spy(self, *args, **kw):
        seen.append(args[6] if len(args) > 6 else kw.get("selection", "indexer"))
        return real(self, *args, **kw)

    monkeypatch.setattr(LightningIndexer, "select", spy)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = torch.randint(40, 4000, (12,), generator=torch.Generator().manual_seed(0)).tolist()  # > index_topk
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for selection in ("recent", "indexer"):
        engine = eval_engine(model, tok, max_num_seqs=2, selection=selection)
        assert engine.config.selection == selection
        seen.clear()
        engine.generate([Request(prompt, params)])
        assert seen and set(seen) == {selection}  # the prefill and every decode step
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="selection='nearest': allowed indexer, recent"):
        eval_engine(model, tok, selection="nearest")
    with pytest.raises(ValueError, match="allowed indexer, recent"):
        check_selection("dense")  # a training mode, not an evaluation one
