"""Scheduling policy without a model: budgets, chunking, preemption, fairness, adapter slots."""

from __future__ import annotations

import pytest

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, fit_max_tokens
from loraplex.engine.sequence import Sequence, SequenceStatus


def _scheduler(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 256)
    return Scheduler(BlockManager(num_blocks, block_size), **kw)


def _seq(n, tenant=None, lora=None, max_tokens=4, request_id="r"):
    return Sequence(request_id, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), tenant=tenant, lora=lora)


def _step(s: Scheduler):
    """One scheduled step with token 0 sampled everywhere; finishes sequences at max_tokens."""
    batch = s.schedule()
    sampled = {m.seq_id: 0 for group in batch.sample_groups.values() for m in group}
    for seq in s.postprocess(batch, sampled):
        if seq.num_output_tokens >= seq.params.max_tokens:
            s.finish(seq, "length")
    return batch


def test_chunked_prefill_shares_the_step_with_decodes():
    s = _scheduler(max_num_batched_tokens=10)
    short = _seq(3)
    s.add(short)
    _step(s)
    long = _seq(30)
    s.add(long)
    batch = _step(s)
    assert dict(zip([q.seq_id for q in batch.seqs], batch.num_new_tokens, strict=True)) == {
        short.seq_id: 1, long.seq_id: 9,
    }
    assert long.seq_id not in batch.sample_groups  # mid-prefill: no token yet
    while long.num_output_tokens == 0:
        _step(s)
    assert long.num_computed_tokens == 30


def test_preempts_the_newest_when_blocks_run_out_and_recomputes_it():
    s = _scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    old, new = _seq(7, max_tokens=6), _seq(7, max_tokens=6)
    s.add(old)
    s.add(new)
    _step(s)
    preempted = []
    while s.has_work():
        preempted += _step(s).preempted
    assert new in preempted and old not in preempted
    assert old.num_output_tokens == 6 and new.num_output_tokens == 6
    assert s.bm.num_free_blocks == 4


def test_request_that_can_never_fit_is_refused(caplog):
    s = _scheduler(num_blocks=4, block_size=4)
    with caplog.at_level("INFO", logger="loraplex.engine.scheduler"), \
            pytest.raises(InvalidRequestError, match="KV cache blocks") as refused:
        s.check_fits(10, 20)
    # the caller is told what it can change; the cache's size is the operator's, and goes to the log
    assert "lower max_tokens, or shorten the prompt" in str(refused.value)
    assert "raise" not in str(refused.value) and "kv_cache_memory" not in str(refused.value)
    assert "kv_cache_memory" in caplog.text
    with pytest.raises(InvalidRequestError, match="context"):
        s.check_fits(256, 1)
    s.check_fits(10, 6)


def test_more_completions_than_the_batch_holds_are_refused():
    # a request's n completions run together: n above max_num_seqs could never be admitted and waited forever
    s = _scheduler(num_blocks=64, block_size=4, max_num_seqs=8)
    with pytest.raises(InvalidRequestError, match="max_num_seqs=8") as info:
        s.check_fits(4, 2, n=9)
    assert info.value.param == "n"
    assert s.check_fits(4, 2, n=8) == 2


def test_unset_max_tokens_is_capped_to_what_the_cache_holds():
    # 4 blocks of 4 tokens, context 256: a 10-token prompt fills 2 full blocks and part of a third
    s = _scheduler(num_blocks=4, block_size=4)
    assert s.check_fits(10, 6) == 6  # a given max_tokens is kept as it is
    assert s.check_fits(10, None) == 6  # one completion: 4 blocks, 16 tokens in all
    # n=2: the 2 full prompt blocks are shared, each completion gets one block of its own: 12 tokens in all
    assert s.check_fits(10, None, n=2) == 2
    with pytest.raises(InvalidRequestError, match="KV cache blocks"):
        s.check_fits(10, None, n=3)  # no block left for the third completion
    roomy = _scheduler(num_blocks=1000, block_size=4)
    assert roomy.check_fits(10, None, n=4) is None  # the whole context fits: left unset

    params = SamplingParams(max_tokens=None, n=2, temperature=0.7, min_tokens=1)
    fitted = fit_max_tokens(s, 10, params)
    assert fitted.max_tokens == 2 and fitted.n == 2 and fitted.temperature == 0.7 and params.max_tokens is None
    assert fit_max_tokens(roomy, 10, params) is params


def test_a_server_set_ceiling_is_lowered_to_what_the_cache_holds():
    """The API caps an unset max_tokens by the tenant's token rate (`max_tokens_is_ceiling`): the cap is not
    the client's number, so the cache lowers it as it would an unset one instead of refusing the request."""
    s = _scheduler(num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match="KV cache blocks"):
        s.check_fits(10, 100, n=2)  # the client asked for 100 tokens each: refused
    assert s.check_fits(10, 100, n=2, ceiling=True) == 2
    assert s.check_fits(10, 1, n=2, ceiling=True) == 1  # a ceiling below the room stays
    params = SamplingParams(max_tokens=100, n=2, max_tokens_is_ceiling=True)
    assert fit_max_tokens(s, 10, params).max_tokens == 2
    with pytest.raises(InvalidRequestError, match="KV cache blocks"):
        fit_max_tokens(s, 10, SamplingParams(max_tokens=100, n=2))
    with pytest.raises(InvalidRequestError, match="min_tokens 3 cannot be reached"):
        fit_max_tokens(s, 10, SamplingParams(max_tokens=None, n=2, min_tokens=3))


