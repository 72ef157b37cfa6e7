"""Model configuration: one frozen dataclass, read from `config.json` or GGUF metadata.

Owns: the numbers that give a Llama-family model its shape (layers, heads, RoPE,
special token ids). Does not own: weights (`weights/`), tokenizer files
(`tokenizer/`) or engine knobs (`EngineConfig` in `engine/`).

Invariants: `num_attention_heads % num_key_value_heads == 0`; `eos_token_ids`
holds every id that ends a turn (Llama 3 Instruct has three). Anything we do
not support (another architecture, another RoPE type) is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")


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

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"model config: {name} must be positive, got {getattr(self, name)}"
                )

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
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
        gen = None
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{gen_path}: not valid JSON ({e})") from e
        return cls.from_hf_dict(cfg, gen, source=str(cfg_path))

    @classmethod
    def from_hf_dict(
        cls,
        cfg: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        source: str = "config",
    ) -> ModelConfig:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if archs and not any(a in SUPPORTED_HF_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{source}: architecture {archs} is not supported; "
                f"pagedllm runs {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
        if not archs and model_type != "llama":
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; pagedllm runs 'llama'"
            )
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"{source}: {key}=true is not supported (Llama has no biases)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported; only 'silu'")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            # transformers >= 5 writes `rope_parameters` (with rope_theta inside);
            # older files write `rope_scaling`. Accept both.
            rope_scaling = _parse_rope_scaling(
                cfg.get("rope_scaling") or cfg.get("rope_parameters"), source
            )
            rope_theta = cfg.get("rope_theta")
            if rope_theta is None:  # transformers 5 moves theta into rope_parameters
                rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            eos = _id_list(cfg.get("eos_token_id"))
            bos = cfg.get("bos_token_id")
            gen_defaults: dict[str, Any] = {}
            if generation_config:
                eos = _merge_ids(eos, _id_list(generation_config.get("eos_token_id")))
                if bos is None:
                    bos = generation_config.get("bos_token_id")
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
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                bos_token_id=None if bos is None else int(bos),
                eos_token_ids=tuple(eos),
                generation_defaults=tuple(sorted(gen_defaults.items())),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r}") from e

    # ---------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], source: str = "gguf") -> ModelConfig:
        """Build from GGUF key/value metadata (plain Python values)."""
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

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = int(get("attention.head_count_kv", heads))
        head_dim = int(get("attention.key_length", hidden // heads))
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = int(get("vocab_size", len(tokens) if tokens is not None else 0))
        rope_scaling = None
        scaling_type = get("rope.scaling.type", None)
        if scaling_type not in (None, "none", "llama3"):
            raise ValueError(
                f"{source}: rope scaling type {scaling_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        factor = get("rope.scaling.factor", None)
        if scaling_type == "llama3" or (factor is not None and float(factor) != 1.0):
            rope_scaling = RopeScaling(
                factor=float(factor if factor is not None else 8.0),
                low_freq_factor=float(get("rope.scaling.low_freq_factor", 1.0)),
                high_freq_factor=float(get("rope.scaling.high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    get("rope.scaling.original_context_length", 8192)
                ),
            )
        eos = _id_list(md.get("tokenizer.ggml.eos_token_id"))
        eot = md.get("tokenizer.ggml.eot_token_id")
        eos = _merge_ids(eos, _id_list(eot))
        bos = md.get("tokenizer.ggml.bos_token_id")
        # GGUF files from HF conversion have no output.weight when embeddings are tied;
        # the loader decides (it sees the tensor list). Default: tied.
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=True,
            max_position_embeddings=int(get("context_length", 2048)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
        )


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
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"{source}: rope_scaling of type llama3 lacks {e.args[0]!r}") from e


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _merge_ids(a: list[int], b: list[int]) -> list[int]:
    out = list(a)
    for v in b:
        if v not in out:
            out.append(v)
    return out
