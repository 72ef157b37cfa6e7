"""Ops the model families of issue 35 need: sliding-window attention, head_dim 256,
GELU (tanh) gated MLPs.

The reference ops are checked against attention written out here (a dense,
masked softmax in float64 over each sequence's whole K/V) and against
transformers' own sliding-window mask function; the Triton kernels run on the
CPU under TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU,
and below for when this module runs alone) against the reference, on tiny
shapes. On a machine where the kernels are compiled, the Triton tests skip.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.ops import reference as ref  # noqa: E402

BS = 16  # page size


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    return ((out - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def allowed_keys(q_pos: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """(n, num_keys) bool: the keys a query at each position sees, written from the
    definition: causal, and with a window W > 0 only the last W positions."""
    k_pos = torch.arange(num_keys)[None, :]
    allowed = k_pos <= q_pos[:, None]
    if window:
        allowed &= k_pos > q_pos[:, None] - window
    return allowed


def naive_attention(q, k, v, q_pos, scale, window):
    """q (n, H, D) at positions q_pos; k, v (L, Hkv, D) of positions 0..L-1: a masked
    softmax in float64, one query head group at a time."""
    group = q.shape[1] // k.shape[1]
    kf = k.double().repeat_interleave(group, dim=1)  # (L, H, D)
    vf = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kf) * scale
    s = s.masked_fill(~allowed_keys(q_pos, k.shape[0], window)[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), vf)


def paged(seqs_k, seqs_v, dtype, gen):
    """Each sequence's whole K/V (L_b, Hkv, D) written into shuffled pages: the
    caches (NB, BS, Hkv, D) and block tables padded with -1."""
    hkv, d = seqs_k[0].shape[1:]
    pages_per_seq = [-(-k.shape[0] // BS) for k in seqs_k]
    num_pages = sum(pages_per_seq) + 2
    k_cache = torch.randn(num_pages, BS, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, BS, hkv, d, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.full((len(seqs_k), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for b, (k, v) in enumerate(zip(seqs_k, seqs_v)):
        n = pages_per_seq[b]
        tables[b, :n] = order[used : used + n].to(torch.int32)
        used += n
        pos = torch.arange(k.shape[0])
        slots = tables[b, pos // BS].long() * BS + pos % BS
        ref.store_kvcache(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache, tables


def prefill_case(gen, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32):
    """A packed prefill batch: every sequence's whole K/V (its cached prefix in the
    pages, its new tokens both there and in k, v), q of the new tokens."""
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    seqs_k = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    seqs_v = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    k_cache, v_cache, tables = paged(seqs_k, seqs_v, dtype, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    k = torch.cat([sk[c:] for sk, c in zip(seqs_k, ctx_lens)])
    v = torch.cat([sv[c:] for sv, c in zip(seqs_v, ctx_lens)])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q, k, v, cu, lens, k_cache, v_cache, tables), (seqs_k, seqs_v)


def naive_prefill(args, seqs, scale, window):
    q, _, _, cu, seq_lens, *_ = args
    outs = []
    for b, (sk, sv) in enumerate(zip(*seqs)):
        q_len = int(cu[b + 1] - cu[b])
        q_pos = torch.arange(int(seq_lens[b]) - q_len, int(seq_lens[b]))
        outs.append(naive_attention(q[int(cu[b]) : int(cu[b + 1])], sk, sv, q_pos, scale, window))
    return torch.cat(outs)


def decode_case(gen, lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32):
    seqs_k = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    seqs_v = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    k_cache, v_cache, tables = paged(seqs_k, seqs_v, dtype, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return (q, k_cache, v_cache, tables, seq_lens), (seqs_k, seqs_v)


def naive_decode(q, seqs, scale, window):
    outs = []
    for b, (sk, sv) in enumerate(zip(*seqs)):
        q_pos = torch.tensor([sk.shape[0] - 1])
        outs.append(naive_attention(q[b : b + 1], sk, sv, q_pos, scale, window))
    return torch.cat(outs)


# --------------------------------------------------------------------------
# Sliding-window attention: the reference
# --------------------------------------------------------------------------


def test_window_mask_is_transformers_sliding_window_mask():
    """The window this file (and the reference) uses is transformers' own:
    `sliding_window_causal_mask_function(W)` keeps kv_idx in (q_idx - W, q_idx]."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    q_pos, k_pos = torch.arange(40)[:, None], torch.arange(40)[None, :]
    for window in (1, 2, 5, 16, 39, 40, 100):
        hf = masking_utils.sliding_window_causal_mask_function(window)(0, 0, q_pos, k_pos)
        assert torch.equal(hf, allowed_keys(torch.arange(40), 40, window)), window
        assert int(hf[-1].sum()) == min(window, 40)  # W keys, its own included


@pytest.mark.parametrize("window", [0, 1, 5, 16, 23, 1000])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 1)])
def test_reference_prefill_window(gen, window, num_heads, num_kv_heads):
    """Ragged prompts with and without a cached prefix, some prefixes longer
    than the window (their first pages are never needed)."""
    q_lens, ctx_lens = [1, 16, 17, 40, 3, 33], [0, 0, 5, 33, 50, 16]
    args, seqs = prefill_case(gen, q_lens, ctx_lens, num_heads, num_kv_heads, 32)
    out = ref.prefill_attention(*args[:5], 0.2, *args[5:], window=window)
    assert rel_err(out, naive_prefill(args, seqs, 0.2, window)) < 1e-5


def test_reference_prefill_window_reads_no_page_before_it(gen):
    """Prefix pages wholly before the first new token's window are never read:
    poisoning them (NaN) changes nothing."""
    args, seqs = prefill_case(gen, [8], [70], 4, 2, 32)
    q, k, v, cu, seq_lens, k_cache, v_cache, tables = args
    want = naive_prefill(args, seqs, 0.2, 20)
    # Position 70 (the first new token) sees 51..70: pages 0-2 (positions 0..47) unused.
    k_cache[tables[0, :3].long()] = float("nan")
    v_cache[tables[0, :3].long()] = float("nan")
    out = ref.prefill_attention(q, k, v, cu, seq_lens, 0.2, k_cache, v_cache, tables, window=20)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("window", [0, 1, 7, 16, 33, 1000])
@pytest.mark.parametrize("chunked", [False, True])
def test_reference_decode_window(gen, window, chunked, monkeypatch):
    """One plain softmax over the pages, or (`chunked`: tiny chunks) the online
    softmax over chunks starting at the first page any window reads."""
    if chunked:
        monkeypatch.setattr(ref, "DECODE_CHUNK_ELEMENTS", 1)  # 256-token chunks
    lens = [1, 15, 16, 17, 70, 300, 600]
    (q, *rest), seqs = decode_case(gen, lens, 8, 2, 32)
    out = ref.decode_attention(q, *rest, 0.2, window=window)
    assert rel_err(out, naive_decode(q, seqs, 0.2, window)) < 1e-5
    q1, kc, vc, tables, seq_lens = q[-1:], *rest[:2], rest[2][-1:], rest[3][-1:]
    out1 = ref.decode_attention(q1, kc, vc, tables, seq_lens, 0.2, window=window)
    assert rel_err(out1, naive_decode(q1, [s[-1:] for s in seqs], 0.2, window)) < 1e-5


def test_reference_window_rejects_a_negative_window(gen):
    (q, *rest), _ = decode_case(gen, [5], 4, 2, 32)
    with pytest.raises(ValueError, match="window -1: must be >= 0"):
        ref.decode_attention(q, *rest, 0.2, window=-1)
