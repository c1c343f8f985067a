"""The arithmetic, passkey, terminal, convert, recall and steps task domains: determinism, split disjointness,
rewards, rendering through the chat template, tool results reproduced by re-running the target's calls, the
terminal domain's end-state reward, and the brief references of the domains where thinking does not help."""

from __future__ import annotations

import json
import re

import pytest

from horizon.agent.registry import make_tools
from horizon.chat import ChatTemplate, load_tokenizer, validate_history
from horizon.simfs import SimFS, Terminal, seeded_tree
from horizon.tasks import (
    DOMAINS,
    ArithmeticDomain,
    ConvertDomain,
    PasskeyDomain,
    RecallDomain,
    StepsDomain,
    Task,
    TerminalDomain,
    check_disjoint,
    get_domain,
    make_split,
    task_fs,
)
from horizon.tasks.arithmetic import expression_heldout
from horizon.tasks.convert import FIELDS, WORDS
from horizon.tasks.passkey import key_heldout, needle
from horizon.tasks.recall import answer_heldout
from horizon.tasks.steps import steps_heldout
from horizon.tasks.terminal import VOCAB, tree_heldout

N = 200
NAMES = ("arithmetic", "passkey", "terminal", "convert", "recall", "steps")
CLASSES = {"arithmetic": ArithmeticDomain, "passkey": PasskeyDomain, "terminal": TerminalDomain,
           "convert": ConvertDomain, "recall": RecallDomain, "steps": StepsDomain}


@pytest.fixture(scope="module")
def splits() -> dict[str, dict[str, list[Task]]]:
    return {name: {split: make_split(name, split, N) for split in ("train", "heldout")} for name in NAMES}


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(load_tokenizer())


def every(splits, name: str) -> list[Task]:
    return splits[name]["train"] + splits[name]["heldout"]


def tool_specs(task: Task) -> list[dict]:
    return [{"type": "function", "function": t.spec()} for t in make_tools(task.tools, seed=task.seed)]


def calls(task: Task) -> list[tuple[dict, dict]]:
    """(tool call, the tool message answering it) for every call in the target, in order."""
    out = []
    for i, m in enumerate(task.target):
        for j, call in enumerate(m.get("tool_calls") or []):
            answer = task.target[i + 1 + j]
            assert answer["role"] == "tool" and answer["tool_call_id"] == call["id"]
            out.append((call, answer))
    return out


# Registry, determinism, splits


def test_domains_are_registered():
    for name, cls in CLASSES.items():
        assert isinstance(DOMAINS[name], cls) and get_domain(name) is DOMAINS[name]
    assert "image" in DOMAINS


@pytest.mark.parametrize("name", NAMES)
def test_generate_is_deterministic_per_seed_and_split(name):
    dom = get_domain(name)
    for seed in range(10):
        a, b = dom.generate(seed, "train"), CLASSES[name]().generate(seed, "train")
        assert a == b and a.id == f"{name}-train-{seed}" and a.domain == name
        assert dom.generate(seed, "heldout").id == f"{name}-heldout-{seed}"
    assert dom.generate(0, "train").messages != dom.generate(1, "train").messages
    assert [dom.generate(s, "train").messages for s in range(5)] != [
        dom.generate(s, "heldout").messages for s in range(5)]
    with pytest.raises(ValueError, match="allowed: train, heldout"):
        dom.generate(0, "test")


@pytest.mark.parametrize("name", NAMES)
def test_splits_are_disjoint_and_deduplicated(splits, name):
    dom = get_domain(name)
    check_disjoint(splits[name]["train"], splits[name]["heldout"])
    for split, tasks in splits[name].items():
        assert len(tasks) == N and len({dom.key(t) for t in tasks}) == N and len({t.id for t in tasks}) == N
        assert all(t.split == split and t.tools == list(dom.tools) for t in tasks)


