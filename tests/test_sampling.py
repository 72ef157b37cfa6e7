"""The batched sampler: greedy stays greedy, seeds reproduce, distributions are exact.

Distributions are checked with a chi-square test against the exact truncated
distribution, computed independently here in float64 (plain Python). The
p-value comes from the regularised upper incomplete gamma function:
p = Q(df / 2, chi2 / 2) = torch.special.gammaincc.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling import Sampler, SamplingMetadata, compute_logprobs, make_generator
from pagedllm.sampling.sampler import apply_penalties
from pagedllm.sampling_params import SamplingParams

V = 10
LOGITS = [2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.5]
N_DRAWS = 20_000
ALPHA = 1e-3
sampler = Sampler()


def meta_for(params, vocab_size=V, outputs=None, prompts=None, generators=None, eos=None):
    B = len(params)
    return SamplingMetadata.from_params(
        params,
        outputs if outputs is not None else [[] for _ in range(B)],
        prompts if prompts is not None else [[0] for _ in range(B)],
        vocab_size,
        "cpu",
        generators,
        eos,
    )


# ------------------------------------------------------------ reference distributions
def softmax(xs: list[float]) -> list[float]:
    m = max(x for x in xs if x != -math.inf)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [x / s for x in e]


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """vLLM's order: temperature, min_p, top_k, top_p (float64, plain Python)."""
    lg = [x / temperature for x in logits]
    p = softmax(lg)
    if min_p > 0:
        lg = [x if pi >= min_p * max(p) else -math.inf for x, pi in zip(lg, p)]
    order = sorted(range(len(lg)), key=lambda i: -lg[i])
    if top_k > 0:
        lg = [x if i in order[:top_k] else -math.inf for i, x in enumerate(lg)]
    if top_p < 1.0:
        p = softmax(lg)
        keep, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            keep.add(i)
            mass += p[i]
        lg = [x if i in keep else -math.inf for i, x in enumerate(lg)]
    return softmax(lg)


def chi_square_pvalue(counts: list[int], probs: list[float]) -> float:
    """p-value of observed counts under probs. A zero-probability hit fails outright."""
    n = sum(counts)
    stat, df = 0.0, -1
    for c, p in zip(counts, probs):
        if p == 0.0:
            if c:
                return 0.0
            continue
        stat += (c - n * p) ** 2 / (n * p)
        df += 1
    if df == 0:
        return 1.0
    return torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    ).item()


def draw_counts(params: SamplingParams, seed: int = 0) -> list[int]:
    """N_DRAWS samples of the fixed logit vector, in one batched call."""
    torch.manual_seed(seed)
    logits = torch.tensor([LOGITS] * N_DRAWS)  # (N, V)
    out = sampler(logits, meta_for([params.resolved()] * N_DRAWS))
    return torch.bincount(out.sampled_token_ids, minlength=V).tolist()


CASES = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "all": dict(temperature=0.9, min_p=0.05, top_k=7, top_p=0.87),
    "top_k_top_p": dict(temperature=1.3, top_k=6, top_p=0.75),
}


def test_top_p_cases_are_not_on_a_boundary():
    # The chosen p must sit well inside a gap of the cumulative mass, so float32
    # cumsum rounding cannot change which tokens survive.
    for kw in CASES.values():
        if "top_p" in kw:
            kw2 = {k: v for k, v in kw.items() if k != "top_p"}
            p = sorted(reference_probs(LOGITS, **kw2), reverse=True)
            cum = [sum(p[: i + 1]) for i in range(len(p))]
            assert min(abs(c - kw["top_p"]) for c in cum) > 0.01


@pytest.mark.parametrize("case", list(CASES))
def test_distribution_matches_exact_truncation(case):
    kw = CASES[case]
    probs = reference_probs(LOGITS, **kw)
    counts = draw_counts(SamplingParams(**kw))
    assert chi_square_pvalue(counts, probs) > ALPHA, (counts, probs)
    # The truncation really truncates (otherwise the case tests nothing new).
    if case in ("top_k", "top_p", "min_p", "all", "top_k_top_p"):
        assert 0 < sum(p > 0 for p in probs) < V


