"""GGUF headers: a bounds-checked reader of the key/value metadata (stdlib only).

Owns: the byte layout of a GGUF header up to the tensor descriptions (magic,
version, counts, key/values) and turning the values into plain Python. Used by
`weights/gguf.py` (which goes on to the tensors) and by `tokenizer/` (which
needs only the `tokenizer.*` keys and must not import torch). Does not own:
what the keys mean (`config.py`, `tokenizer/loaders.py`) or tensors.

Why not `gguf.GGUFReader`: it builds one numpy view per vocabulary string
(2-8 s for SmolLM2's 49k tokens and merges) and does not bound-check, so a
truncated file fails deep inside numpy or loops on a corrupt count.

Invariant: every count and length is checked against the bytes left before
anything loops or allocates; any defect is a `ValueError` naming the file.
As llama.cpp's gguf.cpp (and gguf-py's reader) do, a key must be non-empty
and unique, and `general.alignment`, when present, must be a UINT32.

Layout (GGUF v2/v3, little-endian): magic b"GGUF", version u32, tensor_count
u64, kv_count u64, then kv_count times: key (u64 length + UTF-8), value type
u32, value. A string is a u64 length + bytes; an array is an element type u32,
a count u64, then the elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from pagedllm.utils import plural

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_ARRAY_NESTING = 8  # arrays of arrays are legal; deeper than this is corruption
ALIGNMENT_KEY = "general.alignment"

# GGUF value type ids (gguf-py's GGUFValueType) -> little-endian struct code.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL = 0, 1, 2, 3, 4, 5, 6, 7
STRING, ARRAY, UINT64, INT64, FLOAT64 = 8, 9, 10, 11, 12
_SCALAR_CODES = {
    UINT8: "B",
    INT8: "b",
    UINT16: "H",
    INT16: "h",
    UINT32: "I",
    INT32: "i",
    FLOAT32: "f",
    BOOL: "B",  # any non-zero byte is true
    UINT64: "Q",
    INT64: "q",
    FLOAT64: "d",
}
_SCALARS = {t: struct.Struct("<" + c) for t, c in _SCALAR_CODES.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFCursor:
    """Bounds-checked little-endian reads from a buffer; every overrun calls `fail`."""

    def __init__(self, buf: Any, size: int, fail: Callable[[str], NoReturn]):
        self.buf, self.size, self.pos, self.fail = buf, size, 0, fail

    def take(self, n: int, what: str) -> int:
        """Claim `n` bytes; returns where they start."""
        if n > self.size - self.pos:
            self.fail(
                f"truncated: {what} needs {plural(n, 'byte')} at offset {self.pos}, "
                f"file is {self.size}"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        return self._decode(self.buf[start : start + n], what)

    def _decode(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"{what} is not valid UTF-8 ({e})")

    def string_array(self, count: int, what: str) -> list[str]:
        """`count` strings, decoded in one tight loop (128k-token vocabularies take ~0.1 s)."""
        if count * 8 > self.size - self.pos:
            self.fail(f"truncated: {what} claims {count} strings, more than the bytes left")
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.fail(f"truncated inside {what}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.fail(
                    f"truncated inside {what}: a string of {plural(n, 'byte')} at offset {pos}"
                )
            append(self._decode(buf[pos : pos + n], what))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """One metadata value of type `vtype`, as plain Python (lists for arrays)."""
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            (v,) = fmt.unpack_from(self.buf, self.take(fmt.size, what))
            return bool(v) if vtype == BOOL else v
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            self.fail(f"{what} has unknown value type id {vtype}")
        if depth >= MAX_ARRAY_NESTING:
            self.fail(f"{what}: arrays nested more than {MAX_ARRAY_NESTING} deep")
        itype = self.u32(what)
        count = self.u64(what)
        if itype in _SCALARS:
            item = _SCALARS[itype].size
            start = self.take(count * item, what)  # checks count against the bytes left
            values = list(struct.unpack_from(f"<{count}{_SCALAR_CODES[itype]}", self.buf, start))
            return [v != 0 for v in values] if itype == BOOL else values
        if itype == STRING:
            return self.string_array(count, what)
        if itype == ARRAY:
            # each inner array is at least 12 bytes (type + count): bounds the loop
            if count * 12 > self.size - self.pos:
                self.fail(f"truncated: {what} claims {count} arrays, more than the bytes left")
            return [self.value(itype, what, depth + 1) for _ in range(count)]
        self.fail(f"{what} is an array of unknown value type id {itype}")


def read_header(
    cur: GGUFCursor, fail: Callable[[str], NoReturn]
) -> tuple[int, int, dict[str, Any]]:
    """Parse magic, version, counts and key/values at `cur`: (version, n_tensors, metadata).

    Leaves `cur` at the first tensor description."""
    magic = bytes(cur.buf[:4])
    if magic != GGUF_MAGIC:
        fail(f"bad magic {magic!r} (expected {GGUF_MAGIC!r}): not a GGUF file")
    cur.take(4, "magic")
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version != 0:
        fail("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        fail(f"unsupported GGUF version {version} (supported: {SUPPORTED_VERSIONS})")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("key/value count")
    # Each key/value needs >= 13 bytes and each tensor info >= 24: a count that
    # cannot fit is corruption, reported before we loop on it.
    if n_kv * 13 + n_tensors * 24 > cur.size - cur.pos:
        fail(
            f"truncated or corrupt: {plural(n_kv, 'key/value')} and {plural(n_tensors, 'tensor')} "
            f"cannot fit in the {plural(cur.size - cur.pos, 'byte')} left"
        )
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"key #{i}")
        if not key:
            fail(f"key #{i} is empty")
        if key in metadata:
            fail(f"duplicate metadata key {key!r}")
        vtype = cur.u32(f"type of {key!r}")
        if key == ALIGNMENT_KEY and vtype != UINT32:
            # llama.cpp and gguf-py both refuse any other type; so do we.
            fail(f"{ALIGNMENT_KEY} has value type id {vtype}, expected UINT32 ({UINT32})")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    return version, n_tensors, metadata


def read_gguf_metadata(path: str | os.PathLike[str], prefix: str = "") -> dict[str, Any]:
    """The key/values of a GGUF file whose key starts with `prefix` (all when "")."""
    path = Path(path)

    def fail(defect: str) -> NoReturn:
        raise ValueError(f"{path}: invalid GGUF file: {defect}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                fail(f"file is {plural(size, 'byte')}, too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _, _, metadata = read_header(GGUFCursor(buf, size, fail), fail)
    except OSError as e:
        raise ValueError(f"{path}: cannot read GGUF file: {e}") from e
    return {k: v for k, v in metadata.items() if k.startswith(prefix)}
