"""`Linear`: one weight matrix and the matmul that uses it, `y = x @ W.T`.

Why a type and not a bare tensor: the layout the matrix is stored in depends
on the device. On CUDA it stays (out, in), as in HF files, and `F.linear`
hands it to cuBLAS. On the CPU it is stored transposed, (in, out): `x @ W` on
that layout streams memory about twice as fast as `F.linear` on (out, in)
(measured: a 113 MB LM head, 10 ms vs 5.3 ms), and few-row products (decode)
go through numpy's BLAS, faster still (see `cpu_blas.py`). The choice lives
here, so nothing else has to know: the model calls `proj(x)`, and anyone who
wants HF's (out, in) matrix reads `proj.weight`.

`Fp8Linear` is the same interface over a float8 e4m3 (out, in) matrix and its
float32 scales (one per output channel, or per 128 x 128 block): the decoder
layers' projections of an FP8 checkpoint, or of `--quantization fp8`, on CUDA.
It multiplies through the ops' `fp8_linear` (the reference dequantizes; the
GPU kernels also quantize each activation row), and its `.weight` is the
dequantized matrix, W = weight * scale, in float32.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.model.cpu_blas import numpy_matmul_ok
from pagedllm.ops import reference

NUMPY_MATMUL_MAX_ROWS = 32  # CPU projections of at most this many tokens go through numpy


def numpy_projections(num_rows: int, dtype: torch.dtype) -> bool:
    """Whether a CPU step of `num_rows` tokens in `dtype` multiplies through numpy
    (the runner gives such a step's threads to OpenBLAS: `cpu_threads.threads_for_step`)."""
    return num_rows <= NUMPY_MATMUL_MAX_ROWS and dtype == torch.float32 and numpy_matmul_ok()


class Linear:
    """A weight matrix of HF shape (out, in), applied as `linear(x)`: (T, in) -> (T, out).

    `weight`: the (out, in) matrix (a view). `stored`: the tensor as kept in memory,
    (in, out) when `transposed` (the CPU), else (out, in). `shape`, `device`, `dtype`:
    those of `weight`.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        """`weight`: (out, in), already on its device and in its dtype. On CUDA it is
        kept as is when contiguous (a tied LM head then shares the embedding table's
        memory); on the CPU a transposed, contiguous copy is stored."""
        if weight.dim() != 2:
            raise ValueError(f"a Linear weight is a matrix, got shape {tuple(weight.shape)}")
        self.transposed = weight.device.type == "cpu"  # stored (in, out)
        self.stored = (weight.t() if self.transposed else weight).contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        impl: ModuleType | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (T, in) -> (T, out), plus `bias` (out,) when given (Qwen2's q/k/v).
        `impl`: the ops module (`ops.implementation`) whose `linear` multiplies on
        CUDA (Triton's: a GEMV for a single row, the bias in its epilogue); None: cuBLAS."""
        if not self.transposed:
            if impl is None:
                return F.linear(x, self.stored, bias)
            if bias is None:
                return impl.linear(x, self.stored)
            return impl.linear(x, self.stored, bias=bias)
        if numpy_projections(x.shape[0], x.dtype):
            # Few rows (decode): numpy's BLAS streams CPU weights faster than torch's
            # (see cpu_blas.py); many rows (prefill) stay on torch's multi-threaded
            # GEMM, since numpy's BLAS is pinned to one thread. Zero-copy views.
            out = torch.from_numpy(np.matmul(x.numpy(), self.stored.numpy()))
        else:
            out = x @ self.stored
        return out if bias is None else out.add_(bias)

    forward = __call__

    def then_act_and_mul(
        self, x: torch.Tensor, impl: ModuleType, act: str = "silu"
    ) -> torch.Tensor:
        """act(gate) * up of this projection (gate and up stacked, [gate | up]):
        (T, in) -> (T, out / 2). `act`: "silu" (SwiGLU) or "gelu_tanh" (GeGLU,
        Gemma 3). On CUDA one op (`linear_silu_and_mul` or
        `linear_gelu_tanh_and_mul`: Triton puts the gate in a single row's GEMV
        epilogue)."""
        if not self.transposed:
            fused = impl.linear_silu_and_mul if act == "silu" else impl.linear_gelu_tanh_and_mul
            return fused(x, self.stored)
        return (impl.silu_and_mul if act == "silu" else impl.gelu_tanh_and_mul)(self(x))

    def then_silu_and_mul(self, x: torch.Tensor, impl: ModuleType) -> torch.Tensor:
        """`then_act_and_mul` with SiLU (Llama's SwiGLU)."""
        return self.then_act_and_mul(x, impl, "silu")

    @property
    def weight(self) -> torch.Tensor:
        """The matrix in HF's (out, in) layout: a view, never a copy."""
        return self.stored.t() if self.transposed else self.stored

    @property
    def shape(self) -> torch.Size:
        """(out, in), whatever the stored layout."""
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.stored.device

    @property
    def dtype(self) -> torch.dtype:
        return self.stored.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held (a tied head's too, though it shares the embeddings' on CUDA)."""
        return self.stored.nbytes

    def __repr__(self) -> str:
        out, inp = self.shape
        layout = "(in, out)" if self.transposed else "(out, in)"
        return f"Linear(in={inp}, out={out}, {self.dtype}, {self.device}, stored {layout})"


class Fp8Linear:
    """A float8 e4m3 weight of HF shape (out, in) with its float32 scale, applied as
    `linear(x, impl)`: (T, in) -> (T, out) in x's dtype, through `impl.fp8_linear`.

    `qweight`: the float8 (out, in) matrix, kept as is on every device. `scale`:
    (out,) one per output channel, or (ceil(out / bs0), ceil(in / bs1)) one per
    block when `block_size` is (bs0, bs1). `weight`: the dequantized (out, in)
    matrix in float32 (a new tensor each time: for traces and tests). `shape`,
    `device`: those of the matrix; `dtype`: what it stores, float8 e4m3.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        block_size: tuple[int, int] | None = None,
    ) -> None:
        """`scale` may also be one number for the whole matrix (a per-tensor scale),
        or (out, 1); it is stored as one per row. One-line ValueError for a weight
        that is not 2-D float8 e4m3, or a scale of the wrong shape."""
        self.block_size = None if block_size is None else (int(block_size[0]), int(block_size[1]))
        self.scale = reference.check_fp8_weight(qweight, scale, self.block_size).contiguous()
        self.qweight = qweight.contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        impl: ModuleType | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (T, in) -> (T, out), plus `bias` (out,) when given. `impl`: the ops
        module (`ops.implementation`); None: the reference."""
        return (impl or reference).fp8_linear(
            x, self.qweight, self.scale, bias=bias, block_size=self.block_size
        )

    forward = __call__

    def then_act_and_mul(
        self, x: torch.Tensor, impl: ModuleType, act: str = "silu"
    ) -> torch.Tensor:
        """act(gate) * up of this projection ([gate | up] stacked): (T, in) -> (T,
        out / 2), one op (`fp8_linear_act_and_mul`); `act` "silu" or "gelu_tanh"."""
        return (impl or reference).fp8_linear_act_and_mul(
            x, self.qweight, self.scale, act, block_size=self.block_size
        )

    def then_silu_and_mul(self, x: torch.Tensor, impl: ModuleType) -> torch.Tensor:
        """`then_act_and_mul` with SiLU (Llama's SwiGLU)."""
        return self.then_act_and_mul(x, impl, "silu")

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix, (out, in) float32: W = qweight * scale."""
        return reference.dequantize_fp8(self.qweight, self.scale, self.block_size)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.qweight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: the float8 matrix and its scales."""
        return self.qweight.nbytes + self.scale.nbytes

    def __repr__(self) -> str:
        out, inp = self.shape
        scales = (
            "per output channel"
            if self.block_size is None
            else f"per {self.block_size[0]}x{self.block_size[1]} block"
        )
        return f"Fp8Linear(in={inp}, out={out}, float8_e4m3fn, {self.device}, scales {scales})"
