"""The LoRA side of the model's projections: per-projection slot weights and the per-step state.

`LoraProjection` describes one `LoraLinear` of the model (its layer, the PEFT modules fused into it and
their output widths). `LoraStep` is what the forward context carries for a step with adapters: the
token grouping, built once, and the slot weights of every projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """Every projection of the model that PEFT may target."""
    from loraplex.engine.models.layers import LoraLinear

    return [
        LoraProjection(m.layer_idx, m.module_names, m.in_features, m.output_sizes)
        for m in model.modules()
        if isinstance(m, LoraLinear)
    ]


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
