"""adapter_config.json options we refuse, each with a message naming the option and value."""

from __future__ import annotations

import pytest
from adapter_helpers import refused

from loraplex.adapters import MODULES, AdapterLimits, ErrorCode, load_adapter


def test_good_adapter_loads(adapter_copy, llama_spec):
    adapter = load_adapter(adapter_copy.path, llama_spec)
    assert adapter.rank == 8 and adapter.layers == (0, 1) and len(adapter.weights) == 14


@pytest.mark.parametrize(("changes", "code", "words"), [
    ({"use_dora": True}, ErrorCode.DORA_UNSUPPORTED, ["use_dora", "DoRA"]),
    ({"modules_to_save": ["lm_head"]}, ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, ["modules_to_save", "lm_head"]),
    ({"bias": "some"}, ErrorCode.CONFIG_INVALID, ["bias", "'some'"]),
    ({"lora_bias": True}, ErrorCode.BIAS_UNSUPPORTED, ["lora_bias"]),
    ({"peft_type": "IA3"}, ErrorCode.PEFT_TYPE, ["IA3"]),
    ({"peft_type": None}, ErrorCode.PEFT_TYPE, ["peft_type"]),
    ({"task_type": "SEQ_CLS"}, ErrorCode.TASK_TYPE, ["SEQ_CLS", "CAUSAL_LM"]),
    ({"r": 0}, ErrorCode.INVALID_RANK, ["r must be a positive integer", "0"]),
    ({"r": "8"}, ErrorCode.INVALID_RANK, ["'8'"]),
    ({"lora_alpha": 0}, ErrorCode.INVALID_ALPHA, ["lora_alpha", "0"]),
    ({"lora_alpha": -16}, ErrorCode.INVALID_ALPHA, ["-16"]),
    ({"lora_alpha": "16"}, ErrorCode.INVALID_ALPHA, ["'16'"]),
    ({"use_rslora": "yes"}, ErrorCode.CONFIG_INVALID, ["use_rslora"]),
    # a string is not read as a boolean: "false" is not taken for true (DoRA) nor for false
    ({"use_dora": "false"}, ErrorCode.CONFIG_INVALID, ["use_dora must be true or false", "'false'"]),
    ({"use_dora": 0}, ErrorCode.CONFIG_INVALID, ["use_dora must be true or false"]),
    ({"lora_bias": "false"}, ErrorCode.CONFIG_INVALID, ["lora_bias must be true or false"]),
    ({"rank_pattern": {"q_proj": 128}}, ErrorCode.RANK_TOO_LARGE, ["rank_pattern['q_proj'] is 128", "64"]),
    ({"rank_pattern": {"q_proj": 0}}, ErrorCode.INVALID_RANK, ["rank_pattern['q_proj']"]),
    ({"rank_pattern": {"q_proj(": 4}}, ErrorCode.CONFIG_INVALID, ["rank_pattern", "q_proj("]),
    # valid alone, but not where PEFT puts it (inside a larger pattern): "global flags not at the start"
    ({"rank_pattern": {"(?i)q_proj": 4}}, ErrorCode.CONFIG_INVALID, ["rank_pattern", "(?i)q_proj"]),
    ({"exclude_modules": "(["}, ErrorCode.CONFIG_INVALID, ["exclude_modules", "(["]),
    ({"alpha_pattern": {"q_proj": float("nan")}}, ErrorCode.INVALID_ALPHA, ["alpha_pattern"]),
    ({"target_modules": ["foo_proj", "query_key_value"]}, ErrorCode.UNKNOWN_TARGET_MODULE,
     ["none of the target modules", "foo_proj", "LlamaForCausalLM"]),
    ({"target_modules": ["qkv_proj"]}, ErrorCode.UNKNOWN_TARGET_MODULE, ["qkv_proj"]),
    # LoRA on embed_tokens / lm_head is served; the file must then hold their weights
    ({"target_modules": [*MODULES, "embed_tokens"]}, ErrorCode.MISSING_TENSOR, ["embed_tokens.lora_embedding_A"]),
    ({"target_modules": ["lm_head"]}, ErrorCode.UNKNOWN_TENSOR, ["does not target"]),
    ({"target_modules": r".*(embed_tokens|q_proj)"}, ErrorCode.UNKNOWN_TENSOR, ["does not target"]),
    ({"target_modules": r".*\.nothing"}, ErrorCode.UNKNOWN_TARGET_MODULE, ["nothing"]),
    ({"target_modules": []}, ErrorCode.CONFIG_INVALID, ["target_modules"]),
    ({"layers_to_transform": [0, 5]}, ErrorCode.LAYER_OUT_OF_RANGE, ["layer 5", "0..1"]),
    ({"layers_to_transform": [0], "layers_pattern": "blocks"}, ErrorCode.OPTION_UNSUPPORTED, ["blocks"]),
    ({"layer_replication": [[0, 2]]}, ErrorCode.OPTION_UNSUPPORTED, ["layer_replication"]),
    ({"trainable_token_indices": [1, 2]}, ErrorCode.OPTION_UNSUPPORTED, ["trainable_token_indices"]),
    ({"init_lora_weights": "pissa_niter_4"}, ErrorCode.OPTION_UNSUPPORTED, ["pissa_niter_4", "base model"]),
    ({"init_lora_weights": "olora"}, ErrorCode.OPTION_UNSUPPORTED, ["olora"]),
    ({"init_lora_weights": "loftq"}, ErrorCode.OPTION_UNSUPPORTED, ["loftq"]),
])
def test_config_refusals(adapter_copy, llama_spec, changes, code, words):
    adapter_copy.update_config(**changes)
    refused(adapter_copy.path, llama_spec, code, *words)


