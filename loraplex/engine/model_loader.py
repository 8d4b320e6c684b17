"""Find a model's Hugging Face directory and read its config and weights.

A model is named by a local HF directory (config.json + *.safetensors, sharded or not), a .gguf file
(converted once into a cached HF directory), a Hub id (downloaded where a network exists), or a
built-in alias such as ``smollm2-135m``. Weights are only ever read from safetensors: pickled
checkpoints (.bin/.pt) are refused, because unpickling runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.engine.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_cache_dir() -> Path:
    from loraplex.config import get_settings

    configured = get_settings().model_cache
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "loraplex" / "models"


def resolve_model_dir(model: str | Path, *, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a local HF directory holding `model`, converting or downloading it first if needed."""
    from loraplex.engine.fetch import DEMO_MODELS, fetch_demo_model

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = str(model)
    path = Path(name).expanduser()
    if path.is_dir():
        _check_hf_dir(path)
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model; give a model directory instead")
        return _converted_gguf_dir(path, cache_dir, progress)
    if name in DEMO_MODELS:
        return fetch_demo_model(name, cache_dir=cache_dir, progress=progress)
    if _HUB_ID.fullmatch(name) and not name.startswith((".", "/", "~")):
        return _download_from_hub(name, cache_dir)
    known = ", ".join(sorted(DEMO_MODELS))
    raise ModelLoadError(
        f"model {name!r} not found: it is not a local directory, a .gguf file, a Hub id (org/name) "
        f"or a built-in model ({known})"
    )


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory: config.json is missing")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickled:
            raise ModelLoadError(
                f"{path} has only pickled weights ({', '.join(pickled[:3])}); loraplex loads safetensors "
                f"only, because unpickling runs arbitrary code. Convert the checkpoint to safetensors."
            )
        raise ModelLoadError(f"{path} has no *.safetensors weights")


def _converted_gguf_dir(gguf_path: Path, cache_dir: Path, progress: bool) -> Path:
    from loraplex.engine.gguf import COMPLETE_MARKER, CONVERSION_VERSION, convert_gguf

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERSION_VERSION}"
    out = cache_dir / "gguf" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (out / COMPLETE_MARKER).is_file():
        convert_gguf(gguf_path, out, progress=progress)
    return out


def _download_from_hub(repo_id: str, cache_dir: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - huggingface_hub ships with transformers
        raise ModelLoadError("huggingface_hub is needed to download models from the Hub") from exc
    try:
        local = snapshot_download(
            repo_id,
            cache_dir=str(cache_dir / "hub"),
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model"],
        )
    except Exception as exc:  # network, auth, missing repo: all end the same way for the caller
        raise ModelLoadError(
            f"could not download {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
            f"there is no local path {repo_id!r} either. Without a network, give a local model directory "
            f"or .gguf file instead."
        ) from exc
    path = Path(local)
    _check_hf_dir(path)
    return path


def read_model_config(model_dir: str | Path) -> dict:
    """config.json as a dict, checked like `load_model_config` but without importing transformers (which
    costs about a second), so an engine that needs only the numbers loads fast."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the model config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{model_dir}: architecture {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{model_dir}: activation {act!r} is not supported (only silu)")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if not isinstance(config.get(key), int)]
    if missing:
        raise ModelLoadError(f"{path} lacks integer {', '.join(missing)}")
    return config


def load_model_config(model_dir: str | Path):
    """The model's transformers config; refuses architectures the engine does not implement."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    read_model_config(model_dir)
    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # values transformers rejects
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}") from exc


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every weight, memory-mapped from the safetensors files."""
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {exc}") from exc
