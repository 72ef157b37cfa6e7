"""FP8 weight ops (issue 36): the reference against a float32 oracle, and the Triton
FP8 GEMV against the reference on the CPU under TRITON_INTERPRET=1.

The reference (`reference.fp8_linear`) dequantizes W = weight * scale (per output
channel, or per 128 x 128 block) and multiplies in float32; these tests build W
by hand from the e4m3 bits and the scales and check the reference to float32
rounding. The Triton kernels also round each activation row to e4m3 (absmax /
448 per row), so they are held to the reference within that error (see
`ACT_QUANT_TOL`).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import reference as ref


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
