"""The reference ops against naive formulas: the paged decode's online softmax
(one chunk and many chunks) and prefill over a cached prefix."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import reference as R


def naive_attention(q, k, v, scale):
    """q (H, D) attends to k, v (n, Hkv, D): plain softmax."""
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = torch.einsum("hd,nhd->hn", q, k) * scale
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v)


def paged(lens, hkv=2, d=16, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 3
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[i, j] = perm.pop()
    return kc, vc, tables


@pytest.mark.parametrize("chunk_elements", [R.DECODE_CHUNK_ELEMENTS, 1])
def test_decode_attention_online_softmax(monkeypatch, chunk_elements):
    monkeypatch.setattr(R, "DECODE_CHUNK_ELEMENTS", chunk_elements)  # 1: 256-token chunks
    lens = [1, 15, 16, 17, 300, 1000]
    kc, vc, tables = paged(lens)
    q = torch.randn(len(lens), 8, 16)
    out = R.decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 0.3)
    for b, n in enumerate(lens):
        pages = tables[b, : -(-n // 16)].long()
        k = kc[pages].flatten(0, 1)[:n]
        v = vc[pages].flatten(0, 1)[:n]
        torch.testing.assert_close(out[b], naive_attention(q[b], k, v, 0.3), rtol=1e-5, atol=1e-5)


def test_prefill_with_cached_prefix_equals_whole_sequence():
    torch.manual_seed(1)
    n, ctx, hkv, d = 40, 23, 2, 16
    k_all, v_all = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    q_all = torch.randn(n, 6, d)
    whole = R.prefill_attention(q_all, k_all, v_all, torch.tensor([0, n]), torch.tensor([n]), 0.25)
    kc, vc, tables = paged([n], hkv=hkv, d=d)
    slots = torch.tensor([int(tables[0, i // 16]) * 16 + i % 16 for i in range(n)])
    R.store_kvcache(k_all, v_all, kc, vc, slots)
    part = R.prefill_attention(
        q_all[ctx:],
        k_all[ctx:],
        v_all[ctx:],
        torch.tensor([0, n - ctx]),
        torch.tensor([n]),
        0.25,
        kc,
        vc,
        tables,
    )
    torch.testing.assert_close(part, whole[ctx:], rtol=1e-5, atol=1e-5)
