"""Build a `LlamaModel` from an HF directory or a GGUF file.

Owns: choosing the device and dtype, checking that the file's weights are
exactly those the config implies (each present, with its shape, and none
left over), and fusing Q/K/V and gate/up at load time (one matmul each at run
time). Does not own: file parsing (`weights/`).

FP8 (issue 36): a checkpoint whose config.json has a `quantization_config`
(`pagedllm/quantization.py`) keeps its float8 projections: on CUDA as
`Fp8Linear`s (Q/K/V and gate/up fused with their scales, `weights/fp8.py`),
on the CPU dequantized into the model's dtype (plain `Linear`s, so that every
test and a machine without a GPU can run one). `quantization="fp8"`
(`--quantization fp8`) quantizes a float checkpoint's projections the same
way as they load, one scale per output channel (on the CPU: rounded through
FP8 and back into the model's dtype, the numbers the GPU would multiply). The
embeddings, norms and LM head always stay in the model's dtype, as in vLLM.

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
from pagedllm.engine_config import QUANTIZATIONS
from pagedllm.memory import release_freed_memory
from pagedllm.model.cpu_packed import (
    Fp16Table,
    PackedEmbedding,
    PackedLinear,
    pack_head,
    pack_matrix,
    packed_kernels_available,
)
from pagedllm.model.linear import Fp8Linear, Linear
from pagedllm.model.llama import LayerWeights, LlamaModel
from pagedllm.model.parallel import (
    TensorParallel,
    check_divisible,
    shard_config,
    shard_weight,
    sharded_shape,
)
from pagedllm.resolve import is_gguf, resolve_model_path
from pagedllm.weights.fp8 import (
    RANDOM_CHUNK,
    Fp8Weight,
    fuse_fp8,
    quantize,
    random_fp8,
    take_fp8_weights,
)
from pagedllm.weights.gguf_blocks import GgufBlocks

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
    quantization: str = "none",
) -> LlamaModel:
    """Load a Llama-family model; `path=None` means the default SmolLM2 GGUF.

    `tp`: load only this rank's slice of each weight (see `model/parallel.py`).
    `load_format="dummy"`: no weights are read; `path` is an HF directory whose
    config.json gives the shape, and the weights are random (`dummy_model`).
    `quantization`: "none" (the weights as the checkpoint stores them: an FP8
    checkpoint's stay FP8 on CUDA) or "fp8" (a float checkpoint's projections
    are quantized as they load; see the module docstring and `build_model`).

    On the CPU with `dtype` None, a GGUF's quantized projections, embeddings and
    head stay packed (`keep_gguf_packed`, `model/cpu_packed.py`); `dtype="float32"`
    dequantizes them (the exact path the tests compare with).

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
    check_quantization(quantization)
    if load_format == "dummy":
        config = ModelConfig.from_hf_dir(model_path)
        source = str(model_path / "config.json")
        return dummy_model(config, dev, dt, tp=tp, source=source, quantization=quantization)
    # A tensor-parallel rank keeps (and copies from the file) only its slices.
    select = None if tp is None else (lambda name, t: shard_weight(name, t, tp))
    if is_gguf(model_path):
        from pagedllm.weights import load_gguf_state_dict

        packed = keep_gguf_packed(dev, dtype, tp, quantization)
        metadata, state = load_gguf_state_dict(
            model_path,
            device="cpu",
            dtype=torch.float32,
            select=select,
            keep_quantized=_keep_packable if packed else None,
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
        quantization=quantization,
    )
    model.source_path = model_path
    del state  # the file's tensors (a packed model's blocks, once packed) go now, and
    release_freed_memory()  # the load's temporaries back to the kernel, not kept in the heap
    return model


def keep_gguf_packed(
    device: torch.device,
    dtype: str | torch.dtype | None,
    tp: TensorParallel | None,
    quantization: str,
) -> bool:
    """Whether a GGUF's quantized weights stay packed (`model/cpu_packed.py`): on the
    CPU, with no dtype asked for (`--dtype float32` dequantizes them: the exact
    reference path), one process, no `--quantization`, and a torch that has the
    kernels (2.6 or later)."""
    return (
        device.type == "cpu"
        and dtype is None
        and tp is None
        and quantization == "none"
        and packed_kernels_available()
    )


