"""GGUF files: a validating header parser, vectorised dequantizers, and Llama name mapping.

Owns: reading a GGUF container (metadata key/values, tensor infos, tensor
bytes), dequantizing the supported ggml types to a torch dtype, and turning a
llama.cpp Llama checkpoint into a Hugging Face-named state dict (names mapped,
Q/K row permutation undone). Does not own: building a `ModelConfig` from the
metadata (`pagedllm.config`), the tokenizer, or writing GGUF.

Why our own parser rather than `gguf.GGUFReader`: the reader builds one numpy
view per string of the vocabulary (about 2 s for SmolLM2's 49k tokens and
merges) and does not bound-check, so a truncated file fails deep inside numpy
(IndexError, a reshape error) or loops on a corrupt count. The format is small:
a magic, a version, two counts, key/values and tensor infos, then aligned data.
We use the `gguf` package for its constants (type ids, block sizes) and, in the
tests, `gguf.quants.dequantize` as the oracle.

Invariants, checked on open (any violation is a `ValueError` naming the file):
- magic `GGUF`, version 2 or 3, little-endian;
- every count and length is read against the bytes left, before looping or
  allocating, so no corrupt number can cause a hang or a huge allocation;
- every tensor has a unique name shorter than 64 bytes, at most 4 dimensions,
  each below 2**63 with a product below 2**63, a known ggml type and a first
  dimension divisible by the type's block size (llama.cpp's gguf.cpp checks);
- the tensors are packed in table order, as llama.cpp requires: each offset
  is the sum of the previous tensors' sizes, each padded up to
  `general.alignment` (default 32); the last tensor's bytes end inside the
  file, and at most its alignment padding follows them. A tensor whose type
  or shape was changed in the table no longer fits this layout, so it is
  refused instead of being read from the wrong bytes.
Types we cannot dequantize are listed by `tensor_info` and refused by name
when loaded.

torch is imported where a tensor is made, not with the module: the header
parser (`GGUFFile`, `tensor_info`, `hf_name`) runs without it, so `pagedllm
inspect` of a GGUF needs no torch.

Shapes: GGUF lists dimensions fastest-first (`ne[0]` is the row length), so
a weight listed `[in, out]` is the torch `(out, in)` matrix. Everything this
module returns uses torch order.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.gguf_metadata import GGUFCursor, read_header
from pagedllm.utils import plural

if TYPE_CHECKING:
    import torch

DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS in ggml.h
MAX_NAME_BYTES = 63  # GGML_MAX_NAME (64) counts the terminating NUL
_INT64_LIMIT = 2**63  # ggml's ne[] are int64_t: a u64 at or above this is negative there

Q = GGMLQuantizationType

# ----- dequantizers ---------------------------------------------------------------------------
#
# Each takes `blocks`, a (N, type_size) uint8 tensor of N ggml blocks, and
# returns (N, block_size) float32 on the same device. They follow ggml-quants.c
# (and gguf-py's numpy port) operation by operation, so results are bitwise
# equal to `gguf.quants.dequantize`.


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as (N, 1) float32."""
    import torch

    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifts(values: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.uint8, device=device).view(shape)


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, groups*W) packed bytes -> (N, groups, 2, W): low nibbles, then high, per group."""
    n = qs.shape[0]
    qs = qs.reshape(n, groups, 1, -1)
    return (qs >> _shifts([0, 4], (1, 1, 2, 1), qs.device)) & 0x0F


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | 32 x int8 q ; x = d * q
    import torch

    d = _f16(b, 0)  # (N, 1)
    q = b[:, 2:].contiguous().view(torch.int8).float()  # (N, 32)
    return q * d


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | 16 bytes of nibbles (elements 0-15 low, 16-31 high) ; x = d * (q - 8)
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], 32).float() - 8.0
    return d * q


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 m | 16 bytes of nibbles ; x = d * q + m
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:], 1).reshape(b.shape[0], 32).float()
    return d * q + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: (N, 4) bytes of a little-endian u32 -> (N, 32) uint8, bit i of it at column i.

    ggml reads the four bytes as one uint32 and takes bit j for element j
    (j < 16, the low nibbles) and bit j + 16 for element j + 16 (the high
    nibbles). Little-endian, bit i of the u32 is bit i % 8 of byte i // 8, so
    shifting each byte by 0..7 gives the bits in element order without a
    uint32 tensor (torch's shifts on uint32 are not implemented everywhere).
    """
    n = qh.shape[0]
    bits = (qh.reshape(n, 4, 1) >> _shifts(list(range(8)), (1, 1, 8), qh.device)) & 1
    return bits.reshape(n, 32)


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | 4 bytes fifth bits | 16 bytes of nibbles ; x = d * (q - 16)
    d = _f16(b, 0)
    low = _nibbles(b[:, 6:], 1).reshape(b.shape[0], 32)
    q = (low | (_fifth_bits(b[:, 2:6]) << 4)).float() - 16.0
    return d * q


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 m | 4 bytes fifth bits | 16 bytes of nibbles ; x = d * q + m
    d, m = _f16(b, 0), _f16(b, 2)
    low = _nibbles(b[:, 8:], 1).reshape(b.shape[0], 32)
    q = (low | (_fifth_bits(b[:, 4:8]) << 4)).float()
    return d * q + m


