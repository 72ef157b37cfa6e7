"""The engine: paged KV cache, page-budget admission, static and continuous batching.

Oracles: each prompt generated alone (batching must change nothing), the
naive full-forward greedy loop, and transformers' `generate`.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model import load_model
from tiny_models import greedy, hf_greedy, make_tiny_llama_dir

LENGTHS = [3, 17, 5, 31, 16, 1, 9, 40]  # ragged, across page boundaries
MAX_NEW = [12, 20, 7, 16, 33, 5, 18, 10]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny") / "m", seed=11, num_attention_heads=4, num_key_value_heads=2
    )
    model = load_model(path, device="cpu", dtype="float32")
    return path, hf, model


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def run(model, prompts, params, **kw):
    llm = LLM(model=model, **kw)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_batching_changes_nothing_tiny(tiny, batching):
    _, hf, model = tiny
    prompts = prompts_for(model.config.vocab_size)
    params = [greedy(n) for n in MAX_NEW]
    llm, outs = run(model, prompts, params, batching=batching, kv_cache_mib=4)
    alone = [
        run(model, [p], [sp], kv_cache_mib=4)[1][0].token_ids for p, sp in zip(prompts, params)
    ]
    assert [o.token_ids for o in outs] == alone
    assert all(len(o.token_ids) == n and o.finish_reason == "length" for o, n in zip(outs, MAX_NEW))
    stats = llm.stats()
    assert stats["pages_free"] == stats["pages_total"]
    if batching == "continuous":
        assert stats["peak_active_requests"] == len(prompts)
    # The first tokens equal transformers' own generate.
    for p, o in zip(prompts[:3], outs[:3]):
        assert o.token_ids == hf_greedy(hf, p, len(o.token_ids))


def test_static_admits_next_group_only_when_the_batch_is_done(tiny):
    _, _, model = tiny
    prompts = prompts_for(model.config.vocab_size)
    params = [greedy(n) for n in MAX_NEW]
    # Room for about three requests at a time.
    llm, outs = run(model, prompts, params, batching="static", kv_cache_mib=0.08)
    cont, outs_c = run(model, prompts, params, batching="continuous", kv_cache_mib=0.08)
    assert [o.token_ids for o in outs] == [o.token_ids for o in outs_c]
    s, c = llm.stats(), cont.stats()
    assert s["admission_waits"] > 0 and c["admission_waits"] > 0
    assert s["pages_peak_used"] <= s["pages_total"]
    # Continuous batching fills freed pages at once, so it needs fewer steps.
    assert c["steps"] < s["steps"]


def test_small_pool_forces_waits_without_changing_outputs(tiny):
    _, _, model = tiny
    prompts = prompts_for(model.config.vocab_size)
    params = [greedy(n) for n in MAX_NEW]
    _, big = run(model, prompts, params, kv_cache_mib=4)
    llm, small = run(model, prompts, params, kv_cache_mib=0.05)
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    st = llm.stats()
    assert st["admission_waits"] > 0
    assert st["peak_active_requests"] < len(prompts)
    assert st["pages_free"] == st["pages_total"]


def test_oversized_request_rejected_alone(tiny):
    _, _, model = tiny
    prompts = prompts_for(model.config.vocab_size)
    params = [greedy(n) for n in MAX_NEW]
    prompts.insert(2, list(range(3, 300)))
    params.insert(2, greedy(400))  # 297 + 400 tokens: more than the pool holds
    llm, outs = run(model, prompts, params, kv_cache_mib=0.05)
    assert outs[2].finish_reason == "rejected"
    assert "--kv-cache-mib" in outs[2].error and "696 tokens" in outs[2].error
    assert [len(o.token_ids) for i, o in enumerate(outs) if i != 2] == MAX_NEW
    assert llm.stats()["pages_free"] == llm.stats()["pages_total"]
    # Alone, it raises.
    with pytest.raises(ValueError, match="kv"):
        llm.generate([prompts[2]], params[2])


def test_max_model_len_rejects_with_the_flag(tiny):
    _, _, model = tiny
    llm = LLM(model=model, kv_cache_mib=4, max_model_len=64)
    with pytest.raises(ValueError, match="max.model.len"):
        llm.generate([list(range(3, 60))], greedy(10))


def test_eos_stops_and_is_not_in_text(tiny):
    _, _, model = tiny
    prompt = prompts_for(model.config.vocab_size)[3]
    llm = LLM(model=model, kv_cache_mib=4)
    first = llm.generate([prompt], greedy(20))[0].token_ids
    eos = first[5]
    llm.engine.eos_token_ids = frozenset({eos})
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(eos) + 1]
    assert out.stop_reason == eos


def test_smollm2_batching_changes_nothing_and_matches_transformers(smollm2, hf_smollm2):
    texts = [
        "The capital of France is",
        "Paging in operating systems",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a",
        "1, 2, 3, 4,",
        "Hi",
        "The key-value cache of a transformer stores",
        "Water boils at",
    ]
    llm = LLM(model=smollm2, kv_cache_mib=16)
    params = [greedy(n) for n in (32, 8, 12, 20, 16, 24, 10, 6)]
    outs = llm.generate(texts, params, use_tqdm=False)
    static = LLM(model=smollm2, kv_cache_mib=16, batching="static")
    outs_s = static.generate(texts, params, use_tqdm=False)
    for t, sp, o, s in zip(texts, params, outs, outs_s):
        alone = llm.generate([t], sp)[0]
        assert o.token_ids == alone.token_ids == s.token_ids
        assert o.text == alone.text and len(o.token_ids) == sp.max_tokens
    ref = hf_greedy(hf_smollm2, outs[0].prompt_token_ids, 32)
    assert outs[0].token_ids == ref


def test_smollm2_chat_stops_on_eos(smollm2):
    llm = LLM(model=smollm2, kv_cache_mib=16)
    out = llm.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=64, temperature=0)
    )[0]
    assert (
        out.prompt_token_ids[:2]
        == llm.tokenizer.encode("<|im_start|>system", add_special_tokens=False)[:2]
    )
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in smollm2.config.eos_token_ids
        assert "<|im_end|>" not in out.text
    assert out.time_to_first_token is not None and out.time_to_first_token > 0


def test_bad_prompt_is_rejected_alone_and_leaves_nothing_behind(tiny):
    _, _, model = tiny
    llm = LLM(model=model, kv_cache_mib=4)
    vocab = model.config.vocab_size
    outs = llm.generate([[5, 6, 7], [3, vocab + 5]], greedy(4))
    assert len(outs[0].token_ids) == 4
    assert outs[1].finish_reason == "rejected" and "vocabulary" in outs[1].error
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[vocab]], greedy(4))
    # Nothing half-submitted lingers: the next call runs normally.
    assert llm.generate([[8, 9]], greedy(3))[0].token_ids
    assert not llm.engine.has_unfinished()
    assert llm.stats()["pages_free"] == llm.stats()["pages_total"]


def test_stop_strings_without_a_tokenizer_are_refused(tiny):
    _, _, model = tiny
    llm = LLM(model=model, kv_cache_mib=4)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, stop=["x"]))


def test_prefill_graph_buckets_pad_little():
    """Token buckets of the single-sequence prefill graphs: sorted, capped by
    the step budget, and never more than 25 % padding above 256 tokens."""
    from pagedllm.runner.cuda_graphs import prefill_buckets

    buckets = prefill_buckets(8192)
    assert buckets == sorted(set(buckets)) and buckets[0] == 16 and buckets[-1] == 2048
    for n in range(1, 2049):
        b = next(x for x in buckets if x >= n)
        assert b - n < 16 if n <= 256 else b <= 1.25 * n
    assert prefill_buckets(100)[-1] == 96 and prefill_buckets(8) == []
