"""Triton RoPE, applied in place to q and k in one launch.

Owns: `apply_rope`, and `rope_and_store` (RoPE, then the new K/V written to
their KV-cache slots, in the same launch: one kernel per layer instead of two).
Does not own: the frequencies (Llama 3 scaling included),
which live in the (P, D) float32 [cos | sin] cache built by
`reference.rope_cos_sin_cache`, nor the numerics (`reference.apply_rope`,
"rotate half": dim i pairs with i + D/2).

q (T, H, D) and k (T, Hkv, D) may be strided views of the fused QKV output
(row stride (H + 2Hkv) * D); only their last dim must be contiguous. One
program per token loads that position's cos/sin once and rotates every head
of q and k. The cache write goes through `triton_kv.to_cache` (a float8 cache
clamps, then rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.triton_attention import check_head_dim
from pagedllm.ops.triton_kv import cache_max, to_cache
from pagedllm.ops.triton_pdl import pdl_start, pdl_wait, use_pdl


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
    check_head_dim(head_dim)
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


@triton.jit
def _rope_store_kernel(
    q_ptr,  # (T, H, D)
    k_ptr,  # (T, Hkv, D)
    v_ptr,  # (T, Hkv, D)
    positions_ptr,  # (T,)
    cos_sin_ptr,  # (P, D) float32
    k_cache_ptr,  # (NB, BS, Hkv, D)
    v_cache_ptr,
    slot_mapping_ptr,  # (T,); a slot < 0 writes nothing (CUDA-graph padding)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_kc_nb,
    stride_kc_bs,
    stride_kc_h,
    stride_vc_nb,
    stride_vc_bs,
    stride_vc_h,
    H,
    HKV,
    HALF: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    CACHE_MAX: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent launch (ops/triton_pdl.py)
):
    pdl_start(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, H, cos, sin, BLOCK_H, HALF)
    # k: rotated in place (prefill attention reads the new tokens' k from there)
    # and written to its slot; v: copied to its slot.
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    page = slot // BS
    row = slot % BS
    offs_h = tl.arange(0, BLOCK_HKV)
    head_ok = (offs_h < HKV)[:, None]
    in_cache = head_ok & (slot >= 0)
    src = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(src, mask=head_ok, other=0.0)
    x2 = tl.load(src + HALF, mask=head_ok, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    o2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    tl.store(src, o1, mask=head_ok)
    tl.store(src + HALF, o2, mask=head_ok)
    dst = (
        k_cache_ptr
        + page * stride_kc_nb
        + row * stride_kc_bs
        + offs_h[:, None] * stride_kc_h
        + offs_d[None, :]
    )
    tl.store(dst, to_cache(o1, k_cache_ptr, CACHE_MAX), mask=in_cache)
    tl.store(dst + HALF, to_cache(o2, k_cache_ptr, CACHE_MAX), mask=in_cache)
    src = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = (
        v_cache_ptr
        + page * stride_vc_nb
        + row * stride_vc_bs
        + offs_h[:, None] * stride_vc_h
        + offs_d[None, :]
    )
    for half in tl.static_range(2):
        v = tl.load(src + half * HALF, mask=in_cache)
        tl.store(dst + half * HALF, to_cache(v, v_cache_ptr, CACHE_MAX), mask=in_cache)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.rope_and_store`: q and k rotated in place and returned; the
    rotated k and v written to their slots (slots < 0 skipped)."""
    num_tokens, num_heads, head_dim = q.shape
    check_head_dim(head_dim)
    num_kv_heads = k.shape[1]
    for t in (q, k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("rope_and_store needs a contiguous last dim")
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    block_h = triton.next_power_of_2(num_heads)
    pdl = use_pdl(q)
    _rope_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        num_kv_heads,
        HALF=head_dim // 2,
        BS=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        CACHE_MAX=cache_max(k_cache),
        PDL=pdl,
        num_warps=4 if block_h * head_dim <= 4096 else 8,
        launch_pdl=pdl,
    )
    return q, k
