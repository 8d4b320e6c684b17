"""Projections with packed weights (loraplex's AVX-512 or AVX2 panels, or oneDNN's layout) agree with
F.linear; what cannot be packed keeps F.linear."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.models.layers import LoraLinear
from loraplex.kernels import linear_cpu
from loraplex.kernels.linear_cpu import pack_weight, packed_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
needs_panels = pytest.mark.skipif(linear_cpu._kernel() is None, reason="no AVX-512 or AVX2 GEMM on this machine")


def _assert_fp32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within a few fp32 roundings of the float64 product (another summation order than F.linear's)."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = (x.double().abs() @ w.double().abs().t()) + (0 if b is None else b.double().abs())
    err = (got.double() - want).abs()
    assert bool((err <= 4 * x.shape[-1] ** 0.5 * 2.0**-24 * scale + 1e-30).all()), float((err / scale).max())


@needs_panels
@pytest.mark.parametrize("shape", [(960, 576), (49, 13), (32, 1), (1, 300), (65, 33)])
def test_panels_match_float64_product(shape):
    """Every row count the kernel cuts differently: register-block tails, the decode order's limit (64),
    prefill row chunks and K blocks (576 x 1529 spans several of each)."""
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    packed = pack_weight(w)
    assert packed is not None and packed.kind == "panels"
    width = linear_cpu._kernel().panel_width()  # 32 with AVX-512, 16 with AVX2
    assert width in (16, 32)
    assert packed.data.shape == ((shape[0] + width - 1) // width, shape[1], width)
    for rows in (0, 1, 3, 8, 9, 32, 63, 64, 65, 200, 1529):
        x = torch.randn(rows, shape[1], generator=gen)
        for b in (None, bias):
            _assert_fp32_close(packed_linear(x, packed, b), x, w, b)


@needs_panels
def test_panels_take_any_leading_shape_and_strides():
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    packed = pack_weight(w)
    x3 = torch.randn(2, 5, 24, generator=gen)
    _assert_fp32_close(packed_linear(x3, packed, bias), x3, w, bias)
    xt = torch.randn(24, 7, generator=gen).t()  # not contiguous
    _assert_fp32_close(packed_linear(xt, packed, bias), xt, w, bias)
    with pytest.raises(RuntimeError, match="features"):
        packed_linear(torch.randn(3, 23), packed, None)


@needs_onednn
def test_onednn_form_when_asked(monkeypatch):
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn")
    w = torch.randn(48, 20)
    packed = pack_weight(w)
    assert packed is not None and packed.kind == "onednn"
    x = torch.randn(5, 20)
    torch.testing.assert_close(packed_linear(x, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 13)])
@pytest.mark.parametrize("form", ["default", "onednn"])
def test_packed_matches_linear(rows, shape, form, monkeypatch):
    if form == "onednn":
        monkeypatch.setenv("LORAPLEX_CPU_GEMM", "onednn")
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
        _assert_fp32_close(got, x, w, b)


@needs_panels
@pytest.mark.parametrize("path", ["panels", "blas"])
@pytest.mark.parametrize("shape", [(960, 576), (49, 13)])
def test_large_batches_on_either_path(path, shape, monkeypatch):
    """From BLAS_MIN_ROWS rows a call runs the panels or copies them out for the BLAS GEMM, whichever the
    process chose; both give the product, with and without bias, for any leading shape, and the copied
    weight's buffer is reused across calls of different sizes."""
    monkeypatch.setattr(linear_cpu, "_large_path", path)
    monkeypatch.setattr(linear_cpu, "_scratch", threading.local())
    gen = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    packed = pack_weight(w)
    small_w = torch.randn(7, shape[1], generator=gen)
    small = pack_weight(small_w)
    for rows in (linear_cpu.BLAS_MIN_ROWS, 2 * linear_cpu.BLAS_MIN_ROWS + 3):
        x = torch.randn(rows, shape[1], generator=gen)
        for b in (None, bias):
            _assert_fp32_close(packed_linear(x, packed, b), x, w, b)
        _assert_fp32_close(packed_linear(x, small, None), x, small_w, None)
        if path == "blas":  # the smaller weight reused the larger one's buffer
            assert linear_cpu._scratch.buf.numel() == shape[1] * packed.data.shape[0] * packed.data.shape[2]
        got = packed_linear(x.view(1, rows, shape[1]).expand(2, rows, shape[1]), packed, bias)
        assert got.shape == (2, rows, shape[0])
        _assert_fp32_close(got[1], x, w, bias)


@needs_panels
def test_large_batch_path_measured_once_or_forced(monkeypatch):
    monkeypatch.setattr(linear_cpu, "_large_path", None)
    monkeypatch.setenv("LORAPLEX_CPU_PREFILL_GEMM", "blas")
    assert linear_cpu.large_batch_path() == "blas"
    monkeypatch.setattr(linear_cpu, "_large_path", None)
    monkeypatch.delenv("LORAPLEX_CPU_PREFILL_GEMM")
    chosen = linear_cpu.large_batch_path()
    assert chosen in ("panels", "blas")
    monkeypatch.setenv("LORAPLEX_CPU_PREFILL_GEMM", "panels" if chosen == "blas" else "blas")
    assert linear_cpu.large_batch_path() == chosen  # decided once per process


@pytest.mark.slow
def test_gemm_built_for_avx2_and_without_simd():
    """The 8-wide build (6-row register blocks, 16-column panels) is checked here whatever this machine has;
    a build with neither AVX-512 nor AVX2 has no kernel and leaves the projections to oneDNN."""
    import platform

    from loraplex.kernels.cpp_build import InlineExtension

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    functions = ["has_kernel", "panel_width", "pack", "linear", "unpack_t"]
    avx2 = InlineExtension(f"{linear_cpu.EXTENSION_NAME}_avx2", linear_cpu._SOURCE, functions,
                           what="CPU GEMM kernel (AVX2)", extra_cflags=["-mno-avx512f"]).load()
    plain = InlineExtension(f"{linear_cpu.EXTENSION_NAME}_plain", linear_cpu._SOURCE, functions,
                            what="CPU GEMM kernel (no SIMD)", extra_cflags=["-mno-avx512f", "-mno-avx2"]).load()
    if avx2 is None or plain is None:
        pytest.skip("no C++ compiler")
    assert not plain.has_kernel()
    with pytest.raises(RuntimeError, match="built without"):
        plain.linear(torch.randn(2, 8), plain.pack(torch.randn(4, 8)), 4, None, 0)
    if not avx2.has_kernel():
        pytest.skip("this compiler's native target has no AVX2/FMA")
    assert avx2.panel_width() == 16
    gen = torch.Generator().manual_seed(11)
    for shape in ((960, 576), (49, 13), (24, 1536), (1, 300)):
        w, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
        data = avx2.pack(w)
        assert data.shape == ((shape[0] + 15) // 16, shape[1], 16)
        for rows in (1, 5, 6, 7, 13, 32, 64, 65, 700):
            x = torch.randn(rows, shape[1], generator=gen)
            for b in (None, bias):
                _assert_fp32_close(avx2.linear(x, data, shape[0], b, linear_cpu.MIN_PARALLEL_COST), x, w, b)
        wt = torch.empty(shape[1], data.shape[0] * 16)
        avx2.unpack_t(data, wt)
        assert torch.equal(wt[:, : shape[0]], w.t())


def test_not_packed_when_it_does_not_apply():
    assert pack_weight(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    assert pack_weight(torch.randn(8)) is None
    assert pack_weight(torch.randn(0, 4)) is None


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
