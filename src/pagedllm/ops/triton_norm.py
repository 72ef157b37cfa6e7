"""Triton RMSNorm, plain and fused with the residual add.

Owns: one-program-per-row kernels that read a row once, reduce it in float32
and write it back. Does not own: the numerics (`reference.rms_norm`,
`reference.fused_add_rms_norm`), which these reproduce bit for bit in the
rounding steps: the sum x + residual is rounded to the input dtype before it is
normalized, and the normalized row is rounded before the weight multiplies it
(Hugging Face's order).

`fused_add_rms_norm` writes in place: the new residual over `residual`, the
normed row over `x`. The model never reads either input again.

`rms_norm` also normalizes each head of a (T, H, D) tensor (Qwen3's and Gemma 3's
q/k norms, weight (D,)), read in place even when it is a strided view of the
fused QKV output (token stride != H * D): one program per (token, head) row, no
copy first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.triton_pdl import pdl_start, pdl_wait, use_pdl


@triton.jit
def rms_norm_row(x_row, res_row, w_ptr, offs, mask, E, eps, HAS_RESIDUAL: tl.constexpr):
    """One row's norm, as the kernels here compute it: x (+ the residual, rounded
    to x's dtype and stored over it, when HAS_RESIDUAL), x * rsqrt(mean(x^2) + eps)
    rounded to x's dtype, times the weight, in float32 (the caller rounds). Shared
    with triton_fp8's norm that quantizes its output, so that both do the same
    arithmetic."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(res_row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / E
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)  # HF rounds before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (T, E), or (T, HEADS, E) with a token stride and a head stride
    res_ptr,  # (T, E), read and overwritten with x + residual when HAS_RESIDUAL
    w_ptr,  # (E,)
    out_ptr,  # (T, E)
    stride_x,
    stride_res,
    stride_out,
    E,
    eps,
    HEADS,  # rows per token of x (1: a plain (T, E); specialized, so no division)
    stride_xh,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent launch (ops/triton_pdl.py)
):
    pdl_start(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < E
    x_row = x_ptr + (row // HEADS) * stride_x + (row % HEADS) * stride_xh
    y = rms_norm_row(x_row, res_ptr + row * stride_res, w_ptr, offs, mask, E, eps, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., E) -> (T, E) with a contiguous last dim (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def norm_warps(block: int) -> int:
    """Warps of a program that holds a row of `block` values (a power of two). The
    sum of squares is reduced in an order set by the layout, so a kernel that must
    give these kernels' bits (triton_fp8.rms_norm_quantize) takes the same."""
    # 16 bytes per thread per load at E=2048 bf16 with 8 warps. Rows of one head
    # (D = 64-256: q/k norms) get one or two warps: 8 bf16 values per thread at
    # D=256 instead of 2 (four warps mostly idle, one program per head row).
    if block <= 256:
        return 1
    if block <= 512:
        return 2
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _launch(x2, res2, weight, out2, eps, has_residual, heads=1, stride_xh=0):
    """One program per row of out2 (T * heads, E); x2 is (T, E), or with heads > 1
    (T, heads, E) read through its token and head strides."""
    num_rows, hidden = out2.shape
    block = triton.next_power_of_2(hidden)
    num_warps = norm_warps(block)
    pdl = use_pdl(x2)
    _rms_norm_kernel[(num_rows,)](
        x2,
        res2,
        weight,
        out2,
        x2.stride(0),
        res2.stride(0),
        out2.stride(0),
        hidden,
        eps,
        heads,
        stride_xh,
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `reference.rms_norm`. (..., E) -> (..., E), a new contiguous tensor. A
    (T, H, D) x with a contiguous last dim (a per-head norm over a strided view of
    the fused QKV output) is read where it lies."""
    out_dtype = torch.promote_types(x.dtype, weight.dtype)  # as `weight * normed` would
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return out
    out2 = out.view(-1, x.shape[-1])
    if x.dim() == 3 and x.stride(-1) == 1:
        _launch(x, x, weight, out2, eps, False, heads=x.shape[1], stride_xh=x.stride(1))
    else:
        x2 = _as_rows(x)
        _launch(x2, x2, weight, out2, eps, has_residual=False)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.fused_add_rms_norm`: returns (normed, x + residual), both in place."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    x2 = _as_rows(x)
    res2 = _as_rows(residual)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    # Write the normed rows over x: each program reads its row before writing it.
    out = x2 if out_dtype == x.dtype else torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0] > 0:
        _launch(x2, res2, weight, out, eps, has_residual=True)
    return out.view(x.shape), res2.view(residual.shape)
