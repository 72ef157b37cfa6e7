"""The Triton kernels in bf16 on CUDA, at Llama-3.2-1B sizes, against the float32 reference.

Run on the GPU machine with `pytest -m gpu`. Each kernel's output is compared
with the reference op computed in float32 on upcast copies of the same inputs:
relative error ||out - ref|| / ||ref|| < 1e-2. The decode kernel is also
captured in a CUDA graph and replayed with other sequence lengths (padding rows
of length 0 included), which is how the engine runs it.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip(
        "TRITON_INTERPRET is set: the kernels would not be compiled", allow_module_level=True
    )

from pagedllm.config import RopeScaling  # noqa: E402
from pagedllm.ops import reference as ref  # noqa: E402
from pagedllm.ops import triton_impl as tri  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
BS = 16
H, HKV, D = 32, 8, 64  # Llama-3.2-1B
E, INTER = 2048, 8192


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.float(), expected.float()
    return ((out - expected).norm() / expected.norm()).item()


def f32(*tensors):
    return [t.float() for t in tensors]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def fused_qkv_views(num_tokens, num_heads=H, num_kv_heads=HKV, head_dim=D):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEV, dtype=BF16)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


def paged_cache(seq_lens, num_kv_heads=HKV, head_dim=D, width=None):
    pages = [(n + BS - 1) // BS for n in seq_lens]
    num_pages = sum(pages) + 1
    k_cache = torch.randn(num_pages, BS, num_kv_heads, head_dim, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_pages, device=DEV).to(torch.int32)
    width = width or max(pages) + 1
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(pages):
        block_tables[b, :n] = order[used : used + n]
        used += n
    return k_cache, v_cache, block_tables


def test_norms_activation_embedding():
    x = torch.randn(256, E, device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    w = torch.randn(E, device=DEV, dtype=BF16)
    assert rel_err(tri.rms_norm(x, w, 1e-5), ref.rms_norm(*f32(x, w), 1e-5)) < 1e-2
    want_n, want_r = ref.fused_add_rms_norm(*f32(x, res, w), 1e-5)
    normed, new_res = tri.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert rel_err(new_res, want_r) < 1e-2 and rel_err(normed, want_n) < 1e-2
    gate_up = torch.randn(256, 2 * INTER, device=DEV, dtype=BF16)
    assert rel_err(tri.silu_and_mul(gate_up), ref.silu_and_mul(gate_up.float())) < 1e-2
    table = torch.randn(128256, E, device=DEV, dtype=BF16)
    ids = torch.randint(0, 128256, (300,), device=DEV)
    assert torch.equal(tri.embedding(ids, table), ref.embedding(ids, table))


@pytest.mark.parametrize(
    ("n", "k", "glu"), [(3072, E, False), (E, E, False), (2 * INTER, E, True), (E, INTER, False)]
)
def test_gemv_projections(n, k, glu):
    """The single-row GEMV at the 1B projection shapes (q/k/v, o_proj, gate/up with
    SwiGLU in its epilogue, down), through the op the model calls, and in a CUDA graph."""
    x = torch.randn(1, k, device=DEV, dtype=BF16)
    w = torch.randn(n, k, device=DEV, dtype=BF16) * k**-0.5
    op, want_op = (
        (tri.linear_silu_and_mul, ref.linear_silu_and_mul) if glu else (tri.linear, ref.linear)
    )
    assert rel_err(op(x, w), want_op(*f32(x, w))) < 1e-2
    graph = torch.cuda.CUDAGraph()
    op(x, w)  # compiled before capture
    with torch.cuda.graph(graph):
        out = op(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(out, want_op(*f32(x, w))) < 1e-2


@pytest.mark.parametrize("rows", [1, 256])
def test_argmax_equals_torch(rows):
    logits = torch.randn(rows, 128256, device=DEV)
    logits[0, 100] = logits[0, 70000] = 30.0  # a tie: the first index
    assert torch.equal(tri.argmax(logits), logits.argmax(dim=-1))
    half = logits.to(BF16)  # many ties in bf16
    assert torch.equal(tri.argmax(half), half.argmax(dim=-1))


def test_rope_and_store_kvcache():
    scaling = RopeScaling(32.0, 1.0, 4.0, 8192)
    cache = ref.rope_cos_sin_cache(D, 500000.0, scaling, 131072, device=DEV)
    q, k, v = fused_qkv_views(1024)
    positions = torch.randint(0, 131072, (1024,), device=DEV)
    want_q, want_k = ref.apply_rope(*f32(q, k), positions, cache)
    tri.apply_rope(q, k, positions, cache)
    assert rel_err(q, want_q) < 1e-2 and rel_err(k, want_k) < 1e-2

    k_cache = torch.zeros(128, BS, HKV, D, device=DEV, dtype=BF16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(128 * BS, device=DEV)[:1024]
    slots[::7] = -1  # padding rows are skipped
    tri.store_kvcache(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, HKV, D)[slots[keep]], k[keep])
    assert torch.equal(v_cache.view(-1, HKV, D)[slots[keep]], v[keep])

    # Both in one kernel (what the model runs): the same rotation, the same slots.
    q, k, v = fused_qkv_views(1024)
    q0, k0 = q.clone(), k.clone()
    k_cache.zero_(), v_cache.zero_()
    tri.rope_and_store(q, k, v, positions, cache, k_cache, v_cache, slots)
    want_q, want_k = tri.apply_rope(q0, k0, positions, cache)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(k_cache.view(-1, HKV, D)[slots[keep]], k[keep])
    assert torch.equal(v_cache.view(-1, HKV, D)[slots[keep]], v[keep])
    assert not k_cache.view(-1, HKV, D)[
        torch.isin(torch.arange(128 * BS, device=DEV), slots, invert=True)
    ].any()


FP8 = torch.float8_e4m3fn


def test_rope_and_store_into_fp8_cache_rounds_as_torch():
    """The GPU's conversion to float8 e4m3 gives torch's bytes (round to nearest
    even; +-448 saturation through the clamp): each slot holds exactly
    `to_cache_dtype` of the rotated k (as the kernel left it in place) and of v."""
    scaling = RopeScaling(32.0, 1.0, 4.0, 8192)
    cache = ref.rope_cos_sin_cache(D, 500000.0, scaling, 131072, device=DEV)
    q, k, v = fused_qkv_views(1024)
    v[::5] *= 300  # some past 448
    k[::3] *= 300
    positions = torch.randint(0, 131072, (1024,), device=DEV)
    slots = torch.randperm(128 * BS, device=DEV)[:1024]
    slots[::7] = -1
    k_cache = torch.zeros(128, BS, HKV, D, device=DEV, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    tri.rope_and_store(q, k, v, positions, cache, k_cache, v_cache, slots)
    keep = slots >= 0
    for got, x in ((k_cache, k), (v_cache, v)):
        want = ref.to_cache_dtype(x[keep], FP8).view(torch.uint8)
        assert torch.equal(got.view(-1, HKV, D)[slots[keep]].view(torch.uint8), want)
    assert v_cache.float().abs().max().item() == 448.0
    assert k_cache.float().abs().max().item() == 448.0


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch", [1, 256])
def test_decode_attention_fp8_cache(batch, head_dim):
    """bf16 q over float8 pages, against the reference in float32 on the same pages."""
    seq_lens_list = torch.randint(1, 2049, (batch,)).tolist()
    seq_lens_list[0] = 2048
    k_cache, v_cache, block_tables = paged_cache(seq_lens_list, head_dim=head_dim)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    q, _, _ = fused_qkv_views(batch, head_dim=head_dim)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    rows = torch.tensor(sorted({0, batch // 2, batch - 1}), device=DEV)
    want = ref.decode_attention(
        q[rows].float(), k_cache, v_cache, block_tables[rows], seq_lens[rows], scale
    )
    for kwargs in ({}, {"num_splits": 1}, {"num_splits": 7}):
        out = tri.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, **kwargs)
        assert rel_err(out[rows], want) < 1e-2, kwargs


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_attention(batch, head_dim):
    seq_lens_list = torch.randint(1, 2049, (batch,)).tolist()
    seq_lens_list[0] = 2048
    k_cache, v_cache, block_tables = paged_cache(seq_lens_list, head_dim=head_dim)
    q, _, _ = fused_qkv_views(batch, head_dim=head_dim)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    # Rows are independent; the (slow, page-by-page) reference checks up to 7 of them.
    rows = torch.tensor(sorted({0, 1, 2, batch // 2, batch - 3, batch - 2, batch - 1}))
    rows = rows[(rows >= 0) & (rows < batch)].to(DEV)
    want = ref.decode_attention(
        *f32(q[rows], k_cache, v_cache), block_tables[rows], seq_lens[rows], scale
    )
    for kwargs in ({}, {"max_seq_len": 2048}, {"num_splits": 1}, {"num_splits": 7}):
        out = tri.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, **kwargs)
        assert rel_err(out[rows], want) < 1e-2, kwargs


def test_decode_attention_in_a_cuda_graph():
    """Capture once with a wide block table, replay with new lengths: same answers."""
    batch, width = 8, 128  # block tables cover 2048 tokens
    k_cache, v_cache, block_tables = paged_cache([2048] * batch, width=width)
    q, _, _ = fused_qkv_views(batch)
    seq_lens = torch.full((batch,), 2048, dtype=torch.int32, device=DEV)
    args = (q, k_cache, v_cache, block_tables, seq_lens, D**-0.5)
    tri.decode_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.decode_attention(*args)
    for lens in ([1, 16, 17, 300, 2048, 0, 0, 999], [2048] * batch, [5] * batch):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        real = [i for i, n in enumerate(lens) if n > 0]
        idx = torch.tensor(real, device=DEV)
        want = ref.decode_attention(
            *f32(q[idx], k_cache, v_cache), block_tables[idx], seq_lens[idx], D**-0.5
        )
        assert rel_err(out[idx], want) < 1e-2, lens
        pad = [i for i, n in enumerate(lens) if n == 0]
        assert not pad or out[pad].abs().max().item() == 0.0


@pytest.mark.parametrize("cache_dtype", [BF16, FP8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch", [1, 256])
def test_rope_store_decode_attention(batch, head_dim, cache_dtype):
    """RoPE, the K/V store and decode attention in one kernel against
    rope_and_store + decode_attention (Triton): the cache bit for bit and the
    output, eagerly and in a CUDA graph inside a kernel chain (with PDL, the
    first tile is read before the wait)."""
    from pagedllm import ops

    lens = torch.randint(1, 2049, (batch,)).tolist()
    lens[0] = 2048
    k_cache, v_cache, tables = paged_cache(lens, head_dim=head_dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q, k, v = fused_qkv_views(batch, head_dim=head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    positions = (seq_lens - 1).long()
    slots = tables.gather(1, (positions // BS)[:, None]).squeeze(1).long() * BS + positions % BS
    cos_sin = ref.rope_cos_sin_cache(head_dim, 500000.0, None, 4096, device=DEV)
    args = (q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, seq_lens, head_dim**-0.5)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    q2, k2 = tri.rope_and_store(
        q.clone(), k.clone(), v, positions, cos_sin, want_kc, want_vc, slots
    )
    want = tri.decode_attention(q2, want_kc, want_vc, tables, seq_lens, head_dim**-0.5)
    out = tri.rope_store_decode_attention(*args)
    assert rel_err(out, want) < 1e-2
    assert torch.equal(v_cache.view(torch.uint8), want_vc.view(torch.uint8))
    # k is rotated in float32 by the same expressions; the compiler may still
    # contract them into FMAs differently, so a rounding may land one step over.
    same = k_cache.view(torch.uint8) == want_kc.view(torch.uint8)
    assert same.float().mean().item() > 0.999
    ulp = 2.0**-7 if cache_dtype == BF16 else 2.0**-3
    atol = 1e-6 if cache_dtype == BF16 else 2.0**-9  # float8 subnormals: steps of 2^-9
    torch.testing.assert_close(k_cache.float(), want_kc.float(), rtol=ulp, atol=atol)
    graph = torch.cuda.CUDAGraph()
    with ops.kernel_chain(), torch.cuda.graph(graph):
        out = tri.rope_store_decode_attention(*args, max_seq_len=4096)
    graph.replay()
    assert rel_err(out, want) < 1e-2


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("q_lens", "ctx_lens"), [([1024], [0]), ([512] * 8, [0] * 8)])
def test_prefill_attention(q_lens, ctx_lens, head_dim):
    _prefill_check(q_lens, ctx_lens, head_dim)


def test_prefill_attention_ragged_with_cached_prefix():
    _prefill_check([1, 17, 300, 129, 64], [0, 16, 700, 33, 1000], D)


def _prefill_check(q_lens, ctx_lens, head_dim):
    seq_lens_list = [c + n for c, n in zip(ctx_lens, q_lens)]
    q, k, v = fused_qkv_views(sum(q_lens), head_dim=head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    if any(ctx_lens):
        k_cache, v_cache, block_tables = paged_cache(seq_lens_list, head_dim=head_dim)
        cache_args = (k_cache, v_cache, block_tables)
        want = ref.prefill_attention(
            *f32(q, k, v), cu, seq_lens, scale, *f32(k_cache, v_cache), block_tables
        )
    else:
        cache_args = ()
        want = ref.prefill_attention(*f32(q, k, v), cu, seq_lens, scale)
    out = tri.prefill_attention(q, k, v, cu, seq_lens, scale, *cache_args)
    assert rel_err(out, want) < 1e-2
    out = tri.prefill_attention(q, k, v, cu, seq_lens, scale, *cache_args, max_q_len=max(q_lens))
    assert rel_err(out, want) < 1e-2
