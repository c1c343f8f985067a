"""The request body of OpenAI's `POST /v1/responses`, as pydantic models.

Its shapes are flat and differ from Chat Completions: a function tool is `{type, name, description,
parameters, strict}` (an omitted `strict` means strict), `text.format` is `{type: "json_schema",
name, schema, strict}`, thinking is `reasoning.effort`. Unknown fields are accepted and ignored
(clients send `user`, `service_tier`, `prompt_cache_key`, ...). Input items stay plain dicts:
`horizon.server.responses` reads each one and names `input[i]` in its errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs", "reasoning.summary")


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionTool(Lenient):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # omitted: strict (the Responses API's default)


class NamedFunction(Lenient):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


class Reasoning(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries are produced: `summary: []`


class FormatText(Lenient):
    type: Literal["text"]


class FormatJsonObject(Lenient):
    type: Literal["json_object"]


class FormatJsonSchema(Lenient):
    type: Literal["json_schema"]
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # always enforced here


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(Lenient):
    format: TextFormat | None = None


class ResponsesRequest(Lenient):
    model: str
    user: str | None = None  # accepted and ignored (typed: the spec's string)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: only function tools are served
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    reasoning: Reasoning | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False

    @field_validator("include")
    @classmethod
    def _includable(cls, v):
        for x in v or ():
            if x not in INCLUDABLE:
                raise ValueError(f"{x!r} is not supported; allowed: {', '.join(INCLUDABLE)}")
        return v

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("at least one input item is needed")
        return v
