"""The block manager: which pages belong to which request, and the prefix cache.

Owns: every request's block table (its page ids in token order; token `i`
lives in page `block_table[i // block_size]`), the only copy of it: the
scheduler hands `block_table(request)` to the runner in each step's plan.
Also owns naming full pages by a hash of their contents (prefix caching).
Does not own: the K/V tensors (runner), the order in which requests run, or
the admission policy (scheduler): it answers "does this fit?" and does it.

Prefix caching: the hash of page j of a request is chained,
`hash(page j-1's hash, the page's token ids)`, so equal hashes mean equal
*prefixes*, not only equal pages: the K/V of a token depends on every token
before it. Only full pages are named, for the step that computes them (see
`cache_pages`). A request
arriving with a prefix whose pages are named shares them (their reference
counts go up) and starts computing after them; it always computes at least its
last token (the logits of the next one come from it).

Invariants (`check_invariants`, after every call in the tests): each page's
reference count equals the number of block tables holding it; no table holds a
page twice; free + held == total; the pool's own invariants hold.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from pagedllm.kv.block_pool import BlockPool
from pagedllm.request import Request
from pagedllm.utils import cdiv


def page_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The name of a full page: 16 bytes of BLAKE2b over the parent page's name
    and this page's token ids (a collision would silently share wrong K/V, so a
    cryptographic hash, not Python's 64-bit `hash`)."""
    return _hash_bytes(parent, array("q", token_ids).tobytes())


