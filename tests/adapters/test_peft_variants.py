"""LoraConfig options beyond plain LoRA, and PEFT's target rules: each adapter is served exactly as PEFT applies
it (the same logits as PEFT's own forward pass), or refused with a message naming the option."""

from __future__ import annotations

import json

import pytest
import torch
from adapter_helpers import AdapterCopy, logits_peft_and_canonical, peft_deltas, refused

from loraplex.adapters import MODULES, BaseModelSpec, ErrorCode, load_adapter
from loraplex.testing import make_peft_adapter

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])


def _assert_served_as_peft(base_dir, adapter_dir, spec):
    adapter = load_adapter(adapter_dir, spec)
    expected, served = logits_peft_and_canonical(base_dir, adapter_dir, adapter, IDS)
    torch.testing.assert_close(served, expected, rtol=1e-4, atol=1e-4)
    return adapter


@pytest.mark.parametrize("options", [
    pytest.param(dict(velora_config={"num_groups": 4}), id="velora"),
    pytest.param(dict(monteclora_config={}), id="monteclora"),
    pytest.param(dict(init_lora_weights="mica"), id="mica"),
    pytest.param(dict(init_lora_weights="orthogonal"), id="orthogonal"),
    pytest.param(dict(init_lora_weights="gaussian"), id="gaussian"),
    pytest.param(dict(fan_in_fan_out=True), id="fan_in_fan_out"),  # PEFT turns it off for nn.Linear
])
def test_options_that_change_only_training_load_as_plain_lora(tiny_llama_dir, llama_spec, tmp_path, options):
    """VeLoRA and MonteCLoRA change the backward pass or add noise in training only, and save tensors of their
    own beside A and B; the initialisations only choose the starting A and B. PEFT's inference is plain LoRA."""
    path = make_peft_adapter(tiny_llama_dir, tmp_path / "lora", r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                             seed=5, **options)
    adapter = _assert_served_as_peft(tiny_llama_dir, path, llama_spec)
    assert len(adapter.weights) == 6


@pytest.mark.parametrize("changes", [
    pytest.param(dict(init_lora_weights="eva", eva_config={"rho": 2.0}), id="eva"),
    pytest.param(dict(init_lora_weights=None, runtime_config={"ephemeral_gpu_offload": True},
                      megatron_config=None, lora_dropout=0.3, inference_mode=False), id="runtime-and-nulls"),
    pytest.param(dict(corda_config={"corda_method": "kpm"}, lora_ga_config={"direction": "ArB2r"},
                      loftq_config={}, eva_config=None), id="converted-keeps-its-init-config"),
])
def test_config_blocks_without_effect_on_inference(tiny_llama_dir, llama_spec, tmp_path, changes):
    path = make_peft_adapter(tiny_llama_dir, tmp_path / "lora", r=4, target_modules=["q_proj", "v_proj"], seed=6)
    copy = AdapterCopy(path, tmp_path / "edited")
    copy.update_config(**changes)
    _assert_served_as_peft(tiny_llama_dir, copy.path, llama_spec)


def test_training_only_tensors_need_their_variant(tiny_llama_dir, llama_spec, tmp_path):
    """A VeLoRA tensor is passed over only where the config turns VeLoRA on."""
    path = make_peft_adapter(tiny_llama_dir, tmp_path / "lora", r=4, target_modules=["q_proj"],
                             velora_config={"num_groups": 4})
    copy = AdapterCopy(path, tmp_path / "edited")
    copy.update_config(velora_config=None)
    refused(copy.path, llama_spec, ErrorCode.UNKNOWN_TENSOR, "lora_velora_embed")


