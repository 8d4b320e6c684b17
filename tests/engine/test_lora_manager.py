"""The adapter cache: slots, host LRU, references, pinning, background loads."""

from __future__ import annotations

import threading

import pytest
import torch

from loraplex.engine.errors import AdapterLoadError
from loraplex.engine.lora_layers import LoraProjection
from loraplex.engine.lora_manager import LoraManager
from loraplex.engine.lora_request import LoRARequest

PROJECTIONS = [
    LoraProjection(layer, names, 16, sizes)
    for layer in range(2)
    for names, sizes in ((("q_proj", "k_proj", "v_proj"), (16, 8, 8)), (("o_proj",), (16,)))
]


def _weights(seed: int, rank: int, modules=("q_proj", "v_proj", "o_proj")):
    gen = torch.Generator().manual_seed(seed)
    out = {"q_proj": 16, "k_proj": 8, "v_proj": 8, "o_proj": 16}
    return {
        (layer, m): (torch.randn(rank, 16, generator=gen), torch.randn(out[m], rank, generator=gen))
        for layer in range(2)
        for m in modules
    }


class FakeStore:
    def __init__(self):
        self.adapters: dict[str, dict] = {}
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def add(self, name: str, rank: int, **kw) -> LoRARequest:
        self.adapters[name] = _weights(len(self.adapters), rank, **kw)
        return LoRARequest(name=name, content_hash=name, path=name)

    def load(self, lora: LoRARequest):
        self.gate.wait(5)
        self.calls.append(lora.key)
        if lora.key not in self.adapters:
            raise FileNotFoundError(f"no adapter {lora.key}")
        return self.adapters[lora.key]


def _manager(store, max_loras=2, max_cpu_loras=4):
    return LoraManager(PROJECTIONS, store.load, max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_rank=8)


def _ready(manager, lora):
    if not manager.ready(lora):
        manager.request_load(lora).result(5)
    assert manager.ready(lora)


def test_slot_holds_the_adapter_and_step_applies_it():
    store = FakeStore()
    m = _manager(store)
    a, b = store.add("a", 4), store.add("b", 8, modules=("k_proj",))
    for lora in (a, b):
        _ready(m, lora)
    sa, sb = m.try_acquire(a), m.try_acquire(b)
    assert {sa, sb} == {0, 1}
    x = torch.randn(3, 16)
    y = torch.zeros(3, 32)
    step = m.build_step([sa, -1, sb])
    step.apply(1, ("q_proj", "k_proj", "v_proj"), x, y, (16, 8, 8))
    wa, wb = store.adapters["a"], store.adapters["b"]
    expected = torch.zeros(3, 32)
    expected[0, :16] = x[0] @ wa[(1, "q_proj")][0].t() @ wa[(1, "q_proj")][1].t()
    expected[0, 24:] = x[0] @ wa[(1, "v_proj")][0].t() @ wa[(1, "v_proj")][1].t()
    expected[2, 16:24] = x[2] @ wb[(1, "k_proj")][0].t() @ wb[(1, "k_proj")][1].t()
    torch.testing.assert_close(y, expected)
    assert m.build_step([-1, -1]) is None


def test_a_step_with_the_same_slots_reuses_the_state_and_reads_what_the_slot_holds_now():
    store = FakeStore()
    m = _manager(store, max_loras=1)
    a, b = store.add("a", 4), store.add("b", 8)
    _ready(m, a)
    slot = m.try_acquire(a)
    x = torch.randn(2, 16)

    def o_proj_delta(step):
        y = torch.zeros(2, 16)
        step.apply(0, ("o_proj",), x, y, (16,))
        return y

    first = m.build_step([slot, -1])
    wa = store.adapters["a"][(0, "o_proj")]
    torch.testing.assert_close(o_proj_delta(first)[0], x[0] @ wa[0].t() @ wa[1].t())
    # the slot now holds another adapter: the same slot list gives the same state, which reads the new weights
    m.release(a.key)
    assert m.remove(a.key)
    _ready(m, b)
    assert m.try_acquire(b) == slot
    again = m.build_step(torch.tensor([slot, -1]))
    assert again is first
    wb = store.adapters["b"][(0, "o_proj")]
    delta = o_proj_delta(again)
    torch.testing.assert_close(delta[0], x[0] @ wb[0].t() @ wb[1].t())
    assert torch.equal(delta[1], torch.zeros(16))
    # another slot list: a new grouping
    other = m.build_step([-1, slot])
    assert other is not first and other.batch.sorted_token_ids.tolist() == [1]
    assert m.build_step([-1, -1]) is None and m.build_step([-1, slot]) is not other  # None was the last


