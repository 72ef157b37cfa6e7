"""Every Triton kernel against its reference op, on the CPU under TRITON_INTERPRET=1.

Float32 on small shapes (the interpreter is slow): ragged lengths, page
boundaries (seq lens 1, 15, 16, 17, 33, ...), GQA ratios 1/3/4/8, head dims 64
and 128, prefill with and without a cached prefix, decode with and without
split-KV, strided views of a fused QKV output. A few float16 cases run the
16-bit tile sizes the GPU uses. The kernels that round to bf16 (norms,
SwiGLU, the GEMV) also run in bf16 here, against the reference rounded the
same way: the interpreter rounds float32 to bf16 as the GPU does
(`triton_interpret_fix`). bf16 on CUDA is `test_triton_gpu.py`.

The interpreter must be switched on before Triton is first imported:
tests/conftest.py sets TRITON_INTERPRET=1 for the whole session when there is
no GPU, and this module does the same for when it runs alone. With compiled
(GPU) kernels these CPU-tensor tests cannot run, so the module skips.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from pagedllm.config import RopeScaling  # noqa: E402
from pagedllm.ops import reference as ref  # noqa: E402
from pagedllm.ops import triton_attention  # noqa: E402
from pagedllm.ops import triton_impl as tri  # noqa: E402

if isinstance(triton_attention._decode_kernel, triton.runtime.jit.JITFunction):
    pytest.skip(
        "Triton kernels are compiled, not interpreted (TRITON_INTERPRET=1 was not set before "
        "Triton was first imported); these CPU tests need the interpreter",
        allow_module_level=True,
    )

BS = 16  # page size


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.float(), expected.float()
    return ((out - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, gen=None):
    """q, k, v as strided views of one (T, (H + 2Hkv) D) tensor, as the model makes them."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


def paged_cache(seq_lens, num_kv_heads, head_dim, dtype=torch.float32, gen=None):
    """Random K/V pages, handed out shuffled; block tables padded with -1 past each sequence."""
    pages_per_seq = [(n + BS - 1) // BS for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    k_cache = torch.randn(num_pages, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen)
    width = max(pages_per_seq, default=0) + 2
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        block_tables[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    return k_cache, v_cache, block_tables


def assert_bf16_rounded_as(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results rounded as the reference rounds them: equal bits, except a few
    (at most 1 in 1,000) one bf16 step apart, where a float32 sum taken in another
    order lands on the other side of a rounding boundary. Truncating instead of
    rounding to nearest would change about half of them."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    differ = a != b
    assert int(differ.sum()) <= max(1, got.numel() // 1000), f"{int(differ.sum())} differ"
    assert int((a - b).abs().max()) <= 1


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@triton.jit
def _to_bf16_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))


def test_interpreter_rounds_float32_to_bf16_to_nearest_even():
    """The interpreter's own cast keeps the top 16 bits; the GPU and torch round to
    nearest, ties to even (the shim in `triton_interpret_fix`)."""
    ulp = 2.0**-7  # of bf16 at 1.0
    values = [
        1 + ulp / 2,  # a tie: to 1.0 (even)
        1 + 3 * ulp / 2,  # a tie: up to 1 + 2 ulp (even)
        1 + ulp / 2 + 2.0**-20,  # above the tie: up (truncation gives 1.0)
        2 - ulp / 4,  # rounds up into the next exponent: 2.0
        -(1 + 0.75 * ulp),
        3.4e38,  # above bf16's largest finite value: inf
        1e-40,  # float32 subnormal
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        0.1,
        -123.456,
        65504.0,
        3.0e-5,
    ]
    x = torch.tensor(values, dtype=torch.float32)
    y = torch.empty(16, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](x, y, N=16)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


# --------------------------------------------------------------------------
# Norms, activation, embedding
# --------------------------------------------------------------------------


def assert_matches(got: torch.Tensor, want: torch.Tensor, **tol) -> None:
    if got.dtype == torch.bfloat16:
        assert_bf16_rounded_as(got, want)
    else:
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100, 2048])
def test_rms_norm(gen, dtype, hidden):
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    out = tri.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_matches(out, ref.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_add_rms_norm(gen, dtype):
    x = torch.randn(7, 96, generator=gen).to(dtype)
    res = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    want_normed, want_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    normed, new_res = tri.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    assert_matches(new_res, want_res)
    assert_matches(normed, want_normed)


def test_fused_add_rms_norm_writes_in_place(gen):
    x, res = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen)
    normed, new_res = tri.fused_add_rms_norm(x, res, torch.ones(32), 1e-6)
    assert normed.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [48, 1500])
