"""Triton SwiGLU gate: silu(gate) * up in one pass over the fused gate/up output.

Owns: `silu_and_mul`. Does not own: the numerics (`reference.silu_and_mul`):
silu is computed in float32 and rounded to the input dtype before the multiply,
as Hugging Face does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # 8 bf16 elements (16 bytes) per thread with 4 warps


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (T, 2I) laid out [gate | up]
    out_ptr,  # (T, I)
    stride_x,
    stride_out,
    I,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `reference.silu_and_mul`. (..., 2I) -> (..., I)."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(inter, BLOCK))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, BLOCK=BLOCK)
    return out.view(*x.shape[:-1], inter)
