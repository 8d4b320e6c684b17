"""The engine's subcommands of `loraplex`: generate, model (fetch), bench."""

from __future__ import annotations

import os

import click

from loraplex.engine.fetch import fetch

DEFAULT_MAX_TOKENS = 128


@click.group()
def model() -> None:
    """Fetch the built-in demo model (other models need no fetch)."""


model.add_command(fetch)


@click.command()
@click.argument("prompt")
@click.option("--model", "model_name", default=None, help="Model directory, .gguf file, Hub id or demo name.")
@click.option("--chat", is_flag=True, help="Apply the model's chat template to PROMPT as a user message.")
@click.option("--system", default=None, help="System message (with --chat).")
@click.option("--adapter", default=None,
              help="LoRA adapter: a PEFT directory or archive, or (with --tenant) the name of an adapter uploaded "
                   "to this server (name or name@version).")
@click.option("--tenant", default=None,
              help="Resolve --adapter among this tenant's uploaded adapters (name or id), in the server's database "
                   "(LORAPLEX_DATA_DIR or LORAPLEX_DATABASE_URL).")
@click.option("--max-rank", type=click.IntRange(1, 4096), default=None,
              help="Largest adapter rank accepted [default: LORAPLEX_MAX_LORA_RANK, 64].")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Context length in tokens [default: LORAPLEX_MAX_MODEL_LEN, else the model's own].")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
              help="Model weights' dtype [default: LORAPLEX_DTYPE, float32].")
@click.option("--max-tokens", default=None, type=click.IntRange(min=1),
              help="Most tokens to generate; the prompt and these must fit in the model's context "
                   f"[default: {DEFAULT_MAX_TOKENS}, or what the context leaves after the prompt].")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0))
@click.option("--seed", default=None, type=int)
def generate(prompt, model_name, chat, system, adapter, tenant, max_rank, max_model_len, dtype, max_tokens,
             temperature, top_p, seed) -> None:
    """Print a completion of PROMPT.

    The engine takes the LORAPLEX_* engine settings `loraplex serve` takes (LORAPLEX_MODEL, LORAPLEX_DTYPE,
    LORAPLEX_MAX_MODEL_LEN, LORAPLEX_KV_CACHE_MEMORY, LORAPLEX_MAX_LORA_RANK, LORAPLEX_LORA_DTYPE, ...); a flag
    overrides its setting."""
    if system is not None and not chat:
        raise click.UsageError("--system applies only with --chat (the chat template places it)")
    if tenant is not None and adapter is None:
        raise click.UsageError("--tenant names whose uploaded adapter --adapter is; give --adapter too")
    if adapter is not None and not adapter.strip():
        raise click.UsageError("--adapter is empty; leave it out to use the base model")
    if adapter is not None and tenant is None and not os.path.exists(os.path.expanduser(adapter)):
        # said before the model loads; a name that is no path may be meant as an uploaded adapter's
        raise click.ClickException(f"adapter {adapter!r} does not exist: --adapter takes a PEFT folder or archive, or "
                                   "with --tenant TENANT the name of an adapter uploaded to the server")
    from pydantic import ValidationError

    from loraplex.config import Settings
    from loraplex.engine.errors import EngineError
    from loraplex.engine.sampling_params import SamplingParams

    try:
        settings = Settings()
    except ValidationError as exc:
        from loraplex.platform.commands import _setting_error

        raise click.ClickException("; ".join(_setting_error(e) for e in exc.errors())) from exc
    if tenant is not None:
        from loraplex.platform.registry import uploaded_adapter

        try:
            adapter = uploaded_adapter(settings, tenant, adapter)
        except LookupError as exc:
            raise click.ClickException(str(exc)) from exc
    try:
        flags = {"max_lora_rank": max_rank, "max_model_len": max_model_len, "dtype": dtype}
        options = settings.engine_options | {name: value for name, value in flags.items() if value is not None}
        llm = _start(model_name or settings.model, options, flags)
        max_model_len = llm.engine.limits.max_model_len
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            prompt_ids = llm.engine.tokenizer.apply_chat_template(messages, max_model_len=max_model_len)
        else:
            prompt_ids = llm.engine.encode_prompt(prompt)[1]
        max_tokens = _check_context(len(prompt_ids), max_tokens, max_model_len)
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
        out = llm.generate({"prompt_token_ids": prompt_ids}, params, adapter=adapter, use_tqdm=False)[0]
    except EngineError as exc:
        raise click.ClickException(str(exc)) from exc
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(out.outputs[0].text)


def _start(model: str, options: dict, flags: dict):
    """The offline engine; a setting it cannot run with is refused naming the flag or variable it came from."""
    from loraplex.engine.errors import InvalidRequestError
    from loraplex.engine.llm import LLM

    try:
        return LLM(model, **options)
    except InvalidRequestError as exc:
        if not exc.param:
            raise
        source = (f"--{exc.param.replace('_', '-')}" if flags.get(exc.param) is not None
                  else f"LORAPLEX_{exc.param.upper()}")
        if exc.param == "max_lora_rank" and flags.get("max_lora_rank") is not None:
            source = "--max-rank"
        raise click.ClickException(f"cannot run the model {model}: {exc} ({source})") from exc


def _check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The number of tokens to generate: a --max-tokens that the context cannot hold is refused, as the API
    does (and vLLM's server), rather than generated for minutes up to the end of the context; without one,
    the default or what the context leaves after the prompt."""
    room = max_model_len - prompt_len
    if room < 1:
        raise click.UsageError(f"the prompt has {prompt_len} tokens but the model's context is {max_model_len} "
                               "tokens: shorten the prompt")
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise click.BadParameter(
            f"{max_tokens} does not fit: the model's context is {max_model_len} tokens and the prompt takes "
            f"{prompt_len}, which leaves room for at most {room} new tokens", param_hint="'--max-tokens'")
    return max_tokens


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True)
@click.option("--num-requests", default=32, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
def bench(model_name, num_requests, max_tokens, seed) -> None:
    """Measure offline throughput (32 prompts of 20-60 words, greedy, EOS ignored)."""
    from loraplex.engine.benchmark import run_engine_benchmark
    from loraplex.engine.errors import EngineError

    try:
        result = run_engine_benchmark(model_name, num_requests=num_requests, max_tokens=max_tokens, seed=seed)
    except (EngineError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"{result['generated_tokens']} tokens in {result['seconds']:.2f}s: "
        f"{result['tokens_per_s']:.1f} tok/s ({result['prompt_tokens']} prompt tokens)"
    )
