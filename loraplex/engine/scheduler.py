"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step first continues the running sequences (decodes and unfinished prefill chunks, oldest first),
preempting the newest by recompute when the KV cache runs out, then admits waiting sequences while the
token budget, the sequence limit, KV blocks and adapter slots allow. Waiting requests are taken from the
tenant that received the least service so far; a request whose adapter is not resident triggers its load
and waits without holding up the others.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from loraplex.engine.adapter_slots import AdapterSlots
from loraplex.engine.block_manager import BlockManager, cache_salt
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.fairness import VirtualTokenCounter
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # seq_id of a sampling sequence -> the sequences sampling from its last row (itself, then forks)
    sample_groups: dict[int, list[Sequence]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # e.g. their adapter failed to load

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass
class _Admission:
    """One step's admission pass."""

    running: Counter  # sequences running per tenant, kept as it admits
    blocked: set[int] = field(default_factory=set)  # seq_ids skipped (adapter not ready or no free slot)
    # adapters whose slot a request ahead in the order waits for: nothing behind it is admitted for them
    held_back: set[str] = field(default_factory=set)
    no_load_place: set[str] = field(default_factory=set)  # tenants whose adapter found no place to load


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        adapter_slots: AdapterSlots | None = None,
        fairness: VirtualTokenCounter | None = None,
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.adapter_slots = adapter_slots
        self.fairness = fairness or VirtualTokenCounter()
        self.waiting: OrderedDict[str, deque[Sequence]] = OrderedDict()  # tenant -> FIFO
        self._waiting_per_adapter: Counter[str] = Counter()  # adapter key -> sequences waiting for it
        self.running: list[Sequence] = []  # admission order: the newest is last
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def _backlogged_tenants(self) -> set[str]:
        tenants = {t for t, q in self.waiting.items() if q}
        tenants.update(s.tenant for s in self.running)
        return tenants

    def check_fits(self, prompt_len: int, max_tokens: int | None, n: int = 1, *, ceiling: bool = False) -> int | None:
        """Refuse a request that could never run, even alone on an empty cache. Returns the max_tokens to
        run it with: the one given, or for an unset one (up to the context) None when the whole context fits
        and otherwise the most that the cache can hold for all n completions at once (they then finish with
        "length" there, as at the end of the context). With `ceiling`, max_tokens is a server-set cap on an
        unset one: lowered the same way when the cache cannot hold it."""
        if n > self.max_num_seqs:
            # the n completions of a request run together; more than the batch holds would wait forever
            raise InvalidRequestError(
                f"n={n} is more completions than this engine runs at once (max_num_seqs={self.max_num_seqs}); "
                "lower n, or send the prompt in several requests",
                param="n",
            )
        if prompt_len >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {prompt_len} tokens but the model's context is {self.max_model_len} tokens "
                f"(prompt plus at least one generated token must fit)",
                param="prompt",
            )
        total = self.max_model_len if max_tokens is None else min(prompt_len + max_tokens, self.max_model_len)
        shared = prompt_len // self.bm.block_size  # full prompt blocks n > 1 completions share
        needed = shared + n * (self.bm.blocks_needed(total) - shared)
        if needed <= self.bm.num_blocks:
            return max_tokens
        if max_tokens is None or ceiling:
            per_seq = shared + (self.bm.num_blocks - shared) // n  # blocks each completion may hold
            room = min(per_seq * self.bm.block_size, self.max_model_len) - prompt_len
            if room >= 1:
                return room if max_tokens is None else min(room, max_tokens)
        # the fix for the operator (a larger cache) is no business of the caller's: it goes to the log only
        log.info("refused a request needing %d KV cache blocks of %d (%d prompt tokens, n=%d); a larger KV cache "
                 "(kv_cache_memory or num_kv_blocks) would hold it", needed, self.bm.num_blocks, prompt_len, n)
        raise InvalidRequestError(
            f"request needs {needed} KV cache blocks ({prompt_len} prompt tokens, up to {total} in all"
            f"{f', n={n}' if n > 1 else ''}) but the cache has only {self.bm.num_blocks}, so it can never run "
            f"here; lower max_tokens{' or n' if n > 1 else ''}, or shorten the prompt",
            param="max_tokens",
        )

    def add(self, seq: Sequence) -> None:
        self.fairness.on_arrival(seq.tenant, self._backlogged_tenants())
        self.waiting.setdefault(seq.tenant, deque()).append(seq)
        if seq.adapter_key is not None:
            self._waiting_per_adapter[seq.adapter_key] += 1

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self._leave_running(seq)
            elif seq.status is SequenceStatus.WAITING:
                self._leave_waiting(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.finish_reason or "abort"
            for child in seq.pending_forks:
                child.status = SequenceStatus.FINISHED
                child.finish_reason = child.finish_reason or "abort"
            seq.pending_forks = []

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.status is SequenceStatus.RUNNING:
            self._leave_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._leave_waiting(seq)
        seq.status = SequenceStatus.FINISHED

    def _take_from_waiting(self, seq: Sequence) -> None:
        self.waiting[seq.tenant].remove(seq)
        key = seq.adapter_key
        if key is not None:
            self._waiting_per_adapter[key] -= 1
            if not self._waiting_per_adapter[key]:
                del self._waiting_per_adapter[key]

    def _leave_waiting(self, seq: Sequence) -> None:
        queue = self.waiting.get(seq.tenant)
        if queue is None or seq not in queue:
            return
        self._take_from_waiting(seq)
        key = seq.adapter_key
        unwanted = getattr(self.adapter_slots, "unwanted", None)
        if key is not None and unwanted is not None and key not in self._waiting_per_adapter:
            # the adapter's load was kept a place for this request: give it to others' now
            unwanted(key)

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        if seq.holds_adapter_slot:
            self.adapter_slots.release(seq.adapter_key)
            seq.holds_adapter_slot = False

    def _salt(self, seq: Sequence) -> bytes:
        if seq.cache_salt is None:
            seq.cache_salt = cache_salt(seq.adapter_key, seq.tenant)
        return seq.cache_salt

    # -- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # seq_id -> tokens this step, in scheduling order
        seq_by_id: dict[int, Sequence] = {}

        # A running prefill of a tenant that has received more service than some waiting tenant takes what
        # budget is left after admissions, not before: otherwise one tenant's burst of long prompts, once
        # admitted, fills every step's budget with its chunks and a newly arrived tenant waits for all of
        # them (a 60-request burst of 700-token prompts held another tenant's first token for 11 s).
        # A tenant that just arrived stands level with the least-served backlogged one (see fairness.py), so
        # equal service counts as less here.
        deferred: list[Sequence] = []
        waiting_service = sorted((self.fairness.counter(t), t) for t, q in self.waiting.items() if q)

        def behind_a_waiting_tenant(seq: Sequence) -> bool:
            least = next((c for c, t in waiting_service if t != seq.tenant), None)
            return least is not None and least <= self.fairness.counter(seq.tenant)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens > 1 and behind_a_waiting_tenant(seq):
                deferred.append(seq)
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.bm.append_slots(seq, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                scheduled.pop(victim.seq_id, None)
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = n
                seq_by_id[seq.seq_id] = seq
                budget -= n
                i += 1
                continue
            break

        if not batch.preempted:
            budget = self._admit(budget, scheduled, seq_by_id, batch)
        for seq in deferred:  # what the admissions left; no preemption for these chunks
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted above for another's blocks
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0 or not self.bm.append_slots(seq, n):
                break
            scheduled[seq.seq_id] = n
            seq_by_id[seq.seq_id] = seq
            budget -= n

        for seq_id, n in scheduled.items():
            seq = seq_by_id[seq_id]
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            if seq.num_computed_tokens + n == len(seq.token_ids):
                group = [seq]
                if seq.pending_forks:
                    group.extend(self._fork(seq))
                batch.sample_groups[seq.seq_id] = group
        batch.block_copies = self.bm.take_pending_copies()
        return batch

    def _admit(
        self, budget: int, scheduled: dict[int, int], seq_by_id: dict[int, Sequence], batch: ScheduledBatch
    ) -> int:
        admission = _Admission(Counter(q.tenant for q in self.running))
        blocked, held_back = admission.blocked, admission.held_back
        slot_waiters: list[Sequence] = []  # candidates that found every adapter slot held
        while budget > 0:
            seq = self._next_candidate(admission, batch)
            if seq is None:
                break
            if len(self.running) + 1 + len(seq.pending_forks) > self.max_num_seqs:
                break
            salt = self._salt(seq)
            hits = self.bm.match_prefix(seq, salt)
            cached = len(hits) * self.bm.block_size
            n = min(len(seq.token_ids) - cached, budget)
            if not self.bm.can_admit(hits, cached + n):
                break  # out of KV blocks: wait for running sequences to finish
            if seq.lora is not None:
                if self.adapter_slots.try_acquire(seq.lora) is None:
                    blocked.add(seq.seq_id)  # every slot is held by running requests' adapters
                    slot_waiters.append(seq)
                    # Requests behind it for the adapters in the slots go ahead (they batch well), up to a
                    # batch's worth; then one of those adapters drains for it, or a steady stream of them
                    # (another tenant's burst, say) would keep every slot from it for as long as they came.
                    slot_to_free = getattr(self.adapter_slots, "slot_to_free", None)
                    if seq.num_overtaken >= self.max_num_seqs and slot_to_free is not None:
                        key = slot_to_free()
                        if key is not None:
                            held_back.add(key)
                    continue
                seq.holds_adapter_slot = True
                seq.num_overtaken = 0
                for waiter in slot_waiters:
                    waiter.num_overtaken += 1
            self._take_from_waiting(seq)
            self.bm.admit(seq, hits, salt)
            ok = self.bm.append_slots(seq, n)
            assert ok, "admission check and allocation disagree"
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.running.append(seq)
            admission.running[seq.tenant] += 1
            scheduled[seq.seq_id] = n
            seq_by_id[seq.seq_id] = seq
            budget -= n
        return budget

    def _next_candidate(self, admission: _Admission, batch: ScheduledBatch) -> Sequence | None:
        """The first admissible waiting sequence of the least-served tenant that has one."""
        blocked = admission.blocked
        slots = self.adapter_slots
        waits_for_place = getattr(slots, "waits_for_place", None)
        # least service first; at equal service, the tenant with fewer sequences running
        order = self.fairness.order((t for t, q in self.waiting.items() if q), tiebreak=admission.running.__getitem__)
        for tenant in order:
            for seq in list(self.waiting[tenant]):
                if seq.seq_id in blocked or seq.status is not SequenceStatus.WAITING:
                    continue
                if seq.lora is None or seq.holds_adapter_slot:
                    return seq
                if seq.adapter_key in admission.held_back:
                    blocked.add(seq.seq_id)
                    continue
                if slots is None:
                    raise RuntimeError("a request names an adapter but the engine has no adapter cache")
                # Once another tenant's request found no place to load its adapter, a place that frees in this
                # step is not taken here: it is that tenant's at the next step, which asks first.
                load = not (admission.no_load_place - {tenant})
                try:
                    ready = slots.ready(seq.lora) if load else slots.ready(seq.lora, load=False)
                except Exception as exc:  # the adapter failed to load: its requests fail, others go on
                    # Every request waiting for it fails with this load's error: each one loading it again
                    # in turn would fail the same way and keep other adapters' loads waiting meanwhile.
                    for other in [q for tq in self.waiting.values() for q in tq if q.adapter_key == seq.adapter_key]:
                        self.finish(other, "error")
                        batch.failed.append((other, exc))
                    continue
                if not ready:
                    blocked.add(seq.seq_id)
                    if load and waits_for_place is not None and waits_for_place(seq.adapter_key):
                        admission.no_load_place.add(tenant)
                    continue
                return seq
        return None

    def _fork(self, parent: Sequence) -> list[Sequence]:
        children = parent.pending_forks
        parent.pending_forks = []
        for child in children:
            child.token_ids = list(parent.token_ids)
            child.num_prompt_tokens = parent.num_prompt_tokens
            self.bm.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            child.first_scheduled_time = parent.first_scheduled_time
            if child.lora is not None:
                # the parent's slot holds the adapter already, so this cannot fail
                slot = self.adapter_slots.try_acquire(child.lora)
                assert slot is not None, "adapter slot vanished while in use"
                child.holds_adapter_slot = True
            self.running.append(child)
        return children

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Drop the sequence's KV and put it back at the head of its tenant's queue (recompute later)."""
        self._leave_running(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.setdefault(seq.tenant, deque()).appendleft(seq)
        if seq.adapter_key is not None:
            self._waiting_per_adapter[seq.adapter_key] += 1
        batch.preempted.append(seq)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """Advance the computed counters, publish full blocks, append sampled tokens.

        sampled: seq_id -> new token, for every sequence of every sample group. Returns the sequences that
        received a token; the caller checks their stop conditions."""
        got_token = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            prefill_tokens = max(0, min(seq.num_prompt_tokens - seq.num_computed_tokens, n))
            seq.num_computed_tokens += n
            seq.num_prompt_tokens_processed = max(seq.num_prompt_tokens_processed,
                                                  min(seq.num_computed_tokens, seq.num_prompt_tokens))
            self.bm.register_full_blocks(seq, self._salt(seq))
            self.fairness.charge(seq.tenant, prefill_tokens, 0)
            for member in batch.sample_groups.get(seq.seq_id, ()):
                if member is not seq:
                    if member.status is not SequenceStatus.RUNNING:
                        continue
                    member.num_computed_tokens = seq.num_computed_tokens
                    member.num_full_blocks_hashed = seq.num_full_blocks_hashed
                    member.block_hashes = list(seq.block_hashes)
                member.token_ids.append(sampled[member.seq_id])
                self.fairness.charge(member.tenant, 0, 1)
                got_token.append(member)
        return got_token


def fit_max_tokens(scheduler: Scheduler, prompt_len: int, params: SamplingParams) -> SamplingParams:
    """`params` as the request will run: refused (InvalidRequestError) if it could never run, and with an
    unset max_tokens capped to what the KV cache holds for its n completions (see `Scheduler.check_fits`)."""
    max_tokens = scheduler.check_fits(prompt_len, params.max_tokens, params.n, ceiling=params.max_tokens_is_ceiling)
    room = scheduler.max_model_len - prompt_len
    if params.min_tokens > room:
        # a completion ends with "length" at the end of the context, whatever max_tokens says
        raise InvalidRequestError(
            f"min_tokens {params.min_tokens} cannot be reached: the model's context of {scheduler.max_model_len} "
            f"tokens leaves room for {room} new tokens after this prompt ({prompt_len} tokens)",
            param="min_tokens",
        )
    if max_tokens == params.max_tokens:
        return params
    if max_tokens < params.min_tokens:
        raise InvalidRequestError(
            f"min_tokens {params.min_tokens} cannot be reached: the KV cache holds at most {max_tokens} new "
            f"tokens for each of the {params.n} completions of this prompt ({prompt_len} tokens)",
            param="min_tokens",
        )
    return dataclasses.replace(params, max_tokens=max_tokens)
