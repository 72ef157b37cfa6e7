"""CUDA graphs for decode steps, one per batch-size bucket, captured at start-up.

Owns: the static input buffers the graphs read, their capture, and filling
them each step. Does not own: the model (captured as it is) or prefill
(which runs eagerly: its shapes vary too much to graph).

Why: a decode step of a 1B model launches ~150 kernels; on this machine's
host, launching them one by one costs more than the GPU takes to run them at
small batch. A graph replays them all with one launch.

Invariants: a batch of B sequences runs in the smallest bucket >= B; the
padding rows have seq_len 0 and slot -1, which the Triton kernels treat as
"nothing to attend to / nothing to store". The block-table buffer is as wide
as `max_model_len / block_size` rounded up; only the columns the current
batch uses are refreshed each step (the rest are never read).
"""

from __future__ import annotations

import torch

from pagedllm.model.batch import ForwardBatch
from pagedllm.model.llama import KVCache, LlamaModel
from pagedllm.runner.batch import HostBatch


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
    ) -> None:
        dev = model.device
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        # The runner's pinned (max_num_seqs, width) host mirror of the block tables.
        self.host_tables = host_tables
        self.max_bs = max_num_seqs
        self.buckets = batch_buckets(self.max_bs)
        width = host_tables.shape[1]
        n = self.max_bs
        # Device buffers the graphs read (their addresses are baked into the graphs).
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)
        # Pinned host staging: [ids | positions | slots] as int64, [seq_lens] int32.
        # (Block-table rows are copied straight from the runner's pinned mirror.)
        self.h_long = torch.zeros((3, n), dtype=torch.long).pin_memory()
        self.h_int = torch.zeros(n, dtype=torch.int32).pin_memory()
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
        )

    @torch.inference_mode()
    def _capture(self, model) -> None:
        kv = self.kv_caches
        self.d_long[2].fill_(-1)  # padding: store nothing
        self.seq_lens.fill_(1)
        # Warm up every bucket eagerly first: Triton compiles on first launch.
        for b in self.buckets:
            model.compute_logits(model.forward(self._batch(b), kv))
        torch.cuda.synchronize()
        pool = None
        for b in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model.compute_logits(model.forward(self._batch(b), kv))
            if pool is None:
                pool = graph.pool()
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize()
        self.seq_lens.zero_()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs

    def run(self, host: HostBatch, dirty_rows: set[int]) -> torch.Tensor:
        """Copy the step's host arrays (built by `ModelRunner.prepare`) into the
        graph's buffers and replay; returns (B, V) logits.

        `dirty_rows`: rows of the runner's block-table mirror rewritten since
        this buffer last copied them; the batch's are sent (columns up to its
        longest table: nothing past a row's table is read) and removed.

        The copies are asynchronous, from pinned memory, and the host arrays are
        rewritten next step without waiting: safe because the engine reads the
        sampled ids (a sync) every step. An engine that prepares step n+1 while
        step n runs must first record an event after these copies and wait on it."""
        b = host.num_seqs
        bucket = next(x for x in self.buckets if x >= b)
        h = self.h_long.numpy()
        hi = self.h_int.numpy()
        h[0, :b] = host.input_ids
        h[1, :b] = host.positions
        h[2, :b] = host.slot_mapping
        h[2, b:bucket] = -1
        hi[:b] = host.seq_lens
        hi[b:bucket] = 0
        # Whole buffers (6 KB): a contiguous pinned source keeps the copies asynchronous.
        self.d_long.copy_(self.h_long, non_blocking=True)
        self.seq_lens.copy_(self.h_int, non_blocking=True)
        # This batch's rows among them; a row past the batch stays dirty until a
        # graph step uses it.
        send = [i for i in dirty_rows if i < b]
        if send:
            rows, width = slice(min(send), max(send) + 1), host.longest_table
            self.block_tables[rows, :width].copy_(self.host_tables[rows, :width], non_blocking=True)
            dirty_rows.difference_update(send)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]
