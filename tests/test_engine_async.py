"""Async scheduling: an all-decode step's successor is planned and launched
before the step's own tokens are read back, its input tokens fed on the device.

Oracle: the same engine without it. Nothing a request sees may change: greedy
tokens, seeded samples, log-probs, stop strings, finish reasons, and what is
left in the pool. Each test also checks that continuations really ran.
"""

from __future__ import annotations

import pytest
import torch

import test_engine_online
from pagedllm import LLM, SamplingParams
from tiny_models import greedy

MAX_NEW = [12, 20, 7, 16, 25, 5, 18, 10]
tiny = test_engine_online.tiny  # the fixture: the online engine tests' GQA tiny model


def prompts_for(vocab: int, n: int = 8, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (40,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(3, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        out.append((prefix if i % 2 else []) + own.tolist())
    return out


def counting(llm: LLM) -> list[int]:
    """Count the continuations the scheduler plans (the list grows by one each)."""
    seen: list[int] = []
    scheduler = llm.engine.scheduler
    real = scheduler.schedule_continuation

    def plan(prev):
        out = real(prev)
        if out is not None:
            seen.append(len(out.scheduled))
        return out

    scheduler.schedule_continuation = plan
    return seen


def assert_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.scheduler.check_invariants()
    assert not eng.has_unfinished() and eng.states == {} and eng._inflight is None
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.pool.ref_counts)


def both(model, prompts, params, **settings):
    """(outputs without, outputs with async scheduling, continuations planned)."""
    sync = LLM(model=model, **settings).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, async_scheduling=True, **settings)
    seen = counting(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_clean(llm)
    return sync, outs, seen


@pytest.mark.parametrize(
    "settings",
    [
        dict(kv_cache_mib=4),
        dict(kv_cache_mib=4, admission="optimistic", max_num_seqs=8, max_num_batched_tokens=64),
        dict(kv_cache_mib=4, chunked_prefill=False, prefix_caching=False),
        dict(kv_cache_mib=4, batching="static", max_num_seqs=3),
    ],
)
def test_greedy_tokens_do_not_change(tiny, settings):
    prompts = prompts_for(tiny.config.vocab_size)
    params = [greedy(n, logprobs=2) for n in MAX_NEW]
    sync, outs, seen = both(tiny, prompts, params, **settings)
    assert seen, "no continuation ran"
    for a, b in zip(outs, sync):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [sorted(x) for x in a.logprobs] == [sorted(x) for x in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs):
            assert all(abs(x[k] - y[k]) < 1e-5 for k in x)


def test_eos_seeded_sampling_and_a_tight_pool(tiny):
    """EOS can end a request in the step whose successor is already queued (its
    extra token is dropped); seeded samples keep their sequence; in a pool too
    small for everyone, a continuation that finds no page gives way to the
    normal step, which preempts."""
    vocab = tiny.config.vocab_size
    prompts = prompts_for(vocab, n=6, seed=3)
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=100 + i, ignore_eos=i % 2 == 0)
        for i in range(6)
    ]
    page_mib = tiny.config.kv_bytes_per_token(4) * 16 / 2**20
    for settings in (dict(kv_cache_mib=4), dict(kv_cache_mib=9 * page_mib, admission="optimistic")):
        sync, outs, seen = both(tiny, prompts, params, **settings)
        assert seen
        assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in sync]


def test_continuations_skip_what_depends_on_the_unknown_token(tiny):
    """Penalties read every output token, min_tokens counts them: a batch with
    such a request never runs ahead (and gives the same tokens)."""
    prompts = prompts_for(tiny.config.vocab_size, n=3)
    params = [
        greedy(10),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.0),
        greedy(10),
    ]
    sync, outs, seen = both(tiny, prompts, params, kv_cache_mib=4)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert seen == []
    _, outs, seen = both(tiny, prompts, [greedy(10, min_tokens=5)] * 3, kv_cache_mib=4)
    assert seen  # once min_tokens is reached, it runs ahead again


def test_abort_while_a_continuation_is_queued(tiny):
    prompts = prompts_for(tiny.config.vocab_size, n=4)
    llm = LLM(model=tiny, kv_cache_mib=4, async_scheduling=True)
    eng = llm.engine
    reqs = [eng.add_request(p, greedy(30)) for p in prompts]
    while eng._inflight is None:
        eng.step()
    eng.abort(reqs[1])  # its row is in the queued step: that token is dropped
    while eng.has_unfinished():
        eng.step()
    assert_clean(llm)
    want = LLM(model=tiny, kv_cache_mib=4).generate(prompts, greedy(30), use_tqdm=False)
    for i in (0, 2, 3):
        assert reqs[i].output_token_ids == want[i].token_ids
    assert reqs[1].output_token_ids == want[1].token_ids[: len(reqs[1].output_token_ids)]


