"""Sampling and stopping through the whole engine (issue: sampling and stopping).

Oracles: plain greedy, the naive full-forward loop (`forward_logits`) with the
penalty formula applied by hand, and `log_softmax` of the reference logits.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model import load_model
from tiny_models import make_tiny_llama_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny") / "m", seed=21, num_attention_heads=4, num_key_value_heads=2
    )
    return load_model(path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(model=tiny, kv_cache_mib=2)


PROMPTS = [[5, 9, 11, 40], list(range(60, 90)), [7] * 17, [300, 2, 99]]


def test_greedy_forms_agree_inside_a_sampled_batch(llm):
    n = 12
    plain = [
        o.token_ids
        for o in llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    ]
    topk1 = [
        o.token_ids
        for o in llm.generate(
            PROMPTS, SamplingParams(max_tokens=n, temperature=0.9, top_k=1, ignore_eos=True)
        )
    ]
    mixed_params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=n, temperature=1.3, top_p=0.9, ignore_eos=True),
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=n, temperature=2.0, ignore_eos=True),
    ]
    mixed = llm.generate(PROMPTS, mixed_params)
    assert topk1 == plain
    assert mixed[0].token_ids == plain[0] and mixed[2].token_ids == plain[2]


def test_seeded_requests_reproduce_alone_and_in_other_batches(llm):
    sp = SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], sp)[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True) for m in (5, 20, 9)]
    batch_a = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], sp, others[1]])
    batch_b = llm.generate([PROMPTS[1], PROMPTS[3]], [sp, others[2]])
    assert batch_a[1].token_ids == alone == batch_b[0].token_ids
    unseeded = {
        tuple(
            llm.generate(
                [PROMPTS[1]], SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True)
            )[0].token_ids
        )
        for _ in range(3)
    }
    assert len(unseeded) > 1  # sampling is really random without a seed


def naive_penalised_greedy(model, prompt, n, rep=1.0, presence=0.0, frequency=0.0):
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        logits = model.forward_logits(ids)[-1].clone()
        for t in set(prompt + out):  # repetition penalty: prompt and output tokens (HF rule)
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        nxt = int(logits.argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


@pytest.mark.parametrize(
    "rep,presence,frequency", [(1.8, 0.0, 0.0), (1.0, -1.5, -0.7), (1.0, 0.0, -2.0)]
)
def test_penalties_follow_the_formula(tiny, llm, rep, presence, frequency):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # A prompt that already holds its own greedy continuation invites repeats.
    first = llm.generate([PROMPTS[0]], greedy)[0].token_ids
    prompt = PROMPTS[0] + first + PROMPTS[0]
    sp = SamplingParams(
        max_tokens=24,
        temperature=0,
        ignore_eos=True,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    got = llm.generate([prompt], sp)[0].token_ids
    assert got == naive_penalised_greedy(tiny, prompt, 24, rep, presence, frequency)
    plain = llm.generate([prompt], greedy)[0].token_ids
    assert got != plain  # the penalty changed something


def test_logprobs_and_prompt_logprobs_match_log_softmax(tiny, llm):
    prompt = PROMPTS[1]
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    )[0]
    ref = torch.log_softmax(tiny.forward_logits(prompt + out.token_ids), -1)
    for i, (entry, tok) in enumerate(zip(out.logprobs, out.token_ids)):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert set(entry) == set(top.indices.tolist()) | {tok}
        for t, lp in entry.items():
            assert abs(lp - row[t].item()) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = ref[j - 1]
        assert abs(entry[prompt[j]] - row[prompt[j]].item()) < 1e-4
        assert set(row.topk(2).indices.tolist()) <= set(entry)


def test_last_layer_for_the_logits_rows_only_changes_no_logprob(tiny):
    """A prefill or mixed step runs the last layer's attention, o_proj and MLP
    for each sequence's last token only (decode attention over its pages):
    every sampled token's log-probs still equal the full forward pass's
    (`forward_logits`, no cache): whole prompts, a prompt computed in chunks
    after a cached prefix, and prompt chunks mixed with decode tokens."""
    g = torch.Generator().manual_seed(4)
    a = torch.randint(3, 500, (45,), generator=g).tolist()
    b = a[:32] + torch.randint(3, 500, (30,), generator=g).tolist()  # two pages cached
    c = torch.randint(3, 500, (5,), generator=g).tolist()
    llm = LLM(model=tiny, kv_cache_mib=2, max_num_batched_tokens=24, max_num_seqs=4)  # chunks
    shortcut = []
    real = tiny._layers

    def layers(impl, batch, hidden, kv_caches):
        out = real(impl, batch, hidden, kv_caches)
        shortcut.append((batch.is_decode, out[2]))
        return out

    tiny._layers = layers
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
        outs = [llm.generate([a], params)[0]] + llm.generate([c, b], params)
    finally:
        del tiny._layers
    assert (False, True) in shortcut and all(g for d, g in shortcut if not d)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 32
    for prompt, out in zip((a, c, b), outs):
        ref = torch.log_softmax(tiny.forward_logits(prompt + out.token_ids), -1)
        for i, (entry, tok) in enumerate(zip(out.logprobs, out.token_ids)):
            row = ref[len(prompt) - 1 + i]
            assert tok == int(row.argmax())
            for t, lp in entry.items():
                assert abs(lp - row[t].item()) < 1e-4, (i, t)


def test_min_tokens_and_stop_token_ids(tiny, llm):
    prompt = PROMPTS[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    stop_id = free[3]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free[: free.index(stop_id) + 1]
    late = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=12, temperature=0, min_tokens=8, stop_token_ids=[stop_id], ignore_eos=True
        ),
    )[0]
    assert len(late.token_ids) >= 8 and stop_id not in late.token_ids[:8]


@pytest.fixture(scope="module")
def smol_llm(smollm2):
    return LLM(model=smollm2, kv_cache_mib=16)


def test_stop_strings_straddling_tokens_never_leak(smol_llm):
    llm = smol_llm
    prompt = "The three primary colors are"
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    free = llm.generate([prompt], sp)[0]
    tok = llm.tokenizer
    pieces = [tok.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token and the start of the next.
    k = next(
        i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = free.text.index(stop)
    streamed: list[str] = []
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
        on_step=lambda step: streamed.extend(so.new_text for so in step),
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]
    assert "".join(streamed) == out.text  # nothing leaked, nothing lost
    keep = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=40,
            temperature=0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0]
    assert keep.text == free.text[: cut + len(stop)]


def test_generation_config_defaults_apply_when_unset(tiny):
    llm = LLM(model=tiny, kv_cache_mib=2)
    llm.engine.generation_defaults = {"temperature": 0.0}  # as if generation_config.json said so
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    greedy = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert out.token_ids == greedy.token_ids


def test_bad_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
