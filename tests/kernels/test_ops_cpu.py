"""The fused CPU kernels (ops_cpu) against their torch paths, and the fallback to those paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.models.layers import RMSNorm, apply_rotary_, apply_rotary_torch_
from loraplex.kernels import attention, ops_cpu
from loraplex.kernels.attention import decode_attention, decode_attention_torch

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def _compiled():
    if not ops_cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")


def _decode_problem(gen, *, lengths, num_kv_heads, group, head_dim, block_size=16, num_blocks=None, spare=2):
    """Caches full of random values (padding must never leak into a result), each sequence's blocks drawn
    from a shuffled pool, and table rows padded past a sequence's blocks with random (valid) block ids."""
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    width = max(blocks_per_seq, default=0) + spare
    num_blocks = num_blocks or max(sum(blocks_per_seq) + 4, width + 1)
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    rows = []
    for nb in blocks_per_seq:
        own = [pool.pop() for _ in range(nb)]
        pad = torch.randint(0, num_blocks, (width - nb,), generator=gen).tolist()
        rows.append(own + pad)
    tables = torch.tensor(rows, dtype=torch.int64).reshape(len(lengths), width)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_matches_torch(group, head_dim):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    lengths = [1, 16, 17, 300, 5, 33, 48, 2]  # one token, block boundaries, long, very different lengths
    q, k_cache, v_cache, tables, lens = _decode_problem(
        gen, lengths=lengths, num_kv_heads=2, group=group, head_dim=head_dim
    )
    scale = head_dim**-0.5
    expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, scale)
    got = ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert got is not None
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(decode_attention(q, k_cache, v_cache, tables, lens, scale), expected, **TOL)


@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize(
    "group,head_dim,block_size",
    [(2, 20, 16), (1, 40, 8), (5, 72, 5), (9, 8, 16), (7, 64, 32)],  # odd widths, block sizes, large groups
)
def test_decode_attention_other_shapes(group, head_dim, block_size):
    gen = torch.Generator().manual_seed(group + head_dim + block_size)
    lengths = [1, block_size, block_size + 1, 70, 3]
    q, k_cache, v_cache, tables, lens = _decode_problem(
        gen, lengths=lengths, num_kv_heads=3, group=group, head_dim=head_dim, block_size=block_size
    )
    expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, 0.2)
    got = ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize(
    "group,head_dim,block_size,window",
    [(1, 64, 16, 16), (3, 64, 16, 5), (4, 20, 8, 17), (5, 72, 5, 1), (2, 128, 16, 250)],
)
def test_windowed_decode_attention_matches_torch(group, head_dim, block_size, window):
    gen = torch.Generator().manual_seed(group + head_dim + block_size + window)
    lengths = [1, block_size, block_size + 1, window, window + 1, 70, 300, 3]
    q, k_cache, v_cache, tables, lens = _decode_problem(
        gen, lengths=lengths, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size
    )
    expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, 0.2, window=window)
    got = ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window)
    torch.testing.assert_close(got, expected, **TOL)
    # blocks wholly before a row's window are never read: their table entries may be anything
    first = [max(0, n - window) // block_size for n in lengths]
    for row, j0 in enumerate(first):
        tables[row, :j0] = -1
    torch.testing.assert_close(ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window),
                               expected, **TOL)
    if any(first):  # ... but without the window they are read
        with pytest.raises(RuntimeError, match="out of range"):
            ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)


@pytest.mark.usefixtures("_compiled")
def test_decode_attention_rejects_a_negative_window():
    q, k_cache, v_cache, tables, lens = _decode_problem(
        torch.Generator().manual_seed(0), lengths=[4], num_kv_heads=1, group=1, head_dim=8
    )
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops_cpu._load().paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, 0, -1)


