"""The same request gives the same tokens however it is scheduled."""

from __future__ import annotations

import pytest
from engine_helpers import mixed_prompts

from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Each prompt generated alone, without prefix caching."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, enable_prefix_caching=False)
    prompts = mixed_prompts(llm.tokenizer, 32)
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return prompts, alone


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leaks(llm):
    bm = llm.engine.block_manager
    assert not llm.engine.requests
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_consistency([])


def test_batch_of_32_mixed_lengths_matches_alone(tiny_llama_dir, reference):
    prompts, alone = reference
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert _tokens(outs) == alone
    _assert_no_leaks(llm)


def test_prefix_cache_hit_gives_same_tokens(tiny_llama_dir, reference):
    prompts, alone = reference
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    hits_before = llm.engine.block_manager.prefix_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.block_manager.prefix_hits > hits_before
    assert any(o.metrics.num_cached_tokens > 0 for o in again)
    assert _tokens(first) == alone
    assert _tokens(again) == alone
    _assert_no_leaks(llm)


def test_preemption_and_recompute_give_same_tokens(tiny_llama_dir, reference):
    prompts, alone = reference
    # 24 blocks of 4 tokens cannot hold 32 growing sequences at once: the newest get preempted.
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=24, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == alone
    _assert_no_leaks(llm)


def test_chunked_prefill_gives_same_tokens(tiny_llama_dir, reference):
    prompts, alone = reference
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4, max_num_batched_tokens=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], GREEDY, use_tqdm=False)
    assert _tokens(outs) == alone[:8]
    _assert_no_leaks(llm)


def test_n_completions_share_prompt_blocks_and_match_alone(tiny_llama_dir, reference):
    prompts, alone = reference
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    prompt = max(prompts, key=len)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=3)
    eng = llm.engine
    eng.add_request("r", prompt, params)
    eng.step()  # prefill, then the siblings fork off the parent's blocks
    seqs = eng.requests["r"].seqs
    assert all(s.block_table[:-1] == seqs[0].block_table[:-1] for s in seqs)
    shared = seqs[0].block_table[0]
    assert eng.block_manager.blocks[shared].ref_count == 3
    while eng.has_unfinished_requests():
        outs = eng.step()
    out = outs[-1]
    expected = alone[prompts.index(prompt)]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    _assert_no_leaks(llm)
