"""The request body of OpenAI's `POST /v1/chat/completions`, as pydantic models.

Unknown fields are accepted and ignored (OpenAI clients send many: `user`, `metadata`, `store`,
`service_tier`, ...). The fields Horizon uses are validated here with OpenAI's ranges, so a bad value
is a 400 naming the field. Messages stay plain dicts: `horizon.chat` reads and checks them (one
reader for the template and the history validator), and its errors name `messages[i]`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_CHOICES = 16  # n: each choice is one engine request; more than this is better sent as separate requests
MAX_STOP = 16  # the engine's limit on stop strings (OpenAI allows 4)
THINKING_BUDGETS = ("none", "low", "high", "max")
SEED_MAX = 2**63 - 1 - MAX_CHOICES  # seeds seed+i must still fit torch's 64-bit generator seed


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(Lenient):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments are described
    strict: bool | None = None  # true: the arguments are constrained to the schema while decoding


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Lenient):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # always enforced here (constrained decoding costs nothing extra)


class ResponseFormatText(Lenient):
    type: Literal["text"]


class ResponseFormatJsonObject(Lenient):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(Lenient):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


class StreamOptions(Lenient):
    include_usage: bool = False


class ChatCompletionRequest(Lenient):
    model: str
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    user: str | None = None  # accepted and ignored (typed: the spec's string)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    thinking_budget: Any = None  # the seeds' field: "none" | "low" | "high" | "max" | a token cap (checked below)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's older name
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        if v == "":
            raise ValueError("a stop string must not be empty")
        return v

    @field_validator("thinking_budget")
    @classmethod
    def _thinking_budget(cls, v):
        if v is None or v in THINKING_BUDGETS and isinstance(v, str):
            return v
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
        raise ValueError(f"must be one of {', '.join(map(repr, THINKING_BUDGETS))} or an integer >= 1 (a cap on "
                         f"thinking tokens), got {v!r}")

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v):
        for key in v or {}:
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids written as strings, got {key!r}")
        return v

    # --- derived values --------------------------------------------------------------------------------
    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @property
    def max_new_tokens(self) -> int | None:
        """The client's limit (max_completion_tokens wins over the deprecated max_tokens); None: not given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
