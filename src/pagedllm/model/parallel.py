"""Tensor parallelism (Megatron-style): which slice of each weight a rank holds,
and the two collectives that put the slices' results back together.

With N ranks, rank r holds:
- q/k/v (column-parallel): query heads [r H/N, (r+1) H/N) and KV heads
  [r Hkv/N, (r+1) Hkv/N), so attention and its KV pages are local: each rank
  caches only its Hkv/N heads, under the same block tables as every other;
- o_proj (row-parallel): the input columns of those query heads; each rank's
  product is a partial sum, all-reduced to the whole (T, E);
- gate/up (column-parallel): rows [r I/N, (r+1) I/N) of gate and of up, so
  SwiGLU is local; down (row-parallel): those input columns, then all-reduce;
- the embedding and the LM head (vocabulary-parallel): ids [r Vp, (r+1) Vp),
  Vp = ceil(V/N), zero rows padding the last rank. A rank embeds the ids it
  holds and zeros for the rest, and an all-reduce sums the rows; the LM head
  gives each rank its Vp logits, and an all-gather puts the V back together;
- the norms: all of them (they are tiny).

Two all-reduces per layer, plus one for the embedding and one all-gather for
the logits. The local config (`shard_config`) has H/N, Hkv/N and I/N, so the
forward pass reads the same as on one device.

Owns: `TensorParallel` (rank, size, process group), the slicing of each HF
weight (`shard_weight`), the local config, and the collectives. Does not own:
starting processes or the process group (`runner/tp_workers.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among `size` ranks; `group`: the torch.distributed
    process group of the collectives (None: the default group)."""

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.size - 1}")

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary this rank embeds and scores (Vp rows each;
        the last rank's may run past V: those rows are zeros)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, (self.rank + 1) * per

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (each rank passes its own)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `t` into every rank's `t` (same shape and dtype), in place."""
        import torch.distributed as dist

        dist.broadcast(t, src=src, group=self.group)
        return t

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(N, Vp) logits of each rank -> (N, V), every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def check_divisible(config: ModelConfig, size: int) -> None:
    """ValueError unless `size` ranks can split the model's heads and MLP evenly."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    for what, n in (
        ("query heads (num_attention_heads)", config.num_attention_heads),
        ("KV heads (num_key_value_heads)", config.num_key_value_heads),
        ("MLP width (intermediate_size)", config.intermediate_size),
    ):
        if n % size:
            ok = [d for d in range(1, config.num_key_value_heads + 1) if _splits(config, d)]
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {n} {what}; "
                f"choose one of {', '.join(map(str, ok))}"
            )


def _splits(config: ModelConfig, size: int) -> bool:
    return not (
        config.num_attention_heads % size
        or config.num_key_value_heads % size
        or config.intermediate_size % size
    )


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's forward sees: H/N, Hkv/N and I/N (vocab and hidden size
    are the model's: the logits are gathered whole, the hidden state is replicated)."""
    check_divisible(config, size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


# HF weight name (its last two parts) -> how it is split: "rows" (output
# features, column-parallel), "cols" (input features, row-parallel), "vocab"
# (rows, padded), or None (replicated).
_SPLIT = {
    "q_proj.weight": "rows",
    "k_proj.weight": "rows",
    "v_proj.weight": "rows",
    "q_proj.bias": "rows",  # Qwen2: each rank adds its heads' biases
    "k_proj.bias": "rows",
    "v_proj.bias": "rows",
    "o_proj.weight": "cols",
    "gate_proj.weight": "rows",
    "up_proj.weight": "rows",
    "down_proj.weight": "cols",
    "embed_tokens.weight": "vocab",
    "lm_head.weight": "vocab",
}


def sharded_shape(name: str, shape: tuple[int, ...], tp: TensorParallel) -> tuple[int, ...]:
    """The shape `shard_weight` gives weight `name` of the whole `shape`."""
    how = _SPLIT.get(".".join(name.split(".")[-2:]))
    if how is None or tp.size == 1:
        return shape
    if how == "rows":
        return (shape[0] // tp.size, *shape[1:])
    if how == "cols":
        return (shape[0], shape[1] // tp.size)
    start, end = tp.vocab_rows(shape[0])
    return (end - start, *shape[1:])


def shard_weight(name: str, t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of HF weight `name` (a view where it can be: a memory-mapped
    file then reads only the slice's bytes)."""
    how = _SPLIT.get(".".join(name.split(".")[-2:]))
    if how is None or tp.size == 1:
        return t
    r, n = tp.rank, tp.size
    if how == "rows":
        per = t.shape[0] // n
        return t[r * per : (r + 1) * per]
    if how == "cols":
        per = t.shape[1] // n
        return t[:, r * per : (r + 1) * per]
    start, end = tp.vocab_rows(t.shape[0])
    part = t[start : min(end, t.shape[0])]
    if part.shape[0] < end - start:  # the last rank: pad with zero rows
        pad = torch.zeros(end - start - part.shape[0], t.shape[1], dtype=t.dtype)
        part = torch.cat([part, pad.to(t.device)])
    return part