def test_chi_square_has_teeth():
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=0.8))
    right = reference_probs(LOGITS, top_p=0.8)
    assert chi_square_pvalue(counts, right) > ALPHA
    # Wrong temperature, no truncation, and top-p dropping the token that crosses p.
    assert chi_square_pvalue(counts, reference_probs(LOGITS, temperature=1.15, top_p=0.8)) < ALPHA
    assert chi_square_pvalue(counts, reference_probs(LOGITS)) < ALPHA
    off_by_one = reference_probs(LOGITS, top_p=0.8)
    last = min((p, i) for i, p in enumerate(off_by_one) if p > 0)[1]
    off_by_one[last] = 0.0
    off_by_one = [p / sum(off_by_one) for p in off_by_one]
    assert chi_square_pvalue(counts, off_by_one) < ALPHA


def test_sampled_ids_use_top_k_only_path_and_sort_path_alike():
    # top_k alone goes through torch.topk, top_k with top_p through a sort.
    torch.manual_seed(1)
    logits = torch.randn(64, 200)
    m1 = meta_for([SamplingParams(top_k=5)] * 64, vocab_size=200)
    m2 = meta_for([SamplingParams(top_k=5, top_p=1.0 - 1e-9)] * 64, vocab_size=200)
    assert m1.top_p is None and m2.top_p is not None
    torch.manual_seed(2)
    a = sampler(logits, m1).sampled_token_ids
    torch.manual_seed(2)
    b = sampler(logits, m2).sampled_token_ids
    assert torch.equal(a, b)


def test_top_p_among_the_largest_logits_equals_the_sort(monkeypatch):
    """Top-p (with or without top-k) on the CPU first decides each row among its
    TOP_P_CANDIDATES largest logits (a topk, no sort of the row): the kept logits
    are those of the sort, bit for bit. Only the rows it cannot decide there (a
    flat row: its nucleus reaches past them) are sorted, whatever the rest of the
    batch; a row with top-p off (1.0, as a greedy row has) keeps its top-k."""
    from pagedllm.sampling import sampler as sampler_mod

    sorted_rows = []
    real_sort = sampler_mod._top_k_top_p_sorted

    def counting(logits, *a):
        sorted_rows.append(logits.shape[0])
        return real_sort(logits, *a)

    monkeypatch.setattr(sampler_mod, "_top_k_top_p_sorted", counting)
    g = torch.Generator().manual_seed(5)
    B, V = 12, 2000
    logits = torch.randn(B, V, generator=g)
    head = torch.randint(0, V, (B, 40), generator=g)
    logits.scatter_add_(1, head, torch.rand(B, 40, generator=g) * 6 + 4)  # a peaked head
    logits[3] *= 0.05  # a flat row: thousands of ids in its nucleus
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.9, 1.0, 0.9] * 2)
    for ks in ([0] * B, [0, 5, 40, 0, 300, 7] * 2):
        top_k = torch.tensor(ks) if any(ks) else None
        sorted_rows.clear()
        got = sampler_mod.apply_top_k_top_p(logits, top_k, top_p, max(ks))
        assert sorted_rows == [1], ks  # the flat row alone
        assert torch.equal(got, real_sort(logits, top_k, top_p)), ks
        assert torch.equal(got[4], logits[4] if top_k is None else got[4])  # top-p off


@pytest.mark.parametrize("seed", range(8))
def test_top_p_candidates_against_the_sort_on_mixed_rows(seed):
    """Random batches just past TOP_P_CANDIDATES ids and beyond: peaked and flat
    rows, top-k off, small and above the candidates, top-p 0.5 to 1, some ids -inf
    (min_tokens, penalties): every row equals the sort's (found by a review: rows
    with top-p off, and rows without top-k beside rows with it)."""
    from pagedllm.sampling import sampler as sampler_mod

    g = torch.Generator().manual_seed(seed)
    V = [257, 300, 1000, 3000][seed % 4]
    B = 8
    logits = torch.randn(B, V, generator=g) * (1 + 3 * torch.rand(B, 1, generator=g))
    head = torch.randint(0, V, (B, 20), generator=g)
    logits.scatter_add_(1, head, torch.rand(B, 20, generator=g) * 10)
    logits[torch.rand(B, V, generator=g) < 0.05] = float("-inf")
    top_p = torch.tensor([0.5, 0.8, 0.9, 0.95, 1.0, 0.99, 0.7, 1.0])
    ks = torch.tensor([0, 3, 50, 0, 20, 400, 0, 0])[torch.randperm(B, generator=g)]
    ks = ks.clamp(max=V)  # as SamplingMetadata clamps top_k
    for top_k in (None, ks):
        mk = 0 if top_k is None else int(top_k.max())
        got = sampler_mod.apply_top_k_top_p(logits, top_k, top_p, mk)
        want = sampler_mod._top_k_top_p_sorted(logits, top_k, top_p)
        assert torch.equal(got, want), (seed, top_k)
    # The default max_top_k (0) is read from top_k on the CPU.
    assert torch.equal(
        sampler_mod.apply_top_k_top_p(logits, ks, top_p),
        sampler_mod._top_k_top_p_sorted(logits, ks, top_p),
    )


