"""FP8 weight projections on the GPU (issue 36): `fp8_linear` and `fp8_linear_act_and_mul`.

Work in progress: for now every call dequantizes the weight and runs the
reference (`reference.fp8_linear`); the FP8 GEMV and GEMM follow.
"""

from __future__ import annotations

import torch

from pagedllm.ops import reference


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See `reference.fp8_linear`."""
    return reference.fp8_linear(x, weight, weight_scale, bias=bias, block_size=block_size)


def fp8_linear_act_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    act: str,
    *,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See `reference.fp8_linear_act_and_mul`."""
    return reference.fp8_linear_act_and_mul(x, weight, weight_scale, act, block_size=block_size)
