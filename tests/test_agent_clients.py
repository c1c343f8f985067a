"""Third-party agent clients driving a live server through a whole tool loop, as a user would run them.

Covers the OpenAI Agents SDK (`Runner.run` and `Runner.run_streamed`, with and without its reasoning replay),
langchain-openai and langchain-anthropic: turn 1 calls a tool, the client runs it and sends turn 2 with the
assistant turn in its history, exactly as the client builds it (no workaround on the client's side). Every
request and response is recorded (`Recorder`) so the tests also pin what each client sends back: call ids, the
arguments (verbatim, or re-serialised by langchain-openai), and whether the thinking of turn 1 travels with it.

The bundled model has random weights: tests check protocol, shapes and exact round trips, never what the text
says. Temperature 0 makes every run the same; the tier budgets are small so thinking stays short.
"""

# ruff: noqa: E402 -- tracing is switched off before `agents` is imported, so nothing goes to the network
import os

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

import asyncio
import contextlib
import dataclasses
import json

import anthropic
import httpx2
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from openai.types.shared import Reasoning

from horizon.engine import ConstraintSpec

from .live import LiveServer, engine_requests

MODEL = "horizon-test"
BUDGETS = {"low": 8, "high": 16, "max": 32}
QUESTION = "What is 2 + 3? Use the add tool."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("keys"), generation_config={"thinking_budgets": BUDGETS}) as s:
        yield s


