"""Planned allocations against the memory there is, checked before they are made.

Owns: how much memory a device has available to this process (the CPU:
`MemAvailable` of /proc/meminfo, else `os.sysconf`; CUDA: the device's free
memory) and the rule a large allocation is held to: at most
`USABLE_FRACTION` of that, the rest being left to activations, the sampler
and everything else a step makes. Does not own: what is planned (dummy
weights: `model/loader.py`; the KV cache: `runner/model_runner.py`).

Why: without the check, dummy weights of a config with 10**6 layers, or
`--kv-cache-mib 1000000` on the CPU, allocated until the machine ran out (the
kernel's OOM killer, or swap for minutes) instead of one line saying what fits.

Layer 0: stdlib only; torch is imported only to ask a CUDA device.
"""

from __future__ import annotations

import os
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
# The share of the available memory one planned allocation may take.
USABLE_FRACTION = 0.9


def available_cpu_bytes() -> int | None:
    """Memory the kernel could give this process without swapping: MemAvailable,
    else the free physical pages (`os.sysconf`); None when neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):  # not a POSIX system
        return None


def available_bytes(device: Any) -> tuple[int, str] | None:
    """(bytes available on `device`, what that figure is), or None when unknown.

    `device`: a torch.device or its name ("cpu", "cuda:1")."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), "free GPU memory"
    available = available_cpu_bytes()
    return None if available is None else (available, "MemAvailable")


def usable(available: int) -> int:
    """The bytes one planned allocation may take out of `available`."""
    return int(available * USABLE_FRACTION)


def size_text(n: float) -> str:
    """1.5 GiB, 512.0 MiB: the unit that reads best."""
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / MiB:,.1f} MiB"


def over_text(planned: int, available: int, where: str) -> str:
    """The clause every such error shares: how much is planned against how much there is."""
    return (
        f"{size_text(planned)}, more than {USABLE_FRACTION:.0%} of the "
        f"{size_text(available)} available ({where})"
    )


def release_freed_memory() -> bool:
    """Hand the C allocator's freed memory back to the kernel (glibc's
    `malloc_trim(0)`); False where there is no glibc.

    Why: loading a model makes large temporaries (a GGUF tensor dequantized to
    float32, then packed or cast), and glibc keeps freed blocks below its
    adaptive mmap threshold (up to 32 MiB) in its heap for reuse. After loading
    SmolLM2 with packed weights the resident set had grown by 362 MiB; after
    this call by 138 MiB, of which the weights are 117 (docs/benchmarks.md).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    trim(0)
    return True
