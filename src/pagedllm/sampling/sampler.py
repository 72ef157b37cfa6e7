"""Batched sampling: one step's logits (B, V) -> one token id per request (B,).

Owns: applying each request's own parameters to its row of logits, in one pass
over the batch, on whatever device the logits live (the same code on CPU and
CUDA). Does not own: which requests run (scheduler), the logits (model),
stopping (scheduler and engine), or the lifetime of seeded requests'
generators (the runner keeps one per seeded request, made by
`make_generator`, for the whole request).

Order, per row, as vLLM v1's `Sampler`:

  0. log-probs, when any request asks: `log_softmax` of the *raw* logits, before
     any processing (vLLM's default `logprobs_mode="raw_logprobs"`);
  1. min_tokens: EOS and `stop_token_ids` get -inf while the request has fewer
     than `min_tokens` outputs;
  2. penalties, on the logits as they are (no temperature yet):
       repetition (HF / CTRL), tokens seen in prompt or output: l > 0 -> l / r, else l * r
       frequency, presence (OpenAI), over output tokens only:
           l -= frequency * count;  l -= presence * (count > 0)
  3. greedy rows (temperature < 1e-5, or top_k == 1): argmax here, exactly;
  4. temperature: l / T;
  5. min_p: drop tokens whose probability is below min_p * (the top probability);
  6. top_k, then top_p over the renormalised survivors (the smallest set of the
     most likely tokens whose mass reaches p; the token that crosses p stays);
  7. sample by the exponential race: argmax_i(p_i / E_i), E_i ~ Exp(1) iid, which
     picks i with probability p_i. It runs in log space, as argmax_i((l_i - m) -
     log E_i) over the processed logits l (the Gumbel-max trick: no softmax, no
     probability that underflows to 0). m is the row's largest logit at
     temperatures below LOW_TEMPERATURE (0.1), else 0: it keeps the best tokens'
     scores near 0, where float32 still resolves the noise when l / T is in the
     millions. A seeded row draws its E from its own generator, so its tokens do
     not depend on the rest of the batch; the unseeded rows share one draw.

Constrained decoding (the runner): when every part of a step's sampling is
token by token (`SamplingMetadata.tokenwise`: no min_p, top-k, top-p or
log-probs), a token's score reads its own logit, its own noise and the row's
m only. So `scores` can be queued before the constraints' bitmask is made,
and the mask put on the scores afterwards (`pick`); the sampler's launches
leave the path that waits for the mask. The ids are the sampler's own, bit
for bit, for every row but one constrained and sampled below 0.1: its m is
then the largest logit of all tokens rather than of the allowed ones, so the
same distribution (m is a constant of the row) and the same ids unless two
scores fall within a float32 rounding of each other.

No host sync: metadata tensors are built from host lists (one copy per field,
through pinned memory on CUDA) and nothing on a GPU's tensors calls `.item()` or
`.tolist()` (top-p on the CPU reads which rows it decided: no device there).
The caller syncs once when it reads the sampled ids.
"""

from __future__ import annotations

import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pagedllm import ops
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.request import Request

NEG_INF = float("-inf")
# Below this temperature the race subtracts each row's largest logit first
# (`race_scores`): l / T would be large enough for float32's spacing to blur -log E.
LOW_TEMPERATURE = 0.1


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The generator of a seeded request (None when unseeded); keep it for the request's life."""
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # negative seeds wrap, as in numpy
    return g


