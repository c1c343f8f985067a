"""`horizon agent` end to end: the bundled model served in-process, a forced calculator call, the
transcript, and its replay."""

from __future__ import annotations

import json

from horizon.cli import main


def test_agent_command_runs_a_tool_and_writes_a_replayable_transcript(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    rc = main(["agent", "--tools", "calculator", "--force-tool", "calculator", "--tier", "low", "--max-steps", "2",
               "--max-tokens-per-step", "600", "--seed", "3", "--transcript", str(path), "What is 6 * 7?"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "step 1 (thinking low, tool choice calculator)" in out and "call calculator(" in out
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [r["type"] for r in records]
    assert kinds[0] == "meta" and kinds[-1] == "end" and "tool" in kinds
    tool = next(r for r in records if r["type"] == "tool")
    assert tool["name"] == "calculator" and tool["content"] in out
    assert all("api_key" not in json.dumps(r) for r in records)

    assert main(["agent", "--replay", str(path)]) == 0
    assert main(["agent", "--replay", str(path), "--tools", "calculator", "--rerun-tools"]) == 0


def test_agent_command_errors_are_one_line(tmp_path, capsys):
    assert main(["agent", "--tools", "files", "x"]) == 2
    assert "root" in capsys.readouterr().err
    assert main(["agent", "--tools", "nope", "x"]) == 2
    assert "calculator" in capsys.readouterr().err
    assert main(["agent", "--api", "anthropic", "--tier", "low", "--force-tool", "required", "x"]) == 2
    assert main(["agent", "--base-url", "http://127.0.0.1:9", "x"]) == 1
    assert "cannot use" in capsys.readouterr().out
