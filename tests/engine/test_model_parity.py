"""The engine's model matches Hugging Face transformers: greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, hf_greedy

from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["llama", "qwen2", "tied", "mistral", "qwen3", "phi3"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def test_greedy_tokens_match_transformers(model_dir, hf):
    llm = LLM(str(model_dir), num_kv_blocks=64, max_loras=0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(model_dir, ids, 24, hf)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.cpu(), b.cpu()  # the engine may run on a GPU, the reference on the CPU
    return float((a - b).abs().max() / b.abs().max())


def test_logits_match_transformers_in_prefill_and_decode(model_dir, hf):
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4, max_loras=0)
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[2])
    eng.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        ref = hf(torch.tensor([ids + [5, 6, 7]])).logits[0]
    seq = eng.requests["r"].seqs[0]
    for step, forced in enumerate([5, 6, 7]):
        batch = eng.scheduler.schedule()
        logits = eng.runner.logits_for(batch)[0]
        assert _rel_err(logits, ref[len(ids) - 1 + step]) < 1e-4
        eng.scheduler.postprocess(batch, {seq.seq_id: forced})
