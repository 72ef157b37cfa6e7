"""A GGUF tensor kept quantized: its ggml blocks, row by row, and what can be read from them.

Owns: `GgufBlocks` (the raw bytes of a quantized (out, in) matrix as (out,
row_bytes) uint8, its ggml type and shape: rows can be permuted,
gathered and dequantized), and `int4_parts`, which reads the 4-bit formats
(Q4_0, Q4_1, Q4_K) as 4-bit integers with one scale and one zero per 32
values, exactly:

    w = (q - 8) * scale + zero,   q in 0..15

    Q4_0:  w = d * (q - 8)                scale = d,          zero = 0
    Q4_1:  w = d * q + m                  scale = d,          zero = m + 8 d
    Q4_K:  w = d sc_j * q - dmin m_j      scale = d sc_j,     zero = 8 d sc_j - dmin m_j
           (8 sub-blocks of 32 in a 256-value super-block)

(`+ 8 d` is one float32 rounding away from ggml's own order of operations:
below 1e-7 relative.) Every other type (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) has
more than 16 levels a group and cannot be read as 4-bit integers. What the CPU
makes of these (`model/cpu_packed.py`) is not decided here.

Does not own: reading the file (`gguf.py`: `load_gguf_state_dict(...,
keep_quantized=...)` makes these), or the dequantizers themselves (`gguf.py`'s,
which the tests compare with `gguf.quants.dequantize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the `gguf` package is imported where blocks are read, not here
    from gguf import GGMLQuantizationType

INT4_EXACT = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # ggml type names
GROUP = 32  # values per (scale, zero) pair in `int4_parts`


@dataclass
class GgufBlocks:
    """A quantized (out, in) matrix as the file stores it: `raw` (out, row_bytes) uint8,
    row r holding the in / block_size ggml blocks of output row r."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @classmethod
    def from_file_bytes(
        cls, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
    ) -> GgufBlocks:
        """`raw`: the tensor's 1-D bytes (a view of the file: copied here). `shape`:
        torch order, (out, in); a 1-D tensor is refused (norms are never quantized
        in llama.cpp's files)."""
        if len(shape) != 2:
            raise ValueError(f"a quantized GGUF tensor kept packed must be a matrix, got {shape}")
        rows = int(shape[0])
        return cls(raw.reshape(rows, -1).clone(), qtype, (rows, int(shape[1])))

    @property
    def dtype(self) -> torch.dtype:
        """What `dequantize` returns."""
        return torch.float32

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def dequantize(self) -> torch.Tensor:
        """The (out, in) float32 matrix, bitwise as `gguf.quants.dequantize`."""
        from pagedllm.weights.gguf import dequantize

        return dequantize(self.raw.reshape(-1), self.qtype, torch.float32).view(self.shape)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (any shape of int64) dequantized: (*index.shape, in) float32."""
        from pagedllm.weights.gguf import dequantize

        picked = self.raw[index.reshape(-1)]
        out = dequantize(picked.reshape(-1), self.qtype, torch.float32)
        return out.view(*index.shape, self.shape[1])

    def permute_rows(self, fn) -> GgufBlocks:
        """The blocks with rows reordered as `fn` reorders a (out, ...) tensor's rows
        (`gguf.unpermute_qk`): a row's blocks never mix with another row's."""
        return GgufBlocks(fn(self.raw).contiguous(), self.qtype, self.shape)

    def int4_exact(self) -> bool:
        return self.qtype.name in INT4_EXACT


def int4_parts(w: GgufBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0, Q4_1 or Q4_K matrix (out, in) as (q, scale, zero): q (out, in) uint8
    in 0..15, scale and zero (out, in / 32) float32, w = (q - 8) * scale + zero
    (see the module docstring). ValueError for any other type."""
    from gguf import GGML_QUANT_SIZES

    from pagedllm.weights.gguf import _f16, _k_scales_mins, _nibbles

    if w.qtype.name not in INT4_EXACT:
        raise ValueError(f"{w.qtype.name} is not a 4-bit format (Q4_0, Q4_1, Q4_K)")
    out, inp = w.shape
    block_size, type_size = GGML_QUANT_SIZES[w.qtype]
    b = w.raw.reshape(-1, type_size)  # (blocks, type_size)
    n = b.shape[0]
    if w.qtype.name == "Q4_K":  # 8 sub-blocks of 32
        scale, minus = _k_scales_mins(b)  # (n, 8, 1) each
        q = _nibbles(b[:, 16:], 4).reshape(n, 8, 32)
        zero = 8.0 * scale - minus
    else:
        d = _f16(b, 0).view(n, 1, 1)
        q = _nibbles(b[:, 2 if w.qtype.name == "Q4_0" else 4 :], 1).reshape(n, 1, 32)
        scale = d
        zero = torch.zeros_like(d) if w.qtype.name == "Q4_0" else _f16(b, 2).view(n, 1, 1) + 8.0 * d
    groups = inp // GROUP
    return (
        q.reshape(out, inp),
        scale.reshape(out, groups),
        zero.reshape(out, groups),
    )
