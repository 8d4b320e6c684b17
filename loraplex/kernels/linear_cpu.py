"""Projections on the CPU with weights pre-packed for oneDNN.

A decode step streams every projection weight once for a few dozen rows; it is bound by memory bandwidth.
oneDNN's inner-product primitive reading a weight reordered once into its blocked layout streams it
faster than `F.linear` on the plain row-major weight (bench/bench_decode_floor.py). The packed copy
replaces the plain one for the forward pass; results agree with `F.linear` to fp32 rounding.

Only fp32 CPU weights are packed, and only when this torch build has the oneDNN ops; everything else
keeps `F.linear`.
"""

from __future__ import annotations

import torch

# oneDNN picks its blocking for this many rows; a decode batch is a few dozen, and larger prefill chunks
# run the same packed weight correctly (somewhat below their own best blocking).
BATCH_HINT = 32


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] reordered for oneDNN, or None when it cannot be (the caller keeps F.linear)."""
    if not can_pack(weight):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # a build without these ops, or a shape oneDNN refuses
        return None
    want = torch.nn.functional.linear(probe, weight)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max().clamp_min(1.0))):
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ W^T + bias with the packed weight (zero rows give an empty result)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
