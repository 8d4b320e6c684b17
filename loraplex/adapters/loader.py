"""load_adapter: find, check and convert a PEFT adapter given as a folder, a file pair, an archive, or a
canonical store entry."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from .archive import archive_kind, read_zip_member, safe_extract
from .canonical import FORMAT, CanonicalAdapter
from .convert import to_canonical
from .errors import AdapterValidationError, ErrorCode
from .limits import AdapterLimits
from .peft_config import parse_lora_config
from .safetensors_file import read_header, read_tensors
from .spec import BaseModelSpec
from .store import read_entry

log = logging.getLogger(__name__)
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


_ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


def load_adapter(path: str | Path, spec: BaseModelSpec, limits: AdapterLimits | None = None) -> CanonicalAdapter:
    """Validate the adapter at `path` against `spec` and return its canonical weights.

    `path` may be: a folder holding adapter_config.json + adapter_model.safetensors (directly or in one
    sub-folder); either of those two files; a .zip / .tar / .tar.gz / .tgz of such a folder; or a canonical
    entry written by an AdapterStore. Raises AdapterValidationError naming the first problem found.
    """
    limits = _for_model(limits or AdapterLimits(), spec)
    try:
        return _load(Path(path), spec, limits)
    except AdapterValidationError:
        raise
    except RecursionError:
        raise AdapterValidationError("the adapter is nested too deeply to read", ErrorCode.UNREADABLE) from None
    except Exception as exc:
        # A file no check above foresaw: still a refusal (the caller marks the upload failed), not a crash,
        # with the details in the log.
        log.warning("adapter %s could not be read", path, exc_info=True)
        detail = re.sub(r"\S*loraplex-adapter-[^/\s'\"]*/?", "", str(exc))  # no scratch folder paths
        raise AdapterValidationError(f"the adapter could not be read ({type(exc).__name__}: {detail})"[:500],
                                     ErrorCode.UNREADABLE) from exc


# Files an adapter folder may hold beside its weights (a README, a tokenizer's files), in all.
_OTHER_FILES_BYTES = 64 * 1024 * 1024


def _weights_bound(spec: BaseModelSpec, limits: AdapterLimits) -> int:
    return spec.max_adapter_bytes(limits.max_rank) + limits.max_header_bytes


def _for_model(limits: AdapterLimits, spec: BaseModelSpec) -> AdapterLimits:
    """The limits, with what an archive may inflate to cut down to what an adapter of this model can need:
    a small archive of zeros must not fill the disk before its content is found to be no adapter."""
    weights = _weights_bound(spec, limits)
    return dataclasses.replace(limits, max_member_bytes=min(limits.max_member_bytes, weights),
                               max_total_bytes=min(limits.max_total_bytes, weights + _OTHER_FILES_BYTES))


def _check_weights_size(path: Path, spec: BaseModelSpec, limits: AdapterLimits) -> None:
    """Refuse a weights file larger than any adapter of this model before reading its tensors."""
    size, most = path.stat().st_size, _weights_bound(spec, limits)
    if size > most:
        raise AdapterValidationError(
            f"{path.name} is {size} bytes, more than a LoRA adapter of rank <= {limits.max_rank} for this base "
            f"model can take ({most} bytes with its header)", ErrorCode.ARCHIVE_MEMBER_TOO_LARGE)


def _load(path: Path, spec: BaseModelSpec, limits: AdapterLimits) -> CanonicalAdapter:
    if not path.exists():
        raise AdapterValidationError(f"adapter {path} does not exist", ErrorCode.NOT_FOUND)
    if path.is_dir():
        return _load_dir(path, spec, limits)
    _refuse_pickle(path)
    if path.name == CONFIG_NAME:
        return _load_pair(path, path.with_name(WEIGHTS_NAME), spec, limits)
    if path.suffix == ".safetensors":
        try:
            entry = _load_canonical_entry(path, spec, limits)
        except AdapterValidationError as exc:
            refusal = _config_refusal(lambda: _small_config([path.with_name(CONFIG_NAME)], limits), spec, limits, exc)
            if refusal is None:
                raise
            raise refusal from exc
        if entry is not None:
            return entry
        return _load_pair(path.with_name(CONFIG_NAME), path, spec, limits)
    if path.is_file() and path.stat().st_size == 0:
        raise AdapterValidationError(f"{path.name} is empty (0 bytes)", ErrorCode.ARCHIVE_CORRUPT
                                     if path.name.lower().endswith(_ARCHIVE_SUFFIXES) else ErrorCode.UNSUPPORTED_FORMAT)
    if archive_kind(path) is None:
        if path.name.lower().endswith(_ARCHIVE_SUFFIXES):
            raise AdapterValidationError(
                f"{path.name} is named like an archive but its content is not a zip or tar archive",
                ErrorCode.ARCHIVE_CORRUPT)
        raise AdapterValidationError(
            f"{path.name} is not an adapter folder, a .zip or .tar.gz archive, or a safetensors file",
            ErrorCode.UNSUPPORTED_FORMAT)
    with tempfile.TemporaryDirectory(prefix="loraplex-adapter-", ignore_cleanup_errors=True) as tmp:
        try:
            safe_extract(path, tmp, limits)
        except AdapterValidationError as exc:
            refusal = _config_refusal(lambda: _archived_config(path, Path(tmp), limits), spec, limits, exc)
            if refusal is None:
                raise
            raise refusal from exc
        return _load_dir(Path(tmp), spec, limits)


# An adapter refused for its size may declare in its adapter_config.json (always small) something refused
# whatever the size: modules_to_save makes the weights file large, and that is the reason to give, for a
# smaller file would be refused too.
_SIZE_CODES = (ErrorCode.ARCHIVE_MEMBER_TOO_LARGE, ErrorCode.ARCHIVE_TOO_LARGE)


def _config_refusal(read_config: Callable[[], bytes | None], spec: BaseModelSpec, limits: AdapterLimits,
                    error: AdapterValidationError) -> AdapterValidationError | None:
    """For a refusal for size: the config's own refusal, naming the size refusal too. None when `error` is
    no size refusal, or there is no config to be had, or the config is accepted."""
    if error.code not in _SIZE_CODES:
        return None
    raw = read_config()
    if raw is None:
        return None
    try:
        config = json.loads(raw.decode("utf-8"))
        parse_lora_config(config, spec, limits)
    except AdapterValidationError as refusal:
        return AdapterValidationError(f"{refusal.message}. The adapter is also over a size limit: "
                                      f"{error.message}", refusal.code)
    except (UnicodeDecodeError, ValueError, RecursionError):
        pass  # a config too broken to parse (or cut short by the limit) says nothing surer than the size
    return None


def _archived_config(archive: Path, extracted: Path, limits: AdapterLimits) -> bytes | None:
    """adapter_config.json of an archive refused for its size, where it can be had without inflating the
    refused member: from a zip's directory, or among what a tar gave before that member (a tar is read in
    order, and a compressed one cannot be skipped through)."""
    if archive_kind(archive) == "zip":
        return read_zip_member(archive, _is_config_path, limits.max_config_bytes, limits.max_members)
    return _small_config([extracted / CONFIG_NAME, *(d / CONFIG_NAME for d in extracted.iterdir() if d.is_dir())],
                         limits)


def _is_config_path(parts: tuple[str, ...]) -> bool:
    return parts[-1] == CONFIG_NAME and len(parts) <= 2  # where _load_dir looks for it


def _small_config(candidates: list[Path], limits: AdapterLimits) -> bytes | None:
    """The content of the one existing file among `candidates`, if within the config size limit."""
    found = [c for c in candidates if c.is_file()]
    if len(found) != 1 or found[0].stat().st_size > limits.max_config_bytes:
        return None
    return found[0].read_bytes()


def _refuse_pickle(path: Path, beside_adapter: bool = False) -> None:
    """`beside_adapter`: the file sits in an adapter folder or archive, where it may be another file than the
    weights (the training_args.bin the Hugging Face Trainer saves beside every adapter, an optimizer.pt)."""
    if not path.name.lower().endswith(PICKLE_SUFFIXES):
        return
    why = f"{path.name} is a pickle file ({path.suffix}); pickles can run code when loaded and are never opened"
    if beside_adapter and (not path.name.lower().startswith("adapter_model.")
                           or path.with_name(WEIGHTS_NAME).is_file()):
        raise AdapterValidationError(
            f"{why}, and an adapter with one is refused. The adapter needs only {CONFIG_NAME} and {WEIGHTS_NAME}: "
            f"leave {path.name} out (older PEFT versions save adapter_model.bin beside the safetensors file, the "
            f"Hugging Face Trainer saves training_args.bin, and checkpoints hold optimizer pickles)",
            ErrorCode.PICKLE_FILE)
    raise AdapterValidationError(
        f"{why}. Save the adapter with safetensors (save_pretrained(..., safe_serialization=True))",
        ErrorCode.PICKLE_FILE)


def _load_dir(root: Path, spec: BaseModelSpec, limits: AdapterLimits) -> CanonicalAdapter:
    configs = []
    members = 0
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in dirnames + filenames:
            members += 1
            if members > limits.max_members:
                raise AdapterValidationError(f"adapter folder has more than {limits.max_members} entries",
                                             ErrorCode.ARCHIVE_TOO_MANY_MEMBERS)
            entry = here / name
            rel = entry.relative_to(root)
            if name in filenames:
                # A folder is named by a trusted caller (uploads arrive as archives, which may hold no links),
                # so links to files are followed, as in the Hugging Face cache; a FIFO or device is not a file.
                if not entry.is_file():
                    raise AdapterValidationError(f"{rel} is not a regular file", ErrorCode.ARCHIVE_SPECIAL_FILE)
                _refuse_pickle(entry, beside_adapter=True)
                if name == CONFIG_NAME:
                    configs.append(entry)
    # PEFT writes the two files at the top; archives often wrap them in one folder named after the adapter.
    deeper = sorted(str(c.relative_to(root)) for c in configs if len(c.relative_to(root).parts) > 2)
    configs = [c for c in configs if len(c.relative_to(root).parts) <= 2]
    if not members:
        raise AdapterValidationError(f"the adapter is empty: no {CONFIG_NAME} or {WEIGHTS_NAME} in it",
                                     ErrorCode.MISSING_CONFIG)
    if not configs:
        raise AdapterValidationError(f"no {CONFIG_NAME} at the top of the adapter or in one sub-folder"
                                     f"{_what_is_there(root, deeper)}", ErrorCode.MISSING_CONFIG)
    if len(configs) > 1:
        where = ", ".join(sorted(str(c.relative_to(root)) for c in configs))
        raise AdapterValidationError(f"more than one {CONFIG_NAME} ({where}); upload one adapter at a time",
                                     ErrorCode.AMBIGUOUS_ADAPTER)
    return _load_pair(configs[0], configs[0].with_name(WEIGHTS_NAME), spec, limits)


def _what_is_there(root: Path, deeper: list[str]) -> str:
    """For a folder with no adapter where one is looked for: the adapters found deeper down, or that it holds
    a whole model (its config.json and weights), which is no adapter."""
    if deeper:
        shown = ", ".join(deeper[:3]) + (f" and {len(deeper) - 3} more" if len(deeper) > 3 else "")
        return (f"; found {shown}, deeper than that: give the folder that holds it, or archive the adapter's own "
                f"folder")
    for folder in (root, *(d for d in root.iterdir() if d.is_dir())):
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            where = "" if folder == root else f" ({folder.name})"
            return (f"; it holds a whole model{where} (config.json and its weights), not a LoRA adapter, which PEFT "
                    f"saves as {CONFIG_NAME} and {WEIGHTS_NAME}")
    return ""


def _load_pair(config_path: Path, weights_path: Path, spec: BaseModelSpec, limits: AdapterLimits) -> CanonicalAdapter:
    if not config_path.is_file():
        raise AdapterValidationError(f"missing {CONFIG_NAME} next to {weights_path.name}", ErrorCode.MISSING_CONFIG)
    if not weights_path.is_file():
        raise AdapterValidationError(f"missing {WEIGHTS_NAME} next to {CONFIG_NAME}", ErrorCode.MISSING_WEIGHTS)
    size = config_path.stat().st_size
    if size > limits.max_config_bytes:
        raise AdapterValidationError(f"{CONFIG_NAME} is {size} bytes, over the limit of {limits.max_config_bytes}",
                                     ErrorCode.CONFIG_INVALID)
    if size == 0:
        raise AdapterValidationError(f"{CONFIG_NAME} is empty (0 bytes)", ErrorCode.CONFIG_INVALID)
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise AdapterValidationError(f"{CONFIG_NAME} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                                     f"JSON files are UTF-8", ErrorCode.CONFIG_INVALID) from exc
    except ValueError as exc:
        raise AdapterValidationError(f"{CONFIG_NAME} is not valid JSON: {exc}", ErrorCode.CONFIG_INVALID) from exc
    except RecursionError:
        raise AdapterValidationError(f"{CONFIG_NAME} is JSON nested too deeply", ErrorCode.CONFIG_INVALID) from None
    settings = parse_lora_config(config, spec, limits)
    _check_weights_size(weights_path, spec, limits)
    tensors, _ = read_tensors(weights_path, limits)
    return to_canonical(tensors, settings, spec)


def _load_canonical_entry(path: Path, spec: BaseModelSpec, limits: AdapterLimits) -> CanonicalAdapter | None:
    _check_weights_size(path, spec, limits)
    _, _, meta = read_header(path, limits)
    if meta.get("format") != FORMAT:
        return None
    # a file from outside the store (a user's upload or path) is checked as a PEFT file would be
    adapter = read_entry(path, verify=True)
    adapter.check_compatible(spec)
    if adapter.rank > limits.max_rank:
        raise AdapterValidationError(f"{path.name}: rank {adapter.rank} is over the rank limit of {limits.max_rank}",
                                     ErrorCode.RANK_TOO_LARGE)
    return adapter
