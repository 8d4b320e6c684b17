"""Adapters' host copies: one arena each (2 MB pages where Linux gives them), recycled once nothing reads it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loraplex.engine.host_memory import HUGE_PAGE, ArenaRecycler, HostArena, huge_page_buffer
from loraplex.engine.lora_layers import LoraProjection
from loraplex.engine.lora_manager import LoraManager, to_host_adapter
from loraplex.engine.lora_request import LoRARequest

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _thp_available() -> bool:
    """Linux with transparent huge pages not disabled (globally, or for 2 MB pages where sizes are set apart)."""
    if not sys.platform.startswith("linux") or not (THP / "enabled").exists():
        return False
    size = THP / "hugepages-2048kB" / "enabled"
    if size.exists() and "[never]" in size.read_text():
        return False
    return "[never]" not in (THP / "enabled").read_text() or (size.exists() and "[inherit]" not in size.read_text())


def _vma_of(address: int) -> dict[str, str]:
    """The fields of /proc/self/smaps for the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
            continue
        if inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not _thp_available(), reason="transparent huge pages: Linux with them not disabled")
def test_huge_page_buffer_is_aligned_writable_and_eligible_for_huge_pages():
    buf = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buf is not None and buf.numel() == 3 * HUGE_PAGE + 100 and buf.dtype == torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0
    floats = buf[: 3 * HUGE_PAGE].view(torch.float32)
    floats.copy_(torch.arange(floats.numel(), dtype=torch.float32))
    assert float(floats[-1]) == floats.numel() - 1 and int(buf[-1]) == 0
    vma = _vma_of(buf.data_ptr())
    assert vma.get("THPeligible", "1") == "1", vma  # advised: the kernel may back it with 2 MB pages


def test_small_buffers_are_ordinary_memory():
    assert huge_page_buffer(HUGE_PAGE - 1) is None
    arena = HostArena(1000)
    assert not arena.huge and arena.capacity == 1000


def test_arena_carves_aligned_tensors_and_falls_back_when_full():
    arena = HostArena(4096)
    a = arena.take((3, 5), torch.float32)  # 60 bytes, the next one starts 64 bytes on
    b = arena.take((10,), torch.float16)
    assert a.shape == (3, 5) and b.dtype == torch.float16
    assert b.data_ptr() - a.data_ptr() == 64 and a.data_ptr() % 64 == 0
    a.fill_(1.5)
    b.fill_(2.0)
    assert float(a.sum()) == 22.5 and float(b.sum()) == 20.0
    outside = arena.take((2000,), torch.float32)  # 8000 bytes: no room left
    assert outside.shape == (2000,) and not (arena.buffer.data_ptr() <= outside.data_ptr()
                                             < arena.buffer.data_ptr() + arena.capacity)


def test_recycler_reuses_only_idle_arenas_of_a_fitting_size_within_its_budget():
    mb = 2**20
    r = ArenaRecycler(max_bytes=30 * mb)
    busy, small, big, spare = HostArena(10 * mb), HostArena(8 * mb), HostArena(10 * mb), HostArena(10 * mb)
    held = busy.take((10,), torch.float32)  # a slot still reads this one
    for arena in (busy, small, big):
        r.give(arena)
    assert r.waiting_bytes == 28 * mb
    r.give(spare)  # over the budget: the oldest (busy) goes
    assert r.waiting_bytes == 28 * mb
    got = r.take(9 * mb)
    assert got in (big, spare) and (r.reused, r.fresh) == (1, 0)
    assert got.take((4,), torch.float32).data_ptr() == got.buffer.data_ptr()  # reset: carved from the start
    assert r.take(7 * mb) is small  # the smallest that fits
    assert r.take(2 * mb).capacity == 2 * mb  # 10 MB is too much for 2 MB: a new arena, the 10 MB one waits on
    assert r.fresh == 1 and r.waiting_bytes == 10 * mb
    del held

    r2 = ArenaRecycler()
    arena = HostArena(5_000)
    kept = arena.take((100,), torch.float32)
    r2.give(arena)
    assert r2.take(5_000) is not arena  # a tensor of it is alive
    del kept
    assert r2.take(5_000) is arena  # now nothing refers to it


def _projections(hidden=576, inter=1536, layers=2):
    return [LoraProjection(layer, names, in_f, sizes)
            for layer in range(layers)
            for names, in_f, sizes in ((("q_proj", "k_proj", "v_proj"), hidden, (hidden, 192, 192)),
                                       (("o_proj",), hidden, (hidden,)),
                                       (("gate_proj", "up_proj"), hidden, (inter, inter)),
                                       (("down_proj",), inter, (hidden,)))]


def _adapter(seed, rank, projections, skip=("k_proj",)):
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for p in projections:
        for name, out in zip(p.module_names, p.output_sizes, strict=True):
            if name not in skip:
                weights[(p.layer_idx, name)] = (torch.randn(rank, p.in_features, generator=gen),
                                                torch.randn(out, rank, generator=gen))
    return weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_host_copy_is_one_arena_with_the_same_values(dtype):
    projections = _projections()
    weights = _adapter(0, 32, projections)
    lora = LoRARequest(name="a", content_hash="a", path="a")
    r = ArenaRecycler()
    host = to_host_adapter(lora, weights, projections, 64, pin=False, dtype=dtype, arenas=r)
    plain = to_host_adapter(lora, weights, projections, 64, pin=False, dtype=dtype)
    assert host.arena is not None and plain.arena is None and host.nbytes == plain.nbytes
    lo = host.arena.buffer.data_ptr()
    hi = lo + host.arena.capacity
    for key, (a, b, ranks) in host.fused.items():
        pa, pb, pranks = plain.fused[key]
        assert ranks == pranks and torch.equal(a, pa) and torch.equal(b, pb)
        for t in (a, b):
            assert lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi and t.data_ptr() % 64 == 0
    # the arena is sized to the adapter: nothing fell outside it, and little is left over
    assert host.nbytes <= host.arena.capacity <= host.nbytes + 64 * 2 * len(host.fused)


def test_manager_builds_a_reload_in_the_arena_of_an_adapter_gone_from_every_slot():
    projections = _projections()
    adapters = {name: _adapter(i, 16, projections, skip=()) for i, name in enumerate("abc")}
    manager = LoraManager(projections, lambda lora: adapters[lora.key], max_loras=1, max_cpu_loras=1, max_rank=64)
    loras = {n: LoRARequest(name=n, content_hash=n, path=n) for n in adapters}

    def run(name):
        lora = loras[name]
        if not manager.ready(lora):
            manager.request_load(lora).result(10)
        assert manager.ready(lora)
        slot = manager.try_acquire(lora)
        x = torch.randn(2, 576)
        y = torch.zeros(2, 960)
        manager.build_step([slot, -1]).apply(1, ("q_proj", "k_proj", "v_proj"), x, y, (576, 192, 192))
        a, b = adapters[name][(1, "k_proj")]
        torch.testing.assert_close(y[0, 576:768], x[0] @ a.t() @ b.t(), rtol=1e-4, atol=1e-4)
        assert not y[1].any()
        manager.release(lora.key)
        return manager._host[lora.key].arena if lora.key in manager._host else None

    first = run("a")
    assert first is not None and manager._recycler.fresh == 1
    run("b")  # a leaves the host cache but keeps its slot until b takes it: its arena is not reusable yet
    run("c")  # b's slot goes to c: a's arena is idle by now, and c's copy is built in it
    assert manager._recycler.reused >= 1
    run("a")  # and a reloads exactly
    manager.close()
