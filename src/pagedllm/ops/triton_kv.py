"""Triton row movers: the KV store at `slot_mapping` and the embedding gather.

Owns: `store_kvcache` and `embedding`. Does not own: the numerics
(`reference.store_kvcache`, `reference.embedding`) or which slot a token gets
(the block manager and the runner decide that).

store_kvcache: one program per token copies its K and V rows (Hkv, D) to slot
`page * BS + offset` of the (NB, BS, Hkv, D) caches. k and v may be strided views
of the fused QKV output. A negative slot is a no-op: padding rows of a captured
CUDA graph batch point there. A float8 cache gets `to_cache`'s clamp and
round-to-nearest-even cast (`reference.to_cache_dtype`); `rope_and_store` uses it
too.

embedding: a plain row gather, (T,) ids -> (T, E). It is a Triton kernel only so
that every op of the forward pass is ours; `weight[input_ids]` would cost the
same (one read of T rows of E).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.reference import FP8_KV_DTYPE, FP8_KV_MAX


def cache_max(cache: torch.Tensor) -> float:
    """`to_cache`'s CACHE_MAX for a cache: float8's largest value, else 0 (no clamp)."""
    return FP8_KV_MAX if cache.dtype == FP8_KV_DTYPE else 0.0


@triton.jit
def to_cache(x, cache_ptr, CACHE_MAX: tl.constexpr):
    """x as the cache at cache_ptr stores it: clamped to +-CACHE_MAX first when that
    is not 0 (a float8 cache), then cast (rounding to nearest even)."""
    if CACHE_MAX > 0:
        x = tl.clamp(x.to(tl.float32), -CACHE_MAX, CACHE_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,  # (T, Hkv, D)
    v_ptr,
    k_cache_ptr,  # (NB, BS, Hkv, D)
    v_cache_ptr,
    slot_mapping_ptr,  # (T,)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_nb,
    stride_kc_bs,
    stride_kc_h,
    stride_vc_nb,
    stride_vc_bs,
    stride_vc_h,
    HKV,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CACHE_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    page = slot // BS
    row = slot % BS
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    mask = (offs_h < HKV)[:, None] & (slot >= 0)
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + src, mask=mask)
    dst = page * stride_kc_nb + row * stride_kc_bs + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr, CACHE_MAX), mask=mask)
    src = offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(v_ptr + t * stride_vt + src, mask=mask)
    dst = page * stride_vc_nb + row * stride_vc_bs + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr, CACHE_MAX), mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See `reference.store_kvcache`; slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, "last dim must be contiguous"
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        D=head_dim,
        BS=k_cache.shape[1],
        BLOCK_H=block_h,
        CACHE_MAX=cache_max(k_cache),
        num_warps=4 if block_h * head_dim <= 2048 else 8,
    )


EMBED_BLOCK = 1024


@triton.jit
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, stride_w, stride_out, E, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    token = tl.load(ids_ptr + t).to(tl.int64)
    row = tl.load(weight_ptr + token * stride_w + offs, mask=mask)
    tl.store(out_ptr + t * stride_out + offs, row, mask=mask)


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See `reference.embedding`. (T,) ids, (V, E) -> (T, E)."""
    ids = input_ids.reshape(-1)
    hidden = weight.shape[1]
    assert weight.stride(1) == 1
    out = torch.empty((ids.shape[0], hidden), dtype=weight.dtype, device=weight.device)
    if ids.shape[0] > 0:
        grid = (ids.shape[0], triton.cdiv(hidden, EMBED_BLOCK))
        _embedding_kernel[grid](
            ids, weight, out, weight.stride(0), out.stride(0), hidden, BLOCK=EMBED_BLOCK
        )
    return out.view(*input_ids.shape, hidden)
