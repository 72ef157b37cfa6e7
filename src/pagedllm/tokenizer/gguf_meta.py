"""A minimal reader of GGUF key/value metadata (the header part, not the tensors).

Owns: parsing the GGUF header's key/value section into Python values. Does not
own: tensors (`weights/`), or what the keys mean (`loaders.py`).

Why not `gguf.GGUFReader`: it builds numpy views for every element of every
array, which takes ~8 s for SmolLM2's 49 152 tokens and 48 900 merges; this
reader walks the same bytes with `struct` in well under a second and stops
where the tensor descriptions begin.

Layout (GGUF v2/v3, little-endian): magic b"GGUF", version u32,
tensor_count u64, kv_count u64, then kv_count times: key (u64 length +
UTF-8), value type u32, value. A string is a u64 length + UTF-8 bytes; an
array is an element type u32, a count u64, then the elements.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

# GGUF value types -> struct format of one element (strings and arrays apart).
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def read_gguf_kv(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """Key/values of a GGUF file whose key starts with `prefix` (all when "")."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        _, kv_count = struct.unpack_from("<QQ", buf, 8)
        reader = _Reader(buf, 24)
        out: dict[str, Any] = {}
        for _ in range(kv_count):
            key = reader.string()
            vtype = reader.unpack("<I")
            if key.startswith(prefix):
                out[key] = reader.value(vtype)
            else:
                reader.skip(vtype)
        return out


class _Reader:
    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _SCALAR:
                fmt = f"<{count}{_SCALAR[etype]}"
                items = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return items
            return [self.value(etype) for _ in range(count)]  # nested arrays
        if vtype in _SCALAR:
            return self.unpack("<" + _SCALAR[vtype])
        raise ValueError(f"GGUF: unknown value type {vtype} at byte {self.pos}")

    def skip(self, vtype: int) -> None:
        self.value(vtype)
