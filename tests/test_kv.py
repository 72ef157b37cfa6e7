"""Page pool and block manager: exact block ids, errors, and a random-walk state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
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
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(request_id: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


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
    pool.check_invariants()


def test_pool_refuses_too_many_and_leaves_pool_unchanged() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError, match="asked for 2 pages, only 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


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
    pool.check_invariants()


def test_pool_rejects_empty_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


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
    bm.allocate(a)  # 8 tokens -> 2 pages
    bm.allocate(b)  # 12 tokens -> 3 pages
    assert a.block_table == [0, 1]
    assert b.block_table == [2, 3, 4]
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.peak_used_blocks) == (1, 5, 5)
    assert not bm.can_allocate(c)  # 12 tokens -> 3 pages, 1 free
    bm.free(a)
    assert a.block_table == []
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.block_table == [5, 0, 1]  # the fresh page first, then the oldest freed
    assert bm.block_ids(c) == [5, 0, 1]
    assert bm.peak_used_blocks == 6
    bm.check_invariants()
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6
    assert bm.peak_used_blocks == 6
    bm.check_invariants()


def test_request_exactly_filling_the_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request(0, 10, 7)  # 16 tokens -> 4 pages
    assert bm.can_allocate(req)
    bm.allocate(req)
    assert req.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_allocate_and_free_misuse() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request(0, 4, 1)
    bm.allocate(req)
    with pytest.raises(ValueError, match="already holds pages"):
        bm.allocate(req)
    bm.free(req)
    with pytest.raises(ValueError, match="holds no pages"):
        bm.free(req)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(make_request(1, 30, 1))
    bm.check_invariants()


def test_append_slots_is_a_no_op_under_the_reservation() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request(0, 5, 4)
    bm.allocate(req)
    assert bm.append_slots(req, 5)  # prefill
    req.num_computed_tokens = 7
    assert bm.append_slots(req, 1)  # the last token ever written (index 7)
    assert req.block_table == [0, 1]
    assert bm.num_used_blocks == 2


def test_append_slots_allocates_as_you_go() -> None:
    """The seam for the optimistic policy: pages appear as tokens need them."""
    bm = BlockManager(num_blocks=3, block_size=4)
    req = make_request(0, 5, 100)
    assert bm.append_slots(req, 5)
    assert req.block_table == [0, 1]
    req.num_computed_tokens = 5
    assert bm.append_slots(req, 3)  # 8 tokens still fit in 2 pages
    assert req.block_table == [0, 1]
    req.num_computed_tokens = 8
    assert bm.append_slots(req, 1)
    assert req.block_table == [0, 1, 2]
    req.num_computed_tokens = 12
    assert not bm.append_slots(req, 1)  # pool dry: the caller would preempt
    assert req.block_table == [0, 1, 2]
    other = make_request(1, 3, 1)
    assert not bm.append_slots(other, 3)
    assert bm.block_ids(other) == []
    bm.check_invariants()
    bm.free(req)
    assert bm.num_free_blocks == 3
    bm.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request(0, 4, 1), make_request(1, 4, 1)
    bm.allocate(a)
    bm.allocate(b)
    bm._block_tables[1] = [0]  # b now claims a's page
    with pytest.raises(AssertionError, match="owned twice"):
        bm.check_invariants()
    bm._block_tables[1] = [2]  # a free page
    with pytest.raises(AssertionError, match="also in the free list"):
        bm.check_invariants()
    bm._block_tables[1] = []  # page 1 leaked: neither free nor owned
    with pytest.raises(AssertionError, match=r"free \(2\) \+ reserved \(1\) != total \(4\)"):
        bm.check_invariants()


# ------------------------------------------------------- random state machine


class BlockManagerMachine(RuleBasedStateMachine):
    """Random reserve / grow / release; the invariants must hold after every call."""

    held = Bundle("held")

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.next_id = 0
        self.live: dict[int, Request] = {}

    def _new_request(self, prompt_len: int, max_tokens: int) -> Request:
        self.next_id += 1
        return make_request(self.next_id, prompt_len, max_tokens)

    @rule(target=held, prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 60))
    def reserve(self, prompt_len: int, max_tokens: int) -> Request | None:
        req = self._new_request(prompt_len, max_tokens)
        free_before = self.bm.num_free_blocks
        if not self.bm.can_allocate(req):
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(req)
            assert self.bm.num_free_blocks == free_before
            return None
        self.bm.allocate(req)
        assert len(req.block_table) == self.bm.reservation_blocks(req)
        assert self.bm.num_free_blocks == free_before - len(req.block_table)
        self.live[req.request_id] = req
        return req

    @rule(target=held, n_tokens=st.integers(1, 40))
    def grow(self, n_tokens: int) -> Request | None:
        req = self._new_request(n_tokens, 1)
        if self.bm.append_slots(req, n_tokens):
            assert len(req.block_table) == self.bm.blocks_for_tokens(n_tokens)
            self.live[req.request_id] = req
            return req
        assert req.block_table == []
        return None

    @rule(req=consumes(held))
    def release(self, req: Request | None) -> None:
        if req is None:
            return
        pages = list(req.block_table)
        self.bm.free(req)
        del self.live[req.request_id]
        assert req.block_table == []
        assert all(self.bm.pool.is_free(p) for p in pages)

    @precondition(lambda self: hasattr(self, "bm"))
    @invariant()
    def bookkeeping_holds(self) -> None:
        self.bm.check_invariants()
        used = sum(len(r.block_table) for r in self.live.values())
        assert used == self.bm.num_used_blocks
        assert self.bm.peak_used_blocks >= self.bm.num_used_blocks

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for req in list(self.live.values()):
            self.bm.free(req)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_manager_machine = BlockManagerMachine.TestCase