def _pinned_to(t: Tensor, device: torch.device) -> Tensor:
    """One host-to-device copy, from pinned memory so it does not block the host."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _pinned_to(torch.tensor(values, dtype=dtype), device)


def _flat_index(rows: Sequence[int], token_lists: Sequence[Sequence[int]], vocab_size: int) -> list:
    """row * V + token for every token of every listed row: one flat list."""
    return [r * vocab_size + t for r, toks in zip(rows, token_lists) for t in toks]


def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> Tensor:
    """(B, V) float32: how often each token occurs in each row's list."""
    B = len(token_lists)
    counts = torch.zeros(B * vocab_size, dtype=torch.float32, device=device)
    # Flatten on the host in C (chain into an int64 array), no Python loop per token;
    # the per-token arithmetic runs on the device.
    flat_ids = array.array("q", chain.from_iterable(token_lists))
    N = len(flat_ids)
    if N == 0:
        return counts.view(B, vocab_size)
    ids = _pinned_to(torch.frombuffer(flat_ids, dtype=torch.int64), device)  # (N,)
    lens = _to_device([len(t) for t in token_lists], torch.int64, device)  # (B,)
    rows = torch.arange(B, device=device).repeat_interleave(lens, output_size=N)  # (N,)
    # Adding 1.0s is exact in float32, so the order of the (atomic) adds cannot matter.
    counts.scatter_add_(0, rows * vocab_size + ids, torch.ones(N, device=device))
    return counts.view(B, vocab_size)


@dataclass
class LogprobsTensors:
    """Log-probs of N rows: the chosen token's and the top K. Tensors on the logits' device."""

    token_ids: Tensor  # (N,) int64: the sampled (or given) token
    token_logprobs: Tensor  # (N,) float32: its log-prob
    topk_ids: Tensor  # (N, K) int64, most likely first
    topk_logprobs: Tensor  # (N, K) float32


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # (B,) int64
    # Set when any request asked for logprobs; K = the largest `logprobs` in the
    # batch: request i reads topk_*[i, : params.logprobs].
    logprobs: LogprobsTensors | None = None


