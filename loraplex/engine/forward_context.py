"""Per-step state the model's layers read: attention metadata and the step's LoRA state.

The runner sets it once per step; layers read it instead of taking extra `forward` arguments, so the
model code stays the shape of a plain decoder.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class PrefillSegment:
    """One sequence's chunk of new tokens that attends to its cached prefix plus itself."""

    query_start: int  # index of the chunk's first token in the step's flat token batch
    query_len: int
    context_len: int  # tokens in the KV cache after this step, prefix included
    block_table: torch.Tensor  # int64 [num_blocks_for_context]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V is written
    num_decode_tokens: int  # the first `num_decode_tokens` tokens are single-token decodes
    decode_block_tables: torch.Tensor | None = None  # int64 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # int64 [num_decodes]
    decode_max_context_len: int = 0
    decode_mask: torch.Tensor | None = None  # bool [1, num_decodes, 1, max_blocks * block_size]
    # for the layers with a sliding window, by window: the decodes' block tables and context lengths cut to the
    # window (`window_tables`) and their mask, made by the first such layer and shared by the others
    decode_windows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    prefills: list[PrefillSegment] = field(default_factory=list)
    # every token as a row of its own (block table, context length through that token), built by the first
    # layer that runs short prefills on the CPU kernel and shared by the rest (see PagedAttention)
    token_tables: tuple[torch.Tensor, torch.Tensor] | None = None


class LoraStepState(Protocol):
    """What a LoRA-aware projection calls after its base matmul when the step has adapters.

    `module_names` are the PEFT names fused into the projection ("q_proj", "k_proj", "v_proj") and
    `output_slices` their widths in the output, in the same order. Returns the output with each token's
    adapter delta added (in place where possible).
    """

    def apply(
        self,
        layer_idx: int,
        module_names: tuple[str, ...],
        x: torch.Tensor,
        y: torch.Tensor,
        output_slices: tuple[int, ...],
    ) -> torch.Tensor: ...

    def apply_embedding(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The embedded tokens x [num_tokens, hidden] with each token's adapter's embedding delta added."""
        ...

    def apply_logits(self, rows: list[int], hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the step's tokens `rows` (hidden: their final hidden states) with each row's
        adapter's LM-head delta added."""
        ...


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: LoraStepState | None = None  # None when no token in the step uses an adapter
    # the tokens whose logits the step computes (the LM head runs for these rows only), in logits order
    sample_rows: list[int] | None = None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("the model was called outside a forward context")
    return _current


def current_lora() -> LoraStepState | None:
    return None if _current is None else _current.lora


@contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    previous = _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = previous
