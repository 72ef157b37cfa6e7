"""A shim for Triton 3.6's CPU interpreter under NumPy >= 2.4 (triton-lang/triton#9171).

Owns: nothing numerical. Under `TRITON_INTERPRET=1` every scalar is a 1-element
NumPy array, and the interpreter turns one into a Python int with
`int(array)`, which NumPy 2.4 made an error: any loop whose bound is a loaded
value (`for n0 in range(start, seq_len, BLOCK_N)`) then fails. Upstream's fix
squeezes the array first; this applies the same one-liner, only when
interpreting and only to an interpreter that still has the bug. Compiled (GPU)
kernels never pass through here.
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
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagedllm_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._pagedllm_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


apply()
