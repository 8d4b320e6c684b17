"""Archives and folders: safe unpacking, pickles, layout; and the hash does not depend on the container."""

from __future__ import annotations

import io
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest
from adapter_helpers import refused

from loraplex.adapters import AdapterLimits, AdapterValidationError, ErrorCode, load_adapter, safe_extract

FILES = ("adapter_config.json", "adapter_model.safetensors")



def _zip(path: Path, src: Path, prefix: str = "", extra: dict[str, bytes] | None = None, reverse=False) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(FILES, reverse=reverse):
            zf.write(src / name, prefix + name)
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return path


def _tar(path: Path, src: Path, prefix: str = "", mode: str = "w:gz", extra=()) -> Path:
    with tarfile.open(path, mode) as tf:
        for name in FILES:
            tf.add(src / name, prefix + name)
        for info, data in extra:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _tar_dot(path: Path, src: Path) -> Path:
    """As `tar czf path -C src .` makes it: members "./", "./adapter_config.json", ..."""
    with tarfile.open(path, "w:gz") as tf:
        tf.add(src, arcname=".")
    return path


def test_same_hash_from_every_container(llama_adapter_dir, llama_spec, tmp_path):
    reference = load_adapter(llama_adapter_dir, llama_spec).content_hash
    containers = [
        llama_adapter_dir / "adapter_config.json",
        llama_adapter_dir / "adapter_model.safetensors",
        _zip(tmp_path / "a.zip", llama_adapter_dir),
        _zip(tmp_path / "b.zip", llama_adapter_dir, prefix="my-adapter/", reverse=True,
             extra={"my-adapter/README.md": b"hi"}),
        _tar(tmp_path / "c.tar.gz", llama_adapter_dir, prefix="my-adapter/"),
        _tar(tmp_path / "d.tgz", llama_adapter_dir),
        _tar(tmp_path / "e.tar", llama_adapter_dir, mode="w"),
        _tar(tmp_path / "upload.bin.tmp", llama_adapter_dir, mode="w:bz2"),  # sniffed, not named
        _tar_dot(tmp_path / "dot.tar.gz", llama_adapter_dir),
    ]
    for container in containers:
        assert load_adapter(container, llama_spec).content_hash == reference, container.name


def test_nested_folder_in_a_folder(llama_adapter_dir, llama_spec, tmp_path):
    shutil.copytree(llama_adapter_dir, tmp_path / "outer" / "inner")
    assert load_adapter(tmp_path / "outer", llama_spec).content_hash == \
        load_adapter(llama_adapter_dir, llama_spec).content_hash
    shutil.copytree(llama_adapter_dir, tmp_path / "deep" / "a" / "b")
    refused(tmp_path / "deep", llama_spec, ErrorCode.MISSING_CONFIG, "adapter_config.json")


def test_two_adapters_in_one_archive(llama_adapter_dir, llama_spec, tmp_path):
    path = tmp_path / "two.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for prefix in ("a/", "b/"):
            for name in FILES:
                zf.write(llama_adapter_dir / name, prefix + name)
    refused(path, llama_spec, ErrorCode.AMBIGUOUS_ADAPTER, "a/adapter_config.json", "b/adapter_config.json")


@pytest.mark.parametrize("name", ["adapter_model.bin", "training_args.bin", "optimizer.pt", "x.pkl",
                                  "rng_state.pth", "last.ckpt"])
def test_pickle_in_archive_is_refused_unopened(llama_adapter_dir, llama_spec, tmp_path, name):
    # the pickle's bytes would run code if unpickled; refusing by name means they are never read
    path = _zip(tmp_path / "p.zip", llama_adapter_dir, extra={f"sub/{name}": b"\x80\x04cos\nsystem\n"})
    refused(path, llama_spec, ErrorCode.PICKLE_FILE, name, "pickle", "safetensors")


