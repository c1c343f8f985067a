"""`horizon eval`: held-out tasks of each domain through the engine, scored by the domains' rewards.

Every task runs as an agent episode (`horizon.agent`) over an in-process `EngineClient`: single-turn
domains end after one step, tool domains take as many as they need (up to `max_steps`), with their
real tools (the terminal domain on the task's own simulated file system). Episodes advance in
lockstep, so each step is one batched engine run over every unfinished episode. Nothing is
constrained: tool-call validity measures the model.

Per domain: `accuracy` (mean reward) with a 95% Wilson interval (`ci95`), `tool_call_validity`
(calls that name an offered tool with a JSON-object argument matching its schema, over all calls;
null when no call was made), `thinking_tokens` (mean per episode), mean steps, and the count.

`eval_engine(...)` builds the engine an evaluation decodes with; its `selection` ("indexer", or
"recent": the index_topk most recent positions, the ablation) is an engine setting
(EngineConfig.selection) that reaches every forward as ForwardOptions, so the model is never changed.

`compare(a, b)` (`horizon compare A.jsonl B.jsonl`) pairs two models' per-task records on the same
held-out tasks. Per domain: both accuracies (Wilson), the paired difference A - B with its 95%
interval, and the difference in normalised reward, (reward - mean) / std with the domain's mean and
std over both models' records, so every domain counts in units of its own spread. Overall: the
mean over domains of the normalised difference, with a 95% interval (normal approximation; the
domains' samples are independent, so their variances add). Paired differences are much tighter
than two separate intervals: most tasks are solved, or failed, by both models.
"""

from __future__ import annotations

import json
import math
import tempfile
from typing import Any

from horizon.agent import Agent, AgentConfig, Terminal, fixed_policy
from horizon.agent.local import EngineClient
from horizon.agent.registry import make_tools
from horizon.agent.tool import ToolError, check_arguments
from horizon.engine import Engine, EngineConfig
from horizon.jsonl import jsonl_rows
from horizon.tasks import get_domain, make_split, task_fs

DEFAULT_DOMAINS = ("arithmetic", "passkey-short", "terminal", "convert", "image")
SELECTIONS = ("indexer", "recent")  # what the DSA layers attend to in an evaluation (--selection)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a proportion (rewards in [0, 1] count as fractional successes)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def valid_call(call: dict[str, Any], tools: dict[str, Any]) -> bool:
    fn = call.get("function") or {}
    tool = tools.get(fn.get("name"))
    if tool is None:
        return False
    try:
        args = json.loads(fn.get("arguments") or "")
        if not isinstance(args, dict):
            return False
        check_arguments(tool.parameters, args)
    except (ValueError, ToolError):
        return False
    return True


def task_tools(task, root: str) -> list:
    """The task's tools; the terminal domain's on the task's own file system (its reward reads the end state)."""
    if task.domain == "terminal":
        return [Terminal(task_fs(task))]
    return make_tools(task.tools, root)


def check_selection(selection: str) -> str:
    """"indexer" (the learned top-k) or "recent" (the index_topk most recent positions: the ablation)."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r}: allowed {', '.join(SELECTIONS)}")
    return selection


def eval_engine(model, tokenizer, max_num_seqs: int = 16, selection: str = "indexer",
                generation_config: dict[str, Any] | None = None) -> Engine:
    """The engine `horizon eval` decodes with: up to max_num_seqs sequences a step, DSA attending by
    `selection` (an engine setting, passed down to every forward; the model is left as it is)."""
    config = EngineConfig(max_num_seqs=max_num_seqs, max_batch_tokens=2048, selection=check_selection(selection))
    return Engine(model, tokenizer, config, generation_config=generation_config)


def run_lockstep(client: EngineClient, episodes: list, progress=None) -> None:
    """Advance every episode a step at a time, each step one batched engine run over those still going."""
    active = list(episodes)
    while active:
        live = [(ep, r) for ep in active if (r := ep.next_request()) is not None]
        for (ep, _), (body, turn) in zip(live, client.complete_many([r for _, r in live]), strict=True):
            ep.receive(body, turn)
        active = [ep for ep, _ in live if ep.stop is None]
        if progress:
            progress(len(episodes) - len(active), len(episodes))


def reward_of(domain, task, tools: list, answer: str) -> float:
    """The domain's reward; the terminal domain also scores the end state of the task's file system."""
    score = getattr(domain, "score", None)
    if score is not None:
        return score(task, answer, tools[0].fs if task.domain == "terminal" else None)
    return domain.reward(task, answer)


def evaluate(engine, tokenizer, domains=DEFAULT_DOMAINS, n: int = 100, tier: str | None = "low",
             max_steps: int = 6, max_tokens: int = 512, seed: int = 0, progress=None,
             records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per domain: accuracy (Wilson 95% interval), tool-call validity, thinking tokens, steps. With
    ``records``, one dict per task is appended to it (id, reward, answer, the whole conversation) for
    looking at what went wrong."""
    client = EngineClient(engine, tokenizer)
    out: dict[str, Any] = {}
    for name in domains:
        domain = get_domain(name)
        tasks = make_split(domain, "heldout", n, start_seed=seed)
        with tempfile.TemporaryDirectory(prefix="horizon-eval-") as root:
            runs = []
            for task in tasks:
                tools = task_tools(task, root)
                agent = Agent(client, tools, fixed_policy(tier),
                              AgentConfig(max_steps=max_steps, max_tokens_per_step=max_tokens, temperature=0.0))
                prompt = task.messages[-1]["content"]
                runs.append((task, tools, agent.episode(prompt, task.messages[:-1] or None)))
            run_lockstep(client, [ep for _, _, ep in runs],
                         (lambda done, total, name=name: progress(name, done, total)) if progress else None)
            rewards, thinking, steps, calls, valid = [], [], [], 0, 0
            for task, tools, ep in runs:
                result = ep.finish()
                offered = {t.name: t for t in tools}
                for m in result.messages:
                    for c in m.get("tool_calls") or [] if m.get("role") == "assistant" else []:
                        calls += 1
                        valid += valid_call(c, offered)
                rewards.append(reward_of(domain, task, tools, result.answer))
                if records is not None:
                    records.append({"domain": name, "id": task.id, "tier": tier or "none",
                                    "thinking_budget": engine.budgets[tier] if tier else 0,
                                    "reward": rewards[-1], "answer": result.answer,
                                    "reference": task.answer, "thinking_tokens": result.usage.reasoning_tokens,
                                    "steps": result.steps, "messages": result.messages})
                thinking.append(result.usage.reasoning_tokens)
                steps.append(result.steps)
        lo, hi = wilson(sum(rewards), len(rewards))
        out[name] = {"n": len(rewards), "accuracy": sum(rewards) / len(rewards), "ci95": [lo, hi],
                     "tool_call_validity": valid / calls if calls else None, "tool_calls": calls,
                     "thinking_tokens": sum(thinking) / len(thinking), "mean_steps": sum(steps) / len(steps)}
    return out


