"""The synchronous engine: requests in, one `step()` at a time, `RequestOutput`s out.

    batch = scheduler.schedule()
    sampled = runner.run(batch)
    scheduler.postprocess(batch, sampled)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.adapter_slots import AdapterSlots
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.config import EngineConfig, EngineLimits
from loraplex.engine.cpu_tuning import keep_freed_memory
from loraplex.engine.errors import AdapterLoadError, AdapterMissingError, InvalidRequestError, ModelLoadError
from loraplex.engine.lora_request import LoRARequest, check_lora_request
from loraplex.engine.model_loader import iter_weights, load_model_config, resolve_model_dir
from loraplex.engine.model_runner import ModelRunner, kv_block_bytes
from loraplex.engine.models.arch import ModelArch
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.request_state import RequestState
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, fit_max_tokens
from loraplex.engine.sequence import Sequence
from loraplex.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A step of at least this many tokens pauses background adapter loads rather than run beside them on one
# thread fewer (see LLMEngine._cpu_threads_beside_loads): decode steps are a few dozen tokens, prefills more.
PAUSE_LOADS_MIN_TOKENS = 256
# A step with nothing to run while adapter loads are under way waits this long at most for one to finish
# (LoraManager.wait_for_load) instead of returning at once to a caller that would step again.
IDLE_LOAD_WAIT_S = 0.02

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def resolve_lora_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """How adapter weights are held: `auto` is the model's dtype. Another dtype is a CPU feature (its
    kernel widens half-precision weights as it reads them); a GPU's kernels take the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in _DTYPES:
        raise ValueError(f"lora_dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    dtype = _DTYPES[name]
    if dtype != model_dtype and device.type != "cpu":
        raise ValueError(f"lora_dtype={name} differs from the model's dtype, which only the CPU supports; "
                         f"use lora_dtype=auto on {device.type}")
    return dtype


def check_model(model: str) -> tuple[Path, ModelArch]:
    """The model's local folder (fetched or converted first where needed) and its architecture, without
    loading the weights; ModelLoadError names what is wrong (commands call it before they start a server)."""
    model_dir = resolve_model_dir(model)
    hf_config = load_model_config(model_dir)
    try:
        return model_dir, ModelArch.from_hf_config(hf_config)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc


def derive_limits(config: EngineConfig, arch: ModelArch, dtype: torch.dtype, *,
                  warn: bool = True) -> tuple[int, int]:
    """The number of KV blocks and the context length `config` gives a model of `arch`, without loading it;
    InvalidRequestError (a ValueError) naming the setting that cannot serve it (commands call it before they
    start a server, so that a bad setting is a one-line error rather than a start-up traceback)."""
    max_len = config.max_model_len or arch.max_position_embeddings
    if max_len > arch.max_position_embeddings:
        raise InvalidRequestError(
            f"max_model_len {max_len} exceeds the model's {arch.max_position_embeddings} positions",
            param="max_model_len",
        )
    short = arch.rope_short_positions
    if short is not None and max_len > short:
        # transformers rotates every token of a forward pass whose positions pass LongRoPE's
        # original_max_position_embeddings with the long factors, so past it a token's rotation depends on
        # how its sequence was split into passes; below it every token takes the short factors, which is
        # what the engine computes.
        if config.max_model_len is not None:
            raise InvalidRequestError(
                f"max_model_len {max_len} exceeds the {short} positions this engine serves of a LongRoPE model "
                f"(its original_max_position_embeddings; past them the model switches to its long factors)",
                param="max_model_len",
            )
        if warn:
            log.warning("%s uses LongRoPE, whose long factors this engine does not implement: max_model_len is "
                        "capped at its original_max_position_embeddings, %d", arch.model_type, short)
        max_len = short
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = config.kv_cache_memory // kv_block_bytes(arch, config.block_size, dtype)
    if num_blocks < 1:
        raise InvalidRequestError(
            f"the KV cache budget of {config.kv_cache_memory} bytes holds no block (a block of this model takes "
            f"{kv_block_bytes(arch, config.block_size, dtype)} bytes); raise kv_cache_memory or num_kv_blocks",
            param="kv_cache_memory",
        )
    return num_blocks, max_len


def load_model(model_dir, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(arch, dtype)
    try:
        model.load_weights(iter_weights(model_dir))
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    model.pack_for_cpu()
    return model.eval()


def prepare_cpu_kernels(*, lora: bool) -> None:
    """Build (first time on a machine: one to two minutes on 2 cores) or load the CPU kernels now, at
    start-up, so that no request waits for a compiler. Without a compiler the torch paths serve, with a
    warning."""
    import time

    from loraplex.kernels import lora_cpu, ops_cpu

    extensions = [ops_cpu._EXTENSION] + ([lora_cpu._EXTENSION] if lora else [])
    built = all(any(p.suffix == ".so" for p in Path(e.build_directory()).glob("*")) for e in extensions)
    if not built:
        log.warning("building the CPU kernels for this machine (once; one to two minutes)")
    start = time.perf_counter()
    ok = ops_cpu.available() and (not lora or lora_cpu.available())
    seconds = time.perf_counter() - start
    if seconds > 5:
        log.info("CPU kernels built in %.0f s (cached for later starts)", seconds)
    if not ok:
        log.warning("some CPU kernels could not be built; their plain-torch paths are used (slower)")
    from loraplex.kernels import linear_cpu

    # measured now rather than in the first request's prefill ("panels" at once where there is no kernel)
    log.info("CPU GEMM for prefill-sized batches: %s", linear_cpu.large_batch_path())


class LLMEngine:
    def __init__(self, config: EngineConfig, *, adapter_slots: AdapterSlots | None = None):
        self.config = config
        self.last_step_idle = False  # set by each step: nothing was scheduled and no request changed
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.lora_dtype = resolve_lora_dtype(config.lora_dtype, self.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        torch.manual_seed(config.seed)
        self.model_dir, self.arch = check_model(config.model)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.model = load_model(self.model_dir, self.arch, self.dtype, self.device)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            prepare_cpu_kernels(lora=config.max_loras > 0)
        self.limits = self._derive_limits()
        if adapter_slots is None and config.max_loras > 0:
            from loraplex.engine.lora_manager import LoraManager

            adapter_slots = LoraManager.for_engine(
                self.model, self.model_dir, config, device=self.device,
                dtype=self.lora_dtype,
            )
        self.adapter_slots = adapter_slots
        self.block_manager = BlockManager(
            self.limits.num_kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.limits.max_model_len,
            adapter_slots=adapter_slots,
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks=self.limits.num_kv_blocks,
            block_size=config.block_size,
            device=self.device,
            dtype=self.dtype,
            sampler=Sampler(self.limits.eos_token_ids),
            adapter_slots=adapter_slots,
        )
        self.requests: dict[str, RequestState] = {}
        self._step_threads: int | None = None  # the step thread's OpenMP threads, read at its first step
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @contextmanager
    def _cpu_threads_beside_loads(self, batch) -> Iterator[None]:
        """On the CPU, share the cores with background adapter loads for the duration of a step.

        The loader thread parses and copies tens of megabytes per adapter. Beside a step that uses every
        core it takes a core from one of the step's OpenMP threads, and every parallel region then waits
        at its barrier for the thread that lost its core: on 2 cores a prefill step with loads running
        took 6.5 s instead of 1.9 s. So while loads are under way:
        - a small step (decodes) runs on one thread fewer, leaving the loader a core;
        - a large step (at least PAUSE_LOADS_MIN_TOKENS tokens: prefills) pauses the loads instead, after
          the adapter being loaded is done (20-30 ms), and runs on every thread: a core lent to the loader
          for a whole long step would sit idle once its loads finished, while the step ran on half the
          machine (the 100-adapter benchmark's prefill steps: 2.7-3.1 s on one thread).
        Thread counts are per thread in OpenMP, so they are read and set on the step thread itself."""
        slots = self.adapter_slots
        if self.device.type != "cpu" or slots is None:
            yield
            return
        if self._step_threads is None:
            self._step_threads = torch.get_num_threads()
        want = self._step_threads
        pause = False
        if want > 1 and slots.loading:
            if sum(batch.num_new_tokens) >= PAUSE_LOADS_MIN_TOKENS:
                pause = True
            else:
                want -= 1
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        if pause:
            with slots.loads_paused():
                yield
        else:
            yield

    def _derive_limits(self) -> EngineLimits:
        num_blocks, max_len = derive_limits(self.config, self.arch, self.dtype)
        return EngineLimits(num_blocks, max_len, self.tokenizer.eos_token_ids)

    @property
    def model_name(self) -> str:
        return self.config.model

    # -- requests ---------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Seq[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, (list, tuple)):
                    raise InvalidRequestError("'prompt_token_ids' must be a list of token ids", param="prompt")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, max_model_len=self.limits.max_model_len)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = self.arch.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        else:
            raise InvalidRequestError("prompt must be a string, a list of token ids or a dict", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int] | dict[str, Any],
        params: SamplingParams,
        *,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported", param="prompt_logprobs")
        text, ids = self.encode_prompt(prompt)
        params = fit_max_tokens(self.scheduler, len(ids), params)
        if lora is not None and self.adapter_slots is None:
            raise InvalidRequestError("this engine was started without adapter support", param="adapter")
        check_lora_request(lora)
        seqs = [Sequence(request_id, ids, params, index=i, lora=lora, tenant=tenant) for i in range(params.n)]
        seqs[0].pending_forks = seqs[1:]
        self.requests[request_id] = RequestState(
            request_id, text, ids, params, seqs, self.tokenizer,
            eos_token_ids=self.limits.eos_token_ids, max_model_len=self.limits.max_model_len,
        )
        self.scheduler.add(seqs[0])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free the request's blocks now. Returns its final output, or None if it is unknown/finished."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort([s for s in state.seqs if not s.is_finished])
        return state.make_output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _fail_request(self, state: RequestState, error: str, kind: str = "engine") -> None:
        """End every sequence of the request with an error; its output carries it to the caller."""
        if state.error is None:
            state.error, state.error_kind = error, kind
        self.scheduler.abort([s for s in state.seqs if not s.is_finished])
        for s in state.seqs:
            s.finish_reason = "error"

    # -- the loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        touched: dict[str, RequestState] = {}
        for seq, exc in batch.failed:
            state = self.requests.get(seq.request_id)
            if state is not None:
                self._fail_request(state, str(exc), _failure_kind(exc))
                touched[seq.request_id] = state
        if not batch.empty:
            with self._cpu_threads_beside_loads(batch):
                sample_seqs, out = self.runner.run(batch)
            sampled = {} if out is None else {s.seq_id: t for s, t in zip(sample_seqs, out.token_ids, strict=True)}
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                self.prompt_tokens_total += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
            self.scheduler.postprocess(batch, sampled)
            nonfinite = set(out.nonfinite_rows) if out is not None else set()
            for row, seq in enumerate(sample_seqs):
                state = self.requests.get(seq.request_id)
                if state is None or seq.is_finished:
                    continue
                if row in nonfinite:
                    # NaN or inf logits (an adapter whose weights make the model overflow, say): the request
                    # fails with an error rather than answering tokens drawn from noise
                    self._fail_request(state, "the model's output for this request was not finite (NaN or "
                                              "inf); with an adapter, its weights make the model overflow")
                    touched[seq.request_id] = state
                    continue
                self.generation_tokens_total += 1
                comp = state.completions[seq.index]
                finish = state.on_token(comp, seq.token_ids[-1], out.logprobs[row])
                if finish is not None:
                    self.scheduler.finish(seq, *finish)
                touched[seq.request_id] = state
        elif not touched and self.adapter_slots is not None and self.adapter_slots.loading:
            # Every request that could run waits for an adapter: let the loader have the interpreter.
            self.adapter_slots.wait_for_load(IDLE_LOAD_WAIT_S)
        self.last_step_idle = batch.empty and not touched
        outputs = []
        for request_id, state in touched.items():
            outputs.append(state.make_output())
            if state.finished:
                self.requests.pop(request_id, None)
        return outputs


def _failure_kind(exc: BaseException) -> str:
    """What a request's failure was, for the caller: its adapter's weights gone (deleted after the request was
    accepted), its adapter unloadable, or anything else."""
    if isinstance(exc, AdapterMissingError):
        return "adapter_missing"
    return "adapter_load" if isinstance(exc, AdapterLoadError) else "engine"
