"""Page pool and block manager: exact page ids, reference counts, the prefix
cache and its LRU eviction, misuse errors, corruption caught by the invariant
checks, and a random-walk state machine over all of it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedllm.kv import BlockManager, BlockPool, OutOfBlocksError
from pagedllm.kv.block_manager import page_hash
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(request_id: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


def request_with(request_id: int, tokens: Sequence[int], max_tokens: int = 4) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


def reserve(bm: BlockManager, req: Request) -> None:
    """The "reserve" policy: every page the request can ever write, no cache."""
    bm.admit(req, req.num_prompt_tokens + req.max_tokens - 1, [])


def compute(bm: BlockManager, req: Request, num_computed: int) -> list[int]:
    """Plan and run a step computing the request's first `num_computed` tokens:
    its full pages are named (`cache_pages`); return the pages this named."""
    named = bm.cache_pages(req, num_computed)
    req.num_computed_tokens = num_computed
    return named


def chained_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The names of every full page of `tokens`, computed independently."""
    hashes: list[bytes] = []
    for j in range(len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(page_hash(parent, list(tokens[j * block_size : (j + 1) * block_size])))
    return hashes


# ---------------------------------------------------------------- BlockPool


def test_pool_allocates_in_order_and_reuses_oldest_freed_first() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([1, 0])
    assert pool.num_free == 3
    assert pool.free_block_ids() == [5, 1, 0]
    assert pool.allocate(2) == [5, 1]
    assert pool.allocate(0) == []
    assert pool.ref_counts == [0, 1, 1, 1, 1, 1]
    pool.check_invariants()


def test_pool_refuses_too_many_and_leaves_pool_unchanged() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError, match="asked for 2 pages, only 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.free_block_ids() == [2]
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)
    pool.check_invariants()


def test_pool_detects_double_free_atomically() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    pool.free([ids[0]])
    with pytest.raises(ValueError, match="double free of page 0"):
        pool.free([ids[1], ids[0]])
    assert pool.num_free == 2  # page 1 was not freed by the failed call
    with pytest.raises(ValueError, match="double free of page 2"):
        pool.free([2, 2])
    with pytest.raises(ValueError, match="double free of page 3"):
        pool.free([3])  # never allocated
    with pytest.raises(ValueError, match="not in the pool"):
        pool.free([4])
    with pytest.raises(ValueError, match="not in the pool"):
        pool.free([-1])
    assert pool.ref_counts == [0, 1, 1, 0]
    pool.check_invariants()


def test_pool_rejects_empty_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_pool_reference_counts_and_touch() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.touch([0, 1])  # a second holder of each
    assert pool.ref_counts == [2, 2, 0, 0]
    pool.free([0])
    assert pool.ref_counts == [1, 2, 0, 0] and not pool.is_free(0)
    assert pool.free_block_ids() == [2, 3]  # still held: not in the queue
    pool.free([0, 1])
    assert pool.free_block_ids() == [2, 3, 0]
    # A touch of a free page takes it out of the middle of the queue.
    pool.touch([3])
    assert pool.free_block_ids() == [2, 0] and pool.ref_counts == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="double free of page 1"):
        pool.free([1, 1])  # one holder left, two drops asked
    assert pool.ref_counts == [0, 1, 0, 1]
    pool.check_invariants()


def test_pool_cache_names_held_pages_and_eviction_forgets_them() -> None:
    pool = BlockPool(4)
    h, h2 = page_hash(None, [1, 2]), page_hash(None, [3, 4])
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, h)
    assert pool.lookup(h) == 0 and pool.block_hash[0] == h and pool.num_cached == 1
    pool.cache(1, h)  # the same contents computed twice: the first page keeps the name
    assert pool.lookup(h) == 0 and pool.block_hash[1] is None
    pool.cache(0, h2)  # a named page keeps its name
    assert pool.lookup(h2) is None and pool.block_hash[0] == h
    with pytest.raises(ValueError, match="page 2 is free"):
        pool.cache(2, h2)

    pool.free([0, 1])  # a freed page keeps its name: cached and free
    assert pool.lookup(h) == 0 and pool.num_cached == 1 and pool.num_free == 4
    assert pool.free_block_ids() == [2, 3, 0, 1]
    pool.touch([0])  # a cache hit revives it
    assert pool.free_block_ids() == [2, 3, 1] and pool.ref_counts[0] == 1
    pool.free([0])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.allocate(3) == [2, 3, 1]  # the named page is the last to go
    assert pool.lookup(h) == 0 and pool.num_evictions == 0
    assert pool.allocate(1) == [0]  # now it is evicted: its name is forgotten
    assert pool.lookup(h) is None and pool.block_hash[0] is None
    assert pool.num_cached == 0 and pool.num_evictions == 1
    pool.check_invariants()


