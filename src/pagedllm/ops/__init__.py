"""Op dispatch: every op has a reference (PyTorch) and, on CUDA, a Triton kernel.

`PAGEDLLM_OPS=reference` or `PAGEDLLM_OPS=triton` forces one implementation;
otherwise CUDA tensors take Triton (when it imports) and CPU tensors take the
reference. With `TRITON_INTERPRET=1` and `PAGEDLLM_OPS=triton`, the Triton
kernels run on the CPU (slowly), which is how CI tests them.

Both implementations share one signature per op (see `ops/reference.py` for the
spec of each). The choice is made per call from the tensor's device, so a
model can hold no state about it.
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import ModuleType

import torch

from pagedllm.ops import reference

OP_NAMES = (
    "embedding",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "apply_rope",
    "store_kvcache",
    "prefill_attention",
    "decode_attention",
)


@lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    try:
        from pagedllm.ops import triton_impl
    except ImportError:
        return None
    return triton_impl


def ops_mode() -> str:
    mode = os.environ.get("PAGEDLLM_OPS", "auto").lower()
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"PAGEDLLM_OPS={mode!r}: choose 'reference', 'triton' or unset (auto)")
    return mode


def implementation(device: torch.device | str) -> ModuleType:
    """The module whose functions run ops for tensors on `device`."""
    mode = ops_mode()
    if mode == "reference":
        return reference
    if mode == "triton" or torch.device(device).type == "cuda":
        mod = _triton_module()
        if mod is None:
            if mode == "triton":
                raise RuntimeError(
                    "PAGEDLLM_OPS=triton but triton is not installed (pip install triton)"
                )
            return reference
        return mod
    return reference


def implementation_name(device: torch.device | str) -> str:
    return "reference" if implementation(device) is reference else "triton"
