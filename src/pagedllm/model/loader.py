"""Build a `LlamaModel` from an HF directory or a GGUF file.

Owns: choosing the device and dtype, checking that the file's weights are
exactly those the config implies (each present, with its shape, and none
left over), and fusing Q/K/V and gate/up at load time (one matmul each at run
time). Does not own: file parsing (`weights/`).

A weight the config does not use is an error, never dropped: it means the
config and the checkpoint disagree (e.g. `num_hidden_layers=1` on a 2-layer
file), and the model would silently be another one.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.model.linear import Linear
from pagedllm.model.llama import LayerWeights, LlamaModel
from pagedllm.model.parallel import (
    TensorParallel,
    check_divisible,
    shard_config,
    shard_weight,
    sharded_shape,
)
from pagedllm.resolve import is_gguf, resolve_model_path

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


# Tensors that Llama checkpoints legitimately carry and that are not weights of the
# model: the RoPE inverse frequencies older transformers versions saved (we compute
# them from the config; transformers ignores them on load too). GGUF's equivalent,
# `rope_freqs.weight`, is dropped by `weights/gguf.py`. Anything else unused is an error.
_NOT_WEIGHTS = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
# The weights of decoder layer i in any family we run (no leading zeros: build_model
# asks for "model.layers.1.", so a "model.layers.01." tensor would be dropped unread);
# `layer_weight_names` says which of them a given config uses.
_LAYER_WEIGHT = re.compile(
    r"model\.layers\.(0|[1-9]\d*)\.((?:input_layernorm|post_attention_layernorm"
    r"|pre_feedforward_layernorm|post_feedforward_layernorm|self_attn\.[qk]_norm"
    r"|self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight"
    r"|self_attn\.[qkv]_proj\.bias)"
)


def layer_weight_names(config: ModelConfig) -> frozenset[str]:
    """The names (after "model.layers.i.") of one decoder layer's weights in `config`'s
    family. Llama's norm before the MLP is HF's `post_attention_layernorm`; Gemma 3
    has a norm there *and* one after attention, which HF names that way instead."""
    names = {
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "post_attention_layernorm.weight",
    }
    if config.sandwich_norms:
        names |= {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"}
    if config.attention_bias:
        names |= {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    if config.qk_norm:
        names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    return frozenset(names)


def load_model(
    path: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    max_model_len: int | None = None,
    tp: TensorParallel | None = None,
    load_format: str = "auto",
) -> LlamaModel:
    """Load a Llama-family model; `path=None` means the default SmolLM2 GGUF.

    `tp`: load only this rank's slice of each weight (see `model/parallel.py`).
    `load_format="dummy"`: no weights are read; `path` is an HF directory whose
    config.json gives the shape, and the weights are random (`dummy_model`).

    `max_model_len`: the longest sequence the caller will run; the RoPE table is
    built for min(max_position_embeddings, max_model_len) positions (all of the
    model's positions when None).
    """
    if max_model_len is not None and (
        not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 1
    ):
        raise ValueError(f"max_model_len is {max_model_len!r}; give a positive integer or None")
    model_path = resolve_model_path(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_load_format(model_path, load_format)
    if load_format == "dummy":
        config = ModelConfig.from_hf_dir(model_path)
        return dummy_model(config, dev, dt, tp=tp, source=str(model_path / "config.json"))
    # A tensor-parallel rank keeps (and copies from the file) only its slices.
    select = None if tp is None else (lambda name, t: shard_weight(name, t, tp))
    if is_gguf(model_path):
        from pagedllm.weights import load_gguf_state_dict

        metadata, state = load_gguf_state_dict(
            model_path, device="cpu", dtype=torch.float32, select=select
        )
        config = ModelConfig.from_gguf_metadata(metadata, source=str(model_path))
        # A GGUF with no output.weight ties the LM head to the embeddings.
        config = dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in state)
    else:
        from pagedllm.weights import load_safetensors_dir

        config = ModelConfig.from_hf_dir(model_path)
        state = load_safetensors_dir(model_path, device="cpu", select=select)
    model = build_model(
        config,
        state,
        dev,
        dt,
        source=str(model_path),
        max_model_len=max_model_len,
        tp=tp,
        sharded=tp is not None,
        # HF's Gemma norms multiply by (1 + w); llama.cpp's converter added the 1.
        norm_offset=1.0 if config.family == "gemma3" and not is_gguf(model_path) else 0.0,
    )
    model.source_path = model_path
    return model


def check_load_format(model_path: Path, load_format: str) -> None:
    """ValueError unless `load_format` can load `model_path` (a resolved path):
    "auto" reads anything; "dummy" takes its shape from an HF directory."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r}: choose 'auto' or 'dummy'")
    if load_format == "dummy" and not model_path.is_dir():
        raise ValueError(
            f"{model_path}: load_format 'dummy' takes its shape from an HF directory's "
            "config.json; give a directory (or a preset)"
        )


