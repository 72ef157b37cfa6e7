"""HostBatch: one step's batch as host (numpy) arrays.

Built once per step by `ModelRunner.prepare`, the one place where the plan's
lists become arrays. The eager path copies it to the device as a
`ForwardBatch`; a decode CUDA graph copies it into the graph's own buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class HostBatch:
    """A step's batch as host arrays, built once by `ModelRunner.prepare`; the
    eager path copies it to the device as a ForwardBatch, a CUDA graph copies
    it into its own buffers."""

    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_mapping: np.ndarray  # (T,) int64
    seq_lens: np.ndarray  # (B,) int32, new tokens included
    cu_seqlens: np.ndarray  # (B+1,) int32
    logits_indices: np.ndarray  # (N,) int64
    block_tables: np.ndarray  # (B, W) int32: rows of the runner's table mirror
    longest_table: int  # pages in the longest block table of the batch
    max_q_len: int
    max_seq_len: int
    # A mixed step: its first sequences that have one new token each (decode
    # attention reads them; 0 for an all-decode step, see ForwardBatch).
    num_decode_seqs: int = 0
    # The last layer computes every row, not only the logits rows (a trace
    # records them all; set here so that every tensor-parallel rank agrees).
    every_row: bool = False
    # (B,) int32: the rows longest context first (see ForwardBatch); None for
    # one row.
    decode_order: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)