def test_lru_eviction_spares_adapters_in_use_and_pinned():
    store = FakeStore()
    m = _manager(store, max_loras=2)
    a, b, c, d = (store.add(n, 4) for n in "abcd")
    for lora in (a, b, c, d):
        _ready(m, lora)
    slot_a = m.try_acquire(a)
    m.try_acquire(b)
    assert m.try_acquire(c) is None  # both slots referenced by running requests
    m.release("a")
    assert m.try_acquire(c) == slot_a  # a was idle: evicted
    assert not m.is_resident("a") and m.is_resident("b")
    m.release("b")
    m.release("c")
    m.pin("b")
    m.try_acquire(d)  # c is the only idle, unpinned one
    assert m.is_resident("b") and not m.is_resident("c")
    assert m.evictions_total == 2
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        m.release("c")


def test_pins_never_take_every_slot():
    """With every slot held by a pinned adapter, an idle pinned one gives its slot up rather than leave other
    adapters waiting forever; while any slot holds an unpinned adapter, pins stay resident."""
    store = FakeStore()
    m = _manager(store, max_loras=2)
    a, b, c, d = (store.add(n, 4) for n in "abcd")
    for lora in (a, b, c, d):
        _ready(m, lora)
    m.pin("a")
    m.pin("b")
    m.try_acquire(a)
    m.try_acquire(b)
    assert m.try_acquire(c) is None  # both pinned adapters are running
    m.release("a")
    slot = m.try_acquire(c)  # a is idle: its slot goes, its pin stays
    assert slot is not None and m.is_resident("c") and not m.is_resident("a")
    assert "a" in m.stats()["lora_pinned"] and "a" in m.stats()["lora_host_cached"]
    m.release("c")
    m.release("b")
    assert m.try_acquire(d) is not None  # c is the idle unpinned one: b (pinned) stays
    assert m.is_resident("b") and not m.is_resident("c")
    m.release("d")
    _ready(m, a)
    assert m.try_acquire(a) is not None  # a pinned adapter back on its next request, taking d's slot
    assert m.is_resident("a") and m.is_resident("b") and not m.is_resident("d")


def test_no_more_pins_than_the_host_cache_holds():
    """Pinned adapters stay in host memory: a pin beyond max_cpu_loras is refused, saying why, rather than taken
    while loads drop pinned adapters from the host cache."""
    store = FakeStore()
    m = _manager(store, max_loras=1, max_cpu_loras=2)
    a, b, c = (store.add(n, 4) for n in "abc")
    m.prefetch(a, pin=True).result(5)
    m.prefetch(b, pin=True).result(5)
    m.prefetch(a, pin=True).result(5)  # pinned already: nothing more to hold
    with pytest.raises(AdapterLoadError, match=r"cannot pin adapter 'c': 2 adapters are pinned .*max_cpu_loras=2"):
        m.prefetch(c, pin=True).result(5)
    with pytest.raises(AdapterLoadError, match="max_cpu_loras=2"):
        m.pin("c")
    assert m.stats()["lora_pinned"] == ["a", "b"] and set(m.stats()["lora_host_cached"]) == {"a", "b"}
    m.unpin("b")
    m.prefetch(c, pin=True).result(5)
    assert m.stats()["lora_pinned"] == ["a", "c"]


def test_a_waiting_request_s_load_goes_before_queued_prefetches():
    store = FakeStore()
    m = _manager(store, max_loras=2, max_cpu_loras=8)
    a, b, c, d = (store.add(n, 4) for n in "abcd")
    store.gate.clear()  # the loader blocks on a's read
    prefetches = [m.prefetch(lora) for lora in (a, b, c)]
    while "a" not in m._loading or "a" in m._queued:  # a has left the queue: it is the load under way
        pass
    assert not m.ready(d)  # a request waits for d: its load is queued before b's and c's
    m.request_load(b)  # a request now waits for b too: it goes ahead of c, behind d
    store.gate.set()
    for fut in prefetches:
        fut.result(5)
    m.request_load(d).result(5)
    assert store.calls == ["a", "d", "b", "c"]


def test_an_adapter_removed_while_it_loads_is_not_kept_unless_a_request_asks_for_it_again():
    """A delete during the adapter's load left the load's copy in host memory and, from a prefetch, in a free
    slot: the deleted adapter came back."""
    store = FakeStore()
    m = _manager(store)
    a, b = store.add("a", 4), store.add("b", 4)
    store.gate.clear()  # the loader blocks on a's read
    prefetched = m.prefetch(a)
    while "a" in m._queued:
        pass
    assert m.remove(a.key)  # no request uses it
    store.gate.set()
    assert prefetched.result(5) is None
    assert not m.is_resident(a.key) and a.key not in m._host and not m.loading
    # a request that comes after the delete (accepted before it) still gets the load it waits for
    store.gate.clear()
    m.prefetch(b)
    while "b" in m._queued:
        pass
    assert m.remove(b.key)
    assert not m.ready(b)
    store.gate.set()
    m.request_load(b).result(5)
    assert m.ready(b) and b.key in m._host