# --- recording what a client sends and gets ------------------------------------------------------------------
class Recorder:
    """Each request body a client sent, with the status, headers and body that came back (httpx2 event hooks:
    both SDKs take an httpx2 client). Responses are read in the hook, so a stream reaches the client whole; the
    SDK still parses it as SSE. The clients here send one request at a time."""

    def __init__(self):
        self.exchanges: list[dict] = []

    def _sent(self, request) -> None:
        self.exchanges.append({"request": json.loads(request.content)})

    def _record(self, response) -> None:
        self.exchanges[-1].update(status=response.status_code, headers=response.headers, body=response.text)

    def _got(self, response) -> None:
        response.read()
        self._record(response)

    async def _asent(self, request) -> None:
        self._sent(request)

    async def _agot(self, response) -> None:
        await response.aread()
        self._record(response)

    def client(self) -> httpx2.Client:
        return httpx2.Client(timeout=120, event_hooks={"request": [self._sent], "response": [self._got]})

    def async_client(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(timeout=120, event_hooks={"request": [self._asent], "response": [self._agot]})

    @property
    def requests(self) -> list[dict]:
        return [e["request"] for e in self.exchanges]

    def turn(self, i: int) -> dict:
        """Exchange i, which must have been answered with a 200."""
        assert len(self.exchanges) > i, f"only {len(self.exchanges)} requests were sent"
        e = self.exchanges[i]
        assert e["status"] == 200, e["body"]
        return e


def returned_message(exchange: dict) -> dict:
    """The assistant message a chat completion returned (rebuilt from its SSE chunks when streamed)."""
    if exchange["headers"]["content-type"].startswith("application/json"):
        return json.loads(exchange["body"])["choices"][0]["message"]
    msg = {"reasoning_content": None, "tool_calls": []}
    for line in exchange["body"].splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            delta = choice["delta"]
            if "reasoning_content" in delta:
                msg["reasoning_content"] = (msg["reasoning_content"] or "") + delta["reasoning_content"]
            for tc in delta.get("tool_calls") or []:
                if tc.get("id"):
                    msg["tool_calls"].append({"id": tc["id"], "type": "function",
                                              "function": {"name": tc["function"]["name"], "arguments": ""}})
                msg["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"].get("arguments", "")
    return msg


def history_of(request: dict, role: str) -> list[dict]:
    return [m for m in request["messages"] if m["role"] == role]


def check_openai_turn_two(rec: Recorder, results: list[str], arguments=lambda text: text) -> dict:
    """Turn 2 carries turn 1's calls (ids and names verbatim, each argument string as `arguments` of the one
    generated) and their results; the assistant message as it was sent is returned."""
    first, second = returned_message(rec.turn(0)), rec.requests[1]
    (assistant,) = history_of(second, "assistant")
    expected = [{**c, "function": {**c["function"], "arguments": arguments(c["function"]["arguments"])}}
                for c in first["tool_calls"]]
    assert expected and assistant["tool_calls"] == expected
    assert [(m["tool_call_id"], m["content"]) for m in history_of(second, "tool")] == \
        [(c["id"], r) for c, r in zip(first["tool_calls"], results, strict=True)]
    assert second["reasoning_effort"] == "low" and second.get("tool_choice", "auto") == "auto"
    return assistant


def outcome(call):
    """(what call returned, None) or (None, what it raised): what was sent is checked before the run's failure."""
    try:
        return call(), None
    except Exception as e:  # reported by the test's last assertion
        return None, e


# --- OpenAI Agents SDK ---------------------------------------------------------------------------------------
def run_agent(srv: LiveServer, replay: bool, stream: bool):
    """One Agents SDK run: turn 1 must call `add` (reasoning low), the SDK runs it and resets tool_choice, turn 2
    answers. Returns (recorder, calls the tool ran, the run's result, the exception it raised)."""
    rec, calls = Recorder(), []

    @function_tool(name_override="add")
    def counted_add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return add(a, b)

    async def main():
        client = AsyncOpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0,
                             http_client=rec.async_client())
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client,
                                           should_replay_reasoning_content=(lambda ctx: True) if replay else None)
        settings = ModelSettings(reasoning=Reasoning(effort="low"), tool_choice="required", max_tokens=40,
                                 temperature=0)
        agent = Agent(name="calculator", instructions="Answer with the add tool.", tools=[counted_add],
                      model=model, model_settings=settings)  # reset_tool_choice: turn 2 is free to answer
        if not stream:
            return await Runner.run(agent, QUESTION, max_turns=3)
        result = Runner.run_streamed(agent, QUESTION, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result, error = outcome(lambda: asyncio.run(main()))
    return rec, calls, result, error


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("replay", [False, True], ids=["default", "replay_reasoning"])
def test_agents_sdk_tool_loop_completes(srv, replay, stream):
    rec, calls, result, error = run_agent(srv, replay, stream)
    assert len(calls) >= 1 and all(isinstance(x, int) for call in calls for x in call)
    first = rec.requests[0]
    assert first["reasoning_effort"] == "low" and first["tool_choice"] == "required" and first["max_tokens"] == 40
    assert first["tools"][0]["function"]["name"] == "add" and first["tools"][0]["function"]["strict"] is True
    assert bool(first.get("stream")) == stream
    assistant = check_openai_turn_two(rec, [str(add(*calls[0]))])
    if replay:  # opted in: the reasoning goes back as it came
        assert assistant["reasoning_content"] == returned_message(rec.turn(0))["reasoning_content"] != ""
    else:  # the SDK's default replays reasoning to DeepSeek models only
        assert "reasoning_content" not in assistant
    assert "thinking_tier" not in assistant  # never kept by the SDK
    assert error is None, f"the run failed on request {len(rec.exchanges)}: {error!r}"
    assert isinstance(result.final_output, str)
    assert all(e["status"] == 200 for e in rec.exchanges)


def test_agents_sdk_default_run_is_told_its_turn_was_restored(srv):
    """The SDK sent turn 1 back without its reasoning: the server restores it and says how many turns it did."""
    rec, calls, result, error = run_agent(srv, replay=False, stream=False)
    assert error is None, f"the run failed on request {len(rec.exchanges)}: {error!r}"
    assert calls and isinstance(result.final_output, str)
    assert rec.turn(1)["headers"].get("x-horizon-restored") == "1"


def test_agents_sdk_turn_two_prompt_is_the_same_with_and_without_reasoning_replay(srv):
    """Token for token, the model sees the same history whether the SDK replays reasoning or the server restores it."""
    with engine_requests(srv) as seen:
        runs = [run_agent(srv, replay=replay, stream=False) for replay in (False, True)]
    prompts = [r.prompt_ids for r in seen]
    assert all(error is None for _, _, _, error in runs)
    assert [len(rec.exchanges) for rec, *_ in runs] == [2, 2] and len(prompts) == 4
    assert prompts[0] == prompts[2] and prompts[1] == prompts[3]  # turn 1 and turn 2 of each run


# --- langchain-openai ----------------------------------------------------------------------------------------
def test_langchain_openai_tool_round_trip(srv):
    rec = Recorder()
    llm = ChatOpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, model=MODEL, reasoning_effort="low",
                     max_tokens=40, temperature=0, max_retries=0, http_client=rec.client())
    # strict: the server holds the arguments to the schema (without it, `required` forces a call to any object)
    messages = [HumanMessage(QUESTION)]
    first = llm.bind_tools([add], tool_choice="required", strict=True).invoke(messages)
    assert [c["name"] for c in first.tool_calls] == ["add"] and not first.invalid_tool_calls
    messages.append(first)
    messages += [ToolMessage(str(add(**c["args"])), tool_call_id=c["id"]) for c in first.tool_calls]
    second, error = outcome(lambda: llm.bind_tools([add], strict=True).invoke(messages))

    sent = rec.requests[0]
    assert sent["tool_choice"] == "required" and sent["reasoning_effort"] == "low"
    assert sent["max_completion_tokens"] == 40 and "max_tokens" not in sent  # renamed by langchain-openai
    # langchain keeps parsed args, not the generated text: it sends json.dumps of them ("-0" comes back as "0")
    reserialised = lambda text: json.dumps(json.loads(text), ensure_ascii=False)
    assistant = check_openai_turn_two(rec, [m.content for m in messages[2:]], arguments=reserialised)
    assert "reasoning_content" not in assistant and "reasoning_content" not in first.additional_kwargs  # dropped
    assert error is None, f"turn 2 failed: {error!r}"
    assert isinstance(second, AIMessage) and rec.turn(1)["status"] == 200