def _keep_packable(name: str, raw: torch.Tensor, qtype, shape: tuple) -> GgufBlocks | None:
    """A packed CPU model keeps the blocks of its projections, embeddings and head
    (`load_gguf_state_dict`'s `keep_quantized`); anything else is dequantized."""
    packable = name in ("model.embed_tokens.weight", "lm_head.weight") or (
        _LAYER_WEIGHT.fullmatch(name) is not None and name.endswith("_proj.weight")
    )
    return GgufBlocks.from_file_bytes(raw, qtype, shape) if packable and len(shape) == 2 else None


def check_quantization(quantization: str) -> None:
    """ValueError unless `quantization` is one of QUANTIZATIONS ("none", "fp8")."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {quantization!r}: choose one of {', '.join(map(repr, QUANTIZATIONS))}"
        )


def model_quantization(model: LlamaModel) -> str:
    """ "fp8" for a model whose projections are FP8 (or, on the CPU, were rounded
    through FP8 or dequantized from it): what `load_model` and `dummy_model` record;
    "none" otherwise (a model built another way)."""
    return getattr(model, "quantization", "none")


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
    quantization: str = "none",
    fp8_weights: bool | None = None,
) -> LlamaModel:
    """Check names and shapes, fuse QKV and gate/up, and move everything to device/dtype once.

    `norm_offset` is added to every RMSNorm weight (1.0 for Gemma 3 from HF files,
    whose norms compute x * (1 + w); the sum is taken in float32 before the cast).

    `state` must hold exactly the config's weights (see `check_no_unused_weights`),
    and an FP8 checkpoint's scales (`weights/fp8.py` checks them against
    `config.quantization`). `max_model_len` bounds the RoPE table (see
    `load_model`). `tp`: keep only this rank's slice of each weight; `sharded`:
    `state` holds those slices already (each checked against its share of the
    config's shape; an FP8 weight's scales are whole, and cut here).

    `quantization` "fp8": quantize the decoder layers' float projections to float8
    e4m3, one scale per output channel. `fp8_weights`: whether FP8 projections
    (the checkpoint's, or quantized) stay FP8 (`Fp8Linear`); None: on CUDA only.
    Otherwise they are dequantized into `dtype` (plain `Linear`s): an FP8
    checkpoint's as it stores them, a quantized one's rounded through FP8.
    """
    check_quantization(quantization)
    config = _resolve_tied_head(config, state, source)
    c = config
    if tp is not None:
        check_divisible(c, tp.size)
    keep_fp8 = device.type == "cuda" if fp8_weights is None else fp8_weights
    online = quantization == "fp8"

    def whole_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        # The matrix an FP8 weight's scales cover: the config's whole projection;
        # None when the weight is not the shape (or rank slice) it implies: `take` says so.
        want = _projection_shape(name, c)
        if want is None:
            return None
        return want if shape == (sharded_shape(name, want, tp) if sharded else want) else None

    state = take_fp8_weights(state, c.quantization, source, whole_shape)
    check_no_unused_weights(config, state, source)

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor | Fp8Weight:
        if name not in state:
            raise ValueError(f"{source}: weight {name!r} is missing")
        t = state[name]
        whole = shape
        if sharded:
            shape = sharded_shape(name, shape, tp)
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(t.shape)}, config implies {shape}"
                + (f" (rank {tp.rank} of {tp.size}'s slice)" if sharded else "")
            )
        if isinstance(t, Fp8Weight):
            return t if tp is None else _fp8_rank_slice(name, t, whole, tp, sharded)
        return t if tp is None or sharded else shard_weight(name, t, tp)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def put_matrix(t: torch.Tensor | Fp8Weight, name: str) -> Linear | Fp8Linear:
        if isinstance(t, Fp8Weight):  # the checkpoint's: as it is, or dequantized
            if not keep_fp8:
                return Linear(t.dequantize().to(device=device, dtype=dtype))
            w = t.compact()
            if w is None:
                raise ValueError(_cut_blocks(source, name, t, tp))
            w = w.to(device)
            return Fp8Linear(w.weight, w.scale, w.block_size)
        if not online:
            return Linear(t.to(device=device, dtype=dtype))  # Linear picks the layout
        if keep_fp8:  # quantized on the device, from the file's values
            w = quantize(t.to(device))
            return Fp8Linear(w.weight, w.scale)
        return Linear(quantize(t).dequantize().to(device=device, dtype=dtype))

    def matrix(*parts: tuple[str, tuple[int, int]]) -> Linear | Fp8Linear:
        """One projection, the parts (Q, K, V or gate, up) stacked by rows."""
        names = [n for n, _ in parts]
        ts = [take(n, shape) for n, shape in parts]
        fp8 = [isinstance(t, Fp8Weight) for t in ts]
        if any(fp8) and not all(fp8):
            raise ValueError(
                f"{source}: {names[fp8.index(True)]!r} is FP8 but {names[fp8.index(False)]!r} "
                "is not; the parts of a fused projection must be quantized alike"
            )
        if any(isinstance(t, GgufBlocks) for t in ts):  # a packed CPU model
            packed = pack_matrix(ts)
            if packed is not None:
                return packed
            ts = [t.dequantize() if isinstance(t, GgufBlocks) else t for t in ts]
        if len(ts) == 1:
            return put_matrix(ts[0], names[0])
        if not all(fp8):
            return put_matrix(torch.cat(ts, dim=0), names[0])
        if not keep_fp8:
            return Linear(torch.cat([t.dequantize() for t in ts]).to(device=device, dtype=dtype))
        compact = [t.compact() for t in ts]
        for t, w, name in zip(ts, compact, names):
            if w is None:
                raise ValueError(_cut_blocks(source, name, t, tp))
        return put_matrix(fuse_fp8(compact), names[0])

    def norm(name: str, size: int) -> torch.Tensor:
        return put(take(name, (size,)).float() + norm_offset)

    e, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = matrix(
            (p + "self_attn.q_proj.weight", (c.q_size, e)),
            (p + "self_attn.k_proj.weight", (c.kv_size, e)),
            (p + "self_attn.v_proj.weight", (c.kv_size, e)),
        )
        gate_up = matrix(
            (p + "mlp.gate_proj.weight", (inter, e)),
            (p + "mlp.up_proj.weight", (inter, e)),
        )
        w = LayerWeights(
            input_norm=norm(p + "input_layernorm.weight", e),
            qkv_proj=qkv,
            o_proj=matrix((p + "self_attn.o_proj.weight", (e, c.q_size))),
            post_norm=norm(p + "post_attention_layernorm.weight", e),
            gate_up_proj=gate_up,
            down_proj=matrix((p + "mlp.down_proj.weight", (e, inter))),
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
    embed = take("model.embed_tokens.weight", (c.vocab_size, e))
    if isinstance(embed, GgufBlocks):  # a packed CPU model (`cpu_packed.py`)
        if c.tie_word_embeddings:  # one float16 table for both
            embed = lm_head = pack_head(embed)
        else:  # the file's blocks, rows dequantized as they are looked up
            embed, lm_head = PackedEmbedding(embed), None
    else:
        embed = put(embed)
        # Tied: on the GPU the very same memory; on the CPU a transposed copy.
        lm_head = Linear(embed) if c.tie_word_embeddings else None
    if lm_head is None:  # the head stays in the model's dtype, FP8 or not
        head = take("lm_head.weight", (c.vocab_size, e))
        if isinstance(head, GgufBlocks):
            lm_head = pack_head(head)
        else:
            lm_head = Linear(head.to(device=device, dtype=dtype))
    final_norm = norm("model.norm.weight", e)
    local = c if tp is None else shard_config(c, tp.size)
    model = LlamaModel(
        local, embed, layers, final_norm, lm_head, max_positions=max_model_len, tp=tp
    )
    model.quantization = "fp8" if online or c.quantization is not None else "none"
    model.packed = any(
        isinstance(m, (PackedLinear, Fp16Table, PackedEmbedding))
        for m in [
            embed,
            lm_head,
            *(x for w in layers for x in (w.qkv_proj, w.o_proj, w.gate_up_proj, w.down_proj)),
        ]
    )
    return model


# The HF names of a decoder layer's projections -> their whole (out, in) shape.
_PROJECTION_SHAPES = {
    "self_attn.q_proj": lambda c: (c.q_size, c.hidden_size),
    "self_attn.k_proj": lambda c: (c.kv_size, c.hidden_size),
    "self_attn.v_proj": lambda c: (c.kv_size, c.hidden_size),
    "self_attn.o_proj": lambda c: (c.hidden_size, c.q_size),
    "mlp.gate_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.up_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.down_proj": lambda c: (c.hidden_size, c.intermediate_size),
}


def _projection_shape(name: str, c: ModelConfig) -> tuple[int, int] | None:
    """The (out, in) shape `c` gives the projection weight `name` (None: no such name)."""
    m = _LAYER_WEIGHT.fullmatch(name)
    if m is None or int(m.group(1)) >= c.num_hidden_layers:
        return None
    shape = _PROJECTION_SHAPES.get(m.group(2).removesuffix(".weight"))
    return None if shape is None else shape(c)


def _fp8_rank_slice(
    name: str, w: Fp8Weight, whole: tuple[int, ...], tp: TensorParallel, sharded: bool
) -> Fp8Weight:
    """This rank's part of FP8 weight `name` of `whole` shape (`w` is that part already
    when `sharded`), with the whole matrix's scales and its place in it."""
    rows, cols = sharded_shape(name, whole, tp)
    weight = w.weight if sharded else shard_weight(name, w.weight, tp)
    r0 = tp.rank * rows if rows != whole[0] else 0
    c0 = tp.rank * cols if cols != whole[1] else 0
    return Fp8Weight(weight, w.scale, w.block_size, (r0, c0), (whole[0], whole[1]))


