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


# --------------------------------------------------------------------------
# Sliding-window attention: the Triton kernels (interpreted) against the reference
# --------------------------------------------------------------------------


def _interpreted_triton():
    """The Triton ops module when its kernels run in the interpreter, else None."""
    try:
        import triton
    except ImportError:
        return None
    from pagedllm.ops import triton_attention, triton_impl

    if isinstance(triton_attention._decode_kernel, triton.runtime.jit.JITFunction):
        return None  # compiled: these CPU-tensor tests cannot run
    return triton_impl


tri = _interpreted_triton()
needs_interpreter = pytest.mark.skipif(
    tri is None, reason="needs Triton's interpreter (TRITON_INTERPRET=1 before Triton's import)"
)


def assert_close(out, want, dtype):
    assert out.dtype == dtype and out.shape == want.shape
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_interpreter
@pytest.mark.parametrize("window", [0, 1, 5, 23, 100, 1000])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 1)])
def test_triton_prefill_window(gen, window, num_heads, num_kv_heads):
    """Several query blocks (140 new tokens: float32 tiles are 64 x 32), prefixes
    shorter and longer than the window; windows inside one key tile, across tiles,
    longer than every sequence."""
    q_lens, ctx_lens = [140, 17, 3, 1], [0, 40, 70, 5]
    args, _ = prefill_case(gen, q_lens, ctx_lens, num_heads, num_kv_heads, 32)
    args = (*args[:5], 0.2, *args[5:])
    want = ref.prefill_attention(*args, window=window)
    out = tri.prefill_attention(*args, max_q_len=140, window=window)
    assert_close(out, want, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_triton_decode_window(gen, window, num_splits, num_heads, num_kv_heads):
    lens = [1, 15, 16, 17, 70, 200, 0]  # several pages, and a padding row (seq_len 0)
    (q, kc, vc, tables, seq_lens), _ = decode_case(gen, lens, num_heads, num_kv_heads, 32)
    want = ref.decode_attention(q, kc, vc, tables, seq_lens, 0.2, window=window)
    out = tri.decode_attention(
        q, kc, vc, tables, seq_lens, 0.2, window=window, num_splits=num_splits
    )
    assert_close(out, want, torch.float32)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_window_reads_only_the_window(gen, num_splits):
    """Pages wholly before every window are never loaded: NaN there changes nothing
    (a kernel that read and masked them would multiply NaN values by 0), and the
    splits cover only the window."""
    lens = [300, 100]
    (q, kc, vc, tables, seq_lens), _ = decode_case(gen, lens, 4, 2, 32)
    want = ref.decode_attention(q, kc, vc, tables, seq_lens, 0.2, window=40)
    for b, n in enumerate(lens):
        dead = tables[b, : (n - 40) // BS].long()  # the pages before position n - 40
        kc[dead], vc[dead] = float("nan"), float("nan")
    out = tri.decode_attention(q, kc, vc, tables, seq_lens, 0.2, window=40, num_splits=num_splits)
    assert_close(out, want, torch.float32)
    assert ref.decode_attention(q, kc, vc, tables, seq_lens, 0.2, window=40).isfinite().all()


@needs_interpreter
@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the rows that do read them
def test_triton_prefill_window_reads_no_key_before_it(gen):
    """A chunk after a long prefix: K/V before the first new token's window, in the
    pages and among the new tokens of earlier query blocks, are never loaded."""
    args, _ = prefill_case(gen, [130], [100], 4, 2, 32)
    q, k, v, cu, seq_lens, kc, vc, tables = args
    window = 70  # query block 64.. (position 164..) sees 95.. ; block 128.. sees 159..
    want = ref.prefill_attention(q, k, v, cu, seq_lens, 0.2, kc, vc, tables, window=window)
    dead = tables[0, :1].long()  # positions 0..15: before every window
    # NaN in V: a loaded but masked key would still add 0 * NaN to the sum.
    kc[dead], vc[dead] = float("nan"), float("nan")
    out = tri.prefill_attention(q, k, v, cu, seq_lens, 0.2, kc, vc, tables, window=window)
    assert_close(out, want, torch.float32)
    # New tokens 0..31 are a whole key tile before the last query block's windows:
    # that block (tokens 128, 129) never loads them, the first ones do.
    k[:32], v[:32] = float("nan"), float("nan")
    again = tri.prefill_attention(q, k, v, cu, seq_lens, 0.2, kc, vc, tables, window=window)
    assert again[:64].isnan().all() and torch.equal(again[128:], out[128:])


@needs_interpreter
@pytest.mark.parametrize("window", [0, 1, 20])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_rope_store_decode_attention_window(gen, window, num_splits):
    """The batch-1 fused decode (RoPE, K/V store, attention in one kernel) with a
    window equals rope_and_store then the windowed decode_attention."""
    lens = [1, 17, 70]
    (q, kc, vc, tables, seq_lens), _ = decode_case(gen, lens, 4, 2, 32)
    k = torch.randn(len(lens), 2, 32, generator=gen)
    v = torch.randn(len(lens), 2, 32, generator=gen)
    positions = (seq_lens - 1).long()
    slots = tables[torch.arange(len(lens)), positions // BS].long() * BS + positions % BS
    cos_sin = ref.rope_cos_sin_cache(32, 10000.0, None, 100)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = ref.rope_store_decode_attention(
        q.clone(), k.clone(), v, positions, cos_sin, want_kc, want_vc, slots, tables, seq_lens,
        0.2, window=window,
    )  # fmt: skip
    out = tri.rope_store_decode_attention(
        q, k, v, positions, cos_sin, kc, vc, slots, tables, seq_lens, 0.2,
        window=window, num_splits=num_splits,
    )  # fmt: skip
    assert_close(out, want, torch.float32)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


@needs_interpreter
def test_triton_window_rejects_a_negative_window(gen):
    (q, *rest), _ = decode_case(gen, [5], 4, 2, 32)
    with pytest.raises(ValueError, match="window -3: must be >= 0"):
        tri.decode_attention(q, *rest, 0.2, window=-3)


# --------------------------------------------------------------------------
# head_dim 256 (Gemma 3) and 128 beside 64, in every Triton kernel
# --------------------------------------------------------------------------

HEAD_DIM_CASES = [  # (head_dim, num_heads, num_kv_heads)
    (64, 4, 4),
    (128, 8, 2),
    (256, 4, 1),  # Gemma 3 270M
    (256, 8, 8),
]
DTYPES = [torch.float32, torch.bfloat16]


@needs_interpreter
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), HEAD_DIM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_head_dims(gen, head_dim, num_heads, num_kv_heads, dtype):
    """The tiles each head dim gets (16-bit: 16 KB of K per tile, 32 tokens at
    D=256), with and without splits and a window."""
    lens = [1, 33, 90]
    (q, kc, vc, tables, seq_lens), _ = decode_case(gen, lens, num_heads, num_kv_heads, head_dim)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    for window, splits in [(0, 1), (40, 3)]:
        want = ref.decode_attention(
            q.float(), kc.float(), vc.float(), tables, seq_lens, 0.1, window=window
        )
        out = tri.decode_attention(
            q, kc, vc, tables, seq_lens, 0.1, window=window, num_splits=splits
        )
        assert_close(out, want.to(dtype), dtype)


@needs_interpreter
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), HEAD_DIM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_prefill_head_dims(gen, head_dim, num_heads, num_kv_heads, dtype):
    """`_prefill_config`'s tiles for each head dim (bf16: the GPU's), a cached
    prefix longer than the window."""
    args, _ = prefill_case(gen, [70, 5], [40, 0], num_heads, num_kv_heads, head_dim, dtype)
    args = (*args[:5], 0.1, *args[5:])
    for window in (0, 30):
        want = ref.prefill_attention(*(a.float() if a.is_floating_point() else a for a in args[:5]),
                                     0.1, *(a.float() if a.is_floating_point() else a
                                            for a in args[6:]), window=window)  # fmt: skip
        out = tri.prefill_attention(*args, window=window)
        assert_close(out, want.to(dtype), dtype)


@needs_interpreter
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), HEAD_DIM_CASES[1:3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rope_head_dims(gen, head_dim, num_heads, num_kv_heads, dtype):
    """RoPE in place and RoPE + K/V store at D=128 and 256, on strided views of
    one fused QKV output: equal to the reference bit for bit."""
    n, q_size, kv_size = 5, num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(n, q_size + 2 * kv_size, generator=gen).to(dtype)
    qkv2 = qkv.clone()  # for apply_rope alone, below
    views = (
        qkv[:, :q_size].view(n, num_heads, head_dim),
        qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim),
        qkv[:, q_size + kv_size :].view(n, num_kv_heads, head_dim),
    )
    positions = torch.tensor([0, 3, 17, 40, 99])
    cos_sin = ref.rope_cos_sin_cache(head_dim, 1e6, None, 100)
    want_q, want_k = ref.apply_rope(views[0], views[1], positions, cos_sin)
    kc = torch.zeros(4, BS, num_kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    want_kc, want_vc = kc.clone(), vc.clone()
    slots = torch.tensor([0, 5, 17, 40, 63])
    ref.store_kvcache(want_k, views[2], want_kc, want_vc, slots)
    q, k = tri.rope_and_store(*views, positions, cos_sin, kc, vc, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    q2 = qkv2[:, :q_size].view(n, num_heads, head_dim)
    k2 = qkv2[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)
    tri.apply_rope(q2, k2, positions, cos_sin)
    assert torch.equal(q2, want_q) and torch.equal(k2, want_k)  # in place on the views


@needs_interpreter
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 1), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_rope_store_decode_attention_head_dim_256(gen, num_heads, num_kv_heads, dtype):
    lens = [1, 20, 50]
    (q, kc, vc, tables, seq_lens), _ = decode_case(gen, lens, num_heads, num_kv_heads, 256, dtype)
    k = torch.randn(len(lens), num_kv_heads, 256, generator=gen).to(dtype)
    v = torch.randn(len(lens), num_kv_heads, 256, generator=gen).to(dtype)
    positions = (seq_lens - 1).long()
    slots = tables[torch.arange(len(lens)), positions // BS].long() * BS + positions % BS
    cos_sin = ref.rope_cos_sin_cache(256, 10000.0, None, 64)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = ref.rope_store_decode_attention(
        q.clone(), k.clone(), v, positions, cos_sin, want_kc, want_vc, slots, tables, seq_lens,
        0.0625, window=16,
    )  # fmt: skip
    out = tri.rope_store_decode_attention(
        q, k, v, positions, cos_sin, kc, vc, slots, tables, seq_lens, 0.0625, window=16
    )
    assert out.dtype == dtype and rel_err(out, want) < (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


@needs_interpreter
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rms_norm_per_head_on_a_strided_view(gen, head_dim, dtype):
    """Qwen3's and Gemma 3's q/k norms: rms_norm of a (T, H, D) strided view of the
    fused QKV output (token stride != H * D), read in place, equals the reference
    on the same rows; the view is left as it was."""
    n, heads = 3, 4
    qkv = torch.randn(n, (heads + 2) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    before = qkv.clone()
    out = tri.rms_norm(q, weight, 1e-6)
    want = ref.rms_norm(q.reshape(-1, head_dim), weight, 1e-6).view(n, heads, head_dim)
    assert out.shape == q.shape and out.is_contiguous() and torch.equal(qkv, before)
    if dtype == torch.float32:
        assert rel_err(out, want) < 1e-6
    else:  # one bf16 step apart at most, where a float32 sum order differs
        diff = (out.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= max(1, out.numel() // 1000)


@needs_interpreter
@pytest.mark.parametrize("head_dim", [48, 96, 512])
def test_triton_attention_rejects_unsupported_head_dims(gen, head_dim):
    q = torch.zeros(1, 2, head_dim)
    kc = torch.zeros(2, BS, 1, head_dim)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"head_dim {head_dim}: .* power of two from 16 to 256"):
        tri.decode_attention(q, kc, kc, tables, lens, 0.1)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"head_dim {head_dim}"):
        tri.prefill_attention(q, q[:, :1], q[:, :1], cu, lens, 0.1)
    cos_sin = torch.zeros(4, head_dim)
    with pytest.raises(ValueError, match=f"head_dim {head_dim}"):
        tri.rope_and_store(q, q[:, :1], q[:, :1], lens, cos_sin, kc, kc, lens)


def test_tile_configs_fit_an_h200s_shared_memory():
    """Every (dtype, head_dim) gets tiles whose Q + stages x (K + V) stay within
    the 227 KB a block may use on an H200 (decode: stages x (K + V) plus q): an
    upper bound of what the compiler allocates (128 KB for bf16 prefill at D=128
    and 256, 41 KB for decode at D=256, compiled for sm_90a)."""
    triton_attention = pytest.importorskip("pagedllm.ops.triton_attention")
    limit = 227 * 1024
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim in (64, 128, 256):
            size = dtype.itemsize
            bm, bn, _, stages = triton_attention._prefill_config(dtype, head_dim)
            assert bm * head_dim * size + stages * 2 * bn * head_dim * size <= limit
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        for head_dim in (64, 128, 256):
            bn, warps, stages = triton_attention._decode_tile(head_dim, dtype)
            q_bytes = 16 * head_dim * max(2, dtype.itemsize)
            assert q_bytes + stages * 2 * bn * head_dim * dtype.itemsize <= limit
            assert 16 * head_dim // (32 * warps) <= 64  # float32 accumulator per thread


# --------------------------------------------------------------------------
# GELU (tanh) gated MLP: Gemma's GeGLU
# --------------------------------------------------------------------------


def torch_geglu(x: torch.Tensor) -> torch.Tensor:
    """transformers' Gemma MLP activation on [gate | up], in float64."""
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def assert_bf16_at_most_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results rounded as the reference rounds them: equal bits, except a few
    one bf16 step apart (a float32 value a hair from a rounding boundary)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= max(1, got.numel() // 500)


def test_reference_gelu_tanh_and_mul(gen):
    x = torch.randn(5, 2 * 300, generator=gen) * 3
    out = ref.gelu_tanh_and_mul(x)
    assert out.shape == (5, 300) and rel_err(out, torch_geglu(x)) < 1e-6
    # not the exact (erf) GELU, and not SiLU
    gate, up = x.chunk(2, dim=-1)
    assert rel_err(out, torch.nn.functional.gelu(gate) * up) > 1e-5
    assert rel_err(out, ref.silu_and_mul(x)) > 1e-2
    w = torch.randn(2 * 24, 40, generator=gen)
    h = torch.randn(3, 40, generator=gen)
    assert (
        rel_err(ref.linear_gelu_tanh_and_mul(h, w), torch_geglu(h.double() @ w.double().T)) < 1e-5
    )
    xb = x.bfloat16()  # rounded as transformers' bf16 Gemma: gelu in float32, then to bf16
    gate, up = xb.chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.equal(ref.gelu_tanh_and_mul(xb), want)


def assert_geglu_close(out: torch.Tensor, x: torch.Tensor) -> None:
    """out against the reference on the same x: within its two roundings, and the
    float32 sum 1 + tanh(u), of the exact value everywhere; in 16 bits the same
    bits as the reference almost everywhere.

    The kernel's tanh is not torch's: where 1 + tanh(u) cancels (gates below about
    -3) an ulp of tanh, 6e-8, is large against gelu, so those tiny values differ
    in their bits (by ~0.5 |gate| ulps of 1: 1e-7 * |gate * up| at most here)."""
    want = ref.gelu_tanh_and_mul(x)
    assert out.shape == want.shape and out.dtype == want.dtype == x.dtype
    exact = torch_geglu(x)
    gate, up = x.double().chunk(2, dim=-1)
    step = {torch.float32: 2**-23, torch.float16: 2**-11, torch.bfloat16: 2**-8}[x.dtype]
    tol = 2 * step * exact.abs() + 1e-7 * (gate * up).abs() + 2**-24 * (1 + up.abs())
    assert ((out.double() - exact).abs() <= tol).all()
    if x.dtype != torch.float32:  # where 1 + tanh does not cancel: the same bits
        assert (out != want)[gate > -3].float().mean() < 0.01


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_gelu_tanh_and_mul(gen, dtype):
    """Gates over GELU's whole range (saturated at both ends: 0 and the gate
    itself), and a strided [gate | up] view."""
    x = torch.randn(3, 2 * 1500, generator=gen) * 3
    x[0, :12] = torch.tensor([-60.0, -20, -9, -6, -5.2, -5.0, -1e-4, 0, 1e-4, 5, 9, 60])
    x = x.to(dtype)
    out = tri.gelu_tanh_and_mul(x)
    assert_geglu_close(out, x)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))  # gelu(-60), gelu(-20)
    assert torch.equal(out[0, 10:12], ref.gelu_tanh_and_mul(x)[0, 10:12])  # gelu(g) = g: 9, 60
    wide = torch.randn(2, 3 * 200, generator=gen).to(dtype)[:, :400]  # row stride 600
    assert_geglu_close(tri.gelu_tanh_and_mul(wide), wide)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 300), (1, 38, 100), (3, 40, 70)])
