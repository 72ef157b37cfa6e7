"""Our own safetensors reader: one file, a sharded directory, or a Hugging Face model folder.

Owns: parsing and validating the safetensors container (8-byte little-endian
header length, a JSON header, raw little-endian tensor bytes), memory-mapping
it, and handing out tensors; following `model.safetensors.index.json` across
shards. Does not own: what the names mean (the model maps them), GGUF
(`weights/gguf.py`), or writing files. The `safetensors` package is used only
by the tests, as the oracle.

Invariants, checked before any tensor is touched (the rules of the reference
reader, the `safetensors` package, so that we never accept a file it rejects):
- the header length is at most `MAX_HEADER_BYTES` and fits inside the file;
- the header is strict JSON (no NaN/Infinity, no lone surrogates) holding an
  object; `__metadata__`, when present, maps str -> str;
- every tensor entry holds exactly `dtype`, `shape` and `data_offsets`: a
  supported dtype (BF16, F16, F32, and F8_E4M3: FP8 checkpoints), a shape of non-negative ints whose
  element count fits 64 bits, and `[begin, end]` with
  `end - begin == numel * itemsize`;
- the tensors tile the data area exactly: sorted by offsets, each begins where
  the previous one ended (no gap, no overlap; an empty tensor too), the first
  at 0, and the last ends at the end of the file. A header length one byte
  off (space-padded JSON still parses) therefore fails here instead of
  reading every tensor one byte out of place.
Any violation raises `ValueError` naming the file and the defect; nothing is
allocated in proportion to a number read from the file before it is checked
against the file's real size.

Stricter than the reference, on purpose: a repeated JSON key, and a tensor
entry with keys beyond the three, are refused (the reference silently keeps
one copy or ignores the extra key; neither appears in a file any writer makes).

Memory: the file is mapped copy-on-write (`ACCESS_COPY`), so tensors are
zero-copy, writable views whose writes never reach the disk. A view keeps
the mapping alive (numpy holds the buffer export), so `close()` never pulls
the pages out from under a live tensor.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from pagedllm.resolve import special_file_kind

# A real header is a few hundred KB even for 400B-parameter checkpoints; the
# bound stops a corrupt length field from making us read or allocate gigabytes.
# The same limit as the reference reader's MAX_HEADER_SIZE.
MAX_HEADER_BYTES = 100_000_000
# Shapes and offsets are `usize` in the reference reader: larger is corruption.
_U64_LIMIT = 2**64
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype name -> (torch dtype, numpy dtype with the same bit pattern).
# numpy has neither bfloat16 nor float8, so BF16 bytes go through int16 and F8_E4M3
# bytes (FP8 checkpoints' weights: `weights/fp8.py`) through uint8, re-viewed in torch.
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "BF16": (torch.bfloat16, np.dtype("<i2")),
    "F16": (torch.float16, np.dtype("<f2")),
    "F32": (torch.float32, np.dtype("<f4")),
    "F8_E4M3": (torch.float8_e4m3fn, np.dtype("u1")),
}
# Known to the format but not to us: named in the error so the user knows why.
_KNOWN_UNSUPPORTED = (
    "BOOL U8 I8 U16 I16 U32 I32 U64 I64 F64 F8_E5M2 F8_E8M0 F6_E2M3 F6_E3M2 F4 C64"
).split()
SUPPORTED_DTYPES = tuple(_DTYPES)


def _is_int(x: Any) -> bool:
    # JSON `true` parses to a Python bool, which is an int subclass: refuse it.
    return isinstance(x, int) and not isinstance(x, bool)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a repeated key would silently shadow a tensor, so refuse it."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in the JSON header")
        out[key] = value
    return out


def _no_constants(name: str) -> NoReturn:
    # Python's json accepts NaN, Infinity and -Infinity; JSON (and the reference) does not.
    raise ValueError(f"{name} is not valid JSON")


def _json_int(text: str) -> int | float:
    # `-0` is an integer to Python but a float to the reference's JSON parser, which
    # then refuses it as a shape or offset: hand back a float so that we refuse it too.
    return -0.0 if text == "-0" else int(text)


def _is_utf8(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON `\\ud800`), which is not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _TensorEntry:
    """One validated header entry: where the bytes are and how to view them."""

    __slots__ = ("name", "dtype_name", "shape", "begin", "end")

    def __init__(self, name: str, dtype_name: str, shape: tuple[int, ...], begin: int, end: int):
        self.name = name
        self.dtype_name = dtype_name
        self.shape = shape
        self.begin = begin  # offsets relative to the start of the data area
        self.end = end


class SafetensorsFile:
    """A validated, memory-mapped safetensors file.

    `get_tensor(name)` returns a zero-copy CPU view in the file's dtype; copy it
    (`.to(device, dtype, copy=True)`) before closing if it must outlive the file
    object (a view keeps the mapping alive, so this is about memory, not safety).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        kind = special_file_kind(self.path)
        if kind is not None:  # opening a FIFO would wait for a writer
            raise ValueError(f"{self.path} is {kind}, not a safetensors file")
        try:
            with open(self.path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                header_len = self._read_header_len(f, file_size)
                header_bytes = f.read(header_len)
                if len(header_bytes) != header_len:
                    # The file shrank between fstat and read.
                    self._fail(f"header truncated ({len(header_bytes)} of {header_len} bytes)")
                self._data_start = 8 + header_len
                data_size = file_size - self._data_start
                self.metadata, self._entries = self._parse_header(header_bytes, data_size)
                # mmap refuses empty mappings; a file with an empty data area needs none.
                if file_size > 0 and any(e.end > e.begin for e in self._entries.values()):
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            # Missing file, permission, a directory: still a ValueError naming the file,
            # so callers have one exception type to handle.
            raise ValueError(f"{self.path}: cannot read safetensors file: {e}") from e

    # ----- parsing -------------------------------------------------------------------------

    def _fail(self, defect: str) -> NoReturn:
        raise ValueError(f"{self.path}: malformed safetensors file: {defect}")

    def _read_header_len(self, f: Any, file_size: int) -> int:
        if file_size < 8:
            self._fail(f"file is {file_size} bytes, too short for the 8-byte header length")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > MAX_HEADER_BYTES:
            self._fail(f"header length {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes")
        if header_len > file_size - 8:
            self._fail(
                f"header length {header_len} runs past the end of the file "
                f"({file_size - 8} bytes after the length field)"
            )
        return header_len

    def _parse_header(
        self, header_bytes: bytes, data_size: int
    ) -> tuple[dict[str, str], dict[str, _TensorEntry]]:
        try:
            text = header_bytes.decode("utf-8")
            header = json.loads(
                text,
                object_pairs_hook=_no_duplicate_keys,
                parse_constant=_no_constants,
                parse_int=_json_int,
            )
        except (UnicodeDecodeError, ValueError) as e:
            self._fail(f"header is not valid JSON: {e}")
        except RecursionError:
            # json recurses per nesting level: `[[[[...` would otherwise escape as RecursionError.
            self._fail("header JSON is nested too deeply")
        if not isinstance(header, dict):
            self._fail(f"header is a JSON {type(header).__name__}, expected an object")

        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            self._fail("__metadata__ must be an object mapping strings to strings")
        for text in (*metadata, *metadata.values(), *header):
            if not _is_utf8(text):
                self._fail(f"string {text!r} in the header holds a lone surrogate escape")

        entries = {name: self._parse_entry(name, info, data_size) for name, info in header.items()}
        self._check_tiling(entries, data_size)
        return metadata, entries

    def _parse_entry(self, name: str, info: Any, data_size: int) -> _TensorEntry:
        if not isinstance(info, dict):
            self._fail(f"tensor {name!r}: entry is a {type(info).__name__}, expected an object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                self._fail(f"tensor {name!r}: missing {key!r}")
        extra = sorted(set(info) - _ENTRY_KEYS)
        if extra:
            self._fail(
                f"tensor {name!r}: unexpected keys {extra} "
                "(an entry holds only dtype, shape and data_offsets)"
            )
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]

        if not isinstance(dtype_name, str):
            self._fail(f"tensor {name!r}: dtype {dtype_name!r} is not a string")
        if dtype_name not in _DTYPES:
            kind = "unsupported" if dtype_name in _KNOWN_UNSUPPORTED else "unknown"
            self._fail(
                f"tensor {name!r}: {kind} dtype {dtype_name!r} "
                f"(supported: {', '.join(SUPPORTED_DTYPES)})"
            )
        if not isinstance(shape, list) or not all(
            _is_int(d) and 0 <= d < _U64_LIMIT for d in shape
        ):
            self._fail(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
        ):
            self._fail(f"tensor {name!r}: data_offsets {offsets!r} is not a pair of ints")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            self._fail(
                f"tensor {name!r}: data_offsets [{begin}, {end}] outside the data area "
                f"of {data_size} bytes (or begin > end)"
            )
        # The element count, multiplied left to right, must fit 64 bits at every step
        # (the reference's checked_mul): [2**40, 2**40, 0] has 0 elements but is corrupt.
        numel = 1
        for d in shape:
            numel *= d
            if numel >= _U64_LIMIT:
                self._fail(f"tensor {name!r}: shape {shape} has more elements than 64 bits count")
        expected = numel * _DTYPES[dtype_name][1].itemsize
        if end - begin != expected:
            self._fail(
                f"tensor {name!r}: data_offsets span {end - begin} bytes but "
                f"{dtype_name} x {shape} needs {expected}"
            )
        return _TensorEntry(name, dtype_name, tuple(shape), begin, end)

    def _check_tiling(self, entries: dict[str, _TensorEntry], data_size: int) -> None:
        """The tensors, sorted by (begin, end), cover [0, data_size) with no gap or overlap.

        This is the reference reader's rule, empty tensors included: an empty
        tensor must sit where the previous tensor ends."""
        covered, prev_name = 0, None
        for begin, end, name in sorted((e.begin, e.end, e.name) for e in entries.values()):
            if begin < covered:
                self._fail(f"tensors {prev_name!r} and {name!r} overlap")
            if begin > covered:
                after = "at the start" if prev_name is None else f"after tensor {prev_name!r}"
                self._fail(
                    f"gap of {begin - covered} bytes in the data area {after} "
                    f"(tensor {name!r} begins at {begin}, expected {covered}): "
                    "the header does not describe this data"
                )
            covered, prev_name = end, name
        if covered != data_size:
            self._fail(
                f"the tensors cover {covered} bytes but the data area holds {data_size}: "
                "the header length or the offsets are wrong, or the file was truncated "
                "or padded (the safetensors package refuses it too: file not fully covered)"
            )

    # ----- access --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Tensor names in header order (which is the writer's order, not sorted)."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> _TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def byte_range(self, name: str) -> tuple[int, int]:
        """[start, end) of the tensor's bytes in the file (absolute offsets)."""
        entry = self._entry(name)
        return self._data_start + entry.begin, self._data_start + entry.end

    def dtype_name(self, name: str) -> str:
        """The file's own name for the tensor's type ("BF16", "F32", ...)."""
        return self._entry(name).dtype_name

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._entry(name).dtype_name][0]

    def get_tensor(self, name: str) -> torch.Tensor:
        """A zero-copy CPU view of tensor `name`, in the file's dtype and shape."""
        entry = self._entry(name)
        torch_dtype, np_dtype = _DTYPES[entry.dtype_name]
        numel = math.prod(entry.shape)
        if numel == 0:
            # No bytes to map (and np.frombuffer of zero items at the end of a buffer is fussy).
            return torch.empty(entry.shape, dtype=torch_dtype)
        if self._mmap is None:
            raise ValueError(f"{self.path}: file is closed")
        offset = self._data_start + entry.begin
        array = np.frombuffer(self._mmap, dtype=np_dtype, count=numel, offset=offset)
        if offset % np_dtype.itemsize != 0:
            # Writers pad the header so data is aligned; a file that is not gets one
            # copy rather than misaligned loads in vectorised kernels.
            array = array.copy()
        # from_numpy keeps `array` (and through it the buffer export) alive.
        tensor = torch.from_numpy(array).view(torch_dtype)  # (numel,)
        return tensor.reshape(entry.shape)

    def close(self) -> None:
        """Release the mapping; pages still viewed by live tensors stay until they die."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A tensor still views the mapping: dropping our reference lets the
                # last view unmap it when it is garbage-collected.
                pass
            self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._entries)} tensors)"


# ----- directories and shards -------------------------------------------------------------


def _read_index(index_path: Path) -> dict[str, str]:
    """weight_map of a sharded checkpoint's index: tensor name -> shard file name."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{index_path}: cannot read the shard index: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{index_path}: 'weight_map' must be an object mapping strings to strings")
    for shard in set(weight_map.values()):
        # Shards live next to the index; a path would let an index reach anywhere on disk.
        if Path(shard).name != shard or shard in (".", ".."):
            raise ValueError(f"{index_path}: shard name {shard!r} is not a plain file name")
        kind = special_file_kind(index_path.parent / shard)
        if kind is not None:
            raise ValueError(f"{index_path}: shard {shard!r} is {kind}, not a safetensors file")
        if not (index_path.parent / shard).is_file():
            raise ValueError(f"{index_path}: shard {shard!r} listed in weight_map does not exist")
    return weight_map


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files that make up a checkpoint: a `.safetensors` file, or a directory's shards.

    A directory is read through `model.safetensors.index.json` when present,
    else its single `model.safetensors`.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"{path}: no such safetensors file or directory")
    if (path / INDEX_FILE).is_file():
        weight_map = _read_index(path / INDEX_FILE)
        return [path / shard for shard in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise ValueError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def load_safetensors_dir(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    select: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, under its name in the file (Hugging Face names).

    `path` is a directory (sharded through its index, or holding
    `model.safetensors`) or a single `.safetensors` file. Each tensor is
    copied once, from the mapping straight to `device` and `dtype` (None keeps
    the file's dtype), so the result never refers to the mapped file.
    `select(name, view)`: the part of each tensor to keep (a slice of the mapped
    view: a tensor-parallel rank copies only its own slice).
    """
    path = Path(path)
    weight_map: dict[str, str] | None = None
    if path.is_dir() and (path / INDEX_FILE).is_file():
        weight_map = _read_index(path / INDEX_FILE)
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with SafetensorsFile(file) as st:
            for name in st.keys():
                if weight_map is not None and weight_map.get(name) != file.name:
                    where = weight_map.get(name)
                    said = f"the index puts it in {where!r}" if where else "the index omits it"
                    raise ValueError(f"{file}: holds tensor {name!r} but {said}")
                if name in out:
                    raise ValueError(f"{file}: tensor {name!r} also appears in another shard")
                view = st.get_tensor(name)
                if select is not None:
                    view = select(name, view)
                out[name] = view.to(
                    device=device, dtype=view.dtype if dtype is None else dtype, copy=True
                )
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(out))
        if missing:
            first = missing[0]
            raise ValueError(
                f"{path / INDEX_FILE}: tensor {first!r} is not in {weight_map[first]!r}, where "
                f"the index puts it ({len(missing)} listed tensors missing in all)"
            )
    return out


def load_hf_state_dict(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict of a Hugging Face checkpoint: a directory or one `model.safetensors`."""
    return load_safetensors_dir(path, device=device, dtype=dtype)
