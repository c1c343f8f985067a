"""The agent loop: ask the model, run the tools it calls, keep the whole history, repeat.

Each step sends the conversation so far with the tool definitions and that step's thinking tier
and tool choice (a `Policy` decides both: e.g. low for routine steps, max for a hard one), appends
the assistant turn exactly as returned (thinking, text, calls: the full-history rule, docs/design.md §3),
runs the calls in the order the model made them and appends their results, until the model answers
without calling a tool, the step limit, or the token budget. Tool failures are results the model
reads; an endpoint that refuses a request ends the run with the reason (never a traceback).

Every request and response, tool call and timing goes to an optional JSONL transcript, which
`replay` can run again (checking each request against the recorded one).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from horizon.agent.client import ClientError, OnEvent, ReplayClient, StepRequest, ToolCall, Turn, Usage
from horizon.agent.tool import Tool, ToolResult
from horizon.chat.thinking import TIERS


@dataclass
class StepPlan:
    tier: str | None = None  # thinking tier for this step; None: off
    tool_choice: str | None = None  # None/"auto" | "required" | "none" | a tool's name


Policy = Callable[[int, list[dict[str, Any]]], StepPlan]  # (step index, history so far) -> plan


def fixed_policy(tier: str | None = None, first_tool_choice: str | None = None) -> Policy:
    """The same tier every step; optionally force a tool call ("required" or a tool's name) on step 0."""
    if tier is not None and tier not in TIERS:
        raise ValueError(f"tier={tier!r}: allowed {', '.join(TIERS)} or None (thinking off)")

    def policy(step: int, history: list[dict[str, Any]]) -> StepPlan:
        return StepPlan(tier, first_tool_choice if step == 0 else None)

    return policy


@dataclass
class AgentConfig:
    max_steps: int = 16  # model calls
    max_total_tokens: int | None = None  # completion tokens over all steps (thinking included)
    max_tokens_per_step: int = 4096
    system: str | None = None
    temperature: float | None = None
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    response_schema: dict[str, Any] | None = None  # every answer must be JSON of this schema (calls still allowed)

    def validate(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}: must be >= 1")
        if self.max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step={self.max_tokens_per_step}: must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens={self.max_total_tokens}: must be >= 1 or None")


@dataclass
class AgentResult:
    answer: str  # the last turn's text
    stop_reason: str  # answer | max_steps | token_budget | length | error
    steps: int
    usage: Usage
    messages: list[dict[str, Any]]  # the whole history, as sent and returned
    error: str | None = None


class Transcript:
    """JSONL: one record per line (meta, request, response, tool, end), flushed as the run goes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = self.path.open("w", encoding="utf-8")
        self.t0 = time.time()

    def write(self, kind: str, **data: Any) -> None:
        record = {"type": kind, "t": round(time.time() - self.t0, 6), **data}
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def read_transcript(path: str | Path) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    if not records or records[0].get("type") != "meta":
        raise ValueError(f"{path}: not an agent transcript (the first line must be a meta record)")
    return records


class Agent:
    """`Agent(client, tools).run("task")`: client is an HTTPClient, ReplayClient or anything with
    `.wire` and `.complete(StepRequest, on_event) -> (body, Turn)`."""

    def __init__(self, client, tools: list[Tool], policy: Policy | None = None, config: AgentConfig | None = None,
                 on_event: OnEvent | None = None, transcript: Transcript | None = None):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.client, self.tools = client, {t.name: t for t in tools}
        self.policy = policy or fixed_policy()
        self.config = config or AgentConfig()
        self.config.validate()
        self.on_event = on_event or (lambda kind, data: None)
        self.transcript = transcript

    def run(self, task: str, history: list[dict[str, Any]] | None = None) -> AgentResult:
        """Work on `task` (a new user message after `history`, which is kept as given)."""
        episode = self.episode(task, history)
        while (req := episode.next_request()) is not None:
            try:
                body, turn = self.client.complete(req, self.on_event)
            except ClientError as e:
                episode.fail(e)
                break
            episode.receive(body, turn)
        return episode.finish()

    def episode(self, task: str, history: list[dict[str, Any]] | None = None) -> Episode:
        """The run as a state machine, for callers that batch many episodes' steps (evaluation, RL)."""
        return Episode(self, task, history)

    def _record_turn(self, step: int, body: dict[str, Any], turn: Turn) -> None:
        self.on_event("turn", {"step": step, "finish_reason": turn.finish_reason, "usage": asdict(turn.usage),
                               "elapsed_s": turn.elapsed_s, "ttft_s": turn.ttft_s})
        if self.transcript:
            self.transcript.write("request", step=step, body=body)
            self.transcript.write("response", step=step, response=turn.response, message=turn.message,
                                  finish_reason=turn.finish_reason, usage=asdict(turn.usage),
                                  ttft_s=turn.ttft_s, elapsed_s=round(turn.elapsed_s, 6))

    def _run_tool(self, step: int, call: ToolCall) -> ToolResult:
        t0 = time.perf_counter()
        tool = self.tools.get(call.name)
        if tool is None:
            result = ToolResult(f"error: no tool named {call.name!r}; available: {', '.join(self.tools)}", True)
        else:
            result = tool.run(call.arguments)
        elapsed = time.perf_counter() - t0
        self.on_event("tool_result", {"id": call.id, "name": call.name, "arguments": call.arguments,
                                      "content": result.content, "is_error": result.is_error, "elapsed_s": elapsed})
        if self.transcript:
            self.transcript.write("tool", step=step, id=call.id, name=call.name, arguments=call.arguments,
                                  content=result.content, is_error=result.is_error, elapsed_s=round(elapsed, 6))
        return result


class RecordedTool(Tool):
    """A tool that answers with the results a transcript recorded (replay without side effects)."""

    def __init__(self, spec: dict[str, Any], results: list[ToolResult]):
        self.name, self.description, self.parameters = spec["name"], spec.get("description", ""), spec["parameters"]
        self.strict = bool(spec.get("strict", False))
        self.results = results

    def run(self, arguments) -> ToolResult:
        if not self.results:
            return ToolResult(f"error: the transcript has no more results for {self.name}", True)
        return self.results.pop(0)


def replay(path: str | Path, tools: list[Tool] | None = None, on_event: OnEvent | None = None,
           transcript: Transcript | None = None) -> AgentResult:
    """Run a recorded session again: the model's turns come from the transcript, each request is checked
    against the recorded one. With `tools`, the calls are executed again (a different result makes the
    next request differ: the replay then stops with the step and the first difference); without, the
    recorded results are used."""
    records = read_transcript(path)
    meta = records[0]
    requests = [r for r in records if r["type"] == "request"]
    responses = {r["step"]: r["response"] for r in records if r["type"] == "response"}
    steps = [(r["body"], responses[r["step"]]) for r in requests]
    client = ReplayClient(meta["api"], meta["model"], steps, stream=bool(meta.get("stream", True)))
    if tools is None:
        by_name: dict[str, list[ToolResult]] = {s["name"]: [] for s in meta["tools"]}
        for r in records:
            if r["type"] == "tool" and r["name"] in by_name:
                by_name[r["name"]].append(ToolResult(r["content"], r["is_error"]))
        tools = [RecordedTool(s, by_name[s["name"]]) for s in meta["tools"]]
    cfg = dict(meta["config"])
    config = AgentConfig(**cfg)
    plans = [StepPlan(*_plan_of(meta["api"], body)) for body, _ in steps]

    def policy(step: int, history) -> StepPlan:
        return plans[step] if step < len(plans) else StepPlan()

    agent = Agent(client, tools, policy, config, on_event, transcript)
    return agent.run(meta["task"], meta.get("history") or None)


def _plan_of(api: str, body: dict[str, Any]) -> tuple[str | None, str | None]:
    """The (tier, tool_choice) a recorded request body was made with."""
    if api == "openai":
        effort = body.get("reasoning_effort")
        tier = {"low": "low", "high": "high", "xhigh": "max"}.get(effort) if effort else None
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            choice = choice.get("function", {}).get("name")
        return tier, None if choice == "auto" else choice
    tier = (body.get("output_config") or {}).get("effort") if body.get("thinking") else None
    choice = body.get("tool_choice") or {}
    kind = choice.get("type")
    return tier, {"any": "required", "tool": choice.get("name"), "none": "none"}.get(kind)


class Episode:
    """One agent run, a step at a time: `next_request()` (None once it has stopped), then
    `receive(body, turn)` with the model's reply (tools run here), or `fail(error)`; `finish()`."""

    def __init__(self, agent: Agent, task: str, history: list[dict[str, Any]] | None):
        self.agent, self.cfg = agent, agent.config
        wire = agent.client.wire
        self.messages = [*(history or []), wire.user_message(task)]
        self.usage, self.answer = Usage(), ""
        self.step, self.stop, self.error = 0, None, None
        self.req: StepRequest | None = None
        self.turns: list[Turn] = []  # every reply as received (an in-process client's carry their token ids)
        if agent.transcript:
            agent.transcript.write("meta", api=wire.api, model=wire.model, task=task, history=history or [],
                                   tools=[{**t.spec(), "strict": t.strict} for t in agent.tools.values()],
                                   config=asdict(self.cfg), stream=getattr(agent.client, "stream_mode", None),
                                   base_url=getattr(agent.client, "base_url", None))

    def next_request(self) -> StepRequest | None:
        cfg, agent = self.cfg, self.agent
        if self.stop is not None:
            return None
        if self.step >= cfg.max_steps:
            self.stop = "max_steps"
            return None
        left = None if cfg.max_total_tokens is None else cfg.max_total_tokens - self.usage.completion_tokens
        if left is not None and left <= 0:
            self.stop = "token_budget"
            return None
        plan = agent.policy(self.step, self.messages)
        if plan.tier is not None and plan.tier not in TIERS:
            raise ValueError(f"policy gave tier={plan.tier!r} at step {self.step}: allowed {', '.join(TIERS)} or None")
        if plan.tool_choice not in (None, "auto", "required", "none") and plan.tool_choice not in agent.tools:
            raise ValueError(f"policy forces tool {plan.tool_choice!r} at step {self.step}, which is not offered "
                             f"(offered: {', '.join(agent.tools)})")
        self.req = StepRequest(list(self.messages), list(agent.tools.values()), plan.tier, plan.tool_choice,
                               min(cfg.max_tokens_per_step, left) if left is not None else cfg.max_tokens_per_step,
                               cfg.system, cfg.temperature, cfg.seed, dict(cfg.extra), cfg.response_schema)
        agent.on_event("step", {"step": self.step, "tier": plan.tier, "tool_choice": plan.tool_choice})
        return self.req

    def receive(self, body: dict[str, Any], turn: Turn) -> None:
        agent, cfg = self.agent, self.cfg
        agent._record_turn(self.step, body, turn)
        self.messages.append(turn.message)  # exactly as returned: the full-history rule
        self.turns.append(turn)
        self.usage.add(turn.usage)
        self.answer = turn.text
        step, self.step = self.step, self.step + 1
        if not turn.calls:
            cut_by_budget = cfg.max_total_tokens is not None and self.req.max_tokens < cfg.max_tokens_per_step
            self.stop = (("token_budget" if cut_by_budget else "length") if turn.finish_reason == "length"
                         else "answer")
            return
        results = [agent._run_tool(step, call) for call in turn.calls]  # in the order the model made them
        self.messages.extend(agent.client.wire.result_messages(turn.calls, results))

    def fail(self, error: ClientError) -> None:
        self.stop, self.error = "error", str(error)
        self.step += 1
        self.agent.on_event("error", {"step": self.step - 1, "message": self.error})
        if self.agent.transcript:
            self.agent.transcript.write("error", step=self.step - 1, message=self.error, status=error.status,
                                        body=error.body)

    def finish(self) -> AgentResult:
        stop = self.stop or "max_steps"
        result = AgentResult(self.answer, stop, self.step, self.usage, self.messages, self.error)
        self.agent.on_event("done", {"stop_reason": stop, "steps": result.steps, "usage": asdict(self.usage),
                                     "error": self.error})
        if self.agent.transcript:
            self.agent.transcript.write("end", stop_reason=stop, steps=result.steps, usage=asdict(self.usage),
                                        answer=self.answer, error=self.error, messages=self.messages)
        return result
