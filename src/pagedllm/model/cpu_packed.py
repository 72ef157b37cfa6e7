"""CPU matrices that stay quantized: a GGUF's weights packed for PyTorch's int4 and
int8 weight-only kernels, and the LM head and embeddings they need beside them.

Why: a batch-1 decode step reads every weight once. SmolLM2's float32 weights
are 538 MB (a floor of 14-19 ms a token on the 2-core machines we develop on);
its Q4_1 file holds them in 85 MB. PyTorch ships CPU kernels that multiply
such weights without expanding them: `_weight_int4pack_mm_for_cpu` (4-bit
values, one scale and one zero per group of 32) and `_weight_int8pack_mm`
(8-bit values, one scale per output row). Both are fast only with bfloat16
activations (float32 ones take a scalar path, 10-20x slower: measured), so x
is rounded to bf16 on the way in and the result widened back to float32.

What each GGUF type becomes (`PackedLinear.from_blocks`):

| ggml type | packed as | exact? |
|---|---|---|
| Q4_0, Q4_1, Q4_K | int4, groups of 32: w = (q - 8) * scale + zero | the 4-bit values and group structure exactly; scale and zero rounded to bf16, as the kernel takes them |
| Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 | int8, one scale per row (absmax / 127) | rounded: more levels a group than 4 bits, and per-group scales become one per row |

A fused projection (Q/K/V, gate/up) whose parts are all 4-bit stays int4;
otherwise every part is rounded to int8 (Gemma's Q5_0 + Q8_0 V).

The LM head (`Fp16Table`) keeps float16 values (the file's Q8_0 or Q6_K
dequantized, then rounded to 11 bits), and a tied model's embeddings are the
same table: on SmolLM2, an int8 head (one scale a row, through
`_weight_int8pack_mm`) moved perplexity by +0.29 % and changed 2 of 10 greedy
answers, float16 neither (scripts/accuracy.py). fbgemm's fp16 GEMM reads it
faster (3.2 ms against 5.1 on one thread) but holds 98 MiB for its 54 MiB of
values, and a second copy for the embeddings: over issue 38's memory bound.
An untied model's embeddings (`PackedEmbedding`) keep the file's blocks and
dequantize only the rows a step looks up.

Prefill: at more than `PACKED_KERNEL_MAX_ROWS` rows the packed kernels lose to
float32's GEMM (a 1,024-row gate/up: 46 ms int4, 24 ms float32), so such a
product dequantizes the matrix into float32 first (a few ms) and calls the
GEMM. For int4 that reads torch's packed layout back (`_int4pack_block_n`:
found by packing a probe at first use; a torch whose layout is not recognised
multiplies through the int4 kernel instead: slower, same numbers).

The float32 path (`--dtype float32`) dequantizes everything at load and is
the reference every test compares with; `docs/benchmarks.md` records the
accuracy of this one against it.
"""

from __future__ import annotations

from functools import lru_cache
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedllm.weights.gguf_blocks import GROUP, GgufBlocks, int4_parts

PACKED_KERNEL_MAX_ROWS = 16  # more rows: dequantize and use float32's GEMM


def packed_kernels_available() -> bool:
    """Whether this torch has the CPU kernels (torch 2.6 and later: the int4 ones
    for the CPU got their own names then); without them a GGUF is dequantized."""
    aten = torch.ops.aten
    return all(
        hasattr(aten, name)
        for name in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
    ) and hasattr(torch, "_weight_int8pack_mm")