@dataclass
class SamplingMetadata:
    """Per-step, per-request sampling inputs as tensors (B rows, in batch order).

    A field is None when no row needs it, so each step pays only for what its
    requests use. Build with `from_params` (or `from_requests`) once per step.
    """

    num_reqs: int
    all_greedy: bool  # fast path: one argmax
    all_random: bool  # no greedy row: skip the argmax and the where
    greedy_mask: Tensor | None  # (B,) bool; None when all_greedy or all_random
    temperature: Tensor | None  # (B,) float32, greedy rows 1.0; None when all_greedy
    top_k: Tensor | None  # (B,) int64 in [0, V], 0 = off; None when every row is off
    max_top_k: int  # max(top_k) on the host, so torch.topk needs no sync
    top_p: Tensor | None  # (B,) float32; None when every row is 1.0
    min_p: Tensor | None  # (B,) float32; None when every row is 0.0
    # Penalties: None when every row has the neutral value.
    repetition_penalties: Tensor | None  # (B,) float32
    frequency_penalties: Tensor | None  # (B,) float32
    presence_penalties: Tensor | None  # (B,) float32
    output_token_counts: Tensor | None  # (B, V) float32; set when any penalty is
    prompt_token_mask: Tensor | None  # (B, V) bool; set when any repetition penalty is
    # row * V + token for each (row, EOS / stop id) that min_tokens still forbids.
    min_tokens_index: Tensor | None  # (M,) int64
    max_num_logprobs: int | None  # None: no request asked
    # Batch row -> generator of a seeded, sampled (not greedy) request.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # (B, 1) bool: sampled rows whose temperature is below LOW_TEMPERATURE (the race
    # shifts their logits by the row's largest); None when there is none.
    low_temperature: Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_counts is None

    @property
    def tokenwise(self) -> bool:
        """Every part of this step's sampling reads each token's own logit only (no
        min_p, top-k or top-p, which compare tokens; no log-probs, which normalise
        over them): `Sampler.scores` may then be masked after it is computed."""
        return (
            self.min_p is None
            and self.top_k is None
            and self.top_p is None
            and self.max_num_logprobs is None
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        generators: Sequence[torch.Generator | None] | None = None,
        eos_token_ids: Sequence[Collection[int]] | None = None,
    ) -> SamplingMetadata:
        """Build one step's metadata; all lists are in batch-row order.

        output_token_ids / prompt_token_ids: each request's tokens so far (read
            only when a penalty or min_tokens needs them).
        generators: row i's persistent generator (`make_generator(seed, device)`);
            required for every seeded row.
        eos_token_ids: row i's EOS ids, forbidden (with `stop_token_ids`) while
            min_tokens is not reached; None = no EOS ids known.
        Unresolved params (fields None) are read with vLLM's defaults.
        """
        device = torch.device(device)
        B, V = len(params), vocab_size
        params = [p if p.is_resolved else p.resolved() for p in params]
        greedy = [p.greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        sampled = [not g for g in greedy]

        def per_row(values: list, neutral: float | int, dtype: torch.dtype) -> Tensor | None:
            # Greedy rows take the neutral value: their result is the argmax anyway.
            values = [v if s else neutral for v, s in zip(values, sampled)]
            if all(v == neutral for v in values):
                return None
            return _to_device(values, dtype, device)

        # 1. Sampling (greedy rows are neutral everywhere).
        temperature = greedy_mask = top_k = top_p = min_p = None
        max_top_k = 0
        if not all_greedy:
            temps = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
            temperature = _to_device(temps, torch.float32, device)
            ks = [min(p.top_k, V) if s else 0 for p, s in zip(params, sampled)]
            max_top_k = max(ks)
            top_k = _to_device(ks, torch.int64, device) if max_top_k > 0 else None
            top_p = per_row([p.top_p for p in params], 1.0, torch.float32)
            min_p = per_row([p.min_p for p in params], 0.0, torch.float32)
            if not all_random:
                greedy_mask = _to_device(greedy, torch.bool, device)

        # 2. Penalties (they apply to greedy rows too, as in vLLM).
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        any_rep = any(r != 1.0 for r in rep)
        any_penalty = any_rep or any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres)
        counts = prompt_mask = None
        if any_penalty:
            counts = _token_counts(output_token_ids, V, device)
        if any_rep:
            prompt_mask = _token_counts(prompt_token_ids, V, device) > 0

        def penalty(values: list, neutral: float) -> Tensor | None:
            if all(v == neutral for v in values):
                return None
            return _to_device(values, torch.float32, device)

        # 3. min_tokens: which (row, id) pairs are still forbidden.
        rows, banned = [], []
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                ids = set(p.stop_token_ids)
                if eos_token_ids is not None and not p.ignore_eos:
                    ids |= set(eos_token_ids[i])
                rows.append(i)
                banned.append(sorted(t for t in ids if t < V))
        flat_banned = _flat_index(rows, banned, V)
        min_tokens_index = _to_device(flat_banned, torch.int64, device) if flat_banned else None

        # 4. Seeded rows: their own generator (greedy rows draw nothing).
        gens: dict[int, torch.Generator] = {}
        for i, p in enumerate(params):
            g = None if generators is None else generators[i]
            if p.seed is not None and g is None:
                raise ValueError(
                    f"row {i} has seed={p.seed} but no generator; keep one per request "
                    "from make_generator(seed, device) and pass it every step"
                )
            if g is not None and sampled[i]:
                gens[i] = g

        asked = [p.logprobs for p in params if p.logprobs is not None]
        low = [s and p.temperature < LOW_TEMPERATURE for p, s in zip(params, sampled)]
        return cls(
            num_reqs=B,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=penalty(rep, 1.0),
            frequency_penalties=penalty(freq, 0.0),
            presence_penalties=penalty(pres, 0.0),
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            min_tokens_index=min_tokens_index,
            max_num_logprobs=max(asked) if asked else None,
            generators=gens,
            low_temperature=_to_device(low, torch.bool, device)[:, None] if any(low) else None,
        )

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[Request],
        vocab_size: int,
        device: torch.device | str,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SamplingMetadata:
        """`from_params` reading params, tokens and EOS ids from `Request`s."""
        return cls.from_params(
            [r.sampling_params for r in requests],
            [r.output_token_ids for r in requests],
            [r.prompt_token_ids for r in requests],
            vocab_size,
            device,
            generators,
            [r.eos_token_ids for r in requests],
        )


# --------------------------------------------------------------- the steps
# Each takes and returns (B, V) float32 logits, out of place: the caller's
# logits are never modified.


