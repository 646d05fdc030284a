"""The header of a GGUF file: its metadata and where each tensor's bytes lie.

`gguf.GGUFReader` builds a numpy view for every metadata item and takes ~5 s on a 49k-token
vocabulary, more than our whole start-up budget. This parses the same header with `struct` in a
fraction of that; tensor bytes stay on disk until a caller maps them.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # version 1 counted in 32 bits; no file in use still has it
_DEFAULT_ALIGNMENT = 32

# struct format and numpy dtype of each fixed-size value type
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order, outermost first (the file stores it innermost first)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one innermost row, the unit `gguf.quants.dequantize` works on."""
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block_size * type_size


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]  # arrays as lists, strings decoded
    tensors: dict[str, GGUFTensorInfo]  # in file order

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


_LENGTH = struct.Struct("<Q")  # a string's byte count


class _Cursor:
    """Reads little-endian values from a buffer, failing on anything past its end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"a {n}-byte item at offset {self.pos} runs past the end of the file")
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def string(self) -> str:
        return self.raw(self.scalar("<Q")).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` strings in one loop: a vocabulary holds ~150k of them, and `string`'s calls per
        item took half a second of start-up."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _LENGTH.unpack_from
        out = []
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError(f"a {n}-byte string at offset {pos} runs past the end of the file")
            out.append(buf[pos : pos + n].decode("utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.scalar("<I"))
            count = self.scalar("<Q")
            if item_type in _SCALAR_FORMATS:  # one numpy read instead of `count` struct calls
                fmt = _SCALAR_FORMATS[item_type]
                dtype = np.dtype(fmt)
                return np.frombuffer(self.raw(count * dtype.itemsize), dtype=dtype).tolist()
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        value = self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == GGUFValueType.FLOAT32:
            # the shortest decimal that is this float32: 1e-05, not 9.999999747378752e-06
            return float(str(np.float32(value)))
        return value


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table; `ValueError` if it is not a valid GGUF. The config,
    the tokenizer and the weights each ask for it: the last file's is kept (a vocabulary's strings,
    tens of MB) while it stays unchanged, so that a process parses it once."""
    stat = path.stat()
    return _read_gguf_header(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_gguf_header(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    try:
        with open(path, "rb") as f:
            if f.read(4) != _MAGIC:
                raise ValueError("it does not start with the GGUF magic bytes")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, _Cursor(buf), len(buf))
    except (ValueError, KeyError, struct.error, UnicodeDecodeError, OverflowError, RecursionError) as e:
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e


def _parse(path: Path, cur: _Cursor, file_size: int) -> GGUFHeader:
    cur.pos = len(_MAGIC)
    version = cur.scalar("<I")
    if version not in _VERSIONS:
        raise ValueError(f"unsupported GGUF version {version} (big-endian files are not supported)")
    tensor_count, kv_count = cur.scalar("<Q"), cur.scalar("<Q")
    if tensor_count > file_size or kv_count > file_size:
        raise ValueError("implausible tensor or metadata count")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(GGUFValueType(cur.scalar("<I")))

    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.scalar("<I")
        ne = [cur.scalar("<Q") for _ in range(n_dims)]
        qtype = GGMLQuantizationType(cur.scalar("<I"))
        infos.append((name, tuple(reversed(ne)), qtype, cur.scalar("<Q")))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(shape)
        if not shape:
            raise ValueError(f"tensor {name!r} has no dimensions")
        if shape[-1] % block_size:
            raise ValueError(f"tensor {name!r}: row of {shape[-1]} is not whole {qtype.name} blocks")
        info = GGUFTensorInfo(name, shape, qtype, data_start + offset, n_elements // block_size * type_size)
        if info.offset + info.nbytes > file_size:
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        tensors[name] = info
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


def map_tensor_data(path: Path) -> np.ndarray:
    """The whole file as a uint8 memory map, to slice tensors from. Copy-on-write, so that tensors can
    be views of it (torch wants writable memory); nothing writes to it, so its pages stay the page
    cache's, shared with every other process that maps the file."""
    return np.memmap(path, dtype=np.uint8, mode="c")


def tensor_bytes(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """A tensor's raw bytes as `[*shape[:-1], row_bytes]` uint8, what `gguf.quants.dequantize` takes."""
    flat = data[info.offset : info.offset + info.nbytes]
    return flat.reshape(*info.shape[:-1], info.row_bytes)