def _cut_blocks(source: str, name: str, w: Fp8Weight, tp: TensorParallel | None) -> str:
    b0, b1 = w.block_size
    size = "" if tp is None else f" {tp.size}"
    return (
        f"{source}: tensor parallelism{size} cuts the {b0}x{b1} scale blocks of FP8 weight "
        f"{name!r} ({w.whole[0]} x {w.whole[1]}: rank slices of {w.shape[0]} x {w.shape[1]}); "
        "choose a tensor_parallel_size whose slices are whole blocks"
    )


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
    quantization: str = "none",
    fp8_weights: bool | None = None,
) -> LlamaModel:
    """Random weights of the config's shape, made directly on the device in the compute
    dtype (no file, no float32 detour): for speed work, where values do not matter.
    With `tp`, only this rank's slice is made (seeded by seed + rank). Their bytes are
    checked against the memory available first (`check_dummy_fits`); `source` names
    the config in that error.

    `quantization` "fp8" (or a config with a `quantization_config`: an FP8
    checkpoint's): the decoder layers' projections are made as float8 e4m3 directly,
    one scale per output channel (`random_fp8`: never a 16-bit copy of a matrix), so
    that Llama 3.1 70B fits one 141 GB GPU; embeddings, norms and LM head stay in
    `dtype`. Only where FP8 weights run (`fp8_weights`, as in `build_model`: None is
    CUDA only); elsewhere the projections are random in `dtype` as usual."""
    check_quantization(quantization)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    wants_fp8 = quantization == "fp8" or config.quantization is not None
    fp8 = wants_fp8 and (dev.type == "cuda" if fp8_weights is None else fp8_weights)
    check_dummy_fits(config, dev, dt, tp, source, fp8=fp8)
    c = config if tp is None else shard_config(config, tp.size)
    gen = torch.Generator(device=dev).manual_seed(seed + (tp.rank if tp else 0))

    def dense(rows: int, cols: int) -> Linear:
        return Linear(torch.randn(rows, cols, generator=gen, device=dev, dtype=dt) * std)

    def mat(rows: int, cols: int) -> Linear | Fp8Linear:
        if not fp8:
            return dense(rows, cols)
        w = random_fp8(rows, cols, std, gen, dev)
        return Fp8Linear(w.weight, w.scale)

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
    lm_head = Linear(embed) if c.tie_word_embeddings else dense(vocab, e)
    model = LlamaModel(c, embed, layers, ones(e), lm_head, tp=tp)
    model.quantization = "fp8" if wants_fp8 else "none"
    return model


