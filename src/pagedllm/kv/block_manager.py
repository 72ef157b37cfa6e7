"""The block manager: which pages belong to which request.

Owns: the page budget and every request's block table (its page ids in token
order; token `i` lives in page `block_table[i // block_size]`). Does not own:
the K/V tensors (runner), the order in which requests run (scheduler).

Policy (conservative, the default; see docs/architecture.md): a request reserves at
admission every page it can ever write, so a running request never runs out of
pages and nothing is ever half-admitted. `append_slots` is the seam for a later
optimistic policy (allocate as you go, preempt when the pool runs dry).

Invariants, checked by `check_invariants()` after every call in the tests:
`free + sum(reserved) == total`; no page is owned twice; no page is both free
and owned.
"""

from __future__ import annotations

from pagedllm.kv.block_pool import BlockPool
from pagedllm.request import Request
from pagedllm.utils import cdiv


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # request_id -> page ids in token order. The manager's record is the
        # truth; `request.block_table` is a copy handed to the request.
        self._block_tables: dict[int, list[int]] = {}
        self._peak_used_blocks = 0

    # ------------------------------------------------------------ figures
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def peak_used_blocks(self) -> int:
        return self._peak_used_blocks

    def blocks_for_tokens(self, n_tokens: int) -> int:
        """Pages needed to hold `n_tokens` tokens of K/V."""
        return cdiv(n_tokens, self.block_size)

    def reservation_blocks(self, request: Request) -> int:
        """Pages a request reserves at admission under the conservative policy.

        The last sampled token is never written to the cache (generation stops
        before it is fed back), hence the -1.
        """
        return self.blocks_for_tokens(request.num_prompt_tokens + request.max_tokens - 1)

    def block_ids(self, request: Request) -> list[int]:
        """The pages the manager records for `request` (a copy; empty if none)."""
        return list(self._block_tables.get(request.request_id, ()))

    # ---------------------------------------------------- reserve / release
    def can_allocate(self, request: Request) -> bool:
        return self.reservation_blocks(request) <= self.pool.num_free

    def allocate(self, request: Request) -> None:
        """Reserve all of `request`'s pages and fill its block table, in token order."""
        if request.request_id in self._block_tables:
            raise ValueError(f"request {request.request_id} already holds pages")
        block_ids = self.pool.allocate(self.reservation_blocks(request))
        self._block_tables[request.request_id] = block_ids
        request.block_table = list(block_ids)
        self._note_peak()

    def free(self, request: Request) -> None:
        """Return every page of `request` to the pool and clear its block table."""
        block_ids = self._block_tables.pop(request.request_id, None)
        if block_ids is None:
            raise ValueError(f"request {request.request_id} holds no pages")
        self.pool.free(block_ids)
        request.block_table = []

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make the block table cover `num_computed_tokens + num_new_tokens` tokens.

        Returns False (and changes nothing) when the pool lacks the missing
        pages. Under the conservative policy the reservation already covers
        every token, so this allocates nothing and returns True; an optimistic
        policy admits with `append_slots(request, num_prompt_tokens)` and
        preempts when this returns False.
        """
        table = self._block_tables.setdefault(request.request_id, [])
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            if not table:
                del self._block_tables[request.request_id]
            return False
        table.extend(self.pool.allocate(needed))
        request.block_table = list(table)
        self._note_peak()
        return True

    def _note_peak(self) -> None:
        self._peak_used_blocks = max(self._peak_used_blocks, self.num_used_blocks)

    # ---------------------------------------------------------- integrity
    def check_invariants(self) -> None:
        """Raise AssertionError (never stripped by -O) if the bookkeeping is broken."""
        self.pool.check_invariants()
        owned: set[int] = set()
        for request_id, block_ids in self._block_tables.items():
            for block_id in block_ids:
                if block_id in owned:
                    raise AssertionError(f"page {block_id} is owned twice")
                if self.pool.is_free(block_id):
                    raise AssertionError(
                        f"page {block_id} of request {request_id} is also in the free list"
                    )
                owned.add(block_id)
        if self.pool.num_free + len(owned) != self.num_blocks:
            raise AssertionError(
                f"free ({self.pool.num_free}) + reserved ({len(owned)}) "
                f"!= total ({self.num_blocks})"
            )
