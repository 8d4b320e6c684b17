"""Unpack an uploaded .zip or .tar(.gz) without trusting it.

Each member is checked before it is written (for a zip, all members before any): a relative path that
stays inside the destination, a regular file or folder (no links, devices or FIFOs), a bounded count.
Data is streamed and counted as it is written, so a member that lies about its size (a zip bomb) is
stopped at the limit, not after.
"""

from __future__ import annotations

import os
import stat
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from .errors import AdapterValidationError, ErrorCode
from .limits import AdapterLimits

_CHUNK = 1024 * 1024
# A Hugging Face cache snapshot is a folder of links to its blobs: archived as it is, it holds only the links.
_LINK_HINT = ("; archives may not hold links. Archive the files the links point to (tar -h or --dereference; "
              "zip without --symlinks)")
# An adapter is two files, perhaps in a folder or two: deeper paths or longer names are no adapter's, and a
# path of thousands of folders costs the file system (and a recursive cleanup) dearly.
MAX_DEPTH = 16
MAX_NAME_BYTES = 255  # one path component, as most file systems allow
# tarfile reads a GNU long-name or pax extended header whole into memory before returning its member, and a
# gzip stream inflates a few hundred KB into gigabytes of such a header: its size is checked first. A long
# name is at most MAX_DEPTH components of MAX_NAME_BYTES; a pax header of an adapter's files is a few records.
MAX_TAR_LONG_NAME_BYTES = MAX_DEPTH * (MAX_NAME_BYTES + 1)
MAX_TAR_PAX_BYTES = 64 * 1024
# A zip's central directory is parsed whole by ZipFile, however many entries its end record declares: one
# entry is 46 bytes plus its name, extra fields and comment.
_MAX_ZIP_ENTRY_BYTES = 46 + MAX_TAR_LONG_NAME_BYTES + 1024


def archive_kind(path: Path) -> str | None:
    """"zip", "tar" or None, from the file's first bytes (an upload's name is not evidence)."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00":
        return "tar"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def safe_extract(archive: str | Path, dest: str | Path, limits: AdapterLimits = AdapterLimits()) -> Path:
    """Extract `archive` (zip, tar, tar.gz/bz2/xz) into the existing, empty folder `dest`; returns `dest`.
    Raises AdapterValidationError on the first unsafe or oversized member; members of a tar before that one
    are already in `dest`, so extract into a scratch folder and drop it on failure."""
    archive, dest = Path(archive), Path(dest)
    size = archive.stat().st_size
    if size > limits.max_archive_bytes:
        raise AdapterValidationError(
            f"archive {archive.name} is {size} bytes, over the limit of {limits.max_archive_bytes}",
            ErrorCode.ARCHIVE_TOO_LARGE)
    kind = archive_kind(archive)
    budget = _Budget(limits)
    if kind == "zip":
        _extract_zip(archive, dest, budget)
    elif kind == "tar":
        _extract_tar(archive, dest, budget)
    else:
        raise AdapterValidationError(f"{archive.name} is not a zip or tar archive", ErrorCode.UNSUPPORTED_FORMAT)
    return dest


def read_zip_member(archive: str | Path, wanted: Callable[[tuple[str, ...]], bool], max_bytes: int,
                    max_members: int) -> bytes | None:
    """The content of the one regular file in the zip `archive` whose path parts `wanted` accepts, if it holds
    at most `max_bytes`; None when there is no such file, more than one, or the zip cannot be read. Only that
    member is inflated, and never past `max_bytes`: a small file can be read from an archive refused for a
    large one without paying for the large one. Nothing is written to disk."""
    try:
        directory = _zip_directory(Path(archive))
        if directory is None or directory[0] > max_members or directory[1] > max_members * _MAX_ZIP_ENTRY_BYTES:
            return None
        with zipfile.ZipFile(archive) as zf:
            named = ((info, _plain_parts(info.filename)) for info in zf.infolist() if not info.is_dir())
            found = [info for info, parts in named if parts is not None and wanted(parts)]
            if len(found) != 1 or found[0].file_size > max_bytes:
                return None
            mode = found[0].external_attr >> 16
            if stat.S_IFMT(mode) and not stat.S_ISREG(mode):
                return None
            with zf.open(found[0]) as src:
                data = src.read(max_bytes + 1)  # a member that lies about its size stops here
    except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError, RuntimeError, ValueError):
        return None
    return data if len(data) <= max_bytes else None


def _plain_parts(name: str) -> tuple[str, ...] | None:
    """A member name's path parts, or None for a name safe_extract would refuse (absolute, '..', empty)."""
    posix = name.replace("\\", "/")
    parts = tuple(p for p in PurePosixPath(posix).parts if p not in ("", "."))
    if not parts or "\x00" in name or posix.startswith("/") or ":" in parts[0] or ".." in parts:
        return None
    return parts