# --- langchain-anthropic -------------------------------------------------------------------------------------
def decides_to_call(server: LiveServer):
    """The random model never calls a tool by itself, and a forced tool_choice is refused with thinking on (as in
    the reference API): inside this block the engine holds each answer to one call of an offered tool, as a
    trained model's choice would be. Its thinking runs first, as ever."""

    def calling(request):
        tools = [(t["function"]["name"], t["function"]["parameters"]) for t in request.tools]
        return dataclasses.replace(request, constraint=ConstraintSpec.for_tools(tools, required=True, parallel=False))

    return engine_requests(server, calling)


def chat_anthropic(srv: LiveServer, rec: Recorder, **kw) -> ChatAnthropic:
    llm = ChatAnthropic(base_url=srv.url, api_key=srv.api_key, model=MODEL, max_tokens=48, temperature=0,
                        max_retries=0, default_headers={"x-api-key": srv.api_key}, **kw)
    # langchain-anthropic takes no http client: its cached `_client` is set to one that records
    llm.__dict__["_client"] = anthropic.Anthropic(**llm._client_params, http_client=rec.client())
    return llm


def anthropic_round_trip(llm: ChatAnthropic, rec: Recorder, tool_choice: str | None = None,
                         first_turn=contextlib.nullcontext):
    """Turn 1 (must call `add`, once: a second call would be cut off by max_tokens and come back as text), the
    tool's result, turn 2. Returns (turn 1's content as the server sent it, turn 2's assistant message as
    langchain sent it, turn 2's AIMessage)."""
    messages = [HumanMessage(QUESTION)]
    with first_turn():
        first = llm.bind_tools([add], tool_choice=tool_choice, parallel_tool_calls=False).invoke(messages)
    assert [c["name"] for c in first.tool_calls] == ["add"]
    messages += [first, *(ToolMessage(str(add(**c["args"])), tool_call_id=c["id"]) for c in first.tool_calls)]
    second = llm.bind_tools([add]).invoke(messages)
    returned = json.loads(rec.turn(0)["body"])
    sent = rec.requests[1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    (call,) = [b for b in returned["content"] if b["type"] == "tool_use"]
    assert sent[2]["content"] == [{"type": "tool_result", "tool_use_id": call["id"],
                                   "content": str(add(**call["input"])), "is_error": False}]
    assert rec.turn(1)["status"] == 200 and isinstance(second, AIMessage)
    return returned["content"], sent[1], second


def test_langchain_anthropic_sends_thinking_back_with_its_signature(srv):
    rec = Recorder()
    llm = chat_anthropic(srv, rec, thinking={"type": "adaptive"}, effort="low")  # low: 8 thinking tokens
    returned, assistant, second = anthropic_round_trip(llm, rec, first_turn=lambda: decides_to_call(srv))
    assert rec.requests[0]["thinking"] == {"type": "adaptive"} and rec.requests[0]["output_config"]["effort"] == "low"
    assert [b["type"] for b in returned] == ["thinking", "tool_use"] and returned[0]["signature"].startswith("low.")
    assert assistant["content"] == returned  # thinking text, signature, call id and input: verbatim
    assert second.content[0]["type"] == "thinking" and second.content[0]["signature"].startswith("low.")


def test_langchain_anthropic_forced_tool_round_trip_without_thinking(srv):
    rec = Recorder()
    returned, assistant, _ = anthropic_round_trip(chat_anthropic(srv, rec), rec, tool_choice="add")
    assert rec.requests[0]["tool_choice"] == {"type": "tool", "name": "add", "disable_parallel_tool_use": True}
    assert [b["type"] for b in returned] == ["tool_use"] and assistant["content"] == returned
