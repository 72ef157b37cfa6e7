"""FP8 weights as they load: a checkpoint's float8 tensors and their scales, checked,
sliced and fused; and weights quantized to FP8 as they load (`--quantization fp8`).

Owns: `Fp8Weight` (a float8 e4m3 (out, in) matrix, its float32 scales and where it
sits in the matrix those scales cover), `take_fp8_weights` (every float8 tensor of
a state dict with its scale, checked against the checkpoint's
`QuantizationConfig`: a missing scale, a scale of the wrong shape, a float8
tensor with no quantization_config or that the config leaves unquantized are
one-line errors naming the tensor), fusing Q/K/V and gate/up (`fuse_fp8`), and
making FP8 weights: per-channel quantization of a float matrix (`quantize`,
absmax of each row / 448, as `ops.reference.quantize_fp8`) and random ones
(`random_fp8`, for `--load-format dummy`). Does not own: what the formats mean
(`pagedllm/quantization.py`), the numbers W = weight * scale
(`ops.reference.dequantize_fp8`, the spec the kernels follow), where FP8 weights
run (`model/loader.py`: `Fp8Linear` on CUDA, dequantized on the CPU) or which
rank holds which rows (`model/parallel.py`).

Scales, as the kernels take them (float32): () one per tensor, (out,) one per
output channel (row), or (ceil(out / b0), ceil(in / b1)) one per (b0, b1) block.
A checkpoint's per-channel scale is (out, 1) and its per-tensor one () or (1,);
both are flattened here. A slice of a weight (a tensor-parallel rank's rows or
columns) keeps the scales of the whole matrix, with its `origin` in it, until
`compact` cuts the scales to it (for blocks only when the slice starts and ends
on block edges; a slice that does not can still be dequantized, on the CPU).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.ops.reference import FP8_DTYPE, quantize_fp8
from pagedllm.quantization import SUPPORTED, Fp8Scheme, QuantizationConfig

# The tensors of a quantized module besides its weight. `weight_scale_inv` is the
# block scale of the "fp8" method (it multiplies, despite its name).
SCALE_NAMES = ("weight_scale", "weight_scale_inv", "input_scale")
# The decoder layers' projections: the modules kept in FP8 on the GPU. Everything
# else (embeddings, norms, the LM head) stays in the model's dtype, as in vLLM.
PROJECTION = re.compile(
    r"model\.layers\.(?:0|[1-9]\d*)\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
)
# `random_fp8` makes a matrix this many values at a time, so that a random 70B
# model never holds more than one such chunk in 16 bits.
RANDOM_CHUNK = 1 << 24


@dataclass
class Fp8Weight:
    """A float8 e4m3 matrix and its float32 scales: W = weight.float() * scale.

    `scale`: () per tensor, (R,) per row, or (ceil(R / b0), ceil(C / b1)) per block
    of `block_size` (b0, b1), for the (R, C) matrix `whole` (None: `weight`'s own
    shape) of which `weight` is the part starting at row, column `origin`."""

    weight: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    origin: tuple[int, int] = (0, 0)
    whole: tuple[int, int] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(
            self.weight.to(device), self.scale.to(device), self.block_size, self.origin, self.whole
        )

    def dequantize(self) -> torch.Tensor:
        """W as float32 (out, in): the numbers `ops.reference.dequantize_fp8` makes."""
        w = self.weight.float()
        (r0, c0), (rows, cols) = self.origin, self.weight.shape
        if self.scale.dim() == 0:
            return w * self.scale
        if self.block_size is None:
            return w * self.scale[r0 : r0 + rows, None]
        b0, b1 = self.block_size
        dev = self.scale.device
        row_blocks = torch.arange(r0, r0 + rows, device=dev) // b0
        col_blocks = torch.arange(c0, c0 + cols, device=dev) // b1
        return w * self.scale[row_blocks][:, col_blocks]

    def compact(self) -> Fp8Weight | None:
        """This weight as the kernels take it: its scales cut to it, `origin` (0, 0);
        a per-tensor scale stays one number. None when a block-scaled slice does not
        start and end on block edges (or the whole matrix's end): blocks it shares
        with another slice cannot be cut, and only `dequantize` can use it."""
        (r0, c0), (rows, cols) = self.origin, self.weight.shape
        if self.scale.dim() == 0 or (r0, c0) == (0, 0) and self.whole in (None, (rows, cols)):
            return Fp8Weight(self.weight, self.scale, self.block_size)
        if self.block_size is None:
            return Fp8Weight(self.weight, self.scale[r0 : r0 + rows].contiguous())
        (b0, b1), (whole_rows, whole_cols) = self.block_size, self.whole
        for start, n, b, end in ((r0, rows, b0, whole_rows), (c0, cols, b1, whole_cols)):
            if start % b or ((start + n) % b and start + n != end):
                return None
        scale = self.scale[r0 // b0 : -(-(r0 + rows) // b0), c0 // b1 : -(-(c0 + cols) // b1)]
        return Fp8Weight(self.weight, scale.contiguous(), self.block_size)

    def per_channel_scale(self) -> torch.Tensor:
        """(out,) float32: the scale of each row of a whole (compact) per-tensor or
        per-channel weight."""
        if self.block_size is not None:
            raise ValueError("a block-scaled weight has no scale per row")
        return self.scale.reshape(-1).expand(self.shape[0]).float().contiguous()


# ------------------------------------------------------------------ a checkpoint's FP8 tensors
def take_fp8_weights(
    state: dict[str, torch.Tensor],
    quantization: QuantizationConfig | None,
    source: str,
    full_shape: Callable[[str, tuple[int, ...]], tuple[int, ...] | None] | None = None,
) -> dict[str, torch.Tensor | Fp8Weight]:
    """`state` with each FP8 projection weight (and its scales) as one `Fp8Weight`.

    Checks, each a one-line ValueError naming the tensor: a float8 tensor needs a
    `quantization_config` that quantizes its module, and the scale that config
    names, a float of the shape its strategy implies (and a positive `input_scale`
    when activations are static); only the decoder layers' projections may be
    float8 (vLLM's rule: embeddings and the LM head stay in the model's dtype); a
    projection the config quantizes must be float8; no scale may be left over.

    `full_shape(name, shape)`: the shape of the whole matrix that weight `name` of
    `shape` is a slice of (a tensor-parallel rank's), which its scales cover; None:
    the weight's shape is wrong, and the caller says so. Default: the weight is whole.
    """
    scales = {n: t for n, t in state.items() if n.rpartition(".")[2] in SCALE_NAMES}
    used: set[str] = set()
    out: dict[str, torch.Tensor | Fp8Weight] = {}
    for name, t in state.items():
        if name in scales:
            continue
        module, _, leaf = name.rpartition(".")
        if t.dtype != FP8_DTYPE:
            scheme = None
            if quantization is not None and leaf == "weight" and PROJECTION.fullmatch(module):
                scheme = quantization.scheme_for(module)
            if scheme is not None:
                raise ValueError(
                    f"{source}: weight {name!r} is {_dtype(t)}, but quantization_config "
                    f"quantizes {module!r} ({scheme.describe()}); the weights and "
                    "config.json disagree"
                )
            out[name] = t
            continue
        if quantization is None:
            raise ValueError(
                f"{source}: tensor {name!r} is float8 e4m3, but config.json has no "
                f"quantization_config to say how it is scaled; {SUPPORTED}"
            )
        if leaf != "weight" or not PROJECTION.fullmatch(module):
            raise ValueError(
                f"{source}: tensor {name!r} is float8 e4m3; only the decoder layers' "
                "q/k/v/o and gate/up/down projections may be (the embeddings, norms and "
                "LM head stay in the model's dtype, as vLLM requires)"
            )
        scheme = quantization.scheme_for(module)
        if scheme is None:
            raise ValueError(
                f"{source}: weight {name!r} is float8 e4m3, but quantization_config "
                f"leaves {module!r} unquantized (it is ignored, or no config group targets "
                "it); the weights and config.json disagree"
            )
        whole = tuple(t.shape) if full_shape is None else full_shape(name, tuple(t.shape))
        scale_name = f"{module}.{scheme.scale_name}"
        if scale_name not in scales:
            raise ValueError(
                f"{source}: FP8 weight {name!r} has no scale: {scale_name!r} is missing "
                f"({scheme.describe()})"
            )
        used.add(scale_name)
        scale = _check_scale(scales[scale_name], scale_name, scheme, whole, source)
        if scheme.activations == "static":
            input_name = f"{module}.input_scale"
            if input_name not in scales:
                raise ValueError(
                    f"{source}: FP8 weight {name!r} has no {input_name!r} (quantization_config "
                    "gives its activations a static scale)"
                )
            used.add(input_name)
            _check_input_scale(scales[input_name], input_name, source)
        out[name] = Fp8Weight(t, scale, scheme.block_size, whole=whole)
    unused = sorted(set(scales) - used)
    if unused:
        raise ValueError(
            f"{source}: {unused[0]!r} is a scale of no FP8 weight "
            f"({len(unused)} such tensors): its weight is not float8 e4m3, or "
            "quantization_config gives it no such scale"
        )
    return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_scale(
    scale: torch.Tensor,
    name: str,
    scheme: Fp8Scheme,
    shape: tuple[int, ...] | None,
    source: str,
) -> torch.Tensor:
    """The scale as float32, flattened per tensor or per channel (see the module
    docstring); a one-line ValueError when its dtype or shape does not fit."""
    if not scale.dtype.is_floating_point or scale.dtype == FP8_DTYPE:
        raise ValueError(
            f"{source}: scale {name!r} is {_dtype(scale)}; expected float32 (or bf16/fp16)"
        )
    if shape is None:  # the weight's shape is wrong: the loader names it
        return scale.float()
    rows, cols = shape
    got = tuple(scale.shape)
    if scheme.strategy == "tensor":
        ok, want = scale.numel() == 1, "one number: () or (1,)"
        flat = scale.reshape(())
    elif scheme.strategy == "channel":
        ok, want = got in ((rows, 1), (rows,)), f"one per output channel: ({rows}, 1)"
        flat = scale.reshape(-1)
    else:
        b0, b1 = scheme.block_size
        blocks = (-(-rows // b0), -(-cols // b1))
        ok, want = got == blocks, f"one per {b0}x{b1} block: {blocks}"
        flat = scale
    if not ok:
        raise ValueError(
            f"{source}: scale {name!r} has shape {got}; the ({rows}, {cols}) weight "
            f"it scales needs {want}"
        )
    flat = flat.float()
    if not bool(torch.isfinite(flat).all()) or bool((flat <= 0).any()):
        raise ValueError(f"{source}: scale {name!r} holds a value that is not finite and > 0")
    return flat.contiguous()


def _check_input_scale(scale: torch.Tensor, name: str, source: str) -> None:
    """A static activation scale: one positive float (checked; the kernels quantize
    each token's row with a scale of its own instead)."""
    if not scale.dtype.is_floating_point or scale.dtype == FP8_DTYPE or scale.numel() != 1:
        raise ValueError(
            f"{source}: {name!r} is {_dtype(scale)} of shape {tuple(scale.shape)}; "
            "expected one float: () or (1,)"
        )
    value = float(scale.float().reshape(()))
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{source}: {name!r} is {value}; expected a finite number > 0")


# ------------------------------------------------------------------ fusing and making
def fuse_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    """Compact FP8 weights (same columns) stacked by rows, as Q/K/V and gate/up are
    fused: per-tensor and per-channel scales become one scale per row (each part's
    rows keep their own); block scales are stacked when every part but the last
    ends on a block edge. Otherwise (blocks cut by a part's edge, or parts scaled
    differently) the stacked matrix is quantized again per row: rounded twice, so
    close to the checkpoint's but not bit-identical."""
    blocks = {p.block_size for p in parts}
    if blocks == {None}:
        return Fp8Weight(
            torch.cat([p.weight for p in parts]),
            torch.cat([p.per_channel_scale() for p in parts]),
        )
    if len(blocks) == 1 and all(p.shape[0] % p.block_size[0] == 0 for p in parts[:-1]):
        return Fp8Weight(
            torch.cat([p.weight for p in parts]),
            torch.cat([p.scale for p in parts]),
            parts[0].block_size,
        )
    return quantize(torch.cat([p.dequantize() for p in parts]))


def quantize(w: torch.Tensor) -> Fp8Weight:
    """A float matrix quantized to FP8 with one scale per output channel (row): its
    largest |value| becomes 448 (e4m3's largest), rounded to nearest even
    (`ops.reference.quantize_fp8`), on `w`'s device."""
    weight, scale = quantize_fp8(w)
    return Fp8Weight(weight, scale)


def random_fp8(
    rows: int,
    cols: int,
    std: float,
    generator: torch.Generator,
    device: torch.device,
    chunk: int = RANDOM_CHUNK,
) -> Fp8Weight:
    """Random FP8 weights of standard deviation `std`, made on `device` without a
    16-bit copy of the matrix: normal values, drawn `chunk` at a time in bfloat16,
    become the float8 weight, and every row's scale is `std`."""
    weight = torch.empty(rows, cols, dtype=FP8_DTYPE, device=device)
    step = max(1, chunk // max(cols, 1))
    for r in range(0, rows, step):
        n = min(step, rows - r)
        draw = torch.randn(n, cols, generator=generator, device=device, dtype=torch.bfloat16)
        weight[r : r + n] = draw.to(FP8_DTYPE)
    return Fp8Weight(weight, torch.full((rows,), float(std), device=device))
