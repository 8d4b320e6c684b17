"""LoRA on the LM head and the input embedding: loraplex's greedy tokens equal transformers+PEFT's, with such
adapters mixed in one batch with projection-only adapters and base-model requests, on an untied and a tied
(SmolLM2-like) model."""

from __future__ import annotations

import pytest
from engine_helpers import peft_greedy

from loraplex.adapters import TOP_LEVEL
from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams
from loraplex.testing import make_peft_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, target modules, rslora): the head alone, the embedding alone, both with every projection, and a
# projection-only adapter beside them
ADAPTERS = [
    (8, ("lm_head",), False),
    (4, ("embed_tokens",), True),
    (16, (*ALL, "embed_tokens", "lm_head"), False),
    (8, ("q_proj", "v_proj"), False),
]
PROMPTS = [[5, 17, 33, 80, 101, 7], [9, 250, 31], [44, 44, 12, 190, 66, 3, 71, 140, 9, 2, 11], [300, 1]]
MAX_TOKENS = 10


def _adapters(base_dir, root):
    return [make_peft_adapter(base_dir, root / f"a{i}", r=r, target_modules=mods, use_rslora=rs, seed=20 + i)
            for i, (r, mods, rs) in enumerate(ADAPTERS)]


def _generate(llm, requests):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params,
                        adapter=[None if a is None else str(a) for _, a in requests], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("base_fixture", ["tiny_llama_dir", "tiny_tied_dir"])
def test_mixed_batch_matches_peft(base_fixture, request, tmp_path):
    base_dir = request.getfixturevalue(base_fixture)
    adapters = _adapters(base_dir, tmp_path)
    requests = []
    for i, a in enumerate(adapters):
        requests.append((PROMPTS[i % len(PROMPTS)], a))
        requests.append((PROMPTS[(i + 1) % len(PROMPTS)], None if i % 2 == 0 else a))
    llm = LLM(str(base_dir), max_loras=4, num_kv_blocks=256, max_num_seqs=32)
    got = _generate(llm, requests)
    base_tokens = None
    for adapter in [None, *adapters]:
        idx = [i for i, (_, a) in enumerate(requests) if a == adapter]
        expected = peft_greedy(base_dir, adapter, [requests[i][0] for i in idx], MAX_TOKENS)
        assert [got[i] for i in idx] == expected, f"adapter {adapter}"
        if adapter is None:
            base_tokens = dict(zip((tuple(requests[i][0]) for i in idx), expected, strict=True))
    # each adapter with LoRA on the head or embedding changes the tokens, so the equality above means something
    for i, a in enumerate(adapters[:3]):
        prompt = tuple(requests[2 * i][0])
        reference = base_tokens.get(prompt) or peft_greedy(base_dir, None, [list(prompt)], MAX_TOKENS)[0]
        assert got[2 * i] != reference, f"adapter {a} left the tokens unchanged"
    cache = llm.engine.adapter_slots
    assert (TOP_LEVEL, "lm_head") in cache.weights and (TOP_LEVEL, "embed_tokens") in cache.weights


def test_slots_for_the_head_and_embedding_only_once_an_adapter_needs_them(tiny_llama_dir, tmp_path):
    """An engine serving only projection adapters holds no LM-head or embedding slots; eviction of a head
    adapter and reuse of its slot by a projection-only adapter leaves the head untouched for that slot."""
    plain = make_peft_adapter(tiny_llama_dir, tmp_path / "plain", r=4, target_modules=("q_proj",), seed=3)
    head = make_peft_adapter(tiny_llama_dir, tmp_path / "head", r=4, target_modules=("lm_head",), seed=4)
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=1, num_kv_blocks=128)
    cache = llm.engine.adapter_slots
    _generate(llm, [(PROMPTS[0], plain)])
    assert (TOP_LEVEL, "lm_head") not in cache.weights
    with_head = _generate(llm, [(PROMPTS[0], head)])
    assert (TOP_LEVEL, "lm_head") in cache.weights
    # the one slot now goes back to the projection-only adapter: its tokens are PEFT's, no head delta left over
    assert _generate(llm, [(PROMPTS[0], plain)]) == peft_greedy(tiny_llama_dir, plain, [PROMPTS[0]], MAX_TOKENS)
    assert with_head == peft_greedy(tiny_llama_dir, head, [PROMPTS[0]], MAX_TOKENS)


def test_an_adapter_with_ensure_weight_tying_on_a_tied_model_matches_peft(tiny_tied_dir, tmp_path):
    """PEFT's ensure_weight_tying: the head's LoRA is the embedding's, transposed; served so, beside a base
    request and an adapter without the option."""
    tied = make_peft_adapter(tiny_tied_dir, tmp_path / "tied", r=8, target_modules=("lm_head", "q_proj", "v_proj"),
                             seed=31, ensure_weight_tying=True)
    plain = make_peft_adapter(tiny_tied_dir, tmp_path / "plain", r=4, target_modules=("lm_head",), seed=32)
    requests = [(PROMPTS[0], tied), (PROMPTS[1], None), (PROMPTS[2], plain), (PROMPTS[1], tied)]
    got = _generate(LLM(str(tiny_tied_dir), max_loras=2, num_kv_blocks=128), requests)
    for adapter in (tied, None, plain):
        idx = [i for i, (_, a) in enumerate(requests) if a == adapter]
        assert [got[i] for i in idx] == peft_greedy(tiny_tied_dir, adapter, [requests[i][0] for i in idx],
                                                    MAX_TOKENS), f"adapter {adapter}"
    assert got[3] != got[1]
