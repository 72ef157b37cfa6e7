"""FP8 weight ops (issue 36): the reference against a float32 oracle, and the Triton
FP8 kernels against both on the CPU under TRITON_INTERPRET=1.

The reference (`reference.fp8_linear`) dequantizes W = weight * scale (per output
channel, or per block) and multiplies in float32; these tests build W by hand
from the e4m3 bits and the scales and check the reference to float32 rounding.

The Triton kernels (`ops/triton_fp8.py`) also round the activations to e4m3:
the GEMV per row and chunk of BLOCK_K columns, the GEMM per row (per channel)
or per row and group of bs1 columns (block scales). Each kernel is held two
ways: to 1e-5 of a float32 matmul of x quantized as `quantize_activations_
reference` says (the same rounding: what is left is float32 summation order),
and to `ACT_QUANT_TOL` of the reference. That tolerance: e4m3 keeps 3 mantissa
bits, so a quantized activation is off by at most 2^-4 of itself, about 2^-4 /
sqrt(3) = 3.6 % rms for values spread over a binade; a dot's independent
errors leave the result off by about that fraction of its norm (measured here:
2-4 %). The compiled kernels, and `torch._scaled_mm`, are
tests/test_gpu_fp8_ops.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.ops import reference as ref  # noqa: E402

ACT_QUANT_TOL = 0.05  # relative (norm) error against the unquantized reference


def _interpreted_triton():
    """triton_fp8 when its kernels run in the interpreter, else None (the module's
    Triton tests skip: compiled kernels cannot take CPU tensors)."""
    try:
        from pagedllm.ops import triton_fp8
    except ImportError:
        return None
    return triton_fp8 if triton_fp8._interpreted() else None


tf = _interpreted_triton()
needs_interpreter = pytest.mark.skipif(
    tf is None, reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1 before Triton loads)"
)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.float(), expected.float()
    return ((out - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def random_fp8(out_f: int, in_f: int, block_size=None, gen=None):
    """A random e4m3 weight with random positive scales of the shape block_size asks for."""
    w = (torch.randn(out_f, in_f, generator=gen) * 100).clamp(-448, 448).to(ref.FP8_DTYPE)
    shape = ref.fp8_scale_shape(out_f, in_f, block_size)
    scale = torch.rand(shape, generator=gen) * 0.02 + 0.001
    return w, scale


def test_dequantize_per_channel_and_per_block_by_hand():
    gen = torch.Generator().manual_seed(0)
    w, s = random_fp8(5, 7, gen=gen)
    want = torch.stack([w[i].float() * s[i] for i in range(5)])
    assert torch.equal(ref.dequantize_fp8(w, s), want)
    # Blocks of 2 x 3 over a 5 x 7 weight: the last block row and column are partial.
    w, s = random_fp8(5, 7, (2, 3), gen=gen)
    assert s.shape == (3, 3)
    want = torch.empty(5, 7)
    for i in range(5):
        for j in range(7):
            want[i, j] = w[i, j].float() * s[i // 2, j // 3]
    assert torch.equal(ref.dequantize_fp8(w, s, (2, 3)), want)


@pytest.mark.parametrize("block_size", [None, (4, 8)])
def test_reference_fp8_linear_is_float32_matmul_of_dequantized(block_size):
    gen = torch.Generator().manual_seed(1)
    w, s = random_fp8(10, 21, block_size, gen=gen)
    x = torch.randn(3, 21, generator=gen).to(torch.bfloat16)
    bias = torch.randn(10, generator=gen).to(torch.bfloat16)
    wf = ref.dequantize_fp8(w, s, block_size).double()
    want = (x.double() @ wf.T + bias.double()).to(torch.bfloat16)
    got = ref.fp8_linear(x, w, s, bias=bias, block_size=block_size)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 10)
    torch.testing.assert_close(got, want, rtol=2**-8, atol=0)  # one bf16 rounding apart at most
    act = ref.fp8_linear_act_and_mul(x, w, s, "silu", block_size=block_size)
    y = ref.fp8_linear(x, w, s, block_size=block_size)
    assert torch.equal(act, ref.silu_and_mul(y))
    act = ref.fp8_linear_act_and_mul(x, w, s, "gelu_tanh", block_size=block_size)
    assert torch.equal(act, ref.gelu_tanh_and_mul(y))


@pytest.mark.parametrize("block_size", [None, (4, 8), (128, 128)])
def test_quantize_round_trips_within_e4m3_rounding(block_size):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(37, 300, generator=gen)
    w[3] = 0  # an all-zero channel keeps scale 1 (no division by zero)
    q, s = ref.quantize_fp8(w, block_size)
    assert q.dtype == ref.FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == ref.fp8_scale_shape(37, 300, block_size)
    back = ref.dequantize_fp8(q, s, block_size)
    # e4m3 has 3 mantissa bits: a relative error of at most 2^-4 per element (normals).
    err = (back - w).abs() / w.abs().clamp_min(1e-3)
    assert err[w.abs() > 0.05].max() <= 2**-4 + 1e-6
    assert torch.all(back[3] == 0)


def test_bad_fp8_weights_get_one_line_errors():
    w, s = random_fp8(6, 8)
    with pytest.raises(ValueError, match=r"scale of shape \(5,\); one per output channel is"):
        ref.fp8_linear(torch.randn(1, 8), w, s[:5])
    with pytest.raises(ValueError, match=r"one per 4x4 block is \(2, 2\)"):
        ref.fp8_linear(torch.randn(1, 8), w, torch.ones(3, 2), block_size=(4, 4))
    with pytest.raises(ValueError, match="expected a 2-D torch.float8_e4m3fn"):
        ref.fp8_linear(torch.randn(1, 8), w.float(), s)
    with pytest.raises(ValueError, match="activation 'relu'"):
        ref.fp8_linear_act_and_mul(torch.randn(1, 8), w, s, "relu")
    # A per-tensor scale and an (out, 1) scale are per-channel scales broadcast.
    x = torch.randn(2, 8)
    full = ref.fp8_linear(x, w, torch.full((6,), 0.5))
    assert torch.equal(ref.fp8_linear(x, w, torch.tensor(0.5)), full)
    assert torch.equal(ref.fp8_linear(x, w, torch.full((6, 1), 0.5)), full)


# --------------------------------------------------------------------------
# The Triton kernels, interpreted
# --------------------------------------------------------------------------


def quantized_oracle(x, weight, scale, block_size, group, bias=None, act=None):
    """What the kernels compute, in float32: x quantized in groups of `group`
    columns (None: per row) by `quantize_activations_reference`, dequantized, times
    the dequantized W, (+ bias), rounded to x's dtype, (then act(gate) * up)."""
    xq, xs = tf.quantize_activations_reference(x, group)
    g = group or x.shape[1]
    xd = xq.float() * xs[:, torch.arange(x.shape[1]) // g]
    y = xd @ ref.dequantize_fp8(weight, scale, block_size).T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if act is None:
        return y
    return ref.silu_and_mul(y) if act == "silu" else ref.gelu_tanh_and_mul(y)


def reference_op(x, weight, scale, block_size, bias=None, act=None):
    if act is None:
        return ref.fp8_linear(x, weight, scale, bias=bias, block_size=block_size)
    return ref.fp8_linear_act_and_mul(x, weight, scale, act, block_size=block_size)


# Shapes that are not multiples of any tile: 150 output rows (BLOCK_N 64), 300
# columns (BLOCK_K 128); block scales of 32 x 64 leave partial blocks at both edges.
SCALES = [None, (32, 64)]


@needs_interpreter
@pytest.mark.parametrize("block_size", SCALES, ids=["channel", "block32x64"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemv_matches_the_quantized_oracle_and_the_reference(monkeypatch, block_size, rows):
    """The GEMV (T <= 16, through the op): with a bias, and act_and_mul with SiLU
    (T = 3: GeGLU); x quantized per row and chunk of 64 columns (BLOCK_K 128
    halved to divide bs1) or 128 (per channel). (One row with per-channel scales
    goes weight-only by default: off here, see the next test.)"""
    monkeypatch.setattr(tf, "W8A16_MAX_ROWS", 0)
    gen = torch.Generator().manual_seed(rows)
    w, s = ref.quantize_fp8(torch.randn(150, 300, generator=gen), block_size)
    x = torch.randn(rows, 300, generator=gen)
    bias = torch.randn(150, generator=gen)
    group = 64 if block_size else 128
    got = tf.fp8_linear(x, w, s, bias=bias, block_size=block_size)
    assert got.shape == (rows, 150) and got.dtype == x.dtype
    want = quantized_oracle(x, w, s, block_size, group, bias)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, reference_op(x, w, s, block_size, bias)) < ACT_QUANT_TOL
    act = "gelu_tanh" if rows == 3 else "silu"
    w2, s2 = ref.quantize_fp8(torch.randn(2 * 75, 300, generator=gen), block_size)
    got = tf.fp8_linear_act_and_mul(x, w2, s2, act, block_size=block_size)
    assert got.shape == (rows, 75)
    assert rel_err(got, quantized_oracle(x, w2, s2, block_size, group, act=act)) < 1e-5
    assert rel_err(got, reference_op(x, w2, s2, block_size, act=act)) < ACT_QUANT_TOL


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_per_channel_is_weight_only(dtype):
    """One row of x with per-channel scales: the bf16 GEMV (ops/triton_gemv.py)
    reads the float8 W, x not quantized, each row's float32 sum times its scale:
    the reference to float32 summation order (one rounding to bf16 in bf16), with
    a bias, and with SwiGLU / GeGLU in the epilogue."""
    gen = torch.Generator().manual_seed(11)
    w, s = ref.quantize_fp8(torch.randn(150, 300, generator=gen))
    x = torch.randn(1, 300, generator=gen).to(dtype)
    bias = torch.randn(150, generator=gen).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    got = tf.fp8_linear(x, w, s, bias=bias)
    assert got.shape == (1, 150) and got.dtype == dtype
    assert rel_err(got, reference_op(x, w, s, None, bias)) < tol
    assert rel_err(got, quantized_oracle(x, w, s, None, 128, bias)) > 0.01  # x not quantized
    w2, s2 = ref.quantize_fp8(torch.randn(2 * 75, 300, generator=gen))
    for act in ("silu", "gelu_tanh"):
        got = tf.fp8_linear_act_and_mul(x, w2, s2, act)
        assert got.shape == (1, 75)
        assert rel_err(got, reference_op(x, w2, s2, None, act=act)) < 2 * tol
    # Block scales, or a second row, take the tensor-core GEMV: x quantized.
    x2 = torch.cat([x, x]).float()
    assert rel_err(tf.fp8_linear(x2, w, s)[:1], quantized_oracle(x2, w, s, None, 128)[:1]) < 1e-5


@needs_interpreter
def test_gemv_in_bf16_and_with_128x128_blocks():
    """bf16 activations and output (the model's dtype), 128 x 128 block scales as the
    published checkpoints have them: within bf16 rounding of the oracle."""
    gen = torch.Generator().manual_seed(7)
    w, s = ref.quantize_fp8(torch.randn(200, 260, generator=gen), (128, 128))
    x = torch.randn(2, 260, generator=gen).to(torch.bfloat16)
    bias = torch.randn(200, generator=gen).to(torch.bfloat16)
    got = tf.fp8_linear(x, w, s, bias=bias, block_size=(128, 128))
    assert got.dtype == torch.bfloat16
    want = quantized_oracle(x, w, s, (128, 128), 128, bias)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)  # a bf16 step or so
    assert rel_err(got, reference_op(x, w, s, (128, 128), bias)) < ACT_QUANT_TOL


@needs_interpreter
@pytest.mark.parametrize("act", [None, "silu"])
def test_gemv_split_k_adds_the_splits_in_order_and_resets_its_counts(act):
    """Split K (forced: 3 programs a tile, K = 700 in 11 chunks of 64): the last
    program of each tile adds the partial sums; the counts are zero afterwards, and
    a second call gives the same bits."""
    gen = torch.Generator().manual_seed(3)
    n = 2 * 70 if act else 140
    w, s = ref.quantize_fp8(torch.randn(n, 700, generator=gen))
    x = torch.randn(4, 700, generator=gen) * 0.2  # gates within exp's range
    s = ref.check_fp8_weight(w, s, None)
    cfg = (64, 64, 4, 2, 3)
    got = tf.gemv(x, w, s, act=act, config=cfg)
    assert rel_err(got, quantized_oracle(x, w, s, None, 64, act=act)) < 1e-5
    _, counts = tf._WORKSPACE[x.device]
    assert int(counts.abs().sum()) == 0
    assert torch.equal(tf.gemv(x, w, s, act=act, config=cfg), got)
    one = tf.gemv(x, w, s, act=act, config=(64, 64, 4, 2, 1))
    assert rel_err(one, got) < 1e-6


@needs_interpreter
def test_gemv_split_choice():
    """Enough programs for two a multiprocessor, at least 4 chunks each, at most 16."""
    assert tf.gemv_split(64, 4096, 128, 132) == 5  # 8B o_proj: 64 tiles -> 320 programs
    assert tf.gemv_split(64, 14336, 128, 132) == 5  # down
    assert tf.gemv_split(224, 4096, 128, 132) == 2  # gate/up (224 tiles of 64 + 64)
    assert tf.gemv_split(1000, 4096, 128, 132) == 1
    assert tf.gemv_split(8, 300, 128, 132) == 1  # 3 chunks: too few to share
    assert tf.gemv_split(1, 1 << 20, 128, 132) == 16


@needs_interpreter
@pytest.mark.parametrize("group", [None, 64, 48])
def test_quantize_activations_kernel_matches_its_reference_bit_for_bit(group):
    """Per row (two passes over K = 2,500, more than a chunk of 2,048) and per group
    (K not a multiple of the group; a group of 48 is not a power of two); an
    all-zero row gets scale 0 and zeros, never NaN."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2500, generator=gen).to(torch.bfloat16) * 30
    x[1] = 0
    q, scale = tf.quantize_activations(x, group)
    want_q, want_s = tf.quantize_activations_reference(x, group)
    assert q.dtype == ref.FP8_DTYPE and scale.shape == want_s.shape
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_s)
    assert torch.all(scale[1] == 0) and torch.all(q[1].float() == 0)


@needs_interpreter
@pytest.mark.parametrize(
    "block_size", SCALES + [(16, 48)], ids=["channel", "block32x64", "block16x48"]
)
def test_gemm_for_more_than_16_rows(block_size):
    """T = 20 goes to the Triton GEMM (the dispatcher sends it nowhere else under the
    interpreter): x per row (per channel) or per row and group of bs1 (block scales;
    groups of 16 for bs1 = 48, which no larger power of two divides), tiles forced
    small so that a 150 x 300 weight spans several, with partial edges."""
    gen = torch.Generator().manual_seed(11)
    w, s = ref.quantize_fp8(torch.randn(150, 300, generator=gen), block_size)
    x = torch.randn(20, 300, generator=gen)
    bias = torch.randn(150, generator=gen)
    s32 = ref.check_fp8_weight(w, s, block_size)
    group = (16 if block_size[1] == 48 else block_size[1]) if block_size else None
    got = tf.gemm(x, w, s32, block_size=block_size, bias=bias, config=(16, 64, 4, 2, 2))
    assert rel_err(got, quantized_oracle(x, w, s, block_size, group, bias)) < 1e-5
    assert rel_err(got, reference_op(x, w, s, block_size, bias)) < ACT_QUANT_TOL


@needs_interpreter
def test_dispatch_by_rows_and_act_and_mul_past_the_gemv(monkeypatch):
    """fp8_linear sends T <= GEMV_MAX_ROWS to the GEMV and more to the GEMM; act_and_mul
    past the GEMV runs the GEMM, then the SwiGLU kernel, rounded as the reference."""
    gen = torch.Generator().manual_seed(13)
    w, s = ref.quantize_fp8(torch.randn(64, 128, generator=gen))
    x = torch.randn(5, 128, generator=gen)
    monkeypatch.setattr(tf, "GEMM_CONFIG", (16, 32, 4, 2, 1))
    assert rel_err(tf.fp8_linear(x, w, s), quantized_oracle(x, w, s, None, 128)) < 1e-5
    monkeypatch.setattr(tf, "GEMV_MAX_ROWS", 4)  # 5 rows: the GEMM, x quantized per row
    assert rel_err(tf.fp8_linear(x, w, s), quantized_oracle(x, w, s, None, None)) < 1e-5
    got = tf.fp8_linear_act_and_mul(x, w, s, "silu")
    assert rel_err(got, quantized_oracle(x, w, s, None, None, act="silu")) < 1e-5


@needs_interpreter
def test_triton_ops_give_one_line_errors_and_zero_rows():
    gen = torch.Generator().manual_seed(17)
    w, s = ref.quantize_fp8(torch.randn(6, 32, generator=gen))
    with pytest.raises(ValueError, match=r"scale of shape \(5,\); one per output channel"):
        tf.fp8_linear(torch.randn(1, 32), w, s[:5])
    with pytest.raises(ValueError, match=r"x of shape \(1, 31\) against a weight \(6, 32\)"):
        tf.fp8_linear(torch.randn(1, 31), w, s)
    with pytest.raises(ValueError, match="activation 'relu'"):
        tf.fp8_linear_act_and_mul(torch.randn(1, 32), w, s, "relu")
    with pytest.raises(ValueError, match="bs1 % 16 == 0"):
        tf.fp8_linear(torch.randn(1, 32), w, torch.ones(1, 4), block_size=(8, 8))
    assert tf.fp8_linear(torch.randn(0, 32), w, s).shape == (0, 6)
    # An all-zero row of x: exactly the bias, no NaN from a zero scale.
    bias = torch.randn(6, generator=gen)
    assert torch.equal(tf.fp8_linear(torch.zeros(2, 32), w, s, bias=bias), bias.expand(2, 6))


@needs_interpreter
def test_scaled_mm_path_where_torch_runs_it_on_the_cpu():
    """`triton_fp8.scaled_mm` (the T > 16 path on the GPU: x quantized per row by the
    kernel, then torch._scaled_mm with row-wise scales, the bias in its epilogue).
    Recent torch runs _scaled_mm on the CPU too; where it does not, this skips
    (tests/test_gpu_fp8_ops.py covers it on CUDA)."""
    gen = torch.Generator().manual_seed(19)
    w, s = ref.quantize_fp8(torch.randn(160, 320, generator=gen))
    x = torch.randn(20, 320, generator=gen).to(torch.bfloat16)
    bias = torch.randn(160, generator=gen).to(torch.bfloat16)
    try:
        got = tf.scaled_mm(x, w, s, bias=bias)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {str(e)[:100]}")
    assert got.dtype == torch.bfloat16 and got.shape == (20, 160)
    torch.testing.assert_close(got, quantized_oracle(x, w, s, None, None, bias), rtol=2**-7, atol=0)


# --------------------------------------------------------------------------
# The configs on the GPU's compiler, without a GPU
# --------------------------------------------------------------------------

_COMPILE_FOR_SM90 = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedllm.ops import triton_fp8 as tf

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
# What a launch specializes: pointers and strides divisible by 16, and K, K_SPLIT
# (multiples of 16 at every model shape; K_SPLIT always, a multiple of BLOCK_K).
ALIGNED_INTS = {"K", "K_SPLIT"}
UNALIGNED = set()


def build(name, fn, types, const, warps, stages):
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        sig[arg] = "constexpr" if arg in const else types.get(arg, "i32")
        if arg not in const and arg not in UNALIGNED and (
            sig[arg].startswith("*") or arg.startswith("stride") or arg in ALIGNED_INTS
        ):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = os.path.join(sys.argv[1], name + ".ptx")
    open(ptx, "w").write(k.asm["ptx"])
    log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", ptx + ".o"],
                         capture_output=True, text=True, check=True).stderr
    spills = sum(int(w.split()[0]) for w in log.split(",") if "spill stores" in w)
    fp8_wgmma = bool(re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", k.asm["ptx"]))
    return {"shared": k.metadata.shared, "spill_bytes": spills, "fp8_wgmma": fp8_wgmma,
            "reduce_layout": reduce_layout(k.asm["ttgir"])}


def reduce_layout(ttgir):
    # The layout of the first reduction's operand, spelled out (None: no reduction).
    m = re.search(r"\}\) : \(tensor<\d+xf32, (#\w+)>\)", ttgir)
    if m is None:
        return None
    return re.search("^" + m.group(1) + r" = (.*)$", ttgir, flags=re.M).group(1)


results = {}
block_n, block_k, warps, stages, _ = tf.GEMV_DEFAULT_CONFIG
for glu in (False, True):
    for blocks in (False, True):
        for split in (1, 4):
            types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16",
                         b_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
            const = dict(BLOCK_T=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                         BLOCK_SCALES=blocks, BS0=128, BS1=128, GLU=glu, ACT="silu",
                         HAS_BIAS=not glu, PDL=True, FP8_MAX=448.0)
            name = f"gemv glu={glu} blocks={blocks} split={split}"
            results[name] = build(name.replace(" ", "_"), tf._gemv_kernel, types, const,
                                  warps, stages)
for blocks, (bm, bn, warps, stages, group_m) in ((False, tf.GEMM_CONFIG),
                                                 (True, tf.GEMM_BLOCK_CONFIG)):
    types = dict(xq_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
                 out_ptr="*bf16", b_ptr="*bf16")
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=group_m, BLOCK_SCALES=blocks,
                 BS0=128, BS1=128, HAS_BIAS=True)
    name = f"gemm blocks={blocks}"
    results[name] = build(name.replace(" ", "_"), tf._gemm_kernel, types, const, warps, stages)
from pagedllm.ops.triton_norm import norm_warps
from pagedllm.ops import triton_norm
# As a launch specializes them: E (a model's hidden size, a multiple of 16) and the
# strides but `stride_q` (not specialized); HEADS is 1 for a (T, E) norm.
ALIGNED_INTS.add("E")
UNALIGNED = {"stride_q"}
for block in (4096, 8192, 16384):  # the 8B's and the 70B's rows, and the widest held
    for residual in (True, False):
        types = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", xq_ptr="*fp8e4nv",
                     xs_ptr="*fp32", out_ptr="*bf16", eps="fp32")
        const = dict(HAS_RESIDUAL=residual, BLOCK=block, FP8_MAX=448.0, PDL=True)
        name = f"norm_quant block={block} residual={residual}"
        results[name] = build(name.replace(" ", "_"), tf._rms_norm_quantize_kernel, types,
                              const, norm_warps(block), 1)
        del const["FP8_MAX"]
        const["HEADS"] = 1
        name = f"norm_only block={block} residual={residual}"
        results[name] = build(name.replace(" ", "_"), triton_norm._rms_norm_kernel, types,
                              const, norm_warps(block), 1)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_fp8_kernels_compile_for_the_h200_on_fp8_tensor_cores(tmp_path):
    """The GEMV (default config: plain and act_and_mul, per channel and 128 x 128
    blocks, with and without split K), the GEMM (both configs) and the norm that
    quantizes its output (rows of 4,096, 8,192 and 16,384, beside the plain norm
    kernel: its sum of squares reduced in the same layout), compiled for sm_90a by
    Triton's compiler and ptxas (no GPU needed): within an H200's 227 KB of shared
    memory, no register spilled, and the GEMV and GEMM multiplying on the fp8
    tensor cores (wgmma e4m3 x e4m3; a BLOCK_N below 64 would make Triton convert
    W to fp16 on the CUDA cores instead). A separate process: this one's Triton
    may be interpreted."""
    import json
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton has no bundled ptxas")
    script = tmp_path / "compile_fp8_for_sm90.py"
    script.write_text(_COMPILE_FOR_SM90)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 22
    for name, got in results.items():
        assert got["shared"] <= 227 * 1024, (name, got)
        assert got["spill_bytes"] == 0, (name, got)
        assert got["fp8_wgmma"] or name.startswith("norm"), (name, got)
    # The norm that quantizes reduces its sum of squares laid out as the norm kernel
    # does (so in the same order: the same bits), not as its e4m3 store would have it.
    for block in (4096, 8192, 16384):
        for residual in (True, False):
            fused = results[f"norm_quant block={block} residual={residual}"]
            plain = results[f"norm_only block={block} residual={residual}"]
            assert fused["reduce_layout"] is not None
            assert fused["reduce_layout"] == plain["reduce_layout"], (block, fused, plain)


@needs_interpreter
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("one_pass", [None, 0], ids=["one-pass", "two-pass"])
def test_act_and_mul_quantize_is_the_two_kernels_bit_for_bit(act, one_pass):
    """act(gate) * up quantized per row in one kernel: the same e4m3 bits and scales
    as the act_and_mul kernel then `quantize_activations`, the row held whole or
    (one_pass=0) in chunks of 2,048 (I = 2,100); an all-zero row: scale 0."""
    from pagedllm.ops.triton_act import act_and_mul

    gen = torch.Generator().manual_seed(23)
    y = (torch.randn(3, 2 * 2100, generator=gen) * 3).to(torch.bfloat16)
    y[2] = 0
    q, scale = tf.act_and_mul_quantize(y, act, one_pass=one_pass)
    want_q, want_s = tf.quantize_activations(act_and_mul(y, act), None)
    assert q.shape == (3, 2100) and scale.shape == (3, 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_s)
    assert scale[2].item() == 0 and torch.all(q[2].float() == 0)
    with pytest.raises(ValueError, match="activation 'relu'"):
        tf.act_and_mul_quantize(y, "relu")


@needs_interpreter
def test_fp8_mlp_fused_is_the_two_ops_bit_for_bit(monkeypatch):
    """`fp8_mlp` past the GEMVs with per-channel scales: `_scaled_mm` for gate/up, the
    fused act-and-quantize kernel, `_scaled_mm` for down: the same bits as
    `fp8_linear_act_and_mul` then `fp8_linear` (torch runs _scaled_mm on the CPU
    here; the GPU test runs it there), and near the reference. Block scales, or few
    rows, take the two ops."""
    gen = torch.Generator().manual_seed(29)
    gu, gu_s = ref.quantize_fp8(torch.randn(2 * 96, 64, generator=gen))
    dn, dn_s = ref.quantize_fp8(torch.randn(64, 96, generator=gen))
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(tf, "_scaled_mm_ok", lambda *a: True)
    calls = []
    real = tf.act_and_mul_quantize
    monkeypatch.setattr(tf, "act_and_mul_quantize", lambda *a: calls.append(1) or real(*a))
    try:
        got = tf.fp8_mlp(x, gu, gu_s, dn, dn_s, "silu")
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {str(e)[:100]}")
    assert calls == [1] and got.shape == (20, 64) and got.dtype == torch.bfloat16
    h = tf.fp8_linear_act_and_mul(x, gu, gu_s, "silu")
    assert torch.equal(got, tf.fp8_linear(h, dn, dn_s))
    assert rel_err(got, ref.fp8_mlp(x, gu, gu_s, dn, dn_s, "silu")) < 2 * ACT_QUANT_TOL
    few = tf.fp8_mlp(x[:3], gu, gu_s, dn, dn_s, "silu")  # the GEMVs' rows: two ops
    assert calls == [1] and torch.equal(few, tf.fp8_linear(h[:3], dn, dn_s))
    # I = 24, not a multiple of 16 (what _scaled_mm takes for the down projection's
    # K; found by a review): two ops.
    gu24, gu24_s = ref.quantize_fp8(torch.randn(2 * 24, 64, generator=gen))
    dn24, dn24_s = ref.quantize_fp8(torch.randn(64, 24, generator=gen))
    tf.fp8_mlp(x, gu24, gu24_s, dn24, dn24_s, "silu")
    assert calls == [1]


@needs_interpreter
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_quantize_is_the_two_kernels_bit_for_bit(with_residual):
    """The norm (after the residual add, written over the residual) and the per-row
    e4m3 quantization of its output in one kernel: the same residual, e4m3 bits and
    scales as the norm kernel then `quantize_activations` (E = 320: a row padded to
    512; a row whose mean square is near eps, where eps matters; an all-zero row:
    scale 0)."""
    from pagedllm.ops import triton_norm

    gen = torch.Generator().manual_seed(31)
    hidden = (torch.randn(4, 320, generator=gen) * 2).to(torch.bfloat16)
    residual = (torch.randn(4, 320, generator=gen) * 2).to(torch.bfloat16)
    weight = (torch.rand(320, generator=gen) + 0.5).to(torch.bfloat16)
    hidden[2] *= 1e-3  # mean square ~ 1e-5 with the residual's: eps's size
    residual[2] *= 1e-3
    hidden[3] = 0
    residual[3] = 0
    res = residual.clone() if with_residual else None
    q, scale, stream = tf.rms_norm_quantize(hidden.clone(), res, weight, 1e-5)
    if with_residual:
        want_x, want_stream = triton_norm.fused_add_rms_norm(
            hidden.clone(), residual.clone(), weight, 1e-5
        )
        assert stream is res  # in place, as fused_add_rms_norm
    else:
        want_x, want_stream = triton_norm.rms_norm(hidden, weight, 1e-5), hidden
    want_q, want_s = tf.quantize_activations(want_x, None)
    assert q.shape == (4, 320) and scale.shape == (4, 1)
    assert torch.equal(stream, want_stream)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_s)
    assert scale[3].item() == 0 and torch.all(q[3].float() == 0)
    # eps is read: another eps gives that row other values
    q2, _, _ = tf.rms_norm_quantize(hidden.clone(), None, weight, 1e-3)
    q1, _, _ = tf.rms_norm_quantize(hidden.clone(), None, weight, 1e-5)
    assert not torch.equal(q2[2].view(torch.uint8), q1[2].view(torch.uint8))
    with pytest.raises(ValueError, match="weight"):
        tf.rms_norm_quantize(hidden, None, weight.float(), 1e-5)
    with pytest.raises(ValueError, match="same shape and dtype"):
        tf.rms_norm_quantize(hidden, residual.float(), weight, 1e-5)
    with pytest.raises(ValueError, match="expected \\(T, E\\)"):
        tf.rms_norm_quantize(hidden[None], None, weight, 1e-5)


@needs_interpreter
def test_fp8_norm_ops_are_the_norm_then_the_op_bit_for_bit(monkeypatch):
    """`fp8_norm_linear` and `fp8_norm_mlp` past the GEMVs with per-channel scales:
    the norm writes x quantized (`rms_norm_quantize`) for `_scaled_mm`; the same
    bits (and residual stream) as the norm kernel then `fp8_linear` / `fp8_mlp`,
    and near the reference ops. Few rows, block scales, or no residual take the
    paths they name; each equals its two steps."""
    from pagedllm.ops import triton_norm

    gen = torch.Generator().manual_seed(37)
    qkv, qkv_s = ref.quantize_fp8(torch.randn(96, 64, generator=gen))
    gu, gu_s = ref.quantize_fp8(torch.randn(2 * 96, 64, generator=gen))
    dn, dn_s = ref.quantize_fp8(torch.randn(64, 96, generator=gen))
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    norm_w = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16)
    hidden = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(tf, "_scaled_mm_ok", lambda *a: True)
    calls = []
    real = tf.rms_norm_quantize
    monkeypatch.setattr(tf, "rms_norm_quantize", lambda *a: calls.append(1) or real(*a))

    def two_steps(rows, res):
        h = hidden[:rows].clone()
        if res is None:
            return triton_norm.rms_norm(h, norm_w, 1e-5), h
        return triton_norm.fused_add_rms_norm(h, res[:rows].clone(), norm_w, 1e-5)

    for rows, res in ((20, residual), (20, None), (3, residual)):
        keep = None if res is None else res[:rows].clone()
        try:
            out, stream = tf.fp8_norm_linear(
                hidden[:rows].clone(), keep, norm_w, 1e-5, qkv, qkv_s, bias=bias
            )
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {str(e)[:100]}")
        x, want_stream = two_steps(rows, res)
        assert torch.equal(out, tf.fp8_linear(x, qkv, qkv_s, bias=bias)), rows
        assert torch.equal(stream, want_stream)
        keep = None if res is None else res[:rows].clone()
        out, stream = tf.fp8_norm_mlp(
            hidden[:rows].clone(), keep, norm_w, 1e-5, gu, gu_s, dn, dn_s, "silu"
        )
        assert torch.equal(out, tf.fp8_mlp(x, gu, gu_s, dn, dn_s, "silu")), rows
        assert torch.equal(stream, want_stream)
        ref_out, _ = ref.fp8_norm_mlp(
            hidden[:rows], None if res is None else res[:rows].clone(), norm_w, 1e-5,
            gu, gu_s, dn, dn_s, "silu",
        )  # fmt: skip
        assert rel_err(out, ref_out) < 2 * ACT_QUANT_TOL
    assert len(calls) == 4  # 20 rows with and without a residual, both ops; 3 rows: none
    # Block scales: the norm, then the op.
    bq, bq_s = ref.quantize_fp8(torch.randn(96, 64, generator=gen), (32, 32))
    out, stream = tf.fp8_norm_linear(
        hidden.clone(), residual.clone(), norm_w, 1e-5, bq, bq_s, block_size=(32, 32)
    )
    x, want_stream = two_steps(20, residual)
    assert len(calls) == 4 and torch.equal(out, tf.fp8_linear(x, bq, bq_s, block_size=(32, 32)))
    with pytest.raises(ValueError, match="activation 'relu'"):
        tf.fp8_norm_mlp(hidden, residual, norm_w, 1e-5, gu, gu_s, dn, dn_s, "relu")


@needs_interpreter
def test_a_bf16_fp8_model_takes_the_fused_norms_with_the_same_logits(monkeypatch):
    """A tiny bf16 model with FP8 projections, through the Triton ops, 20 tokens
    (past the GEMVs; `_scaled_mm` as on the GPU, which torch runs on this CPU): both
    norms of every layer write their output quantized (`rms_norm_quantize`), and
    the logits are those of the norm kernels then the projections, bit for bit."""
    from pagedllm.config import ModelConfig
    from pagedllm.model import dummy_model

    config = ModelConfig(300, 64, 96, 2, 4, 2, 16, 1e-5, 1e4, None, False, 256, 1, (2,))
    model = dummy_model(config, "cpu", "bfloat16", std=0.2, quantization="fp8", fp8_weights=True)
    model.ops_mode = "triton"
    monkeypatch.setattr(tf, "_scaled_mm_ok", lambda *a: True)
    calls = []
    real = tf.rms_norm_quantize
    monkeypatch.setattr(tf, "rms_norm_quantize", lambda *a: calls.append(1) or real(*a))
    prompt = list(range(3, 23))
    try:
        fused = model.forward_logits(prompt)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {str(e)[:100]}")
    assert len(calls) == 2 * config.num_hidden_layers
    monkeypatch.setattr(tf, "_norm_quant_ok", lambda *a: False)
    assert torch.equal(model.forward_logits(prompt), fused)
    assert len(calls) == 2 * config.num_hidden_layers
