"""The LoRA side of the model's projections: per-projection slot weights and the per-step state.

`LoraProjection` describes one `LoraLinear` of the model (its layer, the PEFT modules fused into it and
their output widths), or the LM head or input embedding (layer TOP_LEVEL). `LoraStep` is what the forward context carries for a step with adapters: the
token grouping, built once, and the slot weights of every projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.adapters.spec import TOP_LEVEL
from loraplex.kernels.lora import LoraBatch, LoraSlotWeights, add_lora
from loraplex.kernels.lora_cpu import cpu_lora_step


@dataclass(frozen=True)
class LoraProjection:
    layer_idx: int
    module_names: tuple[str, ...]  # PEFT names fused into the projection, e.g. ("q_proj", "k_proj", "v_proj")
    in_features: int
    output_sizes: tuple[int, ...]

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer_idx, self.module_names[0])


def model_projections(model: torch.nn.Module) -> list[LoraProjection]:
    """Every projection of the model that PEFT may target: the decoder layers' LoRA-aware linears, then the
    LM head and the input embedding where the model offers LoRA on them (`lora_top_projections`)."""
    from loraplex.engine.models.layers import LoraLinear

    layers = [
        LoraProjection(m.layer_idx, m.module_names, m.in_features, m.output_sizes)
        for m in model.modules()
        if isinstance(m, LoraLinear)
    ]
    top = getattr(model, "lora_top_projections", None)
    return layers + (list(top()) if top is not None else [])


def top_projections(vocab_size: int, hidden_size: int) -> list[LoraProjection]:
    """LoRA on the LM head (hidden -> vocab) and on the input embedding, whose input is the token's one-hot
    row (vocab -> hidden): A [r, vocab] is PEFT's lora_embedding_A."""
    return [LoraProjection(TOP_LEVEL, ("embed_tokens",), vocab_size, (hidden_size,)),
            LoraProjection(TOP_LEVEL, ("lm_head",), hidden_size, (vocab_size,))]


EMBEDDING_KEY = (TOP_LEVEL, "embed_tokens")
HEAD_KEY = (TOP_LEVEL, "lm_head")


class LoraStep:
    """The forward context's LoRA state for one step (implements `LoraStepState`)."""

    __slots__ = ("batch", "weights", "_cpu")

    def __init__(self, batch: LoraBatch, weights: dict[tuple[int, str], LoraSlotWeights], width: int | None = None):
        """width: the most A rows of any of `weights`, where the caller knows it."""
        self.batch = batch
        self.weights = weights
        self._cpu = cpu_lora_step(batch, weights, width)

    def apply(
        self,
        layer_idx: int,
        module_names: tuple[str, ...],
        x: torch.Tensor,
        y: torch.Tensor,
        output_slices: tuple[int, ...],
    ) -> torch.Tensor:
        w = self.weights[(layer_idx, module_names[0])]
        # rows as they come (the engine's are 2-D already: a view per call is 120 torch calls a step)
        y2 = y if y.dim() == 2 else y.view(-1, y.shape[-1])
        x2 = x if x.dim() == 2 else x.view(-1, x.shape[-1])
        if self._cpu is not None and self._cpu(y2, x2, w):
            return y
        add_lora(y2, x2, w, self.batch)
        return y

    def apply_embedding(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x[t] += A[:, token t] @ B^T of token t's adapter, for the adapters with LoRA on embed_tokens: a
        column gather of A (the one-hot shrink) and one small matmul per adapter group, in torch."""
        w = self.weights.get(EMBEDDING_KEY)
        if w is None:
            return x
        b = self.batch
        for slot, start, count in zip(b.slot_ids, b.starts, b.counts, strict=True):
            r = w.ranks[slot][0]
            if r == 0:
                continue
            rows = b.sorted_token_ids[start : start + count]
            # in the activations' dtype, as the projections' kernels sum (slots may hold fp16/bf16 weights)
            shrunk = w.slot_a(slot)[:r].index_select(1, input_ids.index_select(0, rows)).t().to(x.dtype)
            x.index_add_(0, rows, shrunk @ w.slot_b(slot)[:r].to(x.dtype))
        return x

    def apply_logits(self, rows: list[int], hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """logits[i] += the LM-head delta of row rows[i]'s adapter, through the projections' kernels with a
        grouping of the sampled rows (only they reach the head)."""
        w = self.weights.get(HEAD_KEY)
        if w is None:
            return logits
        slots = self.batch.token_slots
        head_slots = [slots[r] if slots[r] >= 0 and w.ranks[slots[r]][0] else -1 for r in rows]
        if all(s < 0 for s in head_slots):
            return logits
        add_lora(logits, hidden, w, LoraBatch.build(head_slots, device=self.batch.slot_ids_t.device))
        return logits
