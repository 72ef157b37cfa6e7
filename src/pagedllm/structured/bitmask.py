"""Token bitmasks in torch: the pinned host buffer the matchers fill, and the
masking of a batch's logits (runner side; the only torch in `structured/`).

A row holds `ceil(V / 32)` int32 words for the tokenizer's V ids; bit
`t % 32` of word `t // 32` allows token t. The model's logits may be wider
than the tokenizer (an embedding padded to a multiple of 64 or 128 rows):
under a constraint those extra ids are never allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedllm.structured.matcher import bitmask_words


def allocate_bitmask(batch: int, vocab_size: int, *, pin: bool | None = None) -> Tensor:
    """A (batch, ceil(vocab_size / 32)) int32 CPU buffer, all tokens allowed.

    Pinned when CUDA is available (`pin=None`), so that the copy to the GPU
    after the fill is asynchronous. Allocate it once, at the largest batch,
    and fill the rows of each step's constrained requests.
    """
    if batch < 1 or vocab_size < 1:
        raise ValueError(
            f"a bitmask needs batch >= 1 and vocab_size >= 1, got {batch}, {vocab_size}"
        )
    if pin is None:
        pin = torch.cuda.is_available()
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


_BITS: dict[torch.device, Tensor] = {}


def _bits(device: torch.device) -> Tensor:
    """[1 << 0, ..., 1 << 31] as int32 on `device` (the last is -2**31: the sign bit)."""
    b = _BITS.get(device)
    if b is None:
        ones = torch.ones(32, dtype=torch.int32, device=device)
        b = _BITS[device] = ones.bitwise_left_shift(
            torch.arange(32, dtype=torch.int32, device=device)
        )
    return b


def apply_bitmask(logits: Tensor, bitmask: Tensor, rows: Sequence[int] | Tensor) -> Tensor:
    """Set to -inf, in place, the logits of the tokens each constrained row disallows.

    logits: (B, V_model) on any device; bitmask: (n, words) int32, on the CPU
    (pinned: the copy does not wait) or already on the logits' device, row i
    for logits row `rows[i]`; rows: n distinct indices into logits. Rows not
    named are not touched (bit-identical). Ids past 32 * words (model padding)
    are disallowed. Vectorised: the words are unpacked by one AND against each
    bit's value, no loop over the vocabulary or the rows. Returns `logits`.
    """
    n = len(rows)
    if n == 0:
        return logits
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[0] < n:
        raise ValueError(
            f"bitmask must be (>= {n}, words) int32, got {tuple(bitmask.shape)} {bitmask.dtype}"
        )
    device = logits.device
    vocab = logits.shape[1]
    words = bitmask.shape[1]
    # Only the words that cover the logits' ids; the rest (if the model is narrower
    # than the tokenizer) are ignored.
    used = min(words, bitmask_words(vocab))
    mask = bitmask[:n, :used].to(device, non_blocking=True)
    # One AND with each bit's value, one compare: (n, used, 32) -> (n, 32 * used), in
    # token order (bit b of word w is token 32 w + b). Cheaper than shift, AND, cast.
    allowed = ((mask.unsqueeze(-1) & _bits(device)) != 0).flatten(1)
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:  # padded embedding rows: never allowed under a constraint
        pad = torch.zeros((n, vocab - allowed.shape[1]), dtype=torch.bool, device=device)
        allowed = torch.cat([allowed, pad], dim=1)
    index = torch.as_tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)
    return logits
