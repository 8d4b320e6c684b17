"""Turns a scheduled batch into tensors, runs the model and samples.

Tokens of a step are laid out flat: single-token decodes first (one batched attention call), then each
prefill chunk. Only the rows that produce a token go through the LM head.
"""

from __future__ import annotations

import torch

from loraplex.engine.adapter_slots import AdapterSlots
from loraplex.engine.forward_context import AttentionMetadata, ForwardContext, PrefillSegment, forward_context
from loraplex.engine.models.arch import ModelArch
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.sampler import Sampler, SamplerOutput
from loraplex.engine.scheduler import ScheduledBatch
from loraplex.engine.sequence import Sequence
from loraplex.kernels.attention import decode_mask


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sampler: Sampler,
        adapter_slots: AdapterSlots | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.adapter_slots = adapter_slots
        arch = model.arch
        # One allocation for the whole cache, made once: the engine's memory does not grow per step.
        self.kv_cache = torch.zeros(
            arch.num_layers, 2, arch.num_kv_heads, num_blocks, block_size, arch.head_dim,
            dtype=dtype, device=device,
        )
        for i, attn in enumerate(model.attention_layers):
            attn.k_cache = self.kv_cache[i, 0]
            attn.v_cache = self.kv_cache[i, 1]

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        order = sorted(
            range(len(batch.seqs)), key=lambda j: 0 if batch.num_new_tokens[j] == 1 else 1
        )  # stable: decodes first, each group in scheduling order
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        token_adapters: list[str | None] = []
        for j in order:
            seq, n = batch.seqs[j], batch.num_new_tokens[j]
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(
                    PrefillSegment(row0, n, end, torch.tensor(table[: -(-end // bs)], device=self.device))
                )
            token_adapters.extend([seq.adapter_key] * n)
            for member in batch.sample_groups.get(seq.seq_id, ()):
                sample_rows.append(row0 + n - 1)
                sample_seqs.append(member)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decode_tables),
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=self.device)
            meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.long, device=self.device)
            meta.decode_max_context_len = max(decode_lens)
            meta.decode_mask = decode_mask(meta.decode_block_tables, meta.decode_context_lens, bs)
        lora = None
        if any(key is not None for key in token_adapters):
            if self.adapter_slots is None:
                raise RuntimeError("a scheduled sequence uses an adapter but the engine has no adapter cache")
            slot_of = {k: self.adapter_slots.slot_of(k) for k in set(token_adapters) if k is not None}
            lora = self.adapter_slots.build_step([-1 if k is None else slot_of[k] for k in token_adapters])
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, ForwardContext(meta, lora, sample_rows), sample_rows, sample_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        """Returns the sampling sequences (in row order) and their sampler output."""
        self.copy_blocks(batch.block_copies)
        ids, pos, ctx, sample_rows, sample_seqs = self._prepare(batch)
        with forward_context(ctx):
            hidden = self.model(ids, pos)
            if not sample_rows:
                return [], None
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        return sample_seqs, self.sampler(logits, sample_seqs)

    @torch.inference_mode()
    def logits_for(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits of every sampling row, without sampling (for tests comparing with a reference)."""
        self.copy_blocks(batch.block_copies)
        ids, pos, ctx, sample_rows, _ = self._prepare(batch)
        with forward_context(ctx):
            hidden = self.model(ids, pos)
            return self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)])
