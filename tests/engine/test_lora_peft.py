"""loraplex with many PEFT adapters mixed in one batch gives transformers+PEFT's greedy tokens."""

from __future__ import annotations

import pytest
from engine_helpers import peft_greedy

from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams
from loraplex.testing import make_peft_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, target modules, rslora, alpha): ranks 4..64, different module subsets, with and without rslora
ADAPTERS = [
    (4, ("q_proj", "v_proj"), False, None),
    (8, ALL, False, None),
    (16, ("q_proj", "k_proj", "v_proj", "o_proj"), True, None),
    (32, ("gate_proj", "up_proj", "down_proj"), False, None),
    (64, ALL, True, None),
    (8, ("o_proj", "down_proj"), False, 3.0),
    (16, ("k_proj", "v_proj", "up_proj"), True, 8.0),
    (4, ALL, True, 5.0),
]
PROMPTS = [[5, 17, 33, 80, 101, 7], [9, 250, 31], [44, 44, 12, 190, 66, 3, 71, 140, 9, 2, 11], [300, 1]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_adapters")
    return [
        make_peft_adapter(
            tiny_llama_dir, root / f"a{i}", r=r, target_modules=mods, use_rslora=rs, lora_alpha=alpha, seed=i
        )
        for i, (r, mods, rs, alpha) in enumerate(ADAPTERS)
    ]


def _generate(llm, requests):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    outs = llm.generate(prompts, params, adapter=[a for _, a in requests], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_mixed_batch_matches_peft(tiny_llama_dir, adapter_dirs):
    # Every adapter with two prompts, interleaved with base-model requests, all in one batch.
    requests = []
    for i, d in enumerate(adapter_dirs):
        requests.append((PROMPTS[i % len(PROMPTS)], d))
        requests.append((PROMPTS[(i + 1) % len(PROMPTS)], None if i % 3 == 0 else d))
    llm = LLM(str(tiny_llama_dir), max_loras=8, num_kv_blocks=256, max_num_seqs=64)
    got = _generate(llm, [(p, str(a) if a else None) for p, a in requests])
    for adapter in [None, *adapter_dirs]:
        idx = [i for i, (_, a) in enumerate(requests) if a == adapter]
        expected = peft_greedy(tiny_llama_dir, adapter, [requests[i][0] for i in idx], MAX_TOKENS)
        assert [got[i] for i in idx] == expected, f"adapter {adapter}"
    # the adapters change the output, so equality above is not the base model's tokens
    base = peft_greedy(tiny_llama_dir, None, [requests[0][0]], MAX_TOKENS)[0]
    assert got[0] != base


def test_eviction_and_reload_give_the_same_tokens(tiny_llama_dir, adapter_dirs):
    # 8 adapters through 3 slots: requests wait for slots, adapters get evicted and loaded again.
    requests = [(PROMPTS[i % len(PROMPTS)], str(adapter_dirs[i % 8])) for i in range(16)]
    wide = LLM(str(tiny_llama_dir), max_loras=8, num_kv_blocks=256)
    narrow = LLM(str(tiny_llama_dir), max_loras=3, max_cpu_loras=3, num_kv_blocks=256)
    expected = _generate(wide, requests)
    assert _generate(narrow, requests) == expected
    cache = narrow.engine.adapter_slots
    assert cache.evictions_total > 0 and cache.loads_total > 8  # evicted from host memory and reloaded
    assert _generate(narrow, list(reversed(requests))) == list(reversed(expected))


def test_qwen2_with_qkv_bias_matches_peft(tiny_qwen2_dir, tmp_path):
    a = make_peft_adapter(tiny_qwen2_dir, tmp_path / "q", r=8, target_modules=ALL, seed=11)
    llm = LLM(str(tiny_qwen2_dir), max_loras=2, num_kv_blocks=128)
    got = _generate(llm, [(PROMPTS[0], str(a)), (PROMPTS[1], None), (PROMPTS[2], str(a))])
    assert [got[0], got[2]] == peft_greedy(tiny_qwen2_dir, a, [PROMPTS[0], PROMPTS[2]], MAX_TOKENS)
    assert [got[1]] == peft_greedy(tiny_qwen2_dir, None, [PROMPTS[1]], MAX_TOKENS)


# Qwen3 targets the separate projections (q/k norms sit after q_proj and k_proj's LoRA); Phi-3 the fused ones,
# whose one LoRA pair covers q, k and v (gate and up) rows alike.
FAMILY_ADAPTERS = {
    "qwen3": [(4, ("q_proj", "v_proj"), False), (16, ALL, True), (8, ("k_proj", "o_proj", "gate_proj"), False)],
    "phi3": [(4, ("qkv_proj",), False), (16, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), True),
             (8, ("gate_up_proj", "down_proj"), False)],
}


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_family_mixed_batch_matches_peft(arch, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    dirs = [make_peft_adapter(model_dir, tmp_path / f"a{i}", r=r, target_modules=mods, use_rslora=rs, seed=20 + i)
            for i, (r, mods, rs) in enumerate(FAMILY_ADAPTERS[arch])]
    requests = [(PROMPTS[i % len(PROMPTS)], a) for i, a in enumerate([dirs[0], None, dirs[1], dirs[2], None, dirs[0],
                                                                       dirs[2], dirs[1]])]
    llm = LLM(str(model_dir), max_loras=3, num_kv_blocks=128)
    got = _generate(llm, [(p, str(a) if a else None) for p, a in requests])
    for adapter in [None, *dirs]:
        idx = [i for i, (_, a) in enumerate(requests) if a == adapter]
        expected = peft_greedy(model_dir, adapter, [requests[i][0] for i in idx], MAX_TOKENS)
        assert [got[i] for i in idx] == expected, f"adapter {adapter}"
        if adapter is not None:  # each adapter changes its rows: equality above is not the base model's tokens
            assert expected != peft_greedy(model_dir, None, [requests[i][0] for i in idx], MAX_TOKENS)


def test_phi3_refuses_adapters_for_separate_projections(tiny_phi3_dir, tiny_llama_dir, tmp_path):
    # An adapter trained on a Llama-style model names q_proj ...: Phi-3 has no such module
    from loraplex.engine.errors import AdapterLoadError

    other = make_peft_adapter(tiny_llama_dir, tmp_path / "llama", r=4, target_modules=("q_proj", "v_proj"))
    llm = LLM(str(tiny_phi3_dir), max_loras=1, num_kv_blocks=32)
    with pytest.raises(AdapterLoadError, match="is a projection of Phi3ForCausalLM; known modules: qkv_proj"):
        _generate(llm, [(PROMPTS[0], str(other))])
