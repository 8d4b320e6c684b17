"""`LLM`: offline batch generation, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora_request import LoRARequest, check_lora_request
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]
AdapterArg = LoRARequest | str | os.PathLike | None


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any):
        adapter_slots = engine_kwargs.pop("adapter_slots", None)
        self.config = EngineConfig(model=str(model), **engine_kwargs)
        self.engine = LLMEngine(self.config, adapter_slots=adapter_slots)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def register_adapter(self, name: str, adapter: LoRARequest | str | os.PathLike) -> LoRARequest:
        """Let `name` stand for an adapter (a PEFT folder or archive, validated now, or a LoRARequest) in later
        `generate(..., adapter=name)` calls. Registering a name again points it at the new adapter."""
        slots = self.engine.adapter_slots
        if getattr(slots, "register", None) is None:
            raise InvalidRequestError("this engine was started without adapter support (max_loras=0)",
                                      param="adapter")
        return slots.register(name, adapter)

    def resolve_adapter(self, adapter: AdapterArg) -> LoRARequest | None:
        """A LoRARequest as is; a registered name (`register_adapter`) or a path is resolved by the engine's
        adapter cache."""
        if adapter is None or isinstance(adapter, LoRARequest):
            check_lora_request(adapter)
            return adapter
        if not isinstance(adapter, (str, os.PathLike)):
            raise InvalidRequestError(
                "adapter must be a path, a registered adapter name, a LoRARequest or None (or a list of "
                f"those, one per prompt); got {type(adapter).__name__} {adapter!r}", param="adapter",
            )
        resolver = getattr(self.engine.adapter_slots, "resolve", None)
        if resolver is None:
            raise InvalidRequestError(
                "this engine was started without adapter support; cannot resolve adapter "
                f"{adapter!r}", param="adapter",
            )
        return resolver(adapter)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        adapter: AdapterArg | Sequence[AdapterArg] = None,
        tenant: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string, a list of token ids, a prompt dict or a list of "
                                      f"those, got {type(prompts).__name__}", param="prompt")
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in params_list):
            raise InvalidRequestError("sampling_params must be a SamplingParams or a list of them (one per prompt)",
                                      param="sampling_params")
        adapters = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * len(prompts)
        for what, given in (("sampling_params", params_list), ("adapter", adapters)):
            if len(given) != len(prompts):
                raise InvalidRequestError(f"the {what} list has {len(given)} {'entry' if len(given) == 1 else 'entries'} for "
                                          f"{len(prompts)} {'prompt' if len(prompts) == 1 else 'prompts'}: "
                                          "give one per prompt (or a single one for all)", param=what)
        loras = [self.resolve_adapter(a) for a in adapters]
        order = []
        try:
            for prompt, p, lora in zip(prompts, params_list, loras, strict=True):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p, lora=lora, tenant=tenant)
                order.append(request_id)
        except BaseException:
            # one refused prompt refuses the batch: the ones already queued must not run in a later call
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        adapter: AdapterArg = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat template is applied."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer, max_model_len = self.engine.tokenizer, self.engine.limits.max_model_len
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(conv, max_model_len=max_model_len)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, adapter=adapter, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while len(results) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        for out in results.values():
            # offline results are whole: the delta is everything
            for c in out.outputs:
                c.delta_text, c.delta_token_ids, c.delta_logprobs = c.text, list(c.token_ids), c.logprobs
        return [results[r] for r in request_ids]