def test_least_served_tenant_goes_first():
    s = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(20):
        s.add(_seq(8, tenant="big", request_id=f"big{i}"))
    for _ in range(5):
        _step(s)
    small = [_seq(8, tenant="small", request_id=f"small{i}") for i in range(2)]
    for seq in small:
        s.add(seq)
    admitted_before_small = 0
    seen = {q.seq_id for q in s.running}
    while any(q.status is SequenceStatus.WAITING for q in small):
        for q in _step(s).seqs:
            if q.seq_id not in seen:
                seen.add(q.seq_id)
                admitted_before_small += q.tenant == "big"
    # A FIFO queue would admit the 18 queued big requests first; least-served-first lets small in at once.
    assert admitted_before_small <= 1
    assert sum(1 for q in s.waiting.get("big", ())) >= 10


def test_a_burst_of_long_prompts_already_running_does_not_hold_a_new_tenant_back():
    """Long prompts of one tenant admitted in chunks fill each step's budget; a tenant arriving then is
    prefilled in the next step, beside them, not after all of them."""
    s = _scheduler(num_blocks=512, max_num_seqs=16, max_num_batched_tokens=64)
    for i in range(12):
        s.add(_seq(100, tenant="burst", request_id=f"burst{i}"))
    _step(s)  # the burst's first prompt admitted, its first chunk run
    assert [q.tenant for q in s.running] == ["burst"]
    late = _seq(20, tenant="late", request_id="late")
    s.add(late)
    batch = _step(s)
    assert late in batch.seqs and late.num_computed_tokens == 20  # its whole prompt in this step
    assert batch.num_tokens == 64  # the burst's chunk took the rest of the budget
    assert late.num_output_tokens == 1


def test_deferred_chunks_still_progress_when_the_waiting_tenant_cannot_be_admitted():
    s = _scheduler(num_blocks=512, max_num_seqs=1, max_num_batched_tokens=64)
    s.add(_seq(100, tenant="burst", request_id="burst0"))
    _step(s)
    s.add(_seq(20, tenant="late", request_id="late"))  # no room: one sequence at a time
    batch = _step(s)
    assert [q.tenant for q in batch.seqs] == ["burst"] and batch.num_tokens == 36


class FakeSlots:
    """One device slot; adapters become ready one step after their load is requested."""

    def __init__(self, num_slots=1):
        self.num_slots = num_slots
        self.requested: set[str] = set()
        self.loaded: set[str] = set()
        self.refs: dict[str, int] = {}

    def tick(self):
        self.loaded |= self.requested

    def ready(self, lora):
        if lora.key in self.loaded:
            return True
        self.requested.add(lora.key)
        return False

    def try_acquire(self, lora):
        held = {k for k, n in self.refs.items() if n}
        if lora.key not in held and len(held) >= self.num_slots:
            return None
        self.refs[lora.key] = self.refs.get(lora.key, 0) + 1
        return 0

    def release(self, key):
        self.refs[key] -= 1

    def slot_of(self, key):
        return 0

    def build_step(self, token_slots):
        return None


def test_adapter_not_resident_waits_without_blocking_others_and_slots_bound_a_step():
    slots = FakeSlots(num_slots=1)
    s = _scheduler(adapter_slots=slots)
    a, b = LoRARequest("a", "hash-a", "/a"), LoRARequest("b", "hash-b", "/b")
    with_a, with_b, base = _seq(5, lora=a), _seq(5, lora=b), _seq(5)
    for seq in (with_a, with_b, base):
        s.add(seq)
    batch = _step(s)
    assert [q.seq_id for q in batch.seqs] == [base.seq_id]  # adapters still loading
    assert slots.requested == {"hash-a", "hash-b"}
    slots.tick()
    seen = []
    while s.has_work():
        batch = _step(s)
        keys = {q.adapter_key for q in batch.seqs if q.adapter_key}
        assert len(keys) <= 1  # never more adapters in a step than slots
        seen += [q.seq_id for q in batch.seqs]
    assert with_a.seq_id in seen and with_b.seq_id in seen
    assert all(n == 0 for n in slots.refs.values())  # every acquire was released


def test_min_tokens_must_fit_in_the_context_left_after_the_prompt():
    """A request without max_tokens runs to the end of the context at most: a min_tokens beyond it could never
    be met (the completion would end with "length" first), so it is refused, as it is beside a max_tokens."""
    s = _scheduler(num_blocks=64, block_size=4, max_model_len=32)
    assert fit_max_tokens(s, 10, SamplingParams(max_tokens=None, min_tokens=22)).min_tokens == 22
    for max_tokens in (None, 100):
        with pytest.raises(InvalidRequestError, match="min_tokens 23 cannot be reached") as info:
            fit_max_tokens(s, 10, SamplingParams(max_tokens=max_tokens, min_tokens=23))
        assert info.value.param == "min_tokens"
