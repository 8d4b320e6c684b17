"""Convert a GGUF file (llama.cpp's format) into a Hugging Face safetensors directory, once.

Weights are dequantised with gguf-py to float32. llama.cpp stores Llama's q/k projections with their
rows permuted for its interleaved rotary embedding; they are permuted back here so the result matches
the original Hugging Face checkpoint. The tokenizer comes from transformers' GGUF tokenizer converter;
the chat template and EOS/BOS ids from the file's metadata.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from loraplex.engine.errors import ModelLoadError

# GGUF architecture -> (HF model_type, whether q/k rows were permuted by llama.cpp's converter)
_ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False)}
# served by the engine, but not converted from GGUF: Qwen3's q/k norm tensors and Phi-3's fused projections and
# LongRoPE factor tensors have no mapping here
_SAFETENSORS_ONLY = ("qwen3", "phi3")

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

COMPLETE_MARKER = ".loraplex-complete"
# Part of the conversion cache's key: raised when converting the same file gives another result, so that
# conversions cached by an older version are made again.
CONVERSION_VERSION = 2


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a Llama-family model")


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (half-split rotary -> interleaved rotary pairs)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: back to the Hugging Face layout."""
    return (
        weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


class GGUFModel:
    """Metadata and lazily dequantised tensors of one GGUF file."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # gguf-py raises ValueError, struct.error, IndexError... on bad files
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        arch = self.field("general.architecture")
        if arch not in _ARCHITECTURES:
            hint = (f"; the engine serves {arch} from its Hugging Face directory (config.json and safetensors)"
                    if arch in _SAFETENSORS_ONLY else "")
            raise ModelLoadError(
                f"{self.path}: GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(_ARCHITECTURES))}){hint}"
            )
        self.arch = arch
        self.model_type, self.qk_permuted = _ARCHITECTURES[arch]
        if self.field(f"{arch}.rope.scaling.type") not in (None, "none") or any(
            t.name == "rope_freqs.weight" for t in self.reader.tensors
        ):
            raise ModelLoadError(f"{self.path}: GGUF models with rope scaling are not supported")

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _required(self, key: str):
        value = self.field(f"{self.arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def hf_config(self) -> dict:
        num_heads = int(self._required("attention.head_count"))
        hidden = int(self._required("embedding_length"))
        vocab = self.field(f"{self.arch}.vocab_size")
        if vocab is None:
            vocab = len(self.field("tokenizer.ggml.tokens") or [])
        config = {
            "model_type": self.model_type,
            "architectures": ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._required("feed_forward_length")),
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self.field(f"{self.arch}.attention.head_count_kv", num_heads)),
            "head_dim": int(self.field(f"{self.arch}.attention.key_length", hidden // num_heads)),
            "max_position_embeddings": int(self.field(f"{self.arch}.context_length", 2048)),
            "rms_norm_eps": float(self.field(f"{self.arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{self.arch}.rope.freq_base", 10000.0)),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "torch_dtype": "float32",
        }
        for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            value = self.field(f"tokenizer.ggml.{gguf_key}")
            if value is not None:
                config[hf_key] = int(value)
        if self.model_type == "llama":
            config["attention_bias"] = any(n.endswith("attn_q.bias") for n in self.tensor_names)
        return config

    def generation_config(self) -> dict:
        generation = {}
        for key in ("bos_token_id", "eos_token_id"):
            value = self.field(f"tokenizer.ggml.{key}")
            if value is not None:
                generation[key] = int(value)
        pad = self.field("tokenizer.ggml.padding_token_id")
        if pad is not None:
            generation["pad_token_id"] = int(pad)
        return generation

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray, int]]:
        """Yield (hf_name, float32 array in HF layout, bytes read from the file) per tensor."""
        from gguf import quants

        config = self.hf_config()
        for tensor in self.reader.tensors:
            name = hf_tensor_name(tensor.name)
            try:
                array = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            except NotImplementedError as exc:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} uses quantisation {tensor.tensor_type.name}, "
                    f"which gguf-py cannot dequantise"
                ) from exc
            if self.qk_permuted and name.endswith("q_proj.weight"):
                array = unpermute_qk(array, config["num_attention_heads"])
            elif self.qk_permuted and name.endswith("k_proj.weight"):
                array = unpermute_qk(array, config["num_key_value_heads"])
            if not array.flags.writeable:  # unquantised tensors are views into the read-only mmap
                array = array.copy()
            yield name, np.ascontiguousarray(array), int(tensor.n_bytes)


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True, overwrite: bool = False
) -> Path:
    """Convert `gguf_path` into a HF directory at `out_dir` (written to a temporary sibling and renamed,
    so a crash never leaves a half-converted cache behind). When another process finished the same
    conversion first, its result is kept unless `overwrite`. Returns `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    model = GGUFModel(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        config = model.hf_config()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(model.generation_config(), indent=2))
        tensors: dict[str, torch.Tensor] = {}
        total = sum(int(t.n_bytes) for t in model.reader.tensors)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=f"converting {gguf_path.name}", disable=not progress
        ) as bar:
            for name, array, nbytes in model.iter_tensors():
                tensors[name] = torch.from_numpy(array)
                bar.update(nbytes)
        if config["tie_word_embeddings"]:
            tensors.pop("lm_head.weight", None)
        if config.get("attention_bias"):
            # llama.cpp reads each attention bias as optional; Hugging Face's attention_bias means all four.
            # A file with q/k/v biases and none on the output gets the zero bias llama.cpp adds there.
            for layer in range(config["num_hidden_layers"]):
                tensors.setdefault(f"model.layers.{layer}.self_attn.o_proj.bias",
                                   torch.zeros(config["hidden_size"], dtype=torch.float32))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _save_tokenizer(gguf_path, tmp, model.field("tokenizer.chat_template"))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model directory
        for file in tmp.iterdir():
            file.chmod(0o644)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf_path)}))
        if (out_dir / COMPLETE_MARKER).is_file() and not overwrite:
            shutil.rmtree(tmp)
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / COMPLETE_MARKER).is_file():
                raise
            shutil.rmtree(tmp)  # a concurrent conversion won the rename
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many kinds for unsupported tokenizer layouts
        raise ModelLoadError(f"{gguf_path}: could not build a tokenizer from its GGUF metadata: {exc}") from exc
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))