def test_splits_follow_the_documented_partitions(splits):
    for split in ("train", "heldout"):
        held = split == "heldout"
        assert all(expression_heldout(t.meta["expression"]) == held for t in splits["arithmetic"][split])
        assert all(key_heldout(t.meta["key"]) == held for t in splits["passkey"][split])
        assert all(tree_heldout(t.meta["tree_seed"]) == held for t in splits["terminal"][split])
        assert all(answer_heldout(t.answer) == held for t in splits["recall"][split])
        assert all(steps_heldout(t.meta["start"], t.meta["stride"], t.meta["steps"]) == held
                   for t in splits["steps"][split])
        fields = {f for f, _ in FIELDS[split]}
        for t in splits["convert"][split]:
            assert set(t.meta["columns"]) <= fields and all(set(r) <= fields for r in t.meta["records"])
            words = {v for r in t.meta["records"] for v in r.values() if isinstance(v, str)}
            assert words <= set(WORDS[split])
        for t in splits["terminal"][split]:
            if t.meta["kind"] in ("create", "report"):
                assert any(f"{stem}.txt" in t.meta["path"] for stem in VOCAB[split]["stem"])
    for a, b in ((FIELDS["train"], FIELDS["heldout"]), (WORDS["train"], WORDS["heldout"])):
        assert not {x[0] if isinstance(x, tuple) else x for x in a} & {x[0] if isinstance(x, tuple) else x for x in b}
    for k in VOCAB["train"]:
        assert not set(VOCAB["train"][k]) & set(VOCAB["heldout"][k])


# Rewards


def wrong_answer(task: Task) -> str:
    if task.domain in ("arithmetic", "passkey", "steps"):
        return str(int(task.answer) + 1)
    if task.domain == "recall":  # one digit changed (codes may start with 0: not an integer)
        return task.answer[:-1] + str((int(task.answer[-1]) + 1) % 10)
    if task.domain == "terminal":
        return str(task.meta["count"] + 1) if task.meta["kind"] == "count" else "src/nowhere/missing.py"
    records = [dict(r) for r in task.meta["records"]]
    records[-1] = {k: (v + 1 if isinstance(v, int) else v + "x") for k, v in records[-1].items()}
    if task.meta["direction"] == "json2csv":
        last = ",".join(str(records[-1][c]) for c in task.meta["columns"])
        return "\n".join([*task.answer.splitlines()[:-1], last])
    return json.dumps(records)


@pytest.mark.parametrize("name", NAMES)
def test_reference_scores_one_and_wrong_scores_zero(splits, name):
    dom = get_domain(name)
    for t in every(splits, name):
        if name == "terminal" and t.meta["state"]:
            assert dom.reward(t, t.answer) == 0.0 and dom.reward(t, t.target[-1]["content"]) == 0.0
            continue
        assert dom.reward(t, t.answer) == 1.0, t.id
        assert dom.reward(t, t.target[-1]["content"]) == 1.0, t.id
        assert dom.reward(t, wrong_answer(t)) == 0.0, t.id
        assert dom.reward(t, "") == 0.0


def test_arithmetic_reward_reads_signed_and_formatted_numbers():
    dom = get_domain("arithmetic")
    task = next(t for t in make_split("arithmetic", "train", 100) if int(t.answer) <= -1000)
    v = int(task.answer)
    for good in (f"{v}", f"The answer is {v:,}.", f"**{v}**", f"\u2212{abs(v)}", f"{v}.0"):
        assert dom.reward(task, good) == 1.0, good
    for bad in (f"{abs(v)}", f"{v}.5", f"{task.meta['expression']} = {v}", "minus a lot"):
        assert dom.reward(task, bad) == 0.0, bad
    kinds = {t.meta["kind"] for t in make_split("arithmetic", "train", 50)}
    assert kinds == {"expression", "word"}


def test_terminal_path_reward_is_tolerant():
    dom = get_domain("terminal")
    task = next(t for t in make_split("terminal", "train", 50) if t.meta["kind"] == "define")
    p = task.answer
    for good in (p, f"`{p}`", f"./{p}", f"/{p}", p.upper(), f"It is defined in {p}.", f'"{p}"'):
        assert dom.reward(task, good) == 1.0, good
    for bad in (p.replace(".py", ""), "src/", f"tests/{p.rsplit('/', 1)[1]}", "no idea"):
        assert dom.reward(task, bad) == 0.0, bad


