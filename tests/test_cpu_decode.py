"""The CPU decode path's shortcuts against the general reference (issue 38).

Batch-1 decode attention on the CPU takes a path of fewer PyTorch ops
(`reference._decode_attention_one`); it must give what the general, masked
path gives for the same sequence, for every length around a page's edge, an
empty sequence, and half-precision and float8 pages.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import reference as R
from test_reference_ops import naive_attention, paged


def general_path(q, kc, vc, tables, lens, scale):
    """The masked path for the same rows: a window wider than any sequence changes
    nothing in the result but takes decode_attention's general branch."""
    return R.decode_attention(q, kc, vc, tables, lens, scale, window=1 << 20)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_batch_one_equals_general_path_and_naive(n):
    kc, vc, tables = paged([n], hkv=3, d=16)
    q = torch.randn(1, 9, 16)
    lens = torch.tensor([n], dtype=torch.int32)
    out = R.decode_attention(q, kc, vc, tables, lens, 0.25, max_seq_len=n)
    torch.testing.assert_close(out, general_path(q, kc, vc, tables, lens, 0.25))
    pages = tables[0, : -(-n // 16)].long()
    k, v = kc[pages].flatten(0, 1)[:n], vc[pages].flatten(0, 1)[:n]
    torch.testing.assert_close(out[0], naive_attention(q[0], k, v, 0.25), rtol=1e-5, atol=1e-5)


def test_batch_one_ignores_padding_past_its_pages():
    """Table entries past the sequence's pages may hold anything (even ids past the
    pool): only the pages holding its tokens are read."""
    kc, vc, tables = paged([20], hkv=1, d=8)
    wide = torch.cat([tables, torch.full((1, 3), 10_000, dtype=torch.int32)], dim=1)
    q = torch.randn(1, 2, 8)
    lens = torch.tensor([20], dtype=torch.int32)
    torch.testing.assert_close(
        R.decode_attention(q, kc, vc, wide, lens, 0.5), general_path(q, kc, vc, tables, lens, 0.5)
    )


def test_batch_one_empty_sequence_is_zeros():
    kc, vc, tables = paged([16], hkv=1, d=8)
    q = torch.randn(1, 2, 8)
    out = R.decode_attention(q, kc, vc, tables, torch.tensor([0], dtype=torch.int32), 0.5)
    assert out.shape == q.shape and not out.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, R.FP8_KV_DTYPE])
def test_batch_one_narrow_pages(dtype):
    kc, vc, tables = paged([40], hkv=2, d=16)
    kc, vc = R.to_cache_dtype(kc, dtype), R.to_cache_dtype(vc, dtype)
    q = torch.randn(1, 4, 16, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    lens = torch.tensor([40], dtype=torch.int32)
    out = R.decode_attention(q, kc, vc, tables, lens, 0.25)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out, general_path(q, kc, vc, tables, lens, 0.25))
