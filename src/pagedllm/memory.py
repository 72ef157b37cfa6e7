"""Planned allocations against the memory there is, checked before they are made.

Owns: how much memory a device has available to this process (the CPU:
`MemAvailable` of /proc/meminfo, else `os.sysconf`, or less where the
process's memory cgroup (a container's limit) leaves less; CUDA: the
device's free memory) and the rule a large allocation is held to: at most
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


CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as 2**63 rounded down to a page


def _read_int(path: str) -> int | None:
    """The integer in a cgroup file; None for "max" (no limit), a missing file or junk."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: str, key: str) -> int:
    """`key`'s value in a cgroup's memory.stat (0 when absent)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _cgroup_v2_dirs(root: str) -> list[str]:
    """The process's cgroup v2 folder and its ancestors up to `root` (a container
    with its own cgroup namespace sees its cgroup as `root` itself)."""
    dirs = [root]
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            for line in f:
                if line.startswith("0::"):
                    rel = line[3:].strip().strip("/")
                    parts = rel.split("/") if rel else []
                    dirs += [os.path.join(root, *parts[:i]) for i in range(1, len(parts) + 1)]
    except (OSError, UnicodeDecodeError):
        pass
    return dirs


def cgroup_room(root: str | None = None) -> int | None:
    """Bytes this process's memory cgroup can still grow by before the kernel's OOM
    killer acts: its limit less its usage, the page cache it could drop
    (inactive_file) not counted as used, the smallest over the cgroup and its
    ancestors. None where no limit is set (or no cgroup can be read). Docker and
    Kubernetes limits live here, and /proc/meminfo does not show them."""
    root = root or CGROUP_ROOT
    rooms = []
    for folder in _cgroup_v2_dirs(root):  # cgroup v2: memory.max, memory.current
        limit = _read_int(os.path.join(folder, "memory.max"))
        if limit is not None:
            usage = _read_int(os.path.join(folder, "memory.current")) or 0
            cache = _stat_value(os.path.join(folder, "memory.stat"), "inactive_file")
            rooms.append(limit - max(0, usage - cache))
    v1 = os.path.join(root, "memory")  # cgroup v1: the memory controller's own tree
    limit = _read_int(os.path.join(v1, "memory.limit_in_bytes"))
    if limit is not None and limit < _NO_LIMIT:
        usage = _read_int(os.path.join(v1, "memory.usage_in_bytes")) or 0
        cache = _stat_value(os.path.join(v1, "memory.stat"), "total_inactive_file")
        rooms.append(limit - max(0, usage - cache))
    return max(0, min(rooms)) if rooms else None


def available_bytes(device: Any) -> tuple[int, str] | None:
    """(bytes available on `device`, what that figure is), or None when unknown.

    `device`: a torch.device or its name ("cpu", "cuda:1")."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), "free GPU memory"
    available = available_cpu_bytes()
    room = cgroup_room()
    if room is not None and (available is None or room < available):
        return room, "the memory cgroup's limit less its usage"
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
