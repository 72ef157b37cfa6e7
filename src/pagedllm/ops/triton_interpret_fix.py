"""Two shims for Triton 3.6's CPU interpreter, applied only when interpreting.

Owns: nothing numerical of ours. Compiled (GPU) kernels never pass through here.

1. NumPy >= 2.4 (triton-lang/triton#9171). Under `TRITON_INTERPRET=1` every
   scalar is a 1-element NumPy array, and the interpreter turns one into a
   Python int with `int(array)`, which NumPy 2.4 made an error: any loop whose
   bound is a loaded value (`for n0 in range(start, seq_len, BLOCK_N)`) then
   fails. Upstream's fix squeezes the array first; this applies the same
   one-liner, only to an interpreter that still has the bug.
2. Rounding to float8 e4m3 (the fp8 K/V cache). The interpreter's bit-level
   downcast drops mantissa bits with a one-bit round-up that never carries into
   the exponent (0.0307 becomes 0.0156) and flushes e4m3's subnormals to zero.
   The GPU rounds to nearest even, as `torch.Tensor.to(torch.float8_e4m3fn)`
   does: this routes the interpreter's casts to e4m3 through torch. (Casts out
   of fp8 are exact in the interpreter and are left alone.)
3. Rounding float32 to bfloat16. The interpreter keeps the top 16 bits
   (truncation: 1.00781 becomes 1.0); the GPU, like torch, rounds to nearest
   even. The interpreter's float32 -> bfloat16 casts go through torch too, so
   a kernel that rounds its sums to bf16 gives on the CPU the bits the GPU
   gives (the bf16 interpreter tests compare with `reference` exactly).
4. Dots of bfloat16 operands. The interpreter keeps bf16 values as their uint16
   bits and multiplies those integers. The GPU's tensor cores multiply the bf16
   values exactly and sum in float32: the operands are widened to float32 (their
   bits shifted up, exactly) and multiplied in float32, so the bf16 attention
   kernels can be tested on the CPU.
"""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    _fix_index(interpreter)
    _fix_fp8_rounding(interpreter)
    _fix_bf16_rounding(interpreter)
    _fix_bf16_dot(interpreter)


def _unfixed(owner, name: str):
    """owner.name when it exists and is not already our replacement, else None."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_pagedllm_fixed", False):
        return None
    return original


def _fix_index(interpreter) -> None:
    original = _unfixed(interpreter, "_patch_lang_tensor")
    if original is None:
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._pagedllm_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _fix_fp8_rounding(interpreter) -> None:
    import numpy as np
    import torch
    import triton.language as tl

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = _unfixed(builder, "create_fp_to_fp")
    if original is None:
        return

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty = src.dtype.scalar
        if dst_type.scalar != tl.float8e4nv or src_ty not in (tl.float32, tl.bfloat16, tl.float16):
            return original(self, src, dst_type, rounding_mode)
        data = src.data
        if src_ty == tl.bfloat16:  # stored as uint16: its bits are float32's top half
            data = (data.astype(np.uint32) << 16).view(np.float32)
        x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        bits = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interpreter.TensorHandle(bits, dst_type.scalar)

    create_fp_to_fp._pagedllm_fixed = True
    builder.create_fp_to_fp = create_fp_to_fp


def _fix_bf16_rounding(interpreter) -> None:
    import numpy as np
    import torch
    import triton.language as tl

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = _unfixed(builder, "cast_impl")
    if original is None:
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # bf16 as uint16
        return interpreter.TensorHandle(bits, dst_type.scalar)

    cast_impl._pagedllm_fixed = True
    builder.cast_impl = cast_impl


def _fix_bf16_dot(interpreter) -> None:
    import numpy as np
    import triton.language as tl

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = _unfixed(builder, "create_dot")
    if original is None:
        return

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = (handle.data.astype(np.uint32) << 16).view(np.float32)  # exact
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a, b = widened(a), widened(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._pagedllm_fixed = True
    builder.create_dot = create_dot


apply()
