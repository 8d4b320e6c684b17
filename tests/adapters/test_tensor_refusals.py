"""adapter_model.safetensors problems: header, dtypes, keys, shapes, ranks, values."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from adapter_helpers import refused

from loraplex.adapters import AdapterLimits, ErrorCode, load_adapter


def _write_raw(path, header: dict, data: bytes = b"", header_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def test_nan_is_refused_naming_the_tensor(adapter_copy, llama_spec, q_keys):
    tensors = adapter_copy.tensors()
    tensors[q_keys[1]][3, 2] = float("nan")
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.NON_FINITE, q_keys[1], "1 non-finite")


def test_inf_isrefused(adapter_copy, llama_spec, q_keys):
    tensors = adapter_copy.tensors()
    tensors[q_keys[0]][0, 0] = float("-inf")
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.NON_FINITE, q_keys[0])


def test_wrong_input_features(adapter_copy, llama_spec, q_keys):
    tensors = adapter_copy.tensors()
    tensors[q_keys[0]] = torch.randn(8, 48)
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.SHAPE_MISMATCH, q_keys[0], "[8, 48]", "64 input features")


def test_wrong_output_features_gqa(adapter_copy, llama_spec):
    # k_proj outputs num_key_value_heads * head_dim = 32 features, not hidden_size
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    tensors = adapter_copy.tensors()
    tensors[key] = torch.randn(64, 8)
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.SHAPE_MISMATCH, key, "32 output features")


def test_a_and_b_ranks_disagree(adapter_copy, llama_spec, q_keys):
    tensors = adapter_copy.tensors()
    tensors[q_keys[1]] = torch.randn(64, 4)
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.RANK_MISMATCH, q_keys[0], "rank 8", "rank 4")


def test_config_rank_disagrees_with_tensors(adapter_copy, llama_spec):
    adapter_copy.update_config(r=4)
    refused(adapter_copy.path, llama_spec, ErrorCode.RANK_MISMATCH, "rank 8 in its tensors", "4 in adapter_config")


def test_not_a_matrix(adapter_copy, llama_spec, q_keys):
    tensors = adapter_copy.tensors()
    tensors[q_keys[0]] = torch.randn(8, 64, 1)
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.SHAPE_MISMATCH, "matrices")


def test_missing_b(adapter_copy, llama_spec, q_keys):
    tensors = adapter_copy.tensors()
    del tensors[q_keys[1]]
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.MISSING_TENSOR, q_keys[1], "no lora_B")


def test_missing_module(adapter_copy, llama_spec):
    tensors = {k: v for k, v in adapter_copy.tensors().items() if "layers.1.mlp.up_proj" not in k}
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.MISSING_TENSOR, "layers.1.mlp.up_proj.lora_A")


@pytest.mark.parametrize(("key", "code", "word"), [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight", ErrorCode.UNKNOWN_TENSOR, "unknown tensor"),
    ("optimizer.state", ErrorCode.UNKNOWN_TENSOR, "unknown tensor"),
    # past the model's depth: says so (an adapter for a deeper model), not "unknown tensor"
    ("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", ErrorCode.LAYER_OUT_OF_RANGE, "for layer 7"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", ErrorCode.DORA_UNSUPPORTED, "DoRA"),
    # LoRA on the embedding or the head of an adapter whose config does not target them
    ("base_model.model.model.embed_tokens.lora_embedding_A", ErrorCode.UNKNOWN_TENSOR, "does not target"),
    ("base_model.model.lm_head.lora_A.weight", ErrorCode.UNKNOWN_TENSOR, "does not target"),
    ("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta", ErrorCode.OPTION_UNSUPPORTED,
     "trainable_token_indices"),
    ("base_model.model.model.layers.0.self_attn.q_proj.bias", ErrorCode.BIAS_UNSUPPORTED, "bias"),
    ("base_model.model.lm_head.modules_to_save.weight", ErrorCode.MODULES_TO_SAVE_UNSUPPORTED, "modules_to_save"),
    ("base_model.model.model.norm.modules_to_save.weight", ErrorCode.MODULES_TO_SAVE_UNSUPPORTED,
     "modules_to_save"),
])
def test_unexpected_keys(adapter_copy, llama_spec, key, code, word):
    tensors = adapter_copy.tensors()
    tensors[key] = torch.zeros(8, 64)
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, code, key, word)


def test_weights_for_untargeted_module(adapter_copy, llama_spec):
    adapter_copy.update_config(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    refused(adapter_copy.path, llama_spec, ErrorCode.UNKNOWN_TENSOR, ".mlp.", "does not target")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_disallowed_dtype(adapter_copy, llama_spec, q_keys, dtype):
    tensors = adapter_copy.tensors()
    tensors[q_keys[0]] = tensors[q_keys[0]].to(dtype)
    adapter_copy.save_tensors(tensors)
    refused(adapter_copy.path, llama_spec, ErrorCode.DTYPE_UNSUPPORTED, q_keys[0], "F32, F16, BF16")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_are_upcast(adapter_copy, llama_spec, q_keys, dtype):
    reference = load_adapter(adapter_copy.path, llama_spec)
    tensors = {k: v.to(dtype) for k, v in adapter_copy.tensors().items()}
    adapter_copy.save_tensors(tensors)
    adapter = load_adapter(adapter_copy.path, llama_spec)
    w = adapter.weights[(0, "q_proj")]
    assert w.a.dtype == torch.float32
    torch.testing.assert_close(w.a, tensors[q_keys[0]].float())
    torch.testing.assert_close(w.delta(), reference.weights[(0, "q_proj")].delta(), rtol=2e-2, atol=2e-3)
    assert adapter.content_hash != reference.content_hash


def test_header_length_over_limit_is_not_parsed(adapter_copy, llama_spec):
    _write_raw(adapter_copy.weights_path, {}, header_len=1 << 40)
    refused(adapter_copy.path, llama_spec, ErrorCode.HEADER_TOO_LARGE, "adapter_model.safetensors", "header")


def test_header_over_configured_limit(adapter_copy, llama_spec):
    refused(adapter_copy.path, llama_spec, ErrorCode.HEADER_TOO_LARGE, "over the limit of 100",
             limits=AdapterLimits(max_header_bytes=100))


def test_header_runs_past_end(adapter_copy, llama_spec):
    _write_raw(adapter_copy.weights_path, {}, header_len=1000)
    refused(adapter_copy.path, llama_spec, ErrorCode.SAFETENSORS_CORRUPT, "past the end")


@pytest.mark.parametrize(("header", "data", "words"), [
    (None, b"", ["not valid JSON"]),
    ({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 8, ["outside the data"]),
    ({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, b"\0" * 16, ["needs 16 bytes"]),
    ({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}}, b"\0" * 16, ["end before they begin"]),
    ({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}}, b"\0" * 16, ["[begin, end]"]),
    ({"x": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}}, b"\0" * 16, ["invalid shape"]),
    ({"x": {"dtype": "F32", "shape": [2]}}, b"", ["lacks dtype, shape or data_offsets"]),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, ["overlaps"]),
    ({"__metadata__": {"a": 1}}, b"", ["__metadata__"]),
])
def test_corrupt_headers(adapter_copy, llama_spec, header, data, words):
    if header is None:
        raw = b"{broken"
        adapter_copy.weights_path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    else:
        _write_raw(adapter_copy.weights_path, header, data)
    refused(adapter_copy.path, llama_spec, ErrorCode.SAFETENSORS_CORRUPT, "adapter_model.safetensors", *words)


def test_truncated_file(adapter_copy, llama_spec):
    data = adapter_copy.weights_path.read_bytes()
    adapter_copy.weights_path.write_bytes(b"\x01\x02")
    refused(adapter_copy.path, llama_spec, ErrorCode.SAFETENSORS_CORRUPT, "shorter")
    # cut in the tensor data, as an interrupted download leaves it
    adapter_copy.weights_path.write_bytes(data[: len(data) - 100])
    refused(adapter_copy.path, llama_spec, ErrorCode.SAFETENSORS_CORRUPT, "the file is cut short")


def test_unaligned_tensor_data_is_read_correctly(adapter_copy, llama_spec, q_keys):
    # A hand-written file may place tensors at offsets that are not multiples of 4.
    tensors = adapter_copy.tensors()
    header, blob = {}, b""
    names = sorted(tensors)
    for i, name in enumerate(names):
        if i == 0:
            header["pad"] = {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}
            blob += b"\0\0"
        data = tensors[name].numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    _write_raw(adapter_copy.weights_path, header, blob)
    refused(adapter_copy.path, llama_spec, ErrorCode.UNKNOWN_TENSOR, "pad")
    del header["pad"]
    _write_raw(adapter_copy.weights_path, header, b"\0\0" + blob[2:])  # offsets still start at 2
    adapter = load_adapter(adapter_copy.path, llama_spec)
    torch.testing.assert_close(adapter.weights[(0, "q_proj")].a, tensors[q_keys[0]])


def test_reader_round_trips_every_allowed_dtype_and_shape():
    from safetensors.torch import save

    from loraplex.adapters.safetensors_file import tensors_from_bytes

    original = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
                "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4), "big": torch.randn(64, 576)}
    read, _ = tensors_from_bytes(save(original), "x.safetensors", AdapterLimits())
    assert read.keys() == original.keys()
    for name, tensor in original.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name
    read["f32"].zero_()  # tensors share one buffer; writing one leaves its neighbours alone
    for name in original.keys() - {"f32"}:
        assert torch.equal(read[name], original[name]), name
