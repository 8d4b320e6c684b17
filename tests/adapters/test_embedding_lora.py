"""LoRA on the LM head and on the input embedding: canonical weights, validation and refusals."""

from __future__ import annotations

import pytest
import torch
from adapter_helpers import AdapterCopy, peft_deltas, refused

from loraplex.adapters import (
    MODULES,
    TOP_LEVEL,
    AdapterLimits,
    AdapterValidationError,
    BaseModelSpec,
    CanonicalAdapter,
    ErrorCode,
    load_adapter,
)
from loraplex.testing import make_peft_adapter

EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_B = "base_model.model.model.embed_tokens.lora_embedding_B"
HEAD_A = "base_model.model.lm_head.lora_A.weight"
HEAD_B = "base_model.model.lm_head.lora_B.weight"


@pytest.fixture(scope="module")
def head_adapter_dir(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("head"), r=4,
                             target_modules=("q_proj", "embed_tokens", "lm_head"), seed=5)


@pytest.fixture
def head_copy(head_adapter_dir, tmp_path) -> AdapterCopy:
    return AdapterCopy(head_adapter_dir, tmp_path / "adapter")


@pytest.mark.parametrize(("base_fixture", "kwargs"), [
    pytest.param("tiny_llama_dir", dict(r=4, target_modules=("lm_head",)), id="untied-head"),
    pytest.param("tiny_llama_dir", dict(r=8, target_modules=("embed_tokens",), use_rslora=True), id="untied-embed"),
    pytest.param("tiny_tied_dir", dict(r=8, target_modules=[*MODULES, "embed_tokens", "lm_head"],
                                       rank_pattern={"lm_head": 2}, alpha_pattern={"embed_tokens": 5}),
                 id="tied-all-patterns"),
])
def test_canonical_delta_equals_peft_delta(base_fixture, kwargs, request, tmp_path):
    base_dir = request.getfixturevalue(base_fixture)
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "lora", seed=3, **kwargs)
    spec = BaseModelSpec.from_model_dir(base_dir)
    adapter = load_adapter(adapter_dir, spec)
    expected = peft_deltas(base_dir, adapter_dir)
    assert set(adapter.weights) == set(expected)
    for key, delta in expected.items():
        assert delta.abs().max() > 1e-3
        torch.testing.assert_close(adapter.weights[key].delta(), delta, rtol=1e-5, atol=1e-6)
    top = adapter.layer(TOP_LEVEL)
    if "lm_head" in top:
        assert top["lm_head"].a.shape[1] == spec.hidden_size and top["lm_head"].b.shape[0] == spec.vocab_size
    if "embed_tokens" in top:
        assert top["embed_tokens"].a.shape[1] == spec.vocab_size and top["embed_tokens"].b.shape[0] == spec.hidden_size
    assert TOP_LEVEL not in adapter.layers


def test_store_round_trip_and_content_hash(head_copy, llama_spec):
    adapter = load_adapter(head_copy.path, llama_spec)
    assert adapter.target_modules == ("q_proj", "embed_tokens", "lm_head")
    tensors, meta = adapter.to_tensors()
    assert {"lm_head.lora_a", "lm_head.lora_b", "embed_tokens.lora_a", "embed_tokens.lora_b"} <= set(tensors)
    back = CanonicalAdapter.from_tensors(tensors, meta, verify=True)
    assert back == adapter and set(back.weights) == set(adapter.weights)
    back.check_compatible(llama_spec)
    # the hash covers the embedding's and the head's weights
    for key in (EMBED_A, HEAD_B):
        tensors = head_copy.tensors()
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] += 0.25
        head_copy.save_tensors(tensors)
        assert load_adapter(head_copy.path, llama_spec).content_hash != adapter.content_hash


def test_check_compatible_refuses_another_vocabulary(head_copy, llama_spec):
    adapter = load_adapter(head_copy.path, llama_spec)
    other = BaseModelSpec.from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                       "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                       "num_hidden_layers": 2, "vocab_size": 500})
    with pytest.raises(AdapterValidationError, match="embed_tokens") as info:
        adapter.check_compatible(other)
    assert info.value.code == ErrorCode.BASE_MODEL_MISMATCH


@pytest.mark.parametrize(("key", "shape", "words"), [
    (EMBED_A, (4, 300), ["lora_embedding_A", "vocabulary of 384 tokens", "[r, 384]"]),
    (EMBED_B, (32, 4), ["lora_embedding_B", "[64, r]"]),
    (HEAD_A, (4, 32), ["lm_head", "64 input features"]),
    (HEAD_B, (300, 4), ["lm_head", "vocabulary of 384 tokens", "[384, r]"]),
    ("base_model.model.lm_head.base_layer.weight", (400, 64), ["resized vocabulary", "[384, 64]"]),
    ("base_model.model.model.embed_tokens.base_layer.weight", (384, 32), ["resize_token_embeddings"]),
])
def test_bad_shapes_are_refused(head_copy, llama_spec, key, shape, words):
    tensors = head_copy.tensors()
    tensors[key] = torch.zeros(shape)
    head_copy.save_tensors(tensors)
    refused(head_copy.path, llama_spec, ErrorCode.SHAPE_MISMATCH, key, *words)