def test_top_p_among_the_largest_logits_samples_the_exact_distribution():
    """The distribution through the candidates' path (600 ids, more than
    TOP_P_CANDIDATES): a chi-square against the exact truncation."""
    big = [6.0 - 0.45 * i for i in range(20)] + [-4.0] * 580
    probs = reference_probs(big, temperature=1.0, top_p=0.8)
    p_sorted = sorted(probs, reverse=True)
    assert 0 < sum(q > 0 for q in probs) < 20  # the nucleus is inside the head
    full = sorted(reference_probs(big), reverse=True)
    cum = [sum(full[: i + 1]) for i in range(20)]
    assert min(abs(c - 0.8) for c in cum) > 0.01  # not on a boundary
    torch.manual_seed(4)
    n = N_DRAWS
    logits = torch.tensor([big] * n)
    meta = meta_for([SamplingParams(temperature=1.0, top_p=0.8).resolved()] * n, vocab_size=600)
    ids = sampler(logits, meta).sampled_token_ids
    counts = torch.bincount(ids, minlength=600).tolist()
    assert chi_square_pvalue(counts, probs) > ALPHA, (counts[:20], p_sorted[:20])


# ------------------------------------------------------------ greedy
def test_greedy_variants_equal_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    want = logits.argmax(-1)
    t0 = [SamplingParams(temperature=0.0)] * 6
    k1 = [SamplingParams(temperature=1.5, top_k=1)] * 6
    for params in (t0, k1):
        meta = meta_for(params, vocab_size=300)
        assert meta.all_greedy
        assert torch.equal(sampler(logits, meta).sampled_token_ids, want)


def test_bf16_logits_sample_as_their_float32_widening():
    """The model hands over bf16 logits: a greedy step takes their argmax as they
    are, any other step (penalties, sampling) and the log-probs widen them first;
    either way the result equals the float32 path's on the widened values. Ties
    (bf16 has 8 bits of mantissa) go to the first index in both."""
    torch.manual_seed(0)
    logits = (torch.randn(5, 300) * 3).to(torch.bfloat16)
    logits[2, 7] = logits[2, 100] = logits[2].max() + 1  # a tie
    wide = logits.float()
    gens = [make_generator(11 + i, "cpu") for i in range(5)]
    for params, generators in (
        ([SamplingParams(temperature=0.0, logprobs=2)] * 5, None),
        ([SamplingParams(temperature=0.0, presence_penalty=0.5)] * 5, None),
        ([SamplingParams(temperature=0.8, top_p=0.9, seed=11)] * 5, gens),
    ):
        outs = []
        for x in (logits, wide):
            for i, g in enumerate(gens):
                g.manual_seed(11 + i)  # both calls draw the same noise
            outs.append(sampler(x, meta_for(params, 300, [[7]] * 5, generators=generators)))
        got, want = outs
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
        if params[0].logprobs:
            assert got.sampled_token_ids[2] == 7
            assert torch.equal(got.logprobs.topk_logprobs, want.logprobs.topk_logprobs)


def test_greedy_rows_inside_a_sampled_batch_stay_greedy():
    torch.manual_seed(0)
    B = 16
    logits = torch.randn(B, 300) * 0.1  # flat: sampled rows rarely hit the argmax
    params = [
        SamplingParams(temperature=0.0)
        if i % 3 == 0
        else SamplingParams(temperature=1.0, top_k=1)
        if i % 3 == 1
        else SamplingParams(temperature=2.0, top_p=0.95, seed=i)
        for i in range(B)
    ]
    gens = [make_generator(p.seed, "cpu") for p in params]
    meta = meta_for(params, vocab_size=300, generators=gens)
    assert not meta.all_greedy and not meta.all_random
    got = sampler(logits, meta).sampled_token_ids
    want = logits.argmax(-1)
    greedy_rows = [i for i in range(B) if i % 3 != 2]
    assert torch.equal(got[greedy_rows], want[greedy_rows])
    assert not torch.equal(got, want)  # the sampled rows did sample


