"""The GGUF container read directly: header, metadata and tensor table, tensor data
memory-mapped.

Our own parser rather than ``gguf.GGUFReader``: that one builds a numpy view for every
element of every metadata array, which for Gemma 3's 262,144-token vocabulary (tokens,
scores, types) takes ~20 s per open; this reader decodes only the arrays the loader keeps,
skips the rest by size, and opens the same file in well under a second. Every way a file can
be bad becomes a :class:`ModelLoadError` naming the file and saying what is wrong.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.model.load_error import ModelLoadError

__all__ = ["GGUF_MAGIC", "GGUFFile", "open_gguf"]

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types (gguf.GGUFValueType) -> struct format, for scalars and arrays.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# Arrays we keep (the tokenizer); the rest are skipped over.
_WANTED_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                            "tokenizer.ggml.token_type", "tokenizer.ggml.scores"})


class _Truncated(Exception):
    pass


@dataclass
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    n_bytes: int
    data: Any = None  # np.ndarray (uint8 rows) once the file is known to hold it


@dataclass
class GGUFFile:
    fields: dict[str, Any]  # scalars and strings
    arrays: dict[str, list[Any]]  # the _WANTED_ARRAYS present
    tensors: list[_TensorInfo]


class _Cursor:
    """Sequential little-endian reads over the mapped file; running past its end raises
    _Truncated."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated(f"needs {size} bytes at offset {self.pos}")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated(f"needs {n} bytes at offset {self.pos}")
        self.pos += n

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.pos
        self.skip(n)
        return str(self.buf[start:self.pos], "utf-8")

    def strings(self, count: int) -> list[str]:
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack_from, append = struct.unpack_from, out.append
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated(f"string array runs past the end at offset {pos}")
            (n,) = unpack_from("<Q", buf, pos)
            pos += 8
            if pos + n > end:
                raise _Truncated(f"string array runs past the end at offset {pos}")
            append(str(buf[pos:pos + n], "utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown value type {vtype}")
        itype, count = self.unpack("<I"), self.unpack("<Q")
        if itype == _STRING:
            if keep:
                return self.strings(count)
            for _ in range(count):
                self.skip(self.unpack("<Q"))
            return None
        if itype in _NUMPY_TYPES:
            dt = np.dtype(_NUMPY_TYPES[itype])
            start = self.pos
            self.skip(count * dt.itemsize)
            if not keep:
                return None
            arr = np.frombuffer(self.buf[start:self.pos], dtype=dt)
            return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
        items = [self.value(itype, keep) for _ in range(count)]
        return items if keep else None


def open_gguf(path: str) -> GGUFFile:
    """Parse a GGUF's header, metadata and tensor table (see the module docstring)."""
    size = _check_magic(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    fields, arrays, infos = _read_tables(path, cur, size)
    alignment = fields.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ModelLoadError(path, f"invalid general.alignment {alignment!r}")
    start = cur.pos + (-cur.pos) % alignment
    tensors = [_tensor_view(path, data, info, start, size) for info in infos]
    return GGUFFile(fields=fields, arrays=arrays, tensors=tensors)


def _check_magic(path: str) -> int:
    """The size of the file at ``path``; ModelLoadError unless it is a file starting as a GGUF does."""
    if not os.path.exists(path):
        raise ModelLoadError(path, "file not found")
    if not os.path.isfile(path):
        raise ModelLoadError(path, "not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(path, f"not a GGUF file (bad magic {magic!r}, expected {GGUF_MAGIC!r}); corrupted or "
                                   "wrong format")
    return os.path.getsize(path)


def _read_tables(path: str, cur: _Cursor, size: int) -> tuple[dict[str, Any], dict[str, list[Any]], list[tuple]]:
    """(scalar fields, kept arrays, tensor table rows (name, shape, type, offset)) after the
    magic; a read past the end or a malformed value becomes a ModelLoadError naming the field."""
    key = None
    try:
        cur.skip(4)
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        fields: dict[str, Any] = {}
        arrays: dict[str, list[Any]] = {}
        for _ in range(n_kv):
            key = None  # an error reading the name is not the previous field's
            key = cur.string()
            vtype = cur.unpack("<I")
            v = cur.value(vtype, keep=vtype != _ARRAY or key in _WANTED_ARRAYS)
            if vtype == _ARRAY:
                if v is not None:
                    arrays[key] = v
            else:
                fields[key] = v
        key = None
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            shape = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            infos.append((name, shape, cur.unpack("<I"), cur.unpack("<Q")))
    except _Truncated as e:
        where = f" in metadata field {key!r}" if key else ""
        raise ModelLoadError(path, f"corrupted or truncated GGUF file of {size} bytes{where} ({e})") from e
    except ModelLoadError:
        raise
    except (UnicodeDecodeError, ValueError, struct.error, RecursionError) as e:
        what = f"corrupted metadata field {key!r}" if key else "corrupted GGUF header"
        raise ModelLoadError(path, f"{what} ({type(e).__name__}: {e})") from e
    return fields, arrays, infos


def _tensor_view(path: str, data: np.memmap, row: tuple, start: int, size: int) -> "_TensorInfo":
    """A tensor table row as its info, its data a view of the mapped file (checked in bounds)."""
    import gguf

    name, shape, ttype, offset = row
    try:
        qtype = gguf.GGMLQuantizationType(ttype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as e:
        raise ModelLoadError(path, f"tensor {name!r}: unknown tensor type {ttype}") from e
    row_len = shape[0] if shape else 1
    if row_len % block:
        raise ModelLoadError(path, f"tensor {name!r}: row of {row_len} values is not whole {qtype.name} blocks")
    n_bytes = math.prod(shape) // block * type_size
    begin = start + offset
    end = begin + n_bytes
    if end > size:
        raise ModelLoadError(path, f"truncated GGUF: tensor {name!r} needs bytes up to {end}, file has {size}")
    info = _TensorInfo(name, shape, qtype, n_bytes)
    # Rows of raw bytes, as gguf.quants.dequantize expects them (it reads the row length
    # from the last axis; F32/F16 are reinterpreted in place).
    info.data = data[begin:end].reshape(-1, row_len // block * type_size) if n_bytes else data[begin:end]
    return info


