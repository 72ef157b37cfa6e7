"""The FP8 weight kernels compiled on CUDA (issue 36), at Llama-3.1-8B shapes.

Run on the GPU machine with `pytest -m gpu`. Each path of `ops/triton_fp8.py`
against two float32 oracles built from the same e4m3 weights: the quantized
one (x rounded to e4m3 as the kernel rounds it, `quantize_activations_
reference`, then a float32 matmul), within 5e-3 (a bf16 output is rounded once,
~1e-3 rms, and the fp8 tensor cores sum a chunk of 128 products with fewer bits
than float32); and the reference (`reference.fp8_linear`, x not quantized),
within 5 % (the activations' e4m3 rounding, ~3.6 % rms: see tests/test_ops_fp8.py).
Paths: the weight-only GEMV (one row, per-channel scales: x not quantized, so
within 5e-3 of the reference), the GEMV (T <= 16; split K; act_and_mul; bias; in a CUDA graph; with
PDL), `torch._scaled_mm` and the Triton GEMM for T > 16, per channel and with
128 x 128 block scales.
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

from pagedllm import ops  # noqa: E402
from pagedllm.ops import reference as ref  # noqa: E402
from pagedllm.ops import triton_fp8 as tf  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
QUANTIZED_TOL = 5e-3
REFERENCE_TOL = 0.05


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.float(), expected.float()
    return ((out - expected).norm() / expected.norm()).item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def fp8_weight(n: int, k: int, block_size=None):
    """Random weights (std 1 / sqrt(k), as a trained projection's) quantized."""
    return ref.quantize_fp8(torch.randn(n, k, device=DEV) * k**-0.5, block_size)


def quantized_oracle(x, weight, scale, block_size, group, bias=None, act=None):
    xq, xs = tf.quantize_activations_reference(x, group)
    g = group or x.shape[1]
    xd = xq.float() * xs[:, torch.arange(x.shape[1], device=x.device) // g]
    y = xd @ ref.dequantize_fp8(weight, scale, block_size).T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if act is None:
        return y
    return ref.silu_and_mul(y) if act == "silu" else ref.gelu_tanh_and_mul(y)


def reference_op(x, weight, scale, block_size, bias=None, act=None):
    x32 = x.float()
    b32 = None if bias is None else bias.float()
    if act is None:
        return ref.fp8_linear(x32, weight, scale, bias=b32, block_size=block_size)
    return ref.fp8_linear_act_and_mul(x32, weight, scale, act, block_size=block_size)


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_is_bit_exact(group):
    x = torch.randn(37, 14336, device=DEV, dtype=BF16) * 4
    x[3] = 0
    q, s = tf.quantize_activations(x, group)
    want_q, want_s = tf.quantize_activations_reference(x, group)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


# Llama-3.1-8B: q/k/v, o_proj, down; gate/up with SwiGLU; and a shape no tile divides.
SHAPES = [(6144, 4096, None), (4096, 4096, None), (4096, 14336, None), (28672, 4096, "silu")]


@pytest.mark.parametrize("block_size", [None, (128, 128)], ids=["channel", "block128"])
@pytest.mark.parametrize("n,k,act", SHAPES + [(1000, 720, "gelu_tanh"), (1000, 720, None)])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gemv(n, k, act, block_size, rows):
    w, s = fp8_weight(n, k, block_size)
    x = torch.randn(rows, k, device=DEV, dtype=BF16)
    bias = None if act else torch.randn(n, device=DEV, dtype=BF16) * 0.1
    if act:
        got = tf.fp8_linear_act_and_mul(x, w, s, act, block_size=block_size)
    else:
        got = tf.fp8_linear(x, w, s, bias=bias, block_size=block_size)
    reference = reference_op(x, w, s, block_size, bias, act)
    if block_size is None and rows <= tf.W8A16_MAX_ROWS:  # weight-only: x not quantized
        assert rel_err(got, reference) < QUANTIZED_TOL
        return
    want = quantized_oracle(x, w, s, block_size, 128, bias, act)
    assert rel_err(got, want) < QUANTIZED_TOL
    assert rel_err(got, reference) < REFERENCE_TOL


@pytest.mark.parametrize("act", [None, "silu"])
def test_gemv_split_k_is_deterministic_in_a_cuda_graph_and_with_pdl(act):
    """The 8B down projection (64 tiles: K split 5 ways on 132 SMs): the same bits
    eagerly twice, replayed in a CUDA graph, and launched with PDL in a kernel chain;
    every tile's count is back to zero after."""
    n = 2 * 4096 if act else 4096
    w, s = fp8_weight(n, 14336)
    s = ref.check_fp8_weight(w, s, None)
    x = torch.randn(4, 14336, device=DEV, dtype=BF16)
    first = tf.gemv(x, w, s, act=act)
    assert torch.equal(tf.gemv(x, w, s, act=act), first)
    _, counts = tf._WORKSPACE[x.device]
    torch.cuda.synchronize()
    assert int(counts.abs().sum()) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tf.gemv(x, w, s, act=act)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    with ops.kernel_chain():
        chained = tf.gemv(x, w, s, act=act)
    assert torch.equal(chained, first)
    one = tf.gemv(x, w, s, act=act, config=(64, 128, 4, 4, 1))
    assert rel_err(one, first) < 1e-2  # another summation order, rounded to bf16


@pytest.mark.parametrize(
    "use_scaled_mm,fast", [(True, True), (True, False), (False, False)],
    ids=["scaled_mm-fast-accum", "scaled_mm", "triton"],
)  # fmt: skip
@pytest.mark.parametrize("rows", [17, 300])
def test_per_channel_gemm(monkeypatch, use_scaled_mm, fast, rows):
    """T > 16, per channel: torch._scaled_mm (row-wise scales, the bias in its
    epilogue; with FP8 fast accumulation, the default, within 1e-2) or the Triton
    GEMM; x quantized per row."""
    monkeypatch.setattr(tf, "USE_SCALED_MM", use_scaled_mm)
    monkeypatch.setattr(tf, "SCALED_MM_FAST_ACCUM", fast)
    tol = 1e-2 if fast else QUANTIZED_TOL
    w, s = fp8_weight(6144, 4096)
    x = torch.randn(rows, 4096, device=DEV, dtype=BF16)
    bias = torch.randn(6144, device=DEV, dtype=BF16) * 0.1
    got = tf.fp8_linear(x, w, s, bias=bias)
    assert rel_err(got, quantized_oracle(x, w, s, None, None, bias)) < tol
    assert rel_err(got, reference_op(x, w, s, None, bias)) < REFERENCE_TOL
    got = tf.fp8_linear_act_and_mul(x, w, s, "silu")
    assert rel_err(got, quantized_oracle(x, w, s, None, None, act="silu")) < tol


def test_scaled_mm_is_what_runs_for_bf16_and_not_for_fp16(monkeypatch):
    calls = []
    real = tf.scaled_mm
    monkeypatch.setattr(tf, "scaled_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w, s = fp8_weight(1024, 1024)
    x = torch.randn(64, 1024, device=DEV, dtype=BF16)
    tf.fp8_linear(x, w, s)
    assert calls == [1]
    half = tf.fp8_linear(x.half(), w, s)  # row-wise _scaled_mm gives bf16 only: the GEMM
    assert calls == [1] and half.dtype == torch.float16  # (the Triton GEMM: exact accumulation)
    assert rel_err(half, quantized_oracle(x.half(), w, s, None, None)) < QUANTIZED_TOL


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 720)])
def test_block_scaled_gemm(n, k):
    """T > 16 with 128 x 128 block scales: the Triton GEMM, x per row and group of 128."""
    w, s = fp8_weight(n, k, (128, 128))
    x = torch.randn(200, k, device=DEV, dtype=BF16)
    got = tf.fp8_linear(x, w, s, block_size=(128, 128))
    assert rel_err(got, quantized_oracle(x, w, s, (128, 128), 128)) < QUANTIZED_TOL
    assert rel_err(got, reference_op(x, w, s, (128, 128))) < REFERENCE_TOL