def test_rank_mismatch_between_embedding_a_and_b(head_copy, llama_spec):
    tensors = head_copy.tensors()
    tensors[EMBED_B] = torch.zeros(64, 3)
    head_copy.save_tensors(tensors)
    refused(head_copy.path, llama_spec, ErrorCode.RANK_MISMATCH, EMBED_B)


def test_linear_lora_names_on_the_embedding_are_refused(head_copy, llama_spec):
    tensors = head_copy.tensors()
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = tensors.pop(EMBED_A)
    head_copy.save_tensors(tensors)
    refused(head_copy.path, llama_spec, ErrorCode.UNKNOWN_TENSOR, "lora_embedding_A / lora_embedding_B")


def test_missing_head_weights(head_copy, llama_spec):
    tensors = head_copy.tensors()
    del tensors[HEAD_B]
    head_copy.save_tensors(tensors)
    refused(head_copy.path, llama_spec, ErrorCode.MISSING_TENSOR, HEAD_B)


def test_base_layer_copies_are_not_served(head_copy, llama_spec):
    """PEFT saves the embedding's and head's own weights beside their LoRA; without them the adapter is the
    same version."""
    with_copies = load_adapter(head_copy.path, llama_spec)
    tensors = head_copy.tensors()
    assert any(k.endswith("base_layer.weight") for k in tensors)
    head_copy.save_tensors({k: v for k, v in tensors.items() if not k.endswith("base_layer.weight")})
    assert load_adapter(head_copy.path, llama_spec).content_hash == with_copies.content_hash


def test_rank_limit_applies_to_the_head(head_copy, llama_spec):
    head_copy.update_config(rank_pattern={"lm_head": 16})
    refused(head_copy.path, llama_spec, ErrorCode.RANK_TOO_LARGE, "lm_head", limits=AdapterLimits(max_rank=8))


def test_all_linear_leaves_the_head_out(tiny_llama_dir, tmp_path, llama_spec):
    adapter_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "all", r=2, target_modules="all-linear")
    assert TOP_LEVEL not in {layer for layer, _ in load_adapter(adapter_dir, llama_spec).weights}


def test_a_base_model_without_vocab_size_refuses_them(head_copy):
    spec = BaseModelSpec.from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                      "num_hidden_layers": 2})
    refused(head_copy.path, spec, ErrorCode.EMBEDDING_LORA_UNSUPPORTED, "vocab_size")


@pytest.mark.parametrize(("base_fixture", "target_modules"), [
    pytest.param("tiny_tied_dir", ["lm_head", "q_proj"], id="tied-head"),
    pytest.param("tiny_tied_dir", ["embed_tokens", "lm_head", "v_proj"], id="tied-both"),
    pytest.param("tiny_tied_dir", ["embed_tokens", "q_proj"], id="tied-embed"),
    pytest.param("tiny_tied_dir", r".*\.q_proj|lm_head", id="tied-pattern"),
    pytest.param("tiny_llama_dir", ["embed_tokens", "lm_head", "q_proj"], id="untied"),  # nothing to tie
])
def test_ensure_weight_tying_ties_the_head_to_the_embedding_as_peft_does(base_fixture, target_modules, request,
                                                                          tmp_path):
    """With PEFT's ensure_weight_tying on a tied model (SmolLM2), LoRA on the embedding or the head becomes LoRA
    on the embedding with the head's LoRA tied to it: the saved config lists only the embedding, and the file
    holds the head's pair (a copy) and both base weights. Served, the head gets the embedding's update."""
    base_dir = request.getfixturevalue(base_fixture)
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "lora", r=4, target_modules=target_modules, seed=4,
                                    ensure_weight_tying=True)
    spec = BaseModelSpec.from_model_dir(base_dir)
    adapter = load_adapter(adapter_dir, spec)
    expected = peft_deltas(base_dir, adapter_dir)
    assert {(TOP_LEVEL, "embed_tokens"), (TOP_LEVEL, "lm_head")} <= set(expected) == set(adapter.weights)
    for key, delta in expected.items():
        assert delta.abs().max() > 1e-3
        torch.testing.assert_close(adapter.weights[key].delta(), delta, rtol=1e-5, atol=1e-6)
    if spec.tie_word_embeddings:
        head, embedding = adapter.weights[(TOP_LEVEL, "lm_head")], adapter.weights[(TOP_LEVEL, "embed_tokens")]
        torch.testing.assert_close(head.delta(), embedding.delta().t())