def apply_penalties(
    logits: Tensor,
    output_token_counts: Tensor,
    prompt_token_mask: Tensor | None,
    repetition_penalties: Tensor | None,
    frequency_penalties: Tensor | None,
    presence_penalties: Tensor | None,
) -> Tensor:
    """Repetition (prompt + output), then frequency and presence (output only)."""
    if repetition_penalties is not None:
        seen = output_token_counts > 0  # (B, V)
        if prompt_token_mask is not None:
            seen = seen | prompt_token_mask
        r = repetition_penalties[:, None]  # (B, 1)
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits)
    if frequency_penalties is not None:
        logits = logits - frequency_penalties[:, None] * output_token_counts
    if presence_penalties is not None:
        logits = logits - presence_penalties[:, None] * (output_token_counts > 0)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # (B, 1)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k_only(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Top-k without a full sort: torch.topk of the largest k in the batch. 0 = off."""
    values = logits.topk(max_top_k, dim=-1).values  # (B, max_top_k), descending
    kth = values.gather(1, (top_k.clamp(min=1) - 1)[:, None])  # (B, 1)
    kth = kth.masked_fill((top_k == 0)[:, None], NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)  # ties with the k-th stay


# apply_top_k_top_p first looks for each row's nucleus among its this many largest
# logits (torch.topk), before it sorts whole rows.
TOP_P_CANDIDATES = 256


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, max_top_k: int = 0
) -> Tensor:
    """Top-k then top-p over the renormalised survivors. On the CPU each row is
    first decided among its largest logits (`_top_p_candidates`: a topk of 256 or
    `max_top_k`, no sort of the row); the rows that cannot be decided there, and
    every row on a GPU, take one ascending sort (vLLM's reference path,
    `_top_k_top_p_sorted`). `max_top_k`: the largest top_k of the batch, on the
    host (0: read from `top_k` on the CPU)."""
    if top_p is not None and logits.device.type == "cpu":
        return _top_p_candidates(logits, top_k, top_p, max_top_k)
    return _top_k_top_p_sorted(logits, top_k, top_p)


