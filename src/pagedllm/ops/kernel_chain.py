"""Whether our Triton kernels may launch as programmatic dependents (ops/triton_pdl.py).

A module of its own (not ops/__init__.py) so that the kernels that read the
switch import nothing that imports them back.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# Programmatic dependent launch (ops/triton_pdl.py) is used only inside a chain the
# model opens: stream capture failed when such a launch followed cuBLAS's float32
# GEMMs, so the chain covers batch 1 (all kernels ours) and large bf16 decode steps.
_KERNEL_CHAIN = contextvars.ContextVar("pagedllm_kernel_chain", default=False)


@contextlib.contextmanager
def kernel_chain(active: bool = True) -> Iterator[None]:
    """Within (when `active`), our Triton kernels may launch as programmatic
    dependents of the kernel before them. `LlamaModel.forward` opens it around
    its layers when one token runs (batch-1 decode: GEMVs, norms, RoPE + KV
    store and decode attention, all Triton) and in large bf16 decode steps
    (`LlamaModel.chains_kernels`)."""
    token = _KERNEL_CHAIN.set(active)
    try:
        yield
    finally:
        _KERNEL_CHAIN.reset(token)


def in_kernel_chain() -> bool:
    return _KERNEL_CHAIN.get()