@pytest.mark.usefixtures("_compiled")
def test_decode_attention_benchmark_shape_and_strided_query():
    """The SmolLM2 decode batch: 32 sequences, 9 query / 3 KV heads; q is a view into a fused qkv row."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(40, 111, (32,), generator=gen).tolist()
    q, k_cache, v_cache, tables, lens = _decode_problem(
        gen, lengths=lengths, num_kv_heads=3, group=3, head_dim=64, num_blocks=400
    )
    qkv = torch.randn(32, 15 * 64, generator=gen)
    qkv[:, : 9 * 64] = q.reshape(32, -1)
    q_view = qkv[:, : 9 * 64].view(32, 9, 64)
    assert not q_view.is_contiguous()
    expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(ops_cpu.paged_decode_attention(q_view, k_cache, v_cache, tables, lens, 0.125),
                               expected, **TOL)


@pytest.mark.usefixtures("_compiled")
def test_decode_attention_large_scores_stay_stable():
    """Scores in the thousands: the softmax must subtract the maximum (no overflow, no NaN)."""
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, lens = _decode_problem(gen, lengths=[40, 7], num_kv_heads=1, group=2, head_dim=64)
    q = q * 50
    expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, 1.0)
    got = ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.usefixtures("_compiled")
def test_decode_attention_empty_batch():
    k_cache = torch.randn(3, 8, 16, 64)
    q = torch.empty(0, 9, 64)
    tables = torch.empty(0, 4, dtype=torch.int64)
    lens = torch.empty(0, dtype=torch.int64)
    got = ops_cpu.paged_decode_attention(q, k_cache, k_cache.clone(), tables, lens, 0.125)
    assert got.shape == (0, 9, 64)


@pytest.mark.usefixtures("_compiled")
def test_decode_attention_rejects_bad_tables():
    k_cache = torch.randn(1, 4, 16, 8)
    q = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops_cpu.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[4]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops_cpu.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[0]]), torch.tensor([17]), 1.0)


@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize("num_tokens", [0, 1, 32, 200])
@pytest.mark.parametrize("hidden", [576, 37])
def test_add_rms_norm_matches_torch(num_tokens, hidden):
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen) * 3
    residual = torch.randn(num_tokens, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    summed = x + residual
    expected = F.rms_norm(summed, (hidden,), weight, 1e-5)
    assert ops_cpu.fused_add_rms_norm_(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, summed, rtol=0, atol=0)
    torch.testing.assert_close(x, expected, **TOL)


@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize("num_tokens", [0, 1, 32, 200])
def test_rms_norm_matches_torch(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    before = x.clone()
    got = ops_cpu.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(before, (576,), weight, 1e-6), **TOL)
    assert torch.equal(x, before)


@pytest.mark.usefixtures("_compiled")
def test_rmsnorm_module_with_and_without_residual():
    gen = torch.Generator().manual_seed(11)
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.data.copy_(torch.randn(64, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    residual = torch.randn(5, 64, generator=gen)
    expected = F.rms_norm(x + residual, (64,), norm.weight, 1e-6)
    expected_residual = x + residual
    torch.testing.assert_close(norm(x.clone()), F.rms_norm(x, (64,), norm.weight, 1e-6), **TOL)
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)


@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize("num_tokens", [0, 1, 32, 100])
@pytest.mark.parametrize("intermediate", [1536, 13])
def test_silu_and_mul_matches_torch(num_tokens, intermediate):
    gen = torch.Generator().manual_seed(num_tokens + intermediate)
    gate_up = torch.randn(num_tokens, 2 * intermediate, generator=gen) * 4
    gate_up[:1, :3] = torch.tensor([-100.0, 100.0, 0.0])[: gate_up[:1, :3].shape[1]]  # saturating inputs
    gate, up = gate_up.split(intermediate, dim=-1)
    expected = F.silu(gate) * up
    got = ops_cpu.silu_and_mul(gate_up)
    assert got.shape == (num_tokens, intermediate) and got.is_contiguous()
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.usefixtures("_compiled")
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64])
def test_rotary_matches_torch_in_fused_qkv(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(num_tokens, 1, dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    expected = qkv.clone()
    apply_rotary_torch_(expected[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim), cos, sin)
    assert ops_cpu.rotary_(qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim), cos, sin)
    torch.testing.assert_close(qkv, expected, **TOL)


def test_bf16_takes_the_torch_path():
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, lens = _decode_problem(gen, lengths=[3, 20], num_kv_heads=1, group=3, head_dim=16)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    assert ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25) is None
    got = decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, decode_attention_torch(q, k_cache, v_cache, tables, lens, 0.25), rtol=0, atol=0)

    x = torch.randn(4, 32, dtype=torch.bfloat16)
    residual = torch.randn(4, 32, dtype=torch.bfloat16)
    weight = torch.ones(32, dtype=torch.bfloat16)
    assert not ops_cpu.fused_add_rms_norm_(x, residual, weight, 1e-6)
    assert ops_cpu.rms_norm(x, weight, 1e-6) is None
    assert ops_cpu.silu_and_mul(torch.randn(4, 8, dtype=torch.bfloat16)) is None
    assert not ops_cpu.rotary_(x.view(4, 2, 16), torch.ones(4, 1, 8), torch.zeros(4, 1, 8))


def test_unavailable_extension_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(ops_cpu, "_load", lambda: None)
    calls = []
    torch_path = attention.decode_attention_torch

    def counting(*args, **kwargs):
        calls.append(1)
        return torch_path(*args, **kwargs)

    monkeypatch.setattr(attention, "decode_attention_torch", counting)
    gen = torch.Generator().manual_seed(9)
    lengths = [1, 17, 40]
    q, k_cache, v_cache, tables, lens = _decode_problem(gen, lengths=lengths, num_kv_heads=2, group=3, head_dim=32)
    got = decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    assert calls == [1]
    for i, n in enumerate(lengths):  # against dense attention over the sequence's own K/V
        pos = torch.arange(n)
        slots = tables[i][pos // 16] * 16 + pos % 16
        k = k_cache.view(2, -1, 32)[:, slots].transpose(0, 1)
        v = v_cache.view(2, -1, 32)[:, slots].transpose(0, 1)
        qi = torch.cat([torch.zeros(n - 1, 6, 32), q[i : i + 1]])
        ref = attention.reference_attention(qi, k, v, 0.2)[-1]
        torch.testing.assert_close(got[i], ref, **TOL)

    norm = RMSNorm(16, 1e-6, torch.float32)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x_before + residual_before, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(x_before + residual_before, (16,), norm.weight, 1e-6), **TOL)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # the torch path is not in place
    assert ops_cpu.silu_and_mul(torch.randn(2, 8)) is None

    rot = torch.randn(2, 3, 8)
    expected = rot.clone()
    angles = torch.rand(2, 1, 4)
    apply_rotary_torch_(expected, angles.cos(), angles.sin())
    apply_rotary_(rot, angles.cos(), angles.sin())
    torch.testing.assert_close(rot, expected, rtol=0, atol=0)


@pytest.mark.usefixtures("_compiled")
def test_write_kv_matches_index_copy():
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.randn(3, 10, 4, 8, generator=gen)
    v_cache = torch.randn(3, 10, 4, 8, generator=gen)
    qkv = torch.randn(5, 3 * 8 + 2 * 3 * 8, generator=gen)  # k and v as strided views of a fused output
    k = qkv[:, 24:48].view(5, 3, 8)
    v = qkv[:, 48:].view(5, 3, 8)
    slots = torch.tensor([0, 7, 39, 12, 13])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(3, -1, 8).index_copy_(1, slots, k.transpose(0, 1))
    want_v.view(3, -1, 8).index_copy_(1, slots, v.transpose(0, 1))
    assert ops_cpu.write_kv_(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        ops_cpu.write_kv_(k_cache, v_cache, k, v, torch.tensor([0, 1, 2, 3, 40]))
    assert torch.equal(k_cache, before)  # checked before anything is written
    assert not ops_cpu.write_kv_(k_cache.bfloat16(), v_cache.bfloat16(), k.bfloat16(), v.bfloat16(), slots)


@pytest.mark.slow
def test_ops_built_without_avx512(monkeypatch):
    """The fused ops as built for machines without AVX-512 (8-wide vectors only), checked against the torch
    paths whatever this machine has: on an AVX-512 machine the tests above exercise the 16-wide paths, and
    this one the others."""
    import platform

    from loraplex.kernels.cpp_build import InlineExtension

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    ext = InlineExtension(f"{ops_cpu.EXTENSION_NAME}_noavx512", ops_cpu._SOURCE, ops_cpu._FUNCTIONS,
                          what="CPU fused ops (no AVX-512)", extra_cflags=["-fno-trapping-math", "-mno-avx512f"])
    if ext.load() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(ops_cpu, "_EXTENSION", ext)
    gen = torch.Generator().manual_seed(29)
    for group, head_dim, block_size in [(1, 64, 16), (2, 64, 16), (3, 64, 16), (4, 128, 16), (5, 72, 5),
                                        (3, 20, 8), (9, 8, 16)]:
        lengths = [1, block_size, block_size + 1, 70, 300, 3]
        q, k_cache, v_cache, tables, lens = _decode_problem(
            gen, lengths=lengths, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size
        )
        expected = decode_attention_torch(q, k_cache, v_cache, tables, lens, 0.2)
        torch.testing.assert_close(ops_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2),
                                   expected, **TOL)
    for num_tokens, hidden in [(1, 576), (33, 576), (200, 37)]:
        x, residual = torch.randn(num_tokens, hidden, generator=gen), torch.randn(num_tokens, hidden, generator=gen)
        weight = torch.rand(hidden, generator=gen) + 0.5
        expected_res = residual + x
        want = F.rms_norm(expected_res, (hidden,), weight, 1e-5)
        torch.testing.assert_close(ops_cpu.rms_norm(expected_res, weight, 1e-5), want, **TOL)
        xr, rr = x.clone(), residual.clone()
        assert ops_cpu.fused_add_rms_norm_(xr, rr, weight, 1e-5)
        torch.testing.assert_close(rr, expected_res, **TOL)
        torch.testing.assert_close(xr, want, **TOL)
    for num_tokens, intermediate in [(1, 1536), (32, 1536), (100, 13)]:
        gate_up = torch.randn(num_tokens, 2 * intermediate, generator=gen)
        expected = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        torch.testing.assert_close(ops_cpu.silu_and_mul(gate_up), expected, **TOL)
