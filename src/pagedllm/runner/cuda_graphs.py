"""CUDA graphs, captured at start-up: decode steps, one per batch-size bucket,
and single-sequence prefill steps, one per token-count bucket.

Owns: the static input buffers the graphs read, their capture, and filling
them each step. Does not own: the model (captured as it is), or steps of
another shape (prefill of several sequences, mixed steps: they run eagerly).

Why: a decode step of a 1B model launches ~150 kernels; on this machine's
host, launching them one by one costs more than the GPU takes to run them at
small batch. A graph replays them all with one launch. The same holds for
one prompt of up to a few thousand tokens (the time to first token of a
lone request): eager, the host's launches (~30 us each for a Triton kernel)
take longer than the GPU's work.

Invariants: a batch of B sequences runs in the smallest bucket >= B; the
padding rows have seq_len 0 and slot -1, which the Triton kernels treat as
"nothing to attend to / nothing to store". The block-table buffer is as wide
as `max_model_len / block_size` rounded up; only the columns the current
batch uses are refreshed each step (the rest are never read).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.model.batch import ForwardBatch
from pagedllm.model.llama import KVCache, LlamaModel
from pagedllm.runner.batch import HostBatch


class CopyFence:
    """Guards the host memory a step's host-to-device copies read from (the
    runner's block-table mirror, the graphs' pinned staging): the runner waits
    on it before it rewrites any of them for the next step, since with async
    scheduling the next step is prepared while this one is still queued. The
    copies come first in a step, so the wait is short: it does not wait for
    the step's kernels. On the CPU, where copies are done when they return,
    it does nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def copies_queued(self) -> None:
        """Call right after a step's host-to-device copies are queued (before its kernels)."""
        if self.enabled:
            self._event = torch.cuda.Event()
            self._event.record()


@dataclass(frozen=True)
class CaptureTimings:
    """Where a set of graphs' start-up time went (the start-up log prints it)."""

    num_graphs: int
    eager_s: float  # every bucket once, eagerly: Triton compiles each new variant here
    capture_s: float

    def __str__(self) -> str:
        return f"{self.num_graphs} graphs: eager runs {self.eager_s:.1f} s + capture {self.capture_s:.1f} s"


