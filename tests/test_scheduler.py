"""Scheduler: exact plans on small scenarios, stops, rejections, and a random state machine.

A fake model stands in for the forward pass: its next token is a pure function
of the sequence so far, like a greedy model's, so batching must not change it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv import BlockManager
from pagedllm.request import FinishReason, Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import (
    BATCHING_CHOICES,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 2
VOCAB = 16


def make_request(
    request_id: int,
    prompt_len: int,
    max_tokens: int,
    *,
    eos: bool = False,
    params: Any = None,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=[(request_id * 13 + i) % VOCAB + 3 for i in range(prompt_len)],
        sampling_params=params if params is not None else SamplingParams(max_tokens=max_tokens),
        eos_token_ids=frozenset({EOS}) if eos else frozenset(),
    )


def make_scheduler(
    num_blocks: int,
    block_size: int = 4,
    *,
    batching: str = "continuous",
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        batching=batching,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


def next_token(token_ids: Sequence[int]) -> int:
    """A deterministic 'greedy model': the next token depends only on the sequence."""
    h = 0
    for t in token_ids:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return h % VOCAB


def fake_forward(scheduler: Scheduler, out: SchedulerOutput) -> list[int | None]:
    """Check the plan the way the runner relies on it, and 'sample' one token each."""
    block_size = scheduler.block_manager.block_size
    sampled: list[int | None] = []
    for req, n, c in zip(out.scheduled, out.num_new_tokens, out.num_computed_tokens):
        assert n >= 1
        assert c == req.num_computed_tokens
        assert c + n <= len(req.block_table) * block_size  # every new token has a slot
        sampled.append(next_token(req.all_token_ids) if c + n == req.num_tokens else None)
    return sampled


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = scheduler.schedule()
    finished = scheduler.update(out, fake_forward(scheduler, out))
    scheduler.check_invariants()
    return out, finished


def run_all(scheduler: Scheduler, requests: list[Request]) -> list[SchedulerOutput]:
    for req in requests:
        scheduler.add_request(req)
    scheduler.check_invariants()
    plans = []
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        out, _ = step(scheduler)
        assert out.scheduled, "a step with unfinished requests scheduled nothing"
        plans.append(out)
    assert not scheduler.has_unfinished()
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return plans


def ids(requests: Sequence[Request]) -> list[int]:
    return [r.request_id for r in requests]


# ------------------------------------------------------------------- config


def test_config_validation() -> None:
    with pytest.raises(
        ValueError, match="batching must be one of continuous, static, got 'dynamic'"
    ):
        SchedulerConfig(max_model_len=32, batching="dynamic")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs"):
        SchedulerConfig(max_model_len=32, max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1"):
        SchedulerConfig(max_model_len=0)
    config = SchedulerConfig(max_model_len=100, max_num_seqs=4, max_num_batched_tokens=16)
    assert config.batching == "continuous"
    assert config.max_tokens_per_step == 100
    assert SchedulerConfig(max_model_len=100).max_tokens_per_step == 8192


# --------------------------------------------------------- exact scenarios


def test_exact_plan_block_ids_and_admission_waits() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    a = make_request(0, 5, 4)  # 5 + 4 - 1 = 8 tokens -> 2 pages
    b = make_request(1, 6, 7)  # 12 tokens -> 3 pages
    c = make_request(2, 9, 8)  # 16 tokens -> 4 pages
    for r in (a, b, c):
        s.add_request(r)

    # Step 1: A and B fit (5 of 8 pages), C waits: a prefill step of A and B.
    out, _ = step(s)
    assert ids(out.admitted) == [0, 1] and out.admission_wait
    assert ids(out.scheduled) == [0, 1] and out.num_new_tokens == (5, 6)
    assert out.num_computed_tokens == (0, 0)
    assert out.is_prefill and out.total_new_tokens == 11 and out.preempted == ()
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4]
    assert c.status is RequestStatus.WAITING and c.block_table == []

    # Steps 2-4: decode A and B; C still waits; A finishes after its 4th token.
    for _ in range(3):
        out, finished = step(s)
        assert ids(out.scheduled) == [0, 1] and out.num_new_tokens == (1, 1)
        assert not out.is_prefill and out.admission_wait
    assert ids(finished) == [0] and a.finish_reason is FinishReason.LENGTH
    assert a.num_output_tokens == 4 and a.block_table == []
    assert s.block_manager.pool.free_block_ids() == [5, 6, 7, 0, 1]

    # Step 5: C is admitted into the fresh pages, then A's old ones; C prefills alone.
    out, _ = step(s)
    assert ids(out.admitted) == [2] and not out.admission_wait
    assert ids(out.scheduled) == [2] and out.num_new_tokens == (9,)
    assert c.block_table == [5, 6, 7, 0]

    # Step 6: decode B and C.
    out, _ = step(s)
    assert ids(out.scheduled) == [1, 2] and out.num_new_tokens == (1, 1)

    run_all(s, [])
    assert (b.num_output_tokens, c.num_output_tokens) == (7, 8)
    assert s.num_admission_waits == 4
    assert s.peak_running == 2 and s.max_decode_batch == 2
    assert s.num_prefill_tokens == 5 + 6 + 9
    assert s.num_decode_tokens == 3 + 6 + 7  # every output token but the one sampled at prefill
    assert s.block_manager.peak_used_blocks == 7


def test_fifo_order_is_kept_when_a_later_request_would_fit() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    big = make_request(0, 8, 9)  # 16 tokens -> 4 pages
    first = make_request(1, 4, 1)  # 1 page
    small = make_request(2, 2, 1)  # 1 page
    s.add_request(first)
    s.add_request(big)
    s.add_request(small)
    out, _ = step(s)
    # `first` ran; `big` does not fit next to it, and `small` may not jump ahead of `big`.
    assert ids(out.admitted) == [1] and out.admission_wait
    assert [r.request_id for r in s.waiting] == [0, 2]
    run_all(s, [])
    assert big.finish_time is not None and small.finish_time is not None
    assert big.first_token_time < small.first_token_time  # type: ignore[operator]


def test_request_exactly_filling_the_pool_is_admitted() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=17)
    req = make_request(0, 10, 7)  # 16 tokens -> all 4 pages
    s.add_request(req)
    out, _ = step(s)
    assert ids(out.admitted) == [0] and req.block_table == [0, 1, 2, 3]
    assert s.block_manager.num_free_blocks == 0
    run_all(s, [])
    assert req.num_output_tokens == 7 and req.finish_reason is FinishReason.LENGTH
    assert s.block_manager.peak_used_blocks == 4


def test_long_prompt_runs_alone_and_prefills_are_fifo() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)
    a, b, c = make_request(0, 5, 3), make_request(1, 20, 3), make_request(2, 2, 3)
    for r in (a, b, c):
        s.add_request(r)
    plans = [step(s)[0] for _ in range(4)]
    assert ids(plans[0].admitted) == [0, 1, 2]
    # 5 + 20 > 8: A alone; C (2 tokens) would fit but does not jump ahead of B.
    assert [(ids(p.scheduled), p.num_new_tokens) for p in plans] == [
        ([0], (5,)),
        ([1], (20,)),  # longer than the budget: runs alone
        ([2], (2,)),
        ([0, 1, 2], (1, 1, 1)),
    ]
    assert [p.is_prefill for p in plans] == [True, True, True, False]
    run_all(s, [])


def test_prefill_packs_up_to_the_token_budget() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=10)
    reqs = [make_request(i, n, 2) for i, n in enumerate((3, 4, 3, 5))]
    for r in reqs:
        s.add_request(r)
    first, _ = step(s)
    assert ids(first.scheduled) == [0, 1, 2] and first.total_new_tokens == 10
    second, _ = step(s)
    assert ids(second.scheduled) == [3] and second.num_new_tokens == (5,)
    run_all(s, [])


def test_max_num_seqs_caps_running_without_counting_a_wait() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [make_request(i, 3, 3) for i in range(5)]
    plans = run_all(s, reqs)
    assert ids(plans[0].admitted) == [0, 1]
    assert s.peak_running == 2 and s.max_decode_batch == 2
    assert s.num_admission_waits == 0
    assert not any(p.admission_wait for p in plans)


def test_continuous_admits_mid_run_static_waits_for_the_group() -> None:
    def scenario(batching: str) -> tuple[Scheduler, list[SchedulerOutput]]:
        s = make_scheduler(num_blocks=64, batching=batching)
        a, b = make_request(0, 4, 3), make_request(1, 4, 6)
        s.add_request(a)
        s.add_request(b)
        plans = [step(s)[0]]
        s.add_request(make_request(2, 4, 2))  # arrives while A and B run
        plans += run_all(s, [])
        return s, plans

    s, plans = scenario("continuous")
    assert ids(plans[1].admitted) == [2] and ids(plans[1].scheduled) == [2]
    assert plans[1].is_prefill
    assert ids(plans[2].scheduled) == [0, 1, 2]
    assert s.peak_running == 3

    s, plans = scenario("static")
    admitted = [(i, ids(p.admitted)) for i, p in enumerate(plans) if p.admitted]
    # B needs 6 steps (1 prefill + 5 decodes): C is admitted only after the group is done.
    assert admitted == [(0, [0, 1]), (6, [2])]
    assert [ids(p.scheduled) for p in plans[1:6]] == [[0, 1], [0, 1], [1], [1], [1]]
    assert s.peak_running == 2 and s.num_admission_waits == 0


def test_static_counts_a_wait_only_when_a_group_is_formed() -> None:
    def run(batching: str) -> Scheduler:
        s = make_scheduler(num_blocks=4, block_size=4, batching=batching)
        # Each reserves 2 of the 4 pages; A is short, B long.
        reqs = [make_request(0, 4, 2), make_request(1, 4, 5), make_request(2, 4, 5)]
        run_all(s, reqs)
        return s

    static, continuous = run("static"), run("continuous")
    assert static.num_admission_waits == 1  # C did not fit when {A, B} was formed
    assert continuous.num_admission_waits == 2  # C waited until A finished after 2 steps


def test_outputs_do_not_depend_on_batching_or_budget() -> None:
    lengths = [(7, 12), (1, 5), (23, 9), (4, 20), (15, 3), (9, 16), (2, 1), (30, 8)]

    def run(**kwargs: Any) -> tuple[Scheduler, list[tuple[list[int], FinishReason | None]]]:
        s = make_scheduler(**kwargs)
        reqs = [make_request(i, p, m, eos=True) for i, (p, m) in enumerate(lengths)]
        run_all(s, reqs)
        return s, [(r.output_token_ids, r.finish_reason) for r in reqs]

    alone = []
    for i, (p, m) in enumerate(lengths):
        s = make_scheduler(num_blocks=64)
        req = make_request(i, p, m, eos=True)
        run_all(s, [req])
        alone.append((req.output_token_ids, req.finish_reason))
    assert any(reason is FinishReason.STOP for _, reason in alone)  # some hit EOS

    roomy, roomy_out = run(num_blocks=64)
    assert roomy_out == alone and roomy.num_admission_waits == 0
    for batching in BATCHING_CHOICES:
        tight, tight_out = run(num_blocks=10, batching=batching)
        assert tight_out == alone
        assert tight.num_admission_waits > 0
        assert tight.block_manager.peak_used_blocks <= 10
        _, few_out = run(num_blocks=64, batching=batching, max_num_seqs=2, max_num_batched_tokens=8)
        assert few_out == alone


# ------------------------------------------------------------------- stops


def scripted(s: Scheduler, req: Request, tokens: list[int]) -> list[Request]:
    """Feed `req` the given sampled tokens, one per step, until it finishes."""
    s.add_request(req)
    for token in tokens:
        out = s.schedule()
        finished = s.update(out, [token])
        s.check_invariants()
        if finished:
            return finished
    return []


def test_eos_stops_with_the_id_unless_ignored() -> None:
    s = make_scheduler(num_blocks=64)
    req = make_request(0, 3, 10, eos=True)
    assert scripted(s, req, [5, 6, EOS, 7]) == [req]
    assert req.output_token_ids == [5, 6, EOS]
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, EOS)
    ignoring = make_request(1, 3, 4, eos=True, params=SamplingParams(max_tokens=4, ignore_eos=True))
    scripted(s, ignoring, [EOS, EOS, EOS, EOS, EOS])
    assert ignoring.output_token_ids == [EOS] * 4
    assert (ignoring.finish_reason, ignoring.stop_reason) == (FinishReason.LENGTH, None)


def test_eos_at_the_last_allowed_token_reads_as_stop() -> None:
    s = make_scheduler(num_blocks=64)
    req = make_request(0, 3, 2, eos=True)
    scripted(s, req, [5, EOS])
    assert req.finish_reason is FinishReason.STOP


def test_stop_token_ids_and_min_tokens() -> None:
    s = make_scheduler(num_blocks=64)
    params = SimpleNamespace(max_tokens=10, ignore_eos=True, stop_token_ids=[9], min_tokens=3)
    req = make_request(0, 3, 10, eos=True, params=params)
    scripted(s, req, [9, EOS, 9, 5])
    assert req.output_token_ids == [9, EOS, 9]  # the first 9 came before min_tokens
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, 9)
    params = SimpleNamespace(max_tokens=10, ignore_eos=False, min_tokens=2)
    req = make_request(1, 3, 10, eos=True, params=params)
    scripted(s, req, [EOS, EOS])
    assert req.output_token_ids == [EOS, EOS] and req.finish_reason is FinishReason.STOP


def test_stop_token_ids_with_the_real_sampling_params() -> None:
    try:
        params = SamplingParams(max_tokens=10, stop_token_ids=[9], min_tokens=2)  # type: ignore[call-arg]
    except TypeError:
        pytest.skip("SamplingParams has no stop_token_ids / min_tokens yet")
    s = make_scheduler(num_blocks=64)
    req = make_request(0, 3, 10, params=params)
    scripted(s, req, [9, 9, 5])
    assert req.output_token_ids == [9, 9]
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, 9)


def test_max_model_len_stops_with_length() -> None:
    s = make_scheduler(num_blocks=64, max_model_len=8)
    req = make_request(0, 5, 3)
    scripted(s, req, [5, 5, 5])
    assert req.num_tokens == 8 and req.finish_reason is FinishReason.LENGTH
    assert s.block_manager.num_free_blocks == 64


# -------------------------------------------------------------- rejections


def test_rejections_give_the_numbers_and_the_flag() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    good = [make_request(0, 5, 4), make_request(3, 6, 3)]
    s.add_request(good[0])

    too_long = make_request(1, 10, 30)
    with pytest.raises(RequestRejected) as info:
        s.add_request(too_long)
    msg = str(info.value)
    assert "prompt (10 tokens) + max_tokens (30) = 40 exceeds max_model_len (32)" in msg
    # max_model_len is the model's own limit here: raising it cannot help.
    assert "--max-model-len" not in msg
    assert "lower max_tokens to 22 or less" in msg
    assert "shorten the prompt to 2 tokens or fewer" in msg
    assert isinstance(info.value, ValueError)
    assert too_long.finish_reason is FinishReason.REJECTED and too_long.error == msg

    too_big = make_request(2, 10, 8)  # 17 tokens -> 5 pages of 4, the pool has 4
    with pytest.raises(RequestRejected) as info:
        s.add_request(too_big)
    msg = str(info.value)
    assert "needs 5 KV pages of 4 tokens" in msg and "has 4 pages (16 tokens)" in msg
    assert "--kv-cache-mib" in msg and "kv_cache_mib" in msg
    assert too_big.is_finished and too_big.block_table == []

    with pytest.raises(RequestRejected, match="prompt is empty"):
        s.add_request(make_request(4, 0, 3))

    s.add_request(good[1])
    assert s.num_waiting == 2
    run_all(s, [])
    assert all(r.finish_reason is FinishReason.LENGTH for r in good)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "model_max_len", "says", "never"),
    [
        # Raising --max-model-len works only up to the model's own positions.
        (10, 30, 64, ["raise --max-model-len (max_model_len) to 40", "the model has 64"], []),
        (10, 60, 64, ["lower max_tokens to 22 or less"], ["--max-model-len"]),
        # The prompt alone is over every limit: only shortening it helps.
        (40, 5, 32, ["shorten the prompt to 27 tokens or fewer"], ["--max-model-len", "lower"]),
        (40, 40, 32, ["lower max_tokens to 32 tokens together", "has 32 pos"], ["--max-model"]),
    ],
)
def test_context_advice_leads_somewhere(
    prompt: int, max_tokens: int, model_max_len: int, says: list[str], never: list[str]
) -> None:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, model_max_len=model_max_len
    )
    s = Scheduler(config, BlockManager(64, 4))
    with pytest.raises(RequestRejected) as info:
        s.add_request(make_request(0, prompt, max_tokens))
    msg = str(info.value)
    for text in says:
        assert text in msg, msg
    for text in never:
        assert text not in msg, msg


# -------------------------------------------------------- finish / update


def test_finish_request_waiting_and_running() -> None:
    s = make_scheduler(num_blocks=3, block_size=4)
    running, waiting = make_request(0, 8, 5), make_request(1, 8, 5)  # 3 pages each
    s.add_request(running)
    s.add_request(waiting)
    step(s)
    assert s.num_running == 1 and s.num_waiting == 1
    s.finish_request(waiting, FinishReason.ABORT)
    assert s.num_waiting == 0 and waiting.finish_reason is FinishReason.ABORT
    s.finish_request(running, FinishReason.STOP, stop_reason="\n\n")
    assert running.stop_reason == "\n\n" and running.block_table == []
    assert s.block_manager.num_free_blocks == 3 and not s.has_unfinished()
    s.finish_request(running, FinishReason.ABORT)  # already finished: left as it is
    assert running.finish_reason is FinishReason.STOP
    with pytest.raises(ValueError, match="not in this scheduler"):
        s.finish_request(make_request(9, 2, 2), FinishReason.ABORT)
    s.check_invariants()


def test_abort_between_schedule_and_update() -> None:
    s = make_scheduler(num_blocks=16)
    a, b = make_request(0, 4, 5), make_request(1, 4, 5)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.finish_request(a, FinishReason.ABORT)
    assert s.update(out, [7, 8]) == []
    assert a.output_token_ids == [] and b.output_token_ids == [8]
    s.check_invariants()
    run_all(s, [])


def test_update_checks_its_arguments() -> None:
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request(0, 4, 5))
    out = s.schedule()
    with pytest.raises(ValueError, match="got 2 sampled ids for 1 scheduled"):
        s.update(out, [1, 2])
    with pytest.raises(ValueError, match="computed all tokens but got None"):
        s.update(out, [None])


def test_one_token_prompt_is_a_prefill() -> None:
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request(0, 1, 3))
    out, _ = step(s)
    assert out.num_new_tokens == (1,) and out.is_prefill
    out, _ = step(s)
    assert out.num_new_tokens == (1,) and not out.is_prefill


def test_empty_schedule() -> None:
    s = make_scheduler(num_blocks=16)
    out = s.schedule()
    assert out.scheduled == () and not out.is_prefill and out.total_new_tokens == 0
    assert s.update(out, []) == []


# ------------------------------------------------------ random state machine


class SchedulerMachine(RuleBasedStateMachine):
    """Random submissions, steps (with EOS and aborts) and finishes.

    After every step: the invariants hold, a step with work scheduled something,
    prefill and decode never mix, static admits only when idle, and an admission
    wait is reported exactly when the head is blocked by pages. At the end
    everything drains and every page is free.
    """

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4, 8]),
        max_num_seqs=st.integers(1, 8),
        extra_budget=st.integers(0, 24),
        max_model_len=st.integers(8, 48),
        batching=st.sampled_from(BATCHING_CHOICES),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        extra_budget: int,
        max_model_len: int,
        batching: str,
    ) -> None:
        self.s = make_scheduler(
            num_blocks,
            block_size,
            batching=batching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,
            max_model_len=max_model_len,
        )
        self.accepted: list[Request] = []
        self.next_id = 0

    @rule(
        batch=st.lists(
            st.tuples(
                st.integers(1, 12) | st.integers(0, 60),  # prompt: mostly small, some oversize
                st.integers(1, 8) | st.integers(1, 60),  # max_tokens
                st.booleans(),  # ignore_eos
            ),
            min_size=1,
            max_size=4,
        )
    )
    def add_requests(self, batch: list[tuple[int, int, bool]]) -> None:
        for prompt_len, max_tokens, ignore_eos in batch:
            self._add(prompt_len, max_tokens, ignore_eos)

    def _add(self, prompt_len: int, max_tokens: int, ignore_eos: bool) -> None:
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        req = make_request(self.next_id, prompt_len, max_tokens, eos=True, params=params)
        bm, config = self.s.block_manager, self.s.config
        admissible = (
            prompt_len > 0
            and prompt_len + max_tokens <= config.max_model_len
            and bm.reservation_blocks(req) <= bm.num_blocks
        )
        if admissible:
            self.s.add_request(req)
            self.accepted.append(req)
        else:
            with pytest.raises(RequestRejected):
                self.s.add_request(req)
            assert req.finish_reason is FinishReason.REJECTED and req.error
            event("rejected")

    @rule(
        n_steps=st.integers(1, 6),
        sampled=st.lists(st.sampled_from([EOS, 3, 4, 5, 6, 7, 8]), min_size=8, max_size=8),
        abort_index=st.none() | st.none() | st.integers(0, 7),
    )
    def steps(self, n_steps: int, sampled: list[int], abort_index: int | None) -> None:
        for i in range(n_steps):
            self._step(sampled[i:] + sampled[:i], abort_index if i == 0 else None)

    def _step(self, sampled: list[int], abort_index: int | None) -> None:
        s = self.s
        had_work, running_before = s.has_unfinished(), s.num_running
        out = s.schedule()
        self._check_plan(out, had_work, running_before)
        s.check_invariants()
        tokens: list[int | None] = [sampled[i % len(sampled)] for i in range(len(out.scheduled))]
        if abort_index is not None and out.scheduled:
            s.finish_request(out.scheduled[abort_index % len(out.scheduled)], FinishReason.ABORT)
        for req in s.update(out, tokens):
            assert req.is_finished and req.block_table == []
            assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            event(f"finished: {req.finish_reason}")
        if out.admission_wait:
            event(f"admission wait ({s.config.batching})")
        s.check_invariants()

    def _check_plan(self, out: SchedulerOutput, had_work: bool, running_before: int) -> None:
        s, config = self.s, self.s.config
        if had_work:
            assert out.scheduled, "deadlock: unfinished requests but nothing scheduled"
        if out.is_prefill:
            assert all(
                c < r.num_prompt_tokens for r, c in zip(out.scheduled, out.num_computed_tokens)
            )
            assert len(out.scheduled) == 1 or out.total_new_tokens <= config.max_num_batched_tokens
        else:
            assert all(n == 1 for n in out.num_new_tokens)
            assert list(out.scheduled) == s.running
        fake_forward(s, out)
        tried = config.batching == "continuous" or running_before == 0
        if not tried:
            assert out.admitted == () and not out.admission_wait
        else:
            blocked = s.num_waiting > 0 and s.num_running < config.max_num_seqs
            assert out.admission_wait == blocked
            if blocked:
                assert not s.block_manager.can_allocate(s.waiting[0])

    @rule(data=st.data())
    def finish_one(self, data: st.DataObject) -> None:
        live = [r for r in self.accepted if not r.is_finished]
        if not live:
            return
        req = data.draw(st.sampled_from(live))
        self.s.finish_request(
            req, data.draw(st.sampled_from([FinishReason.ABORT, FinishReason.STOP]))
        )
        assert req.is_finished and req.block_table == []

    @precondition(lambda self: hasattr(self, "s"))
    @invariant()
    def bookkeeping_holds(self) -> None:
        self.s.check_invariants()
        for req in self.accepted:
            assert req.num_output_tokens <= req.max_tokens
            assert req.num_tokens <= self.s.config.max_model_len

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        s = self.s
        # Every unfinished request completes within a bounded number of steps.
        bound = sum(1 + r.max_tokens for r in self.accepted if not r.is_finished)
        for _ in range(bound):
            if not s.has_unfinished():
                break
            self._step([3], None)
        assert not s.has_unfinished()
        assert all(r.is_finished and r.block_table == [] for r in self.accepted)
        bm = s.block_manager
        assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
        bm.check_invariants()


SchedulerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None
)
test_scheduler_machine = SchedulerMachine.TestCase