class _Budget:
    def __init__(self, limits: AdapterLimits):
        self.limits = limits
        self.members = 0
        self.total = 0
        self.declared_total = 0

    def add_member(self, name: str) -> None:
        self.members += 1
        if self.members > self.limits.max_members:
            raise AdapterValidationError(
                f"archive has more than {self.limits.max_members} members (at {_shown(name)})",
                ErrorCode.ARCHIVE_TOO_MANY_MEMBERS)

    def check_declared(self, name: str, declared: int) -> None:
        if declared > self.limits.max_member_bytes:
            raise AdapterValidationError(
                f"archive member {_shown(name)} is {declared} bytes, over the per-file limit of "
                f"{self.limits.max_member_bytes}", ErrorCode.ARCHIVE_MEMBER_TOO_LARGE)
        self.declared_total += declared
        if self.declared_total > self.limits.max_total_bytes:
            raise _total_error(name, self.limits)

    def copy(self, name: str, src, target: Path) -> None:
        written = 0
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as out:
            while chunk := src.read(_CHUNK):
                written += len(chunk)
                self.total += len(chunk)
                if written > self.limits.max_member_bytes:
                    raise AdapterValidationError(
                        f"archive member {_shown(name)} inflates past the per-file limit of "
                        f"{self.limits.max_member_bytes} bytes", ErrorCode.ARCHIVE_MEMBER_TOO_LARGE)
                if self.total > self.limits.max_total_bytes:
                    raise _total_error(name, self.limits)
                out.write(chunk)


def _total_error(name: str, limits: AdapterLimits) -> AdapterValidationError:
    return AdapterValidationError(
        f"archive inflates past the limit of {limits.max_total_bytes} bytes in total (at {_shown(name)})",
        ErrorCode.ARCHIVE_TOO_LARGE)


def _safe_target(dest: Path, name: str) -> Path:
    """The path a member named `name` may be written to, or a refusal."""
    if not name or "\x00" in name:
        raise AdapterValidationError(f"archive member has an invalid name {_shown(name)}", ErrorCode.ARCHIVE_UNSAFE_PATH)
    posix = name.replace("\\", "/")
    parts = PurePosixPath(posix).parts
    if posix.startswith("/") or (parts and (":" in parts[0])):
        raise AdapterValidationError(f"archive member {_shown(name)} has an absolute path", ErrorCode.ARCHIVE_UNSAFE_PATH)
    if ".." in parts:
        raise AdapterValidationError(f"archive member {_shown(name)} escapes the archive with '..'",
                                     ErrorCode.ARCHIVE_UNSAFE_PATH)
    parts = tuple(p for p in parts if p not in ("", "."))
    if not parts:
        return dest  # "./", as `tar -C folder .` writes first: the destination itself
    if len(parts) > MAX_DEPTH:
        raise AdapterValidationError(f"archive member {_shown(name)} is {len(parts)} folders deep, more than "
                                     f"{MAX_DEPTH}", ErrorCode.ARCHIVE_UNSAFE_PATH)
    if any(len(p.encode("utf-8", errors="surrogateescape")) > MAX_NAME_BYTES for p in parts):
        raise AdapterValidationError(f"archive member {_shown(name)} has a name longer than {MAX_NAME_BYTES} "
                                     "bytes", ErrorCode.ARCHIVE_UNSAFE_PATH)
    target = dest.joinpath(*parts)
    root = dest.resolve()
    # Parents were made by us from checked names, so resolve() cannot follow a link we did not create;
    # the check stays as a second line of defence.
    if not target.parent.resolve().is_relative_to(root):
        raise AdapterValidationError(f"archive member {_shown(name)} lands outside the destination",
                                     ErrorCode.ARCHIVE_UNSAFE_PATH)
    return target