def dummy_weight_bytes(
    config: ModelConfig, dtype: torch.dtype, device_type: str, fp8: bool = False
) -> int:
    """Peak bytes `dummy_model` makes for `config` (one rank's, when sharded); `fp8`:
    with FP8 projections (one byte a value and a float32 scale a row)."""
    per_layer, rest = _dummy_bytes(config, dtype, device_type, fp8)
    return config.num_hidden_layers * per_layer + rest


def _dummy_bytes(
    c: ModelConfig, dtype: torch.dtype, device_type: str, fp8: bool = False
) -> tuple[int, int]:
    """(bytes of one layer, bytes of the rest) of `dummy_model`'s weights. The rest:
    the embeddings, the head (a tied one too on the CPU, which stores it transposed:
    `Linear`), the final norm, and what is made on the way: the largest 16/32-bit
    matrix twice over (`randn * std`, then its stored layout), and with FP8 one
    chunk of `random_fp8` (drawn in bfloat16, then cast)."""
    e, inter, vocab, size = c.hidden_size, c.intermediate_size, c.vocab_size, dtype.itemsize
    qkv_rows = c.q_size + 2 * c.kv_size
    matrices = [(qkv_rows, e), (e, c.q_size), (2 * inter, e), (e, inter)]
    if fp8:
        # float8 values and a float32 scale per row; the two norms in `dtype`
        per_layer = sum(rows * cols + 4 * rows for rows, cols in matrices) + 2 * e * size
        chunk = max(RANDOM_CHUNK, max(cols for _, cols in matrices)) * 3  # bf16 draw + cast
        made = max(2 * vocab * e * size, chunk)
    else:
        per_layer = (sum(rows * cols for rows, cols in matrices) + 2 * e) * size
        made = 2 * max(vocab * e, 2 * inter * e, qkv_rows * e) * size
    head = vocab * e if not c.tie_word_embeddings or device_type == "cpu" else 0
    return per_layer, (vocab * e + head + e) * size + made