def _k_scales_mins(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 8 sub-block scales and mins, 6 bits each, packed into 12 bytes at offset 4.

    Byte layout (ggml's get_scale_min_k4): bytes 0-3 hold scales 0-3 (low 6 bits)
    and the top 2 bits of scales 4-7; bytes 4-7 the same for mins; bytes 8-11
    the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    Returns (N, 8, 1) float32 each: d * scale and dmin * min.
    """
    import torch

    n = b.shape[0]
    packed = b[:, 4:16].reshape(n, 3, 4)
    sc_lo, mn_lo, hi = packed[:, 0], packed[:, 1], packed[:, 2]  # (N, 4) each
    scales = torch.cat([sc_lo & 0x3F, (hi & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=1)  # (N, 8)
    mins = torch.cat([mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 2) & 0x30)], dim=1)  # (N, 8)
    d, dmin = _f16(b, 0), _f16(b, 2)
    return (d * scales.float()).view(n, 8, 1), (dmin * mins.float()).view(n, 8, 1)


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    # block (256): f16 d | f16 dmin | 12 bytes scales/mins | 128 bytes nibbles
    # 8 sub-blocks of 32: x = d*scale_j * q - dmin*min_j
    n = b.shape[0]
    scale, minus = _k_scales_mins(b)
    q = _nibbles(b[:, 16:], 4).reshape(n, 8, 32).float()
    return (scale * q - minus).reshape(n, 256)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    # block (256): f16 d | f16 dmin | 12 bytes scales/mins | 32 bytes high bits | 128 bytes nibbles
    n = b.shape[0]
    scale, minus = _k_scales_mins(b)
    low = _nibbles(b[:, 48:], 4).reshape(n, 8, 32)
    # bit j of qh[i] is the fifth bit of element i of sub-block j
    qh = b[:, 16:48].reshape(n, 1, 1, 32)
    high = ((qh >> _shifts(list(range(8)), (1, 1, 8, 1), b.device)) & 1).reshape(n, 8, 32)
    q = (low | (high << 4)).float()
    return (scale * q - minus).reshape(n, 256)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    # block (256): 128 bytes low nibbles | 64 bytes 2-bit highs | 16 x int8 scales | f16 d
    # 16 sub-blocks of 16: x = d * scale_j * (q - 32)
    import torch

    n = b.shape[0]
    low = _nibbles(b[:, :128], 2).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).float() - 32.0).reshape(n, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # (N, 16)
    d = (_f16(b, 208) * scales).view(n, 16, 1)
    return (d * q).reshape(n, 256)


_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _deq_q8_0,
    Q.Q4_0: _deq_q4_0,
    Q.Q4_1: _deq_q4_1,
    Q.Q5_0: _deq_q5_0,
    Q.Q5_1: _deq_q5_1,
    Q.Q4_K: _deq_q4_k,
    Q.Q5_K: _deq_q5_k,
    Q.Q6_K: _deq_q6_k,
}
_FLOAT_TYPES: dict[GGMLQuantizationType, str] = {  # the torch dtype's name
    Q.F32: "float32",
    Q.F16: "float16",
    Q.BF16: "bfloat16",
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_FLOAT_TYPES, *_DEQUANTIZERS))

# Elements per dequantization chunk: bounds the float32 temporaries (~16 MB each)
# so a 128k x 8k embedding does not need several full-size intermediates.
_CHUNK_ELEMENTS = 1 << 22


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
    """Raw ggml bytes (1-D uint8) -> a flat tensor of `dtype`, on `raw`'s device.

    Always returns new memory, never a view of `raw`.
    """
    import torch

    if qtype in _FLOAT_TYPES:
        return raw.view(getattr(torch, _FLOAT_TYPES[qtype])).to(dtype=dtype, copy=True)
    if qtype not in _DEQUANTIZERS:
        raise ValueError(
            f"ggml type {qtype.name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(-1, type_size)  # (N, type_size)
    fn = _DEQUANTIZERS[qtype]
    chunk = max(1, _CHUNK_ELEMENTS // block_size)
    if blocks.shape[0] <= chunk:
        return fn(blocks).to(dtype).reshape(-1)
    out = torch.empty((blocks.shape[0], block_size), dtype=dtype, device=raw.device)
    for i in range(0, blocks.shape[0], chunk):
        out[i : i + chunk] = fn(blocks[i : i + chunk])
    return out.reshape(-1)


# ----- the container --------------------------------------------------------------------------

# value type -> (struct format, numpy dtype) for the fixed-size scalars


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives and what it is. `shape` is in torch order (slowest first)."""

    name: str
    type_name: str  # ggml type, e.g. "Q4_K"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return GGMLQuantizationType[self.type_name]

    @property
    def supported(self) -> bool:
        return self.type_name in SUPPORTED_TYPES


def unsupported_type_message(path: Path, info: GGUFTensorInfo) -> str:
    """The one-line error for a tensor whose ggml type we cannot dequantize."""
    return (
        f"{path}: tensor {info.name!r} has ggml type {info.type_name}, which is not supported "
        f"(supported: {', '.join(SUPPORTED_TYPES)}); re-quantize the model to one of these, "
        "for example with llama.cpp's llama-quantize"
    )


class GGUFFile:
    """A validated, memory-mapped GGUF file.

    `metadata` holds every key/value as plain Python (str, int, float, bool,
    lists of those); `tensor_names` lists tensors in file order;
    `load_tensor(name)` dequantizes one.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        try:
            with open(self.path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if self.file_size < 24:
                    self._fail(
                        f"file is {plural(self.file_size, 'byte')}, too short for a GGUF header"
                    )
                # Copy-on-write so torch gets writable buffers; nothing is ever written back.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ValueError(f"{self.path}: cannot read GGUF file: {e}") from e
        try:
            self._parse(GGUFCursor(self._mmap, self.file_size, self._fail))
        except ValueError:
            self.close()
            raise
        except Exception as e:
            # Safety net: every read above is bounds-checked, but a corrupt file must
            # still surface as the one exception type callers handle.
            self.close()
            raise ValueError(f"{self.path}: invalid GGUF file: {type(e).__name__}: {e}") from e

    def _fail(self, defect: str) -> NoReturn:
        raise ValueError(f"{self.path}: invalid GGUF file: {defect}")

    def _parse(self, cur: GGUFCursor) -> None:
        # 1-2. magic, version, counts, key/values (shared with the tokenizer)
        self.version, n_tensors, self.metadata = read_header(cur, self._fail)

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            self._fail(f"general.alignment {alignment!r} is not a positive power of two")

        # 3. tensor infos (offsets are relative to the aligned start of the data)
        self._tensors: dict[str, GGUFTensorInfo] = {}
        infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            info = self._read_tensor_info(cur, i)
            name = info[0]
            if name in seen:
                self._fail(f"duplicate tensor name {name!r}")
            seen.add(name)
            infos.append(info)
        data_start = -(-cur.pos // alignment) * alignment

        # 4. the packed layout: tensor i starts where tensor i-1's padded bytes end
        expected = 0
        for name, ne, qtype, rel_offset, nbytes in infos:
            if rel_offset != expected:
                self._fail(
                    f"tensor {name!r} has offset {rel_offset}, expected {expected}: tensors "
                    f"must be packed in table order, each padded to {plural(alignment, 'byte')} "
                    "(llama.cpp refuses this file too); the tensor table is corrupt, or a "
                    "tensor's type or shape was changed"
                )
            self._check_in_file(name, ne, qtype, data_start + rel_offset, nbytes)
            expected += -(-nbytes // alignment) * alignment
            shape = tuple(reversed(ne))  # torch order: GGUF lists the fastest dimension first
            self._tensors[name] = GGUFTensorInfo(
                name, qtype.name, shape, data_start + rel_offset, nbytes
            )
        # 5. nothing but the last tensor's alignment padding may follow the data
        if infos:
            name, _, _, rel_offset, nbytes = infos[-1]
            data_end = data_start + rel_offset + nbytes
            if self.file_size > data_start + expected:
                extra = self.file_size - data_end
                self._fail(
                    f"{plural(extra, 'byte')} follow{'s' * (extra == 1)} the last tensor "
                    f"{name!r}, which "
                    f"ends at {data_end} (at most its padding to {alignment} is allowed): the "
                    "tensor table does not describe this file; was a tensor's type or shape "
                    "changed?"
                )
        self.data_offset = data_start
        self.alignment = alignment

    def _read_tensor_info(
        self, cur: GGUFCursor, i: int
    ) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
        """One tensor description: (name, ne fastest-first, type, relative offset, nbytes)."""
        name = cur.string(f"name of tensor #{i}")
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            self._fail(
                f"tensor #{i} name {name[:80]!r} is longer than {MAX_NAME_BYTES} bytes "
                "(llama.cpp's limit)"
            )
        n_dims = cur.u32(f"tensor {name!r} n_dims")
        if n_dims > MAX_DIMS:
            self._fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        ne = tuple(cur.u64(f"tensor {name!r} dims") for _ in range(n_dims))
        type_id = cur.u32(f"tensor {name!r} type")
        rel_offset = cur.u64(f"tensor {name!r} offset")
        if any(d >= _INT64_LIMIT for d in ne) or math.prod(ne) >= _INT64_LIMIT - 1:
            self._fail(f"tensor {name!r} has dimensions {list(ne)}: more elements than int64 holds")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            self._fail(f"tensor {name!r} has unknown ggml type id {type_id}")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row = ne[0] if ne else 1
        if row % block_size != 0:
            self._fail(
                f"tensor {name!r}: row length {row} is not a multiple of the "
                f"{qtype.name} block size {block_size}"
            )
        nbytes = math.prod(ne) // block_size * type_size
        return name, ne, qtype, rel_offset, nbytes

    def _check_in_file(
        self, name: str, ne: tuple[int, ...], qtype: GGMLQuantizationType, start: int, nbytes: int
    ) -> None:
        if start + nbytes > self.file_size:
            self._fail(
                f"tensor {name!r} ({qtype.name} {list(reversed(ne))}) needs bytes "
                f"[{start}, {start + nbytes}) but the file ends at {self.file_size}: "
                "the file is truncated or its tensor table is corrupt"
            )

    # ----- access --------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> GGUFTensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def raw_bytes(self, name: str) -> torch.Tensor:
        """A zero-copy (nbytes,) uint8 view of a tensor's bytes in the file."""
        import torch

        info = self.tensor_info(name)
        if self._mmap is None:
            raise ValueError(f"{self.path}: file is closed")
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        # numpy holds the buffer export, so the mapping cannot be closed under the view.
        array = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return torch.from_numpy(array)

    def load_tensor(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> torch.Tensor:
        """Tensor `name` dequantized to `dtype` (None: float32) on `device`, in torch shape order.

        The quantized bytes move to `device` first, so on a GPU the
        dequantization runs there. Unsupported types raise ValueError by name.
        """
        info = self.tensor_info(name)
        if not info.supported:
            raise ValueError(unsupported_type_message(self.path, info))
        import torch

        raw = self.raw_bytes(name).to(device)
        dtype = torch.float32 if dtype is None else dtype
        return dequantize(raw, info.ggml_type, dtype).reshape(info.shape)

    def close(self) -> None:
        """Release the mapping; pages still viewed by live tensors stay until they die."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a raw_bytes() view is alive; it unmaps when collected
            self._mmap = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, v{self.version}, {plural(len(self._tensors), 'tensor')})"
        )


# ----- Llama: GGUF names -> Hugging Face names ------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# What the other families add, under the names llama.cpp gives them.
_LAYER_NAMES_EXTRA = {
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 3 has four norms a layer, and HF calls the one after attention (llama.cpp's
# post_attention_norm) what Llama calls the one before the MLP (ffn_norm).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_NAMES_BY_ARCH = {
    "llama": _LAYER_NAMES,
    "qwen2": {**_LAYER_NAMES, **_LAYER_NAMES_EXTRA},
    "qwen3": {**_LAYER_NAMES, **_LAYER_NAMES_EXTRA},
    "gemma3": {**_GEMMA3_LAYER_NAMES, **_LAYER_NAMES_EXTRA},
}
SUPPORTED_ARCHITECTURES = tuple(_LAYER_NAMES_BY_ARCH)
_ARCH_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma 3"}
_LAYER_INDEX = re.compile(r"0|[1-9][0-9]*")
# Present in llama.cpp's Llama 3 files but not weights: the llama3 RoPE frequency
# factors, which we recompute from the rope-scaling metadata (see pagedllm.config).
IGNORED_TENSORS = frozenset({"rope_freqs.weight"})


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name of architecture `arch`, or
    None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _LAYER_NAMES_BY_ARCH[arch]
    parts = gguf_name.split(".", 2)  # blk, i, rest
    # i as llama.cpp prints it ("blk.%d"): "blk.01" or "blk.²" is no layer, and must not
    # land on (and overwrite) layer 1's weights.
    if (
        len(parts) == 3
        and parts[0] == "blk"
        and _LAYER_INDEX.fullmatch(parts[1])
        and parts[2] in layer_names
    ):
        return f"model.layers.{int(parts[1])}.{layer_names[parts[2]]}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Q or K weight (convert_hf_to_gguf `permute`).

    llama.cpp interleaves each head's rows for its rotate-adjacent-pairs RoPE:
    HF rows (h, half a, j) sit at GGUF row (h, j, a). We read the (rows, cols)
    GGUF matrix as (n_head, D/2, 2, cols) and swap the middle axes back.
    """
    # (a 0-d tensor, from a corrupt tensor table, has no rows to permute)
    if w.dim() == 0 or w.shape[0] % (2 * n_head) != 0:
        raise ValueError(f"cannot un-permute {tuple(w.shape)} over {n_head} heads")
    half = w.shape[0] // n_head // 2  # D/2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _head_count(metadata: dict[str, Any], key: str, path: Path) -> int:
    value = metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{path}: metadata {key!r} is {value!r}, expected a positive integer")
    return value


def load_gguf_state_dict(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,  # None: float32
    strict: bool = True,
    select: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    keep_quantized: Callable[[str, torch.Tensor, GGMLQuantizationType, tuple], Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Metadata and Hugging Face-named, dequantized tensors of a llama.cpp Llama GGUF.

    Q and K weights are un-permuted (Q over `llama.attention.head_count`
    heads, K over `llama.attention.head_count_kv`), so the result is what
    `LlamaForCausalLM.state_dict()` holds. `lm_head.weight` appears only when
    the file has `output.weight` (otherwise the embeddings are tied).
    `rope_freqs.weight` is ignored: we compute llama3 RoPE scaling from the
    metadata. Any other unknown tensor is an error (`strict=True`, the default:
    a weight we would drop silently is a wrong model) or skipped with a warning
    naming it (`strict=False`). `select(hf_name, tensor)`: the part of each
    dequantized tensor to keep (a tensor-parallel rank's slice), taken before
    the next is dequantized. `keep_quantized(hf_name, raw, type, shape)`, asked
    of each quantized tensor (never of F32, F16, BF16 ones) with its bytes (a
    view of the file) and torch shape: what to keep instead of dequantizing it
    (the loader's `gguf_blocks.GgufBlocks`, whose `permute_rows` un-permutes Q
    and K), or None to dequantize it as usual.
    """
    with GGUFFile(path) as g:
        meta = g.metadata
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{g.path}: architecture {arch!r} is not supported (supported: "
                f"{', '.join(map(repr, SUPPORTED_ARCHITECTURES))})"
            )
        n_head = _head_count(meta, f"{arch}.attention.head_count", g.path)
        n_kv_head = (
            _head_count(meta, f"{arch}.attention.head_count_kv", g.path)
            if f"{arch}.attention.head_count_kv" in meta
            else n_head
        )
        # llama.cpp's converter permutes Q and K rows for Llama's GGUF only (its
        # RoPE rotates adjacent pairs there); Qwen and Gemma files keep HF's order.
        permuted = arch == "llama"

        # 1. name map and type check for every tensor before any dequantization,
        #    so a bad file fails in milliseconds rather than half-way through.
        plan: dict[str, str] = {}
        unknown: list[str] = []
        for name in g.tensor_names:
            if name in IGNORED_TENSORS:
                continue
            target = hf_name(name, arch)
            if target is None:
                unknown.append(name)
                continue
            info = g.tensor_info(name)
            if not info.supported:
                raise ValueError(unsupported_type_message(g.path, info))
            plan[name] = target
        if unknown:
            have = "has" if len(unknown) == 1 else "have"
            message = f"{g.path}: {plural(len(unknown), 'tensor')} {have} no {_ARCH_NAMES[arch]} mapping: {unknown[:5]}"
            if strict:
                raise ValueError(message + " (pass strict=False to skip them)")
            warnings.warn(message + "; skipped", stacklevel=2)

        # 2. dequantize (on `device`), then un-permute Q and K
        tensors: dict[str, torch.Tensor] = {}
        for name, target in plan.items():
            info = g.tensor_info(name)
            t = None
            if keep_quantized is not None and info.ggml_type in _DEQUANTIZERS:
                t = keep_quantized(target, g.raw_bytes(name), info.ggml_type, info.shape)
            if t is None:
                t = g.load_tensor(name, dtype=dtype, device=device)
            heads = None
            if not permuted:
                pass
            elif name.endswith(".attn_q.weight"):
                heads = n_head
            elif name.endswith(".attn_k.weight"):
                heads = n_kv_head
            if heads is not None:
                try:
                    t = (
                        t.permute_rows(lambda rows, h=heads: unpermute_qk(rows, h))
                        if hasattr(t, "permute_rows")
                        else unpermute_qk(t, heads)
                    )
                except ValueError as e:
                    raise ValueError(
                        f"{g.path}: tensor {name!r}: {e}; check the attention.head_count "
                        "metadata against the tensor shapes"
                    ) from None
            tensors[target] = t if select is None else select(target, t).clone()
    return meta, tensors
