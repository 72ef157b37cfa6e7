"""The pool of KV pages: reference counts, the free queue and the prefix cache.

Owns: for every page id `0 .. num_blocks - 1`, how many block tables hold it
(its reference count), the queue of pages nobody holds, and which full pages
are known by the hash of their contents (the prefix cache). Does not own: who
holds a page (the block manager keeps the block tables) or any tensor (the
runner holds K/V; a page id is only an index into its first dimension).

A page is in one of three states:

- held: reference count >= 1, in one or more block tables;
- free and cached: count 0, but its hash is known, so its K/V can be reused
  by a request with the same prefix until the page is needed for something
  else (then it is *evicted*: its hash forgotten);
- free: count 0, no hash.

Free pages (cached or not) wait in one queue: `allocate` takes from the front
(the least recently freed, so cached pages live as long as possible: LRU), and
`free` puts a page at the back when its count drops to zero. A prefix-cache
hit on a free page takes it out of the middle of the queue: an `OrderedDict`
does both in O(1) (vLLM hand-builds a doubly linked list for the same reason).

Invariants (`check_invariants`): a page is in the free queue exactly when its
count is 0; `_cached` maps each hash to a page whose recorded hash is that
hash; freeing a page whose count is already 0 raises (a double free).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when more pages are asked for than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # Free pages in eviction order (front first); the values are unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> page holding that content
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages with no holder (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages whose contents are known by hash (held or free)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages from the front of the free queue (evicting cached ones)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} pages, only {len(self._free)} free")
        block_ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each page (a prefix-cache hit); a free page leaves the queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each page (all or nothing); a page nobody holds
        goes to the back of the free queue, keeping its hash (still cached)."""
        block_ids = list(block_ids)
        drops: dict[int, int] = {}
        # Check everything first, so a bad call leaves the pool unchanged.
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"page {block_id} is not in the pool (0..{self.num_blocks - 1})")
            drops[block_id] = drops.get(block_id, 0) + 1
            if drops[block_id] > self.ref_counts[block_id]:
                raise ValueError(f"double free of page {block_id}")
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    # ---------------------------------------------------------- the cache
    def lookup(self, block_hash: bytes) -> int | None:
        """The page holding the contents named `block_hash`, if it is still cached."""
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Name a held, full page by its contents' hash. When another page has
        that name already (two requests computed the same page at once), the
        first keeps it and this page stays anonymous."""
        if self.ref_counts[block_id] < 1:
            raise ValueError(f"page {block_id} is free; only a held page can be cached")
        if self.block_hash[block_id] is not None or block_hash in self._cached:
            return
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    def uncache(self, block_ids: list[int]) -> None:
        """Forget the names of these pages (their K/V was never completed)."""
        for block_id in block_ids:
            block_hash = self.block_hash[block_id]
            if block_hash is not None and self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
            self.block_hash[block_id] = None

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hash[block_id] = None
            self.num_evictions += 1

    def reset_cache(self) -> int:
        """Forget every free page's hash (held pages keep theirs); return how many."""
        n = 0
        for block_id in self._free:
            if self.block_hash[block_id] is not None:
                self._evict(block_id)
                n += 1
        return n

    # ------------------------------------------------------------ queries
    def is_free(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first. For tests and printing."""
        return list(self._free)

    def check_invariants(self) -> None:
        """Raise AssertionError if the counts, the free queue and the cache disagree."""
        for block_id, count in enumerate(self.ref_counts):
            if count < 0:
                raise AssertionError(f"page {block_id} has reference count {count}")
            if (count == 0) != (block_id in self._free):
                raise AssertionError(
                    f"page {block_id} has reference count {count} but is "
                    f"{'' if block_id in self._free else 'not '}in the free queue"
                )
        for block_hash, block_id in self._cached.items():
            if self.block_hash[block_id] != block_hash:
                raise AssertionError(f"the cache names page {block_id} by a hash it does not have")
        named = sum(h is not None for h in self.block_hash)
        if named != len(self._cached):
            raise AssertionError(f"{named} pages carry a hash but {len(self._cached)} are cached")