def _mean_var(xs: list[float]) -> tuple[float, float]:
    """Mean and the variance of the mean (sample variance / n) of a list."""
    n = len(xs)
    m = sum(xs) / n
    return m, (sum((x - m) ** 2 for x in xs) / (n - 1) / n if n > 1 else 0.0)


def cell(record: dict[str, Any]) -> str:
    """What a record is paired within: its domain, and its tier when it has one ("arithmetic@high")."""
    return f"{record['domain']}@{record['tier']}" if "tier" in record else record["domain"]


def charged(record: dict[str, Any], thinking_cost: float) -> float:
    """The thinking cost the RL reward charges a record: thinking_cost per whole budget of its tier."""
    if thinking_cost == 0 or not record.get("thinking_tokens"):
        return 0.0
    budget = record.get("thinking_budget")
    if not budget:
        raise ValueError(f"{record['domain']} {record['id']}: a thinking cost needs each record's thinking_budget "
                         "(written by horizon eval --records since --tiers; evaluate again)")
    return thinking_cost * float(record["thinking_tokens"]) / float(budget)


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]], z: float = 1.96,
            thinking_cost: float = 0.0) -> dict[str, Any]:
    """Model A's eval records against model B's on the same tasks, paired by domain, tier and task id.

    One row per domain, or per domain and tier for records written by `horizon eval --tiers`. The
    normalised reward divides by the domain's reward spread over both models and all its tiers; with
    `thinking_cost` C, each record is charged C x thinking tokens / its tier's budget in those units
    (the RL reward's cost), so the normalised difference is of reward net of thinking. Thinking tokens
    get a paired difference too. ValueError when a row's tasks differ between the two."""
    def by_cell(records):
        out: dict[str, dict[str, dict]] = {}
        for r in records:
            out.setdefault(cell(r), {})[r["id"]] = r
        return out

    da, db = by_cell(a), by_cell(b)
    if set(da) != set(db):
        raise ValueError(f"the records cover different domains/tiers: {sorted(da)} vs {sorted(db)}")
    spread: dict[str, float] = {}  # a domain's reward std over both models and every tier
    for domain in {r["domain"] for r in a}:
        pooled = [float(r["reward"]) for r in (*a, *b) if r["domain"] == domain]
        mean = sum(pooled) / len(pooled)
        spread[domain] = math.sqrt(sum((r - mean) ** 2 for r in pooled) / len(pooled))
    cells: dict[str, Any] = {}
    total, total_var = 0.0, 0.0
    domain_order = list(dict.fromkeys(r["domain"] for r in a))
    tier_rank = {t: k for k, t in enumerate(("none", "low", "high", "max"))}

    def row_order(name: str) -> tuple[int, int]:  # domains as A's records list them, then tiers low to max
        r = next(iter(da[name].values()))
        return domain_order.index(r["domain"]), tier_rank.get(r.get("tier"), 0)

    for name in sorted(da, key=row_order):
        ids = sorted(da[name])
        if set(ids) != set(db[name]):
            raise ValueError(f"{name}: the two records hold different tasks ({len(ids)} vs {len(db[name])}); "
                             "evaluate both with the same --n and --seed")
        pairs = [(da[name][i], db[name][i]) for i in ids]
        first = pairs[0][0]
        std = spread[first["domain"]]
        ra = [float(x["reward"]) for x, _ in pairs]
        rb = [float(y["reward"]) for _, y in pairs]
        ta = [float(x.get("thinking_tokens", 0)) for x, _ in pairs]
        tb = [float(y.get("thinking_tokens", 0)) for _, y in pairs]
        ca = [charged(x, thinking_cost) for x, _ in pairs]
        cb = [charged(y, thinking_cost) for _, y in pairs]
        n = len(ids)
        diff, diff_var = _mean_var([x - y for x, y in zip(ra, rb, strict=True)])
        half = z * math.sqrt(diff_var)
        # every reward of the domain equal: nothing to normalise by, and no reward differs (the cost still may)
        norm, norm_var = _mean_var([((x - y) / std if std > 0 else 0.0) - cx + cy
                                    for x, y, cx, cy in zip(ra, rb, ca, cb, strict=True)])
        total, total_var = total + norm, total_var + norm_var
        think, think_var = _mean_var([x - y for x, y in zip(ta, tb, strict=True)])
        mean_tb = sum(tb) / n
        cells[name] = {
            "domain": first["domain"], "tier": first.get("tier"),
            "n": n, "accuracy_a": sum(ra) / n, "ci95_a": list(wilson(sum(ra), n)),
            "accuracy_b": sum(rb) / n, "ci95_b": list(wilson(sum(rb), n)),
            "difference": diff, "difference_ci95": [diff - half, diff + half],
            "normalized_difference": norm,
            "normalized_ci95": [norm - z * math.sqrt(norm_var), norm + z * math.sqrt(norm_var)],
            "only_a": sum(x > y for x, y in zip(ra, rb, strict=True)),
            "only_b": sum(y > x for x, y in zip(ra, rb, strict=True)),
            "thinking_tokens_a": sum(ta) / n, "thinking_tokens_b": mean_tb,
            "thinking_difference": think,
            "thinking_ci95": [think - z * math.sqrt(think_var), think + z * math.sqrt(think_var)],
            "thinking_change": think / mean_tb if mean_tb else None,
            "cost_a": sum(ca) / n, "cost_b": sum(cb) / n,
            "lower_beyond_ci": diff + half < 0,
        }
    k = len(cells)
    mean_norm, half = total / k, z * math.sqrt(total_var) / k
    out = {"thinking_cost": thinking_cost, "domains": cells, "mean_normalized_difference": mean_norm,
           "mean_normalized_ci95": [mean_norm - half, mean_norm + half],
           "a_better": mean_norm - half > 0,
           "no_domain_lower": not any(d["lower_beyond_ci"] for d in cells.values())}
    if any("tier" in r for r in a):
        out["tier_order_a"], out["tier_order_b"] = tier_order(a, z=z), tier_order(b, z=z)
    return out


