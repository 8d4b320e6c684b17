"""Projections with oneDNN-packed weights agree with F.linear; what cannot be packed keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.models.layers import LoraLinear
from loraplex.kernels.linear_cpu import pack_weight, packed_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 13)])
def test_packed_matches_linear(rows, shape):
    gen = torch.Generator().manual_seed(rows * 31 + shape[0])
    w = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    packed = pack_weight(w)
    assert packed is not None
    for b in (None, bias):
        got = packed_linear(x, packed, b)
        want = F.linear(x, w, b)
        assert got.shape == want.shape == (rows, shape[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_not_packed_when_it_does_not_apply():
    assert pack_weight(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    assert pack_weight(torch.randn(8)) is None


@needs_onednn
def test_lora_linear_packed_forward_and_reload_refused():
    torch.manual_seed(0)
    layer = LoraLinear(24, (16, 8), bias=True, layer_idx=0, module_names=("q_proj", "k_proj"), dtype=torch.float32)
    layer.load_shard(0, "weight", torch.randn(16, 24))
    layer.load_shard(1, "weight", torch.randn(8, 24))
    layer.load_shard(0, "bias", torch.randn(16))
    layer.load_shard(1, "bias", torch.zeros(8))
    x = torch.randn(5, 24)
    want = F.linear(x, layer.weight, layer.bias)
    assert layer.pack_for_cpu()
    assert layer.weight.numel() == 0  # one copy of the weights stays in memory: the packed one
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed"):
        layer.load_shard(0, "weight", torch.randn(16, 24))


def test_bf16_projection_is_not_packed():
    layer = LoraLinear(8, (4,), bias=False, layer_idx=0, module_names=("o_proj",), dtype=torch.bfloat16)
    layer.weight.data.normal_()
    assert not layer.pack_for_cpu()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
