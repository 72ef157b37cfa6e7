"""Build a `LlamaModel` from an HF directory or a GGUF file.

Owns: choosing the device and dtype, checking that every weight is there with
the shape the config implies, and fusing Q/K/V and gate/up at load time (one
matmul each at run time). Does not own: file parsing (`weights/`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.model.llama import LayerWeights, LlamaModel
from pagedllm.model.resolve import is_gguf, resolve_model_path

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no CUDA GPU is available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported; choose 'cpu' or 'cuda'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """CPU defaults to float32 (bf16 allowed); CUDA to bf16."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; choose float32, bfloat16 or float16")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose float32, bfloat16 or float16")
    return _DTYPES[key]


def load_model(
    path: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> LlamaModel:
    """Load a Llama-family model; `path=None` means the default SmolLM2 GGUF."""
    model_path = resolve_model_path(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if is_gguf(model_path):
        from pagedllm.weights import load_gguf_state_dict

        metadata, state = load_gguf_state_dict(model_path, device="cpu", dtype=torch.float32)
        config = ModelConfig.from_gguf_metadata(metadata, source=str(model_path))
        # A GGUF with no output.weight ties the LM head to the embeddings.
        config = dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in state)
    else:
        from pagedllm.weights import load_safetensors_dir

        config = ModelConfig.from_hf_dir(model_path)
        state = load_safetensors_dir(model_path, device="cpu")
    model = build_model(config, state, dev, dt, source=str(model_path))
    model.source_path = model_path
    return model


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    source: str = "model",
) -> LlamaModel:
    """Check shapes, fuse QKV and gate/up, and move everything to device/dtype once."""
    c = config

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"{source}: weight {name!r} is missing")
        t = state[name]
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(t.shape)}, config implies {shape}"
            )
        return t

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    transposed = device.type == "cpu"  # see LayerWeights: (in, out) is faster there

    def put_matrix(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device=device, dtype=dtype)
        return (t.t() if transposed else t).contiguous()

    e, inter = c.hidden_size, c.intermediate_size
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = take(p + "self_attn.q_proj.weight", (c.q_size, e))
        k = take(p + "self_attn.k_proj.weight", (c.kv_size, e))
        v = take(p + "self_attn.v_proj.weight", (c.kv_size, e))
        gate = take(p + "mlp.gate_proj.weight", (inter, e))
        up = take(p + "mlp.up_proj.weight", (inter, e))
        layers.append(
            LayerWeights(
                input_norm=put(take(p + "input_layernorm.weight", (e,))),
                qkv_proj=put_matrix(torch.cat([q, k, v], dim=0)),
                o_proj=put_matrix(take(p + "self_attn.o_proj.weight", (e, c.q_size))),
                post_norm=put(take(p + "post_attention_layernorm.weight", (e,))),
                gate_up_proj=put_matrix(torch.cat([gate, up], dim=0)),
                down_proj=put_matrix(take(p + "mlp.down_proj.weight", (e, inter))),
            )
        )
    embed = put(take("model.embed_tokens.weight", (c.vocab_size, e)))
    if c.tie_word_embeddings:
        # Tied: on the GPU the very same tensor; on the CPU a transposed copy.
        lm_head = embed.t().contiguous() if transposed else embed
    else:
        lm_head = put_matrix(take("lm_head.weight", (c.vocab_size, e)))
    norm = put(take("model.norm.weight", (e,)))
    return LlamaModel(c, embed, layers, norm, lm_head, weights_transposed=transposed)


def dummy_model(
    config: ModelConfig,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> LlamaModel:
    """Random weights of the config's shape, made directly on the device in the compute
    dtype (no file, no float32 detour): for speed work, where values do not matter."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    c = config

    transposed = dev.type == "cpu"  # see LayerWeights

    def mat(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=gen, device=dev, dtype=dt) * std
        return w.t().contiguous() if transposed else w

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=dev, dtype=dt)

    e, inter = c.hidden_size, c.intermediate_size
    layers = [
        LayerWeights(
            input_norm=ones(e),
            qkv_proj=mat(c.q_size + 2 * c.kv_size, e),
            o_proj=mat(e, c.q_size),
            post_norm=ones(e),
            gate_up_proj=mat(2 * inter, e),
            down_proj=mat(e, inter),
        )
        for _ in range(c.num_hidden_layers)
    ]
    embed = torch.randn(c.vocab_size, e, generator=gen, device=dev, dtype=dt) * std
    if c.tie_word_embeddings:
        lm_head = embed.t().contiguous() if transposed else embed
    else:
        lm_head = mat(c.vocab_size, e)
    return LlamaModel(c, embed, layers, ones(e), lm_head, weights_transposed=transposed)
