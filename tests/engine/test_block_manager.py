"""Block accounting: free list, reference counts, prefix caching with salts, copy-on-write."""

from __future__ import annotations

import random

from loraplex.engine.block_manager import BlockManager, cache_salt
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence

SALT = cache_salt(None, "tenant-a")


def _seq(tokens):
    return Sequence("r", list(tokens), SamplingParams())


def _admit(bm, seq, salt=SALT):
    hits = bm.match_prefix(seq, salt)
    bm.admit(seq, hits, salt)
    assert bm.append_slots(seq, len(seq.token_ids) - seq.num_computed_tokens)
    return hits


def _compute(bm, seq, salt=SALT):
    seq.num_computed_tokens = len(seq.token_ids)
    bm.register_full_blocks(seq, salt)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    seq = _seq(range(10))
    _admit(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8
    bm.check_consistency([])


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = _seq(range(12))
    _admit(bm, a)
    _compute(bm, a)
    b = _seq(range(12))
    hits = _admit(bm, b)
    assert hits == a.block_table[:2]  # the third block would leave nothing to compute
    assert b.num_computed_tokens == 8
    assert bm.blocks[hits[0]].ref_count == 2
    bm.check_consistency([a, b])


def test_prefix_survives_free_until_its_block_is_reused():
    bm = BlockManager(4, 4)
    a = _seq(range(9))
    _admit(bm, a)
    _compute(bm, a)
    bm.free(a)
    assert bm.num_cached_free_blocks == 2
    b = _seq(range(9))
    assert len(_admit(bm, b)) == 2
    bm.free(b)
    # Fill the whole cache with other content: the old prefix is evicted lazily.
    c = _seq(range(100, 116))
    _admit(bm, c)
    _compute(bm, c)
    bm.free(c)
    assert bm.match_prefix(_seq(range(9)), SALT) == []
    bm.check_consistency([])


def test_salt_separates_adapters_and_tenants():
    bm = BlockManager(16, 4)
    a = _seq(range(9))
    _admit(bm, a)
    _compute(bm, a)
    for salt in (cache_salt("adapter-1", "tenant-a"), cache_salt(None, "tenant-b")):
        assert bm.match_prefix(_seq(range(9)), salt) == []
    assert len(bm.match_prefix(_seq(range(9)), SALT)) == 2


def test_hit_is_verified_against_the_blocks_tokens():
    bm = BlockManager(16, 4)
    a = _seq(range(9))
    _admit(bm, a)
    _compute(bm, a)
    block = bm.blocks[a.block_table[0]]
    parent, tokens, salt = block.key
    block.key = (parent, (99, 99, 99, 99), salt)  # as if another prefix had collided into this hash
    assert bm.match_prefix(_seq(range(9)), SALT) == []


def test_copy_on_write_never_writes_into_a_shared_block():
    bm = BlockManager(8, 4)
    parent = _seq(range(6))
    _admit(bm, parent)
    _compute(bm, parent)
    child = _seq(range(6))
    bm.fork(parent, child)
    shared_last = parent.block_table[-1]
    assert bm.blocks[shared_last].ref_count == 2
    parent.token_ids.append(7)
    assert bm.append_slots(parent, 1)
    assert parent.block_table[-1] != shared_last  # the writer got its own copy
    assert bm.take_pending_copies() == [(shared_last, parent.block_table[-1])]
    child.token_ids.append(8)
    assert bm.append_slots(child, 1)
    assert child.block_table[-1] == shared_last  # now the only holder: writes in place
    assert bm.take_pending_copies() == []
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    bm.check_consistency([parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_append_is_all_or_nothing_when_out_of_blocks():
    bm = BlockManager(2, 4)
    seq = _seq(range(8))
    _admit(bm, seq)
    _compute(bm, seq)
    before = list(seq.block_table)
    assert not bm.append_slots(seq, 1)
    assert seq.block_table == before
    bm.check_consistency([seq])


def test_random_mix_of_operations_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(32, 4)
    live: list[Sequence] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            seq = _seq([rng.randrange(4) for _ in range(rng.randint(1, 20))])
            hits = bm.match_prefix(seq, SALT)
            if bm.can_admit(hits, len(seq.token_ids)):
                _admit(bm, seq)
                _compute(bm, seq)
                live.append(seq)
        elif op < 0.6 and live:
            seq = rng.choice(live)
            seq.token_ids.append(rng.randrange(4))
            if bm.append_slots(seq, 1):
                _compute(bm, seq)
            else:
                seq.token_ids.pop()
        elif op < 0.7 and live:
            parent = rng.choice(live)
            child = _seq(parent.token_ids)
            bm.fork(parent, child)
            live.append(child)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.take_pending_copies()
        bm.check_consistency(live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == 32
    bm.check_consistency([])