def test_greedy_with_penalties_is_argmax_of_penalised_logits():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    p = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    out = sampler(logits, meta_for([p], vocab_size=4, outputs=[[0]], prompts=[[3]]))
    assert out.sampled_token_ids.tolist() == [1]  # 3.0 / 1.2 < 2.9


@pytest.mark.parametrize(
    "label",
    ["random", "seeded and greedy rows", "penalties and min_tokens", "greedy, bf16"],
)
def test_scores_masked_after_give_the_ids_of_masking_first(label):
    """Constrained decoding masks the sampler's scores after the noise is drawn
    (`Sampler.scores`, then `pick`) where sampling is token by token: the ids
    must be those of masking the logits first, bit for bit, with the same draws.
    The mask: random rows of a batch, some rows unmasked, one allowing 1 id."""
    B, V2 = 6, 300
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(B, V2, generator=g) * 4
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.3, 0.2, 1.0, 2.0)]
    outputs, eos = [[] for _ in range(B)], None
    if label == "seeded and greedy rows":
        params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.9, seed=5),
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.2, seed=6),
            SamplingParams(temperature=0.5),
        ]
    elif label == "penalties and min_tokens":
        params = [
            SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5),
            SamplingParams(temperature=1.0, presence_penalty=0.7, min_tokens=3),
        ] * 3
        outputs = [[1, 2, 2, 9], [4]] * 3
        eos = [{0}] * B
    elif label == "greedy, bf16":
        params = [SamplingParams(temperature=0.0)] * B
        logits = logits.bfloat16()
    params = [p.resolved() for p in params]
    keep = torch.rand(B, V2, generator=g) < 0.3
    keep[:, 0] = True
    keep[3] = False
    keep[3, 17] = True  # one allowed id
    rows = [0, 1, 3, 4]  # rows 2 and 5 unconstrained

    def masked(t):
        t = t.clone()
        t[rows] = t[rows].masked_fill(~keep[rows], float("-inf"))
        return t

    def meta():
        gens = [make_generator(p.seed, "cpu") for p in params]
        return meta_for(params, V2, outputs=outputs, generators=gens, eos=eos)

    torch.manual_seed(3)
    first = sampler(masked(logits), meta()).sampled_token_ids
    torch.manual_seed(3)
    m = meta()
    assert m.tokenwise
    after = sampler.pick(masked(sampler.scores(logits, m)))
    assert after.tolist() == first.tolist()
    for r in rows:
        assert keep[r, after[r]]
    assert after[3] == 17


def test_tied_logits_split_evenly_at_a_very_low_temperature():
    """Two equal top logits at T = 1.1e-5 (just above greedy): each wins half the
    draws. Unshifted, 30 / T is 2.7e6, where float32 steps by 0.25 and swallows most
    of -log E's difference, so the lower id won about 53 % (found by a review)."""
    n = 20_000
    torch.manual_seed(2)
    logits = torch.tensor([[30.0, 30.0, 29.0, 0.0]] * n)
    params = [SamplingParams(temperature=1.1e-5).resolved()] * n
    ids = sampler(logits, meta_for(params, vocab_size=4)).sampled_token_ids
    share = (ids == 1).float().mean().item()
    assert set(ids.tolist()) <= {0, 1}
    assert abs(share - 0.5) < 0.0035 * 4, share  # four standard deviations


def test_scores_refuse_steps_that_compare_tokens():
    for p in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(logprobs=2)):
        m = meta_for([SamplingParams(temperature=1.0, **p).resolved()])
        assert not m.tokenwise
        with pytest.raises(ValueError, match="tokenwise"):
            sampler.scores(torch.zeros(1, V), m)


def test_input_logits_are_not_modified():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    copy = logits.clone()
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1, repetition_penalty=1.3, min_tokens=2)
    ] * 4
    sampler(logits, meta_for(params, vocab_size=50, outputs=[[1, 2]] * 4, eos=[{3}] * 4))
    assert torch.equal(logits, copy)


# ------------------------------------------------------------ seeds
def step_logits(step: int, V: int = 500) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(V, generator=g)  # the same row for the seeded request every time


def generate(batch: list[SamplingParams], row: int, steps: int = 6) -> list[int]:
    """Token ids of batch[row] over `steps` steps; companions get their own random logits."""
    gens = [make_generator(p.seed, "cpu") for p in batch]
    torch.manual_seed(len(batch))  # unseeded companions draw from the global stream
    tokens = []
    for s in range(steps):
        logits = torch.randn(len(batch), 500)
        logits[row] = step_logits(s)
        meta = SamplingMetadata.from_params(
            batch, [[] for _ in batch], [[0] for _ in batch], 500, "cpu", gens
        )
        tokens.append(sampler(logits, meta).sampled_token_ids[row].item())
    return tokens


