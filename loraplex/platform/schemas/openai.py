"""Request and response bodies of the OpenAI-compatible API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from loraplex.platform.schemas.text import DbText, refuse_unstorable


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
    # Fields unknown to OpenAI's API (and to the vLLM extras below) are ignored, as OpenAI-compatible servers
    # do for newer client options. Known fields the server cannot honour are declared so that they are refused
    # by name (loraplex.platform.inference.params) instead of ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: DbText
    n: int = Field(default=1, ge=1, le=128)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    # 0 keeps only the most likely token
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # the length bound inside the optional type, where pydantic words it in characters
    user: Annotated[str, Field(max_length=256), AfterValidator(refuse_unstorable)] | None = None
    # Declared only so that a request relying on it is refused instead of silently ignored.
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras that are handy for tests and tools
    top_k: int | None = None
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=256)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM extras this server does not serve (guided decoding, beam search): refused unless null
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: bool = False
    length_penalty: float | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # an assistant turn in which the model refused (OpenAI's SDKs send it back in the conversation)
    refusal: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # Declared so that a request that needs them is refused (tool calls, audio, web search, stored
    # completions) instead of answered as if they had not been sent.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    service_tier: str | None = None
    store: bool = False
    # accepted: they change nothing in the answer
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's (and vLLM's) default for text completions. An explicit null means the same, as it does for
    # OpenAI's API (vLLM would run up to the end of the context, and bill for it).
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