def test_pool_reset_cache_forgets_only_free_pages() -> None:
    pool = BlockPool(4)
    h0, h1, h2 = (page_hash(None, [i]) for i in range(3))
    assert pool.allocate(3) == [0, 1, 2]
    for page, h in ((0, h0), (1, h1), (2, h2)):
        pool.cache(page, h)
    pool.free([0, 2])
    assert pool.reset_cache() == 2
    assert pool.lookup(h0) is None and pool.lookup(h2) is None
    assert pool.lookup(h1) == 1  # held: keeps its name
    assert pool.free_block_ids() == [3, 0, 2]  # the queue is untouched
    assert pool.num_cached == 1 and pool.num_evictions == 2
    assert pool.reset_cache() == 0
    pool.check_invariants()


def test_pool_check_invariants_catches_corruption() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool.cache(0, page_hash(None, [7]))
    pool.check_invariants()
    pool.ref_counts[2] = 1  # counted as held, but in the free queue
    with pytest.raises(AssertionError, match="page 2 has reference count 1 but is in the free"):
        pool.check_invariants()
    pool.ref_counts[2] = 0
    pool.ref_counts[1] = 0  # counted as free, but not in the free queue
    with pytest.raises(AssertionError, match="page 1 has reference count 0 but is not in"):
        pool.check_invariants()
    pool.ref_counts[1] = -1
    with pytest.raises(AssertionError, match="page 1 has reference count -1"):
        pool.check_invariants()
    pool.ref_counts[1] = 1
    pool.check_invariants()
    h = page_hash(None, [8])
    pool._cached[h] = 1  # the cache names a page by a hash it does not carry
    with pytest.raises(AssertionError, match="names page 1 by a hash it does not have"):
        pool.check_invariants()
    del pool._cached[h]
    pool.block_hash[1] = h  # a hash carried but not in the cache
    with pytest.raises(AssertionError, match="2 pages carry a hash but 1 are cached"):
        pool.check_invariants()


# ------------------------------------------------------------- BlockManager


def test_reservation_counts_every_written_token() -> None:
    bm = BlockManager(num_blocks=10, block_size=16)
    assert [bm.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    # 10 + 7 - 1 = 16 tokens written (the last sampled token never is): one page.
    assert bm.reservation_blocks(make_request(0, 10, 7)) == 1
    assert bm.reservation_blocks(make_request(1, 10, 8)) == 2
    assert bm.reservation_blocks(make_request(2, 1, 1)) == 1


def test_exact_block_tables() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b, c = make_request(0, 5, 4), make_request(1, 9, 4), make_request(2, 8, 5)
    assert bm.block_table(a) == [] and not bm.holds(a) and bm.num_holders == 0
    reserve(bm, a)  # 8 tokens -> 2 pages
    reserve(bm, b)  # 12 tokens -> 3 pages
    assert bm.block_table(a) == [0, 1] and bm.holds(a)
    assert bm.block_table(b) == [2, 3, 4] and bm.num_holders == 2
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.peak_used_blocks) == (1, 5, 5)
    assert not bm.can_admit(c, 12, [])  # 12 tokens -> 3 pages, 1 free
    bm.free(a)
    assert bm.block_table(a) == [] and not bm.holds(a)
    assert bm.pool.free_block_ids() == [5, 0, 1]  # without caching: in table order
    assert bm.can_admit(c, 12, [])
    reserve(bm, c)
    assert bm.block_table(c) == [5, 0, 1]  # the fresh page first, then the oldest freed
    ids = bm.block_ids(c)
    assert ids == [5, 0, 1]
    ids.append(99)  # a copy: the manager's table is untouched
    assert bm.block_table(c) == [5, 0, 1]
    assert bm.peak_used_blocks == 6 and bm.pool.ref_counts == [1] * 6
    # The tables of a plan: the manager's own lists, in the order asked.
    tables = bm.block_tables([c, b])
    assert tables == [[5, 0, 1], [2, 3, 4]] and tables[0] is bm.block_table(c)
    bm.check_invariants()
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6 and bm.num_holders == 0
    assert bm.peak_used_blocks == 6
    bm.check_invariants()