def test_seeded_request_reproduces_alone_and_in_any_batch():
    me = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = generate([me], 0)
    assert generate([me], 0) == alone
    others = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, seed=99),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    assert generate([*others, me], 4) == alone
    assert generate([me, *others[:2]], 0) == alone
    assert generate([others[2], me, others[0]], 1) == alone
    # Another seed gives other tokens.
    assert generate([SamplingParams(temperature=1.0, top_p=0.95, seed=4321)], 0) != alone


def test_seed_without_generator_is_refused():
    with pytest.raises(ValueError, match="make_generator"):
        meta_for([SamplingParams(seed=1)])


# ------------------------------------------------------------ penalties
def reference_penalties(logits, prompt, output, rep, pres, freq):
    """The formula, one token at a time (HF repetition; OpenAI presence/frequency)."""
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        c = output.count(t)
        out[t] -= freq * c
        out[t] -= pres * (c > 0)
    return out


def test_penalties_follow_the_formula():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.0, 0.5, -3.0, 1.5, 4.0, -0.25],
            [1.0, 1.0, -2.0, 0.0, 3.0, -0.5, 0.25, 2.5],
            [0.3, -0.3, 0.7, -0.7, 1.1, -1.1, 0.0, 5.0],
        ]
    )
    prompts = [[0, 1, 2], [7, 7], [5]]
    outputs = [[3, 3, 4, 1], [0, 0, 0, 6], []]
    params = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(repetition_penalty=2.0, presence_penalty=2.0, frequency_penalty=-2.0),
    ]
    meta = meta_for(params, vocab_size=8, outputs=outputs, prompts=prompts)
    got = apply_penalties(
        logits,
        meta.output_token_counts,
        meta.prompt_token_mask,
        meta.repetition_penalties,
        meta.frequency_penalties,
        meta.presence_penalties,
    )
    for i, p in enumerate(params):
        want = reference_penalties(
            logits[i].tolist(),
            prompts[i],
            outputs[i],
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_neutral_penalties_cost_nothing_and_change_nothing():
    meta = meta_for([SamplingParams(), SamplingParams(temperature=0.0)])
    assert meta.no_penalties and meta.output_token_counts is None
    # A penalised row next to a neutral one leaves the neutral row bit-identical.
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    meta = meta_for(params, outputs=[[1, 1], [1, 2]])
    logits = torch.tensor([LOGITS, LOGITS])
    got = apply_penalties(
        logits, meta.output_token_counts, None, None, meta.frequency_penalties, None
    )
    assert torch.equal(got[1], logits[1])
    assert got[0, 1].item() == pytest.approx(LOGITS[1] - 2.0)


# ------------------------------------------------------------ min_tokens
def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # EOS (2) is the argmax, stop id 3 next
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    ids = lambda out, eos={2}: sampler(  # noqa: E731
        logits, meta_for([p], vocab_size=5, outputs=[out], eos=[eos])
    ).sampled_token_ids.item()
    assert ids([]) == 4 and ids([1]) == 4
    assert ids([1, 1]) == 2  # min_tokens reached
    q = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, meta_for([q], 5, [[]], eos=[{2}])).sampled_token_ids.item() == 2


# ------------------------------------------------------------ logprobs
def test_logprobs_are_raw_log_softmax_with_right_topk():
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    logits[4] = logits[4] * 0.3
    logits[4, :2] = torch.tensor([3.0, 2.9])  # a repetition penalty on 0 makes 1 the argmax
    params = [
        SamplingParams(temperature=0.7, top_k=20, logprobs=5, presence_penalty=1.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0),  # asks nothing; gets the batch's K anyway
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1),
    ]
    outputs = [[3, 4], [], [], [1], [0]]
    out = sampler(logits, meta_for(params, vocab_size=100, outputs=outputs))
    lp = out.logprobs
    ref = torch.log_softmax(logits.double(), -1)
    assert lp is not None and lp.topk_ids.shape == (5, 5)
    ids = out.sampled_token_ids
    assert torch.equal(lp.token_ids, ids)
    want_tok = ref.gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(lp.token_logprobs.double(), want_tok, rtol=0, atol=1e-5)
    ref_topk = ref.topk(5, -1)
    assert torch.equal(lp.topk_ids, ref_topk.indices)
    torch.testing.assert_close(lp.topk_logprobs.double(), ref_topk.values, rtol=0, atol=1e-5)
    assert ids[1].item() == ref[1].argmax().item()  # greedy without penalties: the top token
    assert ids[4].item() == 1 and ref[4].argmax().item() != 1  # the penalised argmax lost


