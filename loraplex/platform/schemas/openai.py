"""Request and response bodies of the OpenAI-compatible API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.platform.schemas.text import DbText


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Request bodies are strict about types, as OpenAI's API is: "stream": "yes" or "max_tokens": true is a 400
# naming the field, not read as true or as 1 (numbers may still be given as integers where a float is asked).
STRICT = ConfigDict(strict=True)


class _NullMeansDefault(BaseModel):
    """OpenAI's parameters are nullable, and null means the default: the SDKs send `"temperature": null` when
    a caller passes None. A null for a field whose default is not null is read as the field left out."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            nulls = [k for k, v in data.items()
                     if v is None and k in fields and not fields[k].is_required() and fields[k].default is not None]
            if nulls:
                data = {k: v for k, v in data.items() if k not in nulls}
        return data


class StreamOptions(_NullMeansDefault):
    model_config = STRICT
    include_usage: bool = False


class _Sampling(_NullMeansDefault):
    # Unknown fields are ignored, as OpenAI-compatible servers do for newer client options.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: DbText
    n: int = Field(default=1, ge=1, le=128)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: DbText | None = Field(default=None, max_length=256)
    # Declared only so that a request relying on it is refused instead of silently ignored.
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras that are handy for tests and tools
    top_k: int | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    # Declared so that a request that needs them is refused (tool calls, audio) instead of answered as if
    # they had not been sent.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's (and vLLM's) default for text completions. An explicit null means the same, as it does for
    # OpenAI's API (vLLM would run up to the end of the context, and bill for it).
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