def capture_graphs(
    buckets: list[int],
    forward: Callable[[int], torch.Tensor],
    warm_up: Callable[[int], object] | None = None,
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One graph per bucket of `forward(bucket)` (which returns the logits), and
    the output tensor each replay rewrites.

    Every bucket runs eagerly first (Triton compiles on first launch), then
    `warm_up(bucket)` if given (kernels that other steps launch in another
    variant); then the largest is captured first, so the smaller ones reuse its
    memory pool."""
    t0 = time.perf_counter()
    for b in buckets:
        forward(b)
        if warm_up is not None:
            warm_up(b)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    pool = None
    for b in reversed(buckets):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[b] = forward(b)
        if pool is None:
            pool = graph.pool()
        graphs[b] = graph
    torch.cuda.synchronize()
    timings = CaptureTimings(len(buckets), t1 - t0, time.perf_counter() - t1)
    return graphs, outputs, timings


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's scheme)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        max_num_seqs: int,
        max_model_len: int,
        host_tables: torch.Tensor,
        fence: CopyFence,
    ) -> None:
        dev = model.device
        self.kv_caches = kv_caches
        self.fence = fence
        self.max_model_len = max_model_len
        # The runner's pinned (max_num_seqs, width) host mirror of the block tables.
        self.host_tables = host_tables
        self.max_bs = max_num_seqs
        self.buckets = batch_buckets(self.max_bs)
        width = host_tables.shape[1]
        n = self.max_bs
        # Device buffers the graphs read (their addresses are baked into the graphs).
        # [seq_lens | decode order]: one buffer, one copy per step.
        self.d_int = torch.zeros((2, n), dtype=torch.int32, device=dev)
        self.seq_lens, self.order = self.d_int[0], self.d_int[1]
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)
        # Pinned host staging: [ids | positions | slots] as int64, [seq_lens | order]
        # int32. (Block-table rows are copied straight from the runner's pinned mirror.)
        self.h_long = torch.zeros((3, n), dtype=torch.long).pin_memory()
        self.h_int = torch.zeros((2, n), dtype=torch.int32).pin_memory()
        self.arange = np.arange(n, dtype=np.int32)
        self.d_long = torch.zeros((3, n), dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture(model)

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.d_long[0, :b],
            positions=self.d_long[1, :b],
            slot_mapping=self.d_long[2, :b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            cu_seqlens_q=self.cu_seqlens[: b + 1],
            logits_indices=self.logits_indices[:b],
            is_decode=True,
            max_q_len=1,
            # The graph must be valid for any context up to the longest allowed.
            max_seq_len=self.max_model_len,
            decode_order=self.order[:b] if b > 1 else None,
        )

    @torch.inference_mode()
    def _capture(self, model) -> None:
        kv = self.kv_caches
        self.d_long[2].fill_(-1)  # padding: store nothing
        self.seq_lens.fill_(1)
        self.order.copy_(torch.from_numpy(self.arange))

        def forward(b: int) -> torch.Tensor:
            return model.compute_logits(model.forward(self._batch(b), kv))

        def unchained(b: int) -> None:
            # A bucket whose graph chains its kernels (PDL, a compile-time variant of
            # each Triton kernel) also runs once unchained: mixed steps with as many
            # decode rows launch the same kernels unchained, and compiling one of
            # them mid-run stalled a step (1B float8 K/V: ~0.8 s in the first steps).
            if not model.chains_kernels(self._batch(b)) or b == 1:
                return
            model.chain_batched_decode = False
            try:
                forward(b)
            finally:
                model.chain_batched_decode = True

        self.graphs, self.outputs, self.timings = capture_graphs(self.buckets, forward, unchained)
        self.seq_lens.zero_()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs

    def run(
        self, host: HostBatch, dirty_rows: set[int], fed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy the step's host arrays (built by `ModelRunner.prepare`) into the
        graph's buffers and replay; returns (B, V) logits.

        `dirty_rows`: rows of the runner's block-table mirror rewritten since
        this buffer last copied them; the batch's are sent (columns up to its
        longest table: nothing past a row's table is read) and removed.

        `fed`: (B,) input ids already on the device (a continuation step: the
        ids the step before sampled), copied over the host's placeholders.

        The copies are asynchronous, from pinned memory (the staging and the
        runner's block-table mirror); the runner waits on `fence` before it
        rewrites either for the next step."""
        b = host.num_seqs
        bucket = next(x for x in self.buckets if x >= b)
        h = self.h_long.numpy()
        hi = self.h_int.numpy()
        h[0, :b] = host.input_ids
        h[1, :b] = host.positions
        h[2, :b] = host.slot_mapping
        h[2, b:bucket] = -1
        hi[0, :b] = host.seq_lens
        hi[0, b:bucket] = 0
        # The graph's decode attention takes rows in this order: the batch's longest
        # first, then the padding rows (a permutation of the whole bucket).
        if host.decode_order is not None:
            hi[1, :b] = host.decode_order
        else:
            hi[1, :b] = self.arange[:b]
        hi[1, b:bucket] = self.arange[b:bucket]
        # Whole buffers (8 KB): a contiguous pinned source keeps the copies asynchronous.
        self.d_long.copy_(self.h_long, non_blocking=True)
        self.d_int.copy_(self.h_int, non_blocking=True)
        # This batch's rows among them; a row past the batch stays dirty until a
        # graph step uses it.
        send = [i for i in dirty_rows if i < b]
        if send:
            rows, width = slice(min(send), max(send) + 1), host.longest_table
            self.block_tables[rows, :width].copy_(self.host_tables[rows, :width], non_blocking=True)
            dirty_rows.difference_update(send)
        self.fence.copies_queued()
        if fed is not None:
            self.d_long[0, :b].copy_(fed)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts of the prefill graphs: every 16 up to 256, every 64 up to
    1,024 and every 256 up to 2,048 (at most 25 % padding above 256), none above
    `max_tokens` (which need not be a bucket itself). Longer prompts keep the GPU
    busy longer than their launches take, and run eagerly."""
    sizes = list(range(16, 257, 16)) + list(range(320, 1025, 64)) + list(range(1280, 2049, 256))
    return [t for t in sizes if t <= max_tokens]


class PrefillGraphs:
    """One graph per token-count bucket for a step that prefills one sequence
    (a whole prompt, or a chunk of one after its cached or computed part).

    The batch is padded to the bucket: padding tokens have id 0, position 0
    and slot -1 (nothing stored); the sequence's own length comes from
    `cu_seqlens` and `seq_lens`, which the attention kernel reads on the
    device, so query blocks past it exit at once. Only the last real token's
    row reaches the LM head.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        max_tokens: int,
        max_model_len: int,
        host_tables: torch.Tensor,
        fence: CopyFence,
    ) -> None:
        dev = model.device
        self.kv_caches = kv_caches
        self.fence = fence
        self.max_model_len = max_model_len
        self.host_tables = host_tables.numpy()
        self.buckets = prefill_buckets(max_tokens)
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        t = self.max_tokens
        width = host_tables.shape[1]
        # One pinned int64 staging buffer, one copy a step (each copy call costs
        # the host ~10 us): [ids | positions | slots] (t each), the last row,
        # then what the kernels read as int32: [cu_seqlens (2) | seq_len | unused
        # | block-table row (width)], converted by one copy inside the graph (the
        # row starts 16-byte aligned). A step copies up to its table's last column.
        self.i32_at = 3 * t + 1
        self.h_in = torch.zeros(self.i32_at + 4 + width, dtype=torch.long).pin_memory()
        self.d_in = torch.zeros_like(self.h_in, device=dev)
        self.d_i32 = torch.zeros(4 + width, dtype=torch.int32, device=dev)
        self.cu_seqlens = self.d_i32[0:2]
        self.seq_lens = self.d_i32[2:3]
        self.block_tables = self.d_i32[4:].view(1, width)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.timings: CaptureTimings | None = None
        if self.buckets:
            self._capture(model)

    def _batch(self, t: int) -> ForwardBatch:
        d, m = self.d_in, self.max_tokens
        return ForwardBatch(
            input_ids=d[:t],
            positions=d[m : m + t],
            slot_mapping=d[2 * m : 2 * m + t],
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            cu_seqlens_q=self.cu_seqlens,
            logits_indices=d[3 * m : 3 * m + 1],
            is_decode=False,
            max_q_len=t,  # the grid covers the bucket; blocks past the sequence exit
            # The last layer's decode attention picks its split count from this
            # (each split's range comes from seq_lens on the device): a chunk
            # after a long cached prefix gets as many splits as a decode step.
            max_seq_len=self.max_model_len,
        )

    def _forward(self, model, t: int) -> torch.Tensor:
        # The int32 values the kernels read, from the one int64 copy.
        self.d_i32.copy_(self.d_in[self.i32_at :])
        return model.compute_logits(model.forward(self._batch(t), self.kv_caches))

    @torch.inference_mode()
    def _capture(self, model) -> None:
        m, i = self.max_tokens, self.i32_at
        self.d_in[2 * m : 3 * m].fill_(-1)  # store nothing while capturing
        self.d_in[i : i + 3].copy_(torch.tensor([0, 1, 1]))  # cu_seqlens, seq_len
        self.graphs, self.outputs, self.timings = capture_graphs(
            self.buckets, lambda t: self._forward(model, t)
        )

    def can_run(self, host: HostBatch) -> bool:
        """A prefill step of one sequence that fits a bucket and wants one logits row."""
        return (
            not host.is_decode
            and host.num_seqs == 1
            and len(host.logits_indices) == 1
            and len(host.input_ids) <= self.max_tokens
            and not host.every_row
        )

    def run(self, host: HostBatch) -> torch.Tensor:
        """Copy the step's host arrays into the graph's buffers and replay; (1, V) logits.
        (The host memory the copy reads is guarded by `fence`, as for decode.)"""
        n = len(host.input_ids)
        t = next(x for x in self.buckets if x >= n)
        m, width = self.max_tokens, host.block_tables.shape[1]
        h = self.h_in.numpy()
        h[:n] = host.input_ids
        h[m : m + n] = host.positions
        h[2 * m : 2 * m + n] = host.slot_mapping
        h[n:t] = 0  # padding: token 0 at position 0, stored nowhere
        h[m + n : m + t] = 0
        h[2 * m + n : 2 * m + t] = -1
        h[3 * m] = n - 1  # the last real token's row
        i = self.i32_at
        h[i : i + 3] = (0, n, host.seq_lens[0])
        end = i + 4 + width
        h[i + 4 : end] = self.host_tables[0, :width]
        # A contiguous pinned source keeps the copy asynchronous.
        self.d_in[:end].copy_(self.h_in[:end], non_blocking=True)
        self.fence.copies_queued()
        self.graphs[t].replay()
        return self.outputs[t]
