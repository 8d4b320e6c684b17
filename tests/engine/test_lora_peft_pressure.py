"""Awkward shapes and adapter configs, under every kind of scheduling pressure at once, give transformers+PEFT's
greedy tokens: GQA/MQA, head_dim apart from hidden / heads, sizes no kernel vector width divides; ranks 1 to 33,
one-module adapters, rank/alpha patterns, a layer subset, one adapter under two names, base requests; fewer
slots than adapters (evictions mid-run), a KV cache small enough to preempt, chunked prefill and prefix hits
on a prompt shared across adapters."""

from __future__ import annotations

import shutil

import pytest
import torch

from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams
from loraplex.testing import make_peft_adapter, make_tiny_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = [
    dict(r=1, target_modules=("o_proj",)),
    dict(r=7, target_modules=("down_proj",), lora_alpha=21.5),
    dict(r=33, target_modules=ALL, use_rslora=True, rank_pattern={"k_proj": 2, "gate_proj": 5},
         alpha_pattern={"down_proj": 17.0}),
    dict(r=4, target_modules=("q_proj", "v_proj"), layers_to_transform=[1]),
]
SHARED = [11, 250, 31, 44, 12, 190, 66, 3, 71, 140, 9, 2, 27]
MAX_TOKENS = 6


def _greedy(model_dir, adapter_dir, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch,shape", [
    ("mistral", dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=1, intermediate_size=130,
                     num_hidden_layers=3)),
    ("qwen2", dict(hidden_size=48, num_attention_heads=2, num_key_value_heads=2, head_dim=40, intermediate_size=40,
                   num_hidden_layers=3, tie_word_embeddings=True)),
], ids=["mistral-mqa-odd-sizes", "qwen2-tied-wide-heads"])
def test_awkward_models_and_adapters_under_pressure_match_peft(tmp_path, arch, shape):
    model_dir = make_tiny_model(tmp_path / "m", arch, seed=5, **shape)
    dirs = [make_peft_adapter(model_dir, tmp_path / f"a{i}", seed=40 + i, init_scale=0.3, **kw)
            for i, kw in enumerate(ADAPTERS)]
    twin = shutil.copytree(dirs[2], tmp_path / "twin")  # the same weights under another name
    names = [*dirs, twin, None]
    requests = [(SHARED + [5 + i] * (i % 3), names[i % len(names)]) for i in range(12)]
    requests += [([300], dirs[0]), ([300], None), (SHARED[:5], dirs[3])]
    llm = LLM(str(model_dir), max_loras=2, max_cpu_loras=2, num_kv_blocks=16, block_size=4,
              max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params,
                        adapter=[None if a is None else str(a) for _, a in requests], use_tqdm=False)
    expected = {}
    for (prompt, adapter), out in zip(requests, outs, strict=True):
        key = (tuple(prompt), adapter)
        if key not in expected:
            expected[key] = _greedy(model_dir, adapter, prompt)
        assert out.outputs[0].token_ids == expected[key], (prompt, adapter)
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.adapter_slots.evictions_total > 0
    assert eng.block_manager.prefix_hits > 0
    # each adapter changes the tokens of some prompt: equality above is not the base model's tokens
    for adapter in names[:-1]:
        changed = [p for p, a in expected if a == adapter and expected[(p, adapter)] != _greedy(model_dir, None, p)]
        assert changed, adapter
