"""Small archives that would cost far more than their size to read: refused before the cost is paid."""

from __future__ import annotations

import io
import struct
import tarfile
import zipfile
from pathlib import Path

from adapter_helpers import refused

from loraplex.adapters import ErrorCode
from loraplex.adapters.archive import MAX_TAR_LONG_NAME_BYTES, MAX_TAR_PAX_BYTES

FILES = ("adapter_config.json", "adapter_model.safetensors")


def _header(name: str, size: int, kind: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _truncated_tar(path: Path, kind: bytes, size: int) -> Path:
    """A tar whose first header announces an extended header of `size` bytes followed by only 1 KB of it:
    reading the announced part would need `size` bytes of memory (and find the end of the file)."""
    path.write_bytes(_header("././@LongLink" if kind == tarfile.GNUTYPE_LONGNAME else "pax", size, kind)
                     + b"a" * 1024)
    return path


def test_tar_long_name_header_is_sized_before_it_is_read(llama_spec, tmp_path):
    archive = _truncated_tar(tmp_path / "long.tar", tarfile.GNUTYPE_LONGNAME, 512 * 1024 * 1024)
    refused(archive, llama_spec, ErrorCode.ARCHIVE_UNSAFE_PATH, "long-name header of 536870912 bytes",
            str(MAX_TAR_LONG_NAME_BYTES))


def test_tar_pax_header_is_sized_before_it_is_read(llama_spec, tmp_path):
    archive = _truncated_tar(tmp_path / "pax.tar", tarfile.XHDTYPE, 256 * 1024 * 1024)
    refused(archive, llama_spec, ErrorCode.ARCHIVE_CORRUPT, "extended (pax) header of 268435456 bytes",
            str(MAX_TAR_PAX_BYTES))


def test_tar_long_names_an_adapter_uses_still_read(llama_adapter_dir, llama_spec, tmp_path):
    """GNU long names and pax headers of ordinary size pass (a name past ustar's 100 characters needs one)."""
    prefix = "d" * 200 + "/"
    for fmt, name in ((tarfile.GNU_FORMAT, "gnu.tar.gz"), (tarfile.PAX_FORMAT, "pax.tar.gz")):
        with tarfile.open(tmp_path / name, "w:gz", format=fmt) as tf:
            for file in FILES:
                tf.add(llama_adapter_dir / file, prefix + file)
        from loraplex.adapters import load_adapter

        assert load_adapter(tmp_path / name, llama_spec).rank == 8


def test_tar_sparse_member_is_refused_before_its_map_is_read(llama_spec, tmp_path):
    archive = tmp_path / "sparse.tar"
    archive.write_bytes(_header("holes.bin", 1024, tarfile.GNUTYPE_SPARSE) + b"\0" * 1024)
    refused(archive, llama_spec, ErrorCode.ARCHIVE_SPECIAL_FILE, "'holes.bin' is a sparse file")


def _zip_declaring_one(path: Path, entries: int) -> Path:
    """A zip holding `entries` empty members whose end record declares only one."""
    with zipfile.ZipFile(path, "w") as zf:
        for i in range(entries):
            zf.writestr(f"f{i}", b"")
    data = bytearray(path.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    struct.pack_into("<HH", data, end + 8, 1, 1)  # entries on this disk, entries in all
    path.write_bytes(bytes(data))
    return path


def test_zip_central_directory_larger_than_its_declared_members_is_refused(llama_spec, tmp_path):
    archive = _zip_declaring_one(tmp_path / "many.zip", 20_000)
    refused(archive, llama_spec, ErrorCode.ARCHIVE_TOO_MANY_MEMBERS, "central directory", "more than 64 members")


def test_weights_larger_than_any_adapter_of_the_model_are_refused_unread(llama_adapter_dir, llama_spec, tmp_path):
    """A weights file holding more bytes than a rank-64 adapter of every projection: refused by its size."""
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "junk"
    shutil.copytree(llama_adapter_dir, folder)
    bound = llama_spec.max_adapter_bytes(64) + 16 * 1024 * 1024
    import torch

    save_file({"junk": torch.zeros(bound // 4 + 1024, dtype=torch.float32)}, str(folder / FILES[1]))
    refused(folder, llama_spec, ErrorCode.ARCHIVE_MEMBER_TOO_LARGE, "adapter_model.safetensors is",
            "more than a LoRA adapter of rank <= 64 for this base model can take")


def test_archive_inflating_past_what_the_model_needs_is_stopped(llama_adapter_dir, llama_spec, tmp_path):
    """A member of zeros larger than any adapter of the model stops the extraction at that bound, far below
    the 2 GiB the limits allow by default."""
    bound = llama_spec.max_adapter_bytes(64) + 16 * 1024 * 1024
    archive = tmp_path / "zeros.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for file in FILES:
            zf.write(llama_adapter_dir / file, file)
        with zf.open("notes.txt", "w", force_zip64=True) as out:
            block = b"\0" * (1024 * 1024)
            for _ in range(bound // len(block) + 2):
                out.write(block)
    assert archive.stat().st_size < 1024 * 1024
    refused(archive, llama_spec, ErrorCode.ARCHIVE_MEMBER_TOO_LARGE, "'notes.txt'", f"limit of {bound}")


def test_scratch_paths_stay_out_of_messages(llama_spec, tmp_path):
    """A member path the file system refuses (longer than PATH_MAX) is named, the scratch folder is not."""
    name = "/".join(["d" * 255] * 16)
    for archive in (tmp_path / "long.zip", tmp_path / "long.tar"):
        if archive.suffix == ".zip":
            with zipfile.ZipFile(archive, "w") as zf:
                zf.writestr(name, b"x")
        else:
            with tarfile.open(archive, "w", format=tarfile.GNU_FORMAT) as tf:
                info = tarfile.TarInfo(name)
                info.size = 1
                tf.addfile(info, io.BytesIO(b"x"))
        error = refused(archive, llama_spec, ErrorCode.ARCHIVE_CORRUPT, "File name too long",
                        "cannot read archive member 'ddd")  # the member is named, not only the archive
        assert "loraplex-adapter-" not in str(error) and "/tmp" not in str(error), str(error)
