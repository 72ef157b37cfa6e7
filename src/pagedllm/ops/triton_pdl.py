"""Programmatic dependent launch (PDL): a kernel may start before the one it
follows has finished (Hopper and newer).

Owns: whether our kernels launch that way (`use_pdl`) and the two calls every
such kernel makes (`pdl_start`, `pdl_wait`). Does not own: any numerics.

A batch-1 decode step is a chain of ~10 small kernels per layer, each reading
what the one before wrote. Launched normally, a kernel starts only once the
previous one has completely finished, so every link pays a launch and a ramp
with the SMs partly idle. With PDL (`launch_pdl=True`), once every program of
the running kernel has called `pdl_start` (here: at its top), the next kernel's
programs may be scheduled into the SMs its last wave leaves free. They run up
to `pdl_wait`, which blocks until the previous kernel has finished and its
writes are visible: before it, a kernel may only read what no earlier kernel
of the step writes (weights; the GEMV reads its first chunk of W there).

Every kernel launched with PDL calls `pdl_wait` in every program, before it
reads or writes anything an earlier kernel touches. That keeps the order
transitive: a kernel cannot finish before its own predecessor has, so when
`pdl_wait` returns, every kernel before it has finished too. (A kernel launched
normally, cuBLAS's GEMMs among them, waits for the whole of the one before, as
always.) CUDA graphs keep these edges when captured, but stream capture failed
when a PDL launch followed cuBLAS's float32 GEMMs, so kernels launch this way
only inside `ops.kernel_chain()`: the model's layers at batch 1, where every
kernel is one of ours, and in bf16 decode steps of 64 rows and more
(`LlamaModel.chains_kernels`), where our kernels follow cuBLAS's bf16 GEMMs.

Measured (scripts/bench_pdl.py, H200): the four GEMVs of a layer in a graph,
1B 35.4 -> 31.2 us per layer, 8B 107.2 -> 102.0 us (4.28 TB/s), bit-identical
outputs. `PAGEDLLM_PDL=0` in the environment (read at import) turns it off.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from pagedllm.ops.kernel_chain import in_kernel_chain

ENABLED = os.environ.get("PAGEDLLM_PDL", "1").lower() not in ("0", "false", "no")


@lru_cache(maxsize=8)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch as programmatic dependents: inside
    `ops.kernel_chain()`, on a CUDA device of compute capability 9.0+, unless
    ENABLED is off. Never on the CPU (Triton's interpreter has no such launch)."""
    if not ENABLED or t.device.type != "cuda" or not in_kernel_chain():
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Let the next kernel's programs be scheduled once all of ours got here."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the kernel before has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