@pytest.mark.parametrize("base_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_no_target_modules_takes_peft_default(base_fixture, request, tmp_path):
    """Without target_modules PEFT targets its default for the model type: q_proj and v_proj for Llama and Qwen2."""
    base_dir = request.getfixturevalue(base_fixture)
    spec = BaseModelSpec.from_model_dir(base_dir)
    path = make_peft_adapter(base_dir, tmp_path / "lora", r=4, target_modules=["q_proj", "v_proj"], seed=7)
    copy = AdapterCopy(path, tmp_path / "edited")
    config = json.loads(copy.config_path.read_text())
    del config["target_modules"]
    copy.config_path.write_text(json.dumps(config))
    adapter = _assert_served_as_peft(base_dir, copy.path, spec)
    assert adapter.target_modules == ("q_proj", "v_proj")
    copy.update_config(target_modules=None)
    assert load_adapter(copy.path, spec) == adapter


def test_no_target_modules_where_peft_has_no_default(llama_adapter_dir, tmp_path):
    phi3 = BaseModelSpec.from_config({"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                      "num_attention_heads": 4, "num_hidden_layers": 2})
    copy = AdapterCopy(llama_adapter_dir, tmp_path / "edited")
    copy.update_config(target_modules=None)
    refused(copy.path, phi3, ErrorCode.CONFIG_INVALID, "target_modules is missing", "Phi3ForCausalLM", "qkv_proj")


@pytest.mark.parametrize("changes", [
    pytest.param(dict(layers_pattern="layers"), id="layers"),
    pytest.param(dict(layers_pattern="model.layers"), id="dotted"),
    pytest.param(dict(layers_pattern="lay.rs"), id="regex"),
    pytest.param(dict(layers_pattern=["blocks", "layers"]), id="list"),
    pytest.param(dict(layers_pattern=""), id="empty"),
    pytest.param(dict(layers_to_transform=1), id="int"),
    pytest.param(dict(target_modules="ALL-LINEAR", layers_to_transform=None), id="all-linear-any-case"),
    pytest.param(dict(target_modules=r"model\.layers\.1\.(self_attn\.q_proj|mlp\.down_proj)", layers_to_transform=None),
                 id="regex-target-full-match"),
])
def test_target_rules_follow_peft(tiny_llama_dir, llama_spec, tmp_path, changes):
    path = make_peft_adapter(tiny_llama_dir, tmp_path / "lora", r=4, target_modules=list(MODULES), seed=8)
    copy = AdapterCopy(path, tmp_path / "edited")
    copy.update_config(**{"layers_to_transform": [1], **changes})
    targeted = set(peft_deltas(tiny_llama_dir, copy.path))
    # the file keeps only the tensors of the modules PEFT targets
    tensors = copy.tensors()
    copy.save_tensors({k: v for k, v in tensors.items()
                       if (int(k.split(".")[4]), k.split(".")[6]) in targeted})
    adapter = _assert_served_as_peft(tiny_llama_dir, copy.path, llama_spec)
    assert set(adapter.weights) == targeted and targeted


@pytest.mark.parametrize(("changes", "words"), [
    (dict(target_modules=".*q_proj", layers_to_transform=[0]), ["layers_to_transform cannot be used", ".*q_proj"]),
    (dict(target_modules=".*q_proj", layers_to_transform=[]), ["layers_to_transform cannot be used"]),
    (dict(target_modules="all-linear", layers_to_transform=[0]), ["layers_to_transform cannot be used"]),
    (dict(target_modules=".*q_proj", layers_pattern="layers"), ["layers_pattern cannot be used"]),
    (dict(layers_pattern="layers", layers_to_transform=None), ["layers_pattern is given without layers_to_transform"]),
])
def test_combinations_peft_refuses_are_refused(adapter_copy, llama_spec, changes, words):
    from peft import LoraConfig

    with pytest.raises(ValueError):
        LoraConfig(**changes)
    adapter_copy.update_config(**changes)
    refused(adapter_copy.path, llama_spec, ErrorCode.CONFIG_INVALID, *words)


@pytest.mark.parametrize(("changes", "code", "words"), [
    (dict(init_lora_weights="lora_ga"), ErrorCode.OPTION_UNSUPPORTED, ["LoRA-GA", "base model", "Convert it to a plain LoRA"]),
    (dict(init_lora_weights="corda"), ErrorCode.OPTION_UNSUPPORTED, ["CorDA", "base model"]),
    (dict(init_lora_weights="pissa"), ErrorCode.OPTION_UNSUPPORTED, ["PiSSA", "base model"]),
    (dict(init_lora_weights="kaiming"), ErrorCode.CONFIG_INVALID, ["'kaiming'", "not an initialisation PEFT knows"]),
    (dict(init_lora_weights=[True]), ErrorCode.CONFIG_INVALID, ["init_lora_weights must be"]),
    (dict(kasa_config={}), ErrorCode.OPTION_UNSUPPORTED, ["kasa_config", "KaSA"]),
    (dict(use_bdlora={"target_modules_bd_a": ["q_proj"], "nblocks": 2}), ErrorCode.OPTION_UNSUPPORTED,
     ["use_bdlora", "BD-LoRA"]),
    (dict(arrow_config={}), ErrorCode.OPTION_UNSUPPORTED, ["arrow_config", "Arrow"]),
    (dict(alora_invocation_tokens=[5, 6]), ErrorCode.OPTION_UNSUPPORTED, ["alora_invocation_tokens"]),
    (dict(use_qalora=True), ErrorCode.OPTION_UNSUPPORTED, ["QALoRA"]),
    (dict(target_parameters=["mlp.experts.down_proj"]), ErrorCode.OPTION_UNSUPPORTED, ["target_parameters"]),
    (dict(velora_config={}, monteclora_config={}), ErrorCode.OPTION_UNSUPPORTED,
     ["velora_config and monteclora_config", "not combine"]),
    (dict(init_lora_weights="mica", velora_config={}), ErrorCode.OPTION_UNSUPPORTED, ["not combine"]),
    (dict(velora_config="yes"), ErrorCode.CONFIG_INVALID, ["velora_config must be an object"]),
    (dict(target_modules=["all-linear"]), ErrorCode.UNKNOWN_TARGET_MODULE, ["'all-linear'", "a string"]),
    (dict(layers_to_transform=[0], layers_pattern="("), ErrorCode.CONFIG_INVALID, ["layers_pattern", "'('"]),
    (dict(layers_to_transform=[0], layers_pattern=["layers", 3]), ErrorCode.CONFIG_INVALID, ["layers_pattern"]),
])
def test_variants_refused_by_name(adapter_copy, llama_spec, changes, code, words):
    adapter_copy.update_config(**changes)
    refused(adapter_copy.path, llama_spec, code, *words)


def test_a_kasa_adapter_made_by_peft_is_refused_by_name(tiny_llama_dir, llama_spec, tmp_path):
    path = make_peft_adapter(tiny_llama_dir, tmp_path / "kasa", r=4, target_modules=["q_proj"], kasa_config={})
    refused(path, llama_spec, ErrorCode.OPTION_UNSUPPORTED, "KaSA")


@pytest.mark.parametrize(("raw", "words"), [
    (b'"hello"', ["must be a JSON object", "not a string"]),
    (b"null", ["not null"]),
    (b"[]", ["not a list"]),
    (b"8", ["not a number"]),
    (b'{"r": "\xff"}', ["not UTF-8", "0xff"]),
    (b"", ["is empty (0 bytes)"]),
    (b'{"r": ' + b"9" * 5000 + b"}", ["not valid JSON"]),
])
def test_config_that_is_no_json_object(adapter_copy, llama_spec, raw, words):
    adapter_copy.config_path.write_bytes(raw)
    refused(adapter_copy.path, llama_spec, ErrorCode.CONFIG_INVALID, "adapter_config.json", *words)


@pytest.mark.parametrize(("changes", "code", "words"), [
    (dict(r="8"), ErrorCode.INVALID_RANK, ["r must be a positive integer", "'8'"]),
    (dict(r=8.0), ErrorCode.INVALID_RANK, ["r must be"]),
    (dict(lora_alpha=[16]), ErrorCode.INVALID_ALPHA, ["lora_alpha", "[16]"]),
    (dict(target_modules=5), ErrorCode.CONFIG_INVALID, ["target_modules", "5"]),
    (dict(target_modules=["q_proj", 5]), ErrorCode.CONFIG_INVALID, ["target_modules"]),
    (dict(layers_to_transform="0"), ErrorCode.CONFIG_INVALID, ["layers_to_transform", "'0'"]),
    (dict(exclude_modules=5), ErrorCode.CONFIG_INVALID, ["exclude_modules"]),
    (dict(rank_pattern=[1]), ErrorCode.CONFIG_INVALID, ["rank_pattern"]),
    (dict(alpha_pattern={"q_proj": "x"}), ErrorCode.INVALID_ALPHA, ["alpha_pattern['q_proj']"]),
    (dict(modules_to_save=5), ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, ["modules_to_save"]),
])
def test_fields_of_the_wrong_type_are_named(adapter_copy, llama_spec, changes, code, words):
    adapter_copy.update_config(**changes)
    refused(adapter_copy.path, llama_spec, code, *words)


def test_an_adapter_for_another_model_names_it(llama_spec, tmp_path):
    """Shapes that fit another model (a narrower one, a deeper one) are refused naming the model the adapter's
    config says it was made for, beside the base model here."""
    from loraplex.testing import make_tiny_model

    narrow = make_tiny_model(tmp_path / "narrow", "llama", hidden_size=32, intermediate_size=64)
    path = make_peft_adapter(narrow, tmp_path / "narrow-lora", r=4, target_modules=["q_proj", "v_proj"])
    error = refused(path, llama_spec, ErrorCode.SHAPE_MISMATCH, "q_proj", "takes 64 input features",
                    "LlamaForCausalLM with hidden size 64 and 2 layers")
    assert f"made for {str(narrow)!r} (base_model_name_or_path)" in str(error), str(error)
    deep = make_tiny_model(tmp_path / "deep", "llama", num_hidden_layers=4)
    path = make_peft_adapter(deep, tmp_path / "deep-lora", r=4, target_modules=["q_proj"])
    refused(path, llama_spec, ErrorCode.LAYER_OUT_OF_RANGE, "layer 2", "deeper model", "hidden size 64")


@pytest.mark.parametrize("changes", [
    dict(target_modules=["q_proj", "input_layernorm"]),
    dict(target_modules=["q_proj", "self_attn"]),
    dict(target_modules=["q_proj", "layers.1"]),
    dict(target_modules=r".*\.(q_proj|mlp)"),
    dict(target_modules=["q_proj", "mlp"], layers_to_transform=[1]),
])
def test_targets_that_are_no_linear_layer_are_refused_as_peft_refuses_them(tiny_llama_dir, llama_spec, adapter_copy,
                                                                          changes):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_copy.update_config(**changes)
    with pytest.raises(ValueError, match="is not supported"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)), str(adapter_copy.path))
    refused(adapter_copy.path, llama_spec, ErrorCode.UNKNOWN_TARGET_MODULE, "which is not a linear layer")


def test_qwen3_q_and_k_norms_are_refused_as_peft_refuses_them(tiny_qwen3_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = AdapterCopy(make_peft_adapter(tiny_qwen3_dir, tmp_path / "lora", r=4, target_modules=["q_proj"]),
                          tmp_path / "copy")
    adapter.update_config(target_modules=["q_proj", "k_norm"])
    with pytest.raises(ValueError, match="is not supported"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir)), str(adapter.path))
    refused(adapter.path, BaseModelSpec.from_model_dir(tiny_qwen3_dir), ErrorCode.UNKNOWN_TARGET_MODULE,
            "self_attn.k_norm, which is not a linear layer")


def test_a_non_linear_name_the_layer_filter_or_exclude_modules_leaves_out_is_not_targeted(llama_spec, adapter_copy):
    # "norm" ends model.norm, which has no layer index, so layers_to_transform leaves it out, as in PEFT
    adapter_copy.update_config(target_modules=list(MODULES) + ["norm"], layers_to_transform=[0, 1])
    assert len(load_adapter(adapter_copy.path, llama_spec).weights) == 14
    adapter_copy.update_config(target_modules=list(MODULES) + ["self_attn"], layers_to_transform=None,
                               exclude_modules=["self_attn"])
    assert len(load_adapter(adapter_copy.path, llama_spec).weights) == 14
