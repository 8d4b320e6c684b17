"""OpenAI request fields -> engine SamplingParams and prompt tokens; every refusal names its parameter."""

from __future__ import annotations

import dataclasses
from typing import Any

from loraplex.engine.client import EngineClient
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.errors import bad_request, from_engine_error, shown
from loraplex.platform.schemas.openai import ChatCompletionRequest, CompletionRequest
from loraplex.platform.schemas.text import refuse_unstorable

# Fields the server cannot honour, with why, refused by name when sent with any value but null (or the one
# value that asks for nothing). Fields a request model does not declare are skipped.
_NOT_SERVED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "web_search_options": ("this server does not search the web", ()),
    "prediction": ("this server does not use predicted outputs", ()),
    "reasoning_effort": ("this server's models do not reason", ()),
    "verbosity": ("this server's models have no verbosity setting", ()),
    "service_tier": ("this server has no service tiers (send 'auto' or leave it out)", ("auto", "default")),
    "store": ("this server does not keep completions", (False,)),
    "guided_json": ("this server does not do guided decoding", ()),
    "guided_regex": ("this server does not do guided decoding", ()),
    "guided_choice": ("this server does not do guided decoding", ()),
    "guided_grammar": ("this server does not do guided decoding", ()),
    "structured_outputs": ("this server does not do guided decoding", ()),
    "use_beam_search": ("this server does not do beam search", (False,)),
    "length_penalty": ("it applies to beam search, which this server does not do", (1.0,)),
}


def _refuse_not_served(req) -> None:
    for name, (why, harmless) in _NOT_SERVED.items():
        value = getattr(req, name, None)
        if value is not None and value not in harmless:
            raise bad_request(f"{name} is not supported: {why}", param=name)


def _sampling(req, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    _refuse_not_served(req)
    try:
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k if req.top_k else -1,
            min_p=req.min_p, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty, logprobs=logprobs,
        )
    except InvalidRequestError as exc:
        raise from_engine_error(exc) from exc


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def chat_sampling(req: ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    _refuse_response_format(req)
    _refuse_tools_and_audio(req)
    _refuse_stream_options_without_stream(req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _sampling(req, max_tokens=req.max_completion_tokens or req.max_tokens, logprobs=logprobs)


def _refuse_response_format(req: ChatCompletionRequest) -> None:
    kind = req.response_format.type if req.response_format is not None else "text"
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"Invalid value for 'response_format.type': {shown(kind)!r}; supported values are "
                          "'text', 'json_object' and 'json_schema'", param="response_format.type")
    if kind != "text":
        raise bad_request(f"response_format {kind!r} is not supported; only 'text' is", param="response_format")


def _refuse_tools_and_audio(req: ChatCompletionRequest) -> None:
    """Tool calling and audio output are not served: a request that asks for them is refused. Tools sent
    with tool_choice 'none' (the model answers in text either way) and empty lists are accepted; a tool
    choice without tools is refused, as OpenAI's API refuses it."""
    for tools, choice, name, choice_name in ((req.tools, req.tool_choice, "tools", "tool_choice"),
                                             (req.functions, req.function_call, "functions", "function_call")):
        if choice is not None and not tools:
            raise bad_request(f"{choice_name} is only allowed when {name} are specified", param=choice_name)
        if choice is not None and choice not in ("none", "auto"):
            what = choice if isinstance(choice, str) else "a named function"
            raise bad_request(f"{choice_name} {what!r} is not supported: this server does not make tool calls",
                              param=choice_name)
        if tools and choice != "none":
            raise bad_request(f"{name} are not supported: this server does not make tool calls; leave {name} out "
                              f"or send {choice_name} 'none' to have the model answer in text", param=name)
    other = sorted({m for m in req.modalities or () if m != "text"})
    if other:
        raise bad_request(f"modalities {other} are not supported; only 'text' is", param="modalities")
    if req.audio is not None:
        raise bad_request("audio output is not supported", param="audio")


def _refuse_stream_options_without_stream(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          param="stream_options")


def completion_sampling(req: CompletionRequest) -> SamplingParams:
    _refuse_stream_options_without_stream(req)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    if req.suffix:
        raise bad_request("suffix is not supported by this model", param="suffix")
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    return _sampling(req, max_tokens=req.max_tokens, logprobs=req.logprobs)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: content as plain text (text parts joined; an assistant's
    refusal, as a part or in its `refusal` field, is what it said)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None and m.role == "assistant" and m.refusal is not None:
            content = m.refusal
        # Only an assistant turn may omit its content (OpenAI allows it next to tool calls).
        if content is None and m.role != "assistant":
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}",
                              param=f"messages[{i}].content")
        if isinstance(content, list):
            content = "".join(_part_text(m.role, part, f"messages[{i}].content[{j}]")
                              for j, part in enumerate(content))
        out.append({"role": m.role, "content": content or ""})
    return out