@pytest.mark.parametrize("where", ["launch", "collect"])
@pytest.mark.parametrize("fail_with", [RuntimeError, KeyboardInterrupt])
def test_a_failed_step_with_a_continuation_is_undone(tiny, where, fail_with):
    """The continuation's launch fails, or reading the step before it does: both
    plans are undone, the engine stays consistent, and the answers are right."""
    prompts = prompts_for(tiny.config.vocab_size, n=4)
    llm = LLM(model=tiny, kv_cache_mib=4, async_scheduling=True)
    eng, runner = llm.engine, llm.engine.runner
    reqs = [eng.add_request(p, greedy(20)) for p in prompts]
    for _ in range(4):
        eng.step()
    real = getattr(runner, where)
    failed = []

    def failing(*args, **kw):
        if not failed and (where == "collect" or args[0].is_continuation):
            failed.append(True)
            raise fail_with("the device went away")
        return real(*args, **kw)

    setattr(runner, where, failing)
    with pytest.raises(fail_with):
        while True:
            eng.step()
    setattr(runner, where, real)
    eng.scheduler.check_invariants()
    assert eng._inflight is None
    while eng.has_unfinished():
        eng.step()
    assert_clean(llm)
    want = LLM(model=tiny, kv_cache_mib=4).generate(prompts, greedy(20), use_tqdm=False)
    assert [r.output_token_ids for r in reqs] == [w.token_ids for w in want]


@pytest.mark.parametrize("where", ["collect", "sampler"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_gives_seeded_requests_their_draws_back(tiny, async_scheduling, where):
    """Seeded sampled requests: a step fails after it sampled, reading its ids
    (with async scheduling after the continuation sampled too), or inside its
    launch, right after the sampler drew (a Ctrl-C there). Undone, it gives the
    generators' draws back, so the outputs are those of a run that never
    failed (found by reviews: the redone step drew the next numbers)."""
    prompts = prompts_for(tiny.config.vocab_size, n=3)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i) for i in range(3)]
    want = LLM(model=tiny, kv_cache_mib=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=tiny, kv_cache_mib=4, async_scheduling=async_scheduling)
    eng, runner = llm.engine, llm.engine.runner
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        eng.step()
    real = getattr(runner, where)
    failed = []

    def failing(*args):
        if failed:
            return real(*args)
        if where == "collect":
            failed.append(len(args[0].generator_states))
            raise RuntimeError("the device went away")
        real(*args)  # drawn
        failed.append(len(args[1].generators))
        raise KeyboardInterrupt

    setattr(runner, where, failing)
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        eng.step()
    setattr(runner, where, real)
    assert failed == [3]  # the failed step had drawn for every request
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in reqs] == [w.token_ids for w in want]
    assert_clean(llm)


def test_stop_strings_and_streams_on_the_default_model(smollm2):
    """Text-level stops end a request one step after its successor was queued:
    the same texts, finish reasons and streamed pieces as without."""
    questions = ["Name three colours.", "Count from one to ten.", "What is a page table?"]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[".", "\n"])
    convs = [[{"role": "user", "content": q}] for q in questions]
    sync = LLM(model=smollm2, kv_cache_mib=32).chat(convs, params, use_tqdm=False)
    llm = LLM(model=smollm2, kv_cache_mib=32, async_scheduling=True)
    seen = counting(llm)
    outs = llm.chat(convs, params, use_tqdm=False)
    assert seen
    assert [o.text for o in outs] == [o.text for o in sync]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in sync]
    assert_clean(llm)


def test_pages_filled_ahead_are_cached_as_without(tiny):
    """A page whose last token a queued step was fed is named once that step
    has run: the next turn of a conversation hits as many cached tokens as
    without async scheduling (found by a review: it hit none)."""
    hits = []
    for on in (False, True):
        llm = LLM(model=tiny, kv_cache_mib=4, async_scheduling=on)
        prompt = list(range(10, 24))  # 14 tokens: the third output fills page 1
        out = llm.generate([prompt], greedy(3), use_tqdm=False)[0]
        llm.generate([prompt + out.token_ids + [7, 8]], greedy(3), use_tqdm=False)
        st = llm.stats()
        assert st["steps_planned_ahead"] > 0 or not on
        hits.append(st["prefix_cache_hit_tokens"])
        assert_clean(llm)
    assert hits[0] == hits[1] == 16


def test_aborting_every_row_of_a_queued_step_forgets_it(tiny):
    llm = LLM(model=tiny, kv_cache_mib=4, async_scheduling=True)
    eng = llm.engine
    reqs = [eng.add_request(p, greedy(30)) for p in prompts_for(tiny.config.vocab_size, n=3)]
    while eng._inflight is None:
        eng.step()
    for r in reqs:
        eng.abort(r, report=False)
    assert eng._inflight is None and not eng.has_unfinished()
    assert_clean(llm)