def test_the_dispatcher_gives_cuda_tensors_the_fp8_kernels():
    impl = ops.implementation(DEV)
    assert impl.fp8_linear is tf.fp8_linear
    assert impl.fp8_linear_act_and_mul is tf.fp8_linear_act_and_mul


def test_block_scaled_mm_of_torch_where_it_runs():
    """torch's block-wise scaled_mm (cuBLASLt 12.9+ on sm_90), the alternative the
    benchmark times against the Triton GEMM: same numbers as the oracle, or skipped
    with torch's reason."""
    w, s = fp8_weight(4096, 4096, (128, 128))
    x = torch.randn(200, 4096, device=DEV, dtype=BF16)
    try:
        got = tf.scaled_mm_blockwise(x, w, s.contiguous())
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as e:
        pytest.skip(f"block-wise scaled_mm does not run here: {str(e).splitlines()[0][:200]}")
    assert rel_err(got, quantized_oracle(x, w, s, (128, 128), 128)) < QUANTIZED_TOL


@pytest.mark.parametrize("inter", [14336, 20000], ids=["one-pass", "two-pass"])
def test_act_and_mul_quantize_is_the_two_kernels_bit_for_bit(inter):
    """The fused SwiGLU + per-row quantization at the 8B's I (the row held whole,
    16 warps) and past ACT_QUANT_ONE_PASS (two passes): the bits of silu_and_mul
    then quantize_activations."""
    from pagedllm.ops.triton_act import silu_and_mul

    y = torch.randn(300, 2 * inter, device=DEV).to(BF16) * 3
    q, s = tf.act_and_mul_quantize(y, "silu")
    want_q, want_s = tf.quantize_activations(silu_and_mul(y), None)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


