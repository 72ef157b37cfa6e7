"""Triton RoPE, applied in place to q and k in one launch.

Owns: `apply_rope`. Does not own: the frequencies (Llama 3 scaling included),
which live in the (P, D) float32 [cos | sin] cache built by
`reference.rope_cos_sin_cache`, nor the numerics (`reference.apply_rope`,
"rotate half": dim i pairs with i + D/2).

q (T, H, D) and k (T, Hkv, D) may be strided views of the fused QKV output
(row stride (H + 2Hkv) * D); only their last dim must be contiguous. One
program per token loads that position's cos/sin once and rotates every head
of q and k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Rotate the (num_heads, 2*HALF) rows at ptr (one token) in place."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    p1 = ptr + offs_h[:, None] * stride_h + offs_d[None, :]  # first half
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * cos[None, :] - x2f * sin[None, :]
    o2 = x2f * cos[None, :] + x1f * sin[None, :]
    tl.store(p1, o1.to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, o2.to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,  # (T, H, D)
    k_ptr,  # (T, Hkv, D)
    positions_ptr,  # (T,)
    cos_sin_ptr,  # (P, D) float32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    H,
    HKV,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, H, cos, sin, BLOCK_H, HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, HKV, cos, sin, BLOCK_HKV, HALF)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.apply_rope`. Rotates q and k in place and returns them."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("apply_rope works in place: q and k need a contiguous last dim")
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    block_h = triton.next_power_of_2(num_heads)
    _rope_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_H=block_h,
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        num_warps=4 if block_h * head_dim <= 4096 else 8,
    )
    return q, k