def test_silu_and_mul(gen, dtype, inter):
    x = torch.randn(6, 2 * inter, generator=gen).to(dtype)
    assert_matches(tri.silu_and_mul(x), ref.silu_and_mul(x))


# --------------------------------------------------------------------------
# The GEMV (a projection of a few rows)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 100), (1, 64, 512), (2, 50, 700), (3, 8, 33)])
@pytest.mark.parametrize("glu", [False, True])
def test_gemv(gen, dtype, m, n, k, glu):
    """Every (BLOCK_N, BLOCK_K) against the reference, ragged N and K included; with
    `glu`, W has 2n rows [gate | up] and SwiGLU runs in the epilogue."""
    from pagedllm.ops import triton_gemv

    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(2 * n if glu else n, k, generator=gen) * k**-0.5).to(dtype)
    want = ref.linear_silu_and_mul(x, w) if glu else ref.linear(x, w)
    tol = {} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    for config in [(4, 128, 4), (2, 256, 2), (16, 64, 4)] + ([] if glu else [(1, 256, 2)]):
        got = triton_gemv.gemv(x, w, glu=glu, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_matches(got, want, **tol)


def test_gemv_glu_needs_even_rows(gen, monkeypatch):
    """A given odd BLOCK_N or an odd row count is an error; an odd tuned tile (one
    a plain projection of the same shape might have) is rounded up."""
    from pagedllm.ops import triton_gemv

    monkeypatch.setitem(triton_gemv.CONFIGS, (6, 8), (1, 64, 1))
    x, w = torch.randn(1, 8, generator=gen), torch.randn(6, 8, generator=gen)
    torch.testing.assert_close(triton_gemv.gemv(x, w, glu=True), ref.linear_silu_and_mul(x, w))

    with pytest.raises(ValueError, match="even"):
        triton_gemv.gemv(torch.ones(1, 8), torch.ones(4, 8), glu=True, config=(1, 64, 1))
    with pytest.raises(ValueError, match="even"):
        triton_gemv.gemv(torch.ones(1, 8), torch.ones(5, 8), glu=True, config=(2, 64, 1))


def test_linear_dispatch(gen, monkeypatch):
    """The GEMV serves up to GEMV_MAX_ROWS rows of a contiguous weight; the rest go
    to F.linear; both give the reference's numbers."""
    from pagedllm.ops import triton_gemv

    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(
        triton_gemv, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    w = torch.randn(40, 96, generator=gen)
    for rows in (1, triton_gemv.GEMV_MAX_ROWS, triton_gemv.GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(tri.linear(x, w), ref.linear(x, w))
        torch.testing.assert_close(tri.linear_silu_and_mul(x, w), ref.linear_silu_and_mul(x, w))
    most = triton_gemv.GEMV_MAX_ROWS
    assert calls == [(1, 96), (1, 96), (most, 96), (most, 96)]  # not most + 1 rows
    torch.testing.assert_close(tri.linear(x[:1], w.t().contiguous().t()), ref.linear(x[:1], w))
    assert len(calls) == 4  # a transposed (non-contiguous) weight too


def test_argmax_first_index_of_the_max(gen):
    """Across chunk edges, ties (the first index wins, also across chunks), -inf
    rows, a NaN (the maximum, as in torch.argmax), and a V that is no multiple of
    the chunk."""
    from pagedllm.ops.triton_argmax import CHUNK

    v = 2 * CHUNK + 123
    x = torch.randn(7, v, generator=gen)
    x[1, CHUNK - 1] = x[1, CHUNK] = 50.0  # a tie on both sides of a chunk edge
    x[2, 5] = x[2, v - 1] = 50.0  # a tie across the row
    x[3] = float("-inf")
    x[4, v - 1] = 99.0  # the last element
    x[5, 17] = float("nan")
    x[6, :] = 1.0  # every element the max
    got = tri.argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == ref.argmax(x).tolist()
    assert got[:3].tolist()[1:] == [CHUNK - 1, 5] and got[5] == 17 and got[6] == 0
    assert tri.argmax(x[:, :100]).tolist() == ref.argmax(x[:, :100]).tolist()  # one chunk, strided


def test_embedding(gen):
    weight = torch.randn(50, 1100, generator=gen)
    ids = torch.randint(0, 50, (9,), generator=gen)
    torch.testing.assert_close(tri.embedding(ids, weight), ref.embedding(ids, weight))


# --------------------------------------------------------------------------
# RoPE and the KV store
# --------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_rope_in_place_on_strided_views(gen, head_dim, num_heads, num_kv_heads, dtype):
    scaling = RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    cache = ref.rope_cos_sin_cache(head_dim, 500000.0, scaling, 300)
    q, k, v = fused_qkv_views(5, num_heads, num_kv_heads, head_dim, dtype, gen)
    positions = torch.tensor([0, 1, 17, 255, 299])
    want_q, want_k = ref.apply_rope(q, k, positions, cache)
    v_before = v.clone()
    out_q, out_k = tri.apply_rope(q, k, positions, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(v, v_before)  # the neighbouring V columns are untouched


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 64), (8, 1, 128), (4, 4, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_and_store(gen, num_heads, num_kv_heads, head_dim, dtype):
    """RoPE and the KV store in one kernel: q and k rotated in place as apply_rope
    rotates them, the rotated k and v in their slots, a slot of -1 left alone."""
    cache = ref.rope_cos_sin_cache(head_dim, 10000.0, None, 100)
    q, k, v = fused_qkv_views(6, num_heads, num_kv_heads, head_dim, dtype, gen)
    positions = torch.tensor([0, 1, 17, 40, 99, 3])
    slots = torch.tensor([0, 15, 16, -1, 63, 40])
    k_cache = torch.randn(4, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(4, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    want_q, want_k = ref.rope_and_store(q, k, v, positions, cache, want_kc, want_vc, slots)
    v_before = v.clone()
    out_q, out_k = tri.rope_and_store(q, k, v, positions, cache, k_cache, v_cache, slots)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    torch.testing.assert_close(k_cache, want_kc)
    assert torch.equal(v_cache, want_vc) and torch.equal(v, v_before)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_store_kvcache(gen, cache_dtype):
    num_kv_heads, head_dim, num_pages = 3, 64, 4
    _, k, v = fused_qkv_views(6, 6, num_kv_heads, head_dim, gen=gen)
    slots = torch.tensor([0, 15, 16, 17, 63, 40])
    k_cache = torch.zeros(num_pages, BS, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kvcache(k, v, want_k, want_v, slots)
    tri.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kvcache_skips_negative_slots(gen):
    k = torch.randn(3, 2, 64, generator=gen)
    k_cache = torch.zeros(2, BS, 2, 64)
    v_cache = torch.zeros(2, BS, 2, 64)
    tri.store_kvcache(k, k, k_cache, v_cache, torch.tensor([-1, 5, -1]))
    assert torch.equal(k_cache.view(-1, 2, 64)[5], k[1])
    k_cache.view(-1, 2, 64)[5] = 0
    assert k_cache.abs().sum() == 0  # nothing else was written


FP8 = torch.float8_e4m3fn


def as_bits(cache: torch.Tensor) -> torch.Tensor:
    """A float8 cache's bytes, to compare exactly (torch.equal has no float8 kernel)."""
    return cache.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_and_store_into_fp8_cache(gen, dtype):
    """A float8 cache gets the same bytes as the reference's clamp-and-round
    (`to_cache_dtype`), values past +-448 included; q and k stay in their dtype."""
    cache = ref.rope_cos_sin_cache(64, 10000.0, None, 100)
    q, k, v = fused_qkv_views(6, 6, 2, 64, dtype, gen)
    v[1] *= 500  # past e4m3's largest value: saturates at +-448
    k[2] *= 500
    positions = torch.tensor([0, 1, 17, 40, 99, 3])
    slots = torch.tensor([0, 15, 16, -1, 63, 40])
    k_cache = torch.zeros(4, BS, 2, 64, dtype=FP8)
    v_cache = torch.zeros(4, BS, 2, 64, dtype=FP8)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    want_q, want_k = ref.rope_and_store(q, k, v, positions, cache, want_kc, want_vc, slots)
    tri.rope_and_store(q, k, v, positions, cache, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(as_bits(k_cache), as_bits(want_kc))
    assert torch.equal(as_bits(v_cache), as_bits(want_vc))
    assert v_cache.float().abs().max() == 448.0 and k_cache.float().abs().max() == 448.0


def test_store_kvcache_into_fp8_cache(gen):
    _, k, v = fused_qkv_views(6, 6, 3, 64, gen=gen)
    k[0] *= 1000
    slots = torch.tensor([0, 15, 16, 17, 63, 40])
    k_cache = torch.zeros(4, BS, 3, 64, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kvcache(k, v, want_k, want_v, slots)
    tri.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(as_bits(k_cache), as_bits(want_k))
    assert torch.equal(as_bits(v_cache), as_bits(want_v))


# --------------------------------------------------------------------------
# Decode attention
# --------------------------------------------------------------------------

DECODE_LENS = [1, 15, 16, 17, 33, 70]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention(gen, head_dim, num_heads, num_kv_heads, num_splits):
    k_cache, v_cache, block_tables = paged_cache(DECODE_LENS, num_kv_heads, head_dim, gen=gen)
    q, _, _ = fused_qkv_views(len(DECODE_LENS), num_heads, num_kv_heads, head_dim, gen=gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    want = ref.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    out = tri.decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, 0.125, num_splits=num_splits
    )
    assert out.shape == q.shape and out.is_contiguous()
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "heads_per_program"),
    [(8, 2, 2), (16, 4, 4), (4, 4, 2), (8, 8, 8)],
)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_decode_attention_heads_per_program(
    gen, num_heads, num_kv_heads, heads_per_program, num_splits, cache_dtype
):
    """Several KV heads per program (one contiguous K/V row of all of them per
    token, a block-diagonal q): each query head still sees only its own KV head."""
    k_cache, v_cache, block_tables = paged_cache(DECODE_LENS, num_kv_heads, 64, gen=gen)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q, _, _ = fused_qkv_views(len(DECODE_LENS), num_heads, num_kv_heads, 64, gen=gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    want = ref.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    out = tri.decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, 0.125,
        num_splits=num_splits, heads_per_program=heads_per_program, block_n=32,
    )  # fmt: skip
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("heads_per_program", "cache_dtype"), [(1, torch.float32), (2, FP8)])
def test_decode_attention_order(gen, num_splits, heads_per_program, cache_dtype):
    """`order` only changes which grid row takes which sequence: the output is
    the same, bit for bit, including a padding row (seq_len 0) taken last."""
    lens = [*DECODE_LENS, 0]
    k_cache, v_cache, block_tables = paged_cache(lens, 4, 64, gen=gen)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(len(lens), 8, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    assert order.tolist() != list(range(len(lens)))
    kw = dict(num_splits=num_splits, heads_per_program=heads_per_program, block_n=32)
    plain = tri.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, **kw)
    ordered = tri.decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, 0.125, order=order, **kw
    )
    assert torch.equal(ordered, plain)
    want = ref.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, order=order)
    assert rel_err(ordered, want) < 1e-5
    for impl in (tri, ref):
        with pytest.raises(ValueError, match="order has shape"):
            impl.decode_attention(
                q, k_cache, v_cache, block_tables, seq_lens, 0.125, order=order[:-1]
            )


def test_heads_per_program_rule():
    hpp = triton_attention._heads_per_program
    bf16, f8 = torch.bfloat16, FP8
    assert hpp(256, 4, 8, 64, f8, 132) == 2  # Llama-3.2-1B, float8 pages: 128-byte rows
    assert hpp(99, 4, 8, 64, f8, 132) == 2
    assert hpp(98, 4, 8, 64, f8, 132) == 1  # a thinner grid: one head per program
    assert hpp(256, 4, 8, 128, f8, 132) == 1  # Llama-3.1-8B: 128 values already
    assert hpp(256, 4, 8, 64, bf16, 132) == 1  # 16-bit pages: one head
    assert hpp(256, 3, 3, 64, f8, 132) == 1  # SmolLM2-135M: 3 KV heads
    assert hpp(256, 16, 8, 32, f8, 132) == 1  # 16 query rows already
    assert hpp(256, 1, 32, 32, f8, 132) == 4


def test_decode_attention_default_split_choice(gen):
    """No hint: the block-table width picks the splits (here > 1, one sequence)."""
    lens = [150]
    k_cache, v_cache, block_tables = paged_cache(lens, 2, 64, gen=gen)
    q = torch.randn(1, 8, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = ref.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.1)
    assert triton_attention.num_decode_splits(1, 2, block_tables.shape[1] * BS) > 1
    out = tri.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.1)
    assert rel_err(out, want) < 1e-5
    out = tri.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.1, max_seq_len=150)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_decode_attention_padding_rows_give_zeros(gen, num_splits, heads_per_program):
    """seq_len 0 rows (CUDA-graph padding) are zeros, and the real rows stay right."""
    k_cache, v_cache, block_tables = paged_cache([20, 1], 2, 64, gen=gen)
    block_tables[1] = -1  # a padding row points nowhere
    q = torch.randn(2, 4, 64, generator=gen)
    seq_lens = torch.tensor([20, 0], dtype=torch.int32)
    out = tri.decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, 0.1,
        num_splits=num_splits, heads_per_program=heads_per_program,
    )  # fmt: skip
    want = ref.decode_attention(q[:1], k_cache, v_cache, block_tables[:1], seq_lens[:1], 0.1)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[:1], want) < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_fp16(gen, head_dim):
    """float16 runs the key-tile sizes the GPU uses for 16-bit caches."""
    lens = [5, 16, 100, 200]
    k_cache, v_cache, block_tables = paged_cache(lens, 2, head_dim, torch.float16, gen)
    q = torch.randn(4, 8, head_dim, generator=gen).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = ref.decode_attention(
        q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, 0.125
    )
    for splits in (1, 2):
        out = tri.decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, 0.125, num_splits=splits
        )
        assert out.dtype == torch.float16 and rel_err(out, want) < 2e-3


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_fp8_cache(gen, q_dtype, num_splits):
    """Float8 pages are widened exactly to q's dtype: the kernel equals the
    reference on the same pages (float32 q: to 1e-5; float16 q: its own
    rounding), with the fp8 tile size (twice the tokens of a 16-bit tile)."""
    lens = [5, 16, 100, 200]
    k_cache, v_cache, block_tables = paged_cache(lens, 2, 64, gen=gen)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    q = torch.randn(4, 8, 64, generator=gen).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = ref.decode_attention(q.float(), k_cache, v_cache, block_tables, seq_lens, 0.125)
    out = tri.decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, 0.125, num_splits=num_splits
    )
    assert out.dtype == q_dtype
    assert rel_err(out, want) < (1e-5 if q_dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, FP8),
        (torch.float16, torch.float16),
        (torch.float16, FP8),
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 128)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rope_store_decode_attention(
    gen, q_dtype, cache_dtype, num_heads, num_kv_heads, head_dim, num_splits
):
    """A decode step's RoPE, K/V store and attention in one kernel equal
    rope_and_store then decode_attention: the output, and the cache bit for bit.
    A padding row (seq_len 0, slot -1) stores nothing and gets zeros; q, k and v
    are strided views of one QKV output and are left as they came."""
    lens = [1, 15, 16, 17, 70, 0]
    k_cache, v_cache, tables = paged_cache(lens, num_kv_heads, head_dim, gen=gen)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q, k, v = fused_qkv_views(len(lens), num_heads, num_kv_heads, head_dim, q_dtype, gen)
    k[0] *= 1000  # past float8's range: stored clamped
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = (seq_lens - 1).clamp(min=0)
    slots = torch.tensor(
        [int(tables[b, (n - 1) // BS]) * BS + (n - 1) % BS if n else -1 for b, n in enumerate(lens)]
    )
    cos_sin = ref.rope_cos_sin_cache(head_dim, 10000.0, None, 100)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    real = slice(0, len(lens) - 1)  # the reference would store a slot of -1 (the last row)
    want = ref.rope_store_decode_attention(
        *(t[real].clone() for t in (q, k, v, positions)), cos_sin, want_kc, want_vc,
        slots[real], tables[real], seq_lens[real], 0.125,
    )  # fmt: skip
    before = [t.clone() for t in (q, k, v)]
    out = tri.rope_store_decode_attention(
        q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, seq_lens, 0.125,
        num_splits=num_splits,
    )  # fmt: skip
    assert out.dtype == q_dtype and out.shape == q.shape
    assert rel_err(out[real], want) < (1e-5 if q_dtype == torch.float32 else 2e-3)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert torch.equal(as_bits(k_cache), as_bits(want_kc))
    assert torch.equal(as_bits(v_cache), as_bits(want_vc))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))


def test_num_decode_splits_rule():
    split = triton_attention.num_decode_splits
    assert split(256, 8, 131072) == 1  # enough programs already
    assert split(64, 8, 2048) == 1
    assert split(1, 8, 100) == 1  # too short to split
    assert split(1, 8, 2048) == 2048 // triton_attention.MIN_TOKENS_PER_SPLIT
    assert 1 < split(1, 8, 131072) <= triton_attention.MAX_SPLITS
    assert split(8, 8, 2048) * 8 * 8 >= 132


# --------------------------------------------------------------------------
# Prefill attention
# --------------------------------------------------------------------------

Q_LENS = [1, 15, 16, 17, 33, 70]


def _prefill_case(gen, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32):
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    q, k, v = fused_qkv_views(sum(q_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, num_kv_heads, head_dim, dtype, gen)
    return q, k, v, cu, torch.tensor(seq_lens, dtype=torch.int32), k_cache, v_cache, block_tables


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2), (8, 1)])
def test_prefill_attention_no_cache(gen, head_dim, num_heads, num_kv_heads):
    q, k, v, cu, seq_lens, *_ = _prefill_case(
        gen, Q_LENS, [0] * len(Q_LENS), num_heads, num_kv_heads, head_dim
    )
    want = ref.prefill_attention(q, k, v, cu, seq_lens, 0.125)
    out = tri.prefill_attention(q, k, v, cu, seq_lens, 0.125)
    assert out.shape == q.shape
    assert rel_err(out, want) < 1e-5
    if num_heads == num_kv_heads:  # the host hint sizes the grid instead of a sync
        out = tri.prefill_attention(q, k, v, cu, seq_lens, 0.125, max_q_len=max(Q_LENS))
        assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 1)])
