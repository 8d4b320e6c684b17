"""A sequence owns its request state; the block manager writes its block table, the runner only reads."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
        arrival_time: float | None = None,
    ):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.params = params
        self.lora = lora
        self.tenant = tenant or ""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the last admission
        # the most prompt tokens a step has run through (prefix-cache hits included); a preemption does not
        # lower it: what a request dropped mid-prefill is billed (see AsyncEngine.abort)
        self.num_prompt_tokens_processed = 0
        self.num_full_blocks_hashed = 0  # leading blocks of block_table registered in the prefix cache
        self.block_hashes: list[bytes] = []  # chained hashes of the leading full blocks
        self.cache_salt: bytes | None = None  # prefix-cache salt: adapter content hash and tenant
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list = []  # TokenLogprobs per output token when requested
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # Each completion of a seeded request has its own stream, reproducible alone or in a batch.
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.pending_forks: list[Sequence] = []  # n > 1: siblings that take over the prompt's blocks
        self.num_preemptions = 0
        self.holds_adapter_slot = False  # referenced a device slot of its adapter while running
        # requests for adapters admitted ahead of it while it waited for a slot (the scheduler bounds it)
        self.num_overtaken = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def adapter_key(self) -> str | None:
        return None if self.lora is None else self.lora.key

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )
