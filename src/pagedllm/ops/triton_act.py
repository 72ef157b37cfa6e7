"""Triton gated-MLP activations: act(gate) * up in one pass over the fused
gate/up output, act = SiLU (SwiGLU: Llama, Qwen, Mistral) or GELU with the tanh
approximation (GeGLU: Gemma).

Owns: `silu_and_mul`, `gelu_tanh_and_mul` and the activations themselves
(`activation`, which the GEMV's epilogue in `triton_gemv.py` calls too). Does
not own: the numerics (`reference.silu_and_mul`, `reference.gelu_tanh_and_mul`):
the activation is computed in float32 and rounded to the input dtype before the
multiply, as Hugging Face does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # 8 bf16 elements (16 bytes) per thread with 4 warps

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def activation(g, ACT: tl.constexpr):
    """ACT of a float32 tensor: "silu", g * sigmoid(g); or "gelu_tanh", 0.5 g (1 +
    tanh(sqrt(2/pi) (g + 0.044715 g^3))), torch's gelu(approximate="tanh")."""
    if ACT == "gelu_tanh":
        # tanh from one exp (Triton has no portable tanh): tanh(|u|) = (1 - e) / (1 +
        # e), e = exp(-2|u|) <= 1, so nothing overflows. Then 1 + tanh(u) in float32,
        # as torch adds it: for gates below about -3 that sum cancels, and computing
        # it otherwise (g * sigmoid(2u), more exact) changed 4x more bf16 outputs
        # than this does (~7 % against ~2 % on randn * 3 gates, each by ~1e-7 * |g|).
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (...)
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(u < 0.0, -t, t)
        return 0.5 * g * (1.0 + t)
    else:
        tl.static_assert(ACT == "silu")
        return g / (1.0 + tl.exp(-g))


# The name keeps "silu" for scripts/profile_step.py's SwiGLU category.
@triton.jit
def _silu_or_gelu_and_mul_kernel(
    x_ptr,  # (T, 2I) laid out [gate | up]
    out_ptr,  # (T, I)
    stride_x,
    stride_out,
    I,
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,  # "silu" or "gelu_tanh"
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0)
    act = activation(gate.to(tl.float32), ACT).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up: (..., 2I) -> (..., I), act one of ACTIVATIONS."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: choose one of {', '.join(ACTIVATIONS)}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(inter, BLOCK))
        _silu_or_gelu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=BLOCK, ACT=act
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `reference.silu_and_mul`. (..., 2I) -> (..., I)."""
    return act_and_mul(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `reference.gelu_tanh_and_mul`. (..., 2I) -> (..., I)."""
    return act_and_mul(x, "gelu_tanh")