def test_convert_reward_is_structural():
    dom = get_domain("convert")
    tasks = make_split("convert", "train", 60)
    assert {t.meta["direction"] for t in tasks} == {"json2csv", "csv2json"}
    to_csv = next(t for t in tasks if t.meta["direction"] == "json2csv")
    lines = to_csv.answer.splitlines()
    assert lines[0] == ",".join(to_csv.meta["columns"]) and len(lines) == len(to_csv.meta["records"]) + 1
    for good in (f"```csv\n{to_csv.answer}\n```", "\n".join(", ".join(ln.split(",")) for ln in lines) + "\n\n",
                 f"Here it is:\n```\n{to_csv.answer}\n```\nDone."):
        assert dom.reward(to_csv, good) == 1.0, good
    for bad in ("\n".join(lines[1:]), "\n".join([lines[0], *reversed(lines[1:])]), to_csv.answer.replace(",", ";")):
        if bad != to_csv.answer:
            assert dom.reward(to_csv, bad) == 0.0, bad

    to_json = next(t for t in tasks if t.meta["direction"] == "csv2json"
                   and any(isinstance(v, int) for v in t.meta["records"][0].values()))
    records = to_json.meta["records"]
    assert json.loads(to_json.answer) == records
    assert to_json.messages[0]["content"].endswith(
        "\n".join([",".join(records[0]), *(",".join(str(v) for v in r.values()) for r in records)]))
    reordered = [dict(reversed(list(r.items()))) for r in records]
    for good in (json.dumps(records), f"```json\n{json.dumps(reordered)}\n```", f"Result: {json.dumps(records)}"):
        assert dom.reward(to_json, good) == 1.0, good
    as_strings = [{k: str(v) for k, v in r.items()} for r in records]
    as_floats = [{k: float(v) if isinstance(v, int) else v for k, v in r.items()} for r in records]
    for bad in (json.dumps(as_strings), json.dumps(as_floats), json.dumps(records[:-1]), json.dumps(records)[:-1]):
        assert dom.reward(to_json, bad) == 0.0, bad


# Chat format and tools


@pytest.mark.parametrize("name", NAMES)
def test_tasks_render_through_the_chat_template(splits, template, name):
    for t in splits[name]["train"][:25] + splits[name]["heldout"][:25]:
        tools = tool_specs(t)
        assert [s["function"]["name"] for s in tools] == t.tools
        assert validate_history(t.chat(), tier="high", tools=tools) == [], t.id
        prompt = template.render(t.messages, tools=tools, tier="high", add_generation_prompt=True)
        full = template.render(t.chat(), tools=tools, tier="high")
        assert full.ids[: len(prompt.ids)] == prompt.ids
        assert any(full.assistant_mask) and not any(full.assistant_mask[: len(prompt.ids)])
        assert template.tokenizer.decode(full.ids).endswith(t.target[-1]["content"] + "<｜/assistant｜>")
        assert all(m.get("reasoning_content") for m in t.target if m["role"] == "assistant")


@pytest.mark.parametrize("name", ["arithmetic", "terminal"])
def test_rerunning_the_target_calls_reproduces_the_tool_messages(splits, name):
    for t in every(splits, name):
        pairs = calls(t)
        assert len(pairs) >= (1 if name == "arithmetic" else 2), t.id
        # Fresh tools: the registry's calculator; for the terminal, the task's own initial tree.
        tools = {tool.name: tool for tool in make_tools(["calculator"])} if name == "arithmetic" else {
            "terminal": Terminal(task_fs(t))}
        for call, answer in pairs:
            result = tools[call["function"]["name"]].run(call["function"]["arguments"])
            assert not result.is_error and result.content == answer["content"], (t.id, call)
        if name == "arithmetic":
            assert t.answer == pairs[-1][1]["content"] == str(t.meta["value"])