def read_model_config(path: str | Path | None = None) -> ModelConfig:
    """The config of the model at `path` (None: the default model) without reading
    its weights: config.json, or a GGUF's header. Whether the head is tied is
    decided at load time (a GGUF without output.weight ties it)."""
    model_path = resolve_model_path(path)
    if is_gguf(model_path):
        from pagedllm.gguf_metadata import read_gguf_metadata

        return ModelConfig.from_gguf_metadata(read_gguf_metadata(model_path), str(model_path))
    return ModelConfig.from_hf_dir(model_path)


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    source: str = "model",
    max_model_len: int | None = None,
    tp: TensorParallel | None = None,
    sharded: bool = False,
    norm_offset: float = 0.0,
) -> LlamaModel:
    """Check names and shapes, fuse QKV and gate/up, and move everything to device/dtype once.

    `norm_offset` is added to every RMSNorm weight (1.0 for Gemma 3 from HF files,
    whose norms compute x * (1 + w); the sum is taken in float32 before the cast).

    `state` must hold exactly the config's weights (see `check_no_unused_weights`).
    `max_model_len` bounds the RoPE table (see `load_model`). `tp`: keep only this
    rank's slice of each weight; `sharded`: `state` holds those slices already
    (each checked against its share of the config's shape).
    """
    config = _resolve_tied_head(config, state, source)
    check_no_unused_weights(config, state, source)
    c = config
    if tp is not None:
        check_divisible(c, tp.size)

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"{source}: weight {name!r} is missing")
        t = state[name]
        if sharded:
            shape = sharded_shape(name, shape, tp)
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(t.shape)}, config implies {shape}"
                + (f" (rank {tp.rank} of {tp.size}'s slice)" if sharded else "")
            )
        return t if tp is None or sharded else shard_weight(name, t, tp)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def put_matrix(t: torch.Tensor) -> Linear:
        return Linear(t.to(device=device, dtype=dtype))  # Linear picks the layout

    def norm(name: str, size: int) -> torch.Tensor:
        return put(take(name, (size,)).float() + norm_offset)

    e, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = take(p + "self_attn.q_proj.weight", (c.q_size, e))
        k = take(p + "self_attn.k_proj.weight", (c.kv_size, e))
        v = take(p + "self_attn.v_proj.weight", (c.kv_size, e))
        gate = take(p + "mlp.gate_proj.weight", (inter, e))
        up = take(p + "mlp.up_proj.weight", (inter, e))
        w = LayerWeights(
            input_norm=norm(p + "input_layernorm.weight", e),
            qkv_proj=put_matrix(torch.cat([q, k, v], dim=0)),
            o_proj=put_matrix(take(p + "self_attn.o_proj.weight", (e, c.q_size))),
            post_norm=norm(p + "post_attention_layernorm.weight", e),
            gate_up_proj=put_matrix(torch.cat([gate, up], dim=0)),
            down_proj=put_matrix(take(p + "mlp.down_proj.weight", (e, inter))),
        )
        if c.sandwich_norms:  # Gemma 3: HF's post_attention_layernorm follows attention
            w.attn_out_norm = w.post_norm
            w.post_norm = norm(p + "pre_feedforward_layernorm.weight", e)
            w.mlp_out_norm = norm(p + "post_feedforward_layernorm.weight", e)
        if c.attention_bias:
            w.qkv_bias = put(
                torch.cat(
                    [
                        take(p + "self_attn.q_proj.bias", (c.q_size,)),
                        take(p + "self_attn.k_proj.bias", (c.kv_size,)),
                        take(p + "self_attn.v_proj.bias", (c.kv_size,)),
                    ]
                )
            )
        if c.qk_norm:
            w.q_norm = norm(p + "self_attn.q_norm.weight", d)
            w.k_norm = norm(p + "self_attn.k_norm.weight", d)
        layers.append(w)
    embed = put(take("model.embed_tokens.weight", (c.vocab_size, e)))
    if c.tie_word_embeddings:
        # Tied: on the GPU the very same memory; on the CPU a transposed copy.
        lm_head = Linear(embed)
    else:
        lm_head = put_matrix(take("lm_head.weight", (c.vocab_size, e)))
    final_norm = norm("model.norm.weight", e)
    local = c if tp is None else shard_config(c, tp.size)
    return LlamaModel(local, embed, layers, final_norm, lm_head, max_positions=max_model_len, tp=tp)


