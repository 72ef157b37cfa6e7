"""FP8 weight projections on the GPU (issue 36): `fp8_linear`, `fp8_linear_act_and_mul`,
`fp8_mlp`, and the norms that feed them (`fp8_norm_linear`, `fp8_norm_mlp`).

The numbers first (Llama-3.1-8B, H200). A layer's projections hold 218 M
weights (q/k/v 6144 x 4096, o 4096 x 4096, gate/up 28672 x 4096, down 4096 x
14336), 6.98 G over 32 layers: 6.98 GB in float8 against 13.96 GB in bf16.
Batch-1 decode reads them once per token (plus the bf16 LM head, 1.05 GB): at
4.8 TB/s that is 1.67 ms (600 tok/s), at the 4.28 TB/s copy rate the bf16 GEMV
reaches, 1.88 ms (532 tok/s); the issue's 450 tok/s is 85 % of the latter.
Prefill at 1,024 tokens: 2 x 6.98 G x 1,024 = 14.3 TFLOP, 7.2 ms at the 1,979
TFLOP/s dense FP8 matrix rate (14.4 ms at bf16's 989).

What to expect (not yet measured: scripts/bench_fp8.py times it on the H200).
Batch 1 to 16: the GEMV is memory-bound as the bf16 one is (the tensor cores do
16 x 64 x 128 per 8 KB of W, nothing), so 80-90 % of the copy rate if enough
bytes are in flight: a 4096-row W is 64 tiles of 64 rows, so K is split to give
about two programs an SM (`gemv_split`), each with 3 chunks of W in flight. That
is ~1.6-1.8 ms of projections a token on the 8B, about 2x the bf16 GEMV's.
Prefill: FP8 GEMMs on Hopper usually reach 60-75 % of the dense rate at these
shapes, so 10-12 ms of projections for a 1,024-token TTFT.

What runs, by the number of rows T of x (`fp8_linear`):

- T <= GEMV_MAX_ROWS (16): `gemv`, one Triton kernel (`_gemv_kernel`). A program
  owns BLOCK_N rows of W (with act_and_mul: BLOCK_N gate rows and the BLOCK_N up
  rows that pair with them) and all T rows of x, padded to 16 (the smallest
  tensor-core tile), and walks K in BLOCK_K chunks: each chunk of x is quantized
  to e4m3 in the program (absmax per row of the chunk / 448, see
  `quantize_activations_reference`), multiplied with the e4m3 weight chunk by
  the tensor cores (fp8 x fp8, float32 sums), and the chunk's sums are scaled
  by the x chunk's scales (and the weight block's scale) into a float32
  accumulator. W is read once, straight from memory into the tensor cores with
  no conversion on the CUDA cores; the CUDA cores only quantize x (16 x BLOCK_K
  values a chunk, against BLOCK_N x BLOCK_K weight bytes). Quantizing per chunk
  of BLOCK_K (128 here) rather than per whole row needs no pass over the row
  first (a per-row absmax would be a second read of x or a separate kernel,
  ~2 us a launch, 128 launches a token on the 8B), is finer (a chunk's scale
  fits its values better), and bounds the fp8 tensor cores' imprecise
  accumulation to one chunk (sums are promoted to float32 every chunk). The
  epilogue adds the bias or applies act(gate) * up, rounded as the reference.
- T > 16, per-channel scales: x is quantized per row (`quantize_activations`,
  one small kernel) and `torch._scaled_mm` (cuBLASLt / CUTLASS FP8 with
  row-wise scales: x's (T, 1), W's (1, out)) multiplies; act_and_mul then runs
  the existing SwiGLU/GeGLU kernel over its output. In the whole MLP
  (`fp8_mlp`), that activation and the down projection's quantization of it
  are one kernel (`act_and_mul_quantize`); and the norm before q/k/v and the
  one before the MLP write their output quantized (`fp8_norm_linear`,
  `fp8_norm_mlp`: `rms_norm_quantize`). Where `_scaled_mm` cannot
  (not bf16, K or out not a multiple of 16, Triton's CPU interpreter, or
  USE_SCALED_MM off), the Triton GEMM below does it.
- T > 16, block scales (bs0, bs1): x is quantized per row and group of 128
  columns (the 1 x 128 activation groups of the block-FP8 checkpoints' recipe;
  for a bs1 that 128 does not divide, the largest power of two that divides it)
  and `_gemm_kernel` multiplies: tiles of BLOCK_M x BLOCK_N, BLOCK_K = the group,
  each chunk's fp8 dot scaled by x's group scales and W's block scale into a
  float32 accumulator. (torch's block-wise `scaled_mm` recipes need cuBLAS 12.9+
  on sm_90; `scaled_mm_blockwise`, behind USE_SCALED_MM_BLOCKWISE, and
  scripts/bench_fp8.py times them beside this kernel.)

Numerics against `reference.fp8_linear` (which does not quantize x): e4m3 keeps
3 mantissa bits, so each quantized activation is off by at most 2^-4 of itself
(round to nearest), ~2^-4 / sqrt(3) = 3.6 % rms for values spread over a binade;
the errors of a K-long dot are independent, so the result is off by about that
fraction of its norm (tests/test_ops_fp8.py holds the kernels to 5 % of the
reference and to 1e-5 of a float32 matmul of the same quantized x).

Configs are chosen for an H200 (227 KB of shared memory a block, 64 K registers
an SM): see `GEMV_CONFIGS` and `GEMM_CONFIG`; `scripts/bench_fp8.py` times them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops import (
    reference,
    triton_gemv,
    triton_interpret_fix,  # noqa: F401  (CPU interpreter: float8 casts, dots)
)
from pagedllm.ops.triton_act import activation, gelu_tanh_and_mul, silu_and_mul
from pagedllm.ops.triton_norm import fused_add_rms_norm, norm_warps, rms_norm, rms_norm_row
from pagedllm.ops.triton_pdl import pdl_start, pdl_wait, use_pdl

FP8 = reference.FP8_DTYPE
FP8_MAX = reference.FP8_MAX

# x rows up to which the FP8 GEMV serves; beyond, the GEMM paths.
GEMV_MAX_ROWS = 16
# x rows up to which a per-channel FP8 weight multiplies weight-only ("W8A16"): the
# bf16 GEMV of ops/triton_gemv.py reading float8 W, converting it on the CUDA cores
# and scaling each row's float32 sum, x not quantized (so exactly
# `reference.fp8_linear`, up to summation order). At one row the projection is
# W's bytes and nothing else: measured on the H200 (scripts/bench_fp8.py,
# 2026-12-05) the tensor-core GEMV below read the 8B's layers at 45 % of the HBM
# rate (3.13-3.23 ms a token against a 1.45 ms floor), its per-chunk quantization
# of x and its wgmma's 64-row minimum on the critical path of every 8 KB chunk;
# this one at 63 % (2.29 ms), and the 8B decodes at 344 tok/s against 253.
# At 16 rows the tensor-core GEMV is as fast as at one (2.62 ms): past one row
# a CUDA-core GEMV pays per row. 0 turns it off.
W8A16_MAX_ROWS = 1
# (BLOCK_N, BLOCK_K, num_warps) of that GEMV per FP8 weight shape (N, K): see
# `triton_gemv.CONFIGS`; scripts/bench_fp8.py --w8-sweep times a grid.
# Measured at T = 1 on the H200, 2026-12-05 (scripts/bench_fp8.py --w8-sweep, us per
# call, in a CUDA graph over weights that miss L2; the tensor-core GEMV beside it):
# 8B q/k/v 10.3 (15.5), o_proj 7.6 (11.4), gate/up + SwiGLU 34.8 (42.8), down 18.9
# (28.0): 2.29 ms a token over 32 layers against 3.13 ms (floor 1.45 ms at 4.8 TB/s).
# 70B (--model 70b): q/k/v 26.4, o_proj 21.8, gate/up 121.0, down 68.8 us.
W8A16_DEFAULT_CONFIG = (2, 2048, 4)
W8A16_CONFIGS: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (2, 1024, 4),  # Llama-3.1-8B q/k/v
    (4096, 4096): (4, 1024, 4),  # o_proj
    (28672, 4096): (4, 1024, 4),  # gate/up + SwiGLU
    (4096, 14336): (2, 2048, 4),  # down
    (10240, 8192): (2, 2048, 4),  # Llama-3.1-70B q/k/v
    (8192, 8192): (2, 2048, 4),  # o_proj
    (57344, 8192): (4, 1024, 4),  # gate/up + SwiGLU
    (8192, 28672): (2, 2048, 4),  # down
}
# Whether T > GEMV_MAX_ROWS with per-channel scales goes to torch._scaled_mm (where
# it can) rather than the Triton GEMM: scripts/bench_fp8.py times both.
USE_SCALED_MM = True
# `torch._scaled_mm`'s FP8 fast accumulation: Hopper's FP8 tensor cores sum each
# K-step in a narrower accumulator, and without it the kernel promotes the partial
# sums to float32 every few steps, at a cost in speed. vLLM's sm_90 CUTLASS FP8
# kernels use fast accumulation; tests/test_gpu_fp8_ops.py bounds its error
# (within 1e-2 of the float32 product of the same quantized x, against 5e-3 without).
SCALED_MM_FAST_ACCUM = True
# Whether T > GEMV_MAX_ROWS with 128 x 128 block scales goes to torch's block-wise
# scaled_mm (`scaled_mm_blockwise`) rather than the Triton GEMM; off until measured.
USE_SCALED_MM_BLOCKWISE = False

# The GEMV: (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) per weight shape (N, K)
# (N counts W's rows: with act_and_mul, gate and up together). BLOCK_N is rows of W
# per program (with act_and_mul, BLOCK_N gate rows and as many up rows): 64 is the
# smallest that the H200's fp8 tensor-core instruction takes (wgmma m64n16k32; at 16
# or 32 Triton converts W to fp16 for the older mma, on the CUDA cores). BLOCK_K is
# halved until it divides a block scale's bs1 (128 in every published checkpoint).
# SPLIT_K 0: `gemv_split` picks it. Compiled for sm_90a (Triton 3.6 and its ptxas, no
# GPU): 64 x 128, 4 warps, 4 stages: 46 KB of shared memory, 72 registers, no spills
# (act_and_mul: 78 KB, 104 registers), so 2-4 programs fit an SM.
GEMV_DEFAULT_CONFIG = (64, 128, 4, 4, 0)
GEMV_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int]] = {}

# The Triton GEMM: (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M); BLOCK_K is
# 128 (the block scales' bs1, or a chunk of K for per-channel scales).
# Compiled for sm_90a (wgmma m64n128k32 fp8): per channel, 128 x 128 on two
# warpgroups, 128 KB of shared memory, 170 registers. With block scales a chunk's
# product and the accumulator are both live: 128 x 128 on 8 warps took 255
# registers and spilled, so 64 x 128 on one warpgroup (as vLLM's block-FP8 Triton
# GEMM defaults to), 3 stages: 73 KB, 238 registers, no spills.
GEMM_CONFIG = (128, 128, 8, 4, 8)
GEMM_BLOCK_CONFIG = (64, 128, 4, 3, 8)


def gemv_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    return GEMV_CONFIGS.get((n, k), GEMV_DEFAULT_CONFIG)


# --------------------------------------------------------------------------
# The quantization of activations, as the kernels do it
# --------------------------------------------------------------------------


def quantize_activations_reference(
    x: torch.Tensor, group: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (xq (T, K) e4m3, xs (T, G) float32), in plain PyTorch: the spec
    of what the kernels do to activations. Each row is cut into groups of `group`
    columns (None: one group, the whole row); a group's scale is its absmax / 448
    (0 for an all-zero group) and its values are x * (448 / max(absmax, 1e-30))
    clamped to +-448 and rounded to nearest even, so xq * xs ~ x."""
    xf = x.float()
    t, k = xf.shape
    g = k if group is None else group
    n = -(-k // g) if k else 0
    padded = xf.new_zeros(t, n * g)
    padded[:, :k] = xf
    blocks = padded.view(t, n, g)
    amax = blocks.abs().amax(dim=2)  # (T, G)
    # A true division (448 / tensor in torch multiplies by a reciprocal, an ulp off at
    # times; the kernels divide correctly rounded, `tl.div_rn`, on the GPU too).
    inv = torch.full_like(amax, FP8_MAX) / amax.clamp_min(1e-30)
    inv = torch.where(amax > 0, inv, torch.zeros_like(amax))
    q = (blocks * inv[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(t, n * g)[:, :k], amax / torch.full_like(amax, FP8_MAX)


@triton.jit
def _quantize(x, FP8_MAX: tl.constexpr):
    """x (R, C) float32 -> (x * 448 / absmax per row as e4m3, absmax / 448 per row)."""
    amax = tl.max(tl.abs(x), axis=1)
    # Correctly rounded divisions (Triton's `/` is an approximate one on the GPU), so
    # that the kernels round x exactly as `quantize_activations_reference` does.
    big = tl.full(amax.shape, FP8_MAX, tl.float32)
    inv = tl.where(amax > 0.0, tl.div_rn(big, tl.maximum(amax, 1e-30)), 0.0)
    q = tl.clamp(x * inv[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    return q, tl.div_rn(amax, big)


# --------------------------------------------------------------------------
# The GEMV (T <= 16)
# --------------------------------------------------------------------------


@triton.jit
def _gemv_epilogue(
    acc,
    acc_up,
    ws_ptr,
    out_ptr,
    b_ptr,
    rows,
    up_rows,
    row_ok,
    t,
    t_ok,
    stride_out,
    BLOCK_SCALES: tl.constexpr,
    GLU: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The float32 sums (BLOCK_N, BLOCK_T) -> out[t, rows]: the per-channel scale, the
    bias, act(gate) * up, each rounded as the reference rounds it."""
    if not BLOCK_SCALES:  # per channel: one scale a row of W, applied once
        acc *= tl.load(ws_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if GLU:
            acc_up *= tl.load(ws_ptr + up_rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    if GLU:
        g = acc.to(dtype).to(tl.float32)
        y = activation(g, ACT).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    else:
        y = acc
    out = out_ptr + t.to(tl.int64)[None, :] * stride_out + rows[:, None]
    tl.store(out, y.to(dtype), mask=row_ok[:, None] & t_ok[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr,  # (T, K)
    w_ptr,  # (N, K) e4m3, rows contiguous; with GLU, N = 2I laid out [gate | up]
    ws_ptr,  # float32: (N,) per channel, or (ceil(N / BS0), ceil(K / BS1)) blocks
    out_ptr,  # (T, N), or (T, N / 2) with GLU
    b_ptr,  # HAS_BIAS: (N,), added to the float32 sums before their rounding
    part_ptr,  # SPLIT_K > 1: float32 (SPLIT_K, tiles, 1 or 2, BLOCK_N, BLOCK_T) partial sums
    count_ptr,  # SPLIT_K > 1: int32 (tiles,), zero between launches
    T,
    N,
    K,
    K_SPLIT,  # columns of K per split, a multiple of BLOCK_K
    stride_x,
    stride_w,
    stride_out,
    stride_ws,  # the block scales' row stride
    BLOCK_T: tl.constexpr,  # x rows, padded (16: the smallest tensor-core tile)
    BLOCK_N: tl.constexpr,  # rows of W per program (with GLU: gate rows, and as many up)
    BLOCK_K: tl.constexpr,  # the chunk of K, and the group x is quantized in
    SPLIT_K: tl.constexpr,  # programs that share one tile's K (their sums added in order)
    BLOCK_SCALES: tl.constexpr,
    BS0: tl.constexpr,  # with BLOCK_SCALES: the block's rows and columns
    BS1: tl.constexpr,
    GLU: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    pdl_start(PDL)  # ops/triton_pdl.py
    tile = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # W rows, or with GLU gate rows
    if GLU:
        half = N // 2
        row_ok = rows < half
        up_rows = rows + half
    else:
        row_ok = rows < N
        up_rows = rows
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    w_up_rows = w_ptr + up_rows.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    pdl_wait(PDL)  # x is the previous kernel's output
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + cols
        k_ok = k < K  # (K_SPLIT is a multiple of BLOCK_K: no chunk crosses k_hi but at K)
        x = tl.load(x_rows + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        xq, xs = _quantize(x.to(tl.float32), FP8_MAX)  # (BLOCK_T, BLOCK_K), (BLOCK_T,)
        xq_t = tl.trans(xq)  # (BLOCK_K, BLOCK_T): K-major, as the fp8 MMA wants it
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(w, xq_t)  # (BLOCK_N, BLOCK_T): this chunk's float32 sums
        if BLOCK_SCALES:
            kb = k0 // BS1
            s = tl.load(ws_ptr + (rows // BS0) * stride_ws + kb, mask=row_ok, other=0.0)
            acc += part * s[:, None] * xs[None, :]
        else:
            acc += part * xs[None, :]
        if GLU:
            wu = tl.load(w_up_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(wu, xq_t)
            if BLOCK_SCALES:
                su = tl.load(ws_ptr + (up_rows // BS0) * stride_ws + kb, mask=row_ok, other=0.0)
                acc_up += part * su[:, None] * xs[None, :]
            else:
                acc_up += part * xs[None, :]
    if SPLIT_K == 1:
        _gemv_epilogue(
            acc, acc_up, ws_ptr, out_ptr, b_ptr, rows, up_rows, row_ok, t, t_ok, stride_out,
            BLOCK_SCALES, GLU, ACT, HAS_BIAS,
        )  # fmt: skip
    else:
        # Split K: each program leaves its sums in the workspace; the last of a tile's
        # programs to finish (counted by an atomic) adds them up in split order (so
        # the result does not depend on which finished last), writes the output and
        # zeroes the count for the next launch. One launch, no second kernel.
        ntiles = tl.num_programs(0)
        tile_elems = BLOCK_N * BLOCK_T
        per_split = (2 if GLU else 1) * tile_elems
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + t[None, :]
        mine = part_ptr + (split * ntiles + tile).to(tl.int64) * per_split + offs
        tl.store(mine, acc)
        if GLU:
            tl.store(mine + tile_elems, acc_up)
        tl.debug_barrier()  # every thread's sums stored before the count moves
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for s in range(SPLIT_K):
                theirs = part_ptr + (s * ntiles + tile).to(tl.int64) * per_split + offs
                acc += tl.load(theirs, cache_modifier=".cg")
                if GLU:
                    acc_up += tl.load(theirs + tile_elems, cache_modifier=".cg")
            _gemv_epilogue(
                acc, acc_up, ws_ptr, out_ptr, b_ptr, rows, up_rows, row_ok, t, t_ok, stride_out,
                BLOCK_SCALES, GLU, ACT, HAS_BIAS,
            )  # fmt: skip
            tl.store(count_ptr + tile, 0)


# The split-K GEMV's workspace, per device: partial sums and one count per tile (zero
# between launches: the last program of a tile resets its own). 4 MB of sums cover
# every split the 8B and 70B shapes get (8B gate/up: 224 tiles x 2 splits x 2 x 64
# x 16 floats); a larger need grows it. A buffer it outgrows is kept alive, never
# freed: a CUDA graph captured with it still reads and writes that address. Kernels
# on one stream take turns with it (with PDL too: every access follows `pdl_wait`);
# two streams running split GEMVs at once would need one each.
_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[torch.Tensor] = []


def _workspace(device: torch.device, parts: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    part, count = _WORKSPACE.get(device, (None, None))
    if part is None or part.numel() < parts:
        if part is not None:
            _OUTGROWN.append(part)
        part = torch.empty(max(parts, 1 << 20), dtype=torch.float32, device=device)
    if count is None or count.numel() < tiles:
        if count is not None:
            _OUTGROWN.append(count)
        count = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
    _WORKSPACE[device] = (part, count)
    return part, count


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200, for the interpreter's tests of the split
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def gemv_split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """How many programs share a tile's K: enough that about two programs run per
    SM (a tile is one program otherwise: 64 for a 4096-row W at BLOCK_N 64, half
    an H200 idle), each with at least 4 chunks of K."""
    chunks = triton.cdiv(k, block_k)
    return max(1, min(triton.cdiv(2 * sms, tiles), chunks // 4, 16))


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x (T, K), T <= 16 -> (T, N) = fp8_linear(x, ...) with x quantized per chunk;
    with `act` ("silu", "gelu_tanh"), weight is (2I, K) laid out [gate | up] and the
    result (T, I) is act(gate) * up. `weight_scale` as `reference.check_fp8_weight`
    returns it. `config`: (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K), default
    `gemv_config(N, K)`; SPLIT_K 0 picks `gemv_split`. `pdl`: None is `use_pdl(x)`."""
    t, k = x.shape
    n = weight.shape[0]
    if t > 16:
        raise ValueError(f"the FP8 GEMV takes at most 16 rows of x, got {t}")
    block_n, block_k, warps, stages, split = config or gemv_config(n, k)
    if block_size is not None:
        while block_size[1] % block_k:
            block_k //= 2  # a power of two that divides bs1 (bs1 % 16 == 0: `_prepared`)
    if x.stride(-1) != 1:
        x = x.contiguous()
    glu = act is not None
    rows = n // 2 if glu else n
    out = torch.empty((t, rows), dtype=x.dtype, device=x.device)
    if t == 0 or rows == 0:
        return out
    if pdl is None:
        pdl = use_pdl(x)
    tiles = triton.cdiv(rows, block_n)
    if not split:
        split = gemv_split(tiles, k, block_k, _sm_count(x.device))
    k_split = max(1, triton.cdiv(triton.cdiv(k, block_k), split)) * block_k
    split = max(1, triton.cdiv(k, k_split))  # no split left without columns
    if split > 1:
        part, count = _workspace(x.device, split * tiles * (2 if glu else 1) * block_n * 16, tiles)
    else:
        part = count = weight_scale  # dummies
    _gemv_kernel[(tiles, split)](
        x,
        weight,
        weight_scale,
        out,
        bias if bias is not None else weight_scale,  # a dummy when there is none
        part,
        count,
        t,
        n,
        k,
        k_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        weight_scale.stride(0) if block_size is not None else 0,
        BLOCK_T=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        BLOCK_SCALES=block_size is not None,
        BS0=block_size[0] if block_size is not None else 1,
        BS1=block_size[1] if block_size is not None else 1,
        GLU=glu,
        ACT=act or "silu",
        HAS_BIAS=bias is not None,
        PDL=pdl,
        FP8_MAX=FP8_MAX,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )
    return out


# --------------------------------------------------------------------------
# T > 16: activations quantized by a kernel of their own, then a GEMM
# --------------------------------------------------------------------------


@triton.jit
def _quantize_kernel(
    x_ptr,  # (T, K)
    xq_ptr,  # (T, K) e4m3, contiguous
    xs_ptr,  # (T, G) float32, contiguous
    K,
    G,
    stride_x,
    PER_ROW: tl.constexpr,  # one group a row (G = 1); else groups of GROUP columns
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # the next power of two >= GROUP
    GROUPS: tl.constexpr,  # groups a chunk (with PER_ROW: one group of CHUNK columns)
    CHUNK: tl.constexpr,  # with PER_ROW: columns a chunk (a power of two)
    FP8_MAX: tl.constexpr,
):
    """One program a row of x."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = xq_ptr + row.to(tl.int64) * K
    if PER_ROW:  # two passes over the row: its absmax, then the quantized values
        cols = tl.arange(0, CHUNK)
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for c0 in range(0, K, CHUNK):
            c = c0 + cols
            x = tl.load(x_row + c, mask=c < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        a = tl.max(amax, axis=0)
        big = tl.full((), FP8_MAX, tl.float32)
        inv = tl.where(a > 0.0, tl.div_rn(big, tl.maximum(a, 1e-30)), 0.0)
        for c0 in range(0, K, CHUNK):
            c = c0 + cols
            x = tl.load(x_row + c, mask=c < K, other=0.0).to(tl.float32)
            q = tl.clamp(x * inv, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
            tl.store(q_row + c, q, mask=c < K)
        tl.store(xs_ptr + row.to(tl.int64) * G, tl.div_rn(a, big))
    else:  # GROUPS groups at a time, one pass
        gi = tl.arange(0, GROUPS)
        ci = tl.arange(0, BLOCK_G)
        for g0 in range(0, G, GROUPS):
            g = g0 + gi
            c = g[:, None] * GROUP + ci[None, :]  # (GROUPS, BLOCK_G)
            ok = (ci[None, :] < GROUP) & (c < K)
            x = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
            q, xs = _quantize(x, FP8_MAX)
            tl.store(q_row + c, q, mask=ok)
            tl.store(xs_ptr + row.to(tl.int64) * G + g, xs, mask=g < G)


def quantize_activations(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations_reference`, as one Triton kernel (a program a row):
    (xq (T, K) e4m3 contiguous, xs (T, G) float32 contiguous)."""
    t, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    size = k if group is None else group
    groups = triton.cdiv(k, size) if k else 0
    xq = torch.empty((t, k), dtype=FP8, device=x.device)
    xs = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        return xq, xs
    block_g = triton.next_power_of_2(size)
    _quantize_kernel[(t,)](
        x, xq, xs, k, groups, x.stride(0),
        PER_ROW=group is None,
        GROUP=1 if group is None else size,  # (one compile for every K, per row)
        BLOCK_G=1 if group is None else block_g,
        GROUPS=max(1, 2048 // block_g),
        CHUNK=2048,
        FP8_MAX=FP8_MAX,
        num_warps=4,
    )  # fmt: skip
    return xq, xs


# The whole row of act(gate) * up stays in registers up to this many columns (16
# warps, 32 values a thread: the 8B's I = 14,336; at 32,768 the sm_90a build
# spills); wider rows take two passes, the second computing it again from gate/up
# (read from L2, usually). 0: always two passes. scripts/bench_fp8.py --act-quant.
ACT_QUANT_ONE_PASS = 16384


@triton.jit
def _act_mul_row(y_row, c, ok, I, ACT: tl.constexpr):
    """act(gate) * up for columns c of one row, rounded as `silu_and_mul` rounds it
    (act to y's dtype, the product to y's dtype), returned in float32."""
    gate = tl.load(y_row + c, mask=ok, other=0.0)
    up = tl.load(y_row + I + c, mask=ok, other=0.0)
    a = activation(gate.to(tl.float32), ACT).to(gate.dtype)
    return (a.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def _act_and_mul_quantize_kernel(
    y_ptr,  # (T, 2I) laid out [gate | up]
    xq_ptr,  # (T, I) e4m3, contiguous
    xs_ptr,  # (T,) float32
    I,
    stride_y,
    ACT: tl.constexpr,
    CHUNK: tl.constexpr,  # a power of two; with ONE_PASS, >= I
    ONE_PASS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """One program a row: h = act(gate) * up, then h quantized per row as
    `quantize_activations` does it (h is never written in bf16)."""
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    q_row = xq_ptr + row * I
    cols = tl.arange(0, CHUNK)
    big = tl.full((), FP8_MAX, tl.float32)
    if ONE_PASS:
        ok = cols < I
        h = _act_mul_row(y_row, cols, ok, I, ACT)
        a = tl.max(tl.abs(h), axis=0)
        inv = tl.where(a > 0.0, tl.div_rn(big, tl.maximum(a, 1e-30)), 0.0)
        tl.store(q_row + cols, tl.clamp(h * inv, -FP8_MAX, FP8_MAX).to(tl.float8e4nv), mask=ok)
    else:  # the row's absmax, then the quantized values (h computed twice)
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for c0 in range(0, I, CHUNK):
            c = c0 + cols
            amax = tl.maximum(amax, tl.abs(_act_mul_row(y_row, c, c < I, I, ACT)))
        a = tl.max(amax, axis=0)
        inv = tl.where(a > 0.0, tl.div_rn(big, tl.maximum(a, 1e-30)), 0.0)
        for c0 in range(0, I, CHUNK):
            c = c0 + cols
            h = _act_mul_row(y_row, c, c < I, I, ACT)
            q = tl.clamp(h * inv, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
            tl.store(q_row + c, q, mask=c < I)
    tl.store(xs_ptr + row, tl.div_rn(a, big))


def act_and_mul_quantize(
    y: torch.Tensor, act: str, one_pass: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """y (T, 2I) [gate | up] -> `quantize_activations(act_and_mul(y), None)`, bit for
    bit, in one kernel: (xq (T, I) e4m3, xs (T, 1) float32). The h = act(gate) *
    up in y's dtype that the down projection would quantize is neither written nor
    read back. `one_pass`: the widest row held in registers (None:
    ACT_QUANT_ONE_PASS)."""
    if act not in reference.FP8_ACTIVATIONS:
        raise ValueError(
            f"activation {act!r}: choose one of {', '.join(reference.FP8_ACTIVATIONS)}"
        )
    t, two_i = y.shape
    inter = two_i // 2
    if y.stride(-1) != 1:
        y = y.contiguous()
    xq = torch.empty((t, inter), dtype=FP8, device=y.device)
    xs = torch.zeros((t, 1), dtype=torch.float32, device=y.device)
    if t == 0 or inter == 0:
        return xq, xs
    single = inter <= (ACT_QUANT_ONE_PASS if one_pass is None else one_pass)
    chunk = triton.next_power_of_2(inter) if single else 2048
    _act_and_mul_quantize_kernel[(t,)](
        y, xq, xs, inter, y.stride(0),
        ACT=act,
        CHUNK=chunk,
        ONE_PASS=single,
        FP8_MAX=FP8_MAX,
        num_warps=16 if single and chunk >= 8192 else 4,
    )  # fmt: skip
    return xq, xs


@triton.jit
def _gemm_kernel(
    xq_ptr,  # (M, K) e4m3, contiguous
    xs_ptr,  # (M, G) float32: G = 1 (per row) or ceil(K / BLOCK_K) (BLOCK_SCALES)
    w_ptr,  # (N, K) e4m3, rows contiguous
    ws_ptr,  # (N,) float32 per channel, or (ceil(N / BS0), ceil(K / BLOCK_K)) blocks
    out_ptr,  # (M, N)
    b_ptr,  # HAS_BIAS: (N,)
    M,
    N,
    K,
    G,
    stride_w,
    stride_out,
    stride_ws,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # with BLOCK_SCALES: x's group, a power of two dividing BS1
    GROUP_M: tl.constexpr,  # tiles of M that walk N together (L2 reuse of W)
    BLOCK_SCALES: tl.constexpr,
    BS0: tl.constexpr,
    BS1: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    cols = tl.arange(0, BLOCK_K)
    a_rows = xq_ptr + rm.to(tl.int64)[:, None] * K
    b_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_SCALES:
            sa = tl.load(xs_ptr + rm.to(tl.int64) * G + k0 // BLOCK_K, mask=m_ok, other=0.0)
            sb = tl.load(ws_ptr + (rn // BS0) * stride_ws + k0 // BS1, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        else:
            # Added chunk by chunk rather than accumulated inside the MMA: the fp8
            # tensor cores' own accumulation keeps fewer bits than float32 (Triton
            # lets it run the whole of K on sm_90), and 14,336 of them drift.
            acc += tl.dot(a, tl.trans(b))
    if not BLOCK_SCALES:
        sa = tl.load(xs_ptr + rm.to(tl.int64) * G, mask=m_ok, other=0.0)
        sb = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """`fp8_linear` by the Triton GEMM: x quantized per row (per channel) or per row
    and group of BLOCK_K columns (block scales: 128, or the largest power of two
    that divides bs1 when it does not), then `_gemm_kernel`. `config`: (BLOCK_M,
    BLOCK_N, num_warps, num_stages, GROUP_M), default GEMM_CONFIG or
    GEMM_BLOCK_CONFIG."""
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, warps, stages, group_m = config or (
        GEMM_BLOCK_CONFIG if block_size is not None else GEMM_CONFIG
    )
    block_k = 128
    if block_size is not None:
        while block_size[1] % block_k:
            block_k //= 2  # (bs1 % 16 == 0: `_prepared`)
    xq, xs = quantize_activations(x, block_k if block_size is not None else None)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        xq,
        xs,
        weight,
        weight_scale,
        out,
        bias if bias is not None else weight_scale,
        m,
        n,
        k,
        xs.shape[1],
        weight.stride(0),
        out.stride(0),
        weight_scale.stride(0) if block_size is not None else 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        BLOCK_SCALES=block_size is not None,
        BS0=block_size[0] if block_size is not None else 1,
        BS1=block_size[1] if block_size is not None else 1,
        HAS_BIAS=bias is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool | None = None,
) -> torch.Tensor:
    """`fp8_linear` with per-channel scales by `torch._scaled_mm` (CUDA, bf16 x, K and
    N multiples of 16): x quantized per row, then cuBLASLt's (or CUTLASS's) FP8 GEMM
    with row-wise scales, x's (T, 1) and W's (1, N). W (N, K) row-major is the
    column-major (K, N) operand it wants, as it is: no copy. `use_fast_accum`: None
    is `SCALED_MM_FAST_ACCUM`."""
    xq, xs = quantize_activations(x, None)
    return _scaled_mm_of(xq, xs, weight, weight_scale, x.dtype, bias, use_fast_accum)


def _scaled_mm_of(xq, xs, weight, weight_scale, out_dtype, bias=None, use_fast_accum=None):
    """`torch._scaled_mm` of x already quantized per row (xq (T, K) e4m3, xs (T, 1))
    and W (N, K) with one scale per row: (T, N) in `out_dtype`."""
    return torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=xs,
        scale_b=weight_scale.view(1, -1),
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=SCALED_MM_FAST_ACCUM if use_fast_accum is None else use_fast_accum,
    )


def scaled_mm_blockwise(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor):
    """`fp8_linear` with 128 x 128 block scales by torch's block-wise `scaled_mm`
    (x per row and group of 128: recipe BlockWise1x128, W BlockWise128x128; cuBLASLt
    12.9+ on sm_90, K a multiple of 128; bf16 out). Not dispatched to (the Triton
    GEMM is, unless USE_SCALED_MM_BLOCKWISE): scripts/bench_fp8.py times the two."""
    from torch.nn.functional import ScalingType, scaled_mm

    m, k = x.shape
    xq, xs = quantize_activations(x, 128)
    # cuBLASLt reads both scales column-major: x's (M, K/128) with stride (1, M),
    # W's as (L4, N/128) with stride (1, L4), K/128 padded to a multiple of 4.
    xs = xs.t().contiguous().t()
    nb, kb = weight_scale.shape
    l4 = -(-kb // 4) * 4
    ws = weight_scale.new_zeros(nb, l4)
    ws[:, :kb] = weight_scale
    return scaled_mm(
        xq,
        weight.t(),
        xs,
        ScalingType.BlockWise1x128,
        ws.t(),
        ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )


# --------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------


def _interpreted() -> bool:
    return not isinstance(_gemv_kernel, triton.runtime.jit.JITFunction)


def _w8a16(x: torch.Tensor, block_size, bias: torch.Tensor | None) -> bool:
    """Whether `W8A16_MAX_ROWS`' weight-only GEMV takes this product: per-channel
    scales, few rows, a bias (if any) in x's dtype."""
    return (
        block_size is None
        and 0 < x.shape[0] <= W8A16_MAX_ROWS
        and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1))
    )


def w8a16_config(weight: torch.Tensor, glu: bool = False) -> tuple[int, int, int]:
    block_n, block_k, warps = W8A16_CONFIGS.get(tuple(weight.shape), W8A16_DEFAULT_CONFIG)
    if glu and block_n % 2:
        block_n += 1  # gate and up rows side by side
    return block_n, block_k, warps


def _scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        USE_SCALED_MM
        and x.is_cuda
        and not _interpreted()
        and x.dtype == torch.bfloat16
        and x.shape[1] % 16 == 0
        and weight.shape[0] % 16 == 0
        and weight.stride(-1) == 1
        and (bias is None or bias.dtype == torch.bfloat16)
    )


def _prepared(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_size: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, int] | None]:
    """Checked and laid out for the kernels: x (T, in) with unit column stride, the
    weight's rows contiguous, the scale float32 and contiguous (`check_fp8_weight`),
    the bias contiguous. One-line ValueErrors for shapes that do not fit."""
    scale = reference.check_fp8_weight(weight, weight_scale, block_size).contiguous()
    if block_size is not None:
        block_size = (int(block_size[0]), int(block_size[1]))
        if block_size[1] % 16:
            raise ValueError(f"FP8 block_size {block_size}: the Triton kernels need bs1 % 16 == 0")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: x of shape {tuple(x.shape)} against a weight {tuple(weight.shape)}: "
            "expected x (T, in)"
        )
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"fp8_linear: bias {tuple(bias.shape)}, expected ({weight.shape[0]},)")
        bias = bias.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, weight, scale, block_size


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See `reference.fp8_linear`; x is quantized per token (see the module's
    docstring): the GEMV for T <= 16, else `torch._scaled_mm` or the Triton GEMM."""
    x, weight, scale, block_size = _prepared(x, weight, weight_scale, bias, block_size)
    if _w8a16(x, block_size, bias):
        return triton_gemv.gemv(x, weight, bias=bias, scale=scale, config=w8a16_config(weight))
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(x, weight, scale, block_size=block_size, bias=bias)
    if block_size is None and _scaled_mm_ok(x, weight, bias):
        return scaled_mm(x, weight, scale, bias=bias)
    if (
        USE_SCALED_MM_BLOCKWISE
        and block_size == (128, 128)
        and bias is None
        and x.shape[1] % 128 == 0
        and _scaled_mm_ok(x, weight, None)
    ):
        return scaled_mm_blockwise(x, weight, scale)
    return gemm(x, weight, scale, block_size=block_size, bias=bias)


def fp8_linear_act_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    act: str,
    *,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See `reference.fp8_linear_act_and_mul`: the GEMV with act(gate) * up in its
    epilogue for T <= 16, else `fp8_linear` and then the SwiGLU/GeGLU kernel."""
    if act not in reference.FP8_ACTIVATIONS:
        raise ValueError(
            f"activation {act!r}: choose one of {', '.join(reference.FP8_ACTIVATIONS)}"
        )
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"gate/up weight with {weight.shape[0]} rows: expected [gate | up], even")
    x, weight, scale, block_size = _prepared(x, weight, weight_scale, None, block_size)
    if _w8a16(x, block_size, None):
        return triton_gemv.gemv(
            x, weight, glu=True, act=act, scale=scale, config=w8a16_config(weight, glu=True)
        )
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(x, weight, scale, block_size=block_size, act=act)
    y = fp8_linear(x, weight, scale, block_size=block_size)
    return silu_and_mul(y) if act == "silu" else gelu_tanh_and_mul(y)


def _rows_past_the_gemvs(x: torch.Tensor) -> bool:
    """x (T, K) with more rows than the GEMVs take: the per-row quantization paths."""
    return x.dim() == 2 and x.shape[0] > max(GEMV_MAX_ROWS, W8A16_MAX_ROWS)


def _mlp_fused_ok(x, gate_up, down, gate_up_block_size, down_block_size) -> bool:
    """Whether `fp8_mlp` runs as `_scaled_mm`, `act_and_mul_quantize`, `_scaled_mm`."""
    return (
        gate_up_block_size is None
        and down_block_size is None
        and _rows_past_the_gemvs(x)
        and gate_up.dim() == 2
        and down.dim() == 2
        and gate_up.shape[0] == 2 * down.shape[1]
        and down.shape[1] % 16 == 0  # h's K: what _scaled_mm takes (as `_scaled_mm_ok`)
        and down.shape[0] % 16 == 0
        and down.stride(-1) == 1
        and _scaled_mm_ok(x, gate_up, None)
    )


def fp8_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    act: str,
    *,
    gate_up_block_size: tuple[int, int] | None = None,
    down_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See `reference.fp8_mlp`. Where both projections go to `torch._scaled_mm`
    (per-channel scales, more rows than the GEMVs take), act(gate) * up and the
    down projection's per-row quantization of it are one kernel
    (`act_and_mul_quantize`): the same bits as `fp8_linear_act_and_mul` then
    `fp8_linear`, without writing h in bf16 and reading it back (at 1,024 rows of
    the 8B, 29 MB written and 29-58 MB read a layer). Otherwise those two ops."""
    if not _mlp_fused_ok(x, gate_up, down, gate_up_block_size, down_block_size):
        h = fp8_linear_act_and_mul(x, gate_up, gate_up_scale, act, block_size=gate_up_block_size)
        return fp8_linear(h, down, down_scale, block_size=down_block_size)
    x, gate_up, gu_scale, _ = _prepared(x, gate_up, gate_up_scale, None, None)
    dn_scale = reference.check_fp8_weight(down, down_scale, None).contiguous()
    hq, hs = act_and_mul_quantize(scaled_mm(x, gate_up, gu_scale), act)
    return _scaled_mm_of(hq, hs, down, dn_scale, x.dtype)


# --------------------------------------------------------------------------
# The norm before a projection, and the per-row quantization of its output
# --------------------------------------------------------------------------
# Where x goes to `torch._scaled_mm` (per-channel scales, more rows than the GEMVs
# take), the RMSNorm that makes x also quantizes it: one kernel reads hidden and
# the residual and writes the new residual and x in e4m3 with its row scales. The
# bf16 x is never written: at 1,024 rows of the 8B, 8 MB written and 8-16 MB read
# back per norm, two norms a layer; and one launch fewer each. Expected: about
# 0.3 ms of a 1,024-token prefill on the H200 (measured: not yet).


# xq's rows are hinted 8-byte aligned (`tl.multiple_of(., 8)`; `stride_q`, E, is not
# specialized either): seeing them 16-byte aligned, Triton would store 16 e4m3 values
# a thread and lay the whole row out that way, reducing the sum of squares in another
# order than the norm kernel (8 bf16 values a thread), so at times to other bits.
# With 8-byte stores the row keeps the norm kernel's layout (the sm_90a build,
# tests/test_ops_fp8.py; the bits on a GPU: tests/test_gpu_fp8_ops.py).
@triton.jit(do_not_specialize=["stride_q"])
def _rms_norm_quantize_kernel(
    x_ptr,  # (T, E)
    res_ptr,  # (T, E): read and overwritten with x + residual when HAS_RESIDUAL
    w_ptr,  # (E,), x's dtype
    xq_ptr,  # (T, E) e4m3
    xs_ptr,  # (T,) float32
    stride_x,
    stride_res,
    stride_q,  # E: xq is contiguous
    E,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program a row: `_rms_norm_kernel`'s arithmetic (triton_norm.py's
    `rms_norm_row`), then `_quantize_kernel`'s per row, on the row held in registers."""
    pdl_start(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < E
    y = rms_norm_row(
        x_ptr + row * stride_x, res_ptr + row * stride_res, w_ptr, offs, mask, E, eps,
        HAS_RESIDUAL,
    )  # fmt: skip
    # The norm's output as `rms_norm` writes it (x's dtype), then quantized.
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    amax = tl.max(tl.abs(y), axis=0)
    big = tl.full((), FP8_MAX, tl.float32)
    inv = tl.where(amax > 0.0, tl.div_rn(big, tl.maximum(amax, 1e-30)), 0.0)
    q = tl.clamp(y * inv, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    q_row = tl.multiple_of(xq_ptr + row * stride_q, 8)  # 8-byte stores (see above)
    tl.store(q_row + offs, q, mask=mask)
    tl.store(xs_ptr + row, tl.div_rn(amax, big))


# The whole row stays in registers (16 warps, 32 values a thread); wider rows take
# the norm and then `quantize_activations`.
NORM_QUANT_MAX_COLS = 16384


def rms_norm_quantize(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of x (after adding `residual`, when given, written over it in place)
    and its output quantized per row: (xq (T, E) e4m3, xs (T, 1) float32, the
    residual stream: x + residual, or x). The same bits as `fused_add_rms_norm` (or
    `rms_norm`) then `quantize_activations(., None)`, in one kernel. x (T, E), weight
    (E,) in x's dtype, E <= NORM_QUANT_MAX_COLS, residual (T, E) in x's dtype with
    contiguous rows."""
    if x.dim() != 2:
        raise ValueError(f"rms_norm_quantize: x of shape {tuple(x.shape)}, expected (T, E)")
    t, e = x.shape
    if weight.dtype != x.dtype or weight.shape != (e,) or e > NORM_QUANT_MAX_COLS:
        raise ValueError(
            f"rms_norm_quantize: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: expected a weight (E,) in x's dtype, E <= {NORM_QUANT_MAX_COLS}"
        )
    weight = weight.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
    ):
        raise ValueError(
            f"rms_norm_quantize: residual {tuple(residual.shape)} {residual.dtype} against "
            f"x {tuple(x.shape)} {x.dtype}: expected the same shape and dtype"
        )
    xq = torch.empty((t, e), dtype=FP8, device=x.device)
    xs = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0:
        return xq, xs, x if residual is None else residual
    block = triton.next_power_of_2(e)
    pdl = use_pdl(x)
    res = x if residual is None else residual
    _rms_norm_quantize_kernel[(t,)](
        x, res, weight, xq, xs, x.stride(0), res.stride(0), e, e, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        FP8_MAX=FP8_MAX,
        PDL=pdl,
        num_warps=norm_warps(block),  # the norm kernel's: its layout, its sum's order
        launch_pdl=pdl,
    )  # fmt: skip
    return xq, xs, res


def _norm_quant_ok(hidden, residual, norm_weight) -> bool:
    return (
        hidden.dim() == 2
        and hidden.stride(-1) == 1
        and norm_weight.dtype == hidden.dtype
        and norm_weight.shape == (hidden.shape[1],)
        and hidden.shape[1] <= NORM_QUANT_MAX_COLS
        and (
            residual is None
            or (
                residual.shape == hidden.shape
                and residual.dtype == hidden.dtype
                and residual.stride(-1) == 1
            )
        )
    )


def _norm(hidden, residual, norm_weight, eps):
    """The norm alone: (x, the residual stream), as `reference._norm`."""
    if residual is None:
        return rms_norm(hidden, norm_weight, eps), hidden
    return fused_add_rms_norm(hidden, residual, norm_weight, eps)


def fp8_norm_linear(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.fp8_norm_linear`. Where x would go to `torch._scaled_mm`
    (`fp8_linear`'s per-channel path past the GEMVs), the norm writes it quantized
    (`rms_norm_quantize`): the same bits as the norm then `fp8_linear`."""
    if (
        block_size is None
        and _rows_past_the_gemvs(hidden)
        and _scaled_mm_ok(hidden, weight, bias)
        and _norm_quant_ok(hidden, residual, norm_weight)
        and weight.dim() == 2
        and weight.shape[1] == hidden.shape[1]
        and (bias is None or bias.shape == (weight.shape[0],))
    ):
        scale = reference.check_fp8_weight(weight, weight_scale, None).contiguous()
        xq, xs, residual = rms_norm_quantize(hidden, residual, norm_weight, eps)
        if bias is not None:
            bias = bias.contiguous()
        return _scaled_mm_of(xq, xs, weight, scale, hidden.dtype, bias), residual
    x, residual = _norm(hidden, residual, norm_weight, eps)
    return fp8_linear(x, weight, weight_scale, bias=bias, block_size=block_size), residual


def fp8_norm_mlp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    act: str,
    *,
    gate_up_block_size: tuple[int, int] | None = None,
    down_block_size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.fp8_norm_mlp`. Where `fp8_mlp` would run as `_scaled_mm`,
    `act_and_mul_quantize`, `_scaled_mm`, the norm writes x quantized
    (`rms_norm_quantize`): the same bits as the norm then `fp8_mlp`."""
    if act not in reference.FP8_ACTIVATIONS:
        raise ValueError(
            f"activation {act!r}: choose one of {', '.join(reference.FP8_ACTIVATIONS)}"
        )
    if _mlp_fused_ok(hidden, gate_up, down, gate_up_block_size, down_block_size) and _norm_quant_ok(
        hidden, residual, norm_weight
    ):
        if gate_up.shape[1] != hidden.shape[1]:
            raise ValueError(
                f"fp8_norm_mlp: hidden {tuple(hidden.shape)} against gate/up "
                f"{tuple(gate_up.shape)}: expected hidden (T, in)"
            )
        gu_scale = reference.check_fp8_weight(gate_up, gate_up_scale, None).contiguous()
        dn_scale = reference.check_fp8_weight(down, down_scale, None).contiguous()
        xq, xs, residual = rms_norm_quantize(hidden, residual, norm_weight, eps)
        y = _scaled_mm_of(xq, xs, gate_up, gu_scale, hidden.dtype)
        hq, hs = act_and_mul_quantize(y, act)
        return _scaled_mm_of(hq, hs, down, dn_scale, hidden.dtype), residual
    x, residual = _norm(hidden, residual, norm_weight, eps)
    out = fp8_mlp(
        x, gate_up, gate_up_scale, down, down_scale, act,
        gate_up_block_size=gate_up_block_size, down_block_size=down_block_size,
    )  # fmt: skip
    return out, residual
