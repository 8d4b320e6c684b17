"""Sliding-window attention: Mistral (a window in every layer) and Qwen2 (in the layers `layer_types` names)
serve their whole max_position_embeddings, prompts and generations far past the window giving transformers'
greedy tokens on every attention path: the C++ decoder stack, the module path, the plain-torch path (no
compiled kernels), chunked prefill, prefix-cache hits that start a prefill past the window, long prefills."""

from __future__ import annotations

import json
import random

import pytest
import torch
from engine_helpers import hf_greedy

from loraplex.engine.llm import LLM
from loraplex.engine.models.arch import ModelArch
from loraplex.engine.sampling_params import SamplingParams
from loraplex.kernels import linear_cpu, ops_cpu
from loraplex.testing import make_tiny_model

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CONFIGS = {
    "mistral": {"sliding_window": 8},
    # layer 0 attends over the whole context, layer 1 over a window of 12
    "qwen2": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    lengths = (3, 9, 31, 57, 290)  # inside the window, past it, and past the short-prefill kernel's 256
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


PROMPTS = _prompts()
# a prompt sharing PROMPTS[3]'s first 40 tokens: with prefix caching its prefill starts past the window
SHARED = PROMPTS[3][:40] + [11, 250, 37, 90, 5, 180, 66]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def windowed(request, tmp_path_factory):
    """(model dir, transformers' greedy tokens for each prompt of PROMPTS + [SHARED])."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **CONFIGS[arch])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model_dir, [hf_greedy(model_dir, p, MAX_TOKENS, hf.eval()) for p in [*PROMPTS, SHARED]]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("path", ["decoder-stack", "modules", "torch"])
def test_batch_of_mixed_lengths_matches_transformers(windowed, path, monkeypatch):
    model_dir, expected = windowed
    has_stack = linear_cpu.linear_address() is not None and ops_cpu.available()
    if path == "decoder-stack" and not has_stack:
        pytest.skip("the decoder stack needs the compiled CPU GEMM and fused ops")
    monkeypatch.setenv("LORAPLEX_CPU_DECODER_STACK", "0" if path == "modules" else "1")
    if path == "torch":
        monkeypatch.setattr(ops_cpu, "_load", lambda: None)  # as without a compiler: every torch fallback
    stack_rows = []
    real_stack = ops_cpu.decoder_stack
    monkeypatch.setattr(ops_cpu, "decoder_stack", lambda *a: stack_rows.append(a[0].shape[0]) or real_stack(*a))
    llm = LLM(str(model_dir), num_kv_blocks=160, block_size=4, enable_prefix_caching=False, max_loras=0)
    assert llm.engine.limits.max_model_len == 512  # the whole of max_position_embeddings, no cap at the window
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outs) == expected[: len(PROMPTS)]
    # the stack took the decode steps (the 390-token prefill is the modules'); the other paths never call it
    assert (len(stack_rows) == MAX_TOKENS - 1) == (path == "decoder-stack")


def test_chunked_prefill_and_prefix_cache_hits_match_transformers(windowed):
    model_dir, expected = windowed
    llm = LLM(str(model_dir), num_kv_blocks=200, block_size=4, max_num_batched_tokens=7, max_loras=0)
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(first) == expected[: len(PROMPTS)]
    hits = llm.engine.block_manager.prefix_hits
    again = llm.generate([{"prompt_token_ids": SHARED}, {"prompt_token_ids": PROMPTS[4]}], GREEDY, use_tqdm=False)
    assert llm.engine.block_manager.prefix_hits > hits
    assert again[0].metrics.num_cached_tokens >= 40 - 4  # whole blocks of the shared 40 tokens
    assert _tokens(again) == [expected[-1], expected[4]]


def test_the_window_changes_the_tokens(tmp_path, windowed):
    """The comparisons above are meaningful: the same weights attending over whole contexts give other tokens."""
    model_dir, expected = windowed
    arch = json.loads((model_dir / "config.json").read_text())["model_type"]
    config = {**CONFIGS[arch], "use_sliding_window": False} if arch == "qwen2" else {"sliding_window": None}
    whole = make_tiny_model(tmp_path / "whole", arch, **config)  # the same seed: the same weights
    assert ModelArch.from_hf_config(json.loads((whole / "config.json").read_text())).sliding_window is None
    llm = LLM(str(whole), num_kv_blocks=160, block_size=4, enable_prefix_caching=False, max_loras=0)
    outs = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False))
    assert outs != expected[: len(PROMPTS)]


def _arch(**cfg) -> ModelArch:
    base = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4}
    return ModelArch.from_hf_config({**base, **cfg})


def test_layer_windows_follow_transformers_config():
    assert _arch(model_type="mistral", sliding_window=16).layer_windows == (16,) * 4
    assert _arch(model_type="mistral", sliding_window=None).layer_windows == (None,) * 4
    assert _arch(model_type="llama", sliding_window=16).layer_windows == (None,) * 4
    qwen = {"model_type": "qwen2", "sliding_window": 16}
    assert _arch(**qwen).layer_windows == (None,) * 4  # without use_sliding_window nothing slides
    assert _arch(**qwen, use_sliding_window=True, max_window_layers=2).layer_windows == (None, None, 16, 16)
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    mixed = _arch(**qwen, use_sliding_window=True, layer_types=kinds)
    assert mixed.layer_windows == (16, None, 16, None) and mixed.sliding_window == 16
    # attention FLOPs: two layers over the whole 100-token context, two over their 16
    full = _arch(**qwen)
    assert full.flops_per_token(100) - mixed.flops_per_token(100) == 4 * 2 * (100 - 16) * full.q_size
    assert full.flops_per_token(10) == mixed.flops_per_token(10)


@pytest.mark.parametrize("cfg,message", [
    ({"sliding_window": -4}, "sliding_window must be"),
    ({"sliding_window": "8"}, "sliding_window must be"),
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"]}, "names 1 layers"),
])
def test_bad_window_configs_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        _arch(model_type="qwen2", **cfg)