def _shown(name: str) -> str:
    return repr(name) if len(name) <= 120 else repr(name[:120]) + "..."


def _make_dirs(dest: Path, target: Path) -> None:
    rel = target.relative_to(dest)
    current = dest
    for part in rel.parts:
        current = current / part
        if current.is_symlink():
            raise AdapterValidationError(f"archive path {rel} runs through a link", ErrorCode.ARCHIVE_LINK)
        if current.exists() and not current.is_dir():
            raise AdapterValidationError(f"archive member {rel} is both a file and a folder",
                                         ErrorCode.ARCHIVE_UNSAFE_PATH)
        current.mkdir(exist_ok=True)


def _zip_directory(archive: Path) -> tuple[int, int] | None:
    """The entry count and central directory size in the zip's end record, read before ZipFile builds an
    object per entry: a small archive can declare millions of entries, or declare few and hold millions."""
    with open(archive, "rb") as f:
        end = zipfile._EndRecData(f)  # stable since Python 2; handles zip64
    return None if end is None else (end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE])


def _extract_zip(archive: Path, dest: Path, budget: _Budget) -> None:
    directory = _zip_directory(archive)
    most = budget.limits.max_members
    if directory is not None and directory[0] > most:
        raise AdapterValidationError(f"archive declares {directory[0]} members, more than {most}",
                                     ErrorCode.ARCHIVE_TOO_MANY_MEMBERS)
    if directory is not None and directory[1] > most * _MAX_ZIP_ENTRY_BYTES:
        raise AdapterValidationError(
            f"archive's central directory is {directory[1]} bytes, more than {most} members can take "
            f"({most * _MAX_ZIP_ENTRY_BYTES})", ErrorCode.ARCHIVE_TOO_MANY_MEMBERS)
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as exc:
        raise AdapterValidationError(f"{archive.name} is not a readable zip: {_why(exc)}", ErrorCode.ARCHIVE_CORRUPT) from exc
    with zf:
        infos = zf.infolist()
        for info in infos:  # check every member before writing any
            budget.add_member(info.filename)
            # Unix zips keep st_mode in the high 16 bits; many writers store only permission bits (file
            # type 0), which means a plain file or folder.
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise AdapterValidationError(f"archive member {_shown(info.filename)} is a symbolic link{_LINK_HINT}",
                                             ErrorCode.ARCHIVE_LINK)
            if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise AdapterValidationError(f"archive member {_shown(info.filename)} is not a regular file",
                                             ErrorCode.ARCHIVE_SPECIAL_FILE)
            _safe_target(dest, info.filename)
            budget.check_declared(info.filename, info.file_size)
        for info in infos:
            target = _safe_target(dest, info.filename)
            if info.is_dir():
                _make_dirs(dest, target)
                continue
            if target == dest:
                raise AdapterValidationError(f"archive member {_shown(info.filename)} is a file without a name",
                                             ErrorCode.ARCHIVE_UNSAFE_PATH)
            _make_dirs(dest, target.parent)
            try:
                with zf.open(info) as src:
                    budget.copy(info.filename, src, target)
            except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError, RuntimeError) as exc:
                if isinstance(exc, FileExistsError):
                    raise AdapterValidationError(f"archive member {_shown(info.filename)} appears twice",
                                                 ErrorCode.ARCHIVE_UNSAFE_PATH) from exc
                raise AdapterValidationError(f"cannot read archive member {_shown(info.filename)}: {_why(exc)}",
                                             ErrorCode.ARCHIVE_CORRUPT) from exc


