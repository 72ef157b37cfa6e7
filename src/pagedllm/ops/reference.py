"""Reference ops: the numerical spec of every kernel, in plain PyTorch.

Owns: what each op computes. These run on the CPU (students without a GPU use
them) and are what every Triton kernel in `ops/triton_*.py` is tested against.
Does not own: speed, or which implementation runs (`ops/__init__.py` decides).

Shape letters (everywhere): T tokens in the flat batch, B sequences, H query
heads, Hkv KV heads, D head dim, NB pages, BS page size, V vocab, E hidden.
Accumulation is float32 whatever the input dtype; outputs come back in the
input dtype, as Hugging Face's Llama does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedllm.config import RopeScaling

# --------------------------------------------------------------------------
# Embedding, norms, MLP activation
# --------------------------------------------------------------------------


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T,) int ids, (V, E) table -> (T, E)."""
    return weight[input_ids]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32. (T, E) -> (T, E)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same formula, one op
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    # HF casts back to the input dtype before multiplying by the weight.
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = x + residual; return (rms_norm(residual), residual).

    The residual stream is carried between layers so the add and the norm can
    be one pass over memory in the Triton version.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: (T, 2I) laid out [gate | up] -> silu(gate) * up, (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate.float()).to(x.dtype) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate (Gemma): (T, 2I) laid out [gate | up] -> gelu_tanh(gate) * up,
    (T, I). GELU with the tanh approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g +
    0.044715 g^3))), as transformers' `gelu_pytorch_tanh`; rounded as silu_and_mul."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate.float(), approximate="tanh").to(x.dtype) * up