def test_loads_queued_at_close_are_cancelled():
    store = FakeStore()
    m = _manager(store)
    a, b = store.add("a", 4), store.add("b", 4)
    store.gate.clear()
    m.request_load(a)
    queued = m.request_load(b)
    prefetched = m.prefetch(store.add("c", 4))
    m.close()
    assert queued.cancelled()
    with pytest.raises(AdapterLoadError, match="'c' was not loaded: the adapter cache closed"):
        prefetched.result(5)  # told, not left waiting
    store.gate.set()


def test_least_recently_used_goes_first():
    store = FakeStore()
    m = _manager(store, max_loras=2)
    a, b, c = (store.add(n, 2) for n in "abc")
    for lora in (a, b, c):
        _ready(m, lora)
    for lora in (a, b, a):
        m.try_acquire(lora)
        m.release(lora.key)
    m.try_acquire(c)
    assert m.is_resident("a") and not m.is_resident("b")


def test_load_runs_in_the_background_and_errors_reach_the_scheduler():
    store = FakeStore()
    m = _manager(store)
    a = store.add("a", 4)
    store.gate.clear()
    assert m.ready(a) is False  # returns at once while the load waits
    assert m.ready(a) is False
    store.gate.set()
    m.request_load(a).result(5)
    assert m.ready(a) and store.calls == ["a"]
    missing = LoRARequest(name="zz", content_hash="zz", path="zz")
    assert m.ready(missing) is False
    with pytest.raises(AdapterLoadError):
        m.request_load(missing).result(5)
    with pytest.raises(AdapterLoadError, match="no adapter zz"):
        m.ready(missing)


def test_a_failed_prefetch_is_its_caller_s_error_and_a_later_request_loads_again():
    """A prefetch that fails (a store that did not answer then) tells its caller; the next request for the
    adapter tries the load again rather than fail on the prefetch's old error."""
    store = FakeStore()
    m = _manager(store)
    lora = LoRARequest(name="x", content_hash="x", path="x")
    with pytest.raises(AdapterLoadError, match="no adapter x"):
        m.prefetch(lora).result(5)
    store.add("x", 4)
    assert m.ready(lora) is False  # a new load, not the prefetch's error
    m.request_load(lora).result(5)
    assert m.ready(lora) and store.calls == ["x", "x"]


def test_prefetch_fills_a_free_slot_and_reload_after_host_eviction():
    store = FakeStore()
    m = _manager(store, max_loras=1, max_cpu_loras=1)
    a, b = store.add("a", 4), store.add("b", 4)
    assert m.prefetch(a).result(5) == 0
    assert m.is_resident("a")
    # b fills the one host entry; a keeps its slot but loses its host copy
    m.request_load(b).result(5)
    assert m.try_acquire(b) == 0  # a idle: evicted
    m.release("b")
    assert m.try_acquire(a) is None  # not in host memory anymore: reload starts, no slot yet
    m.request_load(a).result(5)
    assert m.try_acquire(a) == 0
    assert store.calls == ["a", "b", "a"]


def test_remove_refuses_while_in_use_and_validates_shapes():
    store = FakeStore()
    m = _manager(store)
    a = store.add("a", 4)
    _ready(m, a)
    m.try_acquire(a)
    m.try_acquire(a)
    assert m.remove("a") is False
    m.release("a")
    assert m.is_resident("a")  # one request still runs on it
    m.release("a")  # the last one stops: removed now, from the slot and from host memory
    assert not m.is_resident("a") and "a" not in m.stats()["lora_host_cached"]
    _ready(m, a)  # a request accepted before the removal loads it again, and it stays cached after
    m.try_acquire(a)
    m.release("a")
    assert m.is_resident("a")
    assert m.remove("a") is True and not m.is_resident("a") and not m.ready(a)
    bad = LoRARequest(name="bad", content_hash="bad", path="bad")
    store.adapters["bad"] = {(0, "q_proj"): (torch.zeros(4, 12), torch.zeros(16, 4))}
    with pytest.raises(AdapterLoadError, match="do not match the model"):
        m.request_load(bad).result(5)
    big = LoRARequest(name="big", content_hash="big", path="big")
    store.adapters["big"] = {(0, "o_proj"): (torch.zeros(16, 16), torch.zeros(16, 16))}
    with pytest.raises(AdapterLoadError, match="max_lora_rank"):
        m.request_load(big).result(5)


