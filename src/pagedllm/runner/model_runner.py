"""ModelRunner: the one place where Python lists become tensors.

Owns: the KV cache tensors (per layer, K and V of shape (NB, BS, Hkv, D) in
the compute dtype), turning a `SchedulerOutput` into a `ForwardBatch`, running
the model, and (on CUDA) the decode CUDA graphs. Does not own: which requests
run (scheduler), which pages they hold (block manager), or sampling.

Token i of a request lives at slot `block_table[i // BS] * BS + i % BS`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.model.batch import ForwardBatch
from pagedllm.model.llama import KVCache, LlamaModel
from pagedllm.ops import implementation_name
from pagedllm.request import Request

MiB = 1 << 20


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_token: int  # K + V across all layers

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def mib(self) -> float:
        return self.num_blocks * self.block_size * self.bytes_per_token / MiB


def plan_kv_cache(
    model: LlamaModel,
    block_size: int,
    kv_cache_mib: float | None,
    max_model_len: int,
    max_num_seqs: int,
) -> tuple[KVCacheSpec, str]:
    """How many pages to allocate, and a sentence saying why.

    `kv_cache_mib` counts K+V across all layers. Without it: on CUDA, 85% of
    the free device memory (vLLM's default leaves 10%); on the CPU, 256 MiB.
    Never more than max_num_seqs full-length sequences could use.
    """
    itemsize = torch.finfo(model.dtype).bits // 8
    per_token = model.config.kv_bytes_per_token(itemsize)
    per_block = per_token * block_size
    if kv_cache_mib is not None:
        if kv_cache_mib <= 0:
            raise ValueError(f"kv_cache_mib must be positive, got {kv_cache_mib}")
        budget = int(kv_cache_mib * MiB)
        why = f"--kv-cache-mib {kv_cache_mib:g}"
    elif model.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(model.device)
        budget = int(free * 0.85) - 2 * 1024 * MiB  # leave room for activations and graphs
        why = f"85% of free GPU memory ({free / 2**30:.1f} GiB free) less 2 GiB for activations"
    else:
        budget = 256 * MiB
        why = "CPU default of 256 MiB (set --kv-cache-mib to change)"
    useful = math.ceil(max_model_len / block_size) * max_num_seqs
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget / MiB:.1f} MiB) holds not one page of {block_size} tokens "
            f"({per_block / MiB:.3f} MiB); raise --kv-cache-mib"
        )
    return KVCacheSpec(int(num_blocks), block_size, per_token), why


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_spec: KVCacheSpec,
        max_model_len: int,
        max_num_seqs: int,
        use_cuda_graphs: bool | None = None,
    ) -> None:
        self.model = model
        self.device = model.device
        self.block_size = kv_spec.block_size
        self.kv_spec = kv_spec
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # The block table is wide enough for the longest allowed context.
        self.max_blocks_per_seq = math.ceil(max_model_len / kv_spec.block_size)
        cfg = model.config
        shape = (kv_spec.num_blocks, kv_spec.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches: list[KVCache] = [
            (
                torch.zeros(shape, dtype=model.dtype, device=self.device),
                torch.zeros(shape, dtype=model.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.pin = self.device.type == "cuda"
        if use_cuda_graphs is None:
            # Graphs need the Triton kernels: their padding rows (slot -1) are no-ops
            # there, while the reference store would wrap -1 to the pool's last slot.
            use_cuda_graphs = (
                self.device.type == "cuda"
                and implementation_name(self.device) == "triton"
                and os.environ.get("PAGEDLLM_CUDA_GRAPHS", "1") not in ("0", "false")
            )
        self.graphs = None
        if use_cuda_graphs:
            from pagedllm.runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)
        self.host_time_s = 0.0  # time spent building batches on the host
        self.num_steps = 0

    # ------------------------------------------------------------------
    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(array).to(dtype)
        if self.pin:
            t = t.pin_memory()
            return t.to(self.device, non_blocking=True)
        return t.to(self.device)

    def prepare(
        self,
        scheduled: Sequence[Request],
        num_new_tokens: Sequence[int],
        all_logits_rows: frozenset[int] = frozenset(),
    ) -> ForwardBatch:
        """Flatten the scheduled requests' new tokens into one ForwardBatch.

        Logits are wanted for each sequence's last new token, and for every new
        token of the sequences in `all_logits_rows` (prompt log-probs); in that
        case the rows of each sequence are contiguous and its last comes last.
        """
        bs = self.block_size
        num_seqs = len(scheduled)
        total = sum(num_new_tokens)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slot_mapping = np.empty(total, dtype=np.int64)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        cu_seqlens = np.zeros(num_seqs + 1, dtype=np.int32)
        # Width rounded up to a multiple of 16: Triton specializes integer arguments
        # (this row stride) on divisibility by 16, and a width that changes that
        # from step to step recompiles the prefill kernel (~0.5 s each time).
        max_blocks = -(-max(len(r.block_table) for r in scheduled) // 16) * 16
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        pos = 0
        for i, (req, n) in enumerate(zip(scheduled, num_new_tokens)):
            start = req.num_computed_tokens
            end = start + n
            if n == 1:
                input_ids[pos] = (
                    req.last_token_id if end == req.num_tokens else _token_at(req, start)
                )
            else:
                input_ids[pos : pos + n] = _tokens_between(req, start, end)
            p = np.arange(start, end, dtype=np.int64)
            positions[pos : pos + n] = p
            table = np.asarray(req.block_table, dtype=np.int64)
            slot_mapping[pos : pos + n] = table[p // bs] * bs + p % bs
            seq_lens[i] = end
            block_tables[i, : len(req.block_table)] = req.block_table
            pos += n
            cu_seqlens[i + 1] = pos
        dev = self._to_device
        return ForwardBatch(
            input_ids=dev(input_ids, torch.long),
            positions=dev(positions, torch.long),
            slot_mapping=dev(slot_mapping, torch.long),
            block_tables=dev(block_tables, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            cu_seqlens_q=dev(cu_seqlens, torch.int32),
            logits_indices=dev(_logits_indices(cu_seqlens, all_logits_rows), torch.long),
            is_decode=total == num_seqs,
            max_q_len=int(max(num_new_tokens)),
            max_seq_len=int(seq_lens.max()),
        )

    @torch.inference_mode()
    def execute(
        self,
        scheduled: Sequence[Request],
        num_new_tokens: Sequence[int],
        all_logits_rows: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Run one step; return float32 logits: one row per scheduled request (its
        last token), or, when `all_logits_rows` is given, one row per token of
        those requests and one per other request, in batch order."""
        t0 = time.perf_counter()
        is_decode = all(n == 1 for n in num_new_tokens)
        if is_decode and self.graphs is not None and self.graphs.can_run(len(scheduled)):
            logits = self.graphs.run(scheduled)
        else:
            batch = self.prepare(scheduled, num_new_tokens, all_logits_rows)
            hidden = self.model.forward(batch, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        self.host_time_s += time.perf_counter() - t0
        self.num_steps += 1
        return logits


def _logits_indices(cu_seqlens: np.ndarray, all_rows: frozenset[int]) -> np.ndarray:
    last = cu_seqlens[1:].astype(np.int64) - 1
    if not all_rows:
        return last
    parts = [
        np.arange(cu_seqlens[i], cu_seqlens[i + 1]) if i in all_rows else last[i : i + 1]
        for i in range(len(last))
    ]
    return np.concatenate(parts).astype(np.int64)


def _tokens_between(req: Request, start: int, end: int) -> list[int]:
    n_prompt = req.num_prompt_tokens
    if end <= n_prompt:
        return req.prompt_token_ids[start:end]
    return req.all_token_ids[start:end]


def _token_at(req: Request, i: int) -> int:
    n_prompt = req.num_prompt_tokens
    return req.prompt_token_ids[i] if i < n_prompt else req.output_token_ids[i - n_prompt]
