"""Request bodies of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as pydantic models.

Unknown fields are tolerated everywhere (`cache_control`, `citations`, `metadata`, `service_tier`,
thinking `display`, ...): clients send them freely, and Horizon has nothing to do with them. Known
fields are typed, so a malformed request is a 400 in Anthropic's shape (the app's validation
handler) before the adapter sees it. Content block types are a discriminated union on `type`: a
block this server cannot render (`document`, `search_result`, server tool results, ...) is refused
by name rather than dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- content blocks -------------------------------------------------------------------------------
class TextBlock(Loose):
    type: Literal["text"]
    text: str


class Base64Source(Loose):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(Loose):
    type: Literal["url"]
    url: str


class FileSource(Loose):
    type: Literal["file"]
    file_id: str


ImageSource = Annotated[Base64Source | UrlSource | FileSource, Field(discriminator="type")]


class ImageBlock(Loose):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(Loose):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(Loose):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool = False


class ThinkingBlock(Loose):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Loose):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class MessageParam(Loose):
    role: Literal["user", "assistant"]
    content: str | list[Block]


# --- tools, thinking, output ------------------------------------------------------------------------
class ToolParam(Loose):
    name: str = Field(min_length=1)
    type: str | None = None  # absent or "custom"; server tools (bash_..., web_search_...) are refused
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required for custom tools (checked with a clear message)
    strict: bool = False  # constrain this tool's input to its schema even when the call is not forced


class ToolChoice(Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # for type "tool"
    disable_parallel_tool_use: bool = False


class ThinkingEnabled(Loose):
    type: Literal["enabled"]
    budget_tokens: int


class ThinkingAdaptive(Loose):
    type: Literal["adaptive"]


class ThinkingDisabled(Loose):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JsonFormat(Loose):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Loose):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None


# --- requests -----------------------------------------------------------------------------------------
class CountTokensRequest(Loose):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class Metadata(Loose):
    user_id: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as in the reference API; it includes thinking tokens
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None  # accepted and ignored