def _hash_bytes(parent: bytes | None, page: bytes | memoryview) -> bytes:
    """page_hash of a page given as its ids' int64 bytes."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(page)
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}  # request_id -> page ids in token order
        self._hashes: dict[int, list[bytes]] = {}  # request_id -> names of its first pages
        self._named_upto: dict[int, int] = {}  # request_id -> pages of it already named
        self._peak_used_blocks = 0

    # ------------------------------------------------------------ figures
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Pages no request holds (cached ones included: they are evicted on demand)."""
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
        """Every page a request can ever write: the whole need of the "reserve"
        policy, and the most any request may need (a larger one is rejected).

        The last sampled token is never written to the cache (generation stops
        before it is fed back), hence the -1.
        """
        return self.blocks_for_tokens(request.num_prompt_tokens + request.max_tokens - 1)

    def block_table(self, request: Request) -> list[int]:
        """The request's pages in token order: the manager's own list, read only
        (empty when it holds none)."""
        return self._tables.get(request.request_id, [])

    def block_tables(self, requests: Sequence[Request]) -> list[list[int]]:
        """The tables of requests that hold pages (the manager's own lists, read only)."""
        tables = self._tables
        return [tables[r.request_id] for r in requests]

    def block_ids(self, request: Request) -> list[int]:
        """A copy of the request's block table, for printing and tests."""
        return list(self.block_table(request))

    def holds(self, request: Request) -> bool:
        return request.request_id in self._tables

    @property
    def num_holders(self) -> int:
        """How many requests hold pages."""
        return len(self._tables)

    # -------------------------------------------------------- prefix cache
    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached pages at the start of the request's tokens:
        (their page ids, how many tokens they hold). Stops one token short of the
        end: the last token is always computed. ([], 0) without caching."""
        if not self.enable_caching:
            return [], 0
        max_pages = (request.num_tokens - 1) // self.block_size
        # The first page alone first: a prompt whose first page is not cached
        # (most new prompts) costs one hash here, not one per page.
        if max_pages == 0 or self.pool.lookup(self._hashes_of(request, 1)[0]) is None:
            return [], 0
        hashes = self._hashes_of(request, max_pages)
        hits: list[int] = []
        for block_hash in hashes[:max_pages]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def may_share(self, request: Request, hit: int, unnamed: list[tuple[Request, int]]) -> bool:
        """Whether naming the pages `unnamed` lists (request, tokens) could give
        `request` a longer cached prefix than the `hit` tokens found now. Names
        chain from the first page, so with no hit the first page must equal
        one of theirs."""
        if hit:
            return True
        if request.num_tokens - 1 < self.block_size:
            return False  # no full page to share (the last token is always computed)
        first = self._hashes_of(request, 1)[0]
        return any(n >= self.block_size and self._hashes_of(r, 1)[0] == first for r, n in unnamed)

    def _hashes_of(self, request: Request, num_pages: int) -> list[bytes]:
        """The names of the request's first `num_pages` full pages, each computed
        once and kept until the request's pages are freed (`free`) or, for a
        waiting request, until it is dropped (`forget`)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        first = len(hashes)
        if first < num_pages:
            # The new pages' ids as one buffer, each page a slice of it (a list and
            # an array per page took 80 us for 64 pages, this 66 us).
            bs = self.block_size
            ids = array("q", request.token_ids_between(first * bs, num_pages * bs))
            buf = memoryview(ids).cast("B")
            step = bs * ids.itemsize
            for j in range(num_pages - first):
                parent = hashes[-1] if hashes else None
                hashes.append(_hash_bytes(parent, buf[j * step : (j + 1) * step]))
        return hashes

    def cache_pages(self, request: Request, num_tokens: int) -> list[int]:
        """Name the request's full pages among its first `num_tokens` tokens, so
        later requests can share them; return the pages named by this call.

        The scheduler calls this for the step that computes those tokens, not
        after it ran: once the step is launched (`Scheduler.name_pages`), or
        while planning it when a request admitted later in the same step may
        share them, which is sound because each layer writes every new token's
        K/V before any attention of that layer reads the cache. If the step
        fails, `forget_uncomputed` takes the names back (`Scheduler.undo_step`).
        """
        table = self._tables.get(request.request_id)
        if not self.enable_caching or table is None:
            return []
        rid = request.request_id
        start = self._named_upto.get(rid, 0)  # pages below this were seen already
        num_pages = min(num_tokens // self.block_size, len(table))
        if num_pages <= start:
            return []
        hashes = self._hashes_of(request, num_pages)
        named = []
        for j in range(start, num_pages):
            if self.pool.block_hash[table[j]] is None:
                self.pool.cache(table[j], hashes[j])
                if self.pool.block_hash[table[j]] is not None:
                    named.append(table[j])
        self._named_upto[rid] = num_pages
        return named

    def forget_uncomputed(self, request: Request, named: list[int]) -> None:
        """Take back the names `cache_pages` gave pages whose step failed."""
        self.pool.uncache(named)
        rid = request.request_id
        if rid in self._named_upto:
            done = request.num_computed_tokens // self.block_size
            self._named_upto[rid] = min(self._named_upto[rid], done)

    # ------------------------------------------------------ allocate / free
    def can_admit(self, request: Request, num_tokens: int, cached: list[int]) -> bool:
        """Whether pages for the first `num_tokens` tokens fit, sharing `cached`."""
        fresh = self.blocks_for_tokens(num_tokens) - len(cached)
        revived = sum(self.pool.is_free(b) for b in cached)  # cached pages nobody holds now
        return fresh + revived <= self.pool.num_free

    def admit(self, request: Request, num_tokens: int, cached: list[int]) -> None:
        """Give a request holding nothing the pages for its first `num_tokens`
        tokens: the shared `cached` ones first, then fresh ones."""
        if request.request_id in self._tables:
            raise ValueError(f"request {request.request_id} already holds pages")
        if len(cached) > self.blocks_for_tokens(num_tokens):
            raise ValueError(
                f"request {request.request_id}: {len(cached)} shared pages for "
                f"{num_tokens} tokens; cover at least the cached prefix"
            )
        if not self.can_admit(request, num_tokens, cached):
            raise ValueError(f"request {request.request_id}: its pages do not fit (can_admit?)")
        self.pool.touch(cached)
        fresh = self.pool.allocate(self.blocks_for_tokens(num_tokens) - len(cached))
        self._tables[request.request_id] = list(cached) + fresh
        self._note_peak()

    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's table to cover its first `num_tokens` tokens.

        Returns False (and changes nothing) when the pool lacks the pages.
        Under the "reserve" policy the table already covers every token the
        request can write, so this allocates nothing.
        """
        table = self._tables.get(request.request_id)
        if table is None:
            raise ValueError(f"request {request.request_id} holds no pages (admit it first)")
        needed = -(-num_tokens // self.block_size) - len(table)  # cdiv, inlined: hot
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(needed))
        self._note_peak()
        return True

    def forget(self, request: Request) -> None:
        """Drop what is kept for a request that holds no pages (its page names)."""
        if request.request_id in self._tables:
            raise ValueError(f"request {request.request_id} holds pages; free them")
        self._hashes.pop(request.request_id, None)
        self._named_upto.pop(request.request_id, None)

    def free(self, request: Request) -> None:
        """Drop the request's hold on each of its pages; pages with a name stay cached.

        The last pages go first into the free queue, so that they are evicted
        before the request's first pages, which a later request is likelier to share.
        """
        table = self._tables.pop(request.request_id, None)
        if table is None:
            raise ValueError(f"request {request.request_id} holds no pages")
        self._hashes.pop(request.request_id, None)
        self._named_upto.pop(request.request_id, None)
        self.pool.free(reversed(table) if self.enable_caching else table)

    def _note_peak(self) -> None:
        self._peak_used_blocks = max(self._peak_used_blocks, self.num_used_blocks)

    # ---------------------------------------------------------- integrity
    def check_invariants(self) -> None:
        """Raise AssertionError (never stripped by -O) if the bookkeeping is broken."""
        self.pool.check_invariants()
        holders = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id} holds a page twice: {table}")
            for block_id in table:
                holders[block_id] += 1
        for block_id, n in enumerate(holders):
            if self.pool.ref_counts[block_id] != n:
                raise AssertionError(
                    f"page {block_id} has reference count {self.pool.ref_counts[block_id]} "
                    f"but {n} block tables hold it"
                )
        if not self._named_upto.keys() <= self._tables.keys():
            raise AssertionError("page-naming progress kept for a request holding no pages")
        if self.pool.num_free + sum(n > 0 for n in holders) != self.num_blocks:
            raise AssertionError("free + held pages != total")