def tier_order(records: list[dict[str, Any]], base: str = "low", z: float = 1.96) -> dict[str, Any]:
    """One model's tiers against each other on the same tasks (records of `horizon eval --tiers`).

    Per domain and tier: accuracy (Wilson), thinking tokens, and the paired difference in accuracy
    from tier `base` with its 95% interval; `lower_beyond_ci` marks a tier worse than `base` beyond
    it (a higher tier should never be: it may think more, not worse)."""
    by: dict[str, dict[str, dict[str, dict]]] = {}
    for r in records:
        by.setdefault(r["domain"], {}).setdefault(r.get("tier", "low"), {})[r["id"]] = r
    out: dict[str, Any] = {}
    for domain, tiers in by.items():
        rows = {}
        for tier, recs in tiers.items():
            n = len(recs)
            acc = sum(float(r["reward"]) for r in recs.values())
            row = {"n": n, "accuracy": acc / n, "ci95": list(wilson(acc, n)),
                   "thinking_tokens": sum(float(r.get("thinking_tokens", 0)) for r in recs.values()) / n}
            if base in tiers and tier != base and set(recs) == set(tiers[base]):
                d, var = _mean_var([float(recs[i]["reward"]) - float(tiers[base][i]["reward"]) for i in recs])
                row.update({"vs_" + base: d, "vs_" + base + "_ci95": [d - z * math.sqrt(var), d + z * math.sqrt(var)],
                            "lower_beyond_ci": d + z * math.sqrt(var) < 0})
            rows[tier] = row
        out[domain] = rows
    return out


def read_records(path) -> list[dict[str, Any]]:
    """The records `horizon eval --records` wrote; ValueError naming the line for anything else."""
    out = []
    for n, row in jsonl_rows(path):
        if not isinstance(row, dict) or not {"domain", "id", "reward"} <= set(row):
            raise ValueError(f"{path}:{n}: an eval record needs domain, id and reward (horizon eval --records)")
        out.append(row)
    if not out:
        raise ValueError(f"{path}: no records")
    return out
