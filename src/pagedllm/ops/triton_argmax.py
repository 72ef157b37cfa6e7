"""Triton argmax over each row of the logits: greedy sampling's one reduction.

Why: `torch.argmax` of a (1, 128256) float32 row ran as one CUDA block and took
28 us on the H200 (scripts/profile_step.py --batch 1: 2.3 % of a Llama-3.2-1B
batch-1 decode step). Here it is two small kernels: each program takes the max
and its first index over CHUNK logits of a row, then one program per row picks
the best chunk (the first, on ties).

Owns: `argmax` (the op `reference.argmax`). Does not own: the sampling that
decides whether a row is greedy (`sampling/sampler.py`).
Matches `torch.argmax`: the first index of the maximum; a NaN counts as the
maximum (as +inf here, so an earlier +inf would win over it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # logits per program: 32 programs for a 128256-token row


@triton.jit
def _argmax_chunk_kernel(
    x_ptr,  # (B, V)
    val_ptr,  # (B, C) float32: each chunk's max
    idx_ptr,  # (B, C) int64: its first index in the row
    V,
    stride_x,
    C,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN is the maximum, as in torch.argmax
    best = tl.argmax(x, 0, tie_break_left=True)
    tl.store(val_ptr + row * C + c, tl.max(x, 0))
    tl.store(idx_ptr + row * C + c, (c * CHUNK + best).to(tl.int64))


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    vals = tl.load(val_ptr + row * C + offs, mask=offs < C, other=float("-inf"))
    best = tl.argmax(vals, 0, tie_break_left=True)  # the first chunk holding the max
    tl.store(out_ptr + row, tl.load(idx_ptr + row * C + best))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """See `reference.argmax`: (B, V) -> (B,) int64."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0 or v == 0:
        return logits.argmax(dim=-1) if v else out
    c = triton.cdiv(v, CHUNK)
    vals = torch.empty((b, c), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((b, c), dtype=torch.int64, device=logits.device)
    _argmax_chunk_kernel[(b, c)](logits, vals, idxs, v, logits.stride(0), c, CHUNK=CHUNK)
    _argmax_rows_kernel[(b,)](vals, idxs, out, c, BLOCK_C=triton.next_power_of_2(c), num_warps=1)
    return out
