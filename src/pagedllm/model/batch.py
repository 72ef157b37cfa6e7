"""ForwardBatch: everything one forward pass needs, as tensors, passed explicitly.

Owns: the shape of the metadata between the runner (which builds it from
Python lists, the only place that does) and the model (which only reads it).
Attention metadata is an argument of `model.forward`, never a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64: the new tokens of every sequence, packed
    positions: torch.Tensor  # (T,) int64: each token's position in its sequence
    slot_mapping: torch.Tensor | None  # (T,) int64: cache slot of each new token; None: no cache
    block_tables: torch.Tensor | None  # (B, max_blocks) int32: page ids per sequence
    seq_lens: torch.Tensor  # (B,) int32: tokens per sequence *including* the new ones
    cu_seqlens_q: torch.Tensor  # (B+1,) int32: where each sequence's new tokens start in T
    logits_indices: torch.Tensor  # (N,) int64: rows of T whose logits are wanted
    # Every sequence has exactly one new token; then every row is a logits row
    # (logits_indices is 0 .. B-1), and the model reads the rows as they are.
    is_decode: bool
    # Host-side hints (ints known without a device sync), used to size kernel grids.
    max_q_len: int = 0
    max_seq_len: int = 0
    # A mixed step (not is_decode): its first num_decode_seqs sequences have one
    # new token each. The model runs decode attention for them and prefill
    # attention for the rest (a prefill tile would pad each such row to 64 queries).
    num_decode_seqs: int = 0
    # The last layer computes every row, not only the logits rows (see
    # `LlamaModel._layers`; a trace sets it: every tensor-parallel rank must agree).
    every_row: bool = False
    # (B,) int32: the rows longest context first, a mixed step's first
    # num_decode_seqs rows (its decode rows) among themselves, then the others.
    # Decode attention starts its programs in this order (None: row order;
    # batch 1 has none).
    decode_order: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