def test_no_logprobs_unless_asked():
    out = sampler(torch.tensor([LOGITS]), meta_for([SamplingParams()]))
    assert out.logprobs is None


def test_compute_logprobs_for_prompt():
    torch.manual_seed(0)
    prompt = [5, 9, 1, 7]
    logits = torch.randn(len(prompt), 12)  # prefill logits, one per prompt position
    lp = compute_logprobs(logits[:-1], 3, torch.tensor(prompt[1:]))
    ref = torch.log_softmax(logits[:-1], -1)
    for j, tok in enumerate(prompt[1:]):
        assert lp.token_logprobs[j].item() == pytest.approx(ref[j, tok].item(), abs=1e-6)
    assert torch.equal(lp.topk_ids, ref.topk(3, -1).indices)


# ------------------------------------------------------------ metadata
def test_metadata_fields_are_none_when_unused():
    meta = meta_for([SamplingParams(temperature=0.5)] * 3)
    assert meta.all_random and meta.greedy_mask is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.max_num_logprobs is None and meta.min_tokens_index is None
    meta = meta_for([SamplingParams(temperature=0.5, top_k=50)])  # top_k > V is clamped
    assert meta.max_top_k == V
    assert meta.low_temperature is None  # no row below 0.1: the race subtracts nothing
    meta = meta_for([SamplingParams(temperature=t) for t in (0.05, 0.0, 0.5)])
    assert meta.low_temperature.flatten().tolist() == [True, False, False]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_greedy_seeds_and_no_host_sync():
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=7)] * 4
    params += [
        SamplingParams(
            temperature=0.8,
            top_k=40,
            top_p=0.9,
            min_p=0.02,
            logprobs=3,
            min_tokens=3,
            repetition_penalty=1.1,
            frequency_penalty=0.5,
        )
    ]
    B = len(params)
    logits = torch.randn(B, 1000)
    outs = []
    for _ in range(2):
        gens = [make_generator(p.seed, "cuda") for p in params]
        logits_cuda = logits.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
        try:
            meta = SamplingMetadata.from_params(
                params, [[1, 5]] * B, [[2]] * B, 1000, "cuda", gens, [{0}] * B
            )
            out = sampler(logits_cuda, meta)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        outs.append(out.sampled_token_ids.cpu())
    greedy_rows = [0, 2, 4, 6]
    assert torch.equal(outs[0][greedy_rows], logits.argmax(-1)[greedy_rows])
    seeded_rows = [1, 3, 5, 7]
    assert torch.equal(outs[0][seeded_rows], outs[1][seeded_rows])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["all", "top_k", "min_p"])
def test_cuda_distribution_matches_exact_truncation(case):
    kw = CASES[case]
    torch.manual_seed(0)
    logits = torch.tensor([LOGITS] * N_DRAWS, device="cuda")
    meta = SamplingMetadata.from_params(
        [SamplingParams(**kw).resolved()] * N_DRAWS, [[]] * N_DRAWS, [[0]] * N_DRAWS, V, "cuda"
    )
    ids = sampler(logits, meta).sampled_token_ids
    counts = torch.bincount(ids, minlength=V).tolist()
    assert chi_square_pvalue(counts, reference_probs(LOGITS, **kw)) > ALPHA


def test_from_requests_reads_tokens_params_and_eos():
    from pagedllm.request import Request

    p = SamplingParams(temperature=0.0, min_tokens=1, repetition_penalty=2.0)
    req = Request(0, [1], p, eos_token_ids=frozenset({2}))
    logits = torch.tensor([[0.0, 4.0, 5.0, 3.0, -1.0]])  # EOS 2 is the argmax; 1 is in the prompt
    meta = SamplingMetadata.from_requests([req], 5, "cpu")
    assert sampler(logits, meta).sampled_token_ids.item() == 3  # EOS masked, 4.0 / 2 < 3.0
    req.append_output_token(3)
    meta = SamplingMetadata.from_requests([req], 5, "cpu")
    assert sampler(logits, meta).sampled_token_ids.item() == 2
