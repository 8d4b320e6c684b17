"""The adapter cache's LM-head and embedding LoRA: a step adds each token's (each sampled row's) delta."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters import TOP_LEVEL
from loraplex.engine.errors import AdapterLoadError
from loraplex.engine.lora_layers import LoraProjection, top_projections
from loraplex.engine.lora_manager import LoraManager
from loraplex.engine.lora_request import LoRARequest

VOCAB, HIDDEN = 40, 16
PROJECTIONS = [LoraProjection(0, ("o_proj",), HIDDEN, (HIDDEN,)), *top_projections(VOCAB, HIDDEN)]


def _pair(gen, rank, n_in, n_out):
    return torch.randn(rank, n_in, generator=gen), torch.randn(n_out, rank, generator=gen)


def _adapter(seed, rank, modules):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"o_proj": (0, HIDDEN, HIDDEN), "embed_tokens": (TOP_LEVEL, VOCAB, HIDDEN),
              "lm_head": (TOP_LEVEL, HIDDEN, VOCAB)}
    return {(shapes[m][0], m): _pair(gen, rank, *shapes[m][1:]) for m in modules}


def _manager(adapters, dtype=torch.float32):
    m = LoraManager(PROJECTIONS, lambda lora: adapters[lora.key], max_loras=3, max_cpu_loras=3, max_rank=8,
                    dtype=dtype)
    slots = {}
    for name in adapters:
        lora = LoRARequest(name=name, content_hash=name, path=name)
        m.request_load(lora).result(5)
        slots[name] = m.try_acquire(lora)
    return m, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_and_head_deltas_per_token(dtype):
    adapters = {"both": _adapter(1, 4, ("embed_tokens", "lm_head")), "head": _adapter(2, 8, ("lm_head",)),
                "plain": _adapter(3, 2, ("o_proj",))}
    m, slots = _manager(adapters, dtype)
    assert (TOP_LEVEL, "lm_head") in m.weights and (TOP_LEVEL, "embed_tokens") in m.weights
    # tokens of the adapters interleaved with base-model tokens: the grouping is not contiguous
    names = ["head", None, "both", "plain", "both", None, "head", "both"]
    token_slots = [-1 if n is None else slots[n] for n in names]
    step = m.build_step(token_slots)
    ids = torch.tensor([3, 7, 39, 0, 3, 12, 25, 7])
    x = torch.randn(len(ids), HIDDEN)
    got = step.apply_embedding(ids, x.clone())
    expected = x.clone()
    for t, name in enumerate(names):
        pair = adapters.get(name, {}).get((TOP_LEVEL, "embed_tokens"))
        if pair is not None:
            a, b = (w.to(dtype).float() for w in pair)
            expected[t] += b @ a[:, ids[t]]
    torch.testing.assert_close(got, expected, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-4)
    assert not torch.equal(got, x)

    rows = [7, 1, 0, 3, 2]  # the sampled rows, in logits order
    hidden = torch.randn(len(rows), HIDDEN)
    logits = torch.randn(len(rows), VOCAB)
    got = step.apply_logits(rows, hidden, logits.clone())
    expected = logits.clone()
    for i, r in enumerate(rows):
        pair = adapters.get(names[r], {}).get((TOP_LEVEL, "lm_head"))
        if pair is not None:
            a, b = (w.to(dtype).float() for w in pair)
            expected[i] += b @ (a @ hidden[i])
    torch.testing.assert_close(got, expected, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-3)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])  # base row, projection-only adapter


def test_adapters_without_them_make_no_head_or_embedding_slots():
    m, slots = _manager({"plain": _adapter(3, 2, ("o_proj",))})
    assert set(m.weights) == {(0, "o_proj")}
    step = m.build_step([slots["plain"]])
    x, logits = torch.randn(1, HIDDEN), torch.randn(1, VOCAB)
    assert torch.equal(step.apply_embedding(torch.tensor([5]), x.clone()), x)
    assert torch.equal(step.apply_logits([0], x, logits.clone()), logits)


def test_a_head_of_another_vocabulary_is_refused():
    gen = torch.Generator().manual_seed(0)
    bad = {(TOP_LEVEL, "lm_head"): _pair(gen, 4, HIDDEN, VOCAB + 1)}
    m = LoraManager(PROJECTIONS, lambda lora: bad, max_loras=1, max_cpu_loras=1, max_rank=8)
    lora = LoRARequest(name="bad", content_hash="bad", path="bad")
    with pytest.raises(AdapterLoadError, match="lm_head"):
        m.request_load(lora).result(5)
