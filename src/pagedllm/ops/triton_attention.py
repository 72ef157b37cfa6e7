"""Triton attention kernels: paged decode (flash-decoding) and packed causal prefill.

Owns: the two attention kernels and the host-side choices around them (block
sizes, warps, how many KV splits); the decode kernel also serves
`rope_store_decode_attention` (batch-1 decode: RoPE and the KV store of the
new token done inside it, one launch instead of two). Does not own: the
numerics, which are `reference.decode_attention`,
`reference.rope_store_decode_attention` and `reference.prefill_attention`;
the tests compare them.

Layouts: q (T or B, H, D) and the new k, v (T, Hkv, D) may be strided views of a
fused QKV output (row stride != H*D), but their last dim must be contiguous.
Caches are (NB, BS, Hkv, D); token i of a sequence lives at page
`block_table[i // BS]`, row `i % BS`. Block-table entries past a sequence's
pages are never dereferenced (the loads are masked), so padding can hold
anything.

Decode is CUDA-graph safe: the grid and every host-side choice depend only on
host ints (shapes and the optional `max_seq_len` hint); each program reads its
sequence's length from `seq_lens` on the device. A sequence with seq_len 0 (a
padding row of a captured batch) gets zeros.

All scores use exp2 with `scale * log2(e)` folded into one multiply; the
running max, denominator and accumulator are float32.

Sliding windows (`window=W`, Mistral and Gemma 3's local layers; the mask is
`reference`'s, transformers' own): decode reads only the pages of a sequence's
last W positions, its splits sharing those; prefill starts each query block's
key loops at its first row's window. W is a runtime argument, so one compiled
variant serves every window (HAS_WINDOW, a constexpr, keeps the W = 0 kernels
as they were). Head dims: powers of two from 16 to 256 (Gemma 3's), with tiles
chosen per head dim (`_prefill_config`, `_decode_tile`).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from pagedllm.ops import triton_interpret_fix  # noqa: F401  (CPU interpreter + NumPy 2.4)
from pagedllm.ops.triton_kv import cache_max, to_cache
from pagedllm.ops.triton_pdl import pdl_start, pdl_wait, use_pdl

LOG2E = 1.4426950408889634

# Decode: the G query heads that share a KV head are padded up to 16 rows, the
# smallest M of a tensor-core dot; keys arrive BLOCK_N tokens (several pages) a
# time. 16-bit pages: BLOCK_N chosen so one K tile is 16 KB (128 tokens at D=64),
# 4 warps, 3 stages. Measured on the H200 (B=64/256, ctx 512/2048, D=64): 3.8-4.2
# TB/s; 8 KB tiles ran 5-10 % slower, 8 warps 10-20 % slower. Split-KV kicks in
# only when B * Hkv programs leave SMs idle.
DECODE_TILE_BYTES = 16384
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# float8 pages: 8 KB tiles (64 tokens at D=128), 2 warps, 5 stages. Triton's
# pipeliner gives this loop (a block-table load, then the K/V loads that depend on
# it) one shared buffer per tile up to num_stages=4: the next tile's copy is issued
# only after the current tile's math, so every tile pays the full memory latency.
# At 5 stages it keeps two buffers and the copy of tile n+1 overlaps the math of
# tile n. The 16-bit tiles carry twice the bytes per wait and hide it anyway; float8 tiles did
# not (1.7-2.4 TB/s of useful reads at 128 tokens, 4 warps, 3 stages). With the
# fewer warps, each program's cross-warp max/sum and the P relayout cost less too.
# Measured (scripts/bench_decode_attention.py, batch 256 x 790 and 64 x 2,048):
# 2.3-3.2 TB/s at D=64 and 128.
# Tried: 32-token tiles on one warp for grids of >= 6 programs per SM. Alone, in a
# graph of attention calls, batch 128-256 ran 1-30 % faster (8B, 256 x 790: 138
# -> 120 us); inside the engine's decode step the same batches ran 2-3 % slower
# (scripts/profile_throughput.py, 8B float8, batch 192-256: 11.97 -> 12.20 ms per
# step, against the tree before it and the grid order below), so one tile stays.
# At D=64, 128-token tiles (8 KB) ran faster than 64 for batch 64 x 2,048 (49.7
# against 55.1 us alone; in the engine's steps of batch 16-63, 4-5 % faster).
FP8_DECODE_TILE_BYTES = 8192
FP8_DECODE_NUM_WARPS = 2
FP8_DECODE_NUM_STAGES = 5
# KV heads per program (the kernel's HP) for float8 pages: HP neighbouring heads'
# rows of a token read as one row of HP * D values. With one head a token's K row
# is D bytes, 64 at D=64, fetched from pages where each 16-token page interleaves
# every KV head. Two heads at D=64 (128-byte rows): 1B, batch 256 x 790, 82.4 ->
# 71.5 us alone (scripts/bench_decode_attention.py); in the engine, 1B float8
# throughput 43,342 -> 45,711 tok/s (scripts/profile_throughput.py). HP is taken
# only while HP_MIN_PROGRAMS_PER_SM programs per SM remain (a thinner grid was
# slower). Rows wider than 128 values were slower (8B, D=128, two heads: 193 us
# against 138). 16-bit pages stay at one head: alone, four heads at D=64 (512-byte
# rows) ran 112 -> 101 us at batch 256 x 790, but in the engine's decode steps,
# with ragged contexts, 4-8 % slower per step (1B bf16 steps of batch
# 128-191: 2.64 -> 2.75 ms with two heads; 192-256: 2.87-3.16 -> 3.11-3.42 with
# four), so the rule does not use them; `heads_per_program=` still can.
MAX_FP8_ROW_VALUES = 128
HP_MIN_PROGRAMS_PER_SM = 3
MIN_TOKENS_PER_SPLIT = 128  # below this a split costs more than it hides
MAX_SPLITS = 64


def _decode_tile(row: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for decode over pages of `dtype`, reading
    `row` values (heads per program x head_dim) per token.

    The tiles keep their bytes as the row grows, so at D=256 (Gemma 3) they hold
    32 tokens (16-bit and float8 alike). Compiled for sm_90a (ptxas 12.8; not
    yet timed on the GPU), D=256 uses 41 KB of shared memory; 16-bit pages 96-115
    registers (162 with RoPE and the store of the newest token), no spills.
    float8 pages at D=256 take 4 warps, not 2: with 2 the (16, 256) float32
    accumulator is 64 registers a thread, q and the K/V tiles widened to float16
    as many again, and the kernel used all 255 and spilled 212 bytes; with 4,
    198-204 registers and no spills."""
    row_bytes = row * dtype.itemsize
    if dtype.itemsize == 1:
        block_n = max(16, min(128, FP8_DECODE_TILE_BYTES // row_bytes))
        warps = FP8_DECODE_NUM_WARPS if row < 256 else 4
        return block_n, warps, FP8_DECODE_NUM_STAGES
    block_n = max(16, min(128, DECODE_TILE_BYTES // row_bytes))
    return block_n, DECODE_NUM_WARPS, DECODE_NUM_STAGES


def _heads_per_program(
    batch: int, group: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_sms: int
) -> int:
    """KV heads per decode program: one for 16-bit pages; for float8 pages the most
    (a power of two dividing num_kv_heads) whose query rows fit one 16-row dot and
    whose row is at most MAX_FP8_ROW_VALUES, while the grid keeps
    HP_MIN_PROGRAMS_PER_SM programs per SM. A pure function of host ints, so a
    captured graph keeps its choice."""
    hp = 1
    while (
        dtype.itemsize == 1
        and num_kv_heads % (2 * hp) == 0
        and 2 * hp * group <= 16
        and 2 * hp * head_dim <= MAX_FP8_ROW_VALUES
        and batch * num_kv_heads // (2 * hp) >= HP_MIN_PROGRAMS_PER_SM * num_sms
    ):
        hp *= 2
    return hp


def _prefill_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for prefill.

    16-bit inputs: flash-attention's usual Hopper tiles, all wgmma, no spills
    by `ptxas -v` for sm_90a. At D=64, 64 x 64 tiles with 4 warps measured
    fastest on the H200 (1x1024: 22 us, 8x512: 41 us; 128 x 64 with 8 warps
    took 25 and 48 us): more programs for short prompts. At D=128, 128 x 64
    with 8 warps (128 KB of shared memory). float32 inputs run exact ("ieee")
    dots on FMA units, so small tiles keep them in registers; that path exists
    for correctness, not speed.

    Shared memory per program is Q + stages x (K + V) tiles: BLOCK_M * D * 2 +
    num_stages * 2 * BLOCK_N * D * 2 bytes for 16-bit inputs (128 KB at D=128).
    At D=256 (Gemma 3; not yet timed on the GPU): 64 x 32 tiles, 8 warps, 3
    stages: 32 + 3 x 32 = 128 KB of the H200's 227 KB, 194-202 registers and
    no spills (compiled for sm_90a, ptxas 12.8, with and without a cached
    prefix or a window). Every 4-warp choice there used all 255 registers and
    spilled (64 x 64, 2 stages: 64-192 bytes; 64 x 32: 4-36): the (64, 256)
    float32 accumulator alone is 128 registers a thread on 4 warps, 64 on 8.
    128-row tiles (8 warps) reached 255 too. 64-row query blocks also suit
    Gemma's 4-8 query heads, which make few programs per prompt. float32 at
    D=256: 32 x 32 tiles (100 KB).
    """
    if dtype == torch.float32:
        return (64, 32, 4, 2) if head_dim <= 128 else (32, 32, 4, 2)
    if head_dim <= 64:
        return 64, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 3


def check_head_dim(head_dim: int) -> None:
    """The head dims the tiles are made for: powers of two (tl.arange), 16 (the
    smallest dot) to 256 (Gemma 3; larger tiles would not fit shared memory).
    The RoPE kernels, which run before attention, check it too."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(
            f"head_dim {head_dim}: the Triton attention kernels take a power of two from 16 "
            "to 256; run this model with --ops reference"
        )


def _checked_window(window: int) -> int:
    """A sliding window as the kernels take it (0: none), as `reference` checks it."""
    if window < 0:
        raise ValueError(f"attention window {window}: must be >= 0 (0: no window)")
    # The kernels take it as an int32 (positions are int32 there): a window at least
    # as long as any sequence is no window.
    return min(int(window), 2**31 - 1)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise go through tf32 on the GPU (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200; only used to pick splits under the interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """How many KV splits per (sequence, KV head): a pure function of host ints.

    Enough programs for about two per SM, but no split shorter than
    MIN_TOKENS_PER_SPLIT tokens of the longest possible context.
    """
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    cap = max(1, triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT))
    return max(1, min(want, cap, MAX_SPLITS))


# --------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    bt_row,
    k_head,
    v_head,
    n0,
    end,
    strides,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    """K and V (BLOCK_N, D) of tokens n0.. of one sequence and KV head, read
    through its block-table row, as stored; and which of the tokens are < end."""
    stride_kc_nb, stride_kc_bs, stride_vc_nb, stride_vc_bs = strides
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < end
    page = tl.load(bt_row + n // BS, mask=n_mask, other=0).to(tl.int64)
    row = n % BS
    offs_d = tl.arange(0, D)
    k_off = page * stride_kc_nb + row * stride_kc_bs
    k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    v_off = page * stride_vc_nb + row * stride_vc_bs
    v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    return k, v, n_mask


@triton.jit
def _fold_tile(q, k, v, n_mask, m_i, l_i, acc, s_scale, PREC: tl.constexpr):
    """One online-softmax step of decode: the scores of q (BLOCK_G, D) against a
    K tile, then the running max, denominator and P @ V folded in. K/V are
    widened to q's dtype first (exactly, from float8)."""
    k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * s_scale  # (BLOCK_G, BLOCK_N)
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what we had; 0 on the first tile
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _rotated(ptr, rows, row_ok, cs_row, D: tl.constexpr):
    """Rows (R, D) at ptr + rows[:, None], rotated by the [cos | sin] row at cs_row
    ("rotate half": dim d pairs with d +- D/2, as `reference.apply_rope`) in
    float32, with the rope kernel's expressions, and rounded to their dtype."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, D)
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    cos = tl.load(cs_row + offs_d % HALF)[None, :]
    sin = tl.load(cs_row + HALF + offs_d % HALF)[None, :]
    x = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    xp = tl.load(ptr + rows[:, None] + partner[None, :], mask=row_ok[:, None], other=0.0)
    xf = x.to(tl.float32)
    xpf = xp.to(tl.float32)
    out = tl.where(first[None, :], xf * cos - xpf * sin, xf * cos + xpf * sin)
    return out.to(x.dtype)


# The window is a runtime int, never specialized (not even on == 1 or % 16), so
# one compiled variant serves every window size; HAS_WINDOW (constexpr) keeps the
# no-window variant exactly as it was.
@triton.jit(do_not_specialize=["window"])
def _decode_kernel(
    q_ptr,  # (B, H, D); with NEW_TOKEN, before RoPE
    k_cache_ptr,  # (NB, BS, Hkv, D)
    v_cache_ptr,
    block_tables_ptr,  # (B, max_blocks) int32
    seq_lens_ptr,  # (B,)
    out_ptr,  # (B, H, D) when not SPLIT
    part_o_ptr,  # (B, H, S, D) float32 when SPLIT
    part_lse_ptr,  # (B, H, S) float32 when SPLIT, log2 domain
    new_k_ptr,  # NEW_TOKEN: (B, Hkv, D) this step's k, before RoPE
    new_v_ptr,  # NEW_TOKEN: (B, Hkv, D) this step's v
    positions_ptr,  # NEW_TOKEN: (B,)
    cos_sin_ptr,  # NEW_TOKEN: (P, D) float32 [cos | sin]
    slot_mapping_ptr,  # NEW_TOKEN: (B,); a slot < 0 stores nothing (graph padding)
    order_ptr,  # ORDERED: (B,) the sequence each grid row takes (longest first)
    qk_scale,  # scale * log2(e)
    num_splits,
    window,  # HAS_WINDOW: the newest token sees the last `window` positions
    stride_qb,
    stride_qh,
    stride_kc_nb,
    stride_kc_bs,
    stride_kc_h,
    stride_vc_nb,
    stride_vc_bs,
    stride_vc_h,
    stride_bt_b,
    stride_ob,
    stride_oh,
    stride_nk_b,
    stride_nk_h,
    stride_nv_b,
    stride_nv_h,
    stride_cs,
    G: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # G padded to >= 16
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # float8 caches, 16-bit q: see below
    NEW_TOKEN: tl.constexpr,  # RoPE, the KV store and the newest token done here
    CACHE_MAX: tl.constexpr,  # float8 caches: the clamp of to_cache
    PDL: tl.constexpr,  # a programmatic dependent launch (ops/triton_pdl.py)
    HP: tl.constexpr = 1,  # KV heads per program (neighbours in the cache row)
    ORDERED: tl.constexpr = False,  # grid row i takes sequence order[i]
    HAS_WINDOW: tl.constexpr = False,  # a sliding window (reference.prefill_attention)
):
    pdl_start(PDL)
    # Grid (Hkv / HP, B, S): the KV heads of one sequence are neighbouring programs,
    # so they run side by side and read each page (all heads of 16 tokens) together.
    # With b first, a page's rows of one head (64 bytes at D=64 in float8) were read
    # in different waves: 1B, float8, batch 256 x 790 took 93.5 us, now 82.5.
    #
    # With HP > 1 a program takes HP neighbouring KV heads, so each token's K (and V)
    # is one contiguous row of HP * D values (W below) instead of HP rows of D. The
    # HP * G query rows share one dot: row r of q holds its head's values in the D
    # columns of its KV head (r // G) and zeros elsewhere, so q @ K^T over the W
    # columns gives each row the scores against its own KV head only. P @ V gives
    # every row all HP heads' sums; each row keeps (stores) its own D columns. The
    # dots do HP times the multiply-adds of one head's, on rows that were padding
    # (G = 4 query rows per KV head filled 4 of a dot's 16 rows).
    kvh = tl.program_id(0) * HP  # the first of this program's KV heads
    # The GPU starts programs in grid order. With ORDERED, grid row i takes the
    # sequence order[i] (the host sorts them longest first), so the longest
    # contexts start first and the last wave is short ones: ragged batches end
    # together instead of waiting on a long sequence started late.
    b = tl.load(order_ptr + tl.program_id(1)) if ORDERED else tl.program_id(1)
    split = tl.program_id(2)
    # Host-written inputs (lengths, block tables) and pages of earlier steps: no
    # kernel of this step writes them, so they may be read before pdl_wait.
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    # The positions this sequence's newest token sees, [lo, seq_len): all of them,
    # or with a sliding window the last `window`. Pages before lo are never read.
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    # This program's token range [start, end): each sequence's own [lo, seq_len) is
    # cut into num_splits equal (BLOCK_N-aligned) parts, so the split is graph-safe
    # and a split past the end simply runs no iterations. With a window the splits
    # share the window's tokens only.
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)
    else:
        start = lo
        end = seq_len
    # With NEW_TOKEN the last token (this step's) is not in the cache yet: the pages
    # are read up to it, and the program whose range holds it stores and adds it.
    paged_end = tl.minimum(end, seq_len - 1) if NEW_TOKEN else end

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    k_head = k_cache_ptr + kvh * stride_kc_h
    v_head = v_cache_ptr + kvh * stride_vc_h
    strides = (stride_kc_nb, stride_kc_bs, stride_vc_nb, stride_vc_bs)
    # With NEW_TOKEN, no kernel of this step has written the pages read here, so the
    # first tile is loaded before pdl_wait: with PDL it arrives while the kernel
    # before this one finishes. (Without, that kernel stored the newest K/V.)
    W: tl.constexpr = HP * D  # the K/V row a program reads per token
    tl.static_assert(HP == 1 or not NEW_TOKEN)
    if NEW_TOKEN:
        k, v, n_mask = _load_kv_tile(
            bt_row, k_head, v_head, start, paged_end, strides, BS, BLOCK_N, D
        )
    pdl_wait(PDL)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_w = tl.arange(0, W)
    g_mask = offs_g < HP * G
    heads = kvh * G + offs_g  # (BLOCK_G,) query heads of this program's KV heads
    # (BLOCK_G, W): which of row r's columns are its own KV head's
    own = (offs_w // D)[None, :] == (offs_g // G)[:, None]
    q_rows = b.to(tl.int64) * stride_qb + heads * stride_qh
    if NEW_TOKEN:
        cs_row = cos_sin_ptr + tl.load(positions_ptr + b).to(tl.int64) * stride_cs
        q = _rotated(q_ptr, q_rows, g_mask, cs_row, D)  # (BLOCK_G, D)
    else:
        q = tl.load(  # (BLOCK_G, W), zeros outside each row's own columns
            q_ptr + q_rows[:, None] + (offs_w % D)[None, :],
            mask=g_mask[:, None] & own,
            other=0.0,
        )
    if FP16_DOTS:
        # float8 pages under a 16-bit q: the dots run in float16, to which e4m3
        # widens in one hardware instruction (to bf16 it takes several, and the
        # kernel would be bound by them). q is scaled first (so no separate scale
        # after the dot) and clamped to float16's range.
        q = tl.clamp(q.to(tl.float32) * qk_scale, -65504.0, 65504.0).to(tl.float16)
        s_scale = 1.0
    else:
        s_scale = qk_scale

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, W], dtype=tl.float32)
    first = start
    if NEW_TOKEN:  # the tile loaded before the wait
        if start < paged_end:
            m_i, l_i, acc = _fold_tile(q, k, v, n_mask, m_i, l_i, acc, s_scale, PREC)
        first = start + BLOCK_N
    for n0 in range(first, paged_end, BLOCK_N):
        k, v, n_mask = _load_kv_tile(bt_row, k_head, v_head, n0, paged_end, strides, BS, BLOCK_N, W)
        m_i, l_i, acc = _fold_tile(q, k, v, n_mask, m_i, l_i, acc, s_scale, PREC)

    if NEW_TOKEN:
        newest = seq_len - 1
        if (newest >= start) & (newest < end):
            # RoPE on this step's k, k and v stored to their slot as the cache holds
            # them, and the token folded in from those stored values (as a page read
            # would give them back).
            one = tl.zeros([1], dtype=tl.int64)
            k_rows = one + b.to(tl.int64) * stride_nk_b + kvh * stride_nk_h
            k_new = tl.reshape(_rotated(new_k_ptr, k_rows, one == 0, cs_row, D), [D])
            v_new = tl.load(new_v_ptr + b.to(tl.int64) * stride_nv_b + kvh * stride_nv_h + offs_d)
            k_new = to_cache(k_new, k_cache_ptr, CACHE_MAX)
            v_new = to_cache(v_new, v_cache_ptr, CACHE_MAX)
            slot = tl.load(slot_mapping_ptr + b).to(tl.int64)
            if slot >= 0:
                page = slot // BS
                row = slot % BS
                tl.store(k_head + page * stride_kc_nb + row * stride_kc_bs + offs_d, k_new)
                tl.store(v_head + page * stride_vc_nb + row * stride_vc_bs + offs_d, v_new)
            kf = k_new.to(q.dtype).to(tl.float32)
            s_new = tl.sum(q.to(tl.float32) * kf[None, :], 1) * s_scale  # (BLOCK_G,)
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p
            pv = p.to(q.dtype).to(tl.float32)[:, None] * v_new.to(q.dtype).to(tl.float32)[None, :]
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    # An empty range (seq_len 0, or a split past the end) leaves l_i == 0: write
    # zeros and an lse of -inf so it weighs nothing in the reduction.
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    # Each row stores its own KV head's D columns of o (all of them when HP == 1).
    o_mask = g_mask[:, None] & own
    if SPLIT:
        bh = b.to(tl.int64) * (G * HP * tl.num_programs(0)) + heads  # flat (b, h) index
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + bh * num_splits + split, lse, mask=g_mask)
        o_ptrs = part_o_ptr + ((bh * num_splits + split) * D)[:, None] + (offs_w % D)[None, :]
        tl.store(o_ptrs, o, mask=o_mask)
    else:
        o_rows = b.to(tl.int64) * stride_ob + heads * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + (offs_w % D)[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,  # (B, H, S, D) float32
    part_lse_ptr,  # (B, H, S) float32, log2 domain
    out_ptr,  # (B, H, D)
    num_splits,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    PDL: tl.constexpr,
):
    """Merge one (sequence, head)'s split partials: all S at once (one round of
    loads, not S dependent ones), each weighted by exp2(lse - max lse)."""
    pdl_start(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    bh = b.to(tl.int64) * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    lse = tl.load(
        part_lse_ptr + bh * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf")
    )
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    live = w > 0.0  # a split past the end wrote zeros: skip reading them
    o = tl.load(
        part_o_ptr + (bh * num_splits + offs_s)[:, None] * D + offs_d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    acc = tl.sum(w[:, None] * o, 0)
    l = tl.sum(w, 0)
    o = acc / tl.where(l == 0.0, 1.0, l)  # seq_len 0: every split empty -> zeros
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    *,
    order: torch.Tensor | None = None,
    window: int = 0,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """Paged decode attention; see `reference.decode_attention`. Returns (B, H, D).

    One program per (sequence, KV head, split) computes all G = H/Hkv query
    heads of that KV head with one (G padded to 16) x D by D x BLOCK_N dot per
    tile; with `heads_per_program` HP > 1 (the rule's choice for float8 pages
    at D=64 and large batches) a program takes HP neighbouring KV heads, their
    HP * G query rows in one block-diagonal dot. `max_seq_len` (host int,
    optional) bounds every seq_len and only steers how many splits to use;
    without it the block-table width does. `num_splits` forces the split count
    (tests); `block_n`, `num_warps`, `num_stages` and `heads_per_program`
    override the tile choice (scripts/bench_decode_attention.py sweeps them).
    `order` (B,) int32, a permutation of 0..B-1: grid row i takes sequence
    order[i]; the GPU starts programs in grid order, so the runner passes the
    rows longest context first (a ragged batch's long sequences do not start
    in the last wave). `window` > 0: only the last `window` positions are read
    (and split: the split count is sized for min(max_seq_len, window)).
    Nothing here reads a device value on the host, so the call can be captured
    in a CUDA graph. The caches may be float8 (e4m3) while q is bf16/fp16/fp32:
    each tile is widened exactly before its dots, which run in float16 for a
    16-bit q (q scaled and rounded to float16's 11 bits: finer than bf16's 8)
    and in q's dtype for float32.
    """
    tiles = dict(
        window=_checked_window(window),
        num_splits=num_splits,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        heads_per_program=heads_per_program,
        order=order,
    )
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, None, **tiles)


def rope_store_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    *,
    window: int = 0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """See `reference.rope_store_decode_attention`: a decode step's attention from
    its q, k, v before RoPE, in one kernel (no rope_and_store launch before it).

    Each program rotates its G query heads itself; the program whose token range
    holds a sequence's newest token (position seq_len - 1) rotates that token's k,
    stores k and v to their slot, and folds the token in from those stored values.
    The pages it reads hold only earlier steps' tokens, so with PDL the first tile
    is loaded before waiting for the kernel before (the q/k/v projection). q, k
    and the caches are not rotated in place as `rope_and_store` leaves them: q and
    k are left as they came.
    """
    window = _checked_window(window)
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("rope_store_decode_attention needs a contiguous last dim")
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    new = (k, v, positions, cos_sin_cache, slot_mapping)
    return _decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, new,
        window=window, num_splits=num_splits,
    )  # fmt: skip


def _decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    max_seq_len,
    new,
    *,
    window=0,
    num_splits=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
    heads_per_program=None,
    order=None,
):
    """Both decode entry points: `new` = (k, v, positions, cos_sin_cache,
    slot_mapping) of this step's tokens, or None when they are in the cache already."""
    batch, num_heads, head_dim = q.shape
    check_head_dim(head_dim)
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if order is not None and order.shape != (batch,):
        raise ValueError(f"order has shape {tuple(order.shape)}; want ({batch},)")
    sms = _num_sms(q.device)
    hp = heads_per_program or (
        1
        if new is not None
        else _heads_per_program(batch, group, num_kv_heads, head_dim, k_cache.dtype, sms)
    )
    if hp > 1:
        if new is not None:
            raise ValueError("rope_store_decode_attention takes one KV head per program")
        if num_kv_heads % hp or hp & (hp - 1):
            raise ValueError(
                f"{hp} KV heads per program: must be a power of two dividing {num_kv_heads}"
            )
        if k_cache.stride(2) != head_dim or v_cache.stride(2) != head_dim:
            hp = 1  # the heads of a cache row are not contiguous: one at a time
    programs = num_kv_heads // hp
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        if window:  # a program reads at most `window` tokens
            bound = min(bound, window)
        num_splits = num_decode_splits(batch, programs, bound, sms)
    split = num_splits > 1
    pdl = use_pdl(q)
    tile = _decode_tile(hp * head_dim, k_cache.dtype)
    block_n, num_warps, num_stages = (
        given or default for given, default in zip((block_n, num_warps, num_stages), tile)
    )
    if split:
        part_o = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    new_k, new_v, positions, cos_sin, slots = (
        new if new is not None else (q, q, seq_lens, q, seq_lens)
    )
    _decode_kernel[(programs, batch, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_lse,
        new_k,
        new_v,
        positions,
        cos_sin,
        slots,
        order if order is not None else seq_lens,
        scale * LOG2E,
        num_splits,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        cos_sin.stride(0),
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(hp * group)),
        D=head_dim,
        BS=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        PREC=_dot_precision(q.dtype),
        FP16_DOTS=k_cache.dtype.itemsize == 1 and q.dtype.itemsize == 2,
        NEW_TOKEN=new is not None,
        CACHE_MAX=cache_max(k_cache),
        PDL=pdl,
        HP=hp,
        ORDERED=order is not None,
        HAS_WINDOW=window > 0,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    if split:
        block_s = triton.next_power_of_2(num_splits)
        _decode_reduce_kernel[(batch, num_heads)](
            part_o,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            D=head_dim,
            BLOCK_S=block_s,
            PDL=pdl,
            # (S, D) float32 partials in registers: at most 64 values per thread.
            num_warps=1 if block_s * head_dim <= 2048 else 4 if block_s * head_dim <= 8192 else 8,
            launch_pdl=pdl,
        )
    return out


# --------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PREC: tl.constexpr, EMPTY_ROWS: tl.constexpr = False):
    """Fold one tile of (already scaled, masked) scores s (M, N) and values v (N, D) in.

    EMPTY_ROWS: a row may have no visible key in this tile and none before (a
    sliding window starts later for later rows), so its max is still -inf; it
    then keeps m = -inf, l = 0, acc = 0 instead of computing exp2(-inf - -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY_ROWS:
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        base = m_new
    alpha = tl.exp2(m_i - base)
    p = tl.exp2(s - base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


# A mixed step passes cu_seqlens and seq_lens sliced past its decode rows
# (`model/llama.py`): pointers 4 bytes apart. Left unspecialized on alignment,
# they share one compiled kernel (scalar loads: alignment buys nothing there).
# The window, as in decode: a runtime int that is never specialized.
@triton.jit(
    do_not_specialize=["window"],
    do_not_specialize_on_alignment=["cu_seqlens_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _prefill_kernel(
    q_ptr,  # (T, H, D)
    k_ptr,  # (T, Hkv, D) new tokens
    v_ptr,
    k_cache_ptr,  # (NB, BS, Hkv, D), only read when HAS_CACHE
    v_cache_ptr,
    block_tables_ptr,  # (B, max_blocks)
    cu_seqlens_ptr,  # (B + 1,)
    seq_lens_ptr,  # (B,)
    out_ptr,  # (T, H, D)
    qk_scale,  # scale * log2(e)
    window,  # HAS_WINDOW: each token sees the last `window` positions up to its own
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kc_nb,
    stride_kc_bs,
    stride_kc_h,
    stride_vc_nb,
    stride_vc_bs,
    stride_vc_h,
    stride_bt_b,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CACHE: tl.constexpr,
    PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
):
    # The last query blocks of a sequence do the most work (causal): run them first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + b).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + b + 1).to(tl.int32) - q_start
    m_start = m_block * BLOCK_M
    if m_start < q_len:
        kvh = h // G
        offs_m = m_start + tl.arange(0, BLOCK_M)  # index among the new tokens
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        m_mask = offs_m < q_len
        rows = (q_start + offs_m).to(tl.int64)

        q_ptrs = q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_mask[:, None], other=0.0)  # (BLOCK_M, D)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

        # With a sliding window, query row i (new-token index, position ctx_len + i)
        # sees new-token indices t > i - window, prefix positions j > ctx_len + i -
        # window. Keys before the block's first row's window are skipped whole: the
        # loops below start at it. Rows further down start later, so the tiles that
        # hold some row's window start are masked per row (EMPTY_ROWS: a row may see
        # nothing in one); tiles inside every row's window are not.

        # 1. The cached prefix [0, ctx_len): every new token sees all of it (or,
        # with a window, its part of it).
        if HAS_CACHE:
            ctx_len = tl.load(seq_lens_ptr + b).to(tl.int32) - q_len
            bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_b
            if HAS_WINDOW:
                first_key = tl.maximum(ctx_len + m_start - window + 1, 0)
            else:
                first_key = 0
            for n0 in range(first_key, ctx_len, BLOCK_N):
                n = n0 + offs_n
                n_mask = n < ctx_len
                page = tl.load(bt_row + n // BS, mask=n_mask, other=0).to(tl.int64)
                row = n % BS
                k_off = page * stride_kc_nb + row * stride_kc_bs + kvh * stride_kc_h
                k = tl.load(
                    k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0
                )
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale
                if HAS_WINDOW:
                    visible = n_mask[None, :] & (n[None, :] > ctx_len + offs_m[:, None] - window)
                else:
                    visible = n_mask[None, :]
                s = tl.where(visible, s, float("-inf"))
                v_off = page * stride_vc_nb + row * stride_vc_bs + kvh * stride_vc_h
                v = tl.load(
                    v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0
                )
                m_i, l_i, acc = _online_softmax_step(
                    s, v.to(q.dtype), m_i, l_i, acc, PREC, HAS_WINDOW
                )

        # 2. New tokens strictly before this query block: no mask needed (with a
        # window: from the BLOCK_N-aligned tile holding the first row's window start,
        # masked up to the first tile inside every row's window).
        k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kvh * stride_kh
        v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kvh * stride_vh
        first_full = 0
        if HAS_WINDOW:
            first_key = tl.maximum(m_start - window + 1, 0) // BLOCK_N * BLOCK_N
            # Tile n0.. is inside every row's window when n0 > (m_start + BLOCK_M - 1)
            # - window: the last (padded) row's window start.
            first_full = tl.minimum(
                tl.cdiv(tl.maximum(m_start + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, m_start
            )
            for n0 in range(first_key, first_full, BLOCK_N):
                n = n0 + offs_n
                k = tl.load(k_base + n[:, None] * stride_kt + offs_d[None, :])
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
                s = tl.where(n[None, :] > offs_m[:, None] - window, s, float("-inf"))
                v = tl.load(v_base + n[:, None] * stride_vt + offs_d[None, :])
                m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PREC, True)
        for n0 in range(first_full, m_start, BLOCK_N):
            n = n0 + offs_n
            k = tl.load(k_base + n[:, None] * stride_kt + offs_d[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            v = tl.load(v_base + n[:, None] * stride_vt + offs_d[None, :])
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PREC)

        # 3. The diagonal block: causal mask (key j visible to query i iff j <= i;
        # with a window, and j > i - window).
        for n0 in range(m_start, tl.minimum(m_start + BLOCK_M, q_len), BLOCK_N):
            n = n0 + offs_n
            n_mask = n < q_len
            k = tl.load(k_base + n[:, None] * stride_kt + offs_d[None, :], mask=n_mask[:, None])
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            visible = (n[None, :] <= offs_m[:, None]) & n_mask[None, :]
            if HAS_WINDOW:
                visible &= n[None, :] > offs_m[:, None] - window
            s = tl.where(visible, s, float("-inf"))
            v = tl.load(v_base + n[:, None] * stride_vt + offs_d[None, :], mask=n_mask[:, None])
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PREC, HAS_WINDOW)

        # Every real query row saw at least its own key, so l_i > 0 there.
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    max_q_len: int | None = None,
    *,
    window: int = 0,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal flash attention over a packed batch; see `reference.prefill_attention`.

    Grid: (query blocks of the longest sequence, H, B); blocks past a shorter
    sequence's end exit at once. `max_q_len` (host int, optional) sizes the
    grid; without it a single sequence uses T and a batch costs one host sync.
    A cached prefix (seq_len > q_len) is read through block_tables. `window` > 0:
    each token sees its last `window` positions only (key tiles before a query
    block's first window are never loaded). `config`:
    (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of `_prefill_config`'s
    (scripts/bench_prefill_attention.py).
    """
    window = _checked_window(window)
    num_tokens, num_heads, head_dim = q.shape
    check_head_dim(head_dim)
    num_kv_heads = k.shape[1]
    batch = seq_lens.shape[0]
    for t in (q, k, v):
        assert t.stride(-1) == 1, "last dim must be contiguous"
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out
    if max_q_len is None:
        if batch == 1:
            max_q_len = num_tokens
        else:
            max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    has_cache = k_cache is not None
    if has_cache:
        assert v_cache is not None and block_tables is not None
        block_size = k_cache.shape[1]
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0))
    else:
        k_cache = v_cache = block_tables = q  # dummies, never read
        block_size = 16
        cache_strides = (0,) * 7
    block_m, block_n, num_warps, num_stages = config or _prefill_config(q.dtype, head_dim)
    grid = (triton.cdiv(max_q_len, block_m), num_heads, batch)
    _prefill_kernel[grid](
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        *cache_strides,
        G=num_heads // num_kv_heads,
        D=head_dim,
        BS=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_CACHE=has_cache,
        PREC=_dot_precision(q.dtype),
        HAS_WINDOW=window > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
