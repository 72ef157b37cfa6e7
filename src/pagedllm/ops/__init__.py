"""Op dispatch: every op has a reference (PyTorch) and, on CUDA, a Triton kernel.

The mode picks the implementation: "reference" or "triton" forces one; "auto"
gives CUDA tensors Triton (when it imports) and CPU tensors the reference. The
mode is an argument (`implementation(device, mode)`; `LlamaModel.ops_mode`
passes it); when it is None, `$PAGEDLLM_OPS` is read on every call, and unset
means auto. With `TRITON_INTERPRET=1` and mode "triton", the Triton kernels run
on the CPU (slowly), which is how CI tests them.

Both implementations share one signature per op (see `ops/reference.py` for the
spec of each). The choice is made per call from the device and the mode, so a
model holds at most the mode it was asked for.
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import ModuleType

import torch

from pagedllm.ops import reference

# Programmatic dependent launch's switch lives in a module of its own, so the
# kernels that read it (triton_pdl.py) need not import this package back.
from pagedllm.ops.kernel_chain import in_kernel_chain as in_kernel_chain
from pagedllm.ops.kernel_chain import kernel_chain as kernel_chain

OP_NAMES = (
    "embedding",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "linear",
    "linear_silu_and_mul",
    "linear_gelu_tanh_and_mul",
    "fp8_linear",
    "fp8_linear_act_and_mul",
    "fp8_mlp",
    "fp8_norm_linear",
    "fp8_norm_mlp",
    "apply_rope",
    "store_kvcache",
    "rope_and_store",
    "prefill_attention",
    "decode_attention",
    "rope_store_decode_attention",
    "argmax",
)


@lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    try:
        from pagedllm.ops import triton_impl
    except ImportError:
        return None
    return triton_impl


MODES = ("auto", "reference", "triton")


def ops_mode(mode: str | None = None) -> str:
    """The mode in force: `mode` when given, else $PAGEDLLM_OPS, else "auto"."""
    if mode is None:
        env = os.environ.get("PAGEDLLM_OPS", "auto").lower()
        if env not in MODES:
            raise ValueError(f"PAGEDLLM_OPS={env!r}: choose 'reference', 'triton' or unset (auto)")
        return env
    if mode not in MODES:
        raise ValueError(f"ops mode {mode!r}: choose 'auto', 'reference', 'triton' or None")
    return mode


def implementation(device: torch.device | str, mode: str | None = None) -> ModuleType:
    """The module whose functions run ops for tensors on `device`, under `mode`
    ("auto", "reference", "triton"; None: $PAGEDLLM_OPS, else auto)."""
    mode = ops_mode(mode)
    if mode == "reference":
        return reference
    if mode == "triton" or torch.device(device).type == "cuda":
        mod = _triton_module()
        if mod is None:
            if mode == "triton":
                raise RuntimeError(
                    "ops mode 'triton' (PAGEDLLM_OPS or the ops setting) but triton is not "
                    "installed (pip install triton)"
                )
            return reference
        if torch.device(device).type == "cpu" and not _interpreted():
            raise ValueError(
                "ops mode 'triton' on the CPU runs Triton's interpreter, which is switched "
                "on when Triton is first imported: start with TRITON_INTERPRET=1 in the "
                "environment (slow: for testing the kernels), or use --ops reference"
            )
        return mod
    return reference


@lru_cache(maxsize=1)
def _interpreted() -> bool:
    """Whether the Triton kernels run in the interpreter (TRITON_INTERPRET=1 at import)."""
    import triton

    from pagedllm.ops import triton_attention

    return not isinstance(triton_attention._decode_kernel, triton.runtime.jit.JITFunction)


def implementation_name(device: torch.device | str, mode: str | None = None) -> str:
    """The name of what `implementation(device, mode)` returns: reference or triton."""
    return "reference" if implementation(device, mode) is reference else "triton"
