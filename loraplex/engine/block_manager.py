"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts, copy-on-write and
prefix caching by chained block hashes.

A full block's hash chains the previous block's hash, the block's tokens and a salt (the adapter's
content hash and the tenant's salt), so a prefix computed under one adapter or for one tenant is never
reused for another. A hit is verified against the block's stored key before use. Freed blocks keep their
hash and stay findable until the free list hands them out again (lazy eviction, least recently freed
first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from loraplex.engine.sequence import Sequence


def block_hash(parent: bytes | None, tokens: tuple[int, ...], salt: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(salt)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def cache_salt(adapter_key: str | None, tenant_salt: str | None) -> bytes:
    return hashlib.sha256(f"{adapter_key or ''}\0{tenant_salt or ''}".encode()).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    key: tuple | None = None  # (parent hash, tokens, salt): what a hit is verified against


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        # Copy-on-write copies (src, dst) the runner must perform before the next forward pass.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self._free if self.blocks[b].hash is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, salt: bytes) -> list[int]:
        """Cached blocks holding the leading full blocks of the sequence's tokens. At least one token is
        always left to compute, because the step must produce logits for the next token."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        hits: list[int] = []
        parent = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens, salt)
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].key != (parent, tokens, salt):
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a sequence whose prefix hit `hits` can hold `num_tokens` tokens in total."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        new = max(0, self.blocks_needed(num_tokens) - len(hits))
        return revived + new <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: list[int], salt: bytes) -> None:
        """Give a waiting sequence (no blocks yet) the cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        seq.block_hashes = []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += len(hits) * self.block_size
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.num_full_blocks_hashed = len(hits)

    def register_full_blocks(self, seq: Sequence, salt: bytes) -> None:
        """Publish the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        while seq.num_full_blocks_hashed < full:
            i = seq.num_full_blocks_hashed
            parent = seq.block_hashes[i - 1] if i else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens, salt)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.key = h, (parent, tokens, salt)
                self._cached.setdefault(h, block.block_id)
            seq.block_hashes.append(h)
            seq.num_full_blocks_hashed += 1

    # -- allocation -------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.hash = block.key = None
        block.ref_count = 1
        return block_id

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks

    def _blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        new = max(0, self.blocks_needed(total) - len(seq.block_table))
        return new + (1 if self._needs_copy(seq) else 0)

    def _needs_copy(self, seq: Sequence) -> bool:
        """The block the next token is written into is shared with another sequence."""
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(seq.block_table) and self.blocks[seq.block_table[idx]].ref_count > 1

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the sequence's next `num_new_tokens` tokens. All or nothing."""
        if self._blocks_to_append(seq, num_new_tokens) > self.num_free_blocks:
            return False
        if self._needs_copy(seq):
            idx = seq.num_computed_tokens // self.block_size
            src = seq.block_table[idx]
            dst = self._take_free_block()
            self.blocks[src].ref_count -= 1
            seq.block_table[idx] = dst
            self.pending_copies.append((src, dst))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_needed(total):
            seq.block_table.append(self._take_free_block())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; the first write to a shared block copies it."""
        assert not child.block_table, "child already holds blocks"
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_full_blocks_hashed = parent.num_full_blocks_hashed
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        # Tail blocks go to the free list first, so they are evicted before the prefix they extend.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_full_blocks_hashed = 0
        seq.num_computed_tokens = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_consistency(self, live: list[Sequence]) -> None:
        """Every block is either free or referenced exactly as often as live sequences hold it."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}")
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise AssertionError(f"block {block.block_id}: free list disagrees with ref_count")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].hash != h:
                raise AssertionError(f"cache entry for block {block_id} is stale")
