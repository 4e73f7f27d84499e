"""Validate a safetensors file's header before any tensor is read.

File layout (https://github.com/huggingface/safetensors, "Format"):

    | u64 little-endian N | N bytes: JSON header | data section: the tensors' bytes |
    0                     8                      8+N                               file size

Header: {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}}
with offsets in bytes relative to the start of the data section. Like the safetensors library, we require
the tensors to tile the data section exactly: sorted by `begin`, each starts where the previous one ends,
the first at 0 and the last at the end of the file. An upload can therefore be rejected on its header
alone (a few KiB read) before the data is mapped.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass

MAX_HEADER_BYTES = 100 * 1024 * 1024
# safetensors dtype name -> bytes per element; LoRA weights are floating point and nothing else is accepted.
DTYPE_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


class AdapterError(ValueError):
    """An adapter that loraplex refuses; the message names the file, field or tensor at fault."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. `begin`/`end` are byte offsets into the data section, `end - begin` its size."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    dupes = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
    if dupes:
        raise AdapterError(f"duplicate key(s) {dupes} in header")
    return dict(pairs)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, entry: object, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise AdapterError(f"tensor {name!r}: header entry must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_ITEMSIZE:
        raise AdapterError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise AdapterError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise AdapterError(
            f"tensor {name!r}: data_offsets {offsets!r} is not a [begin, end] pair of integers"
        )
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise AdapterError(
            f"tensor {name!r}: data_offsets [{begin}, {end}] fall outside the data section of {data_size} bytes "
            "(truncated file?)"
        )
    num_bytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if end - begin != num_bytes:
        raise AdapterError(
            f"tensor {name!r}: data_offsets [{begin}, {end}] span {end - begin} bytes but {dtype} "
            f"shape {shape} needs {num_bytes}"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Read and validate the header of the safetensors file at `path`; reads no tensor data.

    Returns ({tensor name: TensorInfo}, __metadata__). Raises AdapterError (message prefixed with the
    file name) for a header length that is larger than MAX_HEADER_BYTES or the file, a header that is
    not a JSON object, duplicate names, a dtype outside F32/F16/BF16, a bad shape, offsets outside the
    data section or inconsistent with dtype x shape, and overlapping, gapped or trailing bytes.
    """
    fname = os.path.basename(os.fspath(path))
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            if file_size < 8:
                raise AdapterError(f"file is {file_size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > MAX_HEADER_BYTES or header_len > file_size - 8:
                raise AdapterError(
                    f"declared header length {header_len} bytes exceeds the limit "
                    f"(min of {MAX_HEADER_BYTES} and file size - 8 = {file_size - 8})"
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AdapterError(f"header is not valid UTF-8 JSON: {e}") from None
        if not isinstance(header, dict):
            raise AdapterError(f"header is a JSON {type(header).__name__}, expected an object")

        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise AdapterError("__metadata__ must be an object of string to string")

        data_size = file_size - 8 - header_len
        tensors = {name: _parse_entry(name, entry, data_size) for name, entry in header.items()}
        _check_tiling(tensors, data_size)
    except AdapterError as e:
        raise AdapterError(f"{fname}: {e}") from None
    except OSError as e:
        raise AdapterError(f"{fname}: cannot read: {e}") from None
    return tensors, metadata


def _check_tiling(tensors: dict[str, TensorInfo], data_size: int) -> None:
    """The byte ranges, sorted, must be back to back from 0 to data_size (as the safetensors library requires)."""
    pos, prev = 0, None
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin < pos:
            raise AdapterError(
                f"tensor {name!r}: data_offsets [{info.begin}, {info.end}] overlap tensor {prev!r}"
            )
        if info.begin > pos:
            raise AdapterError(f"tensor {name!r}: gap of {info.begin - pos} bytes before its data_offsets")
        pos, prev = info.end, name
    if pos != data_size:
        raise AdapterError(f"{data_size - pos} bytes after the last tensor are not described by the header")
