"""Request and response bodies in OpenAI's shapes (pydantic), and OpenAI's error shape.

Every field OpenAI defines parses; what we cannot honour (`logit_bias`, penalties, `suffix`, audio,
...) and fields OpenAI does not define are a 400 naming the field (`unsupported_fields`), never
silently ignored. Pure metadata (`user`, `metadata`, `store`, `service_tier`) is accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning (thinking templates)


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # OpenAI: compile the schema in strict mode only when true


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Lenient):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted by OpenAI's schema, not supported here: a 400 unless left at the default
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # metadata: accepted, no effect on generation
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension; `thinking` (bool) is known
    # not supported: a 400 when set
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


def unsupported_fields(req: _Sampling) -> tuple[str, str] | None:
    """(field, why) for the first field set that we cannot honour, or None."""
    for name in sorted(req.model_extra or {}):
        return name, f"Unrecognized request argument supplied: {name}"
    if req.presence_penalty:
        return "presence_penalty", "presence_penalty is not supported (only 0)"
    if req.frequency_penalty:
        return "frequency_penalty", "frequency_penalty is not supported (only 0)"
    if req.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    if isinstance(req, ChatCompletionRequest):
        for name in (
            "functions",
            "function_call",
            "audio",
            "prediction",
            "web_search_options",
            "reasoning_effort",
        ):
            if getattr(req, name) is not None:
                return name, f"{name} is not supported"
        if req.modalities is not None and req.modalities != ["text"]:
            return "modalities", "only text output is supported"
    if isinstance(req, CompletionRequest):
        if req.suffix:
            return "suffix", "suffix is not supported"
        if req.best_of is not None and req.best_of != req.n:
            return "best_of", "best_of is not supported (only equal to n)"
    return None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """A request error to answer with OpenAI's error shape and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)