def test_prefill_attention_with_cached_prefix(gen, head_dim, num_heads, num_kv_heads):
    q_lens = [1, 16, 17, 3, 40]
    ctx_lens = [0, 5, 16, 33, 17]
    q, k, v, cu, seq_lens, k_cache, v_cache, block_tables = _prefill_case(
        gen, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim
    )
    args = (q, k, v, cu, seq_lens, 0.125, k_cache, v_cache, block_tables)
    want = ref.prefill_attention(*args)
    out = tri.prefill_attention(*args, max_q_len=max(q_lens))
    assert rel_err(out, want) < 1e-5


def test_prefill_attention_single_sequence_needs_no_hint(gen):
    q, k, v, cu, seq_lens, k_cache, v_cache, block_tables = _prefill_case(gen, [70], [20], 4, 2, 64)
    args = (q, k, v, cu, seq_lens, 0.1, k_cache, v_cache, block_tables)
    assert rel_err(tri.prefill_attention(*args), ref.prefill_attention(*args)) < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_attention_fp16_gpu_tiles(gen, head_dim):
    """float16 runs the tile sizes the GPU uses for 16-bit inputs."""
    q_lens, ctx_lens = [130, 7], [9, 40]
    q, k, v, cu, seq_lens, k_cache, v_cache, block_tables = _prefill_case(
        gen, q_lens, ctx_lens, 8, 2, head_dim, torch.float16
    )
    want = ref.prefill_attention(
        q.float(),
        k.float(),
        v.float(),
        cu,
        seq_lens,
        0.125,
        k_cache.float(),
        v_cache.float(),
        block_tables,
    )
    out = tri.prefill_attention(q, k, v, cu, seq_lens, 0.125, k_cache, v_cache, block_tables)
    assert out.dtype == torch.float16 and rel_err(out, want) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_fp8_cached_prefix(gen, dtype):
    """A cached prefix in float8 pages is read widened to q's dtype; the new
    tokens' own K/V come in at full precision."""
    q_lens, ctx_lens = [1, 17, 40], [5, 33, 17]
    q, k, v, cu, seq_lens, k_cache, v_cache, block_tables = _prefill_case(
        gen, q_lens, ctx_lens, 8, 2, 64, dtype
    )
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    args = (q, k, v, cu, seq_lens, 0.125, k_cache, v_cache, block_tables)
    want = ref.prefill_attention(*args)
    out = tri.prefill_attention(*args, max_q_len=max(q_lens))
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_mixed_step_split_matches_prefill_over_every_sequence(gen, cache_dtype):
    """A mixed step's attention as the model runs it (`model/llama.py`): decode
    attention for the leading one-token sequences, prefill attention for the
    rest through an offset slice of cu_seqlens_q (rows of the decode sequences
    left unwritten), equals prefill attention over every sequence."""
    q_lens, ctx_lens = [1, 1, 1, 17, 1, 40], [20, 33, 0, 16, 5, 0]
    d = 3  # the leading one-token rows (a later one-token chunk stays in prefill)
    q, k, v, cu, seq_lens, k_cache, v_cache, block_tables = _prefill_case(
        gen, q_lens, ctx_lens, 8, 2, 64
    )
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    # Decode attention reads a token's own K/V from its page, prefill attention
    # from k and v: with float8 pages give both the same (already rounded) values.
    k, v = (t.to(cache_dtype).to(t.dtype) for t in (k, v))
    # This step's K/V into their slots, as rope_and_store leaves them.
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx_lens, q_lens)])
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = block_tables[rows, pos // BS].long() * BS + pos % BS
    ref.store_kvcache(k, v, k_cache, v_cache, slots)
    want = ref.prefill_attention(q, k, v, cu, seq_lens, 0.125, k_cache, v_cache, block_tables)
    for ops in (ref, tri):
        out = ops.prefill_attention(
            q, k, v, cu[d:], seq_lens[d:], 0.125, k_cache, v_cache, block_tables[d:], max_q_len=40
        )
        out[:d] = ops.decode_attention(
            q[:d], k_cache, v_cache, block_tables[:d], seq_lens[:d], 0.125
        )
        assert rel_err(out, want) < 1e-5, ops.__name__


def test_chunked_prefill_then_decode_matches_one_shot(gen):
    """Store + prefill in two chunks, then one decode step == attention over the whole prompt."""
    num_heads, num_kv_heads, head_dim, n = 4, 2, 64, 37
    q, k, v = fused_qkv_views(n + 1, num_heads, num_kv_heads, head_dim, gen=gen)
    k_cache = torch.zeros(4, BS, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.tensor([[2, 0, 3, -1]], dtype=torch.int32)

    def slots(lo, hi):
        pos = torch.arange(lo, hi)
        return block_tables[0, pos // BS].long() * BS + pos % BS

    whole = ref.prefill_attention(
        q, k, v, torch.tensor([0, n + 1], dtype=torch.int32), torch.tensor([n + 1]), 0.1
    )
    outs = []
    for lo, hi in [(0, 20), (20, n)]:  # two prefill chunks
        tri.store_kvcache(k[lo:hi], v[lo:hi], k_cache, v_cache, slots(lo, hi))
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        seq = torch.tensor([hi], dtype=torch.int32)
        outs.append(
            tri.prefill_attention(
                q[lo:hi], k[lo:hi], v[lo:hi], cu, seq, 0.1, k_cache, v_cache, block_tables
            )
        )
    tri.store_kvcache(k[n:], v[n:], k_cache, v_cache, slots(n, n + 1))
    seq = torch.tensor([n + 1], dtype=torch.int32)
    outs.append(tri.decode_attention(q[n:], k_cache, v_cache, block_tables, seq, 0.1))
    assert rel_err(torch.cat(outs), whole) < 1e-5


def test_dispatcher_finds_the_triton_module(monkeypatch):
    from pagedllm import ops

    monkeypatch.setenv("PAGEDLLM_OPS", "triton")
    impl = ops.implementation("cpu")
    assert impl is tri
    for name in ops.OP_NAMES:
        assert callable(getattr(impl, name))


def test_ops_mode_argument_overrides_the_environment(monkeypatch):
    """`mode` wins over $PAGEDLLM_OPS either way; None reads the environment as before."""
    from pagedllm import ops

    monkeypatch.setenv("PAGEDLLM_OPS", "triton")
    assert ops.implementation("cpu", "reference") is ref
    assert ops.implementation_name("cpu", "reference") == "reference"
    assert ops.implementation("cpu") is tri and ops.implementation("cpu", None) is tri
    monkeypatch.setenv("PAGEDLLM_OPS", "reference")
    assert ops.implementation("cpu", "triton") is tri
    assert ops.implementation_name("cpu", "triton") == "triton"
    assert ops.implementation("cpu", "auto") is ref  # auto: the reference on the CPU
    assert ops.implementation_name("cpu") == "reference"
    monkeypatch.delenv("PAGEDLLM_OPS")
    assert ops.implementation("cpu") is ref  # unset: auto
    for bad in ("cuda", "Triton", "", 1):
        with pytest.raises(ValueError, match="ops mode .*: choose 'auto', 'reference', 'triton'"):
            ops.implementation("cpu", bad)
        with pytest.raises(ValueError, match="ops mode"):
            ops.implementation_name("cpu", bad)
    monkeypatch.setenv("PAGEDLLM_OPS", "bogus")
    with pytest.raises(ValueError, match="PAGEDLLM_OPS='bogus'"):
        ops.implementation("cpu")
    assert ops.implementation("cpu", "reference") is ref  # a given mode never reads the env


def test_model_ops_mode_reaches_forward(monkeypatch):
    """`LlamaModel.ops_mode` picks the implementation its forward runs, over the env."""
    from pagedllm.config import ModelConfig
    from pagedllm.model import dummy_model

    config = ModelConfig(300, 64, 96, 2, 4, 2, 16, 1e-5, 1e4, None, False, 256, 1, (2,))
    model = dummy_model(config, "cpu", "float32", std=0.2)
    calls = []

    def spy(module):
        real = module.embedding  # called once per forward
        monkeypatch.setattr(module, "embedding", lambda *a: calls.append(module) or real(*a))

    spy(ref)
    spy(tri)
    prompt = [3, 1, 4, 1, 5, 9]
    monkeypatch.setenv("PAGEDLLM_OPS", "triton")
    model.ops_mode = "reference"
    want = model.forward_logits(prompt)
    assert calls == [ref]
    monkeypatch.setenv("PAGEDLLM_OPS", "reference")
    model.ops_mode = "triton"
    got = model.forward_logits(prompt)
    assert calls == [ref, tri]
    assert rel_err(got, want) < 1e-5
    model.ops_mode = None  # back to the environment
    model.forward_logits(prompt)
    assert calls == [ref, tri, ref]
    model.ops_mode = "gpu"
    with pytest.raises(ValueError, match="ops mode 'gpu'"):
        model.forward_logits(prompt)


def test_layers_chain_their_kernels_at_batch_1_and_in_large_bf16_decode_steps(monkeypatch):
    """Which steps launch the layers' kernels as programmatic dependents
    (`LlamaModel.chains_kernels`): batch 1, and decode steps of PDL_MIN_DECODE_BATCH
    rows or more in bf16; never prefill, float32 or float16 batches or tensor parallelism."""
    from pagedllm import ops
    from pagedllm.config import ModelConfig
    from pagedllm.model import dummy_model, llama
    from pagedllm.model.batch import ForwardBatch

    config = ModelConfig(300, 64, 96, 2, 4, 2, 16, 1e-5, 1e4, None, False, 256, 1, (2,))
    model = dummy_model(config, "cpu", "bfloat16", std=0.2)

    def batch(rows, decode):
        ids = torch.zeros(rows, dtype=torch.long)
        return ForwardBatch(ids, ids, None, None, ids, ids, ids, is_decode=decode)

    big = llama.PDL_MIN_DECODE_BATCH
    assert model.chains_kernels(batch(1, True)) and model.chains_kernels(batch(1, False))
    assert model.chains_kernels(batch(big, True)) and model.chains_kernels(batch(4 * big, True))
    assert not model.chains_kernels(batch(big - 1, True))
    assert not model.chains_kernels(batch(big, False))  # prefill or mixed
    for dtype in (torch.float32, torch.float16):
        model.dtype = dtype
        assert not model.chains_kernels(batch(big, True)) and model.chains_kernels(batch(1, True))
    model.dtype = torch.bfloat16
    model.chain_batched_decode = False  # the decode graphs' unchained warm-up
    assert not model.chains_kernels(batch(big, True)) and model.chains_kernels(batch(1, True))
    model.chain_batched_decode = True
    model.tp = object()  # any tensor-parallel group
    assert not model.chains_kernels(batch(1, True)) and not model.chains_kernels(batch(big, True))
    model.tp = None
    # forward opens the chain with that answer around the layers.
    seen = []
    real = ops.kernel_chain
    monkeypatch.setattr(
        ops, "kernel_chain", lambda active=True: seen.append(active) or real(active)
    )
    model.forward_logits([7])
    model.forward_logits([7, 8, 9])
    assert seen == [True, False]


def test_signatures_match_the_reference():
    import inspect

    from pagedllm import ops

    for name in ops.OP_NAMES:
        want = inspect.signature(getattr(ref, name)).parameters
        got = inspect.signature(getattr(tri, name)).parameters
        assert list(got)[: len(want)] == list(want), name
        extra = list(got)[len(want) :]
        assert all(got[p].kind is inspect.Parameter.KEYWORD_ONLY for p in extra), name
