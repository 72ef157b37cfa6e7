"""The online engine: prefix caching, chunked prefill, mixed steps, admission
policies, preemption, abort and streaming, end to end on real (tiny) models.

Oracle: the seed's engine configuration (reserve admission, whole prompts, no
prefix cache), itself proven against transformers in test_engine.py. Greedy
float32 outputs must not depend on how the work was cut into steps or pages.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model import load_model
from tiny_models import greedy, make_tiny_llama_dir

SEED_CONFIG = dict(admission="reserve", chunked_prefill=False, prefix_caching=False)
MAX_NEW = [12, 20, 7, 16, 25, 5, 18, 10]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny") / "m", seed=21, num_attention_heads=4, num_key_value_heads=2
    )
    return load_model(path, device="cpu", dtype="float32")


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    """Eight prompts: five share a 40-token prefix (one is exactly the prefix,
    one ends on a page boundary), three are unrelated; ragged lengths."""
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prefix = rand(40)
    return [
        prefix + rand(9),
        rand(17),
        prefix,
        prefix + rand(24),  # 64 tokens: four full pages of 16
        rand(3),
        prefix[:33] + rand(2),
        rand(1),
        prefix + rand(9),
    ]


def run(model, prompts, params, **settings):
    llm = LLM(model=model, **settings)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.token_ids for o in outs]


def assert_clean(llm: LLM) -> None:
    """Every page free or cached, every reference count zero, no state left."""
    eng = llm.engine
    eng.scheduler.check_invariants()
    assert not eng.scheduler.has_unfinished() and eng.states == {}
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.pool.ref_counts)


@pytest.fixture(scope="module")
def expected(tiny):
    prompts = shared_prefix_prompts(tiny.config.vocab_size)
    _, ids = run(tiny, prompts, [greedy(n) for n in MAX_NEW], kv_cache_mib=4, **SEED_CONFIG)
    return prompts, ids


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("admission", ["reserve", "optimistic"])
@pytest.mark.parametrize("budget", [16, 64, 8192])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_outputs_do_not_depend_on_how_the_work_is_cut(
    tiny, expected, block_size, admission, budget, prefix_caching
):
    prompts, want = expected
    llm, got = run(
        tiny,
        prompts,
        [greedy(n) for n in MAX_NEW],
        kv_cache_mib=4,
        block_size=block_size,
        admission=admission,
        max_num_batched_tokens=budget,
        max_num_seqs=min(16, budget),
        prefix_caching=prefix_caching,
    )
    assert got == want
    stats = llm.stats()
    if prefix_caching:
        # Pages are named when the step computing them is planned, so even
        # requests admitted in that same step share them.
        assert stats["prefix_cache_hit_tokens"] > 0
        assert 0 < stats["prefix_cache_hit_rate"] < 1
    elif not prefix_caching:
        assert stats["prefix_cache_hit_tokens"] == 0 and stats["prefix_cache_hit_rate"] == 0.0
    assert stats["preemptions"] == 0  # a roomy pool
    assert_clean(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [16, 8192])
@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_preemption_by_a_tiny_pool_changes_no_output(
    tiny, expected, prefix_caching, budget, chunked_prefill
):
    prompts, want = expected
    # 6 pages of 16 tokens: the largest request (64 + 16 new) needs 5 of them.
    page_mib = tiny.config.kv_bytes_per_token(4) * 16 / 2**20
    llm, got = run(
        tiny,
        prompts,
        [greedy(n) for n in MAX_NEW],
        kv_cache_mib=6 * page_mib,
        admission="optimistic",
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        prefix_caching=prefix_caching,
        chunked_prefill=chunked_prefill,
    )
    assert got == want
    assert llm.stats()["pages_total"] == 6
    assert llm.stats()["preemptions"] > 0
    assert_clean(llm)


def test_the_reserve_policy_waits_instead_of_preempting(tiny, expected):
    prompts, want = expected
    page_mib = tiny.config.kv_bytes_per_token(4) * 16 / 2**20
    llm, got = run(
        tiny, prompts, [greedy(n) for n in MAX_NEW], kv_cache_mib=6 * page_mib, admission="reserve"
    )
    assert got == want
    stats = llm.stats()
    assert stats["preemptions"] == 0 and stats["admission_waits"] > 0
    assert stats["pages_peak_used"] <= 6
    assert_clean(llm)


def test_static_batching_with_both_policies(tiny, expected):
    prompts, want = expected
    for admission in ("reserve", "optimistic"):
        llm, got = run(
            tiny,
            prompts,
            [greedy(n) for n in MAX_NEW],
            kv_cache_mib=1,
            batching="static",
            admission=admission,
            max_num_batched_tokens=32,
            max_num_seqs=4,
        )
        assert got == want, admission
        assert llm.stats()["peak_active_requests"] <= 4
        assert_clean(llm)


def test_a_long_prompt_does_not_stall_the_others_next_tokens(tiny):
    """A 300-token prompt arriving while a request decodes: with a budget of 32
    tokens per step, the running request gets a token in every step (mixed
    steps) while the long prompt is computed over about ten steps."""
    llm = LLM(model=tiny, kv_cache_mib=4, max_num_batched_tokens=32, max_num_seqs=8)
    eng = llm.engine
    short = eng.add_request([5, 6, 7], greedy(30))
    eng.step()  # short's prompt
    long = eng.add_request(list(range(3, 303)), greedy(4))
    chunks = []
    while long.num_output_tokens == 0:
        before = short.num_output_tokens
        eng.step()
        assert short.num_output_tokens == before + 1  # a decode token every step
        chunks.append(long.num_computed_tokens)
    assert len(chunks) == 10 and chunks[0] == 31  # 32 - short's decode token
    while eng.has_unfinished():
        eng.step()
    # Same tokens as each request alone with whole prompts.
    for req, prompt in ((short, [5, 6, 7]), (long, list(range(3, 303)))):
        _, alone = run(tiny, [prompt], [greedy(req.max_tokens)], kv_cache_mib=4, **SEED_CONFIG)
        assert req.output_token_ids == alone[0]
    assert_clean(llm)


def test_decode_attention_takes_the_rows_longest_first(tiny, monkeypatch):
    """The runner orders each step's rows longest context first (a mixed step's
    decode rows among themselves first, then its prompts), and the model hands
    that order to decode attention with the rows it takes."""
    from pagedllm.ops import reference

    calls = []
    real = reference.decode_attention

    def spy(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=None, **kw):
        order = kw.get("order")
        calls.append((seq_lens.tolist(), None if order is None else order.tolist()))
        return real(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, **kw)

    monkeypatch.setattr(reference, "decode_attention", spy)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17, 90, 2)]
    llm = LLM(model=tiny, kv_cache_mib=4, max_num_batched_tokens=32, max_num_seqs=8)
    hosts = []
    prepare = llm.engine.runner.prepare

    def recording_prepare(*args):
        hosts.append(prepare(*args))
        return hosts[-1]

    monkeypatch.setattr(llm.engine.runner, "prepare", recording_prepare)
    llm.generate(prompts, [greedy(n) for n in (9, 4, 12, 6, 15)], use_tqdm=False)
    kinds, orders = set(), set()
    for host in hosts:
        b = host.num_seqs
        if b < 2:
            assert host.decode_order is None
            continue
        d = b if host.is_decode else host.num_decode_seqs
        kinds.add("decode" if host.is_decode else "mixed" if d else "prompts")
        order, lens = host.decode_order.tolist(), host.seq_lens.tolist()
        assert sorted(order[:d]) == list(range(d)) and sorted(order[d:]) == list(range(d, b))
        for part in (order[:d], order[d:]):
            assert [lens[i] for i in part] == sorted((lens[i] for i in part), reverse=True)
        orders |= {tuple(order), tuple(order[:d])}
    assert kinds == {"decode", "mixed", "prompts"}
    # The model passes each step's order on (a mixed step's decode rows: its first
    # part); only a call of one row goes without.
    assert any(order != sorted(order) for _, order in calls if order)
    for lens, order in calls:
        assert tuple(order) in orders if len(lens) > 1 else order in (None, [0])
    assert_clean(llm)


def test_requests_admitted_together_share_a_new_prefix(tiny):
    llm = LLM(model=tiny, kv_cache_mib=4)
    prefix = list(range(10, 74))  # four pages of 16
    prompts = [prefix + [100 + i] for i in range(4)]
    outs = llm.generate(prompts, greedy(3), use_tqdm=False)
    stats = llm.stats()
    assert stats["steps"] == 3  # all four in the first step
    assert stats["prefix_cache_hit_tokens"] == 3 * 64  # the last three reuse the first's pages
    _, alone = run(tiny, prompts, greedy(3), kv_cache_mib=4, **SEED_CONFIG)
    assert [o.token_ids for o in outs] == alone
    assert_clean(llm)


@pytest.mark.parametrize("fail_with", [RuntimeError, KeyboardInterrupt])
def test_a_failed_step_takes_back_the_pages_it_named(tiny, fail_with):
    """The runner fails in the step where later requests share pages the first
    one is computing: the names are taken back, the sharers recompute, and the
    answers are still right."""
    llm = LLM(model=tiny, kv_cache_mib=4)
    eng = llm.engine
    prefix = list(range(10, 74))
    prompts = [prefix + [100 + i] for i in range(3)]
    reqs = [eng.add_request(p, greedy(3)) for p in prompts]
    real = eng.runner.collect

    def failing(step):
        assert step.plan.fresh_hits  # the step this test is about
        real(step)  # half the work done: the K/V is written, the bookkeeping is not
        raise fail_with("the device went away")

    eng.runner.collect = failing
    with pytest.raises(fail_with):
        eng.step()
    eng.runner.collect = real
    eng.scheduler.check_invariants()
    assert eng.block_manager.pool.num_cached == 0  # every name taken back
    assert [r.status.value for r in reqs] == ["running", "waiting", "waiting"]
    while eng.has_unfinished():
        eng.step()
    _, alone = run(tiny, prompts, greedy(3), kv_cache_mib=4, **SEED_CONFIG)
    assert [r.output_token_ids for r in reqs] == alone
    assert_clean(llm)


def test_ctrl_c_after_planning_takes_back_the_pages_it_named(tiny):
    """A Ctrl-C held during `schedule()` is raised when planning ends, after the
    plan named the pages it would fill: the step is undone, so the next request
    with that prompt computes it again instead of reading pages never written."""
    import signal

    llm = LLM(model=tiny, kv_cache_mib=4)
    prompt = list(range(10, 50))  # 40 tokens: two full pages
    _, want = run(tiny, [prompt], [greedy(6)], kv_cache_mib=4, **SEED_CONFIG)
    real = llm.engine.scheduler.schedule

    def interrupted():
        plan = real()
        signal.raise_signal(signal.SIGINT)  # held until planning ends, then raised
        return plan

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        llm.engine.scheduler.schedule = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompt], greedy(6), use_tqdm=False)
    finally:
        signal.signal(signal.SIGINT, previous)
        llm.engine.scheduler.schedule = real
    assert llm.engine.block_manager.pool.num_cached == 0
    assert_clean(llm)
    assert llm.generate([prompt], greedy(6), use_tqdm=False)[0].token_ids == want[0]


def test_a_prompts_pages_are_named_after_its_step_is_launched(tiny):
    """The pages a lone new prompt fills are hashed and named once its step is
    on the device (off the time to first token), before the step's results
    are read; the next request with that prefix shares them."""
    llm = LLM(model=tiny, kv_cache_mib=4)
    eng = llm.engine
    pool = eng.block_manager.pool
    prompt = list(range(10, 75))  # 65 tokens: four full pages
    seen = []
    real_launch, real_collect = eng.runner.launch, eng.runner.collect

    def launch(plan, feed=None):
        seen.append(("launch", pool.num_cached, len(plan.unnamed)))
        return real_launch(plan, feed)

    def collect(step):
        seen.append(("collect", pool.num_cached, len(step.plan.unnamed)))
        return real_collect(step)

    eng.runner.launch, eng.runner.collect = launch, collect
    first = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    assert seen[:2] == [("launch", 0, 1), ("collect", 4, 0)]
    again = llm.generate([prompt[:64] + [99]], greedy(2), use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] == 64
    _, alone = run(tiny, [prompt, prompt[:64] + [99]], greedy(2), kv_cache_mib=4, **SEED_CONFIG)
    assert [first.token_ids, again.token_ids] == alone
    assert_clean(llm)


def test_prompt_logprobs_survive_preemption_mid_prompt(tiny):
    """A request asking for prompt log-probs is preempted while its prompt is
    computed in chunks; its recompute sends entries it has already."""
    page_mib = tiny.config.kv_bytes_per_token(4) * 16 / 2**20
    g = torch.Generator().manual_seed(9)
    a = torch.randint(3, 500, (30,), generator=g).tolist()
    b = torch.randint(3, 500, (100,), generator=g).tolist()
    params = [greedy(30), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)]
    base = LLM(model=tiny, kv_cache_mib=4, **SEED_CONFIG)
    want = base.generate([a, b], params, use_tqdm=False)[1].prompt_logprobs
    llm = LLM(
        model=tiny,
        kv_cache_mib=8 * page_mib,
        admission="optimistic",
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    got = llm.generate([a, b], params, use_tqdm=False)[1].prompt_logprobs
    assert llm.stats()["preemptions"] > 0
    assert len(got) == len(b) and got[0] is None
    for g_entry, w_entry in zip(got[1:], want[1:]):
        assert g_entry.keys() == w_entry.keys()
        for k in w_entry:
            assert abs(g_entry[k] - w_entry[k]) < 1e-4
    assert_clean(llm)


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny):
    llm = LLM(model=tiny, kv_cache_mib=4)
    prompt = list(range(10, 42))  # exactly two pages of 16
    first = llm.generate([prompt], greedy(5), use_tqdm=False)[0]
    second = llm.generate([prompt], greedy(5), use_tqdm=False)[0]
    assert second.token_ids == first.token_ids
    stats = llm.stats()
    # The second request reused one page: the second holds its last token.
    assert stats["prefix_cache_hit_tokens"] == 16
    assert stats["prefix_cache_query_tokens"] == 64
    assert stats["prefix_cache_hit_rate"] == 0.25
    assert_clean(llm)


def test_a_cached_page_is_evicted_only_when_its_memory_is_needed(tiny):
    page_mib = tiny.config.kv_bytes_per_token(4) * 16 / 2**20
    llm = LLM(model=tiny, kv_cache_mib=4 * page_mib, max_num_seqs=4)
    bm = llm.engine.block_manager
    prompt = list(range(10, 43))  # 33 tokens: two full pages are named
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert bm.pool.num_cached == 2 and bm.num_free_blocks == 4
    llm.generate([list(range(100, 110))], greedy(2), use_tqdm=False)  # one fresh page
    assert bm.pool.num_cached == 2  # a never-cached free page went first
    llm.generate([list(range(200, 250))], greedy(2), use_tqdm=False)  # four pages: evicts
    assert bm.pool.num_cached <= 3
    assert llm.stats()["prefix_cache_evictions"] >= 1
    before = llm.stats()["prefix_cache_hit_tokens"]
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] == before  # its pages were evicted
    assert_clean(llm)


# ------------------------------------------------------------------- abort


def test_abort_by_id_a_waiting_and_a_running_request(tiny, expected):
    prompts, want = expected
    llm = LLM(model=tiny, kv_cache_mib=4, max_num_seqs=2)
    eng = llm.engine
    reqs = [eng.add_request(p, greedy(n)) for p, n in zip(prompts[:4], MAX_NEW[:4])]
    eng.step()
    eng.step()
    running, waiting = reqs[0], reqs[3]
    assert running.num_output_tokens > 0 and waiting.status.value == "waiting"
    kept = list(running.output_token_ids)
    eng.abort(running.request_id)
    eng.abort(waiting.request_id)
    eng.abort(waiting.request_id)  # twice: nothing more happens
    eng.abort(12345)  # unknown: nothing happens
    outputs = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs[running.request_id].finish_reason == "abort"
    assert outputs[waiting.request_id].finish_reason == "abort"
    assert running.output_token_ids == kept  # the tokens made so far are kept
    assert waiting.output_token_ids == []
    for i in (1, 2):  # the others are untouched
        assert reqs[i].output_token_ids == want[i]
        assert outputs[reqs[i].request_id].finish_reason == "length"
    assert_clean(llm)


def test_an_abort_storm_leaves_every_page_free_or_cached(tiny, expected):
    prompts, want = expected
    page_mib = tiny.config.kv_bytes_per_token(4) * 16 / 2**20
    llm = LLM(model=tiny, kv_cache_mib=8 * page_mib, admission="optimistic", max_num_seqs=8)
    eng = llm.engine
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        reqs = [eng.add_request(p, greedy(n)) for p, n in zip(prompts, MAX_NEW)]
        for _ in range(int(torch.randint(0, 12, (1,), generator=g))):
            eng.step()
            victim = reqs[int(torch.randint(0, len(reqs), (1,), generator=g))]
            eng.abort(victim)
            eng.scheduler.check_invariants()
        while eng.has_unfinished():
            eng.step()
        for req, ids in zip(reqs, want):
            if req.finish_reason.value == "length":
                assert req.output_token_ids == ids
            else:
                assert req.finish_reason.value == "abort"
                assert req.output_token_ids == ids[: len(req.output_token_ids)]
        assert_clean(llm)


# --------------------------------------------------------------- streaming


def test_streams_give_token_ids_text_deltas_and_the_finish(tiny, expected):
    prompts, want = expected
    llm = LLM(model=tiny, kv_cache_mib=4)
    eng = llm.engine
    a = eng.add_request(prompts[0], greedy(MAX_NEW[0]), stream=True)
    b = eng.add_request(prompts[1], greedy(MAX_NEW[1]), stream=True)
    # Interleave two streams in one thread: each sees only its own outputs.
    ids_a, ids_b = [], []
    stream_a, stream_b = eng.stream(a), eng.stream(b)
    for out in stream_a:
        assert out.request_id == a.request_id
        ids_a += out.new_token_ids
        if len(ids_a) == 3:
            break_b = next(stream_b)
            ids_b += break_b.new_token_ids
    assert out.finished and out.finish_reason == "length"
    for out in stream_b:
        assert out.request_id == b.request_id
        ids_b += out.new_token_ids
    assert (ids_a, ids_b) == (want[0], want[1])
    assert_clean(llm)


def test_closing_a_stream_aborts_its_request(tiny, expected):
    prompts, want = expected
    llm = LLM(model=tiny, kv_cache_mib=4)
    eng = llm.engine
    a = eng.add_request(prompts[0], greedy(MAX_NEW[0]), stream=True)
    b = eng.add_request(prompts[1], greedy(MAX_NEW[1]))
    stream = eng.stream(a)
    next(stream)
    next(stream)
    stream.close()  # a client went away
    assert a.finish_reason.value == "abort"
    while eng.has_unfinished():
        eng.step()
    assert b.output_token_ids == want[1]
    assert_clean(llm)


def test_a_stream_ends_however_its_request_ends(tiny, expected):
    prompts, want = expected
    llm = LLM(model=tiny, kv_cache_mib=4)
    eng = llm.engine
    # Finished before anyone read the stream: every output is still there.
    done = eng.add_request(prompts[0], greedy(MAX_NEW[0]), stream=True)
    while eng.has_unfinished():
        eng.step()
    outs = list(eng.stream(done))
    assert [t for o in outs for t in o.new_token_ids] == want[0] and outs[-1].finished
    with pytest.raises(ValueError, match="read to the end"):
        next(eng.stream(done))
    # Aborted by someone else, unreported, while being read: the stream still ends.
    cut = eng.add_request(prompts[1], greedy(MAX_NEW[1]), stream=True)
    stream = eng.stream(cut)
    next(stream)
    eng.abort(cut.request_id, report=False)
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert_clean(llm)


def test_stream_needs_a_streaming_request(tiny):
    llm = LLM(model=tiny, kv_cache_mib=1)
    req = llm.engine.add_request([5, 6], greedy(2))
    with pytest.raises(ValueError, match="stream=True"):
        next(llm.engine.stream(req))
    llm.engine.abort(req, report=False)


def test_streamed_text_equals_the_final_text(smollm2):
    llm = LLM(model=smollm2, kv_cache_mib=16)
    eng = llm.engine
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Explain paging."}])
    req = eng.add_request(ids, greedy(24), stream=True)
    text = "".join(out.new_text for out in eng.stream(req))
    whole = llm.generate([ids], greedy(24), use_tqdm=False)[0]
    assert text == whole.text and text.strip()


# ------------------------------------------------------------ real model


def test_smollm2_chat_turns_reuse_the_prefix_and_answer_the_same(smollm2):
    system = {"role": "system", "content": "You are a concise assistant who explains systems."}
    convs = [
        [system, {"role": "user", "content": "What is a KV cache?"}],
        [system, {"role": "user", "content": "What is paging?"}],
        [system, {"role": "user", "content": "What is a KV cache?"}],
    ]
    base = LLM(model=smollm2, kv_cache_mib=16, **SEED_CONFIG)
    want = [o.token_ids for o in base.chat(convs, greedy(12), use_tqdm=False)]
    page_mib = smollm2.config.kv_bytes_per_token(4) * 16 / 2**20
    for settings in (
        dict(kv_cache_mib=16, max_num_batched_tokens=16, max_num_seqs=4),
        dict(
            kv_cache_mib=8 * page_mib,
            admission="optimistic",
            max_num_batched_tokens=32,
            max_num_seqs=4,
        ),
    ):
        llm = LLM(model=smollm2, **settings)
        got = [o.token_ids for o in llm.chat(convs, greedy(12), use_tqdm=False)]
        assert got == want, settings
        # The third conversation is the first again: at least its first page is reused.
        assert llm.stats()["prefix_cache_hit_tokens"] >= 16
        assert_clean(llm)


# ------------------------------------------------------------- layering


def test_the_bookkeeping_layers_import_without_torch():
    """engine, scheduler, kv and tokenizer import with torch made unimportable."""
    code = textwrap.dedent(
        """
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "triton"):
                    raise ImportError(f"{name} is not importable in this test")

        sys.meta_path.insert(0, NoTorch())
        import pagedllm.engine, pagedllm.scheduler, pagedllm.kv, pagedllm.tokenizer
        from pagedllm import LLM, SamplingParams
        assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "triton")]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