def _top_k_top_p_sorted(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """`apply_top_k_top_p` by one ascending sort of each row."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # (B, V) ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, V)  # (B,)
        kth = sorted_logits.gather(1, (V - k)[:, None])  # (B, 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # mass of this token and all below
        drop = cum <= (1.0 - top_p)[:, None]  # the tokens above hold >= p without it
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_candidates(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor, max_top_k: int
) -> Tensor:
    """`apply_top_k_top_p` on the CPU, each row decided among its K largest logits
    where that can be done, else sorted (K: TOP_P_CANDIDATES, or the largest top_k
    if larger). A row's result depends on that row alone, never on the batch.

    A token outside the K is dropped by top-k when the K-th largest logit is
    already below the row's k-th (so are its ties), or by top-p when the K
    candidates hold at least top_p of the survivors' mass (every outsider has that
    much above it). A row with top-p off (1.0: also a greedy row) keeps its top-k
    survivors. On the CPU a topk of 256 over 49,152 logits took 0.13 ms against a
    sort's 4.2 ms. Ties at the nucleus's edge, and masses within a rounding of
    top_p, may fall the other way than in the sort (whose order among ties is
    unspecified anyway); top-p off keeps tokens whose probability rounds to 0,
    which the sort drops (they are never drawn)."""
    B, V = logits.shape
    if B == 0:
        return _top_k_top_p_sorted(logits, top_k, top_p)
    if top_k is not None and max_top_k <= 0:
        max_top_k = int(top_k.max())  # the CPU: no device to wait for
    K = max(TOP_P_CANDIDATES, max_top_k)
    if K >= V:
        return _top_k_top_p_sorted(logits, top_k, top_p)
    vals, idx = logits.topk(K, dim=-1)  # (B, K), descending
    if top_k is None:
        kth = torch.full((B, 1), NEG_INF)
        survivors = logits
    else:
        on = (top_k > 0)[:, None]
        kth = vals.gather(1, (top_k.clamp(1, K) - 1)[:, None])  # (B, 1): the k-th largest
        kth = torch.where(on, kth, torch.full_like(kth, NEG_INF))
        survivors = torch.where(logits >= kth, logits, NEG_INF)  # top-k (ties kept)
    lse = survivors.logsumexp(dim=-1, keepdim=True)  # (B, 1)
    p = torch.where(vals >= kth, torch.exp(vals - lse), torch.zeros_like(vals))
    above = p.cumsum(dim=-1) - p  # mass of the candidates ranked above each one
    off = (top_p >= 1.0)[:, None]
    decided = off | (p.sum(dim=-1, keepdim=True) >= top_p[:, None]) | (vals[:, -1:] < kth)
    keep = (vals >= kth) & (above < top_p[:, None])
    out = torch.full_like(logits, NEG_INF)
    out.scatter_(1, idx, torch.where(keep, vals, torch.full_like(vals, NEG_INF)))
    out = torch.where(off, survivors, out)
    if not bool(decided.all()):  # flat rows: their nucleus may reach past the K
        rows = (~decided[:, 0]).nonzero()[:, 0]
        sub_k = None if top_k is None else top_k[rows]
        out[rows] = _top_k_top_p_sorted(logits[rows], sub_k, top_p[rows])
    return out


def race_scores(
    logits: Tensor, generators: dict[int, torch.Generator], shift: Tensor | None = None
) -> Tensor:
    """The exponential race in log space: (logits - m) - log E, E ~ Exp(1) iid, a
    new (B, V) tensor whose row-wise argmax is token i with probability
    softmax(logits)_i. That is argmax(p / E) without p: no softmax, and a token
    whose probability would underflow float32 keeps its chance. m is the row's
    largest logit where `shift` (B, 1) bool says so (the rows sampled at a low
    temperature), else 0. Subtracting it keeps the best tokens' scores near 0,
    where float32 resolves the noise: at T = 1e-5 a logit of 30 is 3e6, whose
    float32 spacing (0.25) would swallow -log E and hand ties to the lower id; at
    T >= LOW_TEMPERATURE the spacing is below 1e-4 and the pass is saved. A -inf
    logit (masked, truncated) stays -inf; so does a row of them."""
    q = torch.empty_like(logits)
    if len(generators) < logits.shape[0]:
        _exponential_(q)  # one draw for all the unseeded rows
    for i, g in generators.items():
        _exponential_(q[i], g)  # V draws from the row's own stream, every step
    # E == 0 would give -log E = +inf, and a -inf logit plus +inf is NaN, which argmax picks.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    if shift is not None:
        m = logits.amax(dim=-1, keepdim=True)
        # Rows not shifted, and rows all -inf (-inf - -inf would be NaN), subtract 0.
        m = torch.where(shift & torch.isfinite(m), m, torch.zeros_like(m))
        logits = logits - m
    return torch.sub(logits, q.log_(), out=q)


def _exponential_(q: Tensor, generator: torch.Generator | None = None) -> None:
    """Fill q with E ~ Exp(1). On the CPU as -log U, U ~ Uniform[0, 1) drawn in
    float64: torch's `exponential_` there took 1.10 ms for 49,152 values
    (SmolLM2), this 0.34 (2 cores, 2026-12-05), about 0.8 ms of each sampled
    token. float64, not float32: float32's U comes in steps of 2^-24, so E would
    never fall below ~6e-8 and a token 16 or more nats below the best would win
    too rarely (0.76x as often at 16, never at 20); and U is kept off 0 (E = inf
    would make a row's only allowed token -inf). On CUDA `exponential_`."""
    if q.device.type == "cpu":
        u = torch.empty(q.shape, dtype=torch.float64)
        u.uniform_(generator=generator)
        q.copy_(u.clamp_min_(torch.finfo(torch.float64).tiny).log_().neg_())
    else:
        q.exponential_(generator=generator)


def random_sample(
    logits: Tensor, generators: dict[int, torch.Generator], shift: Tensor | None = None
) -> Tensor:
    """One id per row, drawn from softmax(logits): (B, V) float32 -> (B,)."""
    return race_scores(logits, generators, shift).argmax(dim=-1)


def compute_logprobs(logits: Tensor, num_logprobs: int, token_ids: Tensor) -> LogprobsTensors:
    """Log-probs of `token_ids` and the top `num_logprobs` of each row of `logits`.

    logits: (N, V); token_ids: (N,) int64. For prompt_logprobs, pass the prefill
    logits of prompt positions 0..P-2 and token_ids = prompt[1:] (position j
    predicts token j + 1); the first prompt token has no log-prob.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    topk_logprobs, topk_ids = logprobs.topk(num_logprobs, dim=-1)  # (N, K)
    token_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # (N,)
    return LogprobsTensors(token_ids, token_logprobs, topk_ids, topk_logprobs)


class Sampler:
    """logits (B, V) + SamplingMetadata -> SamplerOutput. Stateless but for
    `ops_mode` (which argmax runs: `ops.implementation(device, ops_mode)`)."""

    def __init__(self, ops_mode: str | None = None) -> None:
        self.ops_mode = ops_mode

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """`logits` in any float dtype (the model's): a step of greedy rows with
        nothing to apply takes the argmax as they are (exact: widening to float32
        keeps every value and their order); any other step works in float32."""
        raw_logits = logits
        # 3-7. Greedy and/or random, on the logits after 1 and 2.
        sampled = self.sample(self._processed(logits, meta), meta)
        # 0. Log-probs of the raw logits (vLLM's default), gathered at the sampled ids.
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw_logits, meta.max_num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs)

    def _processed(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        """Steps 1 and 2, out of place (float32 unless a greedy step has nothing to apply)."""
        if not (meta.all_greedy and meta.min_tokens_index is None and meta.no_penalties):
            logits = logits.float()  # (B, V); never modified in place below
        B, V = logits.shape
        # 1. min_tokens: EOS / stop ids are not allowed yet.
        if meta.min_tokens_index is not None:
            logits = logits.reshape(-1).index_fill(0, meta.min_tokens_index, NEG_INF).view(B, V)
        # 2. Penalties.
        if not meta.no_penalties:
            logits = apply_penalties(
                logits,
                meta.output_token_counts,
                meta.prompt_token_mask,
                meta.repetition_penalties,
                meta.frequency_penalties,
                meta.presence_penalties,
            )
        return logits

    def scores(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        """(B, V) scores whose row-wise argmax (`pick`) is the id `__call__` would
        sample, for a step whose sampling is token by token (`meta.tokenwise`):
        the processed logits for greedy rows, the race's (l - m) / T - log E for
        the others. A mask written over the scores (-inf where a constraint
        forbids) samples from the allowed tokens as masking the logits first
        would: bit for bit, but for masked rows sampled below LOW_TEMPERATURE,
        whose m is the largest logit of every token, not of the allowed ones (the
        same distribution; the same ids but at float32 rounding ties: the
        module's docstring). The noise is drawn here. May be `logits`
        itself (a greedy step with nothing to apply)."""
        if not meta.tokenwise:
            raise ValueError(
                "scores needs a step without min_p, top-k, top-p or log-probs "
                "(SamplingMetadata.tokenwise); sample such a step with the sampler itself"
            )
        logits = self._processed(logits, meta)
        if meta.all_greedy:
            return logits
        race = race_scores(
            logits / meta.temperature[:, None], meta.generators, meta.low_temperature
        )
        if meta.all_random:
            return race
        return torch.where(meta.greedy_mask[:, None], logits, race, out=race)

    def pick(self, scores: Tensor) -> Tensor:
        """The row-wise argmax of `scores` (after any mask): (B, V) -> (B,) int64."""
        return ops.implementation(scores.device, self.ops_mode).argmax(scores)

    def sample(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        # Greedy rows: Triton's two-stage argmax on CUDA (torch's ran as one block).
        impl = ops.implementation(logits.device, self.ops_mode)
        greedy = None if meta.all_random else impl.argmax(logits)
        if meta.all_greedy:
            return greedy
        logits = logits / meta.temperature[:, None]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
        elif meta.top_k is not None:
            logits = apply_top_k_only(logits, meta.top_k, meta.max_top_k)
        random = random_sample(logits, meta.generators, meta.low_temperature)
        if greedy is None:
            return random
        return torch.where(meta.greedy_mask, greedy, random)
