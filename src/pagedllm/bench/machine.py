"""What the benchmark ran on, and the memory roofline it is judged against.

Owns: the device's name, the source commit, the memory bandwidth ceiling
(published-by-us for the H200, measured with a copy elsewhere) and the bytes
one batch-1 decode step must read. Does not own: timing the engines.

Bandwidth counts bytes read + written by a large device-to-device copy, the
same definition as the 4.28 TB/s of the H200 in docs/gpu.md.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from pagedllm.model import LlamaModel

H200_BANDWIDTH_GBPS = 4280.0  # measured on the lent H200 (docs/gpu.md), read + written


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # platform.processor() is often empty on Linux
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return (platform.processor() or platform.machine()) + f" ({torch.get_num_threads()} threads)"


def git_commit() -> str:
    """Short commit of the source tree, with '+dirty' for uncommitted changes; else 'unknown'.

    $PAGEDLLM_COMMIT wins: a copy of the tree without `.git` (the GPU machine) is told.
    """
    if os.environ.get("PAGEDLLM_COMMIT"):
        return os.environ["PAGEDLLM_COMMIT"]
    root = Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode != 0:
            return "unknown"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = "+dirty" if status.stdout.strip() else ""
        return rev.stdout.strip() + dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def memory_bandwidth_gbps(device: torch.device) -> tuple[float, str]:
    """(GB/s, where the figure comes from): the ceiling batch-1 decode is held against."""
    if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device):
        return H200_BANDWIDTH_GBPS, "H200, device-to-device copy measured 2026-11-30 (docs/gpu.md)"
    return measure_copy_bandwidth(device), "measured here: large tensor copy, read + written"


def measure_copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 10) -> float:
    """Best of a few copies of a `mib` MiB buffer; bytes read + written over time, in GB/s.

    On the CPU the copy runs on every usable core, whatever the run's thread
    count: the ceiling is the machine's, not the policy's (one thread copies at
    ~18 GB/s on the 2-vCPU EPYC, two at ~29).
    """
    from pagedllm.cpu_threads import usable_cores

    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(usable_cores())
    try:
        dst.copy_(src)  # first touch: page faults and allocator, not bandwidth
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * src.numel() * src.element_size() / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_per_decode_step(model: LlamaModel) -> int:
    """Bytes of weights one decode step reads: every matrix and norm once, plus one
    embedding row (the embedding table is read in full only as a tied LM head)."""
    # Each matrix as it is held (`nbytes`: an FP8 one's float8 values and scales, a
    # packed CPU one's packed values); a tied LM head is read as the head only.
    total = model.lm_head.nbytes + model.norm.nbytes
    for layer in model.layers:
        total += layer.input_norm.nbytes + layer.post_norm.nbytes
        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            total += m.nbytes
    return int(total + model.embed_tokens.shape[1] * model.embed_tokens.element_size())


def decode_bytes_per_token(
    model: LlamaModel, prompt_len: int, output_len: int, kv_itemsize: int | None = None
) -> float:
    """Mean bytes read per batch-1 decode step over a whole request.

    The step that makes output token j (j = 2..n) attends over prompt + j - 1
    cached tokens; the mean over j is prompt + n/2. `kv_itemsize`: bytes per
    cached K/V value (1 for float8 pages); None: the model's dtype.
    """
    itemsize = kv_itemsize or model.dtype.itemsize
    kv_per_token = model.config.kv_bytes_per_token(itemsize)
    mean_context = prompt_len + output_len / 2
    return weight_bytes_per_decode_step(model) + kv_per_token * mean_context
