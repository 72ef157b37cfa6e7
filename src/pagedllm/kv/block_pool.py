"""The pool of KV pages: which page ids are free.

Owns: the free list of page ids `0 .. num_blocks - 1`. Does not own: who holds a
page (the block manager keeps the block tables) or any tensor (the runner holds
K/V; a page id is only an index into its first dimension).

Invariant: every page id is either in the free list exactly once or held by a
caller; freeing a page that is already free raises (a double free).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when more pages are asked for than are free."""


class BlockPool:
    """A free list of page ids: allocate from the front, free to the back.

    Why a queue and not a stack: a fresh pool hands out pages 0, 1, 2, ... in
    order, and freed pages are reused oldest-freed first. That makes block ids
    predictable (tests assert exact ids, as vLLM's CPU tests do) and leaves a
    just-freed page's K/V untouched for as long as possible, which is what a
    prefix cache wants later (vLLM's free queue evicts least recently freed
    first for the same reason). Why a `deque`: both ends are O(1). vLLM uses a
    hand-made doubly linked list instead because a prefix-cache hit must take a
    page out of the *middle* of the free queue in O(1); we have no prefix cache
    yet, so the deque is enough.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # _is_free[i] mirrors "i is in _free", so a double free is caught in O(1).
        self._is_free: list[bool] = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages from the front of the free list."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} pages, only {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return pages to the back of the free list (all or nothing)."""
        block_ids = list(block_ids)
        seen: set[int] = set()
        # Check everything first, so a bad call leaves the pool unchanged.
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"page {block_id} is not in the pool (0..{self.num_blocks - 1})")
            if self._is_free[block_id] or block_id in seen:
                raise ValueError(f"double free of page {block_id}")
            seen.add(block_id)
        for block_id in block_ids:
            self._is_free[block_id] = True
            self._free.append(block_id)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list, front (next to be allocated) first. For tests and printing."""
        return list(self._free)

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and the free flags disagree."""
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a page is in the free list twice")
        flagged = {i for i, free in enumerate(self._is_free) if free}
        if flagged != set(self._free):
            raise AssertionError("free list and free flags disagree")