# Passkey


def test_passkey_prompts_are_long_and_hold_the_key_once(splits, template):
    tok = template.tokenizer
    depths = []
    for t in every(splits, "passkey"):
        text = t.messages[0]["content"]
        key = t.meta["key"]
        assert re.findall(r"\d+", text) == [str(key)] and text.count(needle(key)) == 1
        assert t.answer == str(key) and needle(key) in t.target[-1]["reasoning_content"]
        depths.append(t.meta["depth"])
    for t in every(splits, "passkey")[::10]:
        assert len(tok.encode(t.messages[0]["content"])) > 200, t.id
    assert min(depths) < 0.1 and max(depths) > 0.9
    assert len({t.messages[0]["content"].split("\n")[2][:60] for t in every(splits, "passkey")}) > N  # varied filler


def test_passkey_length_is_configurable():
    short = PasskeyDomain(min_words=20, max_words=30)
    for seed in range(20):
        t = short.generate(seed, "train")
        assert 20 <= t.meta["words"] < 30 + 25 and t.messages[0]["content"].count(needle(t.meta["key"])) == 1
    with pytest.raises(ValueError, match="min_words <= max_words"):
        PasskeyDomain(min_words=50, max_words=10)


# Terminal end state


def test_terminal_kinds_and_trees(splits):
    tasks = every(splits, "terminal")
    assert {t.meta["kind"] for t in splits["terminal"]["train"]} == {"count", "define", "create", "move", "report"}
    for t in tasks[:40]:
        assert t.meta["files"] == seeded_tree(t.meta["tree_seed"], t.meta["n_files"])
        assert task_fs(t) == SimFS.from_dict(t.meta["files"]) and task_fs(t) is not task_fs(t)
        assert t.meta["state"] == (t.meta["kind"] in ("create", "move", "report"))


def test_terminal_state_tasks_are_scored_on_the_end_state(splits):
    dom = get_domain("terminal")
    state = [t for t in every(splits, "terminal") if t.meta["state"]]
    assert len(state) > 50
    for t in state:
        fs = task_fs(t)
        assert dom.reward_state(t, fs) == 0.0, t.id  # untouched
        assert dom.score(t, t.target[-1]["content"]) == 0.0  # no file system, no credit
        term = Terminal(fs)
        for call, _ in calls(t):
            term.run(call["function"]["arguments"])
        assert dom.reward_state(t, fs) == 1.0, t.id
        assert dom.score(t, "", fs) == 1.0
        # Breaking an unrelated original file loses the reward.
        other = next(p for p in t.meta["files"] if p not in (t.meta.get("src"), t.meta.get("path")))
        term.run({"command": f"rm {other}"})
        assert dom.reward_state(t, fs) == 0.0, t.id
    question = next(t for t in every(splits, "terminal") if not t.meta["state"])
    with pytest.raises(ValueError, match="question task"):
        dom.reward_state(question, task_fs(question))
    assert dom.score(question, question.answer) == 1.0


def test_terminal_state_reward_checks_the_content():
    dom = get_domain("terminal")
    tasks = make_split("terminal", "train", 80)
    create = next(t for t in tasks if t.meta["kind"] == "create")
    fs = task_fs(create)
    fs.write("/" + create.meta["path"], create.meta["text"])  # no trailing newline: still right
    assert dom.reward_state(create, fs) == 1.0
    fs.write("/" + create.meta["path"], create.meta["text"].lower())
    assert dom.reward_state(create, fs) == 0.0
    move = next(t for t in tasks if t.meta["kind"] == "move")
    fs = task_fs(move)
    Terminal(fs).run({"command": f"cp {move.meta['src']} {move.meta['dest']}"})  # a copy is not a move
    assert dom.reward_state(move, fs) == 0.0
    report = next(t for t in tasks if t.meta["kind"] == "report")
    fs = task_fs(report)
    fs.write("/" + report.meta["path"], f"{report.meta['count'] + 1}\n")
    assert dom.reward_state(report, fs) == 0.0