def test_waiting_requests_do_not_thrash_the_host_cache():
    # Six requests wait for six adapters; only two fit in host memory. Asking every step must not load
    # and drop adapters in a circle: loads stay bounded by what can be used next.
    store = FakeStore()
    m = _manager(store, max_loras=2, max_cpu_loras=2)
    loras = [store.add(n, 2) for n in "abcdef"]
    served = []
    for _ in range(40):
        for lora in loras:
            if lora.key in served:
                continue
            if m.ready(lora) and m.try_acquire(lora) is not None:
                served.append(lora.key)
                m.release(lora.key)  # the request ran to the end
        for fut in list(m._loading.values()):
            fut.result(5)
        if len(served) == len(loras):
            break
    assert sorted(served) == list("abcdef")
    assert m.loads_total == 6 and store.calls.count("a") == 1


def test_loads_paused_holds_queued_loads_and_waits_for_the_one_running():
    store = FakeStore()
    a, b = store.add("a", 4), store.add("b", 4)
    manager = _manager(store)
    store.gate.clear()  # the load of a starts and blocks inside the store
    first = manager.request_load(a)
    while not manager._executing:
        threading.Event().wait(0.001)
    second = manager.request_load(b)
    entered = threading.Event()
    during = []

    def pause():
        with manager.loads_paused():
            entered.set()
            threading.Event().wait(0.2)  # a large step runs
            during.append((list(store.calls), second.done()))

    step = threading.Thread(target=pause)
    step.start()
    assert not entered.wait(0.1)  # the pause waits for the load under way
    store.gate.set()
    first.result(5)
    assert entered.wait(5)
    step.join(5)
    assert during == [(["a"], False)]  # b was held back while the step ran
    second.result(5)
    assert store.calls == ["a", "b"]
    assert manager.ready(a) and manager.ready(b) and not manager.loading
    manager.close()


def test_wait_for_load_returns_when_a_load_finishes():
    """An idle step thread blocks here while a load runs, and goes on when it is done (not at the timeout)."""
    store = FakeStore()
    a = store.add("a", 4)
    manager = _manager(store)
    manager.wait_for_load(60)  # nothing queued: returns at once
    store.gate.clear()  # the load of a starts and blocks inside the store
    fut = manager.request_load(a)
    assert manager.loading
    waited = []

    def idle_step():
        manager.wait_for_load(60)
        waited.append(fut.done() or manager.ready(a))

    step = threading.Thread(target=idle_step)
    step.start()
    step.join(0.1)
    assert step.is_alive()  # still waiting: the load has not finished
    store.gate.set()
    step.join(30)
    assert not step.is_alive() and waited == [True]
    assert not manager.loading
    manager.close()


def test_host_copies_of_dropped_adapters_are_recycled_but_never_while_a_slot_reads_them():
    """On the CPU a slot reads the adapter's host tensors; an adapter that leaves the host LRU hands its
    tensors to the next loads of the same shapes, except those a slot still holds. Results stay exact."""
    store = FakeStore()
    m = _manager(store, max_loras=1, max_cpu_loras=2)
    a, b, c, d = (store.add(name, 4) for name in "abcd")
    _ready(m, a)
    slot = m.try_acquire(a)
    m.release(a.key)  # a stays in its slot, idle
    a_ptrs = {t.data_ptr() for t, _, _ in m._host[a.key].fused.values()}
    _ready(m, b)
    b_ptrs = {t.data_ptr() for t, _, _ in m._host[b.key].fused.values()}
    _ready(m, c)  # pushes a out of the host LRU: its tensors wait in the recycler, still read by the slot
    assert a.key not in m._host and m.is_resident(a.key)
    assert m.remove(b.key)  # b's tensors wait in the recycler, read by nobody
    _ready(m, d)  # built in b's tensors, never in a's
    d_ptrs = {t.data_ptr() for t, _, _ in m._host[d.key].fused.values()}
    assert d_ptrs & b_ptrs, "d should be built in b's freed tensors"
    assert not (d_ptrs | {t.data_ptr() for t, _, _ in m._host[c.key].fused.values()}) & a_ptrs
    assert m._recycler.reused > 0
    x = torch.randn(1, 16)
    for lora in (a, d):  # the slot still computes a's delta exactly; then d's, after reloading
        _ready(m, lora)
        slot = m.try_acquire(lora)
        y = torch.zeros(1, 32)
        m.build_step([slot]).apply(0, ("q_proj", "k_proj", "v_proj"), x, y, (16, 8, 8))
        w = store.adapters[lora.name][(0, "q_proj")]
        torch.testing.assert_close(y[0, :16], x[0] @ w[0].t() @ w[1].t())
        m.release(lora.key)