def linear(
    x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A projection, x (T, in) @ weight.T -> (T, out); weight is HF's (out, in).
    `bias` (out,), when given (Qwen2's q/k/v), is added to the float32 sums before
    their one rounding, as `nn.Linear` does (an add after would round twice)."""
    return torch.nn.functional.linear(x, weight, bias)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: (B, V) -> (B,) int64, the first index of each row's maximum."""
    return logits.argmax(dim=-1)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's first half: silu_and_mul(x (T, E) @ weight.T), weight (2I, E) laid
    out [gate | up] -> (T, I)."""
    return silu_and_mul(linear(x, weight))


def linear_gelu_tanh_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Gemma's MLP first half: gelu_tanh_and_mul(x (T, E) @ weight.T), weight (2I, E)
    laid out [gate | up] -> (T, I)."""
    return gelu_tanh_and_mul(linear(x, weight))


# --------------------------------------------------------------------------
# FP8 weights (issue 36)
# --------------------------------------------------------------------------

# A float8 e4m3 weight stores W / scale rounded to e4m3 (3 mantissa bits, largest
# finite value 448); the scale is float32, one per output channel (row of W), or one
# per (bs0, bs1) block of W when the checkpoint gives a `weight_block_size` (128 x
# 128 in the published ones; the blocks at the right and bottom edges may be
# partial). W = weight.float() * scale. The reference dequantizes and multiplies in
# float32 and does not quantize the activations: it is what the CPU runs (a student
# without a GPU, every test) and what transformers computes on the dequantized
# weights. The GPU kernels (`ops/triton_fp8.py`) also round the activations to e4m3,
# with a scale per row (or per row and chunk of K), which the tests' tolerances
# allow for.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def fp8_scale_shape(
    out_features: int, in_features: int, block_size: tuple[int, int] | None
) -> tuple[int, ...]:
    """The shape of the float32 scale for an (out, in) FP8 weight: (out,) per output
    channel, or (ceil(out / bs0), ceil(in / bs1)) for `block_size` (bs0, bs1)."""
    if block_size is None:
        return (out_features,)
    bs0, bs1 = block_size
    return (-(-out_features // bs0), -(-in_features // bs1))


def check_fp8_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, block_size: tuple[int, int] | None
) -> torch.Tensor:
    """Check an FP8 weight and its scale; return the scale as float32, shaped as
    `fp8_scale_shape` says (a per-channel scale given as (out, 1), (1,) or () is
    accepted and reshaped or broadcast to (out,)). Raises a one-line ValueError."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(
            f"FP8 weight of dtype {weight.dtype} and shape {tuple(weight.shape)}: expected a 2-D "
            "torch.float8_e4m3fn tensor (out, in)"
        )
    out_features, in_features = weight.shape
    if block_size is not None:
        if len(block_size) != 2 or min(block_size) <= 0:
            raise ValueError(f"FP8 block_size {block_size}: expected two positive ints (128, 128)")
        block_size = (int(block_size[0]), int(block_size[1]))
    want = fp8_scale_shape(out_features, in_features, block_size)
    scale = weight_scale
    if block_size is None and scale.numel() in (1, out_features) and scale.dim() <= 2:
        scale = scale.reshape(-1).expand(out_features)  # per tensor or (out, 1): per channel
    if tuple(scale.shape) != want:
        kind = f"{block_size[0]}x{block_size[1]} block" if block_size else "output channel"
        raise ValueError(
            f"FP8 weight {tuple(weight.shape)} has a scale of shape {tuple(weight_scale.shape)}; "
            f"one per {kind} is {want}"
        )
    return scale.float()


def dequantize_fp8(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """W = weight.float() * scale, float32 (out, in): the scale per row (out,), or per
    (bs0, bs1) block (ceil(out / bs0), ceil(in / bs1)) with `block_size`."""
    scale = check_fp8_weight(weight, weight_scale, block_size)
    w = weight.float()
    if block_size is None:
        return w * scale[:, None]
    out_features, in_features = weight.shape
    bs0, bs1 = block_size
    full = scale.repeat_interleave(bs0, dim=0).repeat_interleave(bs1, dim=1)
    return w * full[:out_features, :in_features]


def quantize_fp8(
    w: torch.Tensor, block_size: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight e4m3, scale float32) with dequantize_fp8(weight, scale, block_size) ~ w:
    each output channel (or each block) scaled so that its largest |w| becomes 448,
    then rounded to nearest even; an all-zero channel or block gets scale 1."""
    wf = w.float()
    out_features, in_features = wf.shape
    if block_size is None:
        amax = wf.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale
    bs0, bs1 = block_size
    n0, n1 = fp8_scale_shape(out_features, in_features, block_size)
    padded = wf.new_zeros(n0 * bs0, n1 * bs1)
    padded[:out_features, :in_features] = wf
    blocks = padded.view(n0, bs0, n1, bs1)
    amax = blocks.abs().amax(dim=(1, 3))  # (n0, n1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(n0 * bs0, n1 * bs1)[:out_features, :in_features].contiguous(), scale


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A projection with FP8 weights: x (T, in) @ W.T (+ bias (out,)) -> (T, out) in
    x's dtype, W = dequantize_fp8(weight, weight_scale, block_size) (see above),
    weight (out, in) float8 e4m3, weight_scale float32 (out,) or block scales. The
    sum (and the bias) in float32, rounded once."""
    w = dequantize_fp8(weight, weight_scale, block_size)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


FP8_ACTIVATIONS = ("silu", "gelu_tanh")


def fp8_linear_act_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    act: str,
    *,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The MLP's first half with FP8 weights: `fp8_linear` to (T, 2I) laid out [gate |
    up], then `silu_and_mul` (act "silu") or `gelu_tanh_and_mul` ("gelu_tanh") ->
    (T, I), rounded as `linear_silu_and_mul`."""
    if act not in FP8_ACTIVATIONS:
        raise ValueError(f"activation {act!r}: choose one of {', '.join(FP8_ACTIVATIONS)}")
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"gate/up weight with {weight.shape[0]} rows: expected [gate | up], even")
    y = fp8_linear(x, weight, weight_scale, block_size=block_size)
    return silu_and_mul(y) if act == "silu" else gelu_tanh_and_mul(y)


def fp8_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    act: str,
    *,
    gate_up_block_size: tuple[int, int] | None = None,
    down_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The whole gated MLP with FP8 weights: `fp8_linear_act_and_mul` with
    `gate_up` (2I, E) [gate | up], then `fp8_linear` with `down` (E, I): (T, E) ->
    (T, E). One op so that a kernel may hand the down projection its input already
    quantized (ops/triton_fp8.py)."""
    h = fp8_linear_act_and_mul(x, gate_up, gate_up_scale, act, block_size=gate_up_block_size)
    return fp8_linear(h, down, down_scale, block_size=down_block_size)


def _norm(
    hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm's output, the residual stream): `fused_add_rms_norm`, or without a
    residual (a model's first layer) `rms_norm` of hidden, which is the stream."""
    if residual is None:
        return rms_norm(hidden, weight, eps), hidden
    return fused_add_rms_norm(hidden, residual, weight, eps)


def fp8_norm_linear(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm and the FP8 projection that reads it (a layer's q/k/v): `rms_norm` of
    hidden + residual (of hidden alone when residual is None), then `fp8_linear`.
    Returns (the projection, the residual stream). One op so that a kernel may
    quantize the norm's output as it writes it (ops/triton_fp8.py)."""
    x, residual = _norm(hidden, residual, norm_weight, eps)
    return fp8_linear(x, weight, weight_scale, bias=bias, block_size=block_size), residual


def fp8_norm_mlp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    act: str,
    *,
    gate_up_block_size: tuple[int, int] | None = None,
    down_block_size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_norm_linear`'s norm, then `fp8_mlp`: (the MLP's output, the residual
    stream)."""
    x, residual = _norm(hidden, residual, norm_weight, eps)
    out = fp8_mlp(
        x, gate_up, gate_up_scale, down, down_scale, act,
        gate_up_block_size=gate_up_block_size, down_block_size=down_block_size,
    )  # fmt: skip
    return out, residual


# --------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies (D/2,), float32, with Llama 3's frequency-dependent scaling.

    Llama 3 leaves high frequencies (short wavelengths) alone, divides low
    frequencies by `factor`, and blends linearly in between.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin_cache(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int, device=None
) -> torch.Tensor:
    """(P, D) float32: [cos | sin] of position * inv_freq, each half D/2 wide."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (P, D/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, Hkv, D) by their explicit positions (T,).

    HF layout ("rotate half"): dimension i pairs with i + D/2. GGUF files store
    Q/K permuted for llama.cpp's interleaved layout; the loader undoes that.
    """
    cos_sin = cos_sin_cache[positions]  # (T, D)
    cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)  # (T, 1, D/2) each
    num_q_heads = q.shape[1]
    qk = torch.cat([q, k], dim=1).float()  # (T, H + Hkv, D): one rotation for both
    x1, x2 = qk.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated[:, :num_q_heads].to(q.dtype), rotated[:, num_q_heads:].to(k.dtype)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope`, then `store_kvcache` of the rotated k and of v: a layer's new
    K/V are written to the cache as RoPE leaves them. Returns the rotated q, k."""
    q, k = apply_rope(q, k, positions, cos_sin_cache)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


# --------------------------------------------------------------------------
# Paged KV cache and attention
# --------------------------------------------------------------------------

# The reference decode reads K/V in chunks of pages holding about this many
# K elements (B x tokens x Hkv x D): large chunks mean few PyTorch ops, bounded
# ones mean bounded memory.
DECODE_CHUNK_ELEMENTS = 1 << 24


# The float8 K/V cache (`--kv-cache-dtype fp8`) stores e4m3 values with no scale,
# as vLLM does when no scales are calibrated: 3 mantissa bits (a relative error of
# at most 2^-4 per element) and a largest finite value of 448, past which a value
# saturates. Every reader converts a page back to the model's dtype before its dots.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V as a cache of `dtype` holds it: a plain cast, except that float8
    e4m3 first clamps to +-448 (a cast would make larger values NaN on some
    torch versions) and then rounds to nearest even."""
    if dtype == FP8_KV_DTYPE:
        x = x.float().clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return x.to(dtype)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V (T, Hkv, D) at its slot in the (NB, BS, Hkv, D) caches,
    converted to the caches' dtype (`to_cache_dtype`).

    slot = page_id * BS + offset, so viewing the cache as (NB*BS, Hkv, D) makes
    the slot a plain row index.
    """
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d)[slot_mapping] = to_cache_dtype(k, k_cache.dtype)
    v_cache.view(nb * bs, hkv, d)[slot_mapping] = to_cache_dtype(v, v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, n: int, lo: int = 0
) -> torch.Tensor:
    """Tokens lo..n-1 of one sequence from its pages: (n - lo, Hkv, D). Only the
    pages holding them are read (a sliding window needs the last few)."""
    bs = cache.shape[1]
    first = lo // bs
    pages = block_table[first : (n + bs - 1) // bs].long()
    return cache[pages].flatten(0, 1)[lo - first * bs : n - first * bs]


# Sliding-window attention (Mistral, Gemma 3's local layers, Qwen2 when its config
# sets one): with window W > 0, the query at position p sees the keys at positions
# j with p - W < j <= p, W keys counting its own. This is transformers' mask,
# `masking_utils.sliding_window_causal_mask_function`: `kv_idx > q_idx -
# sliding_window` and `kv_idx <= q_idx`. W = 0 is plain causal attention.


def _check_window(window: int) -> None:
    if window < 0:
        raise ValueError(f"attention window {window}: must be >= 0 (0: no window)")


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
) -> torch.Tensor:
    """Causal GQA attention over a packed batch of variable-length sequences.

    q (T, H, D); k, v (T, Hkv, D): the new tokens, sequence b owning rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1]. seq_lens (B,) counts each sequence's
    tokens *including* the new ones; the earlier seq_len - q_len tokens (a
    prefix already in the cache) are read from the pages through block_tables.
    New token i of a sequence sits at position seq_len - q_len + i and sees
    every position up to its own. Returns (T, H, D). The offsets need not start
    at 0 nor cover q: rows outside every sequence are left unwritten (a mixed
    step passes its prompt sequences only; `model/llama.py`). `max_q_len` is a
    host-side hint for kernels that size their grid with it; the reference
    ignores it. `window` > 0: each token sees only the last `window` positions
    up to its own (a sliding window, see above); the prefix pages wholly before
    the first new token's window are not read.
    """
    _check_window(window)
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        start, end = cu[b], cu[b + 1]
        q_len, seq_len = end - start, lens[b]
        ctx_len = seq_len - q_len
        # The first key any new token sees: the first new token's window start
        # (never past ctx_len, the first new token's own position).
        lo = max(0, ctx_len - window + 1) if window else 0
        kb, vb = k[start:end], v[start:end]
        if ctx_len > lo:
            assert k_cache is not None and v_cache is not None and block_tables is not None
            kc = _gather_context(k_cache, block_tables[b], ctx_len, lo)
            vc = _gather_context(v_cache, block_tables[b], ctx_len, lo)
            kb, vb = torch.cat([kc.to(k.dtype), kb]), torch.cat([vc.to(v.dtype), vb])
        qf = q[start:end].float().transpose(0, 1)  # (H, q_len, D)
        kf = kb.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, seq_len, D)
        vf = vb.float().repeat_interleave(group, dim=1).transpose(0, 1)
        # softmax(q k^T * scale, causally masked) @ v, computed by PyTorch's fused SDPA
        # (given 4-D inputs: with 3-D ones it falls back to a path 4x slower on the CPU).
        qf, kf, vf = qf[None], kf[None], vf[None]  # (1, H, n, D)
        if ctx_len == 0 and not window:  # no cached prefix: plain causal (SDPA's flash path)
            o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(ctx_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(lo, seq_len, device=q.device)[None, :]
            allowed = k_pos <= q_pos  # (q_len, seq_len - lo): causal, shifted by the prefix
            if window:
                allowed &= k_pos > q_pos - window
            o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale)
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


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
) -> torch.Tensor:
    """One new token per sequence attends to its whole context, read page by page.

    q (B, H, D); caches (NB, BS, Hkv, D); block_tables (B, max_blocks);
    seq_lens (B,) including the new token (already stored). Online softmax:
    keep a running max m, denominator l and weighted sum acc per head and
    rescale them as each page arrives, so no (H, seq_len) score row is ever
    held. Returns (B, H, D). `max_seq_len`, when given, is the longest seq_len
    (a host-side int, so no device sync is needed to size the loop).
    `order` (B,) int32, when given, is a permutation of 0..B-1: the order in
    which a parallel implementation should start the sequences (the runner
    passes them longest context first, so a ragged batch's long ones do not
    start last). It never changes the result; here it is only checked.
    `window` > 0: the token at position seq_len - 1 sees only the last `window`
    positions (a sliding window, see above); pages before every sequence's
    window are not read.
    """
    if order is not None and order.shape != seq_lens.shape:
        raise ValueError(f"order has shape {tuple(order.shape)}; seq_lens {tuple(seq_lens.shape)}")
    _check_window(window)
    batch, num_heads, head_dim = q.shape
    bs, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if batch == 1 and not window and q.device.type == "cpu":
        return _decode_attention_one(q, k_cache, v_cache, block_tables, seq_lens, scale)
    longest = max_seq_len if max_seq_len else (int(seq_lens.max()) if batch else 0)
    max_pages = min(-(-longest // bs), block_tables.shape[1])
    qf = q.float().view(batch, num_kv_heads, group, head_dim)  # (B, Hkv, G, D)
    lens = seq_lens.long()[:, None]  # (B, 1)
    # A window's first visible position per sequence, and the first page any reads.
    lows = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
    first_page = int(lows.min()) // bs if window and batch else 0

    def gather(p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V (B, Hkv, n, D) of pages p0..p1 and which of their n tokens are valid."""
        # (B*C,); padding entries past a sequence's pages may hold anything: clamp
        # them to a real page (their tokens are masked out below).
        pages = block_tables[:, p0:p1].reshape(-1).long().clamp(0, k_cache.shape[0] - 1)
        n = (p1 - p0) * bs
        # index_select copies whole pages (4x faster than k_cache[pages] on the CPU).
        kp = k_cache.index_select(0, pages).float().view(batch, n, num_kv_heads, head_dim)
        vp = v_cache.index_select(0, pages).float().view(batch, n, num_kv_heads, head_dim)
        kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)  # (B, Hkv, n, D)
        pos = p0 * bs + torch.arange(n, device=q.device)[None, :]
        valid = (pos < lens) & (pos >= lows)  # (B, n)
        return kp, vp, valid

    chunk_tokens = min(4096, max(256, DECODE_CHUNK_ELEMENTS // (batch * num_kv_heads * head_dim)))
    step = max(1, chunk_tokens // bs)  # pages per chunk
    if max_pages - first_page <= step:
        # The whole context is one chunk, where the online softmax is a plain softmax:
        # one fused SDPA call (the common case on the CPU, where every PyTorch op
        # costs ~10 us of overhead: this took SmolLM2's batch-1 step from 41 to 36 ms).
        kp, vp, valid = gather(first_page, max(first_page, max_pages))
        out = F.scaled_dot_product_attention(
            qf, kp, vp, attn_mask=valid[:, None, None, :], scale=scale
        ).nan_to_num(0.0)  # a seq_len 0 row (nothing valid) comes out as zeros
        return out.reshape(batch, num_heads, head_dim).to(q.dtype)
    m = torch.full((batch, num_kv_heads, group), float("-inf"), device=q.device)
    denom = torch.zeros((batch, num_kv_heads, group), device=q.device)
    acc = torch.zeros((batch, num_kv_heads, group, head_dim), device=q.device)
    # All sequences advance together, a chunk of pages at a time: the same online
    # softmax as one page at a time, with fewer, larger PyTorch ops.
    for p0 in range(first_page, max_pages, step):
        kp, vp, valid = gather(p0, min(p0 + step, max_pages))
        s = (qf @ kp.transpose(-1, -2)) * scale  # (B, Hkv, G, n)
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        # A sequence with nothing seen yet keeps m = -inf; use 0 as its baseline.
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - base)  # rescales what we had
        pexp = torch.exp(s - base[..., None])
        denom = denom * alpha + pexp.sum(dim=-1)
        acc = acc * alpha[..., None] + pexp @ vp  # (B, Hkv, G, D)
        m = m_new
    out = acc / denom.clamp_min(1e-30)[..., None]  # seq_len 0 rows come out as zeros
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def _decode_attention_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`decode_attention` of one sequence on the CPU, no window: the same softmax in
    about a third of the PyTorch ops. On the CPU every op costs microseconds of
    dispatch, and batch-1 decode runs one of these per layer per token (SmolLM2 at
    300 tokens of context: ~220 us -> ~80 us a layer, 30 layers). Its length is
    read on the host (no sync on the CPU), so the gathered pages are cut to it
    instead of masked, and the whole context is one SDPA call: the G query heads
    of a KV head are its "query rows" (none of them causal to another)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    bs, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    n = int(seq_lens[0])
    if n <= 0:  # nothing to attend to: zeros, as the masked path gives
        return torch.zeros_like(q)
    pages = block_tables[0, : -(-n // bs)]
    kp = k_cache.index_select(0, pages).view(-1, num_kv_heads, head_dim)[:n]  # (n, Hkv, D)
    vp = v_cache.index_select(0, pages).view(-1, num_kv_heads, head_dim)[:n]
    if kp.dtype != torch.float32:  # bf16 / fp8 pages: attention in float32, as the spec
        kp, vp = kp.float(), vp.float()
    qf = q.float().view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (1, Hkv, G, D)
    out = F.scaled_dot_product_attention(
        qf, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], scale=scale
    )  # (1, Hkv, G, D)
    return out.reshape(1, num_heads, head_dim).to(q.dtype)


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
) -> torch.Tensor:
    """A decode step's attention from its q (B, H, D), k, v (B, Hkv, D) before RoPE:
    `rope_and_store` (the new K/V go to their slots), then `decode_attention`
    (with its sliding `window`, 0 for none). Returns (B, H, D). The Triton kernel
    does all of it in one launch and leaves q and k unrotated; here they may be
    rotated in place or not (callers must not read them after)."""
    _check_window(window)
    q, _ = rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, window=window
    )