def check_no_unused_weights(
    config: ModelConfig, state: dict[str, torch.Tensor], source: str = "model"
) -> None:
    """ValueError naming the tensors of `state` that a model of `config` would not use.

    Names are matched, never generated: a corrupt `num_hidden_layers` of 2**31
    must not build two billion strings."""
    unused = [n for n in state if not _is_model_weight(n, config) and not _NOT_WEIGHTS.fullmatch(n)]
    if not unused:
        return
    layers = [
        int(m.group(1))
        for n in unused
        if (m := _LAYER_WEIGHT.fullmatch(n)) and int(m.group(1)) >= config.num_hidden_layers
    ]
    if layers:
        why = (
            f"the file has layers up to {max(layers)} but the config says "
            f"num_hidden_layers={config.num_hidden_layers} (GGUF: llama.block_count); "
            "check the config against the checkpoint"
        )
    else:
        why = (
            f"a {config.family} model of this config has no such weights; check that the "
            "file and its config are of the same family"
        )
    raise ValueError(
        f"{source}: {len(unused)} tensors in the file are not used by the model: "
        f"{', '.join(map(repr, unused[:5]))}{', ...' if len(unused) > 5 else ''}: {why}"
    )


def _is_model_weight(name: str, config: ModelConfig) -> bool:
    # lm_head.weight: the head when untied, a copy of the embeddings when tied
    # (see _resolve_tied_head); either way it is accounted for.
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return True
    m = _LAYER_WEIGHT.fullmatch(name)
    return (
        m is not None
        and int(m.group(1)) < config.num_hidden_layers
        and m.group(2) in layer_weight_names(config)
    )


def _resolve_tied_head(
    config: ModelConfig, state: dict[str, torch.Tensor], source: str
) -> ModelConfig:
    """A tied config whose file also holds `lm_head.weight`: a copy is fine (transformers'
    `state_dict()` holds one); a different matrix is used untied, as transformers 5 does
    (it warns and leaves the two apart), so we run the model transformers runs."""
    head = state.get("lm_head.weight")
    embed = state.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None:
        return config
    if head.shape == embed.shape and head.dtype == embed.dtype and torch.equal(head, embed):
        return config
    warnings.warn(
        f"{source}: tie_word_embeddings is true, but lm_head.weight differs from the "
        "embeddings; using it untied, as transformers does (set tie_word_embeddings "
        "to false in config.json to silence this)",
        stacklevel=3,
    )
    return dataclasses.replace(config, tie_word_embeddings=False)


