"""Model configuration: one frozen dataclass, read from `config.json` or GGUF metadata.

Owns: the numbers that give a Llama-family model its shape (layers, heads, RoPE,
special token ids), and checking them. Does not own: weights (`weights/`),
tokenizer files (`tokenizer/`) or engine knobs (`EngineConfig` in `engine/`).

Invariants: counts are positive ints (an integral float such as 64.0 is
accepted; a bool, a string, null or 2.5 is not); `num_attention_heads %
num_key_value_heads == 0`; `head_dim` is even; `rope_theta` is finite and
positive, `rms_norm_eps` finite and non-negative; `tie_word_embeddings` is a
bool; `max_position_embeddings` is at most `MAX_POSITIONS`; `eos_token_ids`
holds every id that ends a turn (Llama 3 Instruct has three); token ids are
in [0, vocab_size) (a GGUF's id past them is dropped, as llama.cpp does). A
value that breaks them is a `ValueError` naming the key (and the file, when
read from one). Anything we do not support (another architecture, another RoPE type) is
refused by name. `quantization_config` (FP8 checkpoints) is read by `quantization.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from pagedllm.quantization import QuantizationConfig, parse_quantization_config

# The families one engine runs (docs/architecture.md, "One engine, five families"):
# each differs from Llama in a few switches of `ModelConfig`.
HF_ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
HF_MODEL_TYPE_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
SUPPORTED_HF_ARCHITECTURES = tuple(HF_ARCHITECTURE_FAMILIES)
# Mistral's GGUF files say "llama" (same tensors; llama.cpp keeps no sliding window).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh")
# Gemma 3's GGUF holds the window but not which layers use it, nor their RoPE base:
# llama.cpp's defaults (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer is global,
# the others windowed with RoPE base 10,000.
GEMMA3_GGUF_SLIDING_PATTERN = 6
GEMMA3_GGUF_LOCAL_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# More positions than any released model declares (Llama 4 Scout: 10M < 2**24); a
# larger number is a corrupt file, and would make position-sized tables enormous.
MAX_POSITIONS = 2**26


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Sampling defaults shipped with the model (generation_config.json), if any.
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    # How this family's decoder differs from Llama's; the defaults are Llama's.
    family: str = "llama"  # one of FAMILIES
    attention_bias: bool = False  # q, k and v projections add a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # RMSNorm on attention's and the MLP's outputs too (Gemma 3)
    hidden_act: str = "silu"  # the MLP gate: silu (SwiGLU) or gelu_tanh (GeGLU: Gemma 3)
    embedding_scale: float = 1.0  # embeddings times this (Gemma 3: sqrt(hidden_size))
    query_scale: float | None = None  # attention's scale; None: head_dim ** -0.5
    # Per layer: 0 = attends to every earlier position, W > 0 = to the last W only
    # (Mistral, Gemma 3's local layers). Empty: no windows.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the windowed layers (Gemma 3)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # How the checkpoint stores its weights (config.json's quantization_config: FP8
    # formats, `quantization.py`); None: in a float dtype, as every GGUF we read.
    quantization: QuantizationConfig | None = None

    def __post_init__(self) -> None:
        """The last line of defence, for configs built in code: every field checked.

        `from_hf_dict` and `from_gguf_metadata` check each value as they read it,
        naming the file's own key; this catches whatever reaches the constructor
        another way."""
        where = "model config"
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            _as_int(getattr(self, name), name, where)
        _as_int(self.max_position_embeddings, "max_position_embeddings", where, 1, MAX_POSITIONS)
        _as_float(self.rope_theta, "rope_theta", where, positive=True)
        _as_float(self.rms_norm_eps, "rms_norm_eps", where, positive=False)
        _as_bool(self.tie_word_embeddings, "tie_word_embeddings", where)
        _check_heads(self.num_attention_heads, self.num_key_value_heads, self.head_dim, where)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            _fail(where, "rope_scaling", self.rope_scaling, "a RopeScaling or None")
        if self.bos_token_id is not None:
            _as_int(self.bos_token_id, "bos_token_id", where, 0, self.vocab_size - 1)
        for token_id in self.eos_token_ids:
            _as_int(token_id, "eos_token_ids", where, 0, self.vocab_size - 1)
        if self.family not in FAMILIES:
            _fail(where, "family", self.family, f"one of {', '.join(FAMILIES)}")
        if self.hidden_act not in ACTIVATIONS:
            _fail(where, "hidden_act", self.hidden_act, f"one of {', '.join(ACTIVATIONS)}")
        for name in ("attention_bias", "qk_norm", "sandwich_norms"):
            _as_bool(getattr(self, name), name, where)
        _as_float(self.embedding_scale, "embedding_scale", where, positive=True)
        for name in ("query_scale", "local_rope_theta", "final_logit_softcap"):
            if getattr(self, name) is not None:
                _as_float(getattr(self, name), name, where, positive=True)
        if self.layer_windows:
            if len(self.layer_windows) != self.num_hidden_layers:
                _fail(
                    where,
                    "layer_windows",
                    self.layer_windows,
                    f"one window per layer ({self.num_hidden_layers})",
                )
            for w in self.layer_windows:
                _as_int(w, "layer_windows", where, minimum=0)
        if self.quantization is not None and not isinstance(self.quantization, QuantizationConfig):
            _fail(where, "quantization", self.quantization, "a QuantizationConfig or None")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window: 0 = none (full causal attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * itemsize

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path}: no config.json (expected a Hugging Face model directory)")
        cfg = _read_json(cfg_path)
        gen = None
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            gen = _read_json(gen_path)
        return cls.from_hf_dict(cfg, gen, source=str(cfg_path))

    @classmethod
    def from_hf_dict(
        cls,
        cfg: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        source: str = "config",
    ) -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: the config is a {type(cfg).__name__}, expected an object")
        archs = cfg.get("architectures")
        if archs is not None and (
            not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)
        ):
            _fail(source, "architectures", archs, 'a list of names such as ["LlamaForCausalLM"]')
        archs = archs or []
        model_type = cfg.get("model_type")
        known = [HF_ARCHITECTURE_FAMILIES[a] for a in archs if a in HF_ARCHITECTURE_FAMILIES]
        if archs and not known:
            hint = ""
            if any(a.startswith("Gemma3ForConditionalGeneration") for a in archs):
                hint = " (Gemma 3's multimodal checkpoint: pagedllm runs the text model only)"
            raise ValueError(
                f"{source}: architecture {archs} is not supported; "
                f"pagedllm runs {', '.join(SUPPORTED_HF_ARCHITECTURES)}{hint}"
            )
        if not archs and model_type not in HF_MODEL_TYPE_FAMILIES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; pagedllm runs "
                f"{', '.join(map(repr, HF_MODEL_TYPE_FAMILIES))}"
            )
        family = known[0] if known else HF_MODEL_TYPE_FAMILIES[model_type]
        gemma = family == "gemma3"
        # Qwen2's q/k/v projections always carry a bias (o_proj none); the other
        # families' `attention_bias` would put one on o_proj too, which we do not run.
        if _as_bool(cfg.get("attention_bias", False), "attention_bias", source):
            raise ValueError(
                f"{source}: attention_bias=true is not supported for {family} "
                "(only Qwen2's q/k/v biases are)"
            )
        if _as_bool(cfg.get("mlp_bias", False), "mlp_bias", source):
            raise ValueError(f"{source}: mlp_bias=true is not supported (no family we run has it)")
        act_key = "hidden_activation" if gemma and "hidden_activation" in cfg else "hidden_act"
        act = _HF_ACTIVATIONS.get(cfg.get(act_key, "silu"))
        if act is None or (act != "silu" and not gemma):
            raise ValueError(
                f"{source}: {act_key} {cfg.get(act_key)!r} is not supported; "
                + ("'gelu_pytorch_tanh' for Gemma 3" if gemma else "only 'silu'")
            )
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"{source}: attn_logit_softcapping is not supported (Gemma 2 has it; Gemma 3 not)"
            )

        def required(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"{source}: missing required key {key!r}")
            return cfg[key]

        def optional(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        hidden = _as_int(required("hidden_size"), "hidden_size", source)
        heads = _as_int(required("num_attention_heads"), "num_attention_heads", source)
        kv_heads = _as_int(optional("num_key_value_heads", heads), "num_key_value_heads", source)
        if cfg.get("head_dim") is None:
            head_dim = _implied_head_dim(
                hidden, heads, "hidden_size", "num_attention_heads", source
            )
        else:
            head_dim = _as_int(cfg["head_dim"], "head_dim", source)
        _check_heads(heads, kv_heads, head_dim, source)

        # transformers >= 5 writes `rope_parameters` (with rope_theta inside);
        # older files write `rope_scaling`. Accept both.
        for key in ("rope_scaling", "rope_parameters"):
            if cfg.get(key) is not None and not isinstance(cfg[key], dict):
                _fail(source, key, cfg[key], "an object or null")
        rope_parameters = cfg.get("rope_parameters") or {}
        local_rope = None
        if gemma and isinstance(rope_parameters.get("full_attention"), dict):
            # transformers 5 writes Gemma 3's two RoPEs apart, by layer type.
            local_rope = rope_parameters.get("sliding_attention") or {}
            rope_parameters = rope_parameters["full_attention"]
        rope_scaling = _parse_rope_scaling(cfg.get("rope_scaling") or rope_parameters, source)
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 moves theta into rope_parameters
            rope_theta = rope_parameters.get("rope_theta", 10000.0)
        local_theta = None
        if gemma:
            if local_rope is not None:
                _parse_rope_scaling(local_rope, source)  # refuses what we cannot run
                local_theta = local_rope.get("rope_theta", 10000.0)
            else:
                local_theta = cfg.get("rope_local_base_freq", 10000.0)
            local_theta = _as_float(local_theta, "rope_local_base_freq", source, positive=True)

        # A token id names a row of the embeddings: one past them (10**12, say) is a
        # corrupt file, and would index past the logits when EOS is masked.
        vocab = _as_int(required("vocab_size"), "vocab_size", source)
        num_layers = _as_int(required("num_hidden_layers"), "num_hidden_layers", source)
        eos = _id_list(cfg.get("eos_token_id"), "eos_token_id", source, vocab)
        bos = cfg.get("bos_token_id")
        bos_key = "bos_token_id"
        gen_defaults: dict[str, Any] = {}
        if generation_config is not None:
            if not isinstance(generation_config, dict):
                raise ValueError(
                    f"{source}: generation_config is a {type(generation_config).__name__}, "
                    "expected an object"
                )
            gen_eos = generation_config.get("eos_token_id")
            eos = _merge_ids(
                eos, _id_list(gen_eos, "generation_config eos_token_id", source, vocab)
            )
            if bos is None:
                bos = generation_config.get("bos_token_id")
                bos_key = "generation_config bos_token_id"
            for key in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "do_sample",
            ):
                if key in generation_config:
                    gen_defaults[key] = generation_config[key]
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_as_int(required("intermediate_size"), "intermediate_size", source),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_as_float(
                cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source, positive=False
            ),
            rope_theta=_as_float(rope_theta, "rope_theta", source, positive=True),
            rope_scaling=rope_scaling,
            tie_word_embeddings=_as_bool(
                cfg.get("tie_word_embeddings", False), "tie_word_embeddings", source
            ),
            max_position_embeddings=_as_int(
                cfg.get("max_position_embeddings", 2048),
                "max_position_embeddings",
                source,
                1,
                MAX_POSITIONS,
            ),
            bos_token_id=None if bos is None else _as_token_id(bos, bos_key, source, vocab),
            eos_token_ids=tuple(eos),
            generation_defaults=tuple(sorted(gen_defaults.items())),
            family=family,
            attention_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "gemma3"),
            sandwich_norms=gemma,
            hidden_act=act,
            embedding_scale=hidden**0.5 if gemma else 1.0,
            query_scale=(
                _as_float(
                    optional("query_pre_attn_scalar", head_dim),
                    "query_pre_attn_scalar",
                    source,
                    positive=True,
                )
                ** -0.5
                if gemma
                else None
            ),
            layer_windows=_hf_layer_windows(cfg, family, num_layers, source),
            local_rope_theta=local_theta,
            final_logit_softcap=(
                None
                if cfg.get("final_logit_softcapping") is None
                else _as_float(
                    cfg["final_logit_softcapping"], "final_logit_softcapping", source, positive=True
                )
            ),
            quantization=parse_quantization_config(cfg.get("quantization_config"), source),
        )

    # ---------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], source: str = "gguf") -> ModelConfig:
        """Build from GGUF key/value metadata (plain Python values).

        Errors name the GGUF key (`llama.rope.freq_base`, not `rope_theta`)."""
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(
                f"{source}: GGUF architecture {arch!r} is not supported; "
                f"pagedllm runs {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = ...) -> Any:
            full = f"{arch}.{key}"
            if full in md:
                return md[full]
            if default is ...:
                raise ValueError(f"{source}: GGUF metadata lacks required key {full!r}")
            return default

        def count(key: str, default: Any = ..., maximum: int | None = None) -> int:
            return _as_int(get(key, default), f"{arch}.{key}", source, 1, maximum)

        def number(key: str, default: float, positive: bool) -> float:
            return _as_float(get(key, default), f"{arch}.{key}", source, positive=positive)

        hidden = count("embedding_length")
        heads = count("attention.head_count")
        kv_heads = count("attention.head_count_kv", heads)
        if f"{arch}.attention.key_length" in md:
            head_dim = count("attention.key_length")
        else:
            head_dim = _implied_head_dim(
                hidden, heads, f"{arch}.embedding_length", f"{arch}.attention.head_count", source
            )
        _check_heads(
            heads,
            kv_heads,
            head_dim,
            source,
            (
                f"{arch}.attention.head_count",
                f"{arch}.attention.head_count_kv",
                f"{arch}.attention.key_length",
            ),
        )
        for key in ("attention.value_length", "rope.dimension_count"):
            if get(key, head_dim) != head_dim:
                raise ValueError(
                    f"{source}: {arch}.{key} is {get(key)!r} but the head dimension is "
                    f"{head_dim}; pagedllm supports only equal K/V head sizes and full RoPE"
                )
        vocab = _gguf_vocab_size(md, arch, source)

        rope_scaling = None
        scaling_type = get("rope.scaling.type", None)
        if scaling_type not in (None, "none", "llama3"):
            raise ValueError(
                f"{source}: rope scaling type {scaling_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        factor = get("rope.scaling.factor", None)
        if factor is not None:
            factor = number("rope.scaling.factor", 1.0, positive=True)
        if scaling_type == "llama3" or (factor is not None and factor != 1.0):
            rope_scaling = RopeScaling(
                factor=factor if factor is not None else 8.0,
                low_freq_factor=number("rope.scaling.low_freq_factor", 1.0, positive=True),
                high_freq_factor=number("rope.scaling.high_freq_factor", 4.0, positive=True),
                original_max_position_embeddings=count(
                    "rope.scaling.original_context_length", 8192, MAX_POSITIONS
                ),
            )
        eos = _id_list(md.get("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id", source)
        eot = md.get("tokenizer.ggml.eot_token_id")
        eos = _merge_ids(eos, _id_list(eot, "tokenizer.ggml.eot_token_id", source))
        gemma = arch == "gemma3"
        layers = count("block_count")
        windows: tuple[int, ...] = ()
        if gemma:
            # A Gemma chat turn ends with <end_of_turn>, which the GGUF does not name
            # as EOS or EOT (HF's generation_config.json lists both, 1 and 106).
            tokens = md.get("tokenizer.ggml.tokens")
            if isinstance(tokens, list) and "<end_of_turn>" in tokens:
                eos = _merge_ids(eos, [tokens.index("<end_of_turn>")])
            window = get("attention.sliding_window", None)
            if window is not None:
                window = _as_int(window, f"{arch}.attention.sliding_window", source)
                pattern = GEMMA3_GGUF_SLIDING_PATTERN
                windows = tuple(0 if (i + 1) % pattern == 0 else window for i in range(layers))
            if rope_scaling is not None:
                raise ValueError(
                    f"{source}: Gemma 3 with RoPE scaling (the 4B-27B models' global layers) "
                    "is not supported yet"
                )
        # An id past the vocabulary is ignored, as llama.cpp (and our GGUF tokenizer) do.
        eos = [i for i in eos if i < vocab]
        bos = md.get("tokenizer.ggml.bos_token_id")
        if bos is not None and _as_int(bos, "tokenizer.ggml.bos_token_id", source, 0) >= vocab:
            bos = None
        # GGUF files from HF conversion have no output.weight when embeddings are tied;
        # the loader decides (it sees the tensor list). Default: tied.
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=count("feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5, positive=False),
            rope_theta=number("rope.freq_base", 10000.0, positive=True),
            rope_scaling=rope_scaling,
            tie_word_embeddings=True,
            max_position_embeddings=count("context_length", 2048, MAX_POSITIONS),
            bos_token_id=None
            if bos is None
            else _as_int(bos, "tokenizer.ggml.bos_token_id", source, minimum=0),
            eos_token_ids=tuple(eos),
            family=arch if arch != "llama" else "llama",
            attention_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            sandwich_norms=gemma,
            hidden_act="gelu_tanh" if gemma else "silu",
            embedding_scale=hidden**0.5 if gemma else 1.0,
            # llama.cpp's Gemma 3 scale: 1/sqrt(head size), but 1/sqrt(hidden/heads) for
            # the 27B model (62 layers), whose query_pre_attn_scalar is hidden/heads.
            query_scale=(
                (hidden // heads if layers == 62 else head_dim) ** -0.5 if gemma else None
            ),
            layer_windows=windows if any(windows) else (),
            local_rope_theta=GEMMA3_GGUF_LOCAL_ROPE_THETA if gemma else None,
        )


# ----- checking values ------------------------------------------------------------------------


def _fail(source: str, key: str, value: Any, expected: str) -> NoReturn:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ValueError(f"{source}: {key} is {shown}, expected {expected}")


def _as_int(value: Any, key: str, source: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number in [minimum, maximum]: an int or an integral float (64.0), never a
    bool, a string, null or 2.5."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(source, key, value, "an integer")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            _fail(source, key, value, "an integer")
        value = int(value)
    if value < minimum:
        _fail(source, key, value, f"an integer >= {minimum}")
    if maximum is not None and value > maximum:
        hint = ""
        if maximum == MAX_POSITIONS:
            hint = " (pagedllm refuses more than 2**26 positions: no model has that many)"
        _fail(source, key, value, f"at most {maximum}{hint}")
    return value


def _as_float(value: Any, key: str, source: str, positive: bool) -> float:
    """A finite number, > 0 when `positive`, else >= 0 (never NaN, inf, a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(source, key, value, "a number")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        _fail(source, key, value, "a finite number " + ("> 0" if positive else ">= 0"))
    return value


def _as_bool(value: Any, key: str, source: str) -> bool:
    if not isinstance(value, bool):
        _fail(source, key, value, "true or false")
    return value


def _implied_head_dim(hidden: int, heads: int, hidden_key: str, heads_key: str, source: str) -> int:
    """hidden // heads when the file gives no head size; it must divide exactly."""
    if hidden % heads != 0:
        raise ValueError(
            f"{source}: {hidden_key} {hidden} is not divisible by {heads_key} {heads}, and "
            "no head size is given (head_dim / attention.key_length)"
        )
    return hidden // heads


def _check_heads(
    heads: int,
    kv_heads: int,
    head_dim: int,
    source: str,
    keys: tuple[str, str, str] = ("num_attention_heads", "num_key_value_heads", "head_dim"),
) -> None:
    """Grouped-query attention needs whole groups; RoPE needs an even head size.

    `keys` names the three values as the file spells them."""
    heads_key, kv_key, dim_key = keys
    if heads % kv_heads != 0:
        raise ValueError(
            f"{source}: {heads_key} ({heads}) must be a multiple of {kv_key} ({kv_heads})"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"{source}: {dim_key} {head_dim} is odd; RoPE rotates pairs of dimensions")


def _gguf_vocab_size(md: dict[str, Any], arch: str, source: str) -> int:
    """`{arch}.vocab_size`, else the length of `tokenizer.ggml.tokens`."""
    if f"{arch}.vocab_size" in md:
        return _as_int(md[f"{arch}.vocab_size"], f"{arch}.vocab_size", source)
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(
            f"{source}: GGUF metadata has neither {arch + '.vocab_size'!r} nor "
            "'tokenizer.ggml.tokens', so the vocabulary size is unknown"
        )
    if not isinstance(tokens, list) or not tokens:
        _fail(source, "tokenizer.ggml.tokens", tokens, "a non-empty array of strings")
    return len(tokens)


_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _hf_layer_windows(cfg: dict[str, Any], family: str, num_layers: int, source: str) -> tuple:
    """Each layer's sliding window (0: none) from an HF config, as transformers reads it:
    `layer_types` when the file has them (transformers 5 writes them); otherwise
    Mistral windows every layer when `sliding_window` is set, Qwen2/3 the layers from
    `max_window_layers` on when `use_sliding_window` is true, and Gemma 3 all but every
    `sliding_window_pattern`-th (6) layer."""
    window = cfg.get("sliding_window")
    if family == "llama" or window is None:
        return ()
    window = _as_int(window, "sliding_window", source)
    if family in ("qwen2", "qwen3") and not _as_bool(
        cfg.get("use_sliding_window", False), "use_sliding_window", source
    ):
        return ()
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            _fail(source, "layer_types", types, f"a list of {num_layers} layer types")
        for t in types:
            if t not in ("full_attention", "sliding_attention"):
                _fail(source, "layer_types", t, "'full_attention' or 'sliding_attention'")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif family == "mistral":
        windows = (window,) * num_layers
    elif family == "gemma3":
        pattern = _as_int(
            cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)),
            "sliding_window_pattern",
            source,
        )
        windows = tuple(0 if (i + 1) % pattern == 0 else window for i in range(num_layers))
    else:
        first = _as_int(cfg.get("max_window_layers", 0), "max_window_layers", source, minimum=0)
        windows = tuple(window if i >= first else 0 for i in range(num_layers))
    return windows if any(windows) else ()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _parse_rope_scaling(rs: dict[str, Any] | None, source: str) -> RopeScaling | None:
    if not rs:
        return None
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if key not in rs:
            raise ValueError(f"{source}: rope_scaling of type llama3 lacks {key!r}")
    return RopeScaling(
        factor=_as_float(rs["factor"], "rope_scaling.factor", source, positive=True),
        low_freq_factor=_as_float(
            rs["low_freq_factor"], "rope_scaling.low_freq_factor", source, positive=True
        ),
        high_freq_factor=_as_float(
            rs["high_freq_factor"], "rope_scaling.high_freq_factor", source, positive=True
        ),
        original_max_position_embeddings=_as_int(
            rs["original_max_position_embeddings"],
            "rope_scaling.original_max_position_embeddings",
            source,
            1,
            MAX_POSITIONS,
        ),
    )


def _as_token_id(value: Any, key: str, source: str, vocab_size: int | None) -> int:
    """A token id: a non-negative integer, below `vocab_size` when given."""
    token_id = _as_int(value, key, source, minimum=0)
    if vocab_size is not None and token_id >= vocab_size:
        _fail(source, key, value, f"a token id below vocab_size ({vocab_size})")
    return token_id


def _id_list(value: Any, key: str, source: str, vocab_size: int | None = None) -> list[int]:
    """A token id or a list of them (null: none), each a non-negative integer (below
    `vocab_size` when given)."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [_as_token_id(v, key, source, vocab_size) for v in values]


def _merge_ids(a: list[int], b: list[int]) -> list[int]:
    out = list(a)
    for v in b:
        if v not in out:
            out.append(v)
    return out