def _int4_pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _int4_unpack(packed: torch.Tensor, n: int, k: int, block_n: int) -> torch.Tensor:
    """(n, k) uint8 values 0..15 back from torch's CPU int4 layout: blocks of
    `block_n` rows, each stored (k, block_n / 2) bytes whose low nibble is row
    d of the block and high nibble row d + block_n / 2."""
    v = packed.reshape(n // block_n, k, block_n // 2)
    both = torch.stack([v & 15, v >> 4], dim=1)  # (NB, 2, k, block_n / 2)
    return both.permute(0, 1, 3, 2).reshape(n, k)


@lru_cache(maxsize=1)
def _int4pack_block_n() -> int | None:
    """The row block of this torch's CPU int4 packing (32 on AVX2, 64 on AVX-512),
    found by packing a probe; None when no candidate reads it back."""
    n, k = 256, 64
    probe = ((torch.arange(n).view(n, 1) * 7 + torch.arange(k) * 3) % 16).to(torch.uint8)
    packed = _int4_pack(probe)
    if packed.numel() * 2 != n * k:
        return None
    for block_n in (16, 32, 64, 128, 256):
        if torch.equal(_int4_unpack(packed, n, k, block_n), probe):
            return block_n
    return None


class _CpuMatrix:
    """What the packed CPU matrices share: they live on the CPU, take and return
    float32 (whatever they store), and have an HF-order `shape`."""

    _shape: torch.Size

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32


class PackedLinear(_CpuMatrix):
    """A GGUF (out, in) matrix kept quantized on the CPU, applied as `linear(x)`:
    (T, in) float32 -> (T, out) float32. `kind` "int4" (4-bit values, a scale and
    a zero per 32 inputs) or "int8" (8-bit values, a scale per output row); see
    the module docstring for which types become which."""

    def __init__(self, kind: str, shape: tuple[int, int], tensors: dict[str, torch.Tensor]):
        self.kind = kind
        self._shape = torch.Size(shape)
        self.tensors = tensors  # int4: packed, scale_zero; int8: q, scale

    @classmethod
    def from_blocks(cls, parts: list[GgufBlocks]) -> PackedLinear:
        """Pack the parts (stacked by rows) as one matrix."""
        out = sum(p.shape[0] for p in parts)
        inp = parts[0].shape[1]
        block_n = _int4pack_block_n() or 64
        if all(p.int4_exact() for p in parts) and inp % GROUP == 0 and out % block_n == 0:
            q, scale, zero = (torch.cat(t) for t in zip(*(int4_parts(p) for p in parts)))
            # (in / 32, out, 2): the kernel's layout for the scales and zeros
            scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
            return cls("int4", (out, inp), {"packed": _int4_pack(q), "scale_zero": scale_zero})
        w = torch.cat([p.dequantize() for p in parts]) if len(parts) > 1 else parts[0].dequantize()
        return cls.int8_from_float(w)

    @classmethod
    def int8_from_float(cls, w: torch.Tensor) -> PackedLinear:
        """Round a float (out, in) matrix to int8, one scale per row (absmax / 127)."""
        w = w.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        scale = scale.to(torch.bfloat16)  # what the kernel multiplies by: round first
        q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls("int8", tuple(w.shape), {"q": q.contiguous(), "scale": scale})

    def __call__(
        self,
        x: torch.Tensor,
        impl: ModuleType | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (T, in) -> (T, out) float32, plus `bias` (out,) when given."""
        t = self.tensors
        if x.shape[0] > PACKED_KERNEL_MAX_ROWS and (self.kind == "int8" or _int4pack_block_n()):
            out = F.linear(x.float(), self.weight)
        elif self.kind == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), t["packed"], GROUP, t["scale_zero"]
            ).float()
        else:
            out = torch._weight_int8pack_mm(x.to(torch.bfloat16), t["q"], t["scale"]).float()
        return out if bias is None else out.add_(bias)

    forward = __call__

    def then_act_and_mul(
        self, x: torch.Tensor, impl: ModuleType, act: str = "silu"
    ) -> torch.Tensor:
        """act(gate) * up of this projection (gate and up stacked)."""
        return (impl.silu_and_mul if act == "silu" else impl.gelu_tanh_and_mul)(self(x))

    def then_silu_and_mul(self, x: torch.Tensor, impl: ModuleType) -> torch.Tensor:
        return self.then_act_and_mul(x, impl, "silu")

    @property
    def weight(self) -> torch.Tensor:
        """The (out, in) float32 matrix the kernels multiply by (a new tensor)."""
        t = self.tensors
        out, inp = self._shape
        if self.kind == "int8":
            return t["q"].float() * t["scale"].float()[:, None]
        block_n = _int4pack_block_n()
        if block_n is None:  # read it back through the kernel: x = I
            eye = torch.eye(inp, dtype=torch.bfloat16)
            w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, t["packed"], GROUP, t["scale_zero"])
            return w.float().t().contiguous()
        q = _int4_unpack(t["packed"], out, inp, block_n).view(out, inp // GROUP, GROUP)
        sz = t["scale_zero"].float()  # (groups, out, 2)
        scale, zero = sz[..., 0].t().unsqueeze(-1), sz[..., 1].t().unsqueeze(-1)
        return ((q.float() - 8.0) * scale + zero).view(out, inp)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        out, inp = self._shape
        return f"PackedLinear(in={inp}, out={out}, {self.kind}, {self.nbytes:,} bytes)"


class Fp16Table(_CpuMatrix):
    """The LM head of a packed model, (V, E) float16 values (the file's Q8_0 or Q6_K
    dequantized, then rounded to 11 bits): `table(x)` multiplies float32 rows by
    it (`F.linear` in float16), `table[ids]` reads rows as float32. A tied model's
    embeddings are the same table, held once."""

    def __init__(self, w: torch.Tensor) -> None:
        if w.dim() != 2:
            raise ValueError(f"an LM head is a matrix, got shape {tuple(w.shape)}")
        self.table = w.to(torch.float16).contiguous()
        self._shape = self.table.shape

    def __call__(self, x: torch.Tensor, impl: ModuleType | None = None) -> torch.Tensor:
        return F.linear(x.to(torch.float16), self.table).float()

    forward = __call__

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return self.table[index].float()

    @property
    def weight(self) -> torch.Tensor:
        """(V, E) float32: the float16 values, widened (a new tensor)."""
        return self.table.float()

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def data_ptr(self) -> int:
        return self.table.data_ptr()

    def element_size(self) -> int:
        return self.table.element_size()

    def __repr__(self) -> str:
        v, e = self.table.shape
        return f"Fp16Table(in={e}, out={v}, float16)"


class PackedEmbedding(_CpuMatrix):
    """The embedding table of a packed model: the file's blocks, (V, row_bytes);
    `table[ids]` dequantizes the rows asked for, (*ids.shape, E) float32."""

    def __init__(self, blocks: GgufBlocks) -> None:
        self.blocks = blocks
        self._shape = torch.Size(blocks.shape)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return self.blocks.rows(index)

    @property
    def weight(self) -> torch.Tensor:
        return self.blocks.dequantize()

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def data_ptr(self) -> int:
        return self.blocks.raw.data_ptr()

    def element_size(self) -> float:
        """Bytes a value, on average (a row's bytes over its values)."""
        return self.blocks.raw.shape[1] / self.blocks.shape[1]

    def __repr__(self) -> str:
        v, e = self.blocks.shape
        return f"PackedEmbedding(vocab={v}, dim={e}, {self.blocks.qtype.name})"


def pack_head(w: GgufBlocks | torch.Tensor) -> Fp16Table:
    return Fp16Table(w.dequantize() if isinstance(w, GgufBlocks) else w)


def pack_matrix(parts: list[GgufBlocks | torch.Tensor]):
    """A fused projection's parts -> a `PackedLinear` when every part is quantized
    blocks; None when any is a float tensor (the caller keeps a float `Linear`)."""
    if not all(isinstance(p, GgufBlocks) for p in parts):
        return None
    return PackedLinear.from_blocks(parts)