def dummy_model(
    config: ModelConfig,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    std: float = 0.02,
    tp: TensorParallel | None = None,
    source: str = "the config",
) -> LlamaModel:
    """Random weights of the config's shape, made directly on the device in the compute
    dtype (no file, no float32 detour): for speed work, where values do not matter.
    With `tp`, only this rank's slice is made (seeded by seed + rank). Their bytes are
    checked against the memory available first (`check_dummy_fits`); `source` names
    the config in that error."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_dummy_fits(config, dev, dt, tp, source)
    c = config if tp is None else shard_config(config, tp.size)
    gen = torch.Generator(device=dev).manual_seed(seed + (tp.rank if tp else 0))

    def mat(rows: int, cols: int) -> Linear:
        return Linear(torch.randn(rows, cols, generator=gen, device=dev, dtype=dt) * std)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=dev, dtype=dt)

    e, inter = c.hidden_size, c.intermediate_size
    layers = []
    for _ in range(c.num_hidden_layers):
        w = LayerWeights(
            input_norm=ones(e),
            qkv_proj=mat(c.q_size + 2 * c.kv_size, e),
            o_proj=mat(e, c.q_size),
            post_norm=ones(e),
            gate_up_proj=mat(2 * inter, e),
            down_proj=mat(e, inter),
        )
        if c.sandwich_norms:
            w.attn_out_norm, w.mlp_out_norm = ones(e), ones(e)
        if c.attention_bias:
            w.qkv_bias = torch.zeros(c.q_size + 2 * c.kv_size, device=dev, dtype=dt)
        if c.qk_norm:
            w.q_norm, w.k_norm = ones(c.head_dim), ones(c.head_dim)
        layers.append(w)
    vocab = c.vocab_size if tp is None else -(-c.vocab_size // tp.size)  # this rank's rows
    embed = torch.randn(vocab, e, generator=gen, device=dev, dtype=dt) * std
    lm_head = Linear(embed) if c.tie_word_embeddings else mat(vocab, e)
    return LlamaModel(c, embed, layers, ones(e), lm_head, tp=tp)


def dummy_weight_bytes(config: ModelConfig, dtype: torch.dtype, device_type: str) -> int:
    """Peak bytes `dummy_model` makes for `config` (one rank's, when sharded)."""
    per_layer, rest = _dummy_elements(config, device_type)
    return (config.num_hidden_layers * per_layer + rest) * dtype.itemsize


def _dummy_elements(c: ModelConfig, device_type: str) -> tuple[int, int]:
    """(elements of one layer, elements of the rest) of `dummy_model`'s weights. The
    rest: the embeddings, the head (a tied one too on the CPU, which stores it
    transposed: `Linear`), the final norm, and the largest matrix twice over while it
    is made (`randn * std`, then its stored layout)."""
    e, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    qkv = (c.q_size + 2 * c.kv_size) * e
    per_layer = 2 * e + qkv + e * c.q_size + 3 * inter * e
    head = vocab * e if not c.tie_word_embeddings or device_type == "cpu" else 0
    largest = max(vocab * e, 2 * inter * e, qkv)
    return per_layer, vocab * e + head + e + 2 * largest


def check_dummy_fits(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
    source: str = "the config",
) -> None:
    """ValueError, before anything is allocated, when dummy weights of `config` would
    take more than `memory.USABLE_FRACTION` of the memory available on `device` (on
    the CPU, every rank of a tensor-parallel engine makes its slice in this machine's
    memory). The message says how many layers of this shape would fit."""
    from pagedllm import memory

    found = memory.available_bytes(device)
    if found is None:  # no way to tell on this system: the allocation will say
        return
    available, where = found
    ranks = 1 if tp is None else tp.size
    sharing = ranks if device.type == "cpu" else 1
    c = config if tp is None else shard_config(config, tp.size)
    planned = dummy_weight_bytes(c, dtype, device.type) * sharing
    usable = memory.usable(available)
    if planned <= usable:
        return
    per_layer, rest = (n * dtype.itemsize * sharing for n in _dummy_elements(c, device.type))
    layers = (usable - rest) // per_layer if usable > rest else 0
    if layers >= 1:
        fits = f"at most {layers:,} layers of this shape fit: lower num_hidden_layers"
    else:
        fits = "not one layer of this shape fits: lower hidden_size or vocab_size"
    half = planned // dtype.itemsize * 2  # the same weights in 16 bits
    smaller = " (or give --dtype bfloat16)" if dtype.itemsize == 4 and half <= usable else ""
    each = f", {ranks} ranks" if sharing > 1 else ""
    raise ValueError(
        f"{source}: dummy weights of {config.num_hidden_layers:,} layers (hidden_size "
        f"{config.hidden_size:,}, vocab_size {config.vocab_size:,}) in "
        f"{str(dtype).removeprefix('torch.')}{each} take "
        f"{memory.over_text(planned, available, where)}; {fits}{smaller}"
    )