def test_null_flags_are_off_as_in_peft(adapter_copy, llama_spec):
    adapter_copy.update_config(use_dora=None, use_rslora=None, lora_bias=None)
    assert load_adapter(adapter_copy.path, llama_spec).rank == 8


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_a_bias_setting_with_no_bias_tensors_is_plain_lora(adapter_copy, llama_spec, bias):
    """PEFT's bias='all' on a model whose projections have no biases (Llama) saves no bias tensors: the
    adapter is plain LoRA, as PEFT loads it. One whose file holds a bias is refused, naming the tensor."""
    plain = load_adapter(adapter_copy.path, llama_spec)
    adapter_copy.update_config(bias=bias)
    loaded = load_adapter(adapter_copy.path, llama_spec)
    assert loaded.content_hash == plain.content_hash
    tensors = adapter_copy.tensors()
    tensors["base_model.model.model.layers.0.self_attn.q_proj.bias"] = next(iter(tensors.values()))[0].clone()
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.BIAS_UNSUPPORTED, "q_proj.bias", "bias='none'")


def test_target_names_that_match_nothing_are_passed_over_as_peft_does(adapter_copy, llama_spec):
    """Training scripts often list the names of several architectures; PEFT trains and loads such an adapter
    with the names that match, and so does loraplex."""
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter_copy.update_config(target_modules=[*names, "c_attn", "query_key_value", "Wqkv"])
    assert len(load_adapter(adapter_copy.path, llama_spec).weights) == 14


def test_rank_limit_is_configurable(adapter_copy, llama_spec):
    refused(adapter_copy.path, llama_spec, ErrorCode.RANK_TOO_LARGE, "r is 8 (layer 0 ", "limit of 4",
             limits=AdapterLimits(max_rank=4))
    assert load_adapter(adapter_copy.path, llama_spec, AdapterLimits(max_rank=8)).rank == 8


def test_rank_128_over_default_limit(tiny_llama_dir, llama_spec, tmp_path):
    from loraplex.testing import make_peft_adapter

    path = make_peft_adapter(tiny_llama_dir, tmp_path / "big", r=128, target_modules=["q_proj"])
    refused(path, llama_spec, ErrorCode.RANK_TOO_LARGE, "128", "64")


def test_rank_limit_applies_to_ranks_in_use(tiny_llama_dir, llama_spec, tmp_path):
    from loraplex.testing import make_peft_adapter

    path = make_peft_adapter(tiny_llama_dir, tmp_path / "a", r=128, target_modules=["q_proj", "v_proj"],
                             rank_pattern={"q_proj": 16, "v_proj": 8})
    adapter = load_adapter(path, llama_spec)
    assert adapter.weights[(0, "q_proj")].rank == 16 and adapter.weights[(1, "v_proj")].rank == 8


def test_config_not_json(adapter_copy, llama_spec):
    adapter_copy.config_path.write_text("{not json")
    refused(adapter_copy.path, llama_spec, ErrorCode.CONFIG_INVALID, "adapter_config.json", "JSON")


def test_config_not_object(adapter_copy, llama_spec):
    adapter_copy.config_path.write_text("[1, 2]")
    refused(adapter_copy.path, llama_spec, ErrorCode.CONFIG_INVALID, "JSON object")


def test_config_too_large(adapter_copy, llama_spec):
    adapter_copy.update_config(padding="x" * 4096)
    refused(adapter_copy.path, llama_spec, ErrorCode.CONFIG_INVALID, "over the limit",
             limits=AdapterLimits(max_config_bytes=1024))


def test_exclude_modules_and_all_linear(adapter_copy, llama_spec):
    adapter_copy.update_config(target_modules="all-linear", exclude_modules=["down_proj"])
    # the weights still hold down_proj, which the config now leaves out
    refused(adapter_copy.path, llama_spec, ErrorCode.UNKNOWN_TENSOR, "down_proj", "does not target")
    adapter_copy.update_config(exclude_modules=None)
    assert len(load_adapter(adapter_copy.path, llama_spec).weights) == 14