def test_recall_tasks_hold_their_answer(splits):
    dom = get_domain("recall")
    kinds = set()
    for t in every(splits, "recall"):
        prompt = t.messages[0]["content"]
        kinds.add(t.meta["kind"])
        if t.meta["kind"] == "repeat":  # the prompt ends with exactly the codes to repeat
            assert prompt.endswith(": " + t.answer)
            assert dom.reward(t, t.answer + " 1") == 0.0  # an extra code is wrong
        else:  # the asked-for name's line holds the code, and only that line
            name = prompt.rsplit("code of ", 1)[1].rstrip("?")
            assert f"\n{name}: {t.answer}\n" in "\n" + prompt
            assert dom.reward(t, f"The code is {t.answer}.") == 1.0
    assert kinds == {"repeat", "lookup"}


def test_steps_thoughts_write_every_intermediate_result(splits, template):
    lengths = []
    for t in every(splits, "steps"):
        a, s, k = t.meta["start"], t.meta["stride"], t.meta["steps"]
        assert f"{a}" in t.messages[0]["content"] and f"add {s}" in t.messages[0]["content"].lower()
        assert f" {k} times" in t.messages[0]["content"] and int(t.answer) == a + k * s
        thought = t.target[-1]["reasoning_content"]
        assert thought.startswith(f"From {a}, add {s}, {k} times: ")
        walked = [(int(v), int(left)) for v, left in re.findall(r"(\d+) \((\d+) left\)", thought)]
        assert walked == [(a + i * s, k - i) for i in range(1, k + 1)] and thought.endswith(f"result is {t.answer}.")
        lengths.append((k, len(template.tokenizer.encode(thought))))
    # The thought grows with k (what the tiers' budgets cut): about 11 tokens a step.
    assert max(n for k, n in lengths if k <= 8) < 128 < 256 < 350 < min(n for k, n in lengths if k >= 34)


@pytest.mark.parametrize("name", ["passkey", "recall"])
def test_brief_references_keep_the_answer_in_a_shorter_thought(splits, template, name):
    dom = get_domain(name)
    for t in every(splits, name)[:50]:
        brief = dom.brief(t)
        assert brief.messages == t.messages and brief.answer == t.answer and brief.meta == t.meta
        full_thought, short = t.target[-1]["reasoning_content"], brief.target[-1]["reasoning_content"]
        assert len(short) < len(full_thought) and brief.target[-1]["content"] == t.target[-1]["content"]
        if name == "passkey" or t.meta["kind"] == "lookup":
            assert t.answer in short
        assert validate_history(brief.chat(), tier="low") == []
    assert get_domain("arithmetic").brief(splits["arithmetic"]["train"][0]) is None


def test_recall_reference_thought_is_long_and_true(splits, template):
    # The thought a thinking cost should learn to drop: several times the brief one, and every fact it states holds.
    recall, full, brief = get_domain("recall"), [], []
    for t in every(splits, "recall")[:100]:
        thought = t.target[-1]["reasoning_content"]
        if t.meta["kind"] == "repeat":
            codes = t.answer.split()
            lengths = ", ".join(str(len(c)) for c in codes)
            assert f"repeat {len(codes)} codes" in thought and f"They have {lengths} digits" in thought
        else:
            lines = t.messages[0]["content"].split("\n")[:-1]
            pick = next(i for i, line in enumerate(lines) if line.endswith(f": {t.answer}"))
            name = lines[pick].split(":")[0]
            assert f"line {pick + 1} is the one, \"{name}: {t.answer}\"" in thought and thought.endswith(f"{t.answer}.")
            assert all(line.split(":")[0] in thought for line in lines[:pick])
        full.append(len(template.tokenizer.encode(thought)))
        brief.append(len(template.tokenizer.encode(recall.brief_reasoning(t))))
    assert sum(full) > 5 * sum(brief)