def test_request_exactly_filling_the_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request(0, 10, 7)  # 16 tokens -> 4 pages
    assert bm.reservation_blocks(req) == 4
    assert bm.can_admit(req, 16, [])
    reserve(bm, req)
    assert bm.block_table(req) == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_admit_allocate_and_free_misuse() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request(0, 4, 1)
    reserve(bm, req)
    with pytest.raises(ValueError, match="request 0 already holds pages"):
        bm.admit(req, 4, [])
    big = make_request(1, 30, 1)
    with pytest.raises(ValueError, match="request 1: its pages do not fit"):
        bm.admit(big, 30, [])
    assert not bm.holds(big) and bm.num_free_blocks == 3
    with pytest.raises(ValueError, match=r"request 1 holds no pages \(admit it first\)"):
        bm.allocate_slots(big, 1)
    bm.free(req)
    with pytest.raises(ValueError, match="request 0 holds no pages"):
        bm.free(req)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
    assert bm.pool.ref_counts == [0] * 4
    bm.check_invariants()


def test_admit_with_more_cached_pages_than_tokens_changes_nothing() -> None:
    """A misuse (the scheduler always covers its hit) fails before any change:
    no shared page may gain a holder that no table records."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    a = request_with(0, range(1, 9))
    bm.admit(a, 8, [])
    compute(bm, a, 8)
    b = request_with(1, [*range(1, 9), 50, 51])
    cached, hit = bm.find_cached_prefix(b)
    assert (cached, hit) == ([0, 1], 8)
    counts = list(bm.pool.ref_counts)
    with pytest.raises(ValueError, match="request 1: 2 shared pages for 4 tokens"):
        bm.admit(b, 4, cached)  # 4 tokens: one page, but two shared ones given
    assert not bm.holds(b)
    assert bm.pool.ref_counts == counts
    bm.check_invariants()


def test_allocate_slots_is_a_no_op_under_the_reservation() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request(0, 5, 4)
    reserve(bm, req)
    assert bm.allocate_slots(req, 5)  # prefill
    req.num_computed_tokens = 7
    assert bm.allocate_slots(req, 8)  # the last token ever written (index 7)
    assert bm.block_table(req) == [0, 1]
    assert bm.num_used_blocks == 2


def test_allocate_slots_allocates_as_you_go() -> None:
    """The "optimistic" policy: pages appear as tokens need them."""
    bm = BlockManager(num_blocks=3, block_size=4)
    req = make_request(0, 5, 100)
    bm.admit(req, 5, [])
    assert bm.block_table(req) == [0, 1]
    req.num_computed_tokens = 5
    assert bm.allocate_slots(req, 8)  # 8 tokens still fit in 2 pages
    assert bm.block_table(req) == [0, 1]
    req.num_computed_tokens = 8
    assert bm.allocate_slots(req, 9)
    assert bm.block_table(req) == [0, 1, 2] and bm.peak_used_blocks == 3
    req.num_computed_tokens = 12
    assert not bm.allocate_slots(req, 13)  # pool dry: the caller would preempt
    assert bm.block_table(req) == [0, 1, 2]
    other = make_request(1, 3, 1)
    assert not bm.can_admit(other, 3, [])
    assert bm.block_ids(other) == []
    bm.check_invariants()
    bm.free(req)
    assert bm.num_free_blocks == 3
    bm.admit(other, 0, [])  # a table of no pages (admitted with no tokens yet)
    assert bm.holds(other) and bm.block_table(other) == []
    assert not bm.allocate_slots(other, 13)  # 4 pages > 3: nothing taken
    assert bm.block_table(other) == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(other, 12)
    assert bm.block_table(other) == [0, 1, 2]
    bm.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request(0, 4, 1), make_request(1, 4, 1)
    reserve(bm, a)
    reserve(bm, b)
    bm.check_invariants()
    bm.pool.ref_counts[0] = 2  # a count that disagrees with the tables
    with pytest.raises(AssertionError, match="page 0 has reference count 2 but 1 block tables"):
        bm.check_invariants()
    bm.pool.ref_counts[0] = 1
    bm._tables[1] = [1, 1]  # a page held twice by one table
    with pytest.raises(AssertionError, match=r"request 1 holds a page twice: \[1, 1\]"):
        bm.check_invariants()
    bm._tables[1] = [1, 2]  # a free page in a table
    with pytest.raises(AssertionError, match="page 2 has reference count 0 but 1 block tables"):
        bm.check_invariants()
    bm._tables[1] = [0]  # b now claims a's page (and page 1 leaked)
    with pytest.raises(AssertionError, match="page 0 has reference count 1 but 2 block tables"):
        bm.check_invariants()
    bm._tables[1] = []  # page 1 leaked: held by nobody, not free
    with pytest.raises(AssertionError, match="page 1 has reference count 1 but 0 block tables"):
        bm.check_invariants()
    bm._tables[1] = [1]
    bm.check_invariants()
    bm._named_upto[7] = 1  # naming progress of a request that holds nothing
    with pytest.raises(AssertionError, match="page-naming progress kept for a request"):
        bm.check_invariants()


# ------------------------------------------------------------ prefix cache


def test_page_hash_chains_the_parent() -> None:
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    h0 = page_hash(None, first)
    assert len(h0) == 16 and page_hash(None, first) == h0  # deterministic
    assert page_hash(None, [1, 2, 3, 5]) != h0
    h1 = page_hash(h0, second)
    # The same page under another parent (or none) is another name.
    assert h1 != page_hash(None, second)
    assert h1 != page_hash(page_hash(None, [9, 9, 9, 9]), second)
    assert page_hash(h0, second) == h1
    assert chained_hashes(first + second + [9], 4) == [h0, h1]


def test_no_caching_without_enable_caching() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request(0, 8, 1)
    bm.admit(a, 8, [])
    compute(bm, a, 8)
    assert bm.pool.num_cached == 0
    bm.free(a)
    assert bm.find_cached_prefix(make_request(1, 9, 1)) == ([], 0)


def test_freed_page_with_a_hash_stays_cached_and_is_found_again() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    a = make_request(0, 10, 1)
    bm.admit(a, 10, [])
    assert bm.block_table(a) == [0, 1, 2]
    compute(bm, a, 6)  # one full page computed: only it is named
    assert bm.pool.num_cached == 1
    compute(bm, a, 10)  # two full pages; the third holds only 2 tokens
    hashes = chained_hashes(a.prompt_token_ids, 4)
    assert [bm.pool.block_hash[p] for p in (0, 1, 2)] == [hashes[0], hashes[1], None]
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.pool.num_cached == 2
    assert bm.pool.ref_counts == [0] * 6
    assert bm.find_cached_prefix(make_request(1, 10, 1)) == ([0, 1], 8)
    assert bm.find_cached_prefix(make_request(2, 20, 1)) == ([0, 1], 8)
    bm.check_invariants()


def test_a_whole_cached_prompt_still_computes_its_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request(0, 12, 1)
    bm.admit(a, 12, [])
    compute(bm, a, 12)
    assert bm.pool.num_cached == 3
    # The same 12 tokens: at most 11 may come from the cache, in whole pages: 8.
    assert bm.find_cached_prefix(make_request(1, 12, 1)) == ([0, 1], 8)
    assert bm.find_cached_prefix(make_request(2, 13, 1)) == ([0, 1, 2], 12)
    assert bm.find_cached_prefix(make_request(3, 9, 1)) == ([0, 1], 8)
    assert bm.find_cached_prefix(make_request(4, 8, 1)) == ([0], 4)
    assert bm.find_cached_prefix(make_request(5, 5, 1)) == ([0], 4)
    assert bm.find_cached_prefix(make_request(6, 4, 1)) == ([], 0)
    assert bm.find_cached_prefix(make_request(7, 1, 1)) == ([], 0)
    # Output tokens count: a request with 8 prompt tokens and 1 output token may hit 8.
    b = make_request(8, 8, 4)
    b.append_output_token(9)
    assert bm.find_cached_prefix(b) == ([0, 1], 8)


def test_the_cache_matches_prefixes_not_pages() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = request_with(0, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.admit(a, 9, [])
    compute(bm, a, 9)
    # Same second page, another first page: no hit at all.
    b = request_with(1, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.find_cached_prefix(b) == ([], 0)
    bm.admit(b, 9, [])
    assert bm.block_table(b) == [3, 4, 5]
    compute(bm, b, 9)
    assert bm.pool.num_cached == 4  # b's second page has its own name
    assert bm.pool.block_hash[1] != bm.pool.block_hash[4]
    # Same first page, another second: the first page only.
    c = request_with(2, [1, 2, 3, 4, 5, 6, 7, 9, 0])
    assert bm.find_cached_prefix(c) == ([0], 4)
    bm.check_invariants()


def test_reference_counts_when_two_requests_share_cached_pages() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request(0, 10, 1)
    bm.admit(a, 10, [])
    compute(bm, a, 10)  # pages 0 and 1 named; page 2 holds 2 tokens
    b = request_with(1, [*a.prompt_token_ids[:8], 90, 91, 92])
    cached, hit = bm.find_cached_prefix(b)
    assert (cached, hit) == ([0, 1], 8)
    assert bm.can_admit(b, 11, cached)  # one fresh page
    bm.admit(b, 11, cached)
    assert bm.block_table(b) == [0, 1, 3]
    assert bm.pool.ref_counts == [2, 2, 1, 1, 0, 0, 0, 0]
    assert bm.num_used_blocks == 4  # shared pages count once
    bm.check_invariants()

    bm.free(a)  # b still holds the shared pages
    assert bm.pool.ref_counts == [1, 1, 0, 1, 0, 0, 0, 0]
    assert bm.pool.free_block_ids() == [4, 5, 6, 7, 2]
    compute(bm, b, 11)  # names nothing new: b's pages 0, 1 already have names
    assert bm.pool.num_cached == 2
    bm.free(b)  # last pages first: b's page 3, then the shared 1 and 0
    assert bm.pool.ref_counts == [0] * 8
    assert bm.pool.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    bm.check_invariants()

    # Cached and free: a third request revives them out of the middle of the queue.
    c = request_with(2, [*a.prompt_token_ids[:8], 70])
    cached, hit = bm.find_cached_prefix(c)
    assert (cached, hit) == ([0, 1], 8)
    # Reviving a free cached page costs a free page: 2 revived + 1 fresh.
    assert bm.can_admit(c, 9, cached)
    bm.admit(c, 9, cached)
    assert bm.block_table(c) == [0, 1, 4]
    assert bm.pool.free_block_ids() == [5, 6, 7, 2, 3]
    assert bm.pool.ref_counts == [1, 1, 0, 0, 1, 0, 0, 0]
    bm.check_invariants()


def test_can_admit_counts_revived_cached_pages() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_request(0, 8, 1)
    bm.admit(a, 8, [])
    compute(bm, a, 8)
    b = make_request(1, 9, 8)
    cached, _ = bm.find_cached_prefix(b)
    assert cached == [0, 1]
    # a holds the shared pages: b needs 2 fresh pages for 16 tokens, 2 are free.
    assert bm.can_admit(b, 16, cached) and not bm.can_admit(b, 17, cached)
    bm.free(a)
    # Nobody holds them now: reviving them takes 2 of the 4 free pages.
    assert bm.can_admit(b, 16, cached) and not bm.can_admit(b, 17, cached)
    bm.admit(b, 16, cached)
    assert bm.block_table(b) == [0, 1, 2, 3] and bm.num_free_blocks == 0
    bm.check_invariants()


def test_lru_eviction_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a, b = request_with(0, [1, 2, 3]), request_with(1, [5, 6, 7])
    for req in (a, b):
        bm.admit(req, 3, [])
        compute(bm, req, 3)
    assert (bm.block_table(a), bm.block_table(b)) == ([0, 1], [2, 3])
    bm.free(a)
    bm.free(b)
    assert bm.pool.free_block_ids() == [1, 0, 3, 2]
    # a was freed first: its pages go first (its anonymous half page before its named one).
    x = request_with(2, [9, 9, 9])
    bm.admit(x, 2, [])
    assert bm.block_table(x) == [1]
    assert bm.find_cached_prefix(a) == ([0], 2) and bm.pool.num_evictions == 0
    assert bm.allocate_slots(x, 4) and bm.block_table(x) == [1, 0]
    assert bm.find_cached_prefix(a) == ([], 0) and bm.pool.num_evictions == 1
    assert bm.find_cached_prefix(b) == ([2], 2)  # b's named page survives
    bm.check_invariants()


def test_lru_eviction_takes_a_requests_last_pages_before_its_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    a = make_request(0, 12, 1)
    bm.admit(a, 12, [])
    compute(bm, a, 12)
    bm.free(a)
    assert bm.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    probe = make_request(1, 13, 1)
    assert bm.find_cached_prefix(probe) == ([0, 1, 2], 12)
    x = request_with(2, [50] * 12)
    bm.admit(x, 12, [])  # the three never-used pages go first
    assert bm.block_table(x) == [3, 4, 5]
    assert bm.find_cached_prefix(probe) == ([0, 1, 2], 12)
    assert bm.allocate_slots(x, 13)  # evicts a's last page
    assert bm.block_table(x) == [3, 4, 5, 2]
    assert bm.find_cached_prefix(probe) == ([0, 1], 8)
    assert bm.allocate_slots(x, 17)
    assert bm.find_cached_prefix(probe) == ([0], 4)
    assert bm.pool.num_evictions == 2
    bm.check_invariants()


def test_cache_pages_names_each_full_page_once_and_forget_takes_them_back() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    a = make_request(0, 12, 1)
    bm.admit(a, 12, [])
    hashes = chained_hashes(a.prompt_token_ids, 4)
    probe = make_request(1, 13, 1)
    # Named when the step computing them is planned, before their K/V exists.
    assert bm.cache_pages(a, 7) == [0]  # one full page among 7 tokens
    assert bm.cache_pages(a, 8) == [1]
    assert bm.cache_pages(a, 8) == []  # seen already
    assert bm.find_cached_prefix(probe) == ([0, 1], 8)
    # That step failed: a computed nothing; both names are taken back.
    bm.forget_uncomputed(a, [0, 1])
    assert bm.pool.num_cached == 0 and bm.find_cached_prefix(probe) == ([], 0)
    assert bm.cache_pages(a, 12) == [0, 1, 2]  # planned again, named again
    assert [bm.pool.block_hash[p] for p in (0, 1, 2)] == hashes
    # A later step fails after the first page was computed: only it keeps its name.
    a.num_computed_tokens = 4
    bm.forget_uncomputed(a, [1, 2])
    assert [bm.pool.block_hash[p] for p in (0, 1, 2)] == [hashes[0], None, None]
    assert bm.find_cached_prefix(probe) == ([0], 4)
    assert bm.cache_pages(a, 12) == [1, 2]
    bm.check_invariants()
    # Nothing to name: no caching, or a request holding no pages.
    assert bm.cache_pages(probe, 12) == []
    plain = BlockManager(num_blocks=4, block_size=4)
    b = make_request(2, 8, 1)
    plain.admit(b, 8, [])
    assert plain.cache_pages(b, 8) == [] and plain.pool.num_cached == 0


def test_two_requests_computing_the_same_page_the_first_keeps_the_name() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    a, b = make_request(0, 5, 1), make_request(1, 5, 1)
    bm.admit(a, 5, [])
    bm.admit(b, 5, [])  # both arrived before either computed anything
    assert (bm.block_table(a), bm.block_table(b)) == ([0, 1], [2, 3])
    assert compute(bm, a, 5) == [0]
    assert compute(bm, b, 5) == []  # page 2 holds the same prefix: stays anonymous
    assert bm.pool.block_hash[2] is None and bm.pool.num_cached == 1
    bm.free(b)
    bm.free(a)
    assert bm.find_cached_prefix(make_request(2, 5, 1)) == ([0], 4)
    bm.check_invariants()


def test_pool_uncache_forgets_a_name() -> None:
    pool = BlockPool(3)
    h = page_hash(None, [1])
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, h)
    pool.uncache([1])  # anonymous: nothing to forget
    assert pool.lookup(h) == 0
    pool.uncache([0])
    assert pool.lookup(h) is None and pool.block_hash[0] is None
    assert pool.num_evictions == 0
    pool.cache(1, h)  # the name is free for another page now
    assert pool.lookup(h) == 1
    pool.check_invariants()


def test_reset_cache_forgets_free_pages_held_ones_stay() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    a = make_request(0, 9, 1)
    bm.admit(a, 9, [])
    compute(bm, a, 9)
    b = request_with(1, [50, 51, 52, 53, 54])
    bm.admit(b, 5, [])
    compute(bm, b, 5)
    bm.free(a)
    assert bm.pool.num_cached == 3
    assert bm.pool.reset_cache() == 2  # a's two pages; b's is held
    assert bm.find_cached_prefix(make_request(2, 9, 1)) == ([], 0)
    assert bm.find_cached_prefix(request_with(3, [50, 51, 52, 53, 0])) == ([3], 4)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


# ------------------------------------------------------- random state machine

PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 13, 14, 15, 16], [17] * 12)


class BlockManagerMachine(RuleBasedStateMachine):
    """Admit requests that share prefixes (so the cache hits), grow them, compute
    and name their pages (or fail the step and take the names back), free them,
    reset the cache; the bookkeeping must agree with a model after every call.

    The model keeps, for every page, the K/V 'written' in each slot: the whole
    token prefix up to that position. Sharing a page, naming it, or reviving a
    cached one must never disagree with that.
    """

    held = Bundle("held")

    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 4]),
        enable_caching=st.booleans() | st.just(True),
    )
    def setup(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_caching=enable_caching)
        self.next_id = 0
        self.live: dict[int, Request] = {}
        # page -> slot contents; a slot holds the token prefix whose K/V it has.
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}

    # ---------------------------------------------------------------- model
    def _prefix_of_page(self, tokens: Sequence[int], j: int) -> list[tuple[int, ...]]:
        bs = self.bm.block_size
        return [tuple(tokens[: p + 1]) for p in range(j * bs, (j + 1) * bs)]

    def _write(self, req: Request, start: int, stop: int) -> None:
        """Compute positions [start, stop): write their K/V into the request's pages."""
        bs, table, tokens = self.bm.block_size, self.bm.block_table(req), req.all_token_ids
        for pos in range(start, stop):
            page = table[pos // bs]
            # Nobody else may see this page, and it has no name yet.
            assert self.bm.pool.ref_counts[page] == 1, f"writing into shared page {page}"
            assert self.bm.pool.block_hash[page] is None, f"writing into named page {page}"
            self.kv.setdefault(page, [None] * bs)[pos % bs] = tuple(tokens[: pos + 1])

    # ---------------------------------------------------------------- rules
    @rule(
        target=held,
        prefix=st.sampled_from(range(len(PREFIXES))),
        prefix_len=st.sampled_from([4, 8, 12]) | st.integers(0, 12),
        suffix=st.lists(st.integers(20, 22), max_size=6),
        max_tokens=st.integers(1, 12),
        policy=st.sampled_from(["reserve", "optimistic"]),
        chunk=st.integers(0, 30),
    )
    def admit(
        self,
        prefix: int,
        prefix_len: int,
        suffix: list[int],
        max_tokens: int,
        policy: str,
        chunk: int,
    ) -> Request | None:
        tokens = PREFIXES[prefix][:prefix_len] + suffix
        if not tokens:
            return None
        self.next_id += 1
        req = request_with(self.next_id, tokens, max_tokens)
        bm, pool, bs = self.bm, self.bm.pool, self.bm.block_size
        cached, hit = bm.find_cached_prefix(req)
        assert hit == len(cached) * bs and hit <= req.num_tokens - 1
        assert len(set(cached)) == len(cached)
        if not bm.enable_caching:
            assert (cached, hit) == ([], 0)
        expected = chained_hashes(tokens, bs)
        for j, page in enumerate(cached):
            # A hit is a page named by this prefix, holding this prefix's K/V.
            assert pool.block_hash[page] == expected[j]
            assert self.kv[page] == self._prefix_of_page(tokens, j)
        if hit:
            event("prefix cache hit")
            if any(pool.ref_counts[p] == 0 for p in cached):
                event("prefix cache hit on a free page")
        if policy == "reserve":
            cover = req.num_prompt_tokens + max_tokens - 1
        else:
            cover = hit + min(chunk, req.num_tokens - hit)
        fresh = bm.blocks_for_tokens(cover) - len(cached)
        revived = sum(pool.ref_counts[p] == 0 for p in cached)
        fits = fresh + revived <= bm.num_free_blocks
        assert bm.can_admit(req, cover, cached) == fits
        counts, free_before = list(pool.ref_counts), bm.num_free_blocks
        if not fits:
            with pytest.raises(ValueError, match="do not fit"):
                bm.admit(req, cover, cached)
            assert pool.ref_counts == counts and not bm.holds(req)
            event("does not fit")
            return None
        bm.admit(req, cover, cached)
        table = bm.block_table(req)
        assert table[: len(cached)] == cached
        assert len(table) == bm.blocks_for_tokens(cover)
        assert bm.num_free_blocks == free_before - fresh - revived
        for page in cached:
            assert pool.ref_counts[page] == counts[page] + 1
        for page in table[len(cached) :]:
            assert counts[page] == 0 and pool.ref_counts[page] == 1
            assert pool.block_hash[page] is None  # a fresh page has no name
        req.num_computed_tokens = hit
        self.live[req.request_id] = req
        return req

    @rule(
        req=held,
        n=st.integers(1, 12) | st.just(40),
        token=st.integers(20, 22),
        fails=st.booleans(),
    )
    def compute_tokens(self, req: Request | None, n: int, token: int, fails: bool) -> None:
        """Plan a step of up to `n` more tokens (grow the table, name the pages
        it fills), then either run it (write the K/V; when every token is
        computed, 'sample' one more) or fail it (take the names back)."""
        if req is None or req.request_id not in self.live:
            return
        if req.num_output_tokens >= req.max_tokens:
            return  # finished: only a free is left
        bm, pool, bs = self.bm, self.bm.pool, self.bm.block_size
        start = req.num_computed_tokens
        stop = min(start + n, req.num_tokens)
        table_before = bm.block_ids(req)
        free_before = bm.num_free_blocks
        if not bm.allocate_slots(req, stop):
            assert bm.block_table(req) == table_before and bm.num_free_blocks == free_before
            assert bm.blocks_for_tokens(stop) - len(table_before) > free_before
            event("allocate_slots: pool dry")
            return
        table = bm.block_table(req)
        assert table[: len(table_before)] == table_before
        assert len(table) == max(len(table_before), bm.blocks_for_tokens(stop))
        assert len(table) <= bm.reservation_blocks(req)
        names_before = list(pool.block_hash)
        if fails:
            named = bm.cache_pages(req, stop)
            bm.forget_uncomputed(req, named)
            # Every name this step gave is taken back; older names stay.
            assert pool.block_hash == names_before
            if named:
                event("a failed step's names taken back")
            return
        self._write(req, start, stop)
        named = bm.cache_pages(req, stop)
        req.num_computed_tokens = stop
        assert named == [p for p in table if names_before[p] is None and pool.block_hash[p]]
        if bm.enable_caching:
            expected = chained_hashes(req.all_token_ids, bs)
            # Every page this step filled is named by its prefix, or stays
            # anonymous because another page had the name first.
            for j in range(start // bs, stop // bs):
                name = pool.block_hash[table[j]]
                assert name == expected[j] or (
                    name is None and pool.lookup(expected[j]) not in (None, table[j])
                )
        else:
            assert named == [] and pool.num_cached == 0
        if stop == req.num_tokens:
            req.append_output_token(token)

    @rule(req=consumes(held))
    def release(self, req: Request | None) -> None:
        if req is None:
            return
        bm = self.bm
        pages = bm.block_ids(req)
        queue_before = bm.pool.free_block_ids()
        bm.free(req)
        del self.live[req.request_id]
        assert not bm.holds(req) and bm.block_table(req) == []
        dropped = [p for p in pages if bm.pool.ref_counts[p] == 0]
        # Pages nobody holds now join the back of the queue: last pages first with caching.
        order = list(reversed(dropped)) if bm.enable_caching else dropped
        assert bm.pool.free_block_ids() == queue_before + order

    @rule()
    def reset_cache(self) -> None:
        pool = self.bm.pool
        free_named = sum(pool.block_hash[p] is not None for p in pool.free_block_ids())
        held_named = pool.num_cached - free_named
        assert pool.reset_cache() == free_named
        assert pool.num_cached == held_named

    # ------------------------------------------------------------ invariants
    @precondition(lambda self: hasattr(self, "bm"))
    @invariant()
    def bookkeeping_holds(self) -> None:
        bm, pool = self.bm, self.bm.pool
        bm.check_invariants()
        if pool.num_evictions:
            event("a cached page was evicted")
        holders = [0] * bm.num_blocks
        for req in self.live.values():
            table = bm.block_table(req)
            assert bm.blocks_for_tokens(req.num_computed_tokens) <= len(table)
            for page in table:
                holders[page] += 1
        assert pool.ref_counts == holders
        assert bm.num_holders == len(self.live)
        assert bm.num_used_blocks == sum(n > 0 for n in holders)
        assert bm.peak_used_blocks >= bm.num_used_blocks
        # Every name in the cache points at a page that holds that prefix's K/V.
        for name, page in pool._cached.items():
            assert pool.lookup(name) == page and pool.block_hash[page] == name
            slots = self.kv.get(page)
            assert slots is not None and all(s is not None for s in slots)
            last = slots[-1]
            assert last is not None
            assert chained_hashes(last, bm.block_size)[-1] == name
            assert slots == self._prefix_of_page(last, len(last) // bm.block_size - 1)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        for req in list(self.live.values()):
            bm.free(req)
        bm.check_invariants()
        # Cached pages count as free: every page is free, every count zero.
        assert bm.num_free_blocks == bm.num_blocks and bm.num_holders == 0
        assert bm.pool.ref_counts == [0] * bm.num_blocks
        assert sorted(bm.pool.free_block_ids()) == list(range(bm.num_blocks))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, report_multiple_bugs=False
)
test_block_manager_machine = BlockManagerMachine.TestCase
