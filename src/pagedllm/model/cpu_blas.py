"""CPU projections through numpy's BLAS, when that is safe and faster.

Why: on the 2-core EPYC machines we develop on, a batch-1 float32 projection
through numpy (OpenBLAS) streams weights at ~25 GB/s, torch's matmul at ~16
(read-only ceiling measured at 29 GB/s). But OpenBLAS's own worker threads
spin between calls and fight torch's threads for the cores (a decode step went
from 48 ms to 380 ms). So we use numpy only after pinning OpenBLAS to one
thread, as threadpoolctl does (its C entry point, through ctypes); if that
cannot be done, `numpy_matmul_ok()` is False and the model uses torch.
"""

from __future__ import annotations

import ctypes
import glob
import os
from functools import lru_cache

_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


_setter = None  # OpenBLAS's set_num_threads, once found


@lru_cache(maxsize=1)
def numpy_matmul_ok() -> bool:
    """Pin numpy's OpenBLAS to one thread; True when numpy matmuls are then safe to use."""
    global _setter
    if os.environ.get("PAGEDLLM_CPU_NUMPY_MATMUL", "1") == "0":
        return False
    import numpy

    libs = glob.glob(
        os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs", "*openblas*")
    )
    for path in libs:
        try:
            lib = ctypes.CDLL(path)  # already loaded by numpy: the same handle
        except OSError:
            continue
        for name in _SETTERS:
            if hasattr(lib, name):
                _setter = getattr(lib, name)
                _setter(1)
                return True
    return False


def set_blas_threads(threads: int) -> bool:
    """Let numpy's OpenBLAS use `threads` threads; False when it cannot be set
    (`numpy_matmul_ok()` False: the model does not use numpy then)."""
    if not numpy_matmul_ok() or _setter is None:
        return False
    _setter(int(threads))
    return True