def check_dummy_fits(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
    source: str = "the config",
    fp8: bool = False,
) -> None:
    """ValueError, before anything is allocated, when dummy weights of `config` would
    take more than `memory.USABLE_FRACTION` of the memory available on `device` (on
    the CPU, every rank of a tensor-parallel engine makes its slice in this machine's
    memory). The message says how many layers of this shape would fit (and whether
    FP8 projections, `fp8`, or 16-bit ones would)."""
    from pagedllm import memory

    found = memory.available_bytes(device)
    if found is None:  # no way to tell on this system: the allocation will say
        return
    available, where = found
    ranks = 1 if tp is None else tp.size
    sharing = ranks if device.type == "cpu" else 1
    c = config if tp is None else shard_config(config, tp.size)
    planned = dummy_weight_bytes(c, dtype, device.type, fp8) * sharing
    usable = memory.usable(available)
    if planned <= usable:
        return
    per_layer, rest = (n * sharing for n in _dummy_bytes(c, dtype, device.type, fp8))
    layers = (usable - rest) // per_layer if usable > rest else 0
    if layers >= 1:
        fits = f"at most {layers:,} layers of this shape fit: lower num_hidden_layers"
    else:
        fits = "not one layer of this shape fits: lower hidden_size or vocab_size"
    if dtype.itemsize == 4 and dummy_weight_bytes(c, torch.bfloat16, device.type, fp8) <= usable:
        smaller = " (or give --dtype bfloat16)"
    elif not fp8 and device.type == "cuda" and dummy_weight_bytes(c, dtype, "cuda", True) <= usable:
        smaller = " (or give --quantization fp8)"
    else:
        smaller = ""
    each = f", {ranks} ranks" if sharing > 1 else ""
    kind = str(dtype).removeprefix("torch.")
    if fp8:
        kind = f"float8 e4m3 (embeddings and LM head in {kind})"
    raise ValueError(
        f"{source}: dummy weights of {config.num_hidden_layers:,} layers (hidden_size "
        f"{config.hidden_size:,}, vocab_size {config.vocab_size:,}) in "
        f"{kind}{each} take "
        f"{memory.over_text(planned, available, where)}; {fits}{smaller}"
    )


def holds_fp8_weights(model: LlamaModel) -> bool:
    """Whether the model's projections are held in FP8 (`Fp8Linear`s: on CUDA; the
    CPU holds an FP8 model's dequantized)."""
    return any(
        isinstance(m, Fp8Linear)
        for layer in model.layers
        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    )


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of the model's weights on its device (one rank's, under tensor
    parallelism): every matrix, norm, bias and embedding table once (a tied LM head
    that shares the embeddings' memory counts once), FP8 projections at one byte a
    value plus their float32 scales, a packed CPU model's as packed (`cpu_packed.py`).
    `--stats` and `/metrics` report it."""
    tensors = [model.embed_tokens, model.norm]
    matrices = [model.lm_head]
    for layer in model.layers:
        matrices += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
        tensors += [
            layer.input_norm,
            layer.post_norm,
            layer.qkv_bias,
            layer.q_norm,
            layer.k_norm,
            layer.attn_out_norm,
            layer.mlp_out_norm,
        ]
    for m in matrices:
        if isinstance(m, Fp8Linear):
            tensors += [m.qweight, m.scale]
        elif isinstance(m, PackedLinear):
            tensors += list(m.tensors.values())
        elif isinstance(m, Fp16Table):  # a tied one is the embeddings: counted once
            tensors.append(m)
        else:
            tensors.append(m.stored)
    seen: set[int] = set()
    total = 0
    for t in tensors:
        # Gemma's attn_out_norm is the post_norm tensor of the file: once.
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
