"""Triton GEMV: `y = x @ W.T` for a few rows of x (batch-1 decode), streaming W once.

Why not cuBLAS: at M = 1 a projection is a matrix-vector product whose floor
is reading W once at the copy rate (4.28 TB/s on the H200). cuBLAS picks
M = 8-row tiles and, for the narrow matrices (q/k/v, o_proj), streams them at
about 1.8-3.1 TB/s; for the tall-K ones (down_proj) it splits K and adds a
separate reduce kernel (scripts/profile_step.py --batch 1, 2026-12-01). This
kernel gives each program BLOCK_N whole rows of W, walks K in BLOCK_K chunks
and keeps a (BLOCK_N, BLOCK_K) float32 accumulator of elementwise products,
summed across K once at the end: one pass over W, no split-K, no reduce.

Owns: `linear(x, weight)` (the op `reference.linear`) and
`silu_and_mul_linear(gate_up, weight)` (`reference.silu_and_mul_linear`:
SwiGLU's gate fused into the down projection's input, so the (T, I) product
is never written). Rows beyond GEMV_MAX_ROWS, other dtypes and non-contiguous
weights go to cuBLAS (`F.linear`). Does not own: the numerics, which are the
reference's up to float32 summation order.

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
from pagedllm.ops.triton_act import silu_and_mul
from pagedllm.ops.triton_pdl import pdl_start, pdl_wait, use_pdl

# x rows up to which the GEMV serves: at 2 and 4 rows cuBLAS was as fast or faster
# (scripts/bench_gemv.py, H200, 2026-12-01: 1B gate_up 34 vs 27 us at M = 2).
GEMV_MAX_ROWS = 1
# (BLOCK_N, BLOCK_K, num_warps) per weight shape (N, K): the fastest of a 64-config
# grid, timed in a CUDA graph over weights that miss L2 (scripts/bench_gemv.py, H200,
# 2026-12-01; us per call, cuBLAS -> GEMV: 1B qkv 6.07 -> 4.93, o_proj 6.00 -> 4.02,
# gate_up 18.5 -> 17.5, down + SwiGLU 13.9 -> 11.3; 8B qkv 16.3 -> 14.1, o_proj
# 12.5 -> 10.2, gate_up 56.9 -> 54.7 (4.29 TB/s), down + SwiGLU 32.6 -> 32.3).
# Two rows a program and 1,024-2,048 columns a step won nearly everywhere; other
# shapes take DEFAULT_CONFIG.
DEFAULT_CONFIG = (2, 1024, 4)
CONFIGS: dict[tuple[int, int], tuple[int, int, int]] = {
    (3072, 2048): (2, 1024, 4),  # Llama-3.2-1B q/k/v
    (2048, 2048): (2, 1024, 4),  # o_proj
    (16384, 2048): (2, 1024, 1),  # gate/up
    (2048, 8192): (8, 2048, 8),  # down
    (6144, 4096): (2, 1024, 4),  # Llama-3.1-8B q/k/v
    (4096, 4096): (2, 2048, 2),  # o_proj
    (28672, 4096): (2, 2048, 2),  # gate/up
    (4096, 14336): (8, 2048, 8),  # down
}


def config_for(n: int, k: int) -> tuple[int, int, int]:
    return CONFIGS.get((n, k), DEFAULT_CONFIG)


@triton.jit
def _load_x(x_row, k, k_ok, K, ACT: tl.constexpr):
    """A chunk of the x row in float32; with ACT, silu(gate) * up rounded as
    reference.silu_and_mul rounds it."""
    if ACT:
        gate = tl.load(x_row + k, mask=k_ok, other=0.0)
        up = tl.load(x_row + K + k, mask=k_ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    return tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,  # (M, K), or (M, 2K) laid out [gate | up] when ACT
    w_ptr,  # (N, K), rows contiguous
    out_ptr,  # (M, N)
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    M: tl.constexpr,
    ACT: tl.constexpr,  # x = silu(gate) * up, computed as reference.silu_and_mul rounds it
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the kernel before it
):
    pdl_start(PDL)  # ops/triton_pdl.py
    pid = tl.program_id(0)
    m = pid % M  # the x rows of one W block are neighbours in the grid (L2 reuse)
    rows = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # (BLOCK_N, 1)
    x_row = x_ptr + m.to(tl.int64) * stride_x
    # The first chunk of W is read before waiting for the kernel that writes x:
    # weights never depend on it, so with PDL their load overlaps that kernel.
    k_ok = cols < K
    w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    pdl_wait(PDL)
    acc = w.to(tl.float32) * _load_x(x_row, cols, k_ok, K, ACT)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        x = _load_x(x_row, k, k_ok, K, ACT)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    tl.store(
        out_ptr + m.to(tl.int64) * stride_out + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    act: bool = False,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x (M, K) -> (M, N) = x @ weight.T, weight (N, K); with `act`, x is (M, 2K)
    [gate | up] and silu(gate) * up is what multiplies. `config`: (BLOCK_N,
    BLOCK_K, num_warps), default `config_for(N, K)`. `pdl`: launch as a
    programmatic dependent (ops/triton_pdl.py); None: `use_pdl(x)`."""
    n, k = weight.shape
    m = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, warps = config or config_for(n, k)
    if pdl is None:
        pdl = use_pdl(x)
    grid = (triton.cdiv(n, block_n) * m,)
    _gemv_kernel[grid](
        x,
        weight,
        out,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        M=m,
        ACT=act,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
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


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See `reference.linear`: the GEMV for a few rows, else cuBLAS."""
    if _gemv_ok(x, weight):
        return gemv(x, weight)
    return F.linear(x, weight)


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See `reference.silu_and_mul_linear`: fused into the GEMV for a few rows, else
    the SwiGLU kernel then cuBLAS."""
    if _gemv_ok(gate_up, weight) and gate_up.shape[-1] == 2 * weight.shape[1]:
        return gemv(gate_up, weight, act=True)
    return F.linear(silu_and_mul(gate_up), weight)