@pytest.mark.parametrize("rows", [17, 1024])
def test_fp8_mlp_fused_is_the_two_ops_bit_for_bit(rows):
    """`fp8_mlp` past the GEMVs (`_scaled_mm`, the fused SwiGLU + quantization,
    `_scaled_mm`): the bits of fp8_linear_act_and_mul then fp8_linear."""
    gu, gu_s = fp8_weight(2 * 14336, 4096)
    dn, dn_s = fp8_weight(4096, 14336)
    x = torch.randn(rows, 4096, device=DEV).to(BF16)
    got = tf.fp8_mlp(x, gu, gu_s, dn, dn_s, "silu")
    want = tf.fp8_linear(tf.fp8_linear_act_and_mul(x, gu, gu_s, "silu"), dn, dn_s)
    assert torch.equal(got, want)
    assert rel_err(got, ref.fp8_mlp(x, gu, gu_s, dn, dn_s, "silu")) < 2 * REFERENCE_TOL


@pytest.mark.parametrize("hidden_size", [4096, 8192])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_quantize_is_the_two_kernels_bit_for_bit(hidden_size, with_residual):
    """The norm that writes its output quantized (8B's and 70B's rows): the residual,
    e4m3 bits and scales of the norm kernel then `quantize_activations`."""
    from pagedllm.ops import triton_norm

    hidden = torch.randn(300, hidden_size, device=DEV).to(BF16)
    residual = torch.randn(300, hidden_size, device=DEV).to(BF16)
    weight = (torch.rand(hidden_size, device=DEV) + 0.5).to(BF16)
    res = residual.clone() if with_residual else None
    q, s, stream = tf.rms_norm_quantize(hidden.clone(), res, weight, 1e-5)
    if with_residual:
        x, want_stream = triton_norm.fused_add_rms_norm(hidden.clone(), residual, weight, 1e-5)
    else:
        x, want_stream = triton_norm.rms_norm(hidden, weight, 1e-5), hidden
    want_q, want_s = tf.quantize_activations(x, None)
    assert torch.equal(stream, want_stream)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


@pytest.mark.parametrize("rows", [17, 1024])
def test_fp8_norm_ops_are_the_norm_then_the_op_bit_for_bit(rows):
    """`fp8_norm_linear` (the 8B's q/k/v) and `fp8_norm_mlp` past the GEMVs: the
    bits of the norm kernel then `fp8_linear` / `fp8_mlp`, the same residual."""
    from pagedllm.ops import triton_norm

    qkv, qkv_s = fp8_weight(6144, 4096)
    gu, gu_s = fp8_weight(2 * 14336, 4096)
    dn, dn_s = fp8_weight(4096, 14336)
    w = (torch.rand(4096, device=DEV) + 0.5).to(BF16)
    hidden = torch.randn(rows, 4096, device=DEV).to(BF16)
    residual = torch.randn(rows, 4096, device=DEV).to(BF16)
    x, want_stream = triton_norm.fused_add_rms_norm(hidden.clone(), residual.clone(), w, 1e-5)
    out, stream = tf.fp8_norm_linear(hidden.clone(), residual.clone(), w, 1e-5, qkv, qkv_s)
    assert torch.equal(out, tf.fp8_linear(x, qkv, qkv_s)) and torch.equal(stream, want_stream)
    out, stream = tf.fp8_norm_mlp(
        hidden.clone(), residual.clone(), w, 1e-5, gu, gu_s, dn, dn_s, "silu"
    )
    assert torch.equal(out, tf.fp8_mlp(x, gu, gu_s, dn, dn_s, "silu"))
    assert torch.equal(stream, want_stream)