def _why(exc: BaseException) -> str:
    """What went wrong, without the scratch folder's path that an OSError's text carries."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


class _CheckedTarInfo(tarfile.TarInfo):
    """A tar header whose extended parts are sized before tarfile reads them into memory."""

    def _proc_member(self, tarfile_):
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) and self.size > MAX_TAR_LONG_NAME_BYTES:
            raise AdapterValidationError(
                f"archive has a long-name header of {self.size} bytes; no path of an adapter's files takes more "
                f"than {MAX_TAR_LONG_NAME_BYTES}", ErrorCode.ARCHIVE_UNSAFE_PATH)
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) and self.size > MAX_TAR_PAX_BYTES:
            raise AdapterValidationError(
                f"archive has an extended (pax) header of {self.size} bytes, more than {MAX_TAR_PAX_BYTES}",
                ErrorCode.ARCHIVE_CORRUPT)
        if self.type == tarfile.GNUTYPE_SPARSE:  # its map of holes would be read first, block after block
            raise AdapterValidationError(f"archive member {_shown(self.name)} is a sparse file",
                                         ErrorCode.ARCHIVE_SPECIAL_FILE)
        return super()._proc_member(tarfile_)


def _extract_tar(archive: Path, dest: Path, budget: _Budget) -> None:
    # Streaming mode ("r|*") reads each header and its data once, in order; no random access, no index
    # of all members held in memory before the count limit applies.
    try:
        tf = tarfile.open(archive, mode="r|*", tarinfo=_CheckedTarInfo)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise AdapterValidationError(f"{archive.name} is not a readable tar: {_why(exc)}", ErrorCode.ARCHIVE_CORRUPT) from exc
    try:
        with tf:
            for member in tf:
                _extract_tar_member(tf, member, dest, budget)
    except (tarfile.TarError, OSError, EOFError, ValueError, RuntimeError) as exc:
        # RuntimeError: tarfile recurses once per chained extended header; a long chain overflows the stack.
        if isinstance(exc, AdapterValidationError):
            raise
        raise AdapterValidationError(f"cannot read {archive.name}: {_why(exc)}", ErrorCode.ARCHIVE_CORRUPT) from exc


def _extract_tar_member(tf: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, budget: _Budget) -> None:
    name = member.name
    budget.add_member(name)
    if member.issym() or member.islnk():
        raise AdapterValidationError(f"archive member {_shown(name)} is a link to {_shown(member.linkname)}"
                                     f"{_LINK_HINT}", ErrorCode.ARCHIVE_LINK)
    if member.ischr() or member.isblk() or member.isfifo() or member.issparse() or not (
            member.isreg() or member.isdir()):
        raise AdapterValidationError(f"archive member {_shown(name)} is not a regular file (device, FIFO or special)",
                                     ErrorCode.ARCHIVE_SPECIAL_FILE)
    target = _safe_target(dest, name)
    if member.isdir():
        _make_dirs(dest, target)
        return
    if target == dest:
        raise AdapterValidationError(f"archive member {_shown(name)} is a file without a name", ErrorCode.ARCHIVE_UNSAFE_PATH)
    budget.check_declared(name, member.size)
    src = tf.extractfile(member)
    if src is None:
        raise AdapterValidationError(f"archive member {_shown(name)} has no data", ErrorCode.ARCHIVE_CORRUPT)
    try:
        _make_dirs(dest, target.parent)
        budget.copy(name, src, target)
    except FileExistsError:
        raise AdapterValidationError(f"archive member {_shown(name)} appears twice", ErrorCode.ARCHIVE_UNSAFE_PATH) from None
    except OSError as exc:  # a path the file system refuses (too long, say), named by the member, not the archive
        raise AdapterValidationError(f"cannot read archive member {_shown(name)}: {_why(exc)}",
                                     ErrorCode.ARCHIVE_CORRUPT) from exc