def _part_text(role: str, part: dict[str, Any], param: str) -> str:
    kind = part.get("type")
    if kind == "refusal" and role != "assistant":
        raise bad_request(f"refusal content parts are only allowed in assistant messages, not in a {shown(role)!r} "
                          "one", param=param)
    if kind not in ("text", "refusal"):
        what = f"got {shown(kind)!r}" if kind is not None else "this part has no 'type'"
        raise bad_request("only text content parts are supported (and refusal parts in assistant messages); "
                          f"{what}", param=param)
    # the part's text is under its type's name: {"type": "text", "text": ...}, {"type": "refusal", "refusal": ...}
    if kind not in part:
        raise bad_request(f"this {kind!r} content part has no '{kind}' field: send its text as '{kind}'",
                          param=f"{param}.{kind}")
    if not isinstance(part[kind], str):
        raise bad_request(f"the '{kind}' of a {kind!r} content part must be a string, got "
                          f"{type(part[kind]).__name__}", param=f"{param}.{kind}")
    return part[kind]


def encode_chat(engine: EngineClient, req: ChatCompletionRequest) -> list[int]:
    try:
        return engine.encode_chat(chat_messages(req))
    except InvalidRequestError as exc:
        raise from_engine_error(exc) from exc


# a completion batch (OpenAI's limit on prompts), and prompts x n: one request holds one concurrency slot
# however many sequences it runs
MAX_BATCH_PROMPTS = 2048
MAX_BATCH_SEQUENCES = 2048


def completion_prompts(engine: EngineClient, req: CompletionRequest) -> list[list[int]]:
    """A completion request may carry one prompt or a batch (strings or token ids). A string prompt is the
    caller's whole prompt, written for the model: its special-token text is read as special tokens (as OpenAI's
    legacy completions and vLLM read it), unlike a chat message's."""
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise bad_request(f"prompt holds {len(prompts)} prompts; a request may hold at most {MAX_BATCH_PROMPTS}",
                          param="prompt")
    n = req.n or 1
    if len(prompts) * n > MAX_BATCH_SEQUENCES:
        raise bad_request(f"{len(prompts)} prompts with n={n} make {len(prompts) * n} completions; a request may "
                          f"ask for at most {MAX_BATCH_SEQUENCES} (split the batch)", param="prompt")
    out = []
    for item in prompts:
        try:
            ids = engine.encode(item) if isinstance(item, str) else list(item)
        except InvalidRequestError as exc:
            raise from_engine_error(exc) from exc
        if not ids:
            # an empty text is a prompt where the tokenizer adds a beginning-of-text token (the generation starts
            # from it); where it adds none, nothing is there to start from
            raise bad_request("The prompt is empty and this model's tokenizer gives no tokens for empty text (it "
                              "adds no beginning-of-text token): send at least one token of prompt"
                              if isinstance(item, str) else "prompt must not hold an empty list of token ids",
                              param="prompt")
        out.append(ids)
    return out


def check_context(engine: EngineClient, prompt_len: int, params: SamplingParams, param: str,
                  max_param: str = "max_tokens") -> int:
    """The number of completion tokens each choice may produce; refuses prompts that cannot fit."""
    limit = engine.max_model_len
    if prompt_len >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                          f"{prompt_len} tokens. Please reduce the length of the {param}.", param=param,
                          code="context_length_exceeded")
    if params.max_tokens is None:
        # the default: up to the end of the context, which min_tokens must fit in as it must fit in max_tokens
        room = limit - prompt_len
        if params.min_tokens > room:
            raise bad_request(f"min_tokens is {params.min_tokens}, but this model's maximum context length of "
                              f"{limit} tokens leaves room for at most {room} completion tokens after your "
                              f"prompt's {prompt_len}. Please lower min_tokens or reduce the length of the "
                              f"{param}.", param="min_tokens")
        return room
    if prompt_len + params.max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                          f"{params.max_tokens} for the completion). Please reduce the length of the {param} "
                          "or the completion.", param=max_param, code="context_length_exceeded")
    return params.max_tokens


def fit_unset_max_tokens(limits, prompt_tokens: int, sequences: int, params: SamplingParams,
                         max_new: int, minute_used: int = 0, month_used: int = 0) -> tuple[int, SamplingParams]:
    """A request that leaves max_tokens unset may run to the end of the context, and the quota reserves
    that much up front: a tenant whose per-minute token limit or remaining monthly budget is below the
    context would be refused every such request (or every one after the first in a minute). Instead the
    completion gets what the limits have left (finish_reason "length" when it runs out): the current
    minute's remaining tokens and the month's remaining budget. A prompt that alone exceeds what is left is
    still refused by the quota, with the time to wait."""
    if params.max_tokens is not None:
        return max_new, params
    allowed = min(limits.tokens_per_minute - minute_used, limits.monthly_token_budget - month_used)
    room = (allowed - prompt_tokens) // max(1, sequences)
    if room >= max_new:
        return max_new, params
    # never below min_tokens: a request that needs more than the limit allows is refused by the quota as
    # larger than the limit (429, not worth retrying), not failed by its own min_tokens
    capped = max(1, room, params.min_tokens)
    return capped, dataclasses.replace(params, max_tokens=capped, max_tokens_is_ceiling=True)


def check_text(value: str, param: str) -> str:
    """A value from outside the request body (a path, say) that reaches the database: refused as the body's
    DbText fields are (NUL, lone surrogates)."""
    try:
        return refuse_unstorable(value)
    except ValueError as exc:
        raise bad_request(f"'{param}' {exc}", param=param) from None
