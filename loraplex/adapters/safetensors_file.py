"""Read a safetensors file after checking its header ourselves, so a hostile file is refused with a message
that names the problem instead of a parser's panic, and a huge header is never parsed at all."""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from .errors import AdapterValidationError, ErrorCode
from .limits import AdapterLimits

ALLOWED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}  # bf16: numpy has none; viewed after
_KNOWN_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                      "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read_header(path: Path, limits: AdapterLimits) -> tuple[dict, int, dict[str, str]]:
    """The parsed, checked header (tensor name -> {dtype, shape, data_offsets}), the offset where tensor
    data starts, and the file's string metadata."""
    with open(path, "rb") as f:
        return _read_header(f, path.stat().st_size, path.name, limits)


def _read_header(f: BinaryIO, file_size: int, name: str, limits: AdapterLimits) -> tuple[dict, int, dict[str, str]]:
    if file_size > limits.max_member_bytes:
        raise AdapterValidationError(f"{name} is {file_size} bytes, over the limit of {limits.max_member_bytes}",
                                     ErrorCode.ARCHIVE_MEMBER_TOO_LARGE)
    if file_size == 0:
        raise _corrupt(name, "the file is empty (0 bytes)")
    prefix = f.read(8)
    if len(prefix) < 8:
        raise _corrupt(name, "file is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > limits.max_header_bytes:
        raise AdapterValidationError(
            f"{name}: safetensors header is {header_len} bytes, over the limit of {limits.max_header_bytes}",
            ErrorCode.HEADER_TOO_LARGE)
    if header_len > file_size - 8:
        raise _corrupt(name, f"header length {header_len} runs past the end of the file ({file_size} bytes)")
    raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(name, f"header is not valid JSON ({exc})") from exc
    except RecursionError:
        raise _corrupt(name, "header is JSON nested too deeply") from None
    if not isinstance(header, dict):
        raise _corrupt(name, "header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _corrupt(name, "__metadata__ must map strings to strings")
    data_len = file_size - 8 - header_len
    spans = []
    for key, info in header.items():
        _check_entry(name, key, info, data_len)
        spans.append((*info["data_offsets"], key))
    spans.sort()
    end = 0
    for start, stop, key in spans:
        if start < end:
            raise _corrupt(name, f"tensor {key!r} overlaps the tensor before it")
        end = stop
    return header, 8 + header_len, metadata or {}


def _check_entry(name: str, key: str, info, data_len: int) -> None:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _corrupt(name, f"tensor {key!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise _corrupt(name, f"tensor {key!r} has a dtype that is not a string: {dtype!r}"[:300])
    if dtype not in ALLOWED_DTYPES:
        raise AdapterValidationError(
            f"{name}: tensor {key!r} has dtype {dtype}; allowed dtypes are {', '.join(ALLOWED_DTYPES)}",
            ErrorCode.DTYPE_UNSUPPORTED)
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise _corrupt(name, f"tensor {key!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise _corrupt(name, f"tensor {key!r} has data offsets {offsets!r}; expected [begin, end] byte offsets")
    if offsets[0] > offsets[1]:
        raise _corrupt(name, f"tensor {key!r} has data offsets {offsets!r} that end before they begin")
    if 0 <= offsets[0] <= offsets[1] and offsets[1] > data_len:
        raise _corrupt(name, f"tensor {key!r} has data offsets {offsets!r} outside the data ({data_len} bytes): the "
                             f"file is cut short (an interrupted download or copy?) or its header is damaged")
    if not 0 <= offsets[0] <= offsets[1] <= data_len:
        raise _corrupt(name, f"tensor {key!r} has data offsets {offsets!r} outside the data ({data_len} bytes)")
    expected = math.prod(shape) * _KNOWN_DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise _corrupt(name, f"tensor {key!r} of shape {shape} {dtype} needs {expected} bytes, "
                             f"its offsets span {offsets[1] - offsets[0]}")


def read_tensors(path: Path, limits: AdapterLimits) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a checked safetensors file in their stored dtype, and its metadata.

    The tensors are read into memory (no memory map: a map would tie the tensors to a file that may be
    replaced or deleted, and fault pages in later, at serving time)."""
    with open(path, "rb") as f:
        return _read_tensors(f, path.stat().st_size, path.name, limits)


def tensors_from_bytes(data: bytes, name: str, limits: AdapterLimits) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """As read_tensors, for a safetensors file already in memory (an object fetched from a bucket)."""
    return _read_tensors(io.BytesIO(data), len(data), name, limits)


def _read_tensors(f: BinaryIO, file_size: int, name: str, limits: AdapterLimits):
    """The data section is read with one read into one buffer, and each tensor is a view of its bytes
    (copied out only where its offset does not suit its dtype's alignment). One read per tensor instead cost
    a seek, a read and an allocation for each of an adapter's hundreds of tensors: a rank-16 adapter of
    SmolLM2 (420 tensors, 19.6 MB) took 18-40 ms that way against 5-8 ms for the single read, fresh pages
    included (2 vCPU Zen 3)."""
    header, data_start, metadata = _read_header(f, file_size, name, limits)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    end = max((info["data_offsets"][1] for _, info in entries), default=0)
    data = torch.empty(end, dtype=torch.uint8)
    if end:
        f.seek(data_start)
        view, got = memoryview(data.numpy()), 0
        while got < end:  # (safetensors is little-endian, as is every machine we serve on)
            n = f.readinto(view[got:])
            if not n:
                raise _corrupt(name, "file shrank while being read")
            got += n
    tensors = {}
    buffer = data.numpy()  # views made through numpy: a third of the cost of torch's slice and two views
    for key, info in entries:
        start, stop = info["data_offsets"]
        raw = buffer[start:stop]
        if start % ALLOWED_DTYPES[info["dtype"]].itemsize:
            raw = raw.copy()  # aligned
        tensor = torch.from_numpy(raw.view(_NUMPY_DTYPES[info["dtype"]]).reshape(info["shape"]))
        tensors[key] = tensor.view(torch.bfloat16) if info["dtype"] == "BF16" else tensor
    return tensors, metadata


def _corrupt(name: str, why: str) -> AdapterValidationError:
    return AdapterValidationError(f"{name}: corrupt safetensors file: {why}", ErrorCode.SAFETENSORS_CORRUPT)
