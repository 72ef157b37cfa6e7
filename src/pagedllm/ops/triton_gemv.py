"""Triton GEMV: `y = x @ W.T` for a few rows of x (batch-1 decode), streaming W once.

Why not cuBLAS: at M = 1 a projection is a matrix-vector product whose floor
is reading W once at the copy rate (4.28 TB/s on the H200). cuBLAS picks
M = 8-row tiles and, for the narrow matrices (q/k/v, o_proj), streams them at
about 1.8-3.1 TB/s; for the tall-K ones (down_proj) it splits K and adds a
separate reduce kernel (scripts/profile_step.py --batch 1, 2026-12-01). This
kernel gives each program BLOCK_N whole rows of W, walks K in BLOCK_K chunks
and keeps a (BLOCK_N, BLOCK_K) float32 accumulator of elementwise products,
summed across K once at the end: one pass over W, no split-K, no reduce.

Owns: `linear(x, weight)` (the op `reference.linear`),
`linear_silu_and_mul(x, weight)` (`reference.linear_silu_and_mul`: the gate/up
projection with SwiGLU in its epilogue, so a single row's (1, 2I) gate_up is
never written and the down projection reads a plain (1, I) row) and its GeGLU
twin `linear_gelu_tanh_and_mul` (Gemma; the same kernel, another activation).
For these, a program takes, for each of its output columns j, gate row j and up
row I + j side by side, and applies act(gate) * up to the two sums. Rows beyond
GEMV_MAX_ROWS, other dtypes and non-contiguous weights go to cuBLAS
(`F.linear`). Does not own: the numerics, which are the reference's up to
float32 summation order.

Rows of x: a program serves one x row and one block of W's rows; the grid
puts the x rows of one W block next to each other, so at M > 1 the W tile
the first row read is still in L2 for the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.ops import triton_interpret_fix  # noqa: F401  (CPU interpreter + NumPy 2.4)
from pagedllm.ops.triton_act import ACTIVATIONS, activation, gelu_tanh_and_mul, silu_and_mul
from pagedllm.ops.triton_pdl import pdl_start, pdl_wait, use_pdl

# x rows up to which the GEMV serves: at 2 and 4 rows cuBLAS was as fast or faster
# (scripts/bench_gemv.py, H200, 2026-12-01: 1B gate_up 34 vs 27 us at M = 2).
GEMV_MAX_ROWS = 1
# (BLOCK_N, BLOCK_K, num_warps) per weight shape (N, K); BLOCK_N counts rows of W
# (with SwiGLU, BLOCK_N / 2 gate rows and as many up rows). The fastest of a grid
# timed in a CUDA graph over weights that miss L2 (scripts/bench_gemv.py, H200). us
# per call, cuBLAS -> GEMV: 1B qkv 6.07 -> 4.93, o_proj 6.00 -> 4.02; 8B qkv 16.3 ->
# 14.1, o_proj 12.5 -> 10.2 (2026-12-01); 1B gate/up + SwiGLU 19.6 -> 17.7, down 12.7
# -> 9.9; 8B gate/up + SwiGLU 57.5 -> 54.0 (4.35 TB/s), down 30.5 -> 28.6 (4.11 TB/s;
# 32.3 us when SwiGLU ran in its input) (2026-12-02). Other shapes: DEFAULT_CONFIG.
DEFAULT_CONFIG = (2, 1024, 4)
CONFIGS: dict[tuple[int, int], tuple[int, int, int]] = {
    (3072, 2048): (2, 1024, 4),  # Llama-3.2-1B q/k/v
    (2048, 2048): (2, 1024, 4),  # o_proj
    (16384, 2048): (2, 2048, 2),  # gate/up + SwiGLU
    (2048, 8192): (4, 2048, 4),  # down
    (6144, 4096): (2, 1024, 4),  # Llama-3.1-8B q/k/v
    (4096, 4096): (2, 2048, 2),  # o_proj
    (28672, 4096): (4, 2048, 4),  # gate/up + SwiGLU
    (4096, 14336): (2, 2048, 2),  # down
}


def config_for(n: int, k: int) -> tuple[int, int, int]:
    return CONFIGS.get((n, k), DEFAULT_CONFIG)


@triton.jit
def _gemv_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K), rows contiguous; with GLU, N = 2I laid out [gate | up]
    out_ptr,  # (M, N), or (M, N / 2) with GLU
    b_ptr,  # HAS_BIAS: (N,), added to the sums before their rounding
    s_ptr,  # HAS_SCALE: (N,) float32, each row's sum times its scale (FP8 weights)
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    M: tl.constexpr,
    GLU: tl.constexpr,  # out = act(x @ gate.T) * (x @ up.T), as reference.silu_and_mul rounds it
    BLOCK_N: tl.constexpr,  # rows of W per program
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the kernel before it
    ACT: tl.constexpr = "silu",  # with GLU: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    HAS_BIAS: tl.constexpr = False,  # not with GLU
    HAS_SCALE: tl.constexpr = False,
):
    pdl_start(PDL)  # ops/triton_pdl.py
    pid = tl.program_id(0)
    m = pid % M  # the x rows of one W block are neighbours in the grid (L2 reuse)
    r = tl.arange(0, BLOCK_N)
    if GLU:  # rows (gate j, up j) for BLOCK_N / 2 output columns j
        half = N // 2
        out_cols = (pid // M) * (BLOCK_N // 2) + r // 2
        rows = out_cols + (r % 2) * half  # (BLOCK_N,)
        row_ok = out_cols < half
    else:
        rows = (pid // M) * BLOCK_N + r  # (BLOCK_N,)
        row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # (BLOCK_N, 1)
    x_row = x_ptr + m.to(tl.int64) * stride_x
    # The first chunk of W is read before waiting for the kernel that writes x:
    # weights never depend on it, so with PDL their load overlaps that kernel.
    k_ok = cols < K
    w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    pdl_wait(PDL)
    x = tl.load(x_row + cols, mask=k_ok, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if HAS_SCALE:
        y *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out_row = out_ptr + m.to(tl.int64) * stride_out
    if GLU:
        gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))  # each rounded as cuBLAS's output
        g = gate.to(dtype).to(tl.float32)
        act = activation(g, ACT).to(dtype)
        out = (act.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
        j = (pid // M) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_row + j, out, mask=j < half)
    else:
        tl.store(out_row + rows, y.to(dtype), mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    glu: bool = False,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
    act: str = "silu",
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) -> (M, N) = x @ weight.T, weight (N, K); with `glu`, weight is
    (2I, K) laid out [gate | up] and the result (M, I) is act(x @ gate.T) *
    (x @ up.T), `act` "silu" or "gelu_tanh". `config`: (BLOCK_N, BLOCK_K,
    num_warps), default `config_for(N, K)`; BLOCK_N is rows of W per program
    (even with `glu`). `pdl`: launch as a programmatic dependent
    (ops/triton_pdl.py); None: `use_pdl(x)`. `bias` (N,), without `glu`: added
    to the float32 sums before they are rounded (as `reference.linear`).
    `scale` (N,) float32: each row's float32 sum is multiplied by its scale
    first, so a float8 weight with one scale per output channel multiplies as
    `reference.fp8_linear` (x not quantized: ops/triton_fp8.py, weight-only)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: choose one of {', '.join(ACTIVATIONS)}")
    if bias is not None and glu:
        raise ValueError("a GEMV with an activation takes no bias")
    n, k = weight.shape
    m = x.shape[0]
    block_n, block_k, warps = config or config_for(n, k)
    if glu and config is None and block_n % 2:
        block_n += 1  # a tuned entry for a plain projection of the same shape
    if glu and (n % 2 or block_n % 2):
        raise ValueError(f"a SwiGLU GEMV needs an even row count and BLOCK_N, got {n}, {block_n}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n // 2 if glu else n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if pdl is None:
        pdl = use_pdl(x)
    grid = (triton.cdiv(n, block_n) * m,)
    _gemv_kernel[grid](
        x,
        weight,
        out,
        bias if bias is not None else weight,  # a dummy when there is none
        scale if scale is not None else weight,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        M=m,
        GLU=glu,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        ACT=act,
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        num_warps=warps,
        launch_pdl=pdl,
    )
    return out


def _gemv_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype == weight.dtype
        and weight.stride(-1) == 1
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """See `reference.linear`: the GEMV for a few rows (a bias added in its
    epilogue), else cuBLAS."""
    if _gemv_ok(x, weight) and (
        bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.dim() == 1)
    ):
        return gemv(x, weight, bias=bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See `reference.linear_silu_and_mul`: one GEMV with SwiGLU in its epilogue for a
    few rows, else cuBLAS then the SwiGLU kernel."""
    if _gemv_ok(x, weight) and weight.shape[0] % 2 == 0:
        return gemv(x, weight, glu=True)
    return silu_and_mul(F.linear(x, weight))


def linear_gelu_tanh_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See `reference.linear_gelu_tanh_and_mul`: the same GEMV with GeGLU in its
    epilogue for a few rows, else cuBLAS then the GeGLU kernel."""
    if _gemv_ok(x, weight) and weight.shape[0] % 2 == 0:
        return gemv(x, weight, glu=True, act="gelu_tanh")
    return gelu_tanh_and_mul(F.linear(x, weight))