def test_triton_linear_gelu_tanh_and_mul(gen, dtype, m, n, k, monkeypatch):
    """One row: the GEMV with GeGLU in its epilogue (the kernel's ACT); more rows
    (and its fallback): a matmul then the GeGLU kernel. Both as the reference
    rounds them. The SwiGLU GEMV still computes SiLU."""
    from pagedllm.ops import triton_gemv

    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    real, acts = triton_gemv.gemv, []

    def recording_gemv(*args, **kwargs):
        acts.append(kwargs.get("act"))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_gemv, "gemv", recording_gemv)
    for fused, reference in [
        (tri.linear_gelu_tanh_and_mul, ref.linear_gelu_tanh_and_mul),
        (tri.linear_silu_and_mul, ref.linear_silu_and_mul),
    ]:
        out, want = fused(x, w), reference(x, w)
        assert out.shape == (m, n // 2)
        if dtype == torch.bfloat16:  # the projection's sums in another order
            assert_bf16_at_most_one_step(out, want)
        else:
            assert rel_err(out, want) < 1e-5
    assert acts == (["gelu_tanh", None] if m == 1 else [])  # silu: the default act


# --------------------------------------------------------------------------
# Qwen2's q/k/v bias, added inside the projection
# --------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_linear_with_bias(gen, dtype, m, monkeypatch):
    """`linear(x, w, bias=b)` is nn.Linear's: the bias joins the float32 sums before
    their one rounding (the one-row GEMV adds it in its epilogue), which an add
    after the projection would not give in bf16."""
    from pagedllm.ops import triton_gemv

    x = torch.randn(m, 96, generator=gen).to(dtype)
    w = (torch.randn(40, 96, generator=gen) / 10).to(dtype)
    b = (torch.randn(40, generator=gen) * 3).to(dtype)
    layer = torch.nn.Linear(96, 40, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b)
        want = layer(x)
    assert torch.equal(ref.linear(x, w, bias=b), want)
    real, biased = triton_gemv.gemv, []

    def recording_gemv(*args, **kwargs):
        biased.append(kwargs.get("bias") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_gemv, "gemv", recording_gemv)
    out = tri.linear(x, w, bias=b)
    assert biased == ([True] if m == 1 else [])
    if dtype == torch.bfloat16:
        assert_bf16_at_most_one_step(out, want)
        twice = ref.linear(x, w) + b  # rounded twice: often a step off
        assert (twice != want).sum() > (out != want).sum()
    else:
        assert rel_err(out, want) < 1e-6
    assert torch.equal(tri.linear(x, w), real(x, w) if m == 1 else ref.linear(x, w))
    with pytest.raises(ValueError, match="takes no bias"):
        real(x[:1], w, glu=True, bias=b)


# --------------------------------------------------------------------------
# Windows through a sequence's life, and with float8 pages
# --------------------------------------------------------------------------


@needs_interpreter
def test_windowed_chunked_prefill_then_decode_matches_one_shot(gen):
    """A prompt prefilled in two chunks, then two decode steps (the second through
    the batch-1 fused kernel), all with window 10, equal windowed attention over
    the whole sequence at once."""
    n, window, heads, kv_heads, d = 37, 10, 4, 2, 32
    q = torch.randn(n + 2, heads, d, generator=gen)
    k = torch.randn(n + 2, kv_heads, d, generator=gen)
    v = torch.randn(n + 2, kv_heads, d, generator=gen)
    whole = naive_attention(q, k, v, torch.arange(n + 2), 0.2, window)
    k_cache = torch.zeros(4, BS, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[2, 0, 3, -1]], dtype=torch.int32)

    def slots(lo, hi):
        pos = torch.arange(lo, hi)
        return tables[0, pos // BS].long() * BS + pos % BS

    outs = []
    for lo, hi in [(0, 20), (20, n)]:  # two prefill chunks, the second over a prefix
        tri.store_kvcache(k[lo:hi], v[lo:hi], k_cache, v_cache, slots(lo, hi))
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        seq = torch.tensor([hi], dtype=torch.int32)
        outs.append(
            tri.prefill_attention(
                q[lo:hi],
                k[lo:hi],
                v[lo:hi],
                cu,
                seq,
                0.2,
                k_cache,
                v_cache,
                tables,
                window=window,
            )  # fmt: skip
        )
    tri.store_kvcache(k[n : n + 1], v[n : n + 1], k_cache, v_cache, slots(n, n + 1))
    seq = torch.tensor([n + 1], dtype=torch.int32)
    outs.append(tri.decode_attention(q[n : n + 1], k_cache, v_cache, tables, seq, 0.2, window=10))
    # The fused kernel rotates q and k itself: a cos/sin cache of cos 1, sin 0 leaves
    # them as they are, so the step compares with the same whole-sequence attention.
    identity = torch.cat([torch.ones(n + 2, d // 2), torch.zeros(n + 2, d // 2)], dim=-1)
    seq = torch.tensor([n + 2], dtype=torch.int32)
    outs.append(
        tri.rope_store_decode_attention(
            q[n + 1 :],
            k[n + 1 :],
            v[n + 1 :],
            torch.tensor([n + 1]),
            identity,
            k_cache,
            v_cache,
            slots(n + 1, n + 2),
            tables,
            seq,
            0.2,
            window=window,
        )  # fmt: skip
    )
    assert rel_err(torch.cat(outs), whole) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_triton_decode_window_fp8_pages(gen, num_splits, heads_per_program):
    """float8 pages (the fp8 tiles, and two KV heads per program) with a window."""
    fp8 = torch.float8_e4m3fn
    (q, kc, vc, tables, seq_lens), _ = decode_case(gen, [5, 60, 150], 8, 4, 32)
    kc, vc = kc.to(fp8), vc.to(fp8)
    want = ref.decode_attention(q, kc, vc, tables, seq_lens, 0.2, window=40)
    out = tri.decode_attention(
        q, kc, vc, tables, seq_lens, 0.2, window=40, num_splits=num_splits,
        heads_per_program=heads_per_program,
    )  # fmt: skip
    assert rel_err(out, want) < 1e-5


# --------------------------------------------------------------------------
# The D=256 tiles on the GPU's compiler, without a GPU
# --------------------------------------------------------------------------

_COMPILE_FOR_SM90 = r"""
import json, os, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedllm.ops import triton_attention as ta

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
UNALIGNED = {"cu_seqlens_ptr", "seq_lens_ptr", "block_tables_ptr", "order_ptr", "positions_ptr",
             "slot_mapping_ptr"}
NAMES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}


def build(fn, types, const, warps, stages, out):
    # Pointers and strides carry the divisible-by-16 attribute a launch gives them.
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in const else types.get(name, "i32")
        if name not in const and name not in UNALIGNED and (
            sig[name].startswith("*") or name.startswith("stride")
        ):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = os.path.join(out, "k.ptx")
    open(ptx, "w").write(k.asm["ptx"])
    log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", ptx + ".o"],
                         capture_output=True, text=True, check=True).stderr
    spills = sum(int(w.split()[0]) for w in log.split(",") if "spill stores" in w)
    return {"shared": k.metadata.shared, "spill_bytes": spills}


def prefill(D, window):
    bm, bn, warps, stages = ta._prefill_config(torch.bfloat16, D)
    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types.update(block_tables_ptr="*i32", cu_seqlens_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32")
    const = dict(G=4, D=D, BS=16, BLOCK_M=bm, BLOCK_N=bn, HAS_CACHE=True, PREC="tf32",
                 HAS_WINDOW=window)
    return build(ta._prefill_kernel, types, const, warps, stages, sys.argv[1])


def decode(cache_dtype, D, split, new_token, window):
    bn, warps, stages = ta._decode_tile(D, cache_dtype)
    c = "*" + NAMES[cache_dtype]
    types = dict(q_ptr="*bf16", k_cache_ptr=c, v_cache_ptr=c, block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32",
                 new_k_ptr="*bf16", new_v_ptr="*bf16", positions_ptr="*i64", cos_sin_ptr="*fp32",
                 slot_mapping_ptr="*i64", order_ptr="*i32", qk_scale="fp32")
    const = dict(G=4, BLOCK_G=16, D=D, BS=16, BLOCK_N=bn, SPLIT=split, PREC="tf32",
                 FP16_DOTS=cache_dtype.itemsize == 1, NEW_TOKEN=new_token,
                 CACHE_MAX=448.0 if cache_dtype.itemsize == 1 else 0.0, PDL=False, HP=1,
                 ORDERED=False, HAS_WINDOW=window)
    return build(ta._decode_kernel, types, const, warps, stages, sys.argv[1])


results = {}
for D in (128, 256):
    for window in (False, True):
        results[f"prefill D={D} window={window}"] = prefill(D, window)
results["decode bf16 D=256"] = decode(torch.bfloat16, 256, False, False, False)
results["decode bf16 D=256 split window"] = decode(torch.bfloat16, 256, True, False, True)
results["decode bf16 D=256 new token window"] = decode(torch.bfloat16, 256, False, True, True)
results["decode fp8 D=256 split window"] = decode(torch.float8_e4m3fn, 256, True, False, True)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_attention_tiles_compile_for_the_h200_within_shared_memory_and_registers(tmp_path):
    """The prefill and decode kernels at D=128 and 256 (bf16, float8 pages, with
    windows), compiled for sm_90a by Triton's own compiler and ptxas (no GPU
    needed): each within an H200's 227 KB of shared memory and spilling no
    register. A separate process: the Triton of this one may be interpreted."""
    import json
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton has no bundled ptxas")
    script = tmp_path / "compile_for_sm90.py"
    script.write_text(_COMPILE_FOR_SM90)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, got in results.items():
        assert got["shared"] <= 227 * 1024, (name, got)
        assert got["spill_bytes"] == 0, (name, got)
