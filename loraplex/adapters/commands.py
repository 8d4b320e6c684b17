"""`loraplex adapter ...`: check a PEFT adapter against a base model, and manage a local store."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .errors import AdapterValidationError
from .limits import AdapterLimits
from .loader import load_adapter
from .spec import BaseModelSpec
from .store import LocalAdapterStore


@click.group()
def adapter() -> None:
    """Validate adapters and manage the adapter store."""


@adapter.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--model", "model", default=None,
              help="Base model, as `generate` takes it: a folder, a .gguf file, a Hub id or a built-in name "
                   "(its config decides the shapes an adapter must fit) [default: LORAPLEX_MODEL, smollm2-135m: "
                   "what the server's uploads are checked against].")
@click.option("--max-rank", default=None, type=click.IntRange(1, 4096),
              help="Largest accepted rank [default: LORAPLEX_MAX_LORA_RANK, 64].")
@click.option("--store", "store_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Also put the canonical weights into this local store.")
def validate(path: Path, model: str | None, max_rank: int | None, store_dir: Path | None) -> None:
    """Validate the adapter at PATH (folder, file pair, .zip, .tar.gz); print its version as JSON."""
    from loraplex.engine.errors import ModelLoadError
    from loraplex.engine.model_loader import resolve_model_dir

    # a refused rank names where its limit came from: this flag, or the setting the server checks uploads with
    rank_from = "--max-rank" if max_rank is not None else "the max_lora_rank setting, LORAPLEX_MAX_LORA_RANK"
    if model is None or max_rank is None:  # as the server checks an upload
        settings = _settings()
        model = model or settings.model
        max_rank = max_rank or settings.max_lora_rank
    try:
        model_dir = resolve_model_dir(model)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        spec = BaseModelSpec.from_model_dir(model_dir)
    except AdapterValidationError as exc:
        raise click.ClickException(f"base model {model}: {exc}") from exc
    # The store is opened first, so that a store that cannot be used is said before a long validation.
    store = _open_store(store_dir) if store_dir is not None else None
    try:
        canonical = load_adapter(path, spec, AdapterLimits(max_rank=max_rank, max_rank_from=rank_from))
    except AdapterValidationError as exc:
        raise click.ClickException(f"refused ({exc.code.value}): {exc}") from exc
    report = {
        "content_hash": canonical.content_hash,
        "architecture": canonical.architecture,
        "rank": canonical.rank,
        "target_modules": list(canonical.target_modules),
        "layers": len(canonical.layers),
        "bytes": canonical.nbytes,
    }
    if store is not None:
        try:
            report["stored_at"] = store.put(canonical)
        except OSError as exc:
            raise click.ClickException(f"the adapter is valid but could not be written to the store "
                                       f"{store_dir}: {exc.strerror or exc}") from exc
    click.echo(json.dumps(report, indent=2))


def _settings():
    from pydantic import ValidationError

    from loraplex.config import Settings

    try:
        return Settings()
    except ValidationError as exc:  # said as `loraplex serve` says it, naming each environment variable
        problems = [(f"LORAPLEX_{str(e['loc'][0]).upper()}: " if e.get("loc") else "")
                    + e["msg"].removeprefix("Value error, ") for e in exc.errors()]
        raise click.ClickException(f"cannot read the settings: {'; '.join(problems)}") from exc


def _settings_store_dir() -> Path:
    """The store the server uses (LORAPLEX_ADAPTER_STORE_DIR, else $LORAPLEX_DATA_DIR/adapters): where the
    store options point when not given, so `loraplex adapter list` run beside the server needs no --store."""
    return _settings().resolved_adapter_store_dir


@adapter.command("list")
@click.option("--store", "store_dir", default=_settings_store_dir, show_default="the server's adapter store",
              type=click.Path(exists=True, file_okay=False, path_type=Path))
def list_versions(store_dir: Path) -> None:
    """List the content hashes held by a local store."""
    store = _open_store(store_dir)
    try:
        hashes = store.list()
    except OSError as exc:
        raise click.ClickException(f"cannot read the adapter store {store_dir}: {exc.strerror or exc}") from exc
    if not hashes:  # on stderr: stdout stays one hash a line for scripts
        click.echo(f"the adapter store {store_dir} holds no adapters yet", err=True)
    for content_hash in hashes:
        click.echo(content_hash)


def _open_store(store_dir: Path) -> LocalAdapterStore:
    try:
        return LocalAdapterStore(store_dir)
    except OSError as exc:
        # e.g. a parent that is a file, no permission, a read-only file system
        raise click.ClickException(f"cannot use {store_dir} as the adapter store: {exc.strerror or exc}") from exc
