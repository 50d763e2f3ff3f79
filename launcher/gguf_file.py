"""A GGUF file's metadata and tensor table, read without touching its tensor data.

gguf-py's GGUFReader keeps a numpy view per array element of the metadata: for a 262k-token
vocabulary (Gemma 3) that is most of a minute and 700 MB before the first weight is read. Only the
header is parsed here (the format: magic, version, counts, key-values, tensor infos, then the data
section at the next alignment boundary); the weights are read row slices at a time by gguf.py.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from launcher.gguf_architectures import GGUFError

_VERSIONS = (2, 3)  # v1 counted in 32 bits; nothing in the wild still uses it
# fixed-size value types: u8, i8, u16, i16, u32, i32, f32, bool, (8 string, 9 array), u64, i64, f64
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch's order: ggml's dimensions reversed
    ggml_type: int
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    metadata: dict
    tensors: list[TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))


class _Cursor:
    def __init__(self, buffer, path: Path, pos: int = 0):
        self.buffer, self.pos, self.path = buffer, pos, path

    def unpack(self, fmt: str):
        try:
            values = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        except struct.error:
            raise GGUFError(f"{self.path} ends inside its header") from None
        self.pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def unpack_many(self, count: int, fmt: str) -> tuple:
        """`count` values of one format, as a tuple whatever the count (unpack gives one bare)."""
        if not count:
            return ()
        values = self.unpack(f"{count}{fmt}")
        return values if count > 1 else (values,)

    def string(self) -> str:
        length = self.unpack("Q")
        raw = self.buffer[self.pos:self.pos + length]
        if len(raw) != length:
            raise GGUFError(f"{self.path} ends inside its header")
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type, count = self.unpack("IQ")
            if element_type in _SCALARS:
                return list(self.unpack_many(count, _SCALARS[element_type]))
            return [self.value(element_type) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {value_type}")


def _nbytes(ggml_type: int, shape: tuple[int, ...], name: str) -> int:
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"tensor {name}: unknown ggml type {ggml_type}") from None
    elements = 1
    for dim in shape:
        elements *= dim
    return elements // block * size


def read_gguf(path: Path) -> GGUFFile:
    path = Path(path)
    if path.stat().st_size < 24:  # magic, version and counts: an empty file cannot be mapped
        raise GGUFError(f"{path} is not a GGUF file (too short)")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        cursor = _Cursor(blob, path, pos=4)
        version, tensor_count, kv_count = cursor.unpack("IQQ")
        if version not in _VERSIONS:
            raise GGUFError(f"{path} is GGUF v{version}; only v2 and v3 are read")
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("I"))
        entries = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = cursor.unpack(f"{cursor.unpack('I')}Q")
            dims = dims if isinstance(dims, tuple) else (dims,)
            ggml_type, offset = cursor.unpack("IQ")
            entries.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
        size = len(blob)
    tensors = []
    for name, shape, ggml_type, offset in entries:
        info = TensorInfo(name, shape, ggml_type, data_start + offset,
                          _nbytes(ggml_type, shape, name))
        if info.offset + info.nbytes > size:
            raise GGUFError(f"{path} is truncated: tensor {name} ends past the end of the file")
        tensors.append(info)
    return GGUFFile(path, metadata, tensors)
