"""The agent runtime: tools, a client for either API, and the loop that keeps the full history."""

from horizon.agent.calculator import Calculator
from horizon.agent.client import AnthropicWire, ClientError, HTTPClient, OpenAIWire, ReplayClient, StepRequest, Turn
from horizon.agent.files import ListFiles, ReadFile, SearchFiles, WriteFile
from horizon.agent.loop import Agent, AgentConfig, AgentResult, StepPlan, Transcript, fixed_policy, replay
from horizon.agent.registry import TOOLSETS, make_tools
from horizon.agent.shell import Shell
from horizon.agent.tool import Tool, ToolError, ToolResult
from horizon.simfs.fs import SimFS  # the submodules, not horizon.simfs: see horizon/simfs/__init__.py
from horizon.simfs.shell import Terminal
from horizon.simfs.tree import seeded_tree

__all__ = ["TOOLSETS", "Agent", "AgentConfig", "AgentResult", "AnthropicWire", "Calculator", "ClientError",
           "HTTPClient", "ListFiles", "OpenAIWire", "ReadFile", "ReplayClient", "SearchFiles", "Shell", "SimFS",
           "StepPlan", "StepRequest", "Terminal", "Tool", "ToolError", "ToolResult", "Transcript", "Turn",
           "WriteFile", "fixed_policy", "make_tools", "replay", "seeded_tree"]
