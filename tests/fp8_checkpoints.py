"""Tiny FP8 checkpoints in the Hub's two formats, written by the tests (no downloads).

A random transformers `LlamaForCausalLM` (tests/tiny_models.py) has its decoder
projections quantized here with plain torch ops, independently of pagedllm's
own quantizer: float8 e4m3 values (`.to(torch.float8_e4m3fn)`, round to nearest
even) and float32 scales, one per tensor, per output channel or per block,
absmax / 448. They are written with the `safetensors` package beside a
config.json holding the format's `quantization_config`:

- compressed-tensors "float-quantized": `weight` + `weight_scale` (() per
  tensor, (out, 1) per channel), `input_scale` () when activations are static,
  and the `ignore` list (modules left unquantized);
- the "fp8" method (transformers' FineGrainedFP8): `weight` + `weight_scale_inv`
  of shape (ceil(out / b0), ceil(in / b1)), which multiplies.

The oracle is transformers loading the dequantized weights (weight.float() *
scale) from a second, float32 checkpoint (`dequantized_reference`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, scale of shape (), dequantized float32 weight)."""
    scale = (w.abs().max() / E4M3_MAX).float()
    q = (w.float() / scale).to(E4M3)
    return q, scale, q.float() * scale


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, scale of shape (out, 1), dequantized float32 weight)."""
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).float()
    q = (w.float() / scale).to(E4M3)
    return q, scale, q.float() * scale


def per_block(w: torch.Tensor, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, scale (ceil(out/b0), ceil(in/b1)), dequantized float32 weight);
    the blocks at the bottom and right edges may be partial."""
    rows, cols = w.shape
    n0, n1 = math.ceil(rows / b0), math.ceil(cols / b1)
    scale = torch.empty(n0, n1)
    q = torch.empty(rows, cols, dtype=E4M3)
    deq = torch.empty(rows, cols)
    for i in range(n0):
        for j in range(n1):
            block = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].float()
            s = block.abs().max() / E4M3_MAX
            scale[i, j] = s
            qb = (block / s).to(E4M3)
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = qb
            deq[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = qb.float() * s
    return q, scale, deq


def ct_config(
    strategy: str = "channel",
    activations: str = "dynamic",
    ignore: tuple[str, ...] = ("lm_head",),
) -> dict[str, Any]:
    """A compressed-tensors quantization_config as llm-compressor writes it (FP8,
    FP8_DYNAMIC), `activations` "static" (per tensor), "dynamic" (per token) or "none"."""
    acts: dict[str, Any] | None = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor" if activations == "static" else "token",
        "dynamic": activations == "dynamic",
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": None if activations == "dynamic" else "minmax",
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "ignore": list(ignore),
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": strategy,
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "actorder": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
                "input_activations": None if activations == "none" else acts,
                "output_activations": None,
            }
        },
    }


def fp8_method_config(block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """The "fp8" method's quantization_config, as Qwen3's and DeepSeek-V3's FP8 releases."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }


def write_fp8_checkpoint(
    path: Path,
    hf_model,
    cfg: dict[str, Any],
    quantization_config: dict[str, Any],
    quantize: Callable[[str, torch.Tensor], tuple | None],
    scale_name: str = "weight_scale",
    input_scales: bool = False,
) -> dict[str, torch.Tensor]:
    """Write `hf_model` to `path` with each projection weight `name` for which
    `quantize(name, w)` gives (q, scale, dequantized) stored as float8 + scale
    (None: left in float32). `input_scales`: a static `input_scale` per quantized
    module. Returns the dequantized state dict (the oracle's weights)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    dequantized: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, w in hf_model.state_dict().items():
        w = w.detach()
        got = quantize(name, w) if name.rpartition(".")[0].endswith(PROJECTIONS) else None
        if got is None:
            tensors[name] = w.contiguous()
            dequantized[name] = w.clone()
            continue
        q, scale, deq = got
        module = name.removesuffix(".weight")
        tensors[name] = q.contiguous()
        tensors[f"{module}.{scale_name}"] = scale.contiguous()
        if input_scales:
            tensors[f"{module}.input_scale"] = torch.tensor(0.05)
        dequantized[name] = deq
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": quantization_config})
    )
    return dequantized


def dequantized_reference(hf_model, dequantized: dict[str, torch.Tensor], path: Path):
    """transformers' LlamaForCausalLM loading the dequantized weights from a float32
    checkpoint written at `path` (the oracle)."""
    from transformers import LlamaForCausalLM

    hf_model.load_state_dict(dequantized)
    hf_model.save_pretrained(path, safe_serialization=True)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
