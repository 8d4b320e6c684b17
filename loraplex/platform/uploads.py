"""Multipart uploads streamed straight to disk, cut off the moment they pass the size limit.

Starlette's form parser would take the whole body (spooling files) before a handler could refuse it; this
parser counts every byte as it arrives and stops reading at the limit.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import python_multipart
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from loraplex.platform.errors import APIError, bad_request

MAX_FIELD_BYTES = 64 * 1024
MAX_PARTS = 16
# RFC 2046: a boundary is 1 to 70 characters (the parser itself refuses more than 256, as an error of its own)
MAX_BOUNDARY_CHARS = 70
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def too_large(limit: int) -> APIError:
    # Connection: close makes the server drop the socket instead of draining the rest of the body.
    return APIError(413, f"The upload is larger than the limit of {limit} bytes.", code="upload_too_large",
                    param="file", headers={"connection": "close"})


@dataclass
class UploadedFile:
    field: str
    filename: str
    path: Path
    size: int = 0
    sha256: str = ""


@dataclass
class ParsedUpload:
    directory: Path
    fields: dict[str, str] = field(default_factory=dict)
    files: list[UploadedFile] = field(default_factory=list)
    total_bytes: int = 0

    def discard(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def safe_filename(name: str) -> str:
    base = name.replace("\\", "/").rsplit("/", 1)[-1].strip()
    base = _SAFE_NAME.sub("_", base)[:200]
    return "upload" if base.strip(".") == "" else base  # "", "." and ".." name the folder, not a file


async def parse_upload(stream: AsyncIterator[bytes], content_type: str, directory: Path, limit: int) -> ParsedUpload:
    """Parse a multipart body into `directory`; raises APIError (400/413) and leaves nothing behind."""
    ctype, params = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise bad_request("Uploads must be multipart/form-data.", param="file")
    boundary = params[b"boundary"]
    if not 1 <= len(boundary) <= MAX_BOUNDARY_CHARS:
        raise bad_request(f"The multipart boundary in the Content-Type header must be 1 to {MAX_BOUNDARY_CHARS} "
                          f"characters long (RFC 2046); this one has {len(boundary)}.", param="file")
    directory.mkdir(parents=True, exist_ok=False)
    upload = ParsedUpload(directory)
    state = _PartState()

    def on_part_begin() -> None:
        state.reset()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state.header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state.header_value += data[start:end]

    def on_header_end() -> None:
        if state.header_name.lower() == b"content-disposition":
            state.disposition = state.header_value
        state.header_name, state.header_value = b"", b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(state.disposition)
        if b"name" not in options:
            raise _Refused(bad_request("A multipart part lacks its name.", param="file"))
        state.field = options[b"name"].decode("utf-8", "replace")
        if len(upload.files) + len(upload.fields) >= MAX_PARTS:
            raise _Refused(bad_request(f"At most {MAX_PARTS} form parts are accepted.", param="file"))
        if b"filename" in options:
            name = safe_filename(options[b"filename"].decode("utf-8", "replace"))
            if any(f.filename == name for f in upload.files):
                raise _Refused(bad_request(f"The file {name!r} was sent twice.", param="file"))
            target = directory / name
            state.file = UploadedFile(state.field, name, target)
            state.handle = open(target, "wb")
            state.hasher = hashlib.sha256()
        elif state.field == "file":
            # the archive sent as a text field (curl -F file=<PATH, or a filename only as RFC 5987's filename*=,
            # which RFC 7578 forbids): said so, rather than "too long" or "no file" about a file that was sent
            raise _Refused(bad_request(
                "The 'file' part must be a file: give it a filename in its Content-Disposition header "
                "(filename=\"adapter.zip\"; with curl, -F file=@PATH), not send it as a text field.", param="file"))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        upload.total_bytes += len(chunk)
        if upload.total_bytes > limit:
            raise _Refused(too_large(limit))
        if state.handle is not None:
            state.handle.write(chunk)
            state.hasher.update(chunk)
            state.file.size += len(chunk)
        else:
            state.value += chunk
            if len(state.value) > MAX_FIELD_BYTES:
                raise _Refused(bad_request(f"The form field {state.field!r} is too long.", param=state.field))

    def on_part_end() -> None:
        if state.handle is not None:
            state.handle.close()
            state.handle = None
            state.file.sha256 = state.hasher.hexdigest()
            upload.files.append(state.file)
        elif state.field is not None:
            if state.field in upload.fields:  # which one was meant? refused rather than guessed
                raise _Refused(bad_request(f"The form field {state.field!r} was sent twice.", param=state.field))
            upload.fields[state.field] = state.value.decode("utf-8", "replace")

    def on_end() -> None:
        state.ended = True

    parser = python_multipart.MultipartParser(boundary, {
        "on_part_begin": on_part_begin, "on_part_data": on_part_data, "on_part_end": on_part_end,
        "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_header_end": on_header_end, "on_headers_finished": on_headers_finished, "on_end": on_end,
    })
    try:
        async for chunk in stream:
            parser.write(chunk)
        parser.finalize()
        if not state.ended:
            raise _Refused(bad_request("The multipart body is malformed: it ends before its closing boundary "
                                       "(the upload was cut short).", param="file"))
    except _Refused as exc:
        state.close()
        upload.discard()
        raise exc.error from None
    except FormParserError as exc:
        state.close()
        upload.discard()
        raise bad_request(f"The multipart body is malformed: {exc}", param="file") from exc
    except BaseException:
        state.close()
        upload.discard()
        raise
    return upload


class _Refused(Exception):
    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


class _PartState:
    def __init__(self) -> None:
        self.ended = False  # the closing boundary was read
        self.reset()

    def reset(self) -> None:
        self.header_name = b""
        self.header_value = b""
        self.disposition = b""
        self.field: str | None = None
        self.value = b""
        self.file: UploadedFile | None = None
        self.handle = None
        self.hasher = None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