def test_pickle_only_folder_and_direct_pickle(llama_adapter_dir, llama_spec, tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    shutil.copy(llama_adapter_dir / "adapter_config.json", folder)
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04.")
    refused(folder, llama_spec, ErrorCode.PICKLE_FILE, "adapter_model.bin")
    refused(folder / "adapter_model.bin", llama_spec, ErrorCode.PICKLE_FILE, "adapter_model.bin")
    (tmp_path / "weights.PT").write_bytes(b"\x80\x04.")
    refused(tmp_path / "weights.PT", llama_spec, ErrorCode.PICKLE_FILE, "weights.PT")


def test_missing_files(llama_adapter_dir, llama_spec, tmp_path):
    only_config = tmp_path / "c"
    only_config.mkdir()
    shutil.copy(llama_adapter_dir / "adapter_config.json", only_config)
    refused(only_config, llama_spec, ErrorCode.MISSING_WEIGHTS, "adapter_model.safetensors")
    only_weights = tmp_path / "w"
    only_weights.mkdir()
    shutil.copy(llama_adapter_dir / "adapter_model.safetensors", only_weights)
    refused(only_weights, llama_spec, ErrorCode.MISSING_CONFIG, "adapter_config.json")
    refused(only_weights / "adapter_model.safetensors", llama_spec, ErrorCode.MISSING_CONFIG)
    refused(tmp_path / "nothing-here", llama_spec, ErrorCode.NOT_FOUND, "nothing-here")


def test_not_an_archive(llama_spec, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    refused(tmp_path / "notes.txt", llama_spec, ErrorCode.UNSUPPORTED_FORMAT, "notes.txt")
    (tmp_path / "broken.zip").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    refused(tmp_path / "broken.zip", llama_spec, ErrorCode.ARCHIVE_CORRUPT, "broken.zip")
    (tmp_path / "broken.tgz").write_bytes(b"\x1f\x8b" + b"\0" * 100)
    refused(tmp_path / "broken.tgz", llama_spec, ErrorCode.ARCHIVE_CORRUPT, "broken.tgz")


def test_links_in_a_trusted_folder_are_followed_to_files(llama_adapter_dir, llama_spec, tmp_path):
    # the Hugging Face cache keeps snapshots as links to blobs; a folder path comes from a trusted caller
    folder = tmp_path / "snapshot"
    folder.mkdir()
    for name in FILES:
        (folder / name).symlink_to(llama_adapter_dir / name)
    assert load_adapter(folder, llama_spec) == load_adapter(llama_adapter_dir, llama_spec)


def test_fifo_in_folder(llama_adapter_dir, llama_spec, tmp_path):
    import os

    folder = tmp_path / "a"
    shutil.copytree(llama_adapter_dir, folder)
    os.mkfifo(folder / "pipe")
    refused(folder, llama_spec, ErrorCode.ARCHIVE_SPECIAL_FILE, "pipe", "not a regular file")


def test_file_named_dot(tmp_path):
    archive = _zip_member(tmp_path / "dot.zip", ".", b"data")
    (tmp_path / "dest").mkdir()
    with pytest.raises(AdapterValidationError) as info:
        safe_extract(archive, tmp_path / "dest")
    assert info.value.code == ErrorCode.ARCHIVE_UNSAFE_PATH


def test_file_and_folder_with_one_name(tmp_path):
    archive = tmp_path / "clash.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("a", b"file")
        zf.writestr("a/b", b"file below a file")
    (tmp_path / "dest").mkdir()
    with pytest.raises(AdapterValidationError) as info:
        safe_extract(archive, tmp_path / "dest")
    assert info.value.code == ErrorCode.ARCHIVE_UNSAFE_PATH and "both a file and a folder" in str(info.value)


# --- unsafe members: each refused, nothing written outside the destination --------------------------


def _zip_member(path: Path, name: str, data: bytes = b"x", mode: int | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo(name)
        if mode is not None:
            info.external_attr = mode << 16
        zf.writestr(info, data)
    return path


@pytest.mark.parametrize(("name", "mode", "code", "word"), [
    ("../evil.txt", None, ErrorCode.ARCHIVE_UNSAFE_PATH, ".."),
    ("a/../../evil.txt", None, ErrorCode.ARCHIVE_UNSAFE_PATH, ".."),
    ("..\\evil.txt", None, ErrorCode.ARCHIVE_UNSAFE_PATH, ".."),
    ("/tmp/evil.txt", None, ErrorCode.ARCHIVE_UNSAFE_PATH, "absolute"),
    ("C:/evil.txt", None, ErrorCode.ARCHIVE_UNSAFE_PATH, "absolute"),
    ("link", stat.S_IFLNK | 0o777, ErrorCode.ARCHIVE_LINK, "symbolic link"),
    ("link2", stat.S_IFLNK | 0o777, ErrorCode.ARCHIVE_LINK, "Archive the files the links point to"),
    ("fifo", stat.S_IFIFO | 0o644, ErrorCode.ARCHIVE_SPECIAL_FILE, "not a regular file"),
])
def test_unsafe_zip_members(tmp_path, name, mode, code, word):
    archive = _zip_member(tmp_path / "bad.zip", name, b"/etc/passwd", mode)
    dest = tmp_path / "sandbox" / "dest"
    dest.mkdir(parents=True)
    with pytest.raises(AdapterValidationError) as info:
        safe_extract(archive, dest)
    assert info.value.code == code and word in str(info.value), str(info.value)
    assert list(dest.iterdir()) == [] and not (tmp_path / "sandbox" / "evil.txt").exists()
    assert not (tmp_path / "evil.txt").exists()


def _tar_info(name: str, kind: bytes, **fields) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in fields.items():
        setattr(info, k, v)
    return info


@pytest.mark.parametrize(("info", "code", "word"), [
    (_tar_info("evil", tarfile.SYMTYPE, linkname="/etc/passwd"), ErrorCode.ARCHIVE_LINK, "/etc/passwd"),
    (_tar_info("hard", tarfile.LNKTYPE, linkname="adapter_config.json"), ErrorCode.ARCHIVE_LINK, "link"),
    # a Hugging Face cache snapshot archived as it is: links to its blobs
    (_tar_info("./adapter_model.safetensors", tarfile.SYMTYPE, linkname="../../blobs/1e7a"), ErrorCode.ARCHIVE_LINK,
     "tar -h or --dereference"),
    (_tar_info("dev", tarfile.CHRTYPE, devmajor=1, devminor=3), ErrorCode.ARCHIVE_SPECIAL_FILE, "device"),
    (_tar_info("disk", tarfile.BLKTYPE, devmajor=8, devminor=0), ErrorCode.ARCHIVE_SPECIAL_FILE, "device"),
    (_tar_info("pipe", tarfile.FIFOTYPE), ErrorCode.ARCHIVE_SPECIAL_FILE, "FIFO"),
    (_tar_info("../up.txt", tarfile.REGTYPE), ErrorCode.ARCHIVE_UNSAFE_PATH, ".."),
    (_tar_info("/abs.txt", tarfile.REGTYPE), ErrorCode.ARCHIVE_UNSAFE_PATH, "absolute"),
])
def test_unsafe_tar_members(llama_adapter_dir, llama_spec, tmp_path, info, code, word):
    archive = _tar(tmp_path / "bad.tar.gz", llama_adapter_dir, extra=[(info, b"" if info.isreg() else None)])
    refused(archive, llama_spec, code, word)
    assert not (tmp_path / "up.txt").exists() and not Path("/abs.txt").exists()


def test_link_then_write_through_it(tmp_path):
    # a classic: a symlink "d" -> /tmp, then "d/x"; refused at the link, before any write
    archive = tmp_path / "chain.tar"
    with tarfile.open(archive, "w") as tf:
        tf.addfile(_tar_info("d", tarfile.SYMTYPE, linkname=str(tmp_path / "outside")))
        data = b"payload"
        tf.addfile(_tar_info("d/x", tarfile.REGTYPE, size=len(data)), io.BytesIO(data))
    (tmp_path / "outside").mkdir()
    (tmp_path / "dest").mkdir()
    with pytest.raises(AdapterValidationError):
        safe_extract(archive, tmp_path / "dest")
    assert list((tmp_path / "outside").iterdir()) == []


def test_zip_bomb_stops_at_total_limit(tmp_path):
    archive = tmp_path / "bomb.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for i in range(3):
            zf.writestr(f"zeros{i}", b"\0" * (4 << 20))  # 12 MiB inflated from ~12 KiB
    assert archive.stat().st_size < 100_000
    limits = AdapterLimits(max_total_bytes=10 << 20)
    (tmp_path / "dest").mkdir()
    with pytest.raises(AdapterValidationError) as info:
        safe_extract(archive, tmp_path / "dest", limits)
    assert info.value.code == ErrorCode.ARCHIVE_TOO_LARGE and "in total" in str(info.value)


def test_lying_zip_member_is_cut_off(tmp_path):
    # the headers claim 100 bytes while the data inflates to 8 MiB: reading stops at the claim
    archive = tmp_path / "liar.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("big", b"\0" * (8 << 20))
    raw = bytearray(archive.read_bytes())
    size = (8 << 20).to_bytes(4, "little")
    for at in [i for i in range(len(raw) - 3) if raw[i:i + 4] == size]:
        raw[at:at + 4] = (100).to_bytes(4, "little")
    archive.write_bytes(bytes(raw))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(AdapterValidationError) as info:
        safe_extract(archive, dest, AdapterLimits(max_member_bytes=1 << 20))
    assert info.value.code in (ErrorCode.ARCHIVE_CORRUPT, ErrorCode.ARCHIVE_MEMBER_TOO_LARGE)
    assert sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()) <= 1 << 20


def test_tar_bomb_member_over_limit(tmp_path):
    archive = tmp_path / "bomb.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        data = b"\0" * (3 << 20)
        tf.addfile(_tar_info("zeros", tarfile.REGTYPE, size=len(data)), io.BytesIO(data))
    (tmp_path / "dest").mkdir()
    with pytest.raises(AdapterValidationError) as info:
        safe_extract(archive, tmp_path / "dest", AdapterLimits(max_member_bytes=1 << 20))
    assert info.value.code == ErrorCode.ARCHIVE_MEMBER_TOO_LARGE and "'zeros'" in str(info.value)
    assert not (tmp_path / "dest" / "zeros").exists()


def test_streamed_copy_stops_at_the_limit(tmp_path):
    # a member whose declared size passes but whose stream does not (what a lying decompressor gives)
    from loraplex.adapters.archive import _Budget

    class Endless(io.RawIOBase):
        def read(self, n=-1):
            return b"\0" * (n if n and n > 0 else 4096)

    budget = _Budget(AdapterLimits(max_member_bytes=3 << 20))
    with pytest.raises(AdapterValidationError) as info:
        budget.copy("endless", Endless(), tmp_path / "out")
    assert info.value.code == ErrorCode.ARCHIVE_MEMBER_TOO_LARGE
    assert (tmp_path / "out").stat().st_size <= 3 << 20


def test_too_many_members(llama_adapter_dir, llama_spec, tmp_path):
    extra = {f"junk/{i}.txt": b"" for i in range(10)}
    archive = _zip(tmp_path / "many.zip", llama_adapter_dir, extra=extra)
    refused(archive, llama_spec, ErrorCode.ARCHIVE_TOO_MANY_MEMBERS, "more than 8",
             limits=AdapterLimits(max_members=8))
    assert load_adapter(archive, llama_spec, AdapterLimits(max_members=20)).rank == 8


def test_zip_declaring_many_members_is_refused_before_parsing(tmp_path):
    archive = tmp_path / "many.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(200):
            zf.writestr(f"{i}", b"")
    with pytest.raises(AdapterValidationError) as info:
        safe_extract(archive, tmp_path, AdapterLimits(max_members=100))
    assert info.value.code == ErrorCode.ARCHIVE_TOO_MANY_MEMBERS and "declares 200" in str(info.value)


def test_archive_file_over_limit(llama_adapter_dir, llama_spec, tmp_path):
    archive = _zip(tmp_path / "a.zip", llama_adapter_dir)
    refused(archive, llama_spec, ErrorCode.ARCHIVE_TOO_LARGE, "a.zip", limits=AdapterLimits(max_archive_bytes=1000))


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_duplicate_member(llama_adapter_dir, llama_spec, tmp_path):
    archive = tmp_path / "dup.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in FILES:
            zf.write(llama_adapter_dir / name, name)
        zf.writestr("adapter_config.json", b"{}")
    refused(archive, llama_spec, ErrorCode.ARCHIVE_UNSAFE_PATH, "twice")


def test_empty_files_and_archives_are_named_as_empty(llama_adapter_dir, llama_spec, tmp_path):
    """A zero-byte upload or file (a failed download, a copy that never ran) is said to be empty, not
    described by the parse error it makes."""
    for name, code in (("a.zip", ErrorCode.ARCHIVE_CORRUPT), ("a.tar.gz", ErrorCode.ARCHIVE_CORRUPT),
                       ("adapter", ErrorCode.UNSUPPORTED_FORMAT)):
        (tmp_path / name).write_bytes(b"")
        refused(tmp_path / name, llama_spec, code, f"{name} is empty (0 bytes)")
    with zipfile.ZipFile(tmp_path / "none.zip", "w"):
        pass
    refused(tmp_path / "none.zip", llama_spec, ErrorCode.MISSING_CONFIG, "the adapter is empty")
    for name, code in (("adapter_config.json", ErrorCode.CONFIG_INVALID),
                       ("adapter_model.safetensors", ErrorCode.SAFETENSORS_CORRUPT)):
        folder = tmp_path / f"empty-{name}"
        shutil.copytree(llama_adapter_dir, folder)
        (folder / name).write_bytes(b"")
        refused(folder, llama_spec, code, f"{name}", "is empty (0 bytes)")


def test_a_pickle_beside_a_safetensors_adapter_is_to_be_left_out(llama_adapter_dir, llama_spec, tmp_path):
    """`trainer.save_model(folder)` writes training_args.bin beside the adapter, and older PEFT versions wrote
    adapter_model.bin beside adapter_model.safetensors: the refusal says to leave the pickle out, not to save the
    adapter with safetensors, which it already is. A folder whose only weights are a pickle is told that."""
    for name in ("training_args.bin", "adapter_model.bin", "optimizer.pt"):
        folder = tmp_path / name
        shutil.copytree(llama_adapter_dir, folder)
        (folder / name).write_bytes(b"\x80\x04.")
        error = refused(folder, llama_spec, ErrorCode.PICKLE_FILE, f"leave {name} out")
        assert "Save the adapter with safetensors" not in str(error)
        refused(_zip(tmp_path / f"{name}.zip", folder, extra={name: b"\x80\x04."}), llama_spec, ErrorCode.PICKLE_FILE,
                f"leave {name} out")
    only_pickle = tmp_path / "old"
    only_pickle.mkdir()
    shutil.copy(llama_adapter_dir / "adapter_config.json", only_pickle)
    (only_pickle / "adapter_model.bin").write_bytes(b"\x80\x04.")
    refused(only_pickle, llama_spec, ErrorCode.PICKLE_FILE, "Save the adapter with safetensors")


def test_an_adapter_too_deep_or_a_whole_model_is_named(llama_adapter_dir, llama_spec, tiny_llama_dir, tmp_path):
    """`zip -r adapter.zip outputs/checkpoint-500` puts the adapter two folders down, deeper than is looked in:
    the refusal names where it is. A model folder given as the adapter (a merged model, or the base model by
    mistake) is said to be a whole model."""
    deep = _zip(tmp_path / "deep.zip", llama_adapter_dir, prefix="outputs/checkpoint-500/")
    refused(deep, llama_spec, ErrorCode.MISSING_CONFIG, "found outputs/checkpoint-500/adapter_config.json")
    refused(tiny_llama_dir, llama_spec, ErrorCode.MISSING_CONFIG, "it holds a whole model", "not a LoRA adapter")
